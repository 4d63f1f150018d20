"""Real sizes through the plain ``rollart run``: step time, publish, fetch and pause on the
generator, peak resident memory per process and the checkpoint's cost, for Qwen3-layout
models of ~0.1B / 0.5B / 1.5B parameters, against the machine's limits measured in the same
run (memcpy and loopback TCP, as ``weight_sync.py`` measures them).

    python benchmarks/real_size.py                 # 0.1B and 0.5B (1.5B when it fits), 3 steps each
    python benchmarks/real_size.py --sizes 0.5 --steps 4
    python benchmarks/real_size.py --quick         # a ~10M model, 2 steps; prints JSON, writes nothing

What runs: ``python -m rollart run <config>`` as a user runs it, with the defaults (embedded
nats-server, one process per role, streamed versions through shared memory:
``trainer.weights: auto``), on the quickstart's FrozenLake with small groups (group 2, batch 2,
turns of one constrained action) so that a step's cost is the model's: training a batch,
publishing a version, the generator loading it. The model is built from a config (random
init: the point is size; its vocabulary is the tiny tokenizer's 512 tokens, so the
parameters are in the layers, where a real model's vocabulary adds ``vocab x hidden`` more).
Served in bfloat16 (``proxy.dtype``), trained with fp32 masters and AdamW.

A size whose estimate does not fit the host is skipped with the arithmetic: the trainer holds
16 bytes a parameter (fp32 weights, gradients, AdamW's two moments) plus the serving copy it
casts one tensor at a time; the generator 2 bytes a parameter (bf16) plus its staged file; the
shared-memory folder an anchor and deltas. The full checkpoint is the last step's, written from
the live tensors; a mid-run one holds a copy in CPU memory, 16 bytes a parameter more.

Per process, the peak resident set (``psutil``, sampled every 0.2 s over the run's process
tree). From ``metrics.jsonl``: ``seconds`` (a step, wall), ``train_s``, ``stream_encode_s``
(the publish: cast, bucket, write), ``sync_fetch_s_max`` and ``sync_pause_s_max`` (the
generator's fetch and assembly while serving, and its pause for the load), the version's wire
bytes, and the full checkpoint's ``full_checkpoint_s`` / ``full_checkpoint_block_s`` / bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from common import (
    HERE,
    QUICKSTART,
    add_run_flags,
    begin,
    child_env,
    describe_machine,
    finish,
    render,
    sayer,
    table,
    writes,
)
from weight_sync import memcpy_gbps, tcp_gbps

say = sayer("real_size")
RESULTS = HERE / "results" / "real_size.json"

LAYOUTS = {
    # name: (hidden, layers, heads, kv heads, MLP width); parameters in the layers
    "0.01B": (256, 8, 4, 2, 1024),
    "0.1B": (768, 16, 12, 4, 2048),
    "0.5B": (1024, 32, 16, 8, 4096),
    "1.5B": (1536, 28, 12, 2, 8960),
}
VOCAB = 512


def params(hidden: int, layers: int, heads: int, kv: int, mlp: int, vocab: int = VOCAB) -> int:
    """Parameters of the Qwen3 layout (untied embeddings, per-head q/k norms)."""
    head = hidden // heads
    attn = hidden * hidden * 2 + hidden * head * kv * 2 + 2 * head
    per_layer = attn + 3 * hidden * mlp + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def estimate_gib(n: int) -> dict[str, float]:
    """Bytes per role for ``n`` parameters (see the module docstring), GiB."""
    g = 2**30
    return {"trainer": (16 + 2) * n / g, "checkpoint_copy": 16 * n / g,
            "generator": (2 + 2) * n / g, "shm_folder": 3 * 2 * n / g}


def host_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def write_config(folder: Path, size: str, steps: int) -> Path:
    hidden, layers, heads, kv, mlp = LAYOUTS[size]
    qs = yaml.safe_load(QUICKSTART.read_text())
    cfg = {
        "run": f"real-{size.replace('.', '_')}",
        "run_dir": str(folder / "runs"),
        "model": {"tiny": {"vocab_size": VOCAB, "hidden_size": hidden, "num_layers": layers,
                           "num_heads": heads, "num_kv_heads": kv, "intermediate_size": mlp,
                           "seed": 0}, "threads": 1},
        "envs": {"main": {**qs["envs"]["main"], "max_turns": 2,
                          "args": {**qs["envs"]["main"]["args"], "max_steps": 2}}},
        "rollout": {"group_size": 2, "batch_groups": 2, "alpha": 1},
        "proxy": {"dtype": "bfloat16"},
        "trainer": {"steps": steps, "lr": 1e-5, "eval_groups": 1, "skip_uniform": 0,
                    "full_checkpoint_every": steps},  # the last step's only
    }
    path = folder / f"{cfg['run']}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _label(cmd: list[str]) -> str:
    line = " ".join(cmd)
    if "nats-server" in line:
        return "nats-server"
    if "--roles" in cmd:
        return cmd[cmd.index("--roles") + 1]
    if "trainer_rank" in line:
        return "trainer-rank"
    return "rollart run"


class PeakRss:
    """Peak resident set per process of a tree, sampled every ``every`` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.2):
        import psutil

        self.root = psutil.Process(pid)
        self.every = every
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                try:
                    rss, name = p.memory_info().rss / 2**30, _label(p.cmdline())
                except psutil.Error:
                    continue
                self.peak[name] = max(self.peak.get(name, 0.0), rss)
            self._stop.wait(self.every)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._t.join(5)
        return {k: round(v, 2) for k, v in sorted(self.peak.items())}


