"""Weight sync at real sizes: streamed versions (buckets), deltas, and the paths they travel.

::

    python benchmarks/weight_sync.py [--quick] [--sizes 0.1,0.5,1.5] [--bucket-mb 64]
    python benchmarks/weight_sync.py --deltas [--delta-size 0.5-40]

Random-init Qwen3-layout models from the tiny builder (its 512-token vocabulary; the layers
of Qwen3-0.6B and -1.7B, so ~0.1B, ~0.44B and ~1.4B parameters: nothing is downloaded),
each in fp32 and bf16 serving dtype (the trainer keeps fp32 masters either way). Per model
and dtype, in fresh child processes so that each peak RSS is its own:

- **trainer** (:func:`trainer_child`): the fp32 model and AdamW; version 0 published as a
  full anchor, then from the same weights one real optimizer step (a causal-LM loss on a
  random batch, fresh AdamW: Adam's first step moves every weight by about ``lr``) at each
  learning rate, each published as a delta over version 0. Per version: publish seconds
  (cast, encode, compress, write every bucket and the manifest), bytes on the wire,
  changed-element fraction, the peak RSS during the publish above the RSS before it.
- **generator** (:func:`generator_child`): rollart's torch engine holding version 0 in the
  serving dtype, then each version assembled (fetch, check, decode into a staged file whose
  content digest must be the published one) and loaded, over each path: ``shm`` (the
  trainer's folder in ``/dev/shm``), ``tcp`` (the same folder served by
  :class:`rollart.engines.weight_tcp_server.WeightServer`, read over loopback) and ``object``
  (the NATS object store of an embedded server). Per version: fetch+assemble seconds, load
  seconds (the engine is paused for the load only: the generation pause of
  ``proxy.on_update: wait``), and the peak RSS above the RSS before.

``--deltas`` (issue 45 §2, :func:`measure_deltas`, README section ``weight_delta``): one
model in bf16 over ``tcp``, the generator following versions as a replica does
(:class:`rollart.actors.generate.policy.StreamStage`: each version the base of the next,
deltas patched into the held staged file in place and only their changed tensors loaded):
v0 a full anchor, v1 and v2 near-empty deltas (one element of one tensor each: wire size far
under 1% of full), v3 and v4 full anchors (v4: the steady state, written over a spare). Per
version: fetch+assembly seconds, load seconds (the pause), bytes fetched and written.
``--quick`` runs it too at 0.1B (and writes nothing).

The machine's limits, measured in the same run: ``memcpy`` (numpy copy of 256 MiB) and
loopback TCP (one thread each side, 8 MiB ``sendall``/``recv_into``, 1 GiB). Prints JSON,
writes ``results/weight_sync.json`` and its section of ``README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from common import RESULTS, describe_machine, finish, render, replace_section, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODELS = {
    "0.1": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4,
            "intermediate_size": 2048},  # the 76M model of NOTES.md
    "0.5": {"hidden_size": 1024, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8,
            "intermediate_size": 3072},  # Qwen3-0.6B's layers
    "1.5": {"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8,
            "intermediate_size": 6144},  # Qwen3-1.7B's layers
    "0.5-40": {"hidden_size": 1024, "num_layers": 40, "num_heads": 16, "num_kv_heads": 8,
               "intermediate_size": 3072},  # Qwen3-0.6B's layer, 40 of them: 0.50B parameters
}
QUICKSTART_LR = 3e-3
LRS = (1e-6, 1e-5, QUICKSTART_LR)
"""Learning rates of the deltas: typical RL fine-tuning of a real LLM, and the quickstart's."""
MODEL_CACHE = Path(tempfile.gettempdir()) / "rollart-bench-weight-sync"


# ======================================================================================
# The machine's limits
# ======================================================================================
def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    import numpy as np

    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, nbytes / (time.perf_counter() - t))
    return best / 1e9


