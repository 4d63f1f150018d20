"""LoRA (``trainer.lora``) against full fine-tuning: s/step, trainer peak RSS, bytes per version.

::

    python benchmarks/lora.py [--quick] [--steps K] [--rank R] [--alpha A]

For each model (the quickstart's tiny Qwen3, and a wider one), runs the trainer's backend
(:class:`rollart.engines.torch_trainer.TorchTrainBackend`, 1 torch thread) once with full
fine-tuning and once with ``lora={rank, alpha}`` on the default targets (the attention and
MLP projections), each in a fresh child process so that its peak RSS is its own (full, then
LoRA), the same batch (the quickstart-shaped batch of ``trainer_ranks.py``: 64
samples, ~110 prompt tokens, 8 single-token actions with 6 environment tokens after each).
Per child (two steps): ``ru_maxrss`` after the steps (and after building the backend), the
bytes of one published version (``save_weights``: the adapter file, or every weight), of a
checkpoint (``torch.save`` of ``state_dict_for_checkpoint``), and the trainable parameters.
s/step is timed apart, both backends in this process taking the same steps alternately
(full, LoRA, full, ...), so that a shared machine's load falls on both alike: the median
after one warm-up each. Prints JSON, writes ``results/lora.json`` and its section of
``README.md``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, describe_machine, finish, render, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODELS = {"quickstart (h64, 2 layers)": {"hidden_size": 64, "num_layers": 2, "num_heads": 2,
                                         "num_kv_heads": 1, "intermediate_size": 128},
          "wider (h256, 4 layers)": {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768}}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def backend(model_dir: str | Path, variant: str, rank: int, alpha: float):
    from rollart.config.trainer import LORA_TARGETS
    from rollart.engines.torch_trainer import TorchTrainBackend

    lora = {"rank": rank, "alpha": alpha, "dropout": 0.0, "targets": list(LORA_TARGETS)}
    return TorchTrainBackend(model_dir, lr=1e-4, threads=1, seed=0, micro_batch_tokens=8192,
                             lora=lora if variant == "lora" else None)


def timed(model_dir: Path, steps: int, rank: int, alpha: float) -> dict:
    """s/step of both variants in this process, alternating; the median after a warm-up."""
    from trainer_ranks import batch

    from rollart.algos.losses import LossConfig

    bs = {v: backend(model_dir, v, rank, alpha) for v in ("full", "lora")}
    samples, cfg = batch(), LossConfig(entropy_coef=0.01)
    times: dict[str, list[float]] = {v: [] for v in bs}
    for i in range(steps + 1):
        for v, b in bs.items():
            t = time.perf_counter()
            b.train_step(samples, loss_cfg=cfg)
            if i:
                times[v].append(time.perf_counter() - t)
    return {v: {"s_per_step": statistics.median(ts), "all_s": ts} for v, ts in times.items()}


def child(model_dir: str, variant: str, steps: int, rank: int, alpha: float) -> dict:
    """One backend, ``steps`` steps; what the JSON line on stdout reports."""
    import torch
    from trainer_ranks import batch

    from rollart.algos.losses import LossConfig

    t0 = time.perf_counter()
    b = backend(model_dir, variant, rank, alpha)
    build_s, rss_built = time.perf_counter() - t0, _rss_mib()
    samples, cfg = batch(), LossConfig(entropy_coef=0.01)
    for _ in range(steps):
        b.train_step(samples, loss_cfg=cfg)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        b.save_weights(Path(d) / "v.safetensors")
        save_s = time.perf_counter() - t
        version_bytes = (Path(d) / "v.safetensors").stat().st_size
    buf = io.BytesIO()
    torch.save(b.state_dict_for_checkpoint(), buf)
    return {"variant": variant, "build_s": build_s, "rss_built_mib": rss_built, "rss_peak_mib": _rss_mib(),
            "version_bytes": version_bytes, "save_s": save_s, "checkpoint_bytes": buf.tell(),
            "params": sum(p.numel() for p in b.model.parameters()),
            "trainable": sum(p.numel() for p in b._params)}


def run_child(model_dir: Path, variant: str, steps: int, rank: int, alpha: float) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model_dir), "--variant", variant,
           "--steps", str(steps), "--rank", str(rank), "--alpha", str(alpha)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def section(res: dict) -> str:
    rows = [[name, v, f"{x['trainable'] / 1e6:.3f} M of {x['params'] / 1e6:.2f} M",
             f"{x['s_per_step']:.3f}", f"{x['rss_peak_mib']:.0f}", f"{x['version_bytes']:,}",
             f"{x['checkpoint_bytes']:,}"]
            for name, r in res["models"].items()
            for v, x in (("full", r["full"]), (f"LoRA r{res['rank']}", r["lora"]))]
    return render("lora", rank=res["rank"], alpha=f"{res['alpha']:g}", tokens=res["tokens"],
                  steps=res["steps"], torch=res["torch"], peft=res["peft"],
                  machine=describe_machine(res), date=res["when"][:10],
                  table=table(["model", "variant", "trained params", "s/step", "peak RSS MiB",
                               "bytes per version", "checkpoint bytes"], rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--quick", action="store_true", help="1 step, the tiny model only")
    ap.add_argument("--child")
    ap.add_argument("--variant", choices=["full", "lora"])
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.variant, args.steps, args.rank, args.alpha)))
        return
    import peft
    import torch

    from trainer_ranks import batch

    from rollart.engines.tiny import build_tiny_model

    steps = 1 if args.quick else args.steps
    t0, load0 = time.time(), os.getloadavg()[0]
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for name, shape in list(MODELS.items())[: 1 if args.quick else None]:
            md = build_tiny_model(Path(d) / name.split()[0], seed=0, **shape)
            out[name] = {v: run_child(md, v, 2, args.rank, args.alpha) for v in ("full", "lora")}
            for v, t in timed(md, steps, args.rank, args.alpha).items():
                out[name][v].update(t)
            print(name, json.dumps({v: {k: x for k, x in r.items() if k != "all_s"}
                                    for v, r in out[name].items()}), file=sys.stderr)
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
           "load_start": load0, "load_end": os.getloadavg()[0], "python": platform.python_version(),
           "torch": torch.__version__, "peft": peft.__version__, "steps": steps, "rank": args.rank,
           "alpha": args.alpha, "tokens": sum(len(s.token_ids) for s in batch()),
           "total_s": time.time() - t0, "models": out}
    finish(res, not args.quick, RESULTS / "lora.json", "lora", section)


if __name__ == "__main__":
    main()
