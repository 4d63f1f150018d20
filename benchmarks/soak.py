"""Soak: a long run of fast steps, with memory, threads and disk sampled all along.

::

    python benchmarks/soak.py                  # 2,000 steps; writes results/soak.json + README
    python benchmarks/soak.py --steps 6000     # a longer run, kept next to the default one
    python benchmarks/soak.py --quick          # 60 steps, prints JSON, writes nothing

Runs ``rollart run`` in a child process, as a user would: every role in that process, an
embedded ``nats-server`` (the product default; ``--nats memory`` for the in-process bus),
on a tiny job whose steps are fast (tiny model, ``group_size`` 2, ``batch_groups`` 1,
FrozenLake with at most 2 turns, a checkpoint every step). Every ``--every`` steps (read
from the child's one-line-per-step output) it samples, for every process of the run (the
rollart process and its descendants, e.g. ``nats-server``): RSS and thread count from
``/proc``; the live bytes of the events stream and the KV bucket (a short-lived client asks
the server); and on disk: the store (``runs/<run>/nats``), the checkpoint
(``checkpoints/full-<step>.safetensors``), the weights folder and ``metrics.jsonl``.

A resource is *flat* when the median of its samples in the last 10% of the steps is within
10% of the median in the 10% of the steps right after the warm-up. The warm-up is the first
10% of the steps and, for anything including nats-server, at least ``SERVER_SETTLE_S``
seconds (the server keeps every publish's msg id for the 2-minute duplicate window). The
events stream is capped by ``node.events_max_bytes``, set low here (``--events-max-bytes``,
default 1 MiB, the smallest allowed) so that the cap is reached within the warm-up; the
store on disk is a sawtooth (whole 4 MiB blocks are freed) judged against the ceiling the
limits allow. ``metrics.jsonl`` is a log and grows by design.

The full run adds its entry (keyed by steps and bus) to ``benchmarks/results/soak.json`` and
rewrites the section of ``benchmarks/README.md`` between ``<!-- soak:begin -->`` and
``<!-- soak:end -->`` from every entry there. Progress goes to stderr, the JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, ROOT, loadavg, machine, nats_server_version, render,
                    replace_section, sayer, store, table)

RESULTS = RESULTS_DIR / "soak.json"
WINDOW = 0.10
"""Warm-up, and each comparison window, as a fraction of the steps."""
TOLERANCE = 0.10
"""Flat: last window's median within this fraction of the first window's."""

say = sayer("soak")


# -- the job ------------------------------------------------------------------------------
def job_config(run_dir: Path, run: str, steps: int, events_max_bytes: int) -> dict:
    return {
        "run": run,
        "run_dir": str(run_dir),
        "node": {"events_max_bytes": events_max_bytes},
        "model": {"tiny": {"vocab_size": 512, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                           "num_kv_heads": 1, "intermediate_size": 64, "seed": 0},
                  "threads": 1},
        "envs": {"main": {"type": "frozenlake",
                          "args": {"map": ["SFFF", "FHFH", "FFFH", "HFFG"], "max_steps": 2},
                          "max_turns": 2}},
        "rollout": {"group_size": 2, "batch_groups": 1, "alpha": 1, "concurrency": 4},
        "trainer": {"steps": steps, "eval_groups": 1, "checkpoint_every": 1, "keep_weights": 3},
    }


# -- sampling -------------------------------------------------------------------------------
def _status(pid: int) -> dict | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("Name", "VmRSS", "Threads", "PPid"):
            out[k] = v.strip()
    return out


def processes(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _status(int(d))
            if st and "PPid" in st:
                children.setdefault(int(st["PPid"]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def stream_state(url: str | None, run: str) -> dict:
    """Logical sizes the server reports: the events stream (what ``events_max_bytes`` caps),
    the work queue and the KV bucket. A short-lived client of its own (~10 ms)."""
    if not url or not url.startswith("nats"):
        return {}
    import asyncio

    import nats

    from rollart import messages as m

    async def get() -> dict:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            js, out = nc.jetstream(), {}
            for key, name in (("events", m.stream_name(run, "events")),
                              ("work", m.stream_name(run, "work")),
                              ("kv", f"KV_{m.kv_bucket(run)}")):
                try:
                    st = (await js.stream_info(name)).state
                    out[key] = {"bytes": st.bytes, "messages": st.messages}
                except Exception as e:  # noqa: BLE001 - not created yet
                    out[key] = {"error": type(e).__name__}
            return out
        finally:
            await nc.close()

    try:
        return asyncio.run(get())
    except Exception as e:  # noqa: BLE001 - a sample without it
        return {"error": f"{type(e).__name__}: {e}"}


def sample(root: int, run_path: Path, step: int, t0: float, url: str | None = None,
           run: str = "") -> dict:
    procs = {}
    for pid in processes(root):
        st = _status(pid)
        if not st or "VmRSS" not in st:
            continue
        name = "rollart" if pid == root else st["Name"]
        key = name if name not in procs else f"{name}-{pid}"
        procs[key] = {"pid": pid, "rss_mib": int(st["VmRSS"].split()[0]) / 1024,
                      "threads": int(st["Threads"])}
    ckpt = max((run_path / "checkpoints").glob("full-*.safetensors"), default=run_path / "none")
    metrics = run_path / "metrics.jsonl"
    return {
        "step": step, "t_s": round(time.monotonic() - t0, 2), "processes": procs,
        "rss_mib": round(sum(p["rss_mib"] for p in procs.values()), 1),
        "threads": sum(p["threads"] for p in procs.values()),
        "store_bytes": dir_bytes(run_path / "nats"),
        "checkpoint_bytes": ckpt.stat().st_size if ckpt.exists() else None,
        "weights_bytes": dir_bytes(run_path / "weights"),
        "metrics_bytes": metrics.stat().st_size if metrics.exists() else 0,
        "streams": stream_state(url, run),
    }


# -- the run --------------------------------------------------------------------------------
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\b")
URL_LINE = re.compile(r"nats-server at (nats://\S+?);")


def run_soak(steps: int, every: int, nats: str | None, events_max_bytes: int,
             workdir: Path) -> dict:
    import yaml

    run = f"soak-{uuid.uuid4().hex[:6]}"
    cfg_path = workdir / "soak.yaml"
    cfg_path.write_text(yaml.safe_dump(job_config(workdir / "runs", run, steps, events_max_bytes),
                                       sort_keys=False))
    run_path = workdir / "runs" / run
    cmd = [sys.executable, "-m", "rollart", "run", str(cfg_path)]
    if nats:
        cmd += ["--nats", nats]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false")
    say(f"{' '.join(cmd)}  (run folder {run_path})")
    err = (workdir / "stderr.log").open("wb")
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, env=env, text=True)
    samples: list[dict] = []
    first_step_t = None
    last_step, last_step_t = 0, t0
    tail: list[str] = []
    next_at = every
    url = None
    for line in child.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if url is None and (mu := URL_LINE.search(line)):
            url = mu.group(1)
        mt = STEP_LINE.search(line)
        if not mt:
            continue
        step = int(mt.group(1))
        last_step, last_step_t = step, time.monotonic()
        if first_step_t is None:
            first_step_t = time.monotonic()
            samples.append(sample(child.pid, run_path, step, t0, url, run))
        if step >= next_at or step == steps:
            samples.append(sample(child.pid, run_path, step, t0, url, run))
            s = samples[-1]
            say(f"step {step}/{steps}: RSS {s['rss_mib']:.0f} MiB, threads {s['threads']}, "
                f"store {s['store_bytes'] / 2**20:.2f} MiB, checkpoint "
                f"{(s['checkpoint_bytes'] or 0) / 1024:.0f} KiB")
            next_at = (step // every + 1) * every
    rc = child.wait()
    err.close()
    wall = time.monotonic() - t0
    if rc != 0 or last_step < steps:
        raise RuntimeError(f"rollart run exited {rc} at step {last_step}/{steps}; last output:\n"
                           + "\n".join(tail) + "\nstderr: "
                           + (workdir / "stderr.log").read_text()[-3000:])
    span = last_step_t - (first_step_t or t0)
    return {"run": run, "samples": samples, "wall_s": round(wall, 1),
            "steps_s": round(span, 1), "steps_per_s": round((steps - 1) / max(1e-9, span), 2),
            "setup_s": round((first_step_t or t0) - t0, 1),
            "after_last_step_s": round(wall - (last_step_t - t0), 1),
            "stderr_lines": sum(1 for _ in (workdir / "stderr.log").open()),
            "stderr_tail": (workdir / "stderr.log").read_text()[-2000:]}


# -- analysis -------------------------------------------------------------------------------
SERVER_SETTLE_S = 180.0
"""Warm-up floor, in seconds after the first step, for anything that includes nats-server:
it keeps the msg id of every publish for the streams' duplicate window (2 minutes) and its
Go heap settles after that, so its memory grows for ~2.5 minutes by design, however
many steps that is."""
BLOCK = 4 * 1024**2
"""nats-server's file store block (measured with 2.15: a stream capped at 1 MiB and a KV
bucket both roll to a new 4 MiB block file and delete the old one once nothing in it is
live): on disk a stream holds its live bytes plus at most one such block."""


def warm_step(samples: list[dict], steps: int, seconds: float = 0.0) -> float:
    """The last step of the warm-up: 10% of the steps, or ``seconds`` after the first step."""
    warm = WINDOW * steps
    if seconds > 0 and samples:
        t1 = samples[0]["t_s"]
        later = [x["step"] for x in samples if x["t_s"] - t1 >= seconds]
        warm = max(warm, later[0] if later else float("inf"))
    return warm


def flatness(samples: list[dict], steps: int, key, *, settle_s: float = 0.0,
             abs_tol: float = 0.0) -> dict:
    """Median in the first window after warm-up vs in the last window (each 10% of the
    steps); min and max after warm-up. Flat: within ``TOLERANCE``, or within ``abs_tol``
    (thread counts are small integers: one env thread more is no leak)."""
    warm = warm_step(samples, steps, settle_s)
    w = WINDOW * steps
    if warm + w > steps - w:
        return {"flat": None, "warmup_step": None,
                "why": f"the run is shorter than the warm-up ({settle_s:g} s) and two windows"}
    vals = [(x["step"], v) for x in samples if x["step"] > warm and (v := key(x)) is not None]
    first = [v for s, v in vals if s <= warm + w]
    last = [v for s, v in vals if s > steps - w]
    if not first or not last:
        return {"flat": None, "warmup_step": warm, "why": "too few samples"}
    a, b = statistics.median(first), statistics.median(last)
    change = (b - a) / a if a else (0.0 if b == a else float("inf"))
    return {"first": a, "last": b, "change": round(change, 4), "min": min(v for _, v in vals),
            "max": max(v for _, v in vals), "flat": abs(change) <= TOLERANCE or abs(b - a) <= abs_tol,
            "warmup_step": round(warm)}


def store_bound(samples: list[dict], steps: int, events_max_bytes: int) -> dict:
    """The store on disk is a sawtooth (whole blocks are freed): judged by its peak against
    the ceiling the limits allow (events: cap + one block; KV: one block; 1 MiB for the work
    queue, consumer state and the server log), and by its peaks in the two halves."""
    warm = WINDOW * steps
    mid = (warm + steps) / 2
    h1 = [x["store_bytes"] for x in samples if warm < x["step"] <= mid]
    h2 = [x["store_bytes"] for x in samples if x["step"] > mid]
    ceiling = events_max_bytes + 2 * BLOCK + 1024**2
    if not h1 or not h2:
        return {"bounded": None}
    return {"peak_first_half": max(h1), "peak_second_half": max(h2), "ceiling": ceiling,
            "min": min(h1 + h2), "max": max(h1 + h2), "bounded": max(h1 + h2) <= ceiling}


def _stream(name: str, field: str = "bytes"):
    return lambda x: (x.get("streams") or {}).get(name, {}).get(field)


def analyse(res: dict, steps: int, events_max_bytes: int) -> dict:
    s = res["samples"]
    server = any(n.startswith("nats-server") for x in s for n in x["processes"])
    settle = SERVER_SETTLE_S if server else 0.0
    out = {
        "rss_mib_total": flatness(s, steps, lambda x: x["rss_mib"], settle_s=settle),
        "threads_total": flatness(s, steps, lambda x: x["threads"], settle_s=settle, abs_tol=1),
    }
    for n in sorted({n for x in s for n in x["processes"]}):
        if n in ("rollart", "nats-server"):  # the long-lived ones (not per-task processes)
            st = settle if n == "nats-server" else 0.0
            out[f"rss_mib[{n}]"] = flatness(
                s, steps, lambda x, n=n: x["processes"].get(n, {}).get("rss_mib"), settle_s=st)
            out[f"threads[{n}]"] = flatness(
                s, steps, lambda x, n=n: x["processes"].get(n, {}).get("threads"), settle_s=st,
                abs_tol=1)
    out |= {
        "events_stream_bytes": flatness(s, steps, _stream("events")),
        "kv_bytes": flatness(s, steps, _stream("kv")),
        "checkpoint_bytes": flatness(s, steps, lambda x: x["checkpoint_bytes"]),
        "weights_bytes": flatness(s, steps, lambda x: x["weights_bytes"]),
        "metrics_bytes": flatness(s, steps, lambda x: x["metrics_bytes"]),
    }
    if server:
        out["store_bytes"] = store_bound(s, steps, events_max_bytes)
    return out


def machine_info() -> dict:
    return machine("torch", "nats-py", **{"nats-server": nats_server_version()})


# -- README ---------------------------------------------------------------------------------
def _mib(b) -> str:
    return "–" if b is None else f"{b / 2**20:.2f}"


def _row(label: str, f: dict, fmt, note: str = "") -> list:
    if f.get("flat") is None:
        return [label, None, None, None, None, f"n/a: {f.get('why', 'no samples')}"]
    verdict = "flat" if f["flat"] else "**grows**" if f["change"] > 0 else "**shrinks**"
    return [label, fmt(f["first"]), fmt(f["last"]), f"{f['change'] * 100:+.1f}%",
            f"{fmt(f['min'])} – {fmt(f['max'])}", verdict + note]


def _store_row(f: dict) -> list:
    label = "store `runs/<run>/nats` on disk (MiB)"
    if f.get("bounded") is None:
        return [label, None, None, None, None, "n/a"]
    verdict = "bounded" if f["bounded"] else "**over the ceiling**"
    return [label, f"peak {_mib(f['peak_first_half'])}", f"peak {_mib(f['peak_second_half'])}",
            "sawtooth", f"{_mib(f['min'])} – {_mib(f['max'])}",
            f"{verdict} (ceiling {_mib(f['ceiling'])})"]


def run_rows(r: dict) -> list[list]:
    """One run's rows, each led by the run (steps and bus)."""
    job, a = r["job"], r["analysis"]
    rows = [_row("RSS, all processes (MiB)", a["rss_mib_total"], _f1),
            _row("threads, all processes", a["threads_total"], _fg)]
    for k in sorted(k for k in a if k.startswith(("rss_mib[", "threads["))):
        what, proc = k.split("[")
        rows.append(_row(f"{'RSS (MiB)' if what == 'rss_mib' else 'threads'}: {proc[:-1]}", a[k],
                         _f1 if what == "rss_mib" else _fg))
    rows += [_row("events stream, live bytes (MiB)", a["events_stream_bytes"], _mib,
                  f" (cap {_mib(job['events_max_bytes'])})"),
             _row("KV bucket, live bytes (MiB)", a["kv_bytes"], _mib)]
    if "store_bytes" in a:
        rows.append(_store_row(a["store_bytes"]))
    rows += [_row("full checkpoint (MiB)", a["checkpoint_bytes"], _mib),
             _row("weights folder (MiB)", a["weights_bytes"], _mib),
             _row("`metrics.jsonl` (MiB; a log)", a["metrics_bytes"], _mib, " (by design)")]
    run = f"{job['steps']:,} steps, {job['nats']}"
    return [[run, *row] for row in rows]


