"""Child processes that never outlive rollart: :func:`die_with_parent`."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` (or asyncio's subprocesses) that makes
    the child get ``sig`` when this process dies (Linux ``prctl(PR_SET_PDEATHSIG)``), or None
    where that does not exist. SIGTERM lets a nats-server flush its store; SIGKILL suits a
    child that must not linger. Create the child from the thread that lives as long as the
    process (the event loop's): the signal follows the thread that forked."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl
            os._exit(1)

    return preexec


def describe_exit(rc: int | None) -> str:
    """A child process's return code in words: ``signal SIGKILL``, ``status 3``, ``no status``."""
    if rc is None:
        return "no status"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"