def tcp_gbps(nbytes: int = 1 << 30, chunk: int = 8 << 20) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def send() -> None:
        c, _ = srv.accept()
        buf, left = b"\0" * chunk, nbytes
        while left > 0:
            c.sendall(buf[:min(chunk, left)])
            left -= chunk
        c.close()

    th = threading.Thread(target=send)
    th.start()
    s = socket.create_connection(("127.0.0.1", port))
    mv, got = memoryview(bytearray(chunk)), 0
    t = time.perf_counter()
    while got < nbytes:
        n = s.recv_into(mv)
        if not n:
            break
        got += n
    dt = time.perf_counter() - t
    th.join()
    s.close()
    srv.close()
    return got / dt / 1e9


# ======================================================================================
# Memory: the peak RSS of a phase above the RSS before it (Linux: clear_refs resets VmHWM)
# ======================================================================================
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakAbove:
    def __enter__(self) -> PeakAbove:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.before = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.mib = (_status_kib("VmHWM") - self.before) / 1024


def resident(model) -> None:
    """Make the model's weights resident, private memory before anything is measured:
    transformers maps a safetensors file whose dtype matches, so the first write into a
    weight (an optimizer step, a load) would otherwise count the model itself as extra."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1)


# ======================================================================================
# Children
# ======================================================================================
def trainer_child(model_dir: str, dtype: str, store: str, base_out: str, bucket_mb: int,
                  lrs: list[float], optimizer: str) -> dict:
    """Publish version 0, then one delta per learning rate (from version 0's weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollart.engines.weight_encode import TorchTensors, TrainerBase, write_version
    from rollart.engines.weight_staging import retire
    from rollart.engines.weight_blobs import DirBlobs

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    resident(model)
    params = sum(p.numel() for p in model.parameters())
    blobs = DirBlobs(store)
    out: dict = {"params": params, "versions": []}
    base_path = Path(base_out)

    def publish(version: int, base: TrainerBase | None, lr: float | None) -> TrainerBase:
        nxt = base_path.with_name(f"v{version}.safetensors")
        with PeakAbove() as mem:
            t = time.perf_counter()
            man, name = asyncio.run(write_version(
                blobs, TorchTensors(model.state_dict(), dtype), version=version, dtype=dtype,
                bucket_bytes=bucket_mb << 20, base=base, delta=base is not None,
                anchor_every=1 << 30, base_out=nxt))
            dt = time.perf_counter() - t
        s = man.stats
        out["versions"].append({"version": version, "lr": lr, "kind": man.kind, "name": name,
                                "digest": man.digest, "publish_s": dt, "wire_bytes": s.wire_bytes,
                                "full_bytes": s.full_bytes, "changed": s.changed / s.total,
                                "buckets": len(man.buckets), "rss_above_mib": mem.mib})
        print(f"  trainer v{version} {man.kind} lr={lr}: {dt:.2f}s, {s.wire_bytes / 1e6:.1f} of "
              f"{s.full_bytes / 1e6:.1f} MB, changed {s.changed / s.total:.4f}, "
              f"+{mem.mib:.0f} MiB", file=sys.stderr, flush=True)
        if base is not None:  # only v0 is a base here; the trainer retires the others too
            retire(nxt)
        return TrainerBase(nxt, version, man.digest, man.anchor if man.kind == "delta" else version)

    v0 = publish(0, None, None)
    keep = {k: v.detach().clone() for k, v in model.state_dict().items()} if len(lrs) > 1 else None
    vocab = model.config.vocab_size
    for i, lr in enumerate(lrs):
        if keep is not None and i:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(keep[k])
        opt = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0) if optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=lr))
        ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(i))
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del opt
        out.setdefault("step_s", []).append(time.perf_counter() - t)
        publish(i + 1, v0, lr)
    # one more anchor, now that both sides have a spare staged file to write over: a full
    # version in the steady state (version 0 was each side's first, into new pages)
    publish(len(lrs) + 1, None, None)
    return out


