"""Trainer step time against ``trainer.world_size``: 1 rank vs 2 ranks (gloo), same batches.

::

    python benchmarks/trainer_ranks.py [--quick] [--steps K] [--threads T]

For each model (the quickstart's tiny Qwen3, and a wider one where compute outweighs the
all-reduce), builds one :class:`rollart.engines.torch_trainer.TorchTrainBackend` (world size
1) and one :func:`rollart.engines.trainer_ranks.start_ranks` group (world size 2: rank 0 in
this process, rank 1 a child process), each with ``T`` torch threads per process, and takes
the same steps on both, alternating (1, 2, 1, 2, ...) so that the load of a shared machine
falls on both alike. The batch: 64 samples shaped like the quickstart's (a prompt of ~110
tokens, 8 single-token actions with environment tokens between them), token-mean.
Reports the median s/step of each (after one warm-up step), the speed-up, and the largest
parameter difference between the two after the steps (float round-off of the all-reduce).
Prints JSON, writes ``results/trainer_ranks.json`` and its section of ``README.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from common import RESULTS, cpu_model, describe_machine, finish, render, table

from rollart.algos.losses import LossConfig
from rollart.engines.tiny import build_tiny_model
from rollart.engines.torch_trainer import TorchTrainBackend
from rollart.engines.train_samples import TrainSample
from rollart.engines.rank_launch import start_ranks

MODELS = {"quickstart tiny (h128, 4 layers)": {"hidden_size": 128, "num_layers": 4, "intermediate_size": 256},
          "wider (h512, 6 layers)": {"hidden_size": 512, "num_layers": 6, "intermediate_size": 1408}}


def batch(n: int = 64, vocab: int = 512, seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (100 + i % 20,), generator=g).tolist()
        mask = [0] * len(ids)
        for _ in range(8):  # an action token, then ~6 environment tokens
            ids.append(int(torch.randint(3, vocab, (1,), generator=g)))
            mask.append(1)
            env = torch.randint(3, vocab, (6,), generator=g).tolist()
            ids += env
            mask += [0] * len(env)
        lp = (-1.4 + 0.1 * torch.rand(len(ids), generator=g)).tolist()
        out.append(TrainSample(ids, mask, lp, advantage=1.0 if i % 3 else -1.0))
    return out


def measure(model_dir: Path, steps: int, threads: int, logs: Path) -> dict:
    kw = {"lr": 1e-4, "threads": threads, "seed": 0, "micro_batch_tokens": 8192}
    one = TorchTrainBackend(model_dir, **kw)
    t0 = time.perf_counter()
    two = start_ranks(model_dir, world_size=2, dist_timeout=120, log_dir=logs, **kw)
    start_s = time.perf_counter() - t0
    samples, cfg = batch(), LossConfig()
    times: dict[int, list[float]] = {1: [], 2: []}
    try:
        for i in range(steps + 1):
            for ws, b in ((1, one), (2, two)):
                t = time.perf_counter()
                b.train_step(samples, loss_cfg=cfg)
                if i:  # the first is a warm-up
                    times[ws].append(time.perf_counter() - t)
        diff = max((p - q).abs().max().item() for p, q in
                   zip(one.model.parameters(), two.model.parameters()))
    finally:
        two.shutdown()
    n_params = sum(p.numel() for p in one.model.parameters())
    med = {ws: statistics.median(v) for ws, v in times.items()}
    return {"params": n_params, "tokens": sum(len(s.token_ids) for s in samples),
            "samples": len(samples), "s_per_step_ws1": med[1], "s_per_step_ws2": med[2],
            "speedup": med[1] / med[2], "all_ws1": times[1], "all_ws2": times[2],
            "rank_start_s": start_s, "max_param_diff": diff}


def section(res: dict) -> str:
    rows = [[name, f"{r['params'] / 1e6:.2f} M", f"{r['s_per_step_ws1']:.3f}",
             f"{r['s_per_step_ws2']:.3f}", f"{r['speedup']:.2f}x", f"{r['max_param_diff']:.1e}",
             f"{r['rank_start_s']:.1f}"] for name, r in res["models"].items()]
    return render("trainer_ranks", threads=res["threads"], samples=res["samples"],
                  tokens=res["tokens"], steps=res["steps"], machine=describe_machine(res),
                  date=res["when"][:10],
                  table=table(["model", "parameters", "world size 1 (s/step)",
                               "world size 2 (s/step)", "speed-up", "max param diff",
                               "rank 1 start (s)"], rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2 steps, the tiny model only")
    args = ap.parse_args()
    steps = 2 if args.quick else args.steps
    t0 = time.time()
    load0 = os.getloadavg()[0]
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for name, shape in list(MODELS.items())[: 1 if args.quick else None]:
            md = build_tiny_model(Path(d) / name.split()[0], seed=0, **shape)
            out[name] = measure(md, steps, args.threads, Path(d) / "logs")
            print(name, {k: v for k, v in out[name].items() if not k.startswith("all_")}, file=sys.stderr)
    cpu = cpu_model() or ""
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(), "cpu": cpu,
           "load_start": load0, "load_end": os.getloadavg()[0], "python": platform.python_version(),
           "torch": torch.__version__, "threads": args.threads, "steps": steps,
           "samples": 64, "tokens": sum(len(s.token_ids) for s in batch()),
           "total_s": time.time() - t0, "models": out}
    finish(res, not args.quick, RESULTS / "trainer_ranks.json", "trainer_ranks", section)


if __name__ == "__main__":
    main()
