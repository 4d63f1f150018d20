"""Environments that misbehave on purpose, for rollout tests (imported by path from config)."""

from __future__ import annotations

import itertools
import random
import threading
import time

from rollart.envs.frozenlake import FrozenLakeEnv

_counter = itertools.count()
_lock = threading.Lock()


class JitterLake(FrozenLakeEnv):
    """FrozenLake whose steps take a random 0-200 ms, so group members finish apart."""

    def step(self, action):
        time.sleep(random.random() * 0.2)
        return super().step(action)


_stragglers = itertools.count()


class StragglerLake(FrozenLakeEnv):
    """FrozenLake whose every fifth episode (by a process-wide count of resets) takes 2 s a
    step: a group of five members started together has one straggler that the others
    outrun by far, whatever the host's load (a random 0-200 ms, as JitterLake, let all five
    finish before the cancel on a loaded host)."""

    def reset(self, seed):
        with _lock:
            self.straggler = next(_stragglers) % 5 == 4
        return super().reset(seed)

    def step(self, action):
        time.sleep(2.0 if self.straggler else random.random() * 0.02)
        return super().step(action)


class FlakyLake(FrozenLakeEnv):
    """30% of resets fail, deterministically: 3 of every 10 by a process-wide counter."""

    def reset(self, seed):
        with _lock:
            n = next(_counter)
        if n % 10 in (0, 3, 6):
            raise ConnectionError(f"simulated sandbox failure #{n}")
        return super().reset(seed)


class HangLake(FrozenLakeEnv):
    """The second step never returns (in time)."""

    def step(self, action):
        if self.steps >= 1:
            time.sleep(30)
        return super().step(action)


class SeedFailLake(FrozenLakeEnv):
    """Every reset of a seed divisible by 3 fails (the task itself is broken): every
    member of such a group is dead-lettered, so the group is lost."""

    def reset(self, seed):
        if seed % 3 == 0:
            raise RuntimeError(f"task {seed} cannot be set up")
        return super().reset(seed)


class BrokenStepLake(FrozenLakeEnv):
    """Resets fine, but every step raises: a systematic failure the circuit breaker stops."""

    def step(self, action):
        raise RuntimeError("the simulator crashed")