def generator_child(model_dir: str, dtype: str, transport: str, where: str, versions: list[dict],
                    stage: str) -> dict:
    """Hold version 0 in the engine, then assemble and load each version over ``transport``."""
    from rollart.engines.torch_engine import TorchGenerationEngine
    from rollart.engines.weight_decode import Assembled, assemble_version
    from rollart.engines.weight_staging import retire
    from rollart.engines.weight_blobs import DirBlobs, ObjectBlobs

    eng = TorchGenerationEngine(model_dir, dtype=dtype, threads=2, kv_cache_mb=0)
    resident(eng.model)
    out: list[dict] = []

    async def run() -> None:
        bus = None
        if transport in ("shm", "file"):
            blobs = DirBlobs(where, reuse=True)
        elif transport == "tcp":
            from rollart.engines.weight_tcp_client import TcpBlobs, parse_tcp_uri

            host, port, token, _ = parse_tcp_uri(where + "/x")
            blobs = TcpBlobs(host, port, token)
        else:
            from rollart.bus.nats import NatsBus

            url, bucket = where.split("|")
            bus = NatsBus(url, name="bench-generator")
            await bus.connect()
            blobs = ObjectBlobs(await bus.object_store(bucket), bucket)
        base: Assembled | None = None
        for v in versions:
            with PeakAbove() as mem:
                t = time.perf_counter()
                got, info = await assemble_version(blobs, v["name"], stage, base=base, digest=v["digest"])
                fetch_s = time.perf_counter() - t
                t = time.perf_counter()
                await asyncio.to_thread(eng.load_weights, got.path, v["version"])
                load_s = time.perf_counter() - t
            out.append({"version": v["version"], "kind": v["kind"], "path": info["path"],
                        "fetch_s": fetch_s, "load_s": load_s, "wire_bytes": info["wire_bytes"],
                        "rss_above_mib": mem.mib})
            print(f"  generator {transport} v{v['version']} ({info['path']}): fetch {fetch_s:.2f}s "
                  f"load {load_s:.2f}s +{mem.mib:.0f} MiB", file=sys.stderr, flush=True)
            if base is None:
                base = got  # version 0: the base of every delta here
            else:
                retire(got.path)  # as a replica does with the version it held before
        if bus is not None:
            await bus.close()

    asyncio.run(run())
    return {"versions": out}


