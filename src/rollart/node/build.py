"""Actors from a config: the one place that turns a RunConfig into actor instances.

``python -m rollart.node --roles ...``, ``rollart run`` / ``rollart rollout`` (one process)
and the tests all call :func:`build_actors`; :func:`rollout_actors` and
:func:`training_actors` are the two role sets a one-process run hosts, built by it.

A role's class is ``actors.<role>.type`` when given, else the built-in one
(:data:`BUILTIN_ROLES`); a custom class of a built-in role must subclass the built-in class.
A role has ``actors.<role>.replicas`` instances, each in the pool :func:`role_pool` gives it.
Per-deployment constructor arguments (a scheduler's group count, an evaluation's seeds) are
merged over ``actors.<role>.args``: every ``from_config`` passes those to the constructor.
The role classes are imported by path when first built, so a node that hosts only envs
never imports torch (the trainer and generation need the optional ``train`` extra).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from rollart.actors.groups.admission import TRAINING_PREFIX
from rollart.actors.kernel.base import Actor
from rollart.config import ActorConfig, RunConfig
from rollart.config.placement import mapped_pools
from rollart.envs.base import HELDOUT_SEED_OFFSET

BUILTIN_ROLES = {
    "env": "rollart.actors.env.manager:EnvManager",
    "generate": "rollart.actors.generate.proxy:LLMProxy",
    "relay": "rollart.actors.generate.relay:WeightRelay",
    "reward": "rollart.actors.reward.actor:RewardService",
    "trainer": "rollart.actors.trainer.actor:Trainer",
    "scheduler": "rollart.actors.scheduler.actor:RolloutScheduler",
}

TRANSIENT_DURABLE_IDLE_S = 300.0
"""Idle seconds after which the server deletes an evaluation scheduler's durables."""


def resolve(path: str) -> type:
    """Import ``pkg.module:Name``."""
    mod, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'pkg.module:Name'")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from e


def role_config(cfg: RunConfig, role: str) -> ActorConfig:
    return cfg.actors.get(role, ActorConfig())


def role_class(cfg: RunConfig, role: str) -> type[Actor]:
    """The class of ``role``: ``actors.<role>.type``, else the built-in one; a ValueError
    naming the key when it cannot be imported or is not an actor of that role."""
    given = role_config(cfg, role).type
    builtin = BUILTIN_ROLES.get(role)
    path = given or builtin or (role if ":" in role else None)
    if path is None:
        raise ValueError(f"unknown role {role!r}: built-in roles are {sorted(BUILTIN_ROLES)}; "
                         f"or give actors.{role}.type = 'pkg.module:Class' in the config")
    try:
        cls = resolve(path)
    except ValueError as e:
        raise ValueError(f"actors.{role}.type: {e}" if given else str(e)) from None
    if given and builtin:
        base = resolve(builtin)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"actors.{role}.type: {path} is not a subclass of "
                             f"{base.__module__}:{base.__name__}")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise ValueError(f"{path} is not an Actor subclass")
    return cls


def role_pool(cfg: RunConfig, role: str, pool: str) -> str:
    """The pool an actor of ``role`` joins on a node started with ``--pool pool``.

    Without ``pools`` (or for a role ``mapping`` does not name: trainer, scheduler, custom
    roles) it is the node's pool. With them, the node's pool if the mapping gives it the role;
    a node left on the default pool name ``default`` puts the role in its first mapped pool;
    any other pool is a ValueError naming ``mapping.<role>``."""
    if not cfg.pools or role not in cfg.mapping:
        return pool
    mapped = mapped_pools(cfg.mapping, role)
    if pool in mapped:
        return pool
    if pool == "default":
        return mapped[0]
    raise ValueError(f"mapping.{role}: this node's pool {pool!r} does not serve role {role!r} "
                     f"(mapping.{role}: {', '.join(mapped)}); start the node with --pool "
                     f"{mapped[0]}, or add {pool!r} to mapping.{role}")


def replica_pools(cfg: RunConfig, role: str, pool: str, *, one_host: bool = False) -> list[str]:
    """The pool of each of ``actors.<role>.replicas`` instances of ``role`` on a node of
    ``pool``. ``one_host`` (a one-process run, which hosts every role): with ``pools``
    declared and the node on ``default``, generation and envs get at least one replica per
    pool of ``mapping.generate`` / ``mapping.env``, the replicas dealt round them (a turn
    routed, or a request sent, to a pool with no replica would wait for ever)."""
    n = role_config(cfg, role).replicas
    if one_host and role in ("generate", "env") and cfg.pools and role in cfg.mapping \
            and pool == "default":
        gen = mapped_pools(cfg.mapping, role)
        return [gen[i % len(gen)] for i in range(max(n, len(gen)))]
    return [role_pool(cfg, role, pool)] * n


