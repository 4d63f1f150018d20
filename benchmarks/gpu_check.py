"""GPU check of ``proxy.engine: sglang`` (run it through ``benchmarks/gpu_check.sh``).

::

    python benchmarks/gpu_check.py                 # the full check, about 5-8 minutes
    python benchmarks/gpu_check.py --quick         # smaller model and load (about 3 minutes)
    python benchmarks/gpu_check.py --help

On one CUDA GPU, with nothing downloaded:

1. **Model**: a random-init Qwen3 of about 0.5B parameters built locally
   (:func:`rollart.engines.tiny.build_tiny_model`: hidden 1024, 24 layers, 16 heads (8 kv,
   head size 64), MLP 4096, vocabulary 65536, float32 on disk, served in bfloat16); reused
   when the folder already holds it.
2. **Server**: :class:`rollart.engines.sglang_engine.SglangEngine` launches SGLang on it
   (CUDA graphs on, ``mem_fraction_static`` 0.7).
3. **Throughput**: ``--concurrency`` (256) closed-loop clients, each sending ``--waves``
   requests one after the other (``--prompt-len`` random tokens, ``--max-new-tokens`` at
   temperature 1; a random-init model almost never emits eos, so nearly every request
   generates them all): *SGLang alone* posts the very ``/generate`` bodies the engine sends,
   straight to the server over HTTP; *through the LLMProxy* sends ``GenerateRequest``
   messages on the in-process bus (``MemoryBus``) with a ``ServiceClient``, as 256
   trajectories of an EnvManager do, to an ``LLMProxy`` driving the same engine. Generated
   tokens per second of each, modes alternating (``--reps``), the prefix cache flushed before
   each; the ratio proxy / alone of the medians is the result (target >= 0.97).
4. **Weight updates**: ``pause("wait")``, ``load_weights``, ``resume()`` with the full state
   dict as bytes (written to disk, then ``/update_weights_from_disk``) and as a file path
   (linked, no copy); seconds of ``load_weights`` each, whether the greedy output follows
   the weights, and whether a state dict with a missing tensor is refused with the old
   weights still serving.
5. **Engine contract on CUDA**: the server is closed, then ``pytest tests/engines -k
   sglang`` runs (the contract suite shared by every engine and the SglangEngine tests).

Progress goes to stderr; one JSON summary to stdout (``--out FILE`` writes it too). Exit
status 0 when every check passes, 1 when one fails, 2 when the machine cannot run it (no
GPU, no sglang, no aiohttp): then the summary says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_RATIO = 0.97
T0 = time.monotonic()

FULL_MODEL = dict(vocab_size=65536, hidden_size=1024, num_layers=24, num_heads=16,
                  num_kv_heads=8, intermediate_size=4096, max_position_embeddings=4096)
QUICK_MODEL = dict(vocab_size=32768, hidden_size=512, num_layers=8, num_heads=8,
                   num_kv_heads=4, intermediate_size=2048, max_position_embeddings=4096)

from common import in_turn, sayer

say = sayer("gpu-check")


class Unfit(Exception):
    """This machine cannot run the check (exit 2)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Steps: model, server, throughput (SGLang alone vs through LLMProxy), weight "
               "updates, pytest tests/engines -k sglang. See the module docstring.")
    p.add_argument("--work-dir", default=os.environ.get("ROLLART_GPU_CHECK_DIR",
                                                        str(Path(tempfile.gettempdir())
                                                            / "rollart-gpu-check")),
                   help="model folder, staged weights and server log (kept; the model is "
                        "reused) [%(default)s]")
    p.add_argument("--sglang-python", default=os.environ.get("ROLLART_SGLANG_PYTHON"),
                   help="interpreter that has sglang (default: $ROLLART_SGLANG_PYTHON, else "
                        "this one)")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--waves", type=int, default=4, help="requests per client per measurement")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2, help="measurements per mode (alternating)")
    p.add_argument("--mem-fraction", type=float, default=0.7)
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock budget; pytest gets what is left [%(default)s]")
    p.add_argument("--quick", action="store_true",
                   help="a ~100M model, 2 waves, 1 repetition")
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument("--out", help="also write the JSON summary here")
    args = p.parse_args(argv)
    if args.quick:
        args.waves, args.reps = min(args.waves, 2), 1
    return args


