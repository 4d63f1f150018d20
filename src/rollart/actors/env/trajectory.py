"""One trajectory of an :class:`~rollart.actors.env.manager.EnvManager`, piece by piece.

The EnvManager runs the turn loop; this module holds what the loop works on and the steps
that need nothing of the actor but its name and counters:

- :class:`Trace`: the token-level record as it grows (prompt and response ids, mask,
  logprobs, versions, turns, timings) and the ``rollout.completed`` it ends as.
- :class:`RunningTrajectories`: the trajectories running on one EnvManager, each with its
  group and the event that cancels it.
- :class:`Deliveries`: which trajectories run here or recently ended with their outcome
  stored, so that another delivery of one is answered with that outcome, not run again.
- :func:`reset_runner`: a fresh env reset with the request's seed, retried on fresh envs.
- :func:`unless_cancelled` and :func:`reward_request`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollart import messages as m
from rollart.actors.kernel.base import Reject
from rollart.actors.kernel.sandboxes import sandbox_failure
from rollart.aio import first_of, retry, settle
from rollart.envs import EnvError, EnvRunner, parse_action
from rollart.envs.runner import EnvContractError, EnvSetupError

log = logging.getLogger(__name__)


class Cancelled(Exception):
    """The trajectory's group no longer needs it."""


class SandboxFailed(Exception):
    """A reset failed because a sandbox did (its cause): not an env failure, not retried
    on a fresh env here; the EnvManager counts it and has the request delivered again."""


@dataclass
class Trace:
    """The token-level record of one trajectory as it grows."""

    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[m.TurnRecord] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("reset", "generate", "step", "reward", "wait"), 0.0))

    def add_prompt(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_response(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.token_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs)
        self.versions += [version] * len(ids)

    def completed(self, req: m.RolloutRequested, *, reward: float, success: bool, stop: str,
                  attempt: int, version: int) -> m.RolloutCompleted:
        """The finished trajectory; ``version`` stands for the policy version when no
        token was generated (the EnvManager's newest)."""
        versions = [v for v in self.versions if v >= 0] or [version]
        return m.RolloutCompleted(
            traj_id=req.traj_id, group_id=req.group_id, env=req.env, seed=req.seed,
            index_in_group=req.index_in_group, token_ids=self.token_ids, response_mask=self.mask,
            logprobs=self.logprobs, token_versions=self.versions, turns=self.turns,
            min_version=min(versions), max_version=max(versions), reward=reward, success=success,
            stop_reason=stop, timings=self.timings, eval=req.eval,
            attempt=attempt, finished_at=time.time(),
            group_index=req.group_index, admitted_version=req.admitted_version)


class CancelEvent(asyncio.Event):
    """A trajectory's cancel event. Besides waking its waiters, :meth:`set` resolves the
    futures :func:`unless_cancelled` registered, so a turn waits on one future instead of a
    task running ``wait()`` raced against the call (a task, a wait and a settle per turn)."""

    def __init__(self) -> None:
        super().__init__()
        self.watchers: set[asyncio.Future] = set()

    def set(self) -> None:
        super().set()
        watchers, self.watchers = self.watchers, set()
        for fut in watchers:
            if not fut.done():
                fut.set_result(None)


class RunningTrajectories:
    """The trajectories running on one EnvManager: traj_id -> its group and the event that
    tells it its group was cancelled."""

    def __init__(self) -> None:
        self._cancel: dict[str, CancelEvent] = {}
        self._group_of: dict[str, str] = {}

    def start(self, traj_id: str, group_id: str, *, cancelled: bool = False) -> CancelEvent:
        """Count ``traj_id`` as running; returns its cancel event (set at once when its
        group is already ``cancelled``)."""
        cancel = CancelEvent()
        if cancelled:
            cancel.set()
        self._cancel[traj_id] = cancel
        self._group_of[traj_id] = group_id
        return cancel

    def finish(self, traj_id: str) -> None:
        """``traj_id`` no longer runs here (idempotent)."""
        self._cancel.pop(traj_id, None)
        self._group_of.pop(traj_id, None)

    def cancel_group(self, group_id: str, keep: set[str] | frozenset[str]) -> None:
        """Tell each running trajectory of ``group_id`` but those in ``keep`` to stop."""
        for tid, ev in self._cancel.items():
            if self._group_of.get(tid) == group_id and tid not in keep:
                ev.set()

    def __len__(self) -> int:
        return len(self._cancel)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._cancel))

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._cancel