def trainer_touch_child(model_dir: str, store: str, base_out: str, bucket_mb: int) -> dict:
    """v0 a full anchor; v1, v2: one element of one tensor changed, each a delta over the
    version before; v3, v4: full anchors (bf16 serving dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollart.engines.weight_blobs import DirBlobs
    from rollart.engines.weight_encode import TorchTensors, TrainerBase, write_version
    from rollart.engines.weight_staging import retire

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    resident(model)
    blobs = DirBlobs(store)
    out: dict = {"params": sum(p.numel() for p in model.parameters()), "versions": []}
    names = ["model.norm.weight", "model.layers.0.input_layernorm.weight"]
    base: TrainerBase | None = None
    for version in range(5):
        if version in (1, 2):
            with torch.no_grad():
                model.get_parameter(names[version - 1]).view(-1)[0] += 0.5
        nxt = Path(base_out).with_name(f"v{version}.safetensors")
        t = time.perf_counter()
        man, name = asyncio.run(write_version(
            blobs, TorchTensors(model.state_dict(), "bfloat16"), version=version, dtype="bfloat16",
            bucket_bytes=bucket_mb << 20, base=base if version in (1, 2) else None, delta=True,
            anchor_every=1 << 30, base_out=nxt))
        dt = time.perf_counter() - t
        if base is not None:
            retire(base.path)
        base = TrainerBase(nxt, version, man.digest, man.anchor)
        s = man.stats
        out["versions"].append({"version": version, "kind": man.kind, "name": name,
                                "digest": man.digest, "publish_s": dt, "wire_bytes": s.wire_bytes,
                                "full_bytes": s.full_bytes, "changed": s.changed / s.total,
                                "buckets": len(man.buckets),
                                "changed_buckets": sum(b.codec != "same" for b in man.buckets)})
        print(f"  trainer v{version} {man.kind}: {dt:.2f}s, {s.wire_bytes / 1e6:.3f} of "
              f"{s.full_bytes / 1e6:.1f} MB", file=sys.stderr, flush=True)
    return out


def follower_child(model_dir: str, where: str, versions: list[dict], stage: str) -> dict:
    """The torch engine following ``versions`` over tcp as a replica does (StreamStage):
    assembled in place where it may, only the changed tensors loaded, the held version
    retired as the folder's spare once the next is loaded."""
    from rollart.engines.torch_engine import TorchGenerationEngine
    from rollart.engines.weight_decode import Assembled, assemble_version
    from rollart.engines.weight_staging import retire
    from rollart.engines.weight_tcp_client import TcpBlobs, parse_tcp_uri

    eng = TorchGenerationEngine(model_dir, dtype="bfloat16", threads=2, kv_cache_mb=0)
    resident(eng.model)
    out: list[dict] = []

    async def run() -> None:
        host, port, token, _ = parse_tcp_uri(where + "/x")
        blobs = TcpBlobs(host, port, token)
        base: Assembled | None = None
        for v in versions:
            t = time.perf_counter()
            got, info = await assemble_version(blobs, v["name"], stage, base=base,
                                               digest=v["digest"], in_place=True)
            fetch_s = time.perf_counter() - t
            t = time.perf_counter()
            if got.changed is not None:
                await asyncio.to_thread(partial(eng.load_weights, changed=got.changed),
                                        got.path, v["version"])
            else:
                await asyncio.to_thread(eng.load_weights, got.path, v["version"])
            load_s = time.perf_counter() - t
            if got.undo is not None:  # StreamStage.loaded
                got.undo.drop()
                got = got._replace(undo=None, changed=None)
            elif base is not None and base.path != got.path:
                retire(base.path)
            base = got
            out.append({"version": v["version"], "kind": v["kind"], "path": info["path"],
                        "fetch_s": fetch_s, "load_s": load_s, "wire_bytes": info["wire_bytes"],
                        "written_bytes": info["written_bytes"],
                        "changed_tensors": info["changed_tensors"]})
            print(f"  follower v{v['version']} ({info['path']}): fetch+assembly {fetch_s:.3f}s "
                  f"load {load_s:.3f}s, {info['wire_bytes'] / 1e6:.3f} MB fetched, "
                  f"{info['written_bytes'] / 1e6:.1f} MB written", file=sys.stderr, flush=True)

    asyncio.run(run())
    return {"versions": out}


