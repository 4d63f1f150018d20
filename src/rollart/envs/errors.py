"""What can go wrong in an env call, as :class:`~rollart.envs.runner.EnvRunner` raises it.

:class:`EnvError` is the base (the original exception's type and message in the text);
:class:`EnvTimeout` a call past its deadline. Two subclasses are *permanent*, trying again
fails the same way: :class:`EnvSetupError` (the env cannot be built) and
:class:`EnvContractError` (reset/step returned the wrong shape or types).
:class:`WorkerError` is an exception raised inside a process-mode worker, as text.
"""

from __future__ import annotations


class EnvError(RuntimeError):
    """reset/step of an env failed, or the runner is broken. The message carries the
    original exception's type and message."""


class EnvTimeout(EnvError, TimeoutError):
    """An env call ran past its deadline; the runner is now broken."""


class EnvSetupError(EnvError):
    """The env cannot be built: unknown or unimportable type, bad args, or its constructor
    raised. Permanent: building it again fails the same way."""


class EnvContractError(EnvError):
    """The env broke the protocol: reset/step returned the wrong shape or types. Permanent."""


class WorkerError(Exception):
    """An exception inside a worker process, as ``"Type: message"``; ``transient`` is False
    for a constructor failure that would fail the same way again."""

    def __init__(self, text: str, transient: bool = True) -> None:
        super().__init__(text)
        self.transient = transient


def transient_setup(e: BaseException) -> bool:
    """A constructor failing this way (a sandbox it connects to is away) may succeed later."""
    return isinstance(e, (ConnectionError, TimeoutError))


def describe(e: BaseException) -> str:
    """``"Type: message"`` of ``e`` (a :class:`WorkerError` already is that text)."""
    return str(e) if isinstance(e, WorkerError) else f"{type(e).__name__}: {e}"
