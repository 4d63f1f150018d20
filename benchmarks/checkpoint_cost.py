"""What a checkpoint costs the trainer against model size: the durable state (journal + state,
every step), and the full checkpoint (model + AdamW + scheduler + RNG) written blocking (as
every step used to) or in the background (a copy to CPU memory, then a thread).

::

    python benchmarks/checkpoint_cost.py [--quick] [--sizes 0.1,0.5] [--steps K] [--threads T]

For each size, builds a random-init Qwen3-layout model with
:func:`rollart.engines.tiny.build_tiny_model` (vocab 512: the parameters are in the layers),
one :class:`rollart.engines.torch_trainer.TorchTrainBackend` (fp32, AdamW) and the trainer's
own :class:`rollart.actors.trainer.checkpoint.Checkpoints` over a run folder on the local
disk, and measures, after one warm-up step:

- **step**: the median of ``K`` plain training steps (16 samples of ~56 tokens, token-mean);
- **state**: :meth:`Checkpoints.commit` of one step's journal record (the 16 trajectories as
  ``rollout.completed`` messages, the RNG state) and ``state.json`` (each fsynced);
- **full, blocking**: the live state into a full checkpoint file (safetensors + record), fsynced;
- **full, async**: :meth:`Checkpoints.start_full` (what the step waits for: the copy to CPU
  memory), then a training step while the thread writes, then the write's total seconds.

Prints JSON, writes ``results/checkpoint_cost.json`` and its section of ``README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from common import (RESULTS, cpu_model, describe_machine, finish, render, replace_section,
                    table)

from rollart import messages as m
from rollart.actors.trainer.batch import build_samples
from rollart.actors.trainer.checkpoint import Checkpoints, rng_state
from rollart.actors.trainer.files import RunFiles
from rollart.algos.losses import LossConfig
from rollart.config import TrainerConfig
from rollart.engines.tiny import build_tiny_model
from rollart.engines.torch_trainer import TorchTrainBackend

SIZES = {  # Qwen3 layout, head_dim 64 (0.1) / 128 (0.5), GQA
    "0.02": {"hidden_size": 512, "num_layers": 6, "intermediate_size": 1408, "num_heads": 8, "num_kv_heads": 4},
    "0.1": {"hidden_size": 768, "num_layers": 12, "intermediate_size": 2560, "num_heads": 12, "num_kv_heads": 4},
    "0.5": {"hidden_size": 1280, "num_layers": 28, "intermediate_size": 3584, "num_heads": 10, "num_kv_heads": 2},
}
SAMPLES, GROUP = 16, 4


def trajectories(step: int) -> tuple[list[int], list[m.RolloutCompleted]]:
    rng = random.Random(step)
    groups, out = [], []
    for i in range(SAMPLES):
        g = step * (SAMPLES // GROUP) + i // GROUP
        prompt, resp = 40 + rng.randrange(8), 8 + rng.randrange(8)
        ids = [rng.randrange(3, 512) for _ in range(prompt + resp)]
        out.append(m.RolloutCompleted(
            traj_id=f"g{g:06d}-{i % GROUP}", group_id=f"g{g:06d}", env="main", seed=g,
            index_in_group=i % GROUP, token_ids=ids, response_mask=[0] * prompt + [1] * resp,
            logprobs=[0.0] * prompt + [-rng.uniform(0.5, 3) for _ in range(resp)],
            reward=float(rng.random() < 0.5), group_index=g))
        groups.append(g)
    return groups, out


def durable(version: int) -> dict:
    return {"version": version, "ledger": {"closed": {"low": 4 * version, "above": []}, "next_index": 4 * version,
                                          "lost": 0, "trained": 4 * version, "streak": 0},
            "counts": {}, "wall_s": 0.0}


async def measure(model_dir: Path, run_dir: Path, steps: int, threads: int) -> dict:
    loss = LossConfig()
    b = TorchTrainBackend(model_dir, lr=1e-5, threads=threads, seed=0, micro_batch_tokens=4096)
    files = RunFiles(run_dir)
    files.make()
    ckpt = Checkpoints(files, TrainerConfig())
    step_no = [0]

    def step() -> float:
        gi, trajs = trajectories(step_no[0])
        step_no[0] += 1
        rng = rng_state(b)
        t0 = time.perf_counter()
        b.train_step(build_samples(trajs, gi, "grpo"), loss_cfg=loss)
        took = time.perf_counter() - t0
        ckpt.record(b.version - 1, gi, trajs, rng)
        return took

    def full() -> dict:
        return {"backend": b.state_dict_for_checkpoint(), **durable(b.version)}

    step()  # warm-up
    plain = [step() for _ in range(steps)]
    await ckpt.commit(durable(b.version))  # the records of the steps above, not measured
    state_s = []
    gi, trajs = trajectories(step_no[0])
    for _ in range(3):  # one step's record (as the trainer has at each commit), then the state
        ckpt.record(b.version, gi, trajs, rng_state(b))
        state_s.append(await ckpt.commit(durable(b.version)))
    record_bytes = files.journal_path(ckpt.seq).stat().st_size
    state_bytes = files.state.stat().st_size
    t0 = time.perf_counter()
    ref = files.save_checkpoint({**full(), "journal_seq": ckpt.seq})
    blocking = time.perf_counter() - t0
    size = ref.bytes
    files.full_path(ref.seq).unlink()
    blocked = await ckpt.start_full(full, b.version)
    during = await asyncio.to_thread(step)  # trains while the thread writes (as the trainer does)
    t1 = time.perf_counter()
    await ckpt.wait()
    tail = time.perf_counter() - t1
    done = ckpt.take_done()
    params = sum(p.numel() for p in b.model.parameters())
    return {"params": params, "checkpoint_bytes": size, "tokens": sum(len(t.token_ids) for t in trajectories(0)[1]),
            "step_s": statistics.median(plain), "all_step_s": plain,
            "state_s": statistics.median(state_s), "all_state_s": state_s,
            "record_bytes": record_bytes, "state_bytes": state_bytes,
            "full_blocking_s": blocking, "full_async_block_s": blocked,
            "step_during_write_s": during, "wait_after_step_s": tail,
            "full_async_write_s": done["full_checkpoint_s"]}


def _async_every(r: dict, n: int) -> float:
    """Seconds a step pays on average with the durable state every step and an async full
    checkpoint every ``n``: the copy to CPU memory and the slowdown of the step that trains
    during the write, spread over ``n`` steps."""
    return r["state_s"] + (r["full_async_block_s"] + max(0.0, r["step_during_write_s"] - r["step_s"])) / n


def section(res: dict) -> str:
    rows = []
    for r in res["models"].values():
        st = r["step_s"]
        rows.append([f"{r['params'] / 1e9:.2f} B", f"{r['checkpoint_bytes'] / 1e9:.2f}", f"{st:.2f}",
                     f"{r['state_s'] * 1e3:.1f} ms ({100 * r['state_s'] / st:.2f} %)",
                     f"{r['full_blocking_s']:.2f} ({100 * r['full_blocking_s'] / st:.0f} %)",
                     f"{r['full_async_block_s']:.2f} ({100 * r['full_async_block_s'] / st:.0f} %)",
                     f"{r['full_async_write_s']:.2f}", f"{r['step_during_write_s']:.2f}",
                     f"{100 * r['full_blocking_s'] / st:.0f} % → {100 * _async_every(r, 10) / st:.1f} %",
                     f"{100 * (r['state_s'] + r['full_blocking_s'] / 10) / st:.1f} %"])
    return render("checkpoint_cost", samples=res["samples"], tokens=res["tokens"],
                  steps=res["steps"], threads=res["threads"], date=res["when"][:10],
                  machine=describe_machine(res),
                  table=table(["parameters", "full checkpoint (GB)", "step (s)",
                               "durable state per step (share)", "full, blocking (s, share)",
                               "full, async: step waits (s, share)", "async write (s)",
                               "step during the write (s)", "share per step: blocking → async / 10",
                               "blocking every 10"], rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.1,0.5")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="folder for models and run folders (default: a temp folder)")
    ap.add_argument("--quick", action="store_true", help="the 0.02 B model, 1 step; no README")
    ap.add_argument("--readme-only", action="store_true",
                    help="rewrite the README section from results/checkpoint_cost.json, measure nothing")
    args = ap.parse_args()
    if args.readme_only:
        replace_section("checkpoint_cost", section(json.loads((RESULTS / "checkpoint_cost.json").read_text())))
        return
    sizes = ["0.02"] if args.quick else args.sizes.split(",")
    steps = 1 if args.quick else args.steps
    t0 = time.time()
    load0 = os.getloadavg()[0]
    out: dict = {}
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-cost-"))
    try:
        for s in sizes:
            md = build_tiny_model(base / f"model-{s}", seed=0, **SIZES[s])
            out[s] = asyncio.run(measure(md, base / f"run-{s}", steps, args.threads))
            print(s, {k: v for k, v in out[s].items() if not k.startswith("all_")}, file=sys.stderr)
            shutil.rmtree(base / f"run-{s}", ignore_errors=True)
            shutil.rmtree(md, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    cpu = cpu_model() or ""
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(), "cpu": cpu,
           "mem_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
           "load_start": load0, "load_end": os.getloadavg()[0], "python": platform.python_version(),
           "torch": torch.__version__, "threads": args.threads, "steps": steps, "samples": SAMPLES,
           "tokens": sum(len(t.token_ids) for t in trajectories(0)[1]),
           "total_s": time.time() - t0, "models": out}
    finish(res, not args.quick, RESULTS / "checkpoint_cost.json", "checkpoint_cost", section)


if __name__ == "__main__":
    main()
