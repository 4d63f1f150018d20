"""Sandboxes for model-written code: isolated, resettable workspaces on env hosts.

::

    from rollart import sandbox

    with sandbox.start() as sb:                        # one sandbox, now (scripts, tests)
        sb.write("main.py", "print(input()[::-1])")
        r = sb.run(["python3", "main.py"], stdin="abc", timeout=5)
        r.exit_code, r.stdout, r.limit                 # 0, b"cba\\n", None

    async with sandbox.pool().session() as sb:         # in an env or agent: the host's warm pool
        r = await sb.arun("ls -la")

:mod:`~rollart.sandbox.core` (one sandbox, its wire and :class:`Result`),
:mod:`~rollart.sandbox.bwrap` and :mod:`~rollart.sandbox.container` (the backends),
:mod:`~rollart.sandbox.pool` (warm pools and the process's pool),
:mod:`~rollart.sandbox.supervisor` (what runs inside), :mod:`~rollart.sandbox.errors`
(infrastructure failures against the caller's mistakes). ``docs/design.md`` (§6, "Model-written
code") says what a sandbox can reach and which failures are whose; ``docs/code.md`` is the
user's guide.
"""

from rollart.sandbox.core import Limits, Result, Sandbox
from rollart.sandbox.errors import SandboxError, SandboxRequestError, SandboxUnavailable
from rollart.sandbox.pool import SandboxPool, configure, hold, let_go, pool, shutdown, start, stats

__all__ = ["Limits", "Result", "Sandbox", "SandboxError", "SandboxPool", "SandboxRequestError",
           "SandboxUnavailable", "configure", "hold", "let_go", "pool", "shutdown", "start", "stats"]
