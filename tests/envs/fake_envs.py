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


# -- envs for the startup check (tests/envs/test_env_check.py) ---------------------------


class RaisingCtorEnv:
    """The constructor raises."""

    instruction = "never built"

    def __init__(self, *, level: int = 1) -> None:
        raise ValueError(f"no such level {level}")

    def reset(self, seed):
        return "", {}

    def step(self, action):
        return "", 0.0, True, False, {}


class NeedsArgEnv(EchoEnv):
    """A required keyword argument."""

    def __init__(self, *, level: int, prefix: str = "") -> None:
        super().__init__(prefix=prefix)
        self.level = level


class BadResetEnv(EchoEnv):
    """reset() returns the observation alone."""

    def reset(self, seed):
        return f"obs {seed}"


class BadInfoEnv(EchoEnv):
    """reset() returns an info that is not a dict."""

    def reset(self, seed):
        return f"obs {seed}", "not a dict"


class BadStepEnv(EchoEnv):
    """step() returns a 3-tuple."""

    def step(self, action):
        return "obs", 1.0, True


class AsyncBadStepEnv(AsyncEchoEnv):
    """Async env whose step() returns a 3-tuple; it offers legal actions."""

    def legal_actions(self):
        return ["x"]

    async def step(self, action):
        await asyncio.sleep(0)
        return "obs", 1.0, True


class HangResetEnv(EchoEnv):
    """reset() blocks for a minute (the check must give up at reset_timeout)."""

    def reset(self, seed):
        time.sleep(60)
        return "late", {}


class HangStepEnv(EchoEnv):
    """step() blocks for a minute (the check must give up at step_timeout)."""

    def step(self, action):
        time.sleep(60)
        return "late", 0.0, True, False, {}


_flaky_resets = {"n": 0}


class FlakyResetEnv(EchoEnv):
    """Every other reset in a process raises (a transient failure the check retries)."""

    def reset(self, seed):
        _flaky_resets["n"] += 1
        if _flaky_resets["n"] % 2 == 1:
            raise ConnectionError("sandbox not ready")
        return super().reset(seed)


class OneInThreeEnv(EchoEnv):
    """reset() raises for every seed divisible by 3 (a broken task in a working env)."""

    def reset(self, seed):
        if seed % 3 == 0:
            raise RuntimeError(f"seed {seed} cannot be reset")
        return super().reset(seed)


class RaisingStepEnv(EchoEnv):
    """step() raises for every action."""

    def step(self, action):
        raise KeyError(action)


_flaky_ctors = {"n": 0}


class FlakyCtorEnv(EchoEnv):
    """Every other construction in a process fails to reach its sandbox (transient)."""

    def __init__(self) -> None:
        _flaky_ctors["n"] += 1
        if _flaky_ctors["n"] % 2 == 1:
            raise ConnectionError("sandbox not reachable")
        super().__init__()


HANG_RELEASE = threading.Event()
"""Set it to let every :class:`ReleasableHangStepEnv` step return."""


class ReleasableHangStepEnv(EchoEnv):
    """step() blocks until ``HANG_RELEASE`` is set (at most a minute): a test can count the
    threads of hung steps, then let them return and see them go."""

    def step(self, action):
        HANG_RELEASE.wait(60)
        return "late", 0.0, True, False, {}
