"""``trainer.backend: megatron`` against ``torch``: seconds per train step on the same batch.

::

    python benchmarks/megatron_backend.py            # 2 models x 3 rounds x 5 steps; README + JSON
    python benchmarks/megatron_backend.py --quick    # 1 model, 1 round x 2 steps; prints JSON only

For each model (Qwen3 layouts from :func:`rollart.engines.tiny.build_tiny_model`: the
quickstart's, hidden 64 x 2 layers, and a wider one, hidden 256 x 4 layers), builds a
:class:`TorchTrainBackend` and a :class:`MegatronTrainBackend` on the same HF folder (one
process, 1 torch thread each, CPU) and times, interleaved round by round (order reversed
every other round): ``train_step`` on one fixed batch of 32 trajectories x 96 tokens
(half response, quickstart loss settings), ``token_logprobs`` on it, and ``weights_digest``
(which for megatron includes converting the weights back to HF names). Reports medians, the
loss of the first step of each backend (they should agree), the build time and the load
average (the machine is a shared 2-core one). Writes ``benchmarks/results/megatron_backend.json``
and the ``megatron`` section of ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from common import RESULTS as RESULTS_DIR, finish, in_turn, render, table

RESULTS = RESULTS_DIR / "megatron_backend.json"
MODELS = {"quickstart (h64 x 2)": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                             intermediate_size=128),
          "wider (h256 x 4)": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                         intermediate_size=768)}


def batch(n: int = 32, length: int = 96, vocab: int = 512, seed: int = 0):
    import torch

    from rollart.engines.train_samples import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        half = length // 2
        out.append(TrainSample(ids, [0] * half + [1] * (length - half), [-2.0] * length,
                               1.0 if i % 2 else -1.0))
    return out


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def bench_model(name: str, tiny: dict, rounds: int, steps: int, folder: Path) -> dict:
    from safetensors.torch import load_file

    from rollart.algos.losses import LossConfig
    from rollart.engines.megatron_trainer import MegatronTrainBackend
    from rollart.engines.tiny import build_tiny_model
    from rollart.engines.torch_trainer import TorchTrainBackend

    model_dir = build_tiny_model(folder / name.split()[0], seed=0, **tiny)
    params = sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
    kw = dict(lr=3e-3, grad_clip=1.0, threads=1, seed=0, micro_batch_tokens=8192)
    loss = LossConfig(old_logp="recompute", entropy_coef=0.01, agg="token-mean")
    samples = batch()
    build, backends = {}, {}
    for key, cls in (("torch", TorchTrainBackend), ("megatron", MegatronTrainBackend)):
        build[key], backends[key] = timed(lambda cls=cls: cls(model_dir, **kw))
    first_loss = {k: be.train_step(samples, loss_cfg=loss)["loss"] for k, be in backends.items()}  # warm-up
    times = {k: {"train_step": [], "token_logprobs": [], "weights_digest": []} for k in backends}
    for r in range(rounds):
        order = in_turn(list(backends), r)
        for key in order:
            be = backends[key]
            for _ in range(steps):
                times[key]["train_step"].append(timed(lambda be=be: be.train_step(samples, loss_cfg=loss))[0])
            times[key]["token_logprobs"].append(timed(lambda be=be: be.token_logprobs(samples))[0])
            times[key]["weights_digest"].append(timed(be.weights_digest)[0])
    out = {"params": params, "loss_first_step": first_loss,
           "loss_abs_diff": abs(first_loss["torch"] - first_loss["megatron"])}
    for key in backends:
        out[key] = {"build_s": round(build[key], 3),
                    **{f"{m}_s": round(statistics.median(v), 4) for m, v in times[key].items()}}
    out["megatron_over_torch_train_step"] = round(out["megatron"]["train_step_s"] / out["torch"]["train_step_s"], 3)
    return out


def section(res: dict) -> str:
    rows = [[name, f"{m['params']:,}", key, f"{m[key]['train_step_s']:.3f}",
             f"{m[key]['token_logprobs_s']:.3f}", f"{m[key]['weights_digest_s']:.4f}",
             f"{m[key]['build_s']:.2f}",
             f"{m['megatron_over_torch_train_step']:.2f}x" if key == "megatron" else None]
            for name, m in res["models"].items() for key in ("torch", "megatron")]
    return render("megatron", batch=res["batch"], rounds=res["rounds"], steps=res["steps"],
                  diff=f"{max(m['loss_abs_diff'] for m in res['models'].values()):.1e}",
                  megatron_core=res["megatron_core"], torch=res["torch"],
                  load=f"{res['loadavg'][0]:.2f} -> {res['loadavg_after'][0]:.2f}",
                  table=table(["model", "params", "backend", "train step s", "logprobs s",
                               "digest s", "build s", "megatron / torch step"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 model, 1 round x 2 steps, JSON only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import megatron.core
    import torch

    torch.set_num_threads(1)
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    res = {"batch": "32 trajectories x 96 tokens, half response", "rounds": rounds, "steps": steps,
           "torch": torch.__version__, "megatron_core": megatron.core.__version__,
           "loadavg": os.getloadavg(), "models": {}}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        for name, tiny in models.items():
            res["models"][name] = bench_model(name, tiny, rounds, steps, Path(d))
    res["loadavg_after"] = os.getloadavg()
    res["wall_s"] = round(time.time() - t0, 1)
    finish(res, not args.quick, RESULTS, "megatron", section)


if __name__ == "__main__":
    main()