class Deliveries:
    """Trajectories running on one EnvManager, and the last ``remember`` that ended here
    with their outcome stored. JetStream delivers a request again when its ``ack_wait``
    runs out without an in_progress (a stalled host), possibly while it still runs here or
    just after it ended; run again, the trajectory would complete twice with other tokens,
    a conflict that the trainer trains neither of (a lost group member)."""

    def __init__(self, remember: int = 4096) -> None:
        self.remember = remember
        self._running: dict[str, asyncio.Future] = {}
        self._stored: OrderedDict[str, None] = OrderedDict()

    def earlier(self, traj_id: str) -> asyncio.Future | None:
        """None: run ``traj_id``. Else an earlier delivery's result, ``True`` once its
        outcome is stored (answer this one with it), ``False`` if it ended without one."""
        if (fut := self._running.get(traj_id)) is not None:
            return fut
        if traj_id in self._stored:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(True)
            return fut
        return None

    def begin(self, traj_id: str) -> None:
        self._running[traj_id] = asyncio.get_running_loop().create_future()

    def end(self, traj_id: str, stored: bool) -> None:
        self._running.pop(traj_id).set_result(stored)
        if stored:
            self._stored[traj_id] = None
            while len(self._stored) > self.remember:
                self._stored.popitem(last=False)


async def unless_cancelled(coro: Any, cancel: asyncio.Event) -> Any:
    """Await ``coro`` (a service call, which may wait minutes for a replica), but raise
    :class:`Cancelled` as soon as the group no longer needs this trajectory."""
    task = asyncio.ensure_future(coro)
    if not isinstance(cancel, CancelEvent):
        done, _ = await first_of(task, cancel.wait())
        if task in done:
            return task.result()
        raise Cancelled()
    if not cancel.is_set():
        waiter = task.get_loop().create_future()

        def wake(_: asyncio.Future) -> None:
            if not waiter.done():
                waiter.set_result(None)

        task.add_done_callback(wake)
        cancel.watchers.add(waiter)
        try:
            await waiter
        except asyncio.CancelledError:  # the caller is: so is the call, ended before it goes on
            task.remove_done_callback(wake)
            task.cancel()
            await settle([task])
            raise
        finally:
            cancel.watchers.discard(waiter)
        if task.done():  # first, as first_of: a call that ended as the cancel came counts
            return task.result()
    task.cancel()
    await settle([task])
    raise Cancelled()


async def reset_runner(req: m.RolloutRequested, cfg: Any, tr: Trace, *, name: str,
                       count: Callable[[str], None]):
    """A fresh runner reset with the request's seed: ``(runner, obs, info)``, retried on
    fresh envs ``cfg.reset_retries`` times; a permanent env error is raised at once, a
    sandbox's failure as :class:`SandboxFailed` at once, and once every attempt failed
    :class:`Reject` (``env_reset_failed:``). ``name`` is the EnvManager's (for the log),
    ``count(key)`` one of its counters."""
    async def attempt():
        runner = EnvRunner(cfg.type, cfg.args, executor=cfg.executor, timeout=cfg.step_timeout,
                           max_abandoned_threads=cfg.max_abandoned_threads)
        t0 = time.perf_counter()
        try:
            obs, info = await runner.reset(req.seed, timeout=cfg.reset_timeout)
        except (EnvSetupError, EnvContractError):  # permanent: a fresh env fails the same way
            await runner.close()
            raise
        except EnvError as e:
            tr.timings["reset"] += time.perf_counter() - t0
            await runner.close()
            if sandbox_failure(e) is not None:  # the host's, not the env's: not retried here,
                raise SandboxFailed(str(e)) from e  # the EnvManager has it delivered again
            count("reset_failures")
            raise
        tr.timings["reset"] += time.perf_counter() - t0
        return runner, obs, info

    def failed(e: BaseException, n: int) -> None:
        log.warning("%s reset attempt %d of %s failed: %s", name, n, req.traj_id, e)

    tries = cfg.reset_retries + 1
    try:
        return await retry(attempt, retry_on=EnvError, fatal=(EnvSetupError, EnvContractError),
                           what=f"{name}: reset of {req.traj_id}", attempts=tries,
                           base=0.05, cap=2.0, quiet=True, on_error=failed)
    except (EnvSetupError, EnvContractError):
        raise
    except EnvError as e:
        raise Reject(f"env_reset_failed: {tries} attempts failed; last: {e}") from None


def reward_request(req: m.RolloutRequested, cfg: Any, info: dict, text: str) -> m.RewardRequest:
    """The reward service's request for a finished trajectory: the answer parsed from the
    last response ``text`` (all of it when the env's pattern finds none), the env's
    ``answer`` and scalar info, and what rebuilds the env (seed, type, args)."""
    answer = parse_action(text, cfg.action_pattern) or text
    return m.RewardRequest(
        traj_id=req.traj_id, scorer=cfg.scorer, response=answer,
        answer=str(info.get("answer", "")),
        metadata={**{k: str(v) for k, v in info.items() if isinstance(v, (str, int, float))},
                  "seed": str(req.seed), "env_type": cfg.type,
                  "env_args": json.dumps(cfg.args, sort_keys=True)})