def measure_deltas(size: str, model_dir: Path, bucket_mb: int) -> dict:
    """Full versions against near-empty deltas, bf16 over loopback tcp (see the docstring)."""
    from rollart.engines.weight_blobs import shm_dir
    from rollart.engines.weight_tcp_server import WeightServer

    work = Path(tempfile.mkdtemp(prefix="rollart-bench-wd-"))
    store = shm_dir(f"bench-delta-{os.getpid()}-{size}")
    shutil.rmtree(store, ignore_errors=True)
    try:
        tr = run_child("touch", str(model_dir), str(store), str(work / "base"), str(bucket_mb))
        srv = WeightServer(store, host="127.0.0.1")
        srv.start_sync()
        try:
            tcp = tcp_gbps()  # the limit, just before the generator reads over the same loopback
            g = run_child("follow", str(model_dir), f"{srv.base_uri}/{srv.token}",
                          json.dumps(tr["versions"]), str(work / "stage"))
        finally:
            srv.close_sync()
        return {"size": size, "bucket_mb": bucket_mb, "tcp_gbps": tcp, "trainer": tr, "generator": g}
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def delta_section(res: dict) -> str:
    tcp = max(res["tcp_gbps"], res["deltas"]["tcp_gbps"], res.get("tcp_gbps_end", 0.0))
    d = res["deltas"]
    tv, gv = d["trainer"]["versions"], d["generator"]["versions"]
    full_t, full_g = tv[4], gv[4]
    served_full = full_g["fetch_s"] + full_g["load_s"]
    rate = full_t["full_bytes"] / full_g["fetch_s"] / 1e9
    rows, targets = [], [(f"full fetch >= 50% of TCP ({rate / tcp:.0%})", rate / tcp >= 0.5)]
    for t, g in zip(tv, gv, strict=True):
        served = g["fetch_s"] + g["load_s"]
        rows.append([f"v{t['version']} {t['kind']}", g["path"],
                     f"{t['changed_buckets']} of {t['buckets']}",
                     f"{t['wire_bytes'] / 2**20:.3f} ({t['wire_bytes'] / t['full_bytes']:.4%})",
                     f"{g['written_bytes'] / 2**20:.1f}", f"{t['publish_s']:.2f}",
                     f"{g['fetch_s']:.3f}", f"{g['load_s']:.3f}", f"{served:.3f}",
                     f"{served / served_full:.1%}"])
        if t["kind"] == "delta":
            targets.append((f"v{t['version']} delta <= 10% of a full version "
                            f"({served / served_full:.1%})", served <= 0.1 * served_full))
    return render("weight_delta", size=d["size"],
                  params=f"{d['trainer']['params'] / 1e6:.0f} M", bucket_mb=d["bucket_mb"],
                  tcp=f"{tcp:.2f}", rate=f"{rate:.2f}", share=f"{rate / tcp:.0%}",
                  torch=res["torch"], machine=describe_machine(res), date=res["when"][:10],
                  passed=sum(ok for _, ok in targets), total=len(targets),
                  failed=", ".join(n for n, ok in targets if not ok) or "none",
                  table=table(["version", "staged by", "buckets changed", "MiB on the wire",
                               "MiB written", "publish s", "fetch+assembly s", "load (pause) s",
                               "served s", "of a full version"], rows))


