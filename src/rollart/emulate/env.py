"""An emulated environment: reset and step latencies drawn from distributions, reset
failures, a drawn reward; no simulation at all.

``envs.<name>.type: rollart.emulate.env:EmulatedEnv`` with, for example::

    args: {reset_mu: 15, reset_sigma: 3, step_mu: 10, step_sigma: 5, step_dist: gauss,
           turns: [3, 6], success: 0.5, reset_fail: 0.01, time_scale: 0.01}

- ``*_dist``: ``gauss`` (``max(0, N(mu, sigma))``, the paper's injected latency) or
  ``lognormal`` (heavy-tailed, with mean ``mu`` and standard deviation ``sigma``);
  all times are modelled seconds, slept as ``x time_scale`` (``asyncio.sleep``: the env is
  ``async``, so thousands of them cost no threads);
- the draws come from an RNG seeded by the task seed (``emulated:<seed>``): trajectory
  ``seed`` sees the same reset latency, number of turns, step latencies and reward in every
  run and every rollout mode; what it drew is recorded in
  :data:`rollart.emulate.records.RECORDS` for the critical-path ideal;
- ``reset_fail``: the probability a reset try raises (after its latency); how many tries of
  trajectory ``seed`` fail, and their latencies, are drawn from the seed too (geometric), so
  both rollout modes see the same failures; the tries are counted per seed in this process
  (the EnvManager tries a fresh env ``reset_retries`` times);
- ``long_share``: the share of tasks (drawn per seed, from a stream of its own) whose
  observations have ``long_obs_words`` words instead of ``obs_words`` (long-context,
  prefill-heavy tasks beside short ones, for routing by prompt length);
- the episode ends after ``turns`` steps (an int, or ``[lo, hi]`` drawn uniformly); the last
  step's reward is 1 with probability ``success`` (per trajectory), else 0, so groups are
  mostly not uniform. Any action is accepted.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from rollart.emulate.profiles import time_scale as _time_scale
from rollart.emulate.records import RECORDS

__all__ = ["EmulatedEnv", "draw"]

DISTS = ("gauss", "lognormal", "fixed")


def draw(rng: random.Random, dist: str, mu: float, sigma: float) -> float:
    """One latency in modelled seconds (>= 0)."""
    if dist == "gauss":
        return max(0.0, rng.gauss(mu, sigma))
    if dist == "lognormal":
        if mu <= 0:
            return 0.0
        s2 = math.log(1.0 + (sigma / mu) ** 2)  # mean mu, standard deviation sigma
        return rng.lognormvariate(math.log(mu) - s2 / 2, math.sqrt(s2))
    if dist == "fixed":
        return max(0.0, mu)
    raise ValueError(f"unknown latency distribution {dist!r}: one of {', '.join(DISTS)}")


class EmulatedEnv:
    """Latency-only env (module docstring). ``obs_words``: words per observation (so that
    prompts grow as a real multi-turn context would)."""

    instruction = "Emulated environment: answer anything."

    def __init__(self, *, reset_mu: float = 0.0, reset_sigma: float = 0.0,
                 reset_dist: str = "gauss", step_mu: float = 1.0, step_sigma: float = 0.0,
                 step_dist: str = "gauss", turns: int | list[int] = 4, success: float = 0.5,
                 reset_fail: float = 0.0, obs_words: int = 8, long_share: float = 0.0,
                 long_obs_words: int = 0, time_scale: float | None = None) -> None:
        for d in (reset_dist, step_dist):
            if d not in DISTS:
                raise ValueError(f"unknown latency distribution {d!r}: one of {', '.join(DISTS)}")
        if min(reset_mu, reset_sigma, step_mu, step_sigma) < 0:
            raise ValueError("latency mu and sigma must be >= 0")
        if not (0 <= success <= 1 and 0 <= reset_fail < 1 and 0 <= long_share <= 1):
            raise ValueError("success and long_share in [0, 1], reset_fail in [0, 1)")
        lo, hi = (turns, turns) if isinstance(turns, int) else (int(turns[0]), int(turns[-1]))
        if not 1 <= lo <= hi:
            raise ValueError(f"turns must be >= 1 (lo <= hi), got {turns!r}")
        self.reset_args = (reset_dist, float(reset_mu), float(reset_sigma))
        self.step_args = (step_dist, float(step_mu), float(step_sigma))
        self.turns_range = (lo, hi)
        self.success_p, self.reset_fail = float(success), float(reset_fail)
        self.obs_words = int(obs_words)
        self.long_share, self.long_obs_words = float(long_share), int(long_obs_words)
        self.scale = _time_scale(time_scale)
        self._seed = -1
        self._turn = 0
        self._plan: dict[str, Any] = {}

    def plan(self, seed: int) -> dict[str, Any]:
        """What trajectory ``seed`` draws: reset latency, turns, step latencies, reward."""
        return plan(seed, self.reset_args, self.step_args, self.turns_range, self.success_p,
                    self.reset_fail)

    def words(self, seed: int) -> int:
        """Words per observation of task ``seed`` (``long_obs_words`` for a long task)."""
        if self.long_share and random.Random(f"emulated-long:{seed}").random() < self.long_share:
            return self.long_obs_words
        return self.obs_words

    def _obs(self, seed: int, turn: int) -> str:
        n = self.words(seed)
        words = " ".join(f"w{(seed * 7919 + turn * 104729 + i) % 997}" for i in range(n))
        return f"task {seed} turn {turn}: {words}"

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        p = self.plan(seed)
        rec = RECORDS.env.setdefault(seed, {"reset_s": p["reset_s"], "reset_failures": 0,
                                            "steps_s": p["steps_s"], "turns": p["turns"],
                                            "reward": p["reward"], "failed_reset_s": []})
        tries = rec["reset_failures"]
        if tries < len(p["failed_reset_s"]):
            lat = p["failed_reset_s"][tries]  # a failed try costs a reset too
            rec["reset_failures"] += 1
            rec["failed_reset_s"].append(lat)
            await asyncio.sleep(lat * self.scale)
            raise RuntimeError(f"emulated reset failure (seed {seed}, try {tries + 1})")
        await asyncio.sleep(p["reset_s"] * self.scale)
        self._seed, self._turn, self._plan = seed, 0, p
        return self._obs(seed, 0), {"success": False, "emulated": True}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._seed < 0 or self._turn >= self._plan["turns"]:
            raise RuntimeError("step before reset or after the episode ended")
        lat = self._plan["steps_s"][self._turn]
        await asyncio.sleep(lat * self.scale)
        self._turn += 1
        done = self._turn >= self._plan["turns"]
        reward = self._plan["reward"] if done else 0.0
        info = {"success": bool(done and reward > 0), "valid_action": True, "latency_s": lat}
        return self._obs(self._seed, self._turn), reward, done, False, info


def plan(seed: int, reset_args: tuple, step_args: tuple, turns_range: tuple[int, int],
         success: float, reset_fail: float = 0.0) -> dict[str, Any]:
    """The draws of trajectory ``seed`` (deterministic): see :meth:`EmulatedEnv.plan`."""
    rng = random.Random(f"emulated:{seed}")
    reset_s = draw(rng, *reset_args)
    turns = rng.randint(*turns_range)
    steps = [draw(rng, *step_args) for _ in range(turns)]
    reward = 1.0 if rng.random() < success else 0.0
    fails = random.Random(f"emulated-fail:{seed}")  # its own stream: the rest is as without
    failed = []
    while reset_fail and fails.random() < reset_fail and len(failed) < 64:
        failed.append(draw(fails, *reset_args))
    return {"reset_s": reset_s, "turns": turns, "steps_s": steps, "reward": reward,
            "failed_reset_s": failed}
