"""In-process deployments: the actor sets behind ``rollart rollout`` and ``rollart run``,
and how a training run ends (evaluation, ``summary.json``, the end published to its nodes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import msgspec

from rollart.actors.base import Actor
from rollart.config import ActorConfig, RunConfig

log = logging.getLogger(__name__)


def _role(cfg: RunConfig, role: str) -> ActorConfig:
    return cfg.actors.get(role, ActorConfig())


def _cls(cfg: RunConfig, role: str, default: type) -> type:
    """The class of ``role`` in a one-process run: ``actors.<role>.type`` when given (as a
    node builds it), a subclass of the built-in ``default`` (this module sets its
    attributes), else ``default``."""
    path = _role(cfg, role).type
    if not path:
        return default
    from rollart.node import resolve

    try:
        cls = resolve(path)
    except ValueError as e:
        raise ValueError(f"actors.{role}.type: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, default)):
        raise ValueError(f"actors.{role}.type: {path} is not a subclass of "
                         f"{default.__module__}:{default.__name__}")
    return cls


def role_pool(cfg: RunConfig, role: str, pool: str) -> str:
    """The pool an actor of ``role`` joins on a node started with ``--pool pool``.

    Without ``pools`` (or for a role ``mapping`` does not name: trainer, scheduler, custom
    roles) it is the node's pool. With them, the node's pool if the mapping gives it the role;
    a node left on the default pool name ``default`` puts the role in its first mapped pool;
    any other pool is a ValueError naming ``mapping.<role>``."""
    from rollart.config.placement import mapped_pools

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


TRANSIENT_DURABLE_IDLE_S = 300.0
"""Idle seconds after which the server deletes an evaluation scheduler's durables."""


def rollout_actors(cfg: RunConfig, *, groups: int | None, bounded: bool = True,
                   keep_results: bool = False, greedy: bool = False, eval: bool = False,
                   env: str | None = None, pool: str = "default",
                   prefix: str = "g") -> tuple[Actor, list[Actor]]:
    """Scheduler, EnvManager, LLMProxy replicas and RewardService replicas for one host."""
    from rollart.actors.env_manager import EnvManager
    from rollart.actors.llm_proxy import LLMProxy
    from rollart.actors.reward import RewardService
    from rollart.actors.scheduler import RolloutScheduler

    sched = _cls(cfg, "scheduler", RolloutScheduler).from_config(
        cfg, _role(cfg, "scheduler"), pool=role_pool(cfg, "scheduler", pool))
    if prefix != "g":  # a second scheduler on the same run reads every outcome itself
        sched.name = f"scheduler-{prefix.strip('-')}"
        # one-off durables: the server deletes them once idle (a long run's evaluations
        # would otherwise leave three each on the run's stream)
        sched.settings = {h: {"durable": f"{sched.name}-{h}".replace("_", "-"),
                              "inactive_threshold": TRANSIENT_DURABLE_IDLE_S}
                          for h in ("on_completed", "on_cancelled", "on_dead")}
    sched.total_groups, sched.bounded, sched.keep_results = groups, bounded, keep_results
    sched.greedy, sched.eval, sched.env, sched.prefix = greedy, eval, env, prefix
    if eval:
        sched.seed_offset = 1_000_000  # held-out tasks: training seeds start at rollout.seed
        sched.run_cfg = None  # the training scheduler already watches the pools
    actors: list[Actor] = [sched, _cls(cfg, "env", EnvManager).from_config(
        cfg, _role(cfg, "env"), pool=role_pool(cfg, "env", pool))]
    for i, gen_pool in enumerate(_generate_pools(cfg, pool)):
        actors.append(_cls(cfg, "generate", LLMProxy).from_config(cfg, _role(cfg, "generate"),
                                                                 pool=gen_pool, index=i))
    for i in range(cfg.reward.replicas):
        actors.append(_cls(cfg, "reward", RewardService).from_config(
            cfg, _role(cfg, "reward"), pool=role_pool(cfg, "reward", pool), index=i))
    return sched, actors


def _generate_pools(cfg: RunConfig, pool: str) -> list[str]:
    """The pool of each generate replica of a one-process run: ``proxy.replicas`` of them in
    the node's pool; with ``pools`` declared (and the node on ``default``), at least one per
    pool of ``mapping.generate``, the replicas dealt round the pools (a turn routed to a pool
    with no replica would wait for ever)."""
    from rollart.config.placement import mapped_pools

    if not cfg.pools or "generate" not in cfg.mapping or pool != "default":
        return [role_pool(cfg, "generate", pool)] * cfg.proxy.replicas
    gen = mapped_pools(cfg.mapping, "generate")
    return [gen[i % len(gen)] for i in range(max(cfg.proxy.replicas, len(gen)))]


