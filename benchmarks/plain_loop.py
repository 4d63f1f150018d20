"""The floor: a plain, single-process, synchronous generate-then-train loop.

::

    python benchmarks/plain_loop.py configs/quickstart.yaml --steps 5

Same model folder, environment, seeds, prompt tokens and hyper-parameters as a rollart run
of the same config, but no bus, no actors, no asyncio and no weight files: each step

1. rolls out ``batch_groups x group_size`` trajectories in lock step: one batched
   ``TorchGenerationEngine.generate`` call per turn over every live trajectory, then one
   environment step per trajectory (in this thread); with ``trainer.skip_uniform``, groups
   whose rewards are all equal (``skip_which``) are replaced by fresh ones, rolled out in
   lock step again, up to that many a step, as rollart's trainer and admission do (DAPO's
   dynamic sampling: the same work per step on both sides);
2. turns them into samples with :func:`rollart.actors.trainer.batch.build_samples` (token
   ids, masks and behaviour log-probs exactly as an EnvManager records them, built with
   :class:`rollart.actors.env.chat.ChatFormat`);
3. takes one ``TorchTrainBackend.train_step`` with ``loss_config(cfg.trainer)`` (the
   entropy coefficient adapted per step under ``trainer.entropy_target``, and the LR
   schedule moved or held by ``trainer.schedule_clock``, as the Trainer's);
4. copies the trainer's state dict into the generation engine (in memory).

This is what the rollart ``alpha = 0`` pipeline would cost with zero overhead; rollart with
``alpha >= 1`` can beat it by overlapping generation with training.

The per-step ``wall_s`` is measured from the start of the first step to the end of the
``train_step`` that produced the version (the same point at which rollart's Trainer
records its ``wall_s``). Saving weight snapshots (``snapshot_dir``) happens with the clock
stopped, so evaluation never costs the loop time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart import messages as m
from rollart.actors.env.chat import ChatFormat
from rollart.actors.env.manager import Trace
from rollart.config import RunConfig, load
from rollart.envs import parse_action
from rollart.envs.base import legal_actions_of
from rollart.envs.registry import make_env


@dataclass(kw_only=True)
class _Traj(Trace):
    """One trajectory in flight: EnvManager's token-level ``Trace`` plus loop state."""

    traj_id: str
    group_index: int
    seed: int
    env: Any
    obs: str
    reward: float = 0.0
    success: bool = False
    stop: str = "max_turns"
    done: bool = False
    legal: list[str] | None = None
    choices: list[list[int]] = field(default_factory=list)