def _f1(x: float) -> str:
    return f"{x:.1f}"


def _fg(x: float) -> str:
    return f"{x:g}"


def verdict(r: dict) -> str:
    """``2,000 steps, ...: flat`` or what is not."""
    judged = {k: v for k, v in r["analysis"].items() if k != "metrics_bytes"}
    bad = [k for k, v in judged.items() if v.get("flat", v.get("bounded")) is False]
    na = [k for k, v in judged.items() if v.get("flat", v.get("bounded")) is None]
    out = f"{r['job']['steps']:,} steps ({r['steps_per_s']:.2f} steps/s, {r['timestamp'][:10]}): "
    out += ("not flat: " + ", ".join(bad)) if bad else "everything judged is flat"
    return out + (f" (not judged: {', '.join(na)})" if na else "")


def readme_section(runs: dict) -> str:
    order = sorted(runs.values(), key=lambda r: r["job"]["steps"])
    mi = order[0]["machine"]
    return render("soak", summary=order[0]["job"]["summary"], window=f"{WINDOW:.0%}",
                  tolerance=f"{TOLERANCE:.0%}", settle=f"{SERVER_SETTLE_S:g}",
                  python=mi["python"], torch=mi["torch"],
                  nats_server=mi.get("nats-server") or "no nats-server",
                  verdicts="; ".join(verdict(r) for r in order),
                  table=table(["run", "resource", "first", "last", "change",
                               "range after warm-up", "result"],
                              [row for r in order for row in run_rows(r)]))