def run_child(*args: str) -> dict:
    cmd = [sys.executable, __file__, "--child", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    sys.stderr.write(p.stderr[-4000:] if p.returncode else p.stderr)
    if p.returncode:
        raise RuntimeError(f"child {args[0]} failed ({p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


async def _copy_to_object_store(url: str, bucket: str, store: Path, names: list[str]) -> float:
    """Put the version folder's blobs into the object store (as the trainer's object path
    would); returns the seconds it took."""
    from rollart.bus.nats import NatsBus

    bus = NatsBus(url, name="bench-trainer")
    await bus.connect()
    try:
        obs = await bus.object_store(bucket)
        t = time.perf_counter()
        for n in names:
            await obs.put(n, await asyncio.to_thread((store / n).read_bytes))
        return time.perf_counter() - t
    finally:
        await bus.close()


def measure(size: str, dtype: str, model_dir: Path, bucket_mb: int, transports: list[str],
            lrs: list[float], optimizer: str) -> dict:
    from rollart.engines.weight_blobs import shm_dir

    work = Path(tempfile.mkdtemp(prefix="rollart-bench-ws-"))
    # the store in /dev/shm (RAM) unless its versions would not fit beside the processes:
    # the 1.5B model's fp32 versions (5.6 GB each) go to a folder on disk (`file`)
    store = work / "store" if "file" in transports else shm_dir(f"bench-{os.getpid()}-{size}-{dtype}")
    shutil.rmtree(store, ignore_errors=True)
    try:
        tr = run_child("trainer", str(model_dir), dtype, str(store), str(work / "base"),
                       str(bucket_mb), ",".join(map(str, lrs)), optimizer)
        res: dict = {"trainer": tr, "generators": {}}
        names = sorted(p.name for p in store.iterdir() if not p.name.startswith("."))
        for tp in transports:
            if tp in ("shm", "file"):
                where = str(store)
            elif tp == "tcp":
                from rollart.engines.weight_tcp_server import WeightServer

                srv = WeightServer(store, host="127.0.0.1")
                srv.start_sync()
                where = f"{srv.base_uri}/{srv.token}"  # the child has no run store to read it from
            else:  # a server of its own, its store removed afterwards (GBs per model)
                from rollart.bus.server import EmbeddedServer

                server = EmbeddedServer(work / "nats")
                server.start()
                bucket = f"BENCH_{size.replace('.', '_')}_{dtype}"
                res["object_put_s"] = asyncio.run(_copy_to_object_store(server.url, bucket, store, names))
                where = f"{server.url}|{bucket}"
            try:
                res["generators"][tp] = run_child("generator", str(model_dir), dtype, tp, where,
                                                  json.dumps(tr["versions"]), str(work / f"stage-{tp}"))
            finally:
                if tp == "tcp":
                    srv.close_sync()
                elif tp == "object":
                    server.stop()
                    shutil.rmtree(work / "nats", ignore_errors=True)
        return res
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# ======================================================================================
# The README section
# ======================================================================================
def section(res: dict) -> str:
    # the machine's limits: the better of the two measurements (start, end): a ratio to a
    # limit measured while something else ran would flatter the result
    tcp = max(res["tcp_gbps"], res.get("tcp_gbps_end", 0.0))
    mem = max(res["memcpy_gbps"], res.get("memcpy_gbps_end", 0.0))
    rows, targets = [], []
    for key, r in res["models"].items():
        size, dtype = key.split("/")
        model = f"{size}B ({r['trainer']['params'] / 1e6:.0f} M)"
        tv = r["trainer"]["versions"]
        full = tv[-1]
        for tp, g in r["generators"].items():
            gl = g["versions"][-1]
            rate = full["full_bytes"] / gl["fetch_s"] / 1e9
            rows.append([model, dtype, "full", tp, f"{full['full_bytes'] / 1e9:.2f}",
                         f"{full['publish_s']:.2f}", f"{gl['fetch_s']:.2f}", f"{gl['load_s']:.2f}",
                         f"{full['publish_s'] + gl['fetch_s'] + gl['load_s']:.2f}",
                         f"{rate:.2f} ({rate / tcp:.0%} of TCP)"])
            extra = max(x["rss_above_mib"] for x in g["versions"]) / res["bucket_mb"]
            rows[-1].append(f"{extra:.2f}")
            targets += [(f"fetch {tp} {size}B {dtype}", rate / tcp >= 0.5),
                        (f"memory {tp} {size}B {dtype}", extra <= 2.2)]
        for d in tv[1:-1]:
            gs = {tp: next(x for x in g["versions"] if x["version"] == d["version"])
                  for tp, g in r["generators"].items()}
            g = gs.get("tcp") or next(iter(gs.values()))
            share = d["wire_bytes"] / d["full_bytes"]
            rows.append([model, dtype, f"delta, lr {d['lr']:g} ({d['changed']:.1%} changed)", "tcp",
                         f"{d['wire_bytes'] / 1e9:.3f} ({share:.1%})", f"{d['publish_s']:.2f}",
                         f"{g['fetch_s']:.2f}", f"{g['load_s']:.2f}",
                         f"{d['publish_s'] + g['fetch_s'] + g['load_s']:.2f}", None, None])
            if dtype == "bfloat16" and d["lr"] == QUICKSTART_LR:
                targets.append((f"delta {size}B", share <= 0.10))
    return render("weight_sync", bucket_mb=res["bucket_mb"], optimizer=res["optimizer"],
                  memcpy=f"{mem:.1f}", tcp=f"{tcp:.2f}", torch=res["torch"],
                  machine=describe_machine(res), date=res["when"][:10],
                  passed=sum(ok for _, ok in targets), total=len(targets),
                  failed=", ".join(n for n, ok in targets if not ok) or "none",
                  table=table(["model", "serving dtype", "version", "path", "GB on the wire",
                               "publish s", "fetch s", "load s", "served s", "fetch GB/s",
                               "generator RSS above (buckets)"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("::")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.1,0.5,1.5", help="models to run (of 0.1, 0.5, 1.5)")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="0.1B, bf16, one learning rate, shm and tcp")
    ap.add_argument("--deltas", action="store_true",
                    help="issue 45 §2 only: full versions against near-empty deltas (section weight_delta)")
    ap.add_argument("--delta-size", default="0.5-40",
                    help="the model of --deltas (of 0.1, 0.5, 0.5-40: 0.50B parameters, 1.5)")
    ap.add_argument("--readme-only", action="store_true",
                    help="rewrite the README section from results/weight_sync.json, measure nothing")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.readme_only:
        if args.deltas:
            replace_section("weight_delta", delta_section(
                json.loads((RESULTS / "weight_delta.json").read_text())))
        else:
            replace_section("weight_sync", section(json.loads((RESULTS / "weight_sync.json").read_text())))
        return
    if args.child:
        role, *rest = args.child
        if role == "touch":
            md, store, base, bucket = rest
            r = trainer_touch_child(md, store, base, int(bucket))
        elif role == "follow":
            md, where, versions, stage = rest
            r = follower_child(md, where, json.loads(versions), stage)
        elif role == "trainer":
            md, dtype, store, base, bucket, lrs, opt = rest
            r = trainer_child(md, dtype, store, base, int(bucket), [float(x) for x in lrs.split(",")], opt)
        else:
            md, dtype, tp, where, versions, stage = rest
            r = generator_child(md, dtype, tp, where, json.loads(versions), stage)
        print(json.dumps(r))
        return

    import torch

    from rollart.engines.tiny import build_tiny_model

    t0, load0 = time.time(), os.getloadavg()[0]
    sizes = ["0.1"] if args.quick else args.sizes.split(",")
    dtypes = ["bfloat16"] if args.quick else ["float32", "bfloat16"]
    res: dict = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
                 "load_start": load0, "python": platform.python_version(), "torch": torch.__version__,
                 "bucket_mb": args.bucket_mb, "optimizer": "AdamW (1.5B: SGD, AdamW's state does not fit in 24 GiB)",
                 "memcpy_gbps": memcpy_gbps(), "tcp_gbps": tcp_gbps(), "models": {}}
    print(f"memcpy {res['memcpy_gbps']:.1f} GB/s, loopback TCP {res['tcp_gbps']:.2f} GB/s", file=sys.stderr)
    if args.deltas or args.quick:
        size = "0.1" if args.quick else args.delta_size
        t = time.perf_counter()
        md = build_tiny_model(MODEL_CACHE / f"qwen3-{size}b", seed=0, **MODELS[size])
        print(f"model {size}B ready in {time.perf_counter() - t:.0f}s; deltas", file=sys.stderr)
        res["deltas"] = measure_deltas(size, md, args.bucket_mb)
    if args.deltas:
        res["load_end"] = os.getloadavg()[0]
        res["tcp_gbps_end"] = tcp_gbps()
        res["total_s"] = time.time() - t0
        finish(res, True, RESULTS / "weight_delta.json", "weight_delta", delta_section)
        return
    for size in sizes:
        t = time.perf_counter()
        md = build_tiny_model(MODEL_CACHE / f"qwen3-{size}b", seed=0, **MODELS[size])
        print(f"model {size}B ready in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        big = size == "1.5"
        for dtype in dtypes:
            transports = (["shm", "tcp"] if args.quick or (big and dtype == "bfloat16") else
                          ["file", "tcp"] if big else ["shm", "tcp", "object"])
            lrs = [QUICKSTART_LR] if args.quick else ([1e-5, QUICKSTART_LR] if big else list(LRS))
            print(f"{size}B {dtype}", file=sys.stderr, flush=True)
            res["models"][f"{size}/{dtype}"] = measure(
                size, dtype, md, args.bucket_mb, transports, lrs, "sgd" if big else "adamw")
    res["load_end"] = os.getloadavg()[0]
    res["memcpy_gbps_end"], res["tcp_gbps_end"] = memcpy_gbps(), tcp_gbps()
    res["total_s"] = time.time() - t0
    finish(res, not args.quick, RESULTS / "weight_sync.json", "weight_sync", section)


if __name__ == "__main__":
    main()
