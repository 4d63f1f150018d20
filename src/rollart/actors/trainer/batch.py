"""From completed trajectories to the trainer's samples, loss settings and step statistics."""

from __future__ import annotations

from typing import Any

from rollart import messages as m
from rollart.engines.choice_trie import allowed_after


def allowed_per_token(t: m.RolloutCompleted) -> list[list[int] | None] | None:
    """The constrained-decoding token sets of every generated token (None: free)."""
    if not any(turn.choices for turn in t.turns):
        return None
    allowed: list[list[int] | None] = [None] * len(t.token_ids)
    for turn in t.turns:
        if not turn.choices:
            continue
        resp = t.token_ids[turn.start: turn.start + turn.response_len]
        for k in range(len(resp)):
            allowed[turn.start + k] = allowed_after(turn.choices, resp[:k])
    return allowed


def advantages(rewards: list[float], groups: list[int], kind: str) -> list[float]:
    import torch  # optional: the train extra

    from rollart.algos import advantages as adv  # optional: imports torch (the train extra)

    r = torch.tensor(rewards, dtype=torch.float32)
    if kind == "grpo":
        a = adv.grpo_advantages(r, groups, std_normalize=True)
    elif kind == "drgrpo":
        a = adv.grpo_advantages(r, groups, std_normalize=False)
    elif kind == "rloo":
        a = adv.rloo_advantages(r, groups)
    elif kind == "reinforce_pp":
        a = adv.reinforce_pp_advantages(r, groups)
    else:
        raise ValueError(f"unknown advantage {kind!r}")
    return [float(x) for x in a]


def build_samples(trajs: list[m.RolloutCompleted], groups: list[int], kind: str) -> list:
    from rollart.engines.train_samples import TrainSample  # optional: imports torch

    advs = advantages([t.reward for t in trajs], groups, kind)
    return [TrainSample(token_ids=list(t.token_ids), response_mask=list(t.response_mask),
                        behav_logprobs=list(t.logprobs), advantage=a, allowed=allowed_per_token(t))
            for t, a in zip(trajs, advs)]


def loss_config(t: Any, entropy_coef: float | None = None, advance_schedule: bool = True):
    """The loss settings of trainer config ``t``; ``entropy_coef``: this step's coefficient
    (``trainer.entropy_target`` adapts it), else the config's; ``advance_schedule``: whether
    the step moves the LR schedule (:func:`advances_schedule`)."""
    from rollart.algos.losses import LossConfig  # optional: imports torch (the train extra)

    coef = t.entropy_coef if entropy_coef is None else entropy_coef
    return LossConfig(clip_low=t.clip_low, clip_high=t.clip_high, agg=t.agg, is_cap=t.is_cap,
                      decoupled=t.decoupled, entropy_coef=coef, kl_coef=t.kl_coef,
                      advance_schedule=advance_schedule)


def advances_schedule(t: Any, trajs: list[m.RolloutCompleted], samples: list) -> bool:
    """Whether a step on ``samples`` (built from ``trajs``) moves the LR schedule under
    trainer config ``t``'s ``schedule_clock``: ``signal`` holds it on a step in which every
    trajectory failed and every advantage is 0; ``steps`` always moves it."""
    if getattr(t, "schedule_clock", "steps") != "signal":
        return True
    return any(s.advantage != 0 for s in samples) or any(tr.success for tr in trajs)


def next_entropy_coef(t: Any, coef: float, entropy: float | None) -> float:
    """The coefficient after a step with coefficient ``coef`` whose mean entropy was
    ``entropy`` (``trainer.entropy_target``; without one, or without a measured entropy,
    ``coef`` unchanged)."""
    if t.entropy_target is None or entropy is None or entropy != entropy:  # NaN: no evidence
        return coef
    moved = coef + (t.entropy_coef_step if entropy < t.entropy_target else -t.entropy_coef_step)
    return min(t.entropy_coef_max, max(0.0, moved))


def trajectory_stats(trajs: list[m.RolloutCompleted], version: int) -> dict[str, float]:
    n = len(trajs) or 1
    stages = ("reset", "generate", "step", "reward", "wait")
    out = {
        "reward": sum(t.reward for t in trajs) / n,
        "success": sum(t.success for t in trajs) / n,
        "turns": sum(len(t.turns) for t in trajs) / n,
        "ctx_tokens": float(sum(len(t.token_ids) for t in trajs)),
        "gen_tokens": float(sum(sum(t.response_mask) for t in trajs)),
        "staleness": sum(version - t.min_version for t in trajs) / n,
        "max_staleness": float(max((version - t.min_version for t in trajs), default=0)),
        "stopped_max_time": float(sum(t.stop_reason == "max_time" for t in trajs)),
    }
    out.update({f"traj_{s}_s": sum(t.timings.get(s, 0.0) for t in trajs) / n for s in stages})
    return out