def rollout_lockstep(engine: Any, chat: ChatFormat, env_cfg: Any, tasks: list[tuple[str, int, int]],
                     *, greedy: bool = False, eval: bool = False,
                     counts: dict | None = None) -> list[m.RolloutCompleted]:
    """Roll out one trajectory per ``(traj_id, group_index, seed)`` in lock step.

    Turn by turn this does what :class:`rollart.actors.env.manager.EnvManager` does for one
    trajectory (chat template deltas at token level, constrained decoding to the env's
    legal actions, ``format_penalty``, ``max_context_tokens``, ``max_turns``), but with one
    batched engine call per turn over every trajectory still running. ``counts``, if given,
    gains ``engine_calls`` and ``engine_rows``.
    """
    from rollart.engines.base import GenInput

    s = env_cfg.sampling
    version = int(engine.version)
    trajs: list[_Traj] = []
    for traj_id, gi, seed in tasks:
        env = make_env(env_cfg.type, env_cfg.args)
        obs, _info = env.reset(seed)
        t = _Traj(traj_id=traj_id, group_index=gi, seed=seed, env=env, obs=obs)
        instruction = env_cfg.instruction or env.instruction
        t.add_prompt(chat.first_prompt(instruction, env_cfg.turn_template.format(observation=obs, turn=1)))
        t.legal = legal_actions_of(env) if env_cfg.constrain else None
        trajs.append(t)
    choice_cache: dict[tuple[str, ...], list[list[int]]] = {}
    for turn in range(1, env_cfg.max_turns + 1):
        live = []
        for t in trajs:
            if t.done:
                continue
            if len(t.token_ids) >= env_cfg.max_context_tokens:
                t.stop, t.done = "max_context", True
                continue
            live.append(t)
        if not live:
            break
        inputs = []
        for t in live:
            if t.legal:
                key = tuple(t.legal)
                if key not in choice_cache:
                    choice_cache[key] = [chat.encode(a) for a in t.legal]
                t.choices = choice_cache[key]
            else:
                t.choices = []
            inputs.append(GenInput(prompt_ids=list(t.token_ids), max_new_tokens=s.max_new_tokens,
                                   temperature=s.temperature, top_p=s.top_p,
                                   choices=[list(c) for c in t.choices] or None, greedy=greedy,
                                   session=t.traj_id))  # the engine's KV cache, as behind the LLMProxy
        outs = engine.generate(inputs)
        if counts is not None:
            counts["engine_calls"] = counts.get("engine_calls", 0) + 1
            counts["engine_rows"] = counts.get("engine_rows", 0) + len(inputs)
        for t, o in zip(live, outs):
            start = len(t.token_ids)
            t.add_response(o.token_ids, o.logprobs, version)
            text = chat.decode(o.token_ids)
            action = text.strip() if t.legal else parse_action(text, env_cfg.action_pattern)
            format_ok = action is not None
            if not format_ok:
                t.reward += env_cfg.format_penalty
            t.obs, r, term, trunc, info = t.env.step(action if format_ok else text)
            t.reward += float(r)
            t.success = bool(info.get("success", t.success))
            t.legal = legal_actions_of(t.env) if env_cfg.constrain else None
            t.turns.append(m.TurnRecord(start=start, response_len=len(o.token_ids), version=version,
                                        action=action or text[:64], reward=float(r),
                                        format_ok=format_ok, choices=t.choices))
            if term or trunc:
                t.stop, t.done = ("terminated" if term else "truncated"), True
            elif turn < env_cfg.max_turns:
                t.add_prompt(chat.next_prompt(o.token_ids, env_cfg.turn_template.format(
                    observation=t.obs, turn=turn + 1)))
    if env_cfg.scorer:
        raise NotImplementedError("plain loop: envs with a RewardService scorer are not supported")
    return [m.RolloutCompleted(
        traj_id=t.traj_id, group_id=f"g{t.group_index:06d}", env="main", seed=t.seed,
        index_in_group=int(t.traj_id.rsplit("-", 1)[-1]), token_ids=t.token_ids,
        response_mask=t.mask, logprobs=t.logprobs, token_versions=t.versions, turns=t.turns,
        min_version=version, max_version=version, reward=t.reward, success=t.success,
        stop_reason=t.stop, eval=eval, group_index=t.group_index) for t in trajs]


def build(cfg: RunConfig, *, model_dir: str | None = None, kv_cache: bool = True):
    """The generation engine, the training backend and the chat format of ``cfg``, set up
    like the LLMProxy (replica 0) and the Trainer of a rollart run. ``kv_cache=False``: the
    engine re-reads every prompt (no multi-turn KV reuse)."""
    from rollart.engines.provision import model_dir as provision
    from rollart.engines.torch_engine import TorchGenerationEngine
    from rollart.engines.train_backends import make_backend

    md = str(model_dir or provision(cfg))
    gen = cfg.actors.get("generate")
    seed = int((gen.args if gen is not None else {}).get("seed", 0))  # LLMProxy replica 0's seed
    kw = {} if kv_cache else {"kv_cache_mb": 0}
    engine = TorchGenerationEngine(md, threads=cfg.model.threads, seed=seed, **kw)
    backend = make_backend(cfg, md)  # the Trainer's own backend, from the same settings
    return engine, backend, ChatFormat.load(md)