def with_overrides(cfg: RunConfig, **sections) -> RunConfig:
    """``cfg`` with some sections' fields replaced: ``with_overrides(cfg, rollout={...})``."""
    out = cfg
    for name, values in sections.items():
        if name == "nats" and isinstance(values, dict):  # a section given as a mapping
            from rollart.config.schema import nats_settings

            values = nats_settings(values)
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
    trainer = _cls(cfg, "trainer", Trainer).from_config(cfg, _role(cfg, "trainer"),
                                                       pool=role_pool(cfg, "trainer", pool))
    trainer.resume = resume
    return sched, trainer, actors + [trainer]


# -- the end of a training run: the same in one process (`rollart run`) and on the node
#    that hosts the trainer (`python -m rollart.node --roles trainer,...`) ------------


def write_config(cfg: RunConfig, *, overwrite: bool = True) -> Path:
    """The run's resolved config as ``<run_dir>/<run>/config.yaml``."""
    import yaml

    path = Path(cfg.run_dir) / cfg.run / "config.yaml"
    if overwrite or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    return path


async def evaluate(bus, cfg: RunConfig, version: int, groups: int, proxies=(),
                   pool: str = "default") -> dict:
    """Greedy success of the policy ``version`` on ``groups`` fresh groups, on whatever
    env, generate and reward replicas serve the run (in this process or others)."""
    import uuid

    from rollart.node import Node

    deadline = time.monotonic() + 60
    while any(p.version < version for p in proxies) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if cfg.pools:  # only the scheduler is used: its requests go to mapping.env whatever this
        pool = "default"  # node's pool (which need not serve env or generate)
    sched, _ = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True, greedy=True,
                              eval=True, pool=pool,
                              prefix=f"eval{version}-{uuid.uuid4().hex[:6]}-")  # unique:
    # the prefix names trajectories and their msg ids; a repeated evaluation of the same
    # version (a resumed run) would otherwise be dropped as duplicates and never finish
    sched.min_policy = version  # a replica elsewhere that has not loaded it yet waits for it
    async with Node(bus, [sched], heartbeat_every=0, events_max_age=cfg.node.events_max_age,
                    events_max_bytes=cfg.node.events_max_bytes):
        await sched.all_done.wait()
    res = sched.results
    return {"version": version, "greedy_success": sum(r.success for r in res) / max(1, len(res)),
            "greedy_reward": sum(r.reward for r in res) / max(1, len(res)), "trajectories": len(res)}


class _QuietHandBacks(logging.Filter):
    """Deliveries a finished (or stopping) trainer hands back for a later run are expected,
    not news: their ``retry`` lines are logged only at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        from rollart.actors.base import Retry

        args = record.args if isinstance(record.args, tuple) else ()
        if (record.levelno == logging.INFO and str(record.msg).startswith("retry ")
                and args and isinstance(args[-1], Retry) and str(args[-1]).startswith("trainer ")):
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_hand_backs() -> None:
    """Install :class:`_QuietHandBacks` on the consumer runtime's logger (idempotent)."""
    lg = logging.getLogger("rollart.actors.runtime")
    if not any(isinstance(f, _QuietHandBacks) for f in lg.filters):
        lg.addFilter(_QuietHandBacks())


def _stop_consuming(node, actor) -> None:
    """Stop ``actor``'s consumers: what they would fetch now stays queued for a later run."""
    for loop in node.loops:
        if loop.actor is actor:
            loop.stop()