def build_actors(cfg: RunConfig, roles: Sequence[str], pool: str = "default", *,
                 args: Mapping[str, Mapping[str, Any]] | None = None,
                 one_host: bool = False) -> list[Actor]:
    """Instantiate the actors of ``roles``, ``actors.<role>.replicas`` of each, each in its
    pool (:func:`replica_pools`). ``args``: per role, constructor arguments over the config's
    ``actors.<role>.args``."""
    actors: list[Actor] = []
    for role in roles:
        cls = role_class(cfg, role)
        acfg = role_config(cfg, role)
        extra = (args or {}).get(role)
        if extra:
            acfg = msgspec.structs.replace(acfg, args={**acfg.args, **extra})
        for i, role_in in enumerate(replica_pools(cfg, role, pool, one_host=one_host)):
            actors.append(cls.from_config(cfg, acfg, pool=role_in, index=i))
    return actors


def rollout_actors(cfg: RunConfig, *, groups: int | None, bounded: bool = True,
                   keep_results: bool = False, greedy: bool = False, eval: bool = False,
                   env: str | None = None, pool: str = "default", resume: bool = False,
                   prefix: str = TRAINING_PREFIX,
                   max_live: int | None = None) -> tuple[Actor, list[Actor]]:
    """Scheduler, EnvManager, generation and reward replicas for one host: the scheduler
    and the list of all of them (scheduler first).

    ``groups``: groups to admit (None: until stopped); ``bounded``: apply α (False with no
    trainer); ``keep_results``: keep every outcome (``rollart rollout``); ``eval``: held-out
    seeds, for a second scheduler beside the training one (its own ``prefix``, one-off
    durables, no pool watch: the training scheduler watches the pools); ``resume``: continue
    the admission count an earlier process of the run stored; ``max_live``: at most that
    many trajectories in flight at once, in whole groups, at least one (an evaluation beside
    training)."""
    sched_args: dict[str, Any] = dict(total_groups=groups, bounded=bounded,
                                      keep_results=keep_results, greedy=greedy, eval=eval,
                                      env=env, prefix=prefix, resume=resume)
    if prefix != TRAINING_PREFIX:  # a second scheduler on the same run reads every outcome itself
        name = f"scheduler-{prefix.strip('-')}"
        # one-off durables: the server deletes them once idle (a long run's evaluations
        # would otherwise leave three each on the run's stream); they start at the stream's
        # end, since the scheduler binds them before it publishes its first request
        sched_args.update(name=name, settings={
            h: {"durable": f"{name}-{h}".replace("_", "-"),
                "inactive_threshold": TRANSIENT_DURABLE_IDLE_S, "deliver_new": True}
            for h in ("on_completed", "on_cancelled", "on_dead")})
    if eval:
        sched_args.update(seed_offset=HELDOUT_SEED_OFFSET,  # held-out tasks: training seeds start at 0
                          run_cfg=None)
        if greedy and cfg.rollout.same_seed_per_group:
            # greedy decoding plays a task one way: one trajectory per held-out task, not a
            # group of identical ones (the sampled evaluation keeps group_size per task)
            sched_args["rollout"] = msgspec.structs.replace(cfg.rollout, group_size=1, redundancy=0)
    if max_live is not None:
        r = sched_args.get("rollout", cfg.rollout)
        sched_args["max_live_groups"] = max(1, max_live // (r.group_size + r.redundancy))
    actors = build_actors(cfg, ["scheduler", "env", "generate", "reward"], pool,
                          args={"scheduler": sched_args}, one_host=True)
    return actors[0], actors


def training_actors(cfg: RunConfig, *, resume: bool = False, pool: str = "default"):
    """Everything ``rollart run`` hosts in one process: the rollout actors plus the Trainer;
    ``(scheduler, trainer, all actors)``."""
    sched, actors = rollout_actors(cfg, groups=None, bounded=True, pool=pool, resume=resume)
    (trainer,) = build_actors(cfg, ["trainer"], pool, args={"trainer": {"resume": resume}})
    return sched, trainer, actors + [trainer]