def measure(size: str, steps: int, folder: Path, keep: bool = False) -> dict:
    n = params(*LAYOUTS[size])
    est = estimate_gib(n)
    # the full checkpoint is the last step's (trainer.full_checkpoint_every: steps), written
    # from the live tensors: its copy is not held (a mid-run one would add checkpoint_copy)
    need = est["trainer"] + est["generator"] + est["shm_folder"] + 2.5
    out: dict = {"size": size, "params": n, "estimate_gib": {k: round(v, 2) for k, v in est.items()},
                 "estimate_total_gib": round(need, 1), "host_gib": round(host_gib(), 1)}
    if need > 0.9 * host_gib():
        out["skipped"] = (f"needs ~{need:.1f} GiB (trainer {est['trainer']:.1f} + generator "
                          f"{est['generator']:.1f} + shared memory {est['shm_folder']:.1f} + 2.5 for "
                          f"the runtimes) of {host_gib():.1f}")
        say(f"{size}: skipped, {out['skipped']}")
        return out
    cfg = write_config(folder, size, steps)
    log = folder / f"{cfg.stem}.log"
    say(f"{size}: {n / 1e9:.2f}B parameters, {steps} steps (log {log})")
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "rollart", "--log-level", "INFO", "run",
                                 str(cfg), "--quiet"],
                                cwd=folder, env=child_env(), stdout=fh, stderr=subprocess.STDOUT)
        rss = PeakRss(proc.pid)
        rc = proc.wait()
        out["peak_rss_gib"] = rss.stop()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if rc != 0:
        raise SystemExit(f"{size}: rollart run exited {rc}:\n{log.read_text()[-4000:]}")
    run_dir = folder / "runs" / yaml.safe_load(cfg.read_text())["run"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    keys = ("seconds", "train_s", "stream_encode_s", "stream_wire_bytes", "stream_wire_ratio",
            "sync_fetch_s_max", "sync_pause_s_max", "sync_replicas", "full_checkpoint_s",
            "full_checkpoint_block_s", "full_checkpoint_bytes")
    out["steps"] = [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows]
    # the last step's full checkpoint is in no metrics row (a row reports the ones finished
    # before it): its log line
    full = re.findall(r"full checkpoint at version (\d+): (\d+) bytes in ([\d.]+)s \(written "
                      r"([\d.]+)s, the step waited ([\d.]+)s", log.read_text())
    if full:
        v, nbytes, took, written, waited = full[-1]
        out["full_checkpoint"] = {"version": int(v), "bytes": int(nbytes), "s": float(took),
                                  "write_s": float(written), "copy_wait_s": float(waited)}
    out["versions_loaded"] = sorted({int(x) for x in re.findall(
        r"loaded policy v(\d+)", "".join(f.read_text() for f in (run_dir / "logs").glob("*.log")))})
    say(f"{size}: {out['wall_s']} s, peak RSS {out['peak_rss_gib']}")
    if not keep:  # a 0.5B run folder holds ~9 GB (model, checkpoint, base): room for the next
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def kill_mid_publish(size: str, steps: int, folder: Path) -> dict:
    """``rollart run`` of ``size``, kill -9 of its process (the trainer's) while the first
    version's buckets are being written to shared memory and its manifest is not, then
    ``rollart run --resume``: what the resumed run trained and loaded."""
    from rollart.engines.weight_blobs import shm_dir, shm_key

    sub = folder / "kill"
    sub.mkdir(parents=True, exist_ok=True)
    cfg = write_config(sub, size, steps)
    run = yaml.safe_load(cfg.read_text())["run"]
    run_dir = sub / "runs" / run
    shm = shm_dir(run, shm_key(run_dir))
    log = sub / f"{run}.log"
    say(f"{size}: kill -9 of the trainer mid-publish, then --resume (log {log})")
    argv = [sys.executable, "-m", "rollart", "--log-level", "INFO", "run"]
    with log.open("w") as fh:
        proc = subprocess.Popen([*argv, str(cfg), "--quiet"], cwd=sub, env=child_env(),
                                stdout=fh, stderr=subprocess.STDOUT)
        deadline, seen = time.monotonic() + 900, None
        while time.monotonic() < deadline and proc.poll() is None:
            buckets = sorted(shm.glob("stream.v000001-*.b*")) if shm.is_dir() else []
            if buckets and not list(shm.glob("stream.v000001-*.manifest")):
                seen = len(buckets)
                proc.kill()
                break
            time.sleep(0.02)
        proc.wait()
        if seen is None:
            raise SystemExit(f"{size}: no moment with v1's buckets and no manifest was seen "
                             f"(rc {proc.returncode}):\n{log.read_text()[-3000:]}")
        t0 = time.perf_counter()
        rc = subprocess.run([*argv, "--resume", str(run_dir), "--quiet"], cwd=sub,
                            env=child_env(), stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{size}: the resume exited {rc}:\n{log.read_text()[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ids = [t for r in rows for t in r["traj_ids"]]
    logs = "".join(f.read_text() for f in (run_dir / "logs").glob("*.log"))
    out = {"size": size, "killed_with_buckets": seen, "resume_wall_s": round(time.perf_counter() - t0, 1),
           "steps": [r["step"] for r in rows], "trajectories": len(ids),
           "trained_twice": len(ids) - len(set(ids)),
           "versions_loaded": sorted({int(x) for x in re.findall(r"loaded policy v(\d+)", logs)}),
           "shm_left": shm.is_dir()}
    out["ok"] = (out["steps"] == list(range(1, steps + 1)) and out["trained_twice"] == 0
                 and steps in out["versions_loaded"] and not out["shm_left"])
    say(f"{size}: killed with {seen} buckets of v1 written, resumed: {out}")
    return out


def _mid(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def section(res: dict) -> str:
    rows = []
    for m in res["models"]:
        if "skipped" in m:
            rows.append([m["size"], f"{m['params'] / 1e9:.2f}B", "skipped: " + m["skipped"],
                         *["-"] * 8])
            continue
        s = m["steps"][1:] or m["steps"]  # the first step also builds and loads
        full_v = [r for r in m["steps"] if r.get("stream_wire_ratio", 0) >= 0.5]
        deltas = [r for r in m["steps"] if "stream_wire_ratio" in r and r["stream_wire_ratio"] < 0.5]

        def med(rs, k, fmt="{:.2f}"):
            v = _mid([r.get(k) for r in rs])
            return fmt.format(v) if v is not None else "-"

        def served(rs):
            if not rs:
                return "-"
            wire = _mid([r.get("stream_wire_bytes") for r in rs]) or 0
            return (f"{med(rs, 'sync_fetch_s_max')} + {med(rs, 'sync_pause_s_max')} s "
                    f"({wire / 2**20:.1f} MiB)")

        full = m.get("full_checkpoint") or {}
        rss = m["peak_rss_gib"]
        rows.append([m["size"], f"{m['params'] / 1e9:.2f}B", med(s, "seconds", "{:.1f} s"),
                     med(s, "stream_encode_s", "{:.2f} s"), served(full_v), served(deltas),
                     f"{full['bytes'] / 2**30:.1f} GiB in {full['s']:.1f} s" if full else "-",
                     ", ".join(f"v{v}" for v in m.get("versions_loaded", [])) or "-",
                     f"{rss.get('rollart run', 0):.1f}",  # the trainer runs in rollart run's process
                     f"{max((v for k, v in rss.items() if 'generate' in k), default=0):.1f}",
                     f"{m['wall_s']:.0f} s"])
    return render("real_size", tbl=table(
        ["model", "parameters", "step (median)", "publish", "full version: fetch + pause (wire)",
         "delta: fetch + pause (wire)", "last full checkpoint", "versions loaded",
         "trainer RSS GiB", "generator RSS GiB", "run wall"], rows),
        memcpy=f"{res['memcpy_gbps']:.1f}", tcp=f"{res['tcp_gbps']:.2f}",
        when=res["timestamp"][:10], machine=describe_machine(res["machine"]),
        kill=kill_line(res.get("kill")))


def kill_line(k: dict | None) -> str:
    if not k:
        return "No kill test in this run."
    return (f"Kill -9 of the trainer while version 1 was being published ({k['killed_with_buckets']} "
            f"of its buckets in shared memory, no manifest), then `rollart run --resume` at "
            f"{k['size']}: steps {k['steps'][0]}-{k['steps'][-1]} each once, "
            f"{k['trajectories']} trajectories, {k['trained_twice']} trained twice, versions "
            f"loaded {', '.join(f'v{v}' for v in k['versions_loaded'])}, the shared-memory folder "
            f"{'left behind' if k['shm_left'] else 'removed'} at the end "
            f"({'as expected' if k['ok'] else 'NOT as expected'}; the resume took "
            f"{k['resume_wall_s']:.0f} s).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(p, "a ~10M-parameter model, 2 steps")
    p.add_argument("--sizes", default="0.1,0.5,1.5",
                   help=f"comma-separated, from {', '.join(k.removesuffix('B') for k in LAYOUTS)}")
    p.add_argument("--steps", type=int, default=3, help="trainer.steps of each run (at least 2)")
    p.add_argument("--keep", default=None, help="keep the run folders here")
    p.add_argument("--kill", default="0.5", metavar="SIZE",
                   help="also kill -9 the trainer mid-publish at this size and resume ('': no)")
    args = p.parse_args(argv)
    sizes = ["0.01B"] if args.quick else [f"{s.strip()}B" for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in LAYOUTS]
    if bad:
        p.error(f"unknown sizes {bad}; known: {', '.join(LAYOUTS)}")
    steps = 2 if args.quick else args.steps
    if steps < 2:
        p.error("--steps must be at least 2")
    res = begin("real_size", args, ("sizes", "steps"))
    res["memcpy_gbps"], res["tcp_gbps"] = memcpy_gbps(), tcp_gbps()
    say(f"memcpy {res['memcpy_gbps']:.1f} GB/s, loopback TCP {res['tcp_gbps']:.2f} GB/s")
    res["models"] = []
    with tempfile.TemporaryDirectory(prefix="rollart-real-size-") as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for size in sizes:
            res["models"].append(measure(size, steps, folder, keep=bool(args.keep)))
        # (not in --quick: a 10M model's version is written faster than a poll can catch)
        kill = "" if args.quick else (f"{args.kill}B" if args.kill else "")
        if kill:
            if kill not in LAYOUTS:
                p.error(f"unknown --kill size {args.kill}")
            res["kill"] = kill_mid_publish(kill, steps, folder)
    return finish(res, writes(args), RESULTS, "real_size", section, say)


if __name__ == "__main__":
    sys.exit(main())
