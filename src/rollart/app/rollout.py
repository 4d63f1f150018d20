"""``rollart rollout``: roll out (evaluate) a policy into a JSON-lines file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollart import messages as m
from rollart.app.args import nats_overrides, open_bus
from rollart.app.configs import check_run_config, resolve_config
from rollart.config import RunConfig, load
from rollart.node import Node, rollout_actors


def summarize(results: list[m.RolloutCompleted], wall_s: float) -> dict:
    n = len(results) or 1
    stages = ("reset", "generate", "step", "reward", "wait")
    return {
        "trajectories": len(results),
        "success_rate": sum(r.success for r in results) / n,
        "mean_reward": sum(r.reward for r in results) / n,
        "mean_turns": sum(len(r.turns) for r in results) / n,
        "mean_tokens": sum(len(r.token_ids) for r in results) / n,
        "generated_tokens": sum(sum(r.response_mask) for r in results),
        "stop_reasons": {s: sum(r.stop_reason == s for r in results)
                         for s in sorted({r.stop_reason for r in results})},
        "mean_stage_s": {s: sum(r.timings.get(s, 0.0) for r in results) / n for s in stages},
        "wall_s": wall_s,
    }


@contextlib.asynccontextmanager
async def _scratch_bus(cfg: RunConfig, nats: str | None, overrides: dict | None = None):
    """``open_bus`` for a rollout: an embedded server keeps its store in a temporary folder
    (removed after), so a rollout writes nothing but its ``--out`` file."""
    with tempfile.TemporaryDirectory(prefix="rollart-rollout-") as store:
        async with open_bus(msgspec.structs.replace(cfg, run_dir=store), nats, overrides) as bus:
            yield bus


async def rollout_main(args) -> int:
    cfg = load(resolve_config(args.config), RunConfig)
    base = m.check_token("run", args.run) if args.run else cfg.run
    # its own run name (subjects, streams): never a training run's folder, queue or stream
    cfg = msgspec.structs.replace(cfg, run=f"{base}-rollout-{uuid.uuid4().hex[:6]}")
    await check_run_config(cfg, [args.env] if args.env else None, trainer=False)  # a broken env fails now
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    async with _scratch_bus(cfg, args.nats, nats_overrides(args)) as bus:
        sched, actors = rollout_actors(cfg, groups=args.groups, bounded=False, keep_results=True,
                                       greedy=args.greedy, eval=True, env=args.env,
                                       prefix=f"e{int(time.time())}-")
        if args.weights:
            for a in actors:
                if a.role == "generate":
                    a.initial_weights = args.weights
        t0 = time.perf_counter()
        with Progress(TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                      disable=args.quiet) as bar:
            task = bar.add_task("groups", total=args.groups, info="")
            async with Node(bus, actors, heartbeat_every=0, events_max_age=cfg.node.events_max_age,
                            events_max_bytes=cfg.node.events_max_bytes):
                while not sched.all_done.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sched.all_done.wait(), 0.25)
                    res = sched.results
                    ok = sum(r.success for r in res) / max(1, len(res))
                    bar.update(task, completed=sched.groups_settled,
                               info=f"success {ok:.2f}  trajectories {len(res)}")
        wall = time.perf_counter() - t0
    lines = "".join(json.dumps(msgspec.to_builtins(r)) + "\n" for r in sched.results)
    await asyncio.to_thread(out.write_text, lines)
    summary = summarize(sched.results, wall) | {"run": cfg.run, "outcomes": sched.summary(),
                                                 "out": str(out)}
    print(json.dumps(summary, indent=2))
    return 0
