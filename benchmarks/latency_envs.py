"""FrozenLake with injected env-step latency, for ``benchmarks/rollout_modes.py``.

Each ``step`` takes ``max(0, N(mu, sigma) * unit)`` seconds on top of the (instant) game
logic, the way the paper injects latency into env interaction. The draws come from an RNG
seeded by the reset seed, so trajectory ``seed`` sees the same latency at its ``k``-th step
in every run and in both rollout modes (``latency:{seed}``, one draw per step in order).
``reset`` has no latency.

Two flavours with the same draws:

- :class:`LatencyLake` (sync): ``time.sleep`` in ``step``. rollart runs a sync env on a
  dedicated daemon thread of its ``EnvRunner`` (one thread per trajectory, not a shared
  pool), so 32 trajectories sleeping at once do not queue behind each other; this is how a
  CPU-side simulator or a blocking client behaves.
- :class:`AsyncLatencyLake` (async): ``await asyncio.sleep`` in ``async def step``, run on
  the event loop; this is how a remote env (a container reached over the network) behaves.

Use them (with ``benchmarks/`` on the import path) as ``type: "latency_envs:LatencyLake"`` with
``args: {mu: 10, sigma: 5, unit: 0.01, ...}`` (any other args go to ``FrozenLakeEnv``).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from rollart.envs.frozenlake import FrozenLakeEnv


class LatencyLake(FrozenLakeEnv):
    """FrozenLake whose every step takes ``max(0, N(mu, sigma)) * unit`` seconds.

    Args:
        mu: mean latency in ``unit`` (default 10).
        sigma: standard deviation in ``unit`` (default 1).
        unit: seconds per unit (default 0.01, i.e. 10 ms).
        **kwargs: passed to :class:`rollart.envs.frozenlake.FrozenLakeEnv`.
    """

    def __init__(self, *, mu: float = 10.0, sigma: float = 1.0, unit: float = 0.01,
                 **kwargs: Any) -> None:
        if mu < 0 or sigma < 0 or unit <= 0:
            raise ValueError(f"latency args need mu >= 0, sigma >= 0, unit > 0; got "
                             f"mu={mu!r}, sigma={sigma!r}, unit={unit!r}")
        super().__init__(**kwargs)
        self.mu, self.sigma, self.unit = float(mu), float(sigma), float(unit)
        self._lat_rng = random.Random("latency:0")
        self.latencies: list[float] = []
        """Seconds drawn for each step of the current episode."""

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._lat_rng = random.Random(f"latency:{seed}")
        self.latencies = []
        return super().reset(seed)

    def draw(self) -> float:
        """The next step's latency in seconds (and remember it)."""
        s = max(0.0, self._lat_rng.gauss(self.mu, self.sigma)) * self.unit
        self.latencies.append(s)
        return s

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        delay = self.draw()
        if delay:
            time.sleep(delay)
        obs, reward, term, trunc, info = super().step(action)
        return obs, reward, term, trunc, {**info, "latency_s": delay}


class AsyncLatencyLake(LatencyLake):
    """:class:`LatencyLake` whose ``step`` is a coroutine that ``asyncio.sleep``s."""

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        delay = self.draw()
        if delay:
            await asyncio.sleep(delay)
        obs, reward, term, trunc, info = FrozenLakeEnv.step(self, action)
        return obs, reward, term, trunc, {**info, "latency_s": delay}