# -- pure helpers (checked on CPU by bash -n / --self-test) ----------------------------------------
def model_spec(args: argparse.Namespace) -> dict:
    return dict(QUICK_MODEL if args.quick else FULL_MODEL)


def param_count(spec: dict) -> int:
    """Parameters of the Qwen3 :func:`build_tiny_model` builds with ``spec`` (untied)."""
    h, layers, v = spec["hidden_size"], spec["num_layers"], spec["vocab_size"]
    hd = h // spec["num_heads"]
    q, kv = spec["num_heads"] * hd, spec["num_kv_heads"] * hd
    attn = h * q + 2 * h * kv + q * h + 2 * hd  # q, k, v, o, q_norm, k_norm
    mlp = 3 * h * spec["intermediate_size"]
    return layers * (attn + mlp + 2 * h) + 2 * v * h + h


def prompts(n_clients: int, waves: int, length: int, vocab: int, avoid: tuple[int, ...],
            seed: int = 0) -> list[list[list[int]]]:
    """``[client][wave] -> prompt``: random token ids, none of the eos tokens."""
    rng = random.Random(seed)
    bad = set(avoid)
    pool = [t for t in range(3, min(vocab, 60000)) if t not in bad]
    return [[[rng.choice(pool) for _ in range(length)] for _ in range(waves)]
            for _ in range(n_clients)]


def pytest_counts(text: str) -> dict:
    """Counts of pytest's closing line (``3 passed, 1 skipped in 9.1s``)."""
    out = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", text):
        out["errors" if word.startswith("error") else word] = int(n)
    return out


def summarize_throughput(alone: list[float], proxy: list[float]) -> dict:
    a, p = statistics.median(alone), statistics.median(proxy)
    ratio = p / a if a else None
    return {"sglang_alone_tok_s": [round(x, 1) for x in alone],
            "through_proxy_tok_s": [round(x, 1) for x in proxy],
            "sglang_alone_median": round(a, 1), "through_proxy_median": round(p, 1),
            "ratio": round(ratio, 4) if ratio is not None else None, "target": TARGET_RATIO,
            "pass": ratio is not None and ratio >= TARGET_RATIO}


def self_test() -> None:
    """The CPU-side parts (what ``gpu_check.sh --self-test`` runs anywhere)."""
    from rollart.engines.base import GenInput
    from rollart.engines.sglang_protocol import generate_payload

    args = parse_args([])
    assert abs(param_count(model_spec(args)) / 1e9 - 0.51) < 0.01, param_count(model_spec(args))
    quick = parse_args(["--quick"])
    assert (quick.waves, quick.reps) == (2, 1) and param_count(model_spec(quick)) < 0.15e9
    ps = prompts(4, 2, 16, 65536, (0, 2))
    assert len(ps) == 4 and all(len(w) == 16 and 0 not in w and 2 not in w for c in ps for w in c)
    assert ps == prompts(4, 2, 16, 65536, (0, 2))
    assert pytest_counts("== 12 passed, 3 skipped, 1 error in 80.2s ==") == \
        {"passed": 12, "skipped": 3, "errors": 1}
    s = summarize_throughput([100.0, 110.0], [99.0, 107.0])
    assert s["ratio"] == round(103 / 105, 4) and s["pass"] is True
    body = generate_payload(GenInput(prompt_ids=ps[0][0], max_new_tokens=8), "r",
                            eos_token_ids=(2,))
    json.dumps(body)
    print(json.dumps({"self_test": "ok", "params_full": param_count(model_spec(args))}))


