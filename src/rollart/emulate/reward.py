"""An emulated reward model (a generative judge on a GPU) behind the real RewardService.

``actors.reward.type: rollart.emulate.reward:EmulatedRewardService`` with
``actors.reward.args.emulate: {device: judge-0, pass_s: 1.0, per_item_s: 0.02,
max_batch: 64, time_scale: 0.05}`` and an env whose ``scorer`` is ``emulated``:

- a :class:`RewardDevice` runs batched passes: a pass over ``n`` queued requests costs
  ``pass_s + per_item_s * n`` modelled seconds (a judge's decode is paid once per pass, its
  prefill per item); requests that arrive during a pass wait for the next one;
- ``device`` names the device: every RewardService in this process that names the same
  device shares it (a serverless reward pool serving several jobs); without it each replica
  has its own (a dedicated reward GPU);
- the score is the env's own outcome (``success`` in the request's metadata), so the reward
  is what the emulated env drew; what each request waited and cost is recorded in
  :data:`rollart.emulate.records.RECORDS` (``reward``), and each device keeps its busy time
  for the utilisation.

Never used by the default path (``benchmarks/emulate.py e4``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rollart import messages as m
from rollart.actors.reward.actor import RewardService
from rollart.emulate.profiles import time_scale as _time_scale
from rollart.emulate.records import RECORDS

__all__ = ["DEVICES", "EmulatedRewardService", "RewardDevice"]

SCORER = "emulated"


class RewardDevice:
    """One emulated reward GPU (module docstring). Its loop task is owned by the device and
    runs while at least one service holds it (:meth:`acquire` / :meth:`release`)."""

    def __init__(self, name: str, *, pass_s: float = 1.0, per_item_s: float = 0.02,
                 max_batch: int = 64, time_scale: float | None = None) -> None:
        if pass_s < 0 or per_item_s < 0 or max_batch < 1:
            raise ValueError("pass_s and per_item_s must be >= 0, max_batch >= 1")
        self.name = name
        self.pass_s, self.per_item_s, self.max_batch = float(pass_s), float(per_item_s), int(max_batch)
        self.scale = _time_scale(time_scale)
        self._queue: list[tuple[str, float, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._holders = 0
        self.busy_wall_s = 0.0
        self.busy_model_s = 0.0
        self.passes = 0
        self.items = 0
        self.intervals: list[tuple[float, float]] = []
        """Wall (monotonic) start and end of every pass, for utilisation over any window."""

    def acquire(self) -> None:
        self._holders += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"reward-device-{self.name}")

    async def release(self) -> None:
        self._holders -= 1
        if self._holders <= 0 and self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            for _, _, fut in self._queue:
                if not fut.done():
                    fut.set_exception(RuntimeError(f"reward device {self.name} stopped"))
            self._queue.clear()

    async def score(self, key: str) -> None:
        """Wait for the pass that scores request ``key`` (the trajectory id: what it waited
        and cost is recorded under it)."""
        if self._task is None:
            raise RuntimeError(f"reward device {self.name} is not running (no service holds it)")
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((key, time.monotonic(), fut))
        self._wake.set()
        await fut

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            dur = self.pass_s + self.per_item_s * len(batch)
            t0 = time.monotonic()
            await asyncio.sleep(dur * self.scale)
            t1 = time.monotonic()
            self.intervals.append((t0, t1))
            self.busy_wall_s += t1 - t0
            self.busy_model_s += dur
            self.passes += 1
            self.items += len(batch)
            for key, queued, fut in batch:
                RECORDS.reward[key] = {"model_s": dur, "queue_s": (t0 - queued) / self.scale
                                       if self.scale else 0.0, "batch": len(batch)}
                if not fut.done():
                    fut.set_result(None)

    def busy_between(self, start: float, end: float) -> float:
        """Wall seconds this device was in a pass between ``start`` and ``end``."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.intervals)

    def stats(self) -> dict[str, float]:
        return {"passes": float(self.passes), "items": float(self.items),
                "busy_model_s": self.busy_model_s, "busy_wall_s": self.busy_wall_s,
                "mean_batch": self.items / self.passes if self.passes else 0.0}


DEVICES: dict[str, RewardDevice] = {}
"""This process's emulated reward devices by name (the benchmark clears it between runs)."""


@dataclass(kw_only=True, eq=False)
class EmulatedRewardService(RewardService):
    """The real :class:`RewardService` whose ``emulated`` scorer waits for a pass of an
    emulated reward device (module docstring); other scorers are the real ones."""

    emulate: dict[str, Any] = field(default_factory=dict)
    _device: RewardDevice | None = field(default=None, init=False, repr=False)

    async def setup(self) -> None:
        await super().setup()
        kw = dict(self.emulate)
        name = str(kw.pop("device", None) or self.name)
        dev = DEVICES.get(name)
        if dev is None:
            dev = DEVICES[name] = RewardDevice(name, **kw)
        dev.acquire()
        self._device = dev

    async def teardown(self) -> None:
        try:
            if self._device is not None:
                await self._device.release()
        finally:
            await super().teardown()

    async def _score(self, req: m.RewardRequest) -> m.RewardResult:
        if req.scorer != SCORER:
            return await super()._score(req)
        assert self._device is not None
        await self._device.score(f"{self.run}/{req.traj_id}")  # runs share a device
        score = 1.0 if req.metadata.get("success") == "True" else 0.0
        return m.RewardResult(score=score, replica=self.name)
