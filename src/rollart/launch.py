"""In-process deployments: the actor sets behind ``rollart rollout`` and ``rollart run``."""

from __future__ import annotations

import msgspec

from rollart.actors.base import Actor
from rollart.config import ActorConfig, RunConfig


def _role(cfg: RunConfig, role: str) -> ActorConfig:
    return cfg.actors.get(role, ActorConfig())


def rollout_actors(cfg: RunConfig, *, groups: int | None, bounded: bool = True,
                   keep_results: bool = False, greedy: bool = False, eval: bool = False,
                   env: str | None = None, pool: str = "default",
                   prefix: str = "g") -> tuple[Actor, list[Actor]]:
    """Scheduler, EnvManager, LLMProxy replicas and RewardService replicas for one host."""
    from rollart.actors.env_manager import EnvManager
    from rollart.actors.llm_proxy import LLMProxy
    from rollart.actors.reward import RewardService
    from rollart.actors.scheduler import RolloutScheduler

    sched = RolloutScheduler.from_config(cfg, _role(cfg, "scheduler"), pool=pool)
    if prefix != "g":  # a second scheduler on the same run reads every outcome itself
        sched.name = f"scheduler-{prefix.strip('-')}"
        sched.settings = {h: {"durable": f"{sched.name}-{h}".replace("_", "-")}
                          for h in ("on_completed", "on_cancelled", "on_dead")}
    sched.total_groups, sched.bounded, sched.keep_results = groups, bounded, keep_results
    sched.greedy, sched.eval, sched.env, sched.prefix = greedy, eval, env, prefix
    if eval:
        sched.seed_offset = 1_000_000  # held-out tasks: training seeds start at rollout.seed
    actors: list[Actor] = [sched, EnvManager.from_config(cfg, _role(cfg, "env"), pool=pool)]
    for i in range(cfg.proxy.replicas):
        actors.append(LLMProxy.from_config(cfg, _role(cfg, "generate"), pool=pool, index=i))
    for i in range(cfg.reward.replicas):
        actors.append(RewardService.from_config(cfg, _role(cfg, "reward"), pool=pool, index=i))
    return sched, actors


def with_overrides(cfg: RunConfig, **sections) -> RunConfig:
    """``cfg`` with some sections' fields replaced: ``with_overrides(cfg, rollout={...})``."""
    out = cfg
    for name, values in sections.items():
        if name in ("run", "nats", "run_dir"):
            out = msgspec.structs.replace(out, **{name: values})
        else:
            out = msgspec.structs.replace(out, **{name: msgspec.structs.replace(getattr(out, name), **values)})
    return out


def training_actors(cfg: RunConfig, *, resume: bool = False, pool: str = "default"):
    """Everything ``rollart run`` hosts in one process: rollout actors plus the Trainer."""
    from rollart.actors.trainer import Trainer

    sched, actors = rollout_actors(cfg, groups=None, bounded=True, pool=pool)
    sched.resume = resume
    trainer = Trainer.from_config(cfg, _role(cfg, "trainer"), pool=pool)
    trainer.resume = resume
    return sched, trainer, actors + [trainer]