# -- preflight ------------------------------------------------------------------------------------
def preflight(args: argparse.Namespace) -> dict:
    info: dict = {"host": platform.node(), "python": sys.version.split()[0]}
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        gpus = [g.strip() for g in r.stdout.splitlines() if g.strip()] if r.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        gpus = []
    if not gpus:
        raise Unfit("no NVIDIA GPU here (nvidia-smi lists none): this check runs on a CUDA "
                    "machine")
    info["gpus"] = gpus
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise Unfit("aiohttp is missing: pip install -e '.[sglang]'") from None
    from rollart.engines.sglang_server import sglang_unavailable_reason

    why = sglang_unavailable_reason(args.sglang_python)
    if why is not None:
        raise Unfit(why)
    py = args.sglang_python or sys.executable
    r = subprocess.run([py, "-c", "import sglang, torch; print(sglang.__version__, "
                        "torch.__version__)"], capture_output=True, text=True, timeout=120)
    info["sglang"], info["torch_server"] = (r.stdout.split() + ["?", "?"])[:2]
    info["sglang_python"] = py
    return info


# -- steps --------------------------------------------------------------------------------------
def build_model(args: argparse.Namespace) -> tuple[Path, dict]:
    from rollart.engines.tiny import build_tiny_model

    spec = model_spec(args)
    out = Path(args.work_dir) / ("model-quick" if args.quick else "model-0.5b")
    t = time.perf_counter()
    build_tiny_model(out, seed=0, **spec)
    return out, {**spec, "params": param_count(spec), "build_s": round(time.perf_counter() - t, 1),
                 "dir": str(out)}


async def run_alone(url: str, eng, ps, max_new: int) -> tuple[float, int]:
    """SGLang alone: the engine's own ``/generate`` bodies, posted straight to the server."""
    import aiohttp

    from rollart.engines.base import GenInput
    from rollart.engines.sglang_protocol import generate_payload, parse_generate_response

    tokens = 0
    conn = aiohttp.TCPConnector(limit=len(ps) + 8, limit_per_host=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def client(c: int) -> None:
            nonlocal tokens
            for w, prompt in enumerate(ps[c]):
                body = generate_payload(GenInput(prompt_ids=prompt, max_new_tokens=max_new),
                                        f"alone-{c}-{w}-{uuid.uuid4().hex[:6]}",
                                        eos_token_ids=eng.eos_token_ids)
                async with session.post(url + "/generate", json=body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"/generate: HTTP {r.status}: {data}")
                tokens += len(parse_generate_response(data)[0])

        t = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(len(ps))))
        return time.perf_counter() - t, tokens


async def run_proxy(eng, model_dir: Path, ps, max_new: int) -> tuple[float, int]:
    """Through the LLMProxy: ``GenerateRequest`` messages on the MemoryBus, sent with a
    ServiceClient as an EnvManager's trajectories send them."""
    from rollart import messages as m
    from rollart.actors.kernel.base import Actor
    from rollart.actors.generate.proxy import LLMProxy
    from rollart.actors.kernel.service_client import ServiceClient
    from rollart.bus.memory import MemoryBus
    from rollart.node import Node

    class Driver(Actor):
        role = "driver"

    run = f"gpucheck{uuid.uuid4().hex[:6]}"
    bus = MemoryBus()
    await bus.connect()
    tokens = 0
    try:
        proxy = LLMProxy(run=run, name="gen-0", model_dir=str(model_dir), engine_obj=eng)
        async with Node(bus, [proxy], heartbeat_every=0):
            driver = Driver(run=run, name="driver")
            driver.bus = bus
            client = ServiceClient(driver, timeout=600.0, wait=120.0, retries=0)
            await client.start()
            sweeper = asyncio.ensure_future(client.run())
            try:
                async def trajectory(c: int) -> None:
                    nonlocal tokens
                    for w, prompt in enumerate(ps[c]):
                        res = await client.call("generate.request", m.GenerateRequest(
                            traj_id=f"g{c}-t{w}", prompt_ids=prompt,
                            sampling=m.SamplingParams(max_new_tokens=max_new,
                                                      temperature=1.0)))
                        tokens += len(res.token_ids)

                t = time.perf_counter()
                await asyncio.gather(*(trajectory(c) for c in range(len(ps))))
                wall = time.perf_counter() - t
            finally:
                sweeper.cancel()
                await client.stop()
    finally:
        await bus.close()
    return wall, tokens


