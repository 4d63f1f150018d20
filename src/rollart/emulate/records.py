"""What the emulated components drew and did, in this process, for the critical-path ideal.

Every emulated engine, env and trainer backend appends here (one process: the benchmark runs
the actors in-process). Keys are stable across runs of the same workload (task seeds, turn
numbers), so two modes of one workload can be compared draw for draw.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Records:
    gen: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    """session (traj_id) -> per request, in order: ``model_s`` (admission to last token, at
    the batch it ran in), ``queue_s`` (modelled wait for a batch slot), ``prefill_tokens``,
    ``tokens``, ``batch_mean``."""
    env: dict[int, dict] = field(default_factory=dict)
    """task seed -> ``reset_s`` (modelled, the successful reset), ``reset_failures``,
    ``steps_s`` (modelled, per step), ``turns`` (planned), ``reward``."""
    train: list[dict] = field(default_factory=list)
    """per training step: ``model_s``, ``tokens``, ``samples``, ``version``."""
    publish: list[dict] = field(default_factory=list)
    """per published version: ``model_s``, ``version``."""
    loads: list[dict] = field(default_factory=list)
    """per engine weight load: ``model_s``, ``version``."""
    reward: dict[str, dict] = field(default_factory=dict)
    """``<run>/<traj_id>`` -> its emulated reward pass: ``model_s`` (the pass), ``queue_s`` (modelled wait
    for it), ``batch``."""
    trained: dict[str, tuple[int, int]] = field(default_factory=dict)
    """traj_id -> ``(seed, turns)`` of each trajectory the emulated trainer trained."""
    crossings: list[dict] = field(default_factory=list)
    """per version fetched across an emulated site link (:mod:`rollart.emulate.link`):
    ``version``, ``mode``, ``wire_bytes``, ``wall_s``, ``model_s``, ``engine``."""

    def clear(self) -> None:
        self.gen.clear()
        self.env.clear()
        self.train.clear()
        self.publish.clear()
        self.loads.clear()
        self.reward.clear()
        self.trained.clear()
        self.crossings.clear()


RECORDS = Records()
"""This process's records (cleared by the benchmark between measurements)."""