async def drive_training(bus, cfg: RunConfig, node, trainer, sched=None, *, proxies=(),
                         pool: str = "default", t0: float | None = None) -> dict:
    """Drive a training run hosted by ``node`` to its end and return its summary.

    Waits for the trainer's last step (or the node's stop: SIGINT/SIGTERM), stops admitting,
    runs the final greedy evaluation, writes ``summary.json`` and the plot into the run
    folder, and publishes the end of the run (:mod:`rollart.actors.run_end`), on which the
    other nodes of the run drain and exit. ``proxies``: generate replicas in this process.
    """
    from rollart import messages as m
    from rollart.actors.run_end import put_run_end

    quiet_hand_backs()
    t0 = time.perf_counter() if t0 is None else t0
    done = asyncio.ensure_future(trainer.finished.wait())
    stop = asyncio.ensure_future(node.wait())
    await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    interrupted = not done.done()
    done.cancel()
    _stop_consuming(node, trainer)
    final: dict = {}
    if not interrupted and trainer.failure is None:
        if sched is not None:
            sched.total_groups = sched.admitted  # no more training rollouts
        log.info("run %s: trained %d steps; final greedy evaluation on %d groups", cfg.run,
                 trainer.version, cfg.trainer.eval_groups)
        ev = asyncio.ensure_future(
            evaluate(bus, cfg, trainer.version, cfg.trainer.eval_groups, proxies, pool=pool))
        stop = asyncio.ensure_future(node.wait())  # SIGINT/SIGTERM stop it too
        await asyncio.wait({ev, stop}, return_when=asyncio.FIRST_COMPLETED,
                           timeout=cfg.trainer.eval_timeout)
        stopped = stop.done()
        stop.cancel()
        if ev.done():
            try:
                final = ev.result()
            except Exception as e:  # noqa: BLE001 - training is done: the run ends, saying why
                log.error("run %s: the final evaluation failed: %s; the run ends without its "
                          "result", cfg.run, e)
                final = {"eval_error": str(e)[:500]}
        else:
            ev.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ev
            if stopped:
                interrupted = True
            else:
                log.error("run %s: the final evaluation did not finish within %.0fs "
                          "(trainer.eval_timeout); the run ends without its result", cfg.run,
                          cfg.trainer.eval_timeout)
                final = {"eval_error": f"timed out after {cfg.trainer.eval_timeout:.0f}s"}
    summary = await write_summary(cfg, trainer, wall=time.perf_counter() - t0,
                                  interrupted=interrupted, final=final)
    if not interrupted:
        await put_run_end(bus, cfg.run, m.RunEnd(
            stage="ended", version=trainer.version, steps=cfg.trainer.steps,
            stopped=trainer.failure or "", summary=str(Path(cfg.run_dir) / cfg.run / "summary.json"),
            result={k: float(v) for k, v in final.items() if isinstance(v, (int, float))},
            ts=time.time()))
    return summary


async def write_summary(cfg: RunConfig, trainer, *, wall: float, interrupted: bool,
                        final: dict) -> dict:
    """``summary.json`` (and the plot) of a training run; returns the summary."""
    from rollart.telemetry.report import plot

    run_path = Path(cfg.run_dir) / cfg.run
    summary = {"run": cfg.run, "steps": trainer.version, "wall_s": wall,
               "interrupted": interrupted, **final}
    if trainer.failure is not None:  # the circuit breaker: say why, with the counts by kind
        led = trainer.ledger
        summary.update(failed=trainer.failure, groups_failed=led.counts["groups_failed"],
                       groups_trained=led.trained,
                       dead_letters_by_kind=dict(led.failure_kinds.most_common()))
    if trainer.history:  # this run's summary marks the greedy result (not an old file's)
        summary["plot"] = str(await asyncio.to_thread(plot, run_path, summary=summary))
    await asyncio.to_thread((run_path / "summary.json").write_text, json.dumps(summary, indent=2))
    return summary


async def wait_for_peers(bus, run: str, node_id: str, *, heartbeat_every: float,
                         deadline: float, known: dict | None = None) -> int:
    """After the end of a run: wait (up to ``deadline`` seconds) until every other node of
    the run has stopped heartbeating, i.e. has drained, so that an embedded server is not
    stopped under them. ``known``: node id -> last :class:`NodeHeartbeat` seen so far.
    Returns how many were still heartbeating at the deadline."""
    from rollart import messages as m
    from rollart.actors.runtime import decode_core

    if heartbeat_every <= 0:
        return 0
    now, wall = time.monotonic(), time.time()
    last: dict[str, float] = {}
    for nid, hb in (known or {}).items():
        age = min(max(0.0, wall - hb.ts), 3 * heartbeat_every)
        if nid != node_id and age < 3 * heartbeat_every:
            last[nid] = now - age

    async def on_hb(req) -> None:
        hb = decode_core(m.NodeHeartbeat, req)
        if hb is None:  # junk on a core subject: counted and dropped
            return
        if hb.node_id != node_id:
            last[hb.node_id] = time.monotonic()

    sub = await bus.subscribe(m.subject(run, "node.heartbeat"), on_hb)
    try:
        end = now + deadline
        while time.monotonic() < end:
            t = time.monotonic()
            if all(t - seen > 1.5 * heartbeat_every for seen in last.values()):
                return 0
            await asyncio.sleep(0.1)
        t = time.monotonic()
        return sum(t - seen <= 1.5 * heartbeat_every for seen in last.values())
    finally:
        await sub.unsubscribe()