async def throughput(args, eng, model_dir: Path) -> dict:
    ps = prompts(args.concurrency, args.waves, args.prompt_len, int(eng.vocab_size),
                 eng.eos_token_ids)
    say(f"warm-up: {args.concurrency} requests")
    await run_alone(eng.base_url, eng, [c[:1] for c in ps], 16)
    alone, proxy, walls = [], [], []
    for rep in range(args.reps):
        for mode in in_turn(("alone", "proxy"), rep):
            await eng.flush_cache()
            if mode == "alone":
                wall, tok = await run_alone(eng.base_url, eng, ps, args.max_new_tokens)
                alone.append(tok / wall)
            else:
                wall, tok = await run_proxy(eng, model_dir, ps, args.max_new_tokens)
                proxy.append(tok / wall)
            walls.append({"mode": mode, "wall_s": round(wall, 2), "tokens": tok})
            say(f"  {mode}: {tok} tokens in {wall:.2f}s = {tok / wall:,.0f} tok/s")
    out = summarize_throughput(alone, proxy)
    out.update(concurrency=args.concurrency, requests_per_measurement=args.concurrency * args.waves,
               prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
               runs=walls)
    return out


async def weight_updates(args, eng, model_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save

    from rollart.engines.base import GenInput

    path = model_dir / "model.safetensors"
    t = time.perf_counter()
    sd = load_file(str(path))
    g = torch.Generator().manual_seed(1)
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in sd.items()}
    data = save(new)
    del new
    say(f"  perturbed state dict ready ({len(data) / 1e9:.2f} GB, "
        f"{time.perf_counter() - t:.1f}s)")
    probe = GenInput(prompt_ids=list(range(10, 42)), max_new_tokens=16, greedy=True)
    before = await eng.generate(probe, "wprobe-0")
    out: dict = {"size_bytes": len(data), "bytes_s": [], "path_s": [], "pause_to_resume_s": []}
    version = eng.version
    changed = restored = True
    for rep in range(2 if not args.quick else 1):
        for kind, src in (("bytes", data), ("path", path)):
            version += 1
            t0 = time.perf_counter()
            await eng.pause("wait")
            t1 = time.perf_counter()
            await eng.load_weights(src, version)
            t2 = time.perf_counter()
            await eng.resume()
            out[f"{kind}_s"].append(round(t2 - t1, 3))
            out["pause_to_resume_s"].append(round(time.perf_counter() - t0, 3))
            got = await eng.generate(probe, f"wprobe-{version}")
            if kind == "bytes":
                changed &= got.token_ids != before.token_ids and got.version == version
            else:
                restored &= got.token_ids == before.token_ids and got.version == version
            say(f"  load_weights({kind}) v{version}: {t2 - t1:.2f}s")
    out["weights_effective"] = bool(changed and restored)
    bad = dict(sd)
    bad.pop(next(iter(bad)))
    try:
        await eng.load_weights(save(bad), version + 1)
        refused = False
    except ValueError:
        refused = eng.version == version
    still = await eng.generate(probe, "wprobe-after-refusal")
    out["mismatch_refused"] = bool(refused and still.token_ids == before.token_ids)
    out["bytes_median_s"] = statistics.median(out["bytes_s"])
    out["path_median_s"] = statistics.median(out["path_s"])
    return out


