"""Sharded trainer ranks (``trainer.shard: fsdp2``) against replicated ones (``shard: none``):
per-rank memory and step time at world size 1, 2 and 4, the same model and batches.

::

    python benchmarks/fsdp2.py [--quick] [--steps K] [--threads T] [--write | --no-write]

Each configuration runs in a fresh process (rank 0; ranks 1..N-1 are its children), so no
configuration's memory is left in another's: world size 1 replicated is the plain
:class:`rollart.engines.torch_trainer.TorchTrainBackend`; the others
:func:`rollart.engines.rank_launch.start_ranks` with ``shard`` none or fsdp2 (fsdp2 at world
size 1: a group of one). Each takes one warm-up step and ``K`` measured ones (median s/step),
then reads every rank's ``VmRSS`` (resident now, after the steps: the training state) and
``VmHWM`` (the peak since the process started: loading the whole model included) from
``/proc``, and rank 0's local elements of the parameters and of the AdamW moments.
Every process runs with ``MALLOC_MMAP_THRESHOLD_=65536`` and ``MALLOC_TRIM_THRESHOLD_=0``:
glibc gives freed tensors back to the system, so RSS is what a rank holds, not the high-water
mark of its allocator's heap. Full: a 24 M-parameter Qwen3 (h512, 8 layers; fp32 training state 16 bytes a parameter,
~0.38 GB); ``--quick``: the tiny one, world sizes 1 and 2, one step (writes nothing).
Prints JSON; a full run writes ``results/fsdp2.json`` and its section of ``README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import RESULTS, add_run_flags, begin, describe_machine, finish, render, table, writes

FULL = {"hidden_size": 512, "num_layers": 8, "intermediate_size": 1408}
QUICK = {"hidden_size": 128, "num_layers": 4, "intermediate_size": 256}
CONFIGS = [("none", 1), ("fsdp2", 1), ("none", 2), ("fsdp2", 2), ("none", 4), ("fsdp2", 4)]


def _proc_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def child(args: argparse.Namespace) -> None:
    """One configuration, in this process (rank 0): its numbers as JSON on stdout."""
    import torch

    from rollart.algos.losses import LossConfig
    from rollart.engines.rank_launch import start_ranks
    from rollart.engines.torch_trainer import TorchTrainBackend
    from trainer_ranks import batch

    kw = {"lr": 1e-4, "threads": args.threads, "seed": 0,
          "micro_batch_tokens": args.micro_batch_tokens}
    t0 = time.perf_counter()
    if args.shard == "none" and args.world_size == 1:
        b = TorchTrainBackend(args.model_dir, **kw)
    else:
        b = start_ranks(args.model_dir, world_size=args.world_size, dist_timeout=600,
                        shard=args.shard, log_dir=args.logs, **kw)
    start_s = time.perf_counter() - t0
    samples, cfg = batch(args.samples), LossConfig()
    times = []
    try:
        for i in range(args.steps + 1):
            t = time.perf_counter()
            b.train_step(samples, loss_cfg=cfg)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t)
        pids = [os.getpid(), *(p.pid for p in getattr(b, "procs", {}).values())]
        rss = [_proc_kb(p, "VmRSS") / 1024 for p in pids]
        hwm = [_proc_kb(p, "VmHWM") / 1024 for p in pids]
        params = [p for p in b.model.parameters() if p.requires_grad]
        local = getattr(b, "local_elements", None)
        full = sum(p.numel() for p in params)
        out = {"shard": args.shard, "world_size": args.world_size, "params": full,
               "local_params": local("params") if local else full,
               "local_optimizer": local("optimizer") if local else sum(
                   v.numel() for st in b.optimizer.state.values() for k, v in st.items()
                   if k != "step"),
               "s_per_step": statistics.median(times), "all_s": times, "start_s": start_s,
               "rss_mib": rss, "hwm_mib": hwm, "tokens": sum(len(s.token_ids) for s in samples),
               "threads": torch.get_num_threads()}
    finally:
        if hasattr(b, "shutdown"):
            b.shutdown()
    print(json.dumps(out))


def section(res: dict) -> str:
    rows = []
    for r in res["runs"]:
        state = (2 * r["local_params"] + r["local_optimizer"]) * 4 / 2**20  # fp32: weight, grad, moments
        rows.append([r["shard"], r["world_size"], f"{r['s_per_step']:.2f}", f"{state:.0f}",
                     f"{max(r['rss_mib']):.0f}", f"{statistics.mean(r['rss_mib']):.0f}",
                     f"{max(r['hwm_mib']):.0f}",
                     f"{r['local_optimizer'] / 1e6:.1f} M", f"{r['local_params'] / 1e6:.1f} M"])
    first = res["runs"][0]
    return render("fsdp2", params=f"{first['params'] / 1e6:.1f} M", samples=res["config"]["samples"],
                  tokens=first["tokens"], steps=res["config"]["steps"],
                  threads=res["config"]["threads"], machine=describe_machine(res["machine"]),
                  date=res["timestamp"][:10],
                  mbt=res["config"]["micro_batch_tokens"],
                  table=table(["shard", "world size", "s/step", "training state per rank (MiB)",
                               "RSS, largest rank (MiB)",
                               "RSS, mean of ranks (MiB)", "peak RSS, largest rank (MiB)",
                               "AdamW state per rank (elements)", "parameters per rank"], rows))


def main() -> int:
    ap = argparse.ArgumentParser()
    add_run_flags(ap, "the tiny model, world sizes 1 and 2, one step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="small: the activations of a micro-batch stay below the training state")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shard", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--logs", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.quick:
        args.steps, args.samples = 1, 4
    res = begin("fsdp2", args, ("steps", "threads", "samples", "micro_batch_tokens", "quick"))
    from rollart.engines.tiny import build_tiny_model

    runs = []
    with tempfile.TemporaryDirectory() as d:
        md = build_tiny_model(Path(d) / "model", seed=0, **(QUICK if args.quick else FULL))
        for shard, ws in CONFIGS:
            if args.quick and ws > 2:
                continue
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
            cmd = [sys.executable, __file__, "--child", "--shard", shard, "--world-size", str(ws),
                   "--model-dir", str(md), "--logs", str(Path(d) / "logs"), "--steps",
                   str(args.steps), "--threads", str(args.threads), "--samples", str(args.samples),
                   "--micro-batch-tokens", str(args.micro_batch_tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
            if out.returncode != 0:
                raise SystemExit(f"{shard} at world size {ws} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(shard, ws, {k: v for k, v in r.items() if k != "all_s"}, file=sys.stderr, flush=True)
            runs.append(r)
    res["runs"] = runs
    return finish(res, writes(args), RESULTS / "fsdp2.json", "fsdp2", section)


if __name__ == "__main__":
    raise SystemExit(main())