# -- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    p.add_argument("--every", type=int, default=None,
                   help="sample every K steps (default: steps / 100, at least 1)")
    p.add_argument("--nats", default=None,
                   help="'memory' for the in-process bus, a URL to join; default: embedded nats-server")
    p.add_argument("--events-max-bytes", type=int, default=1024**2,
                   help="node.events_max_bytes of the run (default 1 MiB, the smallest allowed)")
    p.add_argument("--quick", action="store_true", help="60 steps; print JSON, write nothing")
    p.add_argument("--no-write", action="store_true", help="print JSON, write nothing")
    p.add_argument("--render", action="store_true",
                   help="only rewrite the README section from results/soak.json")
    args = p.parse_args(argv)

    def stored() -> dict:
        try:
            return json.loads(RESULTS.read_text()).get("runs", {})
        except (OSError, ValueError):
            return {}

    if args.render:  # the analysis again, from the stored samples, with this version's rules
        runs = stored()
        for r in runs.values():
            r["analysis"] = analyse(r, r["job"]["steps"], r["job"]["events_max_bytes"])
        RESULTS.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
        replace_section("soak", readme_section(runs))
        return 0
    steps = 60 if args.quick else args.steps
    every = args.every or max(1, steps // 100)
    mi = machine_info()
    with tempfile.TemporaryDirectory(prefix="rollart-soak-") as tmp:
        res = run_soak(steps, every, args.nats, args.events_max_bytes, Path(tmp))
    mi["loadavg_end"] = loadavg()
    bus = ("in-process bus" if args.nats == "memory" else
           f"nats-server at {args.nats}" if args.nats else "embedded nats-server")
    summary = ("tiny model h32 l1 v512, 1 torch thread; FrozenLake 4x4 fixed map, max_turns 2; "
               "group_size 2, batch_groups 1, alpha 1; checkpoint every step, keep_weights 3")
    result = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": mi,
        "job": {"steps": steps, "every": every, "nats": bus,
                "events_max_bytes": args.events_max_bytes, "summary": summary},
        **res,
        "analysis": analyse(res, steps, args.events_max_bytes),
    }
    print(json.dumps(result, indent=2, ensure_ascii=False))
    if not (args.quick or args.no_write):
        runs = stored()  # one entry per (steps, bus): a longer run sits next to the default one
        runs[f"{steps}-{args.nats or 'embedded'}"] = result
        store(RESULTS, {"runs": runs}, "soak", readme_section(runs))
        say(f"wrote {RESULTS} and the soak section of the README")
    return 0


if __name__ == "__main__":
    sys.exit(main())