def contract_suite(args, budget_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests/engines", "-k", "sglang", "-q", "-rs",
           "-p", "no:cacheprovider"]
    env = dict(os.environ)
    if args.sglang_python:
        env["ROLLART_SGLANG_PYTHON"] = args.sglang_python
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=max(30.0, budget_s))
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                else (e.stdout or "")) + "\n[timed out]"
        rc = 124
    counts = pytest_counts(text.strip().splitlines()[-1] if text.strip() else "")
    ok = rc == 0 and counts.get("passed", 0) > 0 and not counts.get("failed")
    return {"cmd": " ".join(cmd[1:]), "rc": rc, **counts,
            "seconds": round(time.perf_counter() - t, 1), "pass": ok,
            "tail": "\n".join(text.strip().splitlines()[-25:])}


async def main_async(args, summary: dict) -> None:
    from rollart.engines.sglang_engine import SglangEngine

    say("building the model")
    model_dir, summary["model"] = build_model(args)
    say(f"model: {summary['model']['params'] / 1e9:.3f}B parameters in "
        f"{summary['model']['build_s']}s ({model_dir})")
    work = Path(args.work_dir)
    engine_args = {"dtype": "bfloat16", "mem_fraction_static": args.mem_fraction,
                   "startup_timeout_s": 300, "weights_dir": str(work / "weights"),
                   "log_file": str(work / "sglang-server.log")}
    if args.sglang_python:
        engine_args["python"] = args.sglang_python
    eng = SglangEngine(model_dir, seed=0, engine_args=engine_args)
    t = time.perf_counter()
    say("starting SGLang")
    await eng.start()
    try:
        summary["server"] = {"startup_s": round(time.perf_counter() - t, 1),
                             "sglang": eng.server_version, "raw_logprobs": eng.raw_logprobs,
                             "command": " ".join(eng.command or []), "log": str(eng.log_path)}
        say(f"server up in {summary['server']['startup_s']}s (sglang {eng.server_version}, "
            f"raw log-probs {eng.raw_logprobs})")
        say("throughput: SGLang alone vs through the LLMProxy")
        summary["throughput"] = await throughput(args, eng, model_dir)
        say(f"ratio proxy / alone = {summary['throughput']['ratio']}")
        say("weight updates")
        summary["weight_update"] = await weight_updates(args, eng, model_dir)
    finally:
        await eng.close()


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--self-test" in argv:
        self_test()
        return 0
    args = parse_args(argv)
    summary: dict = {"check": "sglang-gpu", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                     "quick": args.quick}
    rc = 0
    try:
        summary["machine"] = preflight(args)
        asyncio.run(main_async(args, summary))
        if not args.skip_pytest:
            left = args.budget_s - (time.monotonic() - T0)
            say(f"engine contract suite on CUDA (pytest tests/engines -k sglang, {left:.0f}s left)")
            summary["contract"] = contract_suite(args, left)
            say(f"pytest: rc {summary['contract']['rc']}, "
                f"{summary['contract'].get('passed', 0)} passed, "
                f"{summary['contract'].get('failed', 0)} failed, "
                f"{summary['contract'].get('skipped', 0)} skipped")
        checks = [summary["throughput"]["pass"], summary["weight_update"]["weights_effective"],
                  summary["weight_update"]["mismatch_refused"]]
        if "contract" in summary:
            checks.append(summary["contract"]["pass"])
        summary["ok"] = all(checks)
        rc = 0 if summary["ok"] else 1
    except Unfit as e:
        summary.update(ok=False, unfit=str(e))
        say(f"cannot run here: {e}")
        rc = 2
    except Exception as e:  # the summary still comes out, with the error
        summary.update(ok=False, error=f"{type(e).__name__}: {e}")
        say(f"failed: {type(e).__name__}: {e}")
        rc = 1
    summary["elapsed_s"] = round(time.monotonic() - T0, 1)
    text = json.dumps(summary, indent=2, default=str)
    print(text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
