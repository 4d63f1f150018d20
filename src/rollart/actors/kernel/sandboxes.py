"""An env host's sandboxes: who keeps the pool warm, and which failures are the sandbox's.

**The declaration.** An env class, an agent function or a scorer that runs model-written
code in :func:`rollart.sandbox.pool` says so with an attribute::

    class HumanEvalEnv:
        uses_sandbox = True          # an env class

    async def run_agent(base_url, task): ...
    run_agent.uses_sandbox = True    # an agent (or a scorer) function

An EnvManager (and a RewardService) holds the process's pool from its ``setup`` to its
``teardown`` (:func:`rollart.sandbox.pool.hold`), and keeps ``sandbox.warm`` sandboxes started
only when one of its run's envs (or scorers) declares it: a run without code tasks starts
no sandbox at all.

**The failure kind.** A :class:`~rollart.sandbox.SandboxError` (the sandbox could not start,
its supervisor died or stopped answering) is the host's failure, not the policy's nor the
env's: :func:`sandbox_failure` finds one in an exception's chain, however the env runner or
an agent wrapped it (for an env of ``executor: process`` only its text comes back). The
EnvManager counts it (``sandbox_failures``), has the request delivered again after a backoff
(to any EnvManager: a fresh sandbox, maybe another host) and dead-letters it as
``sandbox_unavailable:`` once its deliveries are spent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from rollart.actors.kernel.base import Reject, Retry
from rollart.envs.agent_type import is_agent, resolve_agent
from rollart.envs.errors import WorkerError
from rollart.envs.registry import resolve_env_class
from rollart.sandbox import SandboxError
from rollart.sandbox import stats as sandbox_pool_stats

log = logging.getLogger(__name__)

DECLARATION = "uses_sandbox"
"""The attribute (``True``) by which an env class, agent or scorer asks for warm sandboxes."""

_NAMES = ("SandboxError:", "SandboxUnavailable:")
"""How a sandbox failure reads once it crossed from a worker process (``Type: message``)."""


def declares_sandbox(obj: Any) -> bool:
    """Whether ``obj`` (an env class, an agent or scorer function, a partial of one) runs
    code in sandboxes."""
    while obj is not None:
        if getattr(obj, DECLARATION, False) is True:
            return True
        obj = getattr(obj, "func", None)  # functools.partial
    return False


def env_types_use_sandbox(types: Iterable[str]) -> list[str]:
    """The env types among ``types`` that declare sandboxes. A type that does not resolve
    here is skipped (its trajectories fail with ``env_setup:``, where the error is said)."""
    out = []
    for t in types:
        try:
            obj = resolve_agent(t) if is_agent(t) else resolve_env_class(t)
        except Exception as e:  # noqa: BLE001 - any import failure is the trajectory's to report
            log.debug("env type %s does not resolve here (%s): no sandboxes for it", t, e)
            continue
        if declares_sandbox(obj):
            out.append(t)
    return out


def sandbox_failure(e: BaseException | None) -> str | None:
    """The sandbox failure behind ``e`` (``"SandboxError: ..."``), or None when ``e`` is
    another kind of failure. Follows ``__cause__``/``__context__``; a failure from a worker
    process is known by its text."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, SandboxError):
            return f"{type(e).__name__}: {e}"
        if isinstance(e, WorkerError) and str(e).startswith(_NAMES):  # from a worker process
            return str(e)
        e = e.__cause__ or e.__context__
    return None


def heartbeat_stats(name: str, failures: int) -> dict[str, float]:
    """What an actor holding the pool adds to its node's heartbeat: this process's pool
    (``sandbox.<stat>``: start and acquire p50/p99 seconds, warm hits, cold starts, start
    failures, ready, lent) and its own ``<name>.sandbox_failures``
    (:mod:`rollart.telemetry.sandboxes` sums them)."""
    out = {f"sandbox.{k}": v for k, v in sandbox_pool_stats().items()}
    out[f"{name}.sandbox_failures"] = float(failures)
    return out


def retry_delay(delivery: int) -> float:
    """Seconds before the ``delivery``-th failed delivery is tried again: 0.5, 1, 2... 10."""
    return min(10.0, 0.5 * 2 ** max(0, delivery - 1))


def after_sandbox_failure(why: str, delivery: int, max_deliver: int, *, what: str) -> Exception:
    """What a handler raises when a sandbox failed under its ``delivery``-th delivery (of
    ``max_deliver``; ``what`` names it in the log): :class:`Retry` after
    :func:`retry_delay`, or, on the last delivery, :class:`Reject` as
    ``sandbox_unavailable:``."""
    if max_deliver > 0 and delivery >= max_deliver:
        log.error("%s failed on sandboxes on all %d deliveries; last: %s", what, delivery, why)
        return Reject(f"sandbox_unavailable: {delivery} deliveries failed on sandboxes; last: "
                      f"{why}"[:1000])
    delay = retry_delay(delivery)
    log.warning("%s: a sandbox failed (delivery %d of %d; again in %.1f s): %s", what, delivery,
                max_deliver, delay, why)
    return Retry(delay, f"sandbox failure: {why}"[:1000])
