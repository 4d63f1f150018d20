"""Tiny envs for the runner and registry tests (importable by path in worker processes)."""

from __future__ import annotations

import asyncio
import os
import threading
import time


class EchoEnv:
    """Sync env: observation echoes the action; reports the pid and thread it runs in."""

    instruction = "echo"

    def __init__(self, *, prefix: str = "") -> None:
        self.prefix = prefix
        self.closed = False

    def reset(self, seed):
        return f"{self.prefix}{seed}", {"pid": os.getpid(), "thread": threading.get_ident()}

    def step(self, action):
        if action == "slow":
            time.sleep(0.3)
        if action == "crash":
            os._exit(3)
        if action == "timeout-error":
            raise TimeoutError("env-internal timeout")
        return f"{self.prefix}{action}", 0.5, action == "stop", False, {"success": action == "stop"}

    def legal_actions(self):
        return ["a", "stop"]

    def close(self):
        self.closed = True


class AsyncEchoEnv:
    """Async env."""

    instruction = "async echo"

    def __init__(self) -> None:
        self.loop_thread = None

    async def reset(self, seed):
        await asyncio.sleep(0)
        self.loop_thread = threading.get_ident()
        return str(seed), {}

    async def step(self, action):
        await asyncio.sleep(0)
        if action == "hang":
            await asyncio.Event().wait()
        return action, 1.0, True, False, {"success": True, "thread": threading.get_ident()}


class HangEnv:
    """step() blocks: on ``release`` (thread tests) or for a minute (process tests)."""

    instruction = "hang"

    def __init__(self, *, release: threading.Event | None = None) -> None:
        self.release = release

    def reset(self, seed):
        return str(os.getpid()), {}

    def step(self, action):
        if self.release is not None:
            self.release.wait(30)
        else:
            time.sleep(60)
        return "late", 0.0, True, False, {}


class FailingEnv:
    """reset() raises."""

    instruction = "fail"

    def reset(self, seed):
        raise ValueError(f"kaboom {seed}")

    def step(self, action):
        raise AssertionError("unreachable")


class NotAnEnv:
    def __init__(self) -> None:
        pass
