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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from readme_section import markers, replace_section

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
    begin, end = markers("checkpoint_cost")
    rows = []
    for r in res["models"].values():
        st = r["step_s"]
        rows.append(
            f"| {r['params'] / 1e9:.2f} B | {r['checkpoint_bytes'] / 1e9:.2f} | {st:.2f} "
            f"| {r['state_s'] * 1e3:.1f} ms ({100 * r['state_s'] / st:.2f} %) "
            f"| {r['full_blocking_s']:.2f} ({100 * r['full_blocking_s'] / st:.0f} %) "
            f"| {r['full_async_block_s']:.2f} ({100 * r['full_async_block_s'] / st:.0f} %) "
            f"| {r['full_async_write_s']:.2f} | {r['step_during_write_s']:.2f} "
            f"| **{100 * r['full_blocking_s'] / st:.0f} % → {100 * _async_every(r, 10) / st:.1f} %** "
            f"| {100 * (r['state_s'] + r['full_blocking_s'] / 10) / st:.1f} % |")
    table = "\n".join(rows)
    return f"""{begin}
## Checkpoint cost against model size (`checkpoint_cost.py`)

`python benchmarks/checkpoint_cost.py [--quick] [--sizes 0.1,0.5] [--steps K] [--threads T]`
builds random-init Qwen3-layout models (`rollart.engines.tiny`, vocab 512) and, with the
trainer's own `TorchTrainBackend` (fp32, AdamW) and `Checkpoints` over a run folder on the
local disk, measures: a training step ({res['samples']} samples, {res['tokens']} tokens,
token-mean; median of {res['steps']} after a warm-up); the durable state (one step's journal
record, {res['samples']} `rollout.completed` messages, and `state.json`, each fsynced); the
full checkpoint written blocking (`torch.save` of the live state, fsynced: what every step
paid before) and in the background (`start_full`: the step waits for the copy to CPU memory,
then a thread writes while the next step trains).

Last run {res['when']}: {res['cpus']} CPUs ({res['cpu']}), {res['mem_gb']:.0f} GB memory, load
{res['load_start']:.2f} at start, {res['load_end']:.2f} at end, Python {res['python']}, torch
{res['torch']}, {res['threads']} torch thread(s); total {res['total_s']:.0f} s.

| parameters | full checkpoint (GB) | step (s) | durable state per step (share of the step) | full, blocking (s, share) | full, async: step waits (s, share) | async write (s) | step during the write (s) | share per step: blocking full every step → async every 10 | blocking every 10 |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{table}

The *share per step* column is the checkpoint's share of a step before (a blocking full
checkpoint every step, the old default) and now (the durable state every step, plus a tenth
of the copy to CPU memory and of the slowdown of the step that trains during the write, with
the default `trainer.full_checkpoint_every: 10`); the last column is the same spacing with
blocking writes, for comparison. A full checkpoint is 16 bytes a parameter (weights, two
AdamW moments, fp32) plus the step counters; the durable state does not grow with the model
(one step's journal record: {_kb(res, 'record_bytes')} kB, `state.json`: {_kb(res, 'state_bytes')} kB).
Most of the gain is the spacing. On this 2-core CPU machine the background write competes
with the step for the cores and for memory (the copy to CPU memory is one more copy of model
and moments in host memory), so the step that trains during the write
is slower, and here that slowdown costs more than a blocking write; on a host whose step
runs on a GPU the write competes with it for little (not measured here: no GPU was lent to
this task). Step times on this shared machine vary by tens of percent from step to step.
Raw numbers: `benchmarks/results/checkpoint_cost.json`.
{end}"""


def _kb(res: dict, key: str) -> str:
    return f"{max(r[key] for r in res['models'].values()) / 1e3:.1f}"


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
        replace_section("checkpoint_cost", section(json.loads((HERE / "results" / "checkpoint_cost.json").read_text())))
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
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(), "cpu": cpu,
           "mem_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
           "load_start": load0, "load_end": os.getloadavg()[0], "python": platform.python_version(),
           "torch": torch.__version__, "threads": args.threads, "steps": steps, "samples": SAMPLES,
           "tokens": sum(len(t.token_ids) for t in trajectories(0)[1]),
           "total_s": time.time() - t0, "models": out}
    print(json.dumps(res, indent=2))
    if not args.quick:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "checkpoint_cost.json").write_text(json.dumps(res, indent=2))
        replace_section("checkpoint_cost", section(res))


if __name__ == "__main__":
    main()
