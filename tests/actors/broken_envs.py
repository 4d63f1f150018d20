"""Envs that break the env contract, deterministically (imported by path from config)."""

from __future__ import annotations

from rollart.envs.frozenlake import FrozenLakeEnv


class CtorFails(FrozenLakeEnv):
    """The constructor raises (e.g. a missing licence file): the env can never be built."""

    def __init__(self, **kw):
        raise RuntimeError("no licence for this simulator")


class ShortStep(FrozenLakeEnv):
    """step() returns the old gym 4-tuple."""

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        return obs, reward, term or trunc, info


class ObsOnlyReset(FrozenLakeEnv):
    """reset() returns the observation alone."""

    def reset(self, seed):
        return super().reset(seed)[0]


class WordReward(FrozenLakeEnv):
    """step() returns a reward that is not a number."""

    def step(self, action):
        obs, _, term, trunc, info = super().step(action)
        return obs, "high", term, trunc, info


class SandboxAway(FrozenLakeEnv):
    """The constructor cannot reach its sandbox: a transient construction failure."""

    def __init__(self, **kw):
        raise ConnectionError("sandbox pool unreachable")


class Straggler:
    """Never ends; every step takes ``step_s`` (just under step_timeout: never an error)."""

    instruction = "straggle"

    def __init__(self, step_s: float = 0.4) -> None:
        self.step_s = step_s

    def reset(self, seed):
        return f"task {seed}", {}

    def step(self, action):
        import time

        time.sleep(self.step_s)
        return f"did {action}", 0.25, False, False, {}

    def legal_actions(self):
        return ["a", "b"]
