"""Envs and an agent that run their steps in sandboxes of the host's pool, and whose
sandboxes die under them: killed by the host mid-episode, or never starting at all."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

from rollart import sandbox
from rollart.config import SandboxConfig

_lock = threading.Lock()
_killed: dict[str, int] = {}
"""Episodes whose sandbox was killed so far, by the env's ``key`` (shared by its instances)."""


def kill(sb: sandbox.Sandbox) -> None:
    """SIGKILL a sandbox from outside, as the host would, and wait (with a deadline) until
    its process is gone: the supervisor dies with it, but not at the same instant."""
    os.kill(sb.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while sb.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sb.alive, f"sandbox {sb.pid} survived SIGKILL"


def kill_once_more(key: str, times: int) -> bool:
    """Whether this episode's sandbox dies: the first ``times`` episodes of ``key`` do."""
    with _lock:
        n = _killed.get(key, 0)
        if n >= times:
            return False
        _killed[key] = n + 1
        return True


class DyingSandboxEnv:
    """One sandbox per episode from the host's warm pool; ``step`` runs the action in it.
    The first ``dies`` episodes (of all instances with this ``key``) have their sandbox
    killed with SIGKILL from outside (the host) before their first step runs."""

    uses_sandbox = True
    instruction = "Say anything."

    def __init__(self, *, key: str, dies: int = 1) -> None:
        self.key, self.dies = key, dies
        self.sb: sandbox.Sandbox | None = None

    def reset(self, seed):
        self.sb = sandbox.pool().acquire()
        return "ready", {}

    def step(self, action):
        if kill_once_more(self.key, self.dies):
            kill(self.sb)
        r = self.sb.run(["/bin/sh", "-c", "echo ran"], timeout=10)  # SandboxError when killed
        return r.stdout.decode().strip(), 1.0, True, False, {"success": True}

    def close(self):
        if self.sb is not None:
            sandbox.pool().release(self.sb)


class NoSandboxStarts:
    """``reset`` asks for a sandbox of a backend that cannot start one (its interpreter is
    missing): the sandbox's failure, not the env's."""

    uses_sandbox = True
    instruction = "Say anything."

    def reset(self, seed):
        broken = sandbox.SandboxPool(SandboxConfig(python="/nonexistent/python3", warm=0))
        broken.acquire()  # raises SandboxError
        raise AssertionError("a sandbox started without its interpreter")

    def step(self, action):
        raise AssertionError("unreachable")


async def agent_whose_sandbox_dies(base_url: str, task: dict) -> float:
    """An agent whose sandbox is killed under its first command."""
    async with sandbox.pool().session() as sb:
        await asyncio.to_thread(kill, sb)
        await sb.arun("echo hello")  # SandboxError
    return 1.0


agent_whose_sandbox_dies.uses_sandbox = True