def run_plain(cfg: RunConfig, steps: int | None = None,
              on_step: Callable[[dict], None] | None = None, *,
              snapshot_dir: str | Path | None = None, model_dir: str | None = None,
              kv_cache: bool = True) -> list[dict]:
    """Train ``cfg`` for ``steps`` (default ``cfg.trainer.steps``) plain synchronous steps.

    Returns one record per step: ``step``/``version``, ``wall_s`` (from the first step's
    start to the end of this step's ``train_step``), ``gen_s``, ``train_s``, ``sync_s``
    (state-dict copy into the engine, counted in the next step's wall time), reward,
    success, token counts and the train metrics. With ``snapshot_dir`` each version's
    weights are written to ``vNNNNNN.safetensors`` there with the clock stopped.
    """
    from rollart.actors.groups.ledger import uniform
    from rollart.actors.trainer.batch import (advances_schedule, build_samples, loss_config,
                                            next_entropy_coef, trajectory_stats)
    from rollart.engines.base import save_weights

    steps = cfg.trainer.steps if steps is None else steps
    r = cfg.rollout
    env_cfg = cfg.envs[r.env]
    engine, backend, chat = build(cfg, model_dir=model_dir, kv_cache=kv_cache)
    coef = cfg.trainer.entropy_coef  # trainer.entropy_target adapts it, as the Trainer does
    snap = Path(snapshot_dir) if snapshot_dir is not None else None
    if snap is not None:
        snap.mkdir(parents=True, exist_ok=True)
    history: list[dict] = []
    paused = paused_cpu = 0.0  # seconds (wall, CPU) the clocks were stopped (snapshots)
    t_start = time.perf_counter()
    cpu0 = time.process_time()
    sync_s = 0.0
    next_group = 0
    skipped_total = 0
    for k in range(steps):
        v = backend.version
        t0 = time.perf_counter()
        counts: dict = {}
        trajs: list = []  # the step's trained groups
        rolled: list = []  # every trajectory rolled out this step (skipped groups too)
        skipped, want = 0, r.batch_groups
        while want:  # dynamic sampling as the trainer's: uniform groups replaced, up to the budget
            tasks = []
            for gi in range(next_group, next_group + want):
                seed = r.seed + gi  # RolloutScheduler's task seed of group gi
                for i in range(r.group_size):
                    tasks.append((f"g{gi:06d}-{i}", gi,
                                  seed if r.same_seed_per_group else r.seed + gi * r.group_size + i))
            next_group += want
            got = rollout_lockstep(engine, chat, env_cfg, tasks, counts=counts)
            rolled += got
            want = 0
            for gi in sorted({t.group_index for t in got}):
                group = [t for t in got if t.group_index == gi]
                if skipped < cfg.trainer.skip_uniform and uniform(group, cfg.trainer.skip_which):
                    skipped += 1
                    want += 1
                else:
                    trajs += group
        skipped_total += skipped
        counts.update(groups_skipped=skipped, count_uniform_skipped=skipped_total,
                      rolled_trajectories=len(rolled))
        t1 = time.perf_counter()
        samples = build_samples(trajs, [t.group_index for t in trajs], cfg.trainer.advantage)
        advance = advances_schedule(cfg.trainer, trajs, samples)  # trainer.schedule_clock
        tm = backend.train_step(samples, loss_cfg=loss_config(cfg.trainer, coef, advance))
        counts["entropy_coef"] = coef
        counts["schedule_held"] = float(not advance)
        coef = next_entropy_coef(cfg.trainer, coef, tm.get("entropy"))
        t2 = time.perf_counter()
        cpu = time.process_time() - cpu0
        rec = {"step": backend.version, "version": backend.version, "wall_s": t2 - t_start - paused,
               "cpu_s": cpu - paused_cpu,
               "gen_s": t1 - t0, "train_s": t2 - t1, "sync_s_before": sync_s, **counts,
               **trajectory_stats(rolled, v),
               **{f"train_{k2}": float(x) for k2, x in tm.items() if isinstance(x, (int, float))}}
        history.append(rec)
        if snap is not None:
            p0, c0 = time.perf_counter(), time.process_time()
            save_weights(backend.model.state_dict(), snap / f"v{backend.version:06d}.safetensors")
            paused += time.perf_counter() - p0
            paused_cpu += time.process_time() - c0
        t3 = time.perf_counter()
        engine.load_state_dict(backend.model.state_dict(), backend.version)
        sync_s = time.perf_counter() - t3
        if on_step is not None:
            p0, c0 = time.perf_counter(), time.process_time()
            on_step(rec)
            paused += time.perf_counter() - p0
            paused_cpu += time.process_time() - c0
    return history


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--snapshots", default=None, help="folder for one weight file per version")
    args = p.parse_args(argv)
    cfg = load(args.config, RunConfig)

    def show(rec: dict) -> None:
        print(f"step {rec['step']:3d} wall {rec['wall_s']:7.2f}s gen {rec['gen_s']:.2f}s "
              f"train {rec['train_s']:.2f}s reward {rec['reward']:.2f} success {rec['success']:.2f}",
              file=sys.stderr, flush=True)

    hist = run_plain(cfg, args.steps, show, snapshot_dir=args.snapshots)
    print(json.dumps(hist[-1], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
