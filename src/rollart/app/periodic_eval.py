"""Evaluations of a training run on held-out tasks: :func:`evaluate` (the final one, and
the ones of ``trainer.eval_every``: during the run, beside it).

Every ``eval_every`` steps the version just trained is evaluated on ``trainer.eval_groups``
groups of held-out tasks (the final evaluation's seeds, so the rows compare), greedy then
sampled, through the run's own env, generate and reward replicas, with at most
``trainer.eval_share`` of ``rollout.concurrency`` in flight at once (so training's requests
never queue behind all of its held-out ones). The trainer does not wait for it: its steps go on (an evaluation's time is in no step's ``train_s``), and with
``rollout.alpha`` > 0 a generator may already serve a later version, which ``served`` says.
Each evaluation is one row of ``<run>/eval.jsonl`` (and the loggers' ``eval/`` curves); the
plot and ``rollart report`` show them. A failed or timed-out evaluation is a row with its
``eval_error`` and never stops training. The last step is left to the final evaluation; one
under way when training ends is finished first (an interrupted run cuts it short).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

from rollart.actors.trainer.files import EVAL_FILE, read_evals
from rollart.config import RunConfig
from rollart.node import Node, rollout_actors

__all__ = ["EVAL_FILE", "eval_path", "evaluate", "next_due", "periodic_evals", "read_evals", "stop_evals"]

log = logging.getLogger(__name__)

def eval_path(run_path: str | Path) -> Path:
    return Path(run_path) / EVAL_FILE


def next_due(version: int, every: int) -> int:
    """The first version after ``version`` that is a multiple of ``every``."""
    return (version // every + 1) * every


async def _wait_version(trainer, version: int, stop: asyncio.Event) -> None:
    async with trainer.stepped:
        await trainer.stepped.wait_for(lambda: trainer.version >= version or stop.is_set())


async def stop_evals(trainer, stop: asyncio.Event) -> None:
    """No evaluation starts after this (one under way finishes)."""
    stop.set()
    async with trainer.stepped:
        trainer.stepped.notify_all()


async def evaluate(bus, cfg: RunConfig, version: int, groups: int, proxies=(),
                   pool: str = "default", *, greedy: bool = True, served: bool = False,
                   share: float | None = None) -> dict:
    """Greedy success of the policy ``version`` (or a later one) on ``groups`` groups of
    held-out tasks, on whatever env, generate and reward replicas serve the run (in this
    process or others); ``greedy=False``: sampled, keys ``sampled_*``. ``served``: with the
    lowest and highest policy version that generated a token (``served``). ``share``: at most
    that share of ``rollout.concurrency`` in flight at once (beside training)."""
    deadline = time.monotonic() + 60
    while any(p.version < version for p in proxies) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if cfg.pools:  # only the scheduler is used: its requests go to mapping.env whatever this
        pool = "default"  # node's pool (which need not serve env or generate)
    live = None if share is None else max(1, int(share * cfg.rollout.concurrency))
    sched, _ = rollout_actors(cfg, groups=groups, bounded=False, keep_results=True, greedy=greedy,
                              eval=True, pool=pool, max_live=live,
                              prefix=f"eval{version}-{uuid.uuid4().hex[:6]}-")  # unique:
    # the prefix names trajectories and their msg ids; a repeated evaluation of the same
    # version (a resumed run) would otherwise be dropped as duplicates and never finish
    sched.min_policy = version  # a replica elsewhere that has not loaded it yet waits for it
    async with Node(bus, [sched], heartbeat_every=0, events_max_age=cfg.node.events_max_age,
                    events_max_bytes=cfg.node.events_max_bytes):
        await sched.all_done.wait()
    res = sched.results
    kind = "greedy" if greedy else "sampled"
    out = {"version": version, f"{kind}_success": sum(r.success for r in res) / max(1, len(res)),
           f"{kind}_reward": sum(r.reward for r in res) / max(1, len(res)), "trajectories": len(res)}
    if served:
        out["served"] = [min((r.min_version for r in res), default=version),
                         max((r.max_version for r in res), default=version)]
    return out


async def evaluate_version(bus, cfg: RunConfig, version: int, *, proxies=(),
                           pool: str = "default", share: float | None = None) -> dict:
    """One row: greedy then sampled success of ``version`` on the held-out groups
    (``trainer.eval_groups``; the sampled half on ``trainer.eval_sampled_groups`` of them);
    ``share``: as :func:`evaluate`'s."""
    t0 = time.perf_counter()
    greedy = await evaluate(bus, cfg, version, cfg.trainer.eval_groups, proxies, pool=pool,
                            served=True, share=share)
    t = cfg.trainer
    sampled_groups = t.eval_groups if t.eval_sampled_groups is None else t.eval_sampled_groups
    sampled = await evaluate(bus, cfg, version, sampled_groups, proxies, pool=pool,
                             greedy=False, served=True, share=share)
    served = [min(greedy["served"][0], sampled["served"][0]),
              max(greedy["served"][1], sampled["served"][1])]
    return {"version": version, "step": version,
            "greedy_success": greedy["greedy_success"], "greedy_reward": greedy["greedy_reward"],
            "sampled_success": sampled["sampled_success"],
            "sampled_reward": sampled["sampled_reward"],
            "trajectories": greedy["trajectories"] + sampled["trajectories"],
            "served": served, "eval_s": time.perf_counter() - t0}


async def periodic_evals(bus, cfg: RunConfig, trainer, run_path: str | Path, stop: asyncio.Event,
                         *, proxies=(), pool: str = "default") -> None:
    """Evaluate every ``trainer.eval_every`` versions before the last, until ``stop``
    (:func:`stop_evals`: one under way is finished) or cancelled (the run was interrupted);
    owned by :func:`rollart.app.launch.drive_training`."""
    every, last = cfg.trainer.eval_every, cfg.trainer.steps
    if every <= 0:
        return
    due = next_due(trainer.version, every)
    while due < last:
        await _wait_version(trainer, due, stop)
        if stop.is_set():
            return
        v = trainer.version  # the latest: a slow evaluation skips the versions it missed
        if v >= last:  # the steps ran on to the last one while this waited: the final
            return  # evaluation's
        t_run = time.time() - trainer.started_at if trainer.started_at else 0.0
        try:
            row = await asyncio.wait_for(
                evaluate_version(bus, cfg, v, proxies=proxies, pool=pool,
                                 share=cfg.trainer.eval_share), cfg.trainer.eval_timeout)
        except TimeoutError:
            row = {"version": v, "step": v,
                   "eval_error": f"timed out after {cfg.trainer.eval_timeout:.0f}s "
                                 f"(trainer.eval_timeout)"}
        except Exception as e:  # noqa: BLE001 - an evaluation never stops training
            row = {"version": v, "step": v, "eval_error": f"{type(e).__name__}: {e}"[:500]}
        row["wall_s"] = t_run
        if "eval_error" in row:
            log.warning("run %s: the evaluation of v%d failed: %s", cfg.run, v, row["eval_error"])
        else:
            log.info("run %s: v%d held-out greedy success %.2f, sampled %.2f (%.0fs)", cfg.run, v,
                     row["greedy_success"], row["sampled_success"], row["eval_s"])
        await asyncio.to_thread(_append, eval_path(run_path), row)
        if getattr(trainer, "loggers", None) is not None:
            await asyncio.to_thread(trainer.loggers.log,
                                    {k: x for k, x in row.items() if k != "served"}, prefix="eval/")
        due = next_due(v, every)


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
