"""What can go wrong with a sandbox, by whose fault it is.

:class:`SandboxError` is an *infrastructure* failure: the sandbox could not start, its
supervisor died or stopped answering, the host refused. It is never the policy's doing, so
it is never scored: an env raises it out of ``reset``/``step`` and the trajectory is tried
again with a fresh sandbox (it subclasses ``ConnectionError``, which the env runner treats as
transient). What the model's code does (crash, time out, hit a limit) is not an error at all:
it is a :class:`~rollart.sandbox.core.Result` with its exit code and ``limit``.
"""

from __future__ import annotations


class SandboxError(ConnectionError):
    """The sandbox itself failed (infrastructure, not the model's code): try another."""


class SandboxUnavailable(SandboxError):
    """No sandbox can be made on this host: the backend is missing or refused (the text says
    which, and how to install it). Retrying here will not help."""


class SandboxRequestError(ValueError):
    """The caller asked for something the sandbox refuses (a path outside the workspace, a
    file too large): a bug in the env or agent, raised at once, never retried."""
