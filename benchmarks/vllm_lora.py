"""A LoRA version served by ``proxy.engine: vllm-server`` as an adapter, against the same
model's merged full weights: bytes per version and the server's load time.

::

    PYTHONPATH=src:. <vLLM venv>/bin/python benchmarks/vllm_lora.py [--rank R] [--loads N]
        [--hidden H --layers L --intermediate I]

Builds a tiny Qwen3-layout model (default: the tests' h128, 4 layers; ``--hidden 768
--layers 12 --intermediate 2048`` is the 76M-parameter one of the field notes), a rank-``R``
adapter on every projection as the trainer publishes it (B random, so it changes the model)
and its merged full weights, starts one vLLM server (``enable_lora``), then loads the
adapter and the merged weights alternately ``N`` times each, every load between
``pause("wait")`` and ``resume()`` as a replica does, from the file's bytes (what a replica
fetched). Load time: the engine's ``load_weights`` call (adapter: check, peft folder written,
``/v1/load_lora_adapter``, previous adapter unloaded; full: check, staged file written,
``reload_weights``, prefix cache reset, version confirmed); median and min; and the first
request after it (4 greedy tokens: an adapter is moved into the server's LoRA slot there).
Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_versions(model_dir: Path, out: Path, rank: int) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rollart.config.trainer import LORA_TARGETS
    from rollart.engines import lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    pm = lora.wrap_model(model, rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    adapter, merged = out / "adapter.safetensors", out / "merged.safetensors"
    save_file(lora.adapter_tensors(pm), str(adapter),
              metadata=lora.adapter_metadata(rank, 2.0 * rank, LORA_TARGETS))
    save_file({k: v.contiguous() for k, v in lora.merged_tensors(pm).items()}, str(merged))
    return adapter, merged


async def measure(model_dir: Path, adapter: Path, merged: Path, rank: int, loads: int) -> dict:
    from rollart.engines import build_engine, lora_engine_args
    from rollart.engines.base import GenInput

    args = lora_engine_args("vllm-server", {"max_model_len": 512}, rank)
    eng = build_engine("vllm-server", str(model_dir), engine_args=args)
    await eng.start()
    times: dict[str, list[float]] = {"lora": [], "full": []}
    first: dict[str, list[float]] = {"lora": [], "full": []}
    try:
        data = {"lora": adapter.read_bytes(), "full": merged.read_bytes()}
        v = 0
        for _ in range(loads + 1):  # the first of each is a warm-up
            for kind in ("lora", "full"):
                v += 1
                await eng.pause("wait")
                t0 = time.perf_counter()
                try:
                    await eng.load_weights(data[kind], v)
                finally:
                    await eng.resume()
                times[kind].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = await eng.generate(GenInput([5, 6, 7], max_new_tokens=4, greedy=True), f"r{v}")
                first[kind].append(time.perf_counter() - t0)
                assert out.version == v
        start_s = eng.start_s
    finally:
        await eng.close()
    res = {"server_start_s": round(start_s or 0.0, 1), "loads": loads}
    for kind, path in (("lora", adapter), ("full", merged)):
        ts = times[kind][1:]
        res[kind] = {"bytes": path.stat().st_size, "load_s_median": round(statistics.median(ts), 4),
                     "load_s_min": round(min(ts), 4),
                     "first_request_s_median": round(statistics.median(first[kind][1:]), 4)}
    res["bytes_ratio_full_over_lora"] = round(merged.stat().st_size / adapter.stat().st_size, 1)
    res["load_ratio_full_over_lora"] = round(res["full"]["load_s_median"]
                                             / res["lora"]["load_s_median"], 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=256)
    a = ap.parse_args()
    from rollart.engines.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rollart-vllm-lora-") as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(tmp / "model", hidden_size=a.hidden, num_layers=a.layers,
                                     intermediate_size=a.intermediate)
        adapter, merged = make_versions(model_dir, tmp, a.rank)
        res = asyncio.run(measure(model_dir, adapter, merged, a.rank, a.loads))
    res["model"] = {"hidden": a.hidden, "layers": a.layers, "intermediate": a.intermediate,
                    "rank": a.rank}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
