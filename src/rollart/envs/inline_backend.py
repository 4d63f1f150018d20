"""The inline backend of :class:`~rollart.envs.runner.EnvRunner` (``executor: inline``).

A sync env's calls run on the event loop itself: no thread hand-off and no wake-up of the
loop from another thread per call, which for an env whose step takes microseconds (the
built-in FrozenLake and Sokoban) is most of what a step costs (``benchmarks/cpu_per_turn.py``).
Nothing can interrupt a call: a step that hangs hangs the EnvManager's loop (and its node's
heartbeats, so ``rollart run`` takes a child for stuck). A call slower than
:data:`SLOW_CALL_S` is reported once per env type: use ``executor: thread`` for such an env.
An async env is awaited on the loop, as with ``thread``.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable

from rollart.envs.base import legal_actions_of

log = logging.getLogger(__name__)

SLOW_CALL_S = 0.005
"""A sync call that takes longer holds the event loop long enough to say so (once per type)."""
_warned: set[str] = set()


class InlineBackend:
    """One env built by ``factory`` and called on the event loop (``name``: its type)."""

    def __init__(self, factory: Callable[[], Any], name: str) -> None:
        self._factory, self._name = factory, name
        self.env: Any = None
        self.dead = False

    def _timed(self, fn: Callable[[], Any], what: str) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            took = time.perf_counter() - t0
            if took > SLOW_CALL_S and self._name not in _warned:
                _warned.add(self._name)
                log.warning("env %s: %s took %.1f ms on the event loop (executor: inline); "
                            "an env this slow belongs on executor: thread", self._name, what,
                            1e3 * took)

    async def start(self) -> str:
        self.env = self._factory()  # construction is not timed: it happens once per env
        return getattr(self.env, "instruction", None) or ""

    async def call(self, method: str, arg: Any) -> tuple[Any, list[str] | None]:
        fn = getattr(self.env, method)
        if inspect.iscoroutinefunction(fn):
            res = await fn(arg)
            return res, legal_actions_of(self.env)
        return self._timed(lambda: (fn(arg), legal_actions_of(self.env)), method)

    async def close(self, healthy: bool) -> None:
        fn = getattr(self.env, "close", None)
        if healthy and fn is not None:
            if inspect.iscoroutinefunction(fn):
                await fn()
            else:
                self._timed(fn, "close")

    def kill(self) -> None:
        """Nothing to kill: a call on the loop has returned by the time anyone could."""
