"""Generators at another site than the trainer (issue 48 §4): the step time of an emulated run
whose weights cross a wide-area link **synchronously** (the site waits for each version to
arrive before generating with it: generation is paused while it crosses) against
**asynchronously** (the site keeps generating with the version it holds, within α, while the
next one is in transit), at 1, 10 and 25 Gbit/s with a 20 ms round trip; the paper's
1.10-1.16x beside it.

::

    python benchmarks/sites.py [--quick] [--rates 1,10,25] [--rtt-ms 20] [--steps N]
                               [--model-gb 16] [--time-scale 0.04] [--wire-mb-s 32]

The run is E3's healthy mix of ``benchmarks/emulate.py`` (``rollout.mode: trajectory``,
α = 1, the ``h800`` profile's 8B-class engine, the emulated trainer): the real scheduler,
EnvManager, LLMProxy, Trainer and memory bus, emulated hardware. The generate replica is a
:class:`rollart.emulate.link.SiteLLMProxy`: before loading version v it fetches the version's
bytes from a :class:`~rollart.emulate.link.ByteSource` (the trainer's site) through a
:class:`~rollart.emulate.link.DelayRelay`, a user-space TCP relay that delays each direction
by RTT/2 and paces it to the link rate, both scaled: time by ``--time-scale`` (as every
emulated latency), bytes by a factor chosen so the fastest link is ``--wire-mb-s`` real MB/s
through the relay; a modelled transfer of B bytes at R takes B / R + RTT, run x time-scale,
and the run waits on those real bytes. *local* is the same run with nothing crossing. Step
time: the mean interval between the trainer's steps after the first (start-up), in modelled
seconds. Prints JSON; a full run writes ``results/sites.json`` and its section of
``README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from common import RESULTS, add_run_flags, begin, describe_machine, finish, in_turn, render, sayer, table, writes

import emulate
from rollart.emulate.link import ByteSource, DelayRelay, scaled_link
from rollart.emulate.records import RECORDS

NAME = "sites"
say = sayer(NAME)
SITE_TYPE = "rollart.emulate.link:SiteLLMProxy"
PAPER = (1.10, 1.16)
"""Asynchronous cross-cluster weight transfer: 1.10-1.16x shorter step time."""
MIX = "healthy"


def bench_args(args, tmp: Path) -> argparse.Namespace:
    """What :func:`emulate.base_cfg` reads, for this benchmark's run."""
    return argparse.Namespace(
        replicas=1, run_dir=tmp, max_new_tokens=4096, group_size=args.group_size,
        batch_groups=args.batch_groups, concurrency=args.group_size * args.batch_groups * 2,
        seed=0, timeout=args.timeout, bus="memory", gantt=None)


def run_cfg(args, eargs, link: dict | None):
    mx = emulate.MIXES[MIX]
    env = {**mx["env"], "success": 0.5, "obs_words": 16, "time_scale": args.time_scale}
    engine = {"profile": "h800", "time_scale": args.time_scale, "out_mean": mx["out_mean"],
              "out_sigma": 0.5, "model_gb": args.model_gb}
    trainer = {**mx["train"], "model_gb": args.model_gb, "time_scale": args.time_scale}
    cfg = emulate.base_cfg(eargs, env_args=env, mode="trajectory", alpha=args.alpha,
                           engine=engine, max_turns=8, trainer=trainer, steps=args.steps)
    actors = dict(cfg.actors)
    actors["generate"] = msgspec.structs.replace(
        actors["generate"], type=SITE_TYPE,
        args={"emulate": engine, "site_link": link or {}, "version_wait": 3600.0})
    return msgspec.structs.replace(cfg, actors=actors)


async def one_run(args, eargs, label: str, link: dict | None) -> dict:
    """One training run; its step times (modelled s), generation pauses and crossings."""
    cfg = run_cfg(args, eargs, link)
    got = await emulate._run_training(args, cfg, label, bus="memory")
    rows, wall = got["rows"], got["wall_s"]
    gens = [a for a in got["actors"] if a.role == "generate"]
    ts = args.time_scale
    steps = [(b["wall_s"] - a["wall_s"]) / ts for a, b in zip(rows, rows[1:])]
    pauses = [p for g in gens for v, p in g.pauses if v > 0]
    cross = list(RECORDS.crossings)
    return {"label": label, "steps": len(rows), "wall_s": round(wall, 2),
            "step_s": round(statistics.mean(steps), 2) if steps else None,
            "step_s_all": [round(s, 1) for s in steps],
            "pause_s": round(statistics.mean(pauses) / ts, 2) if pauses else 0.0,
            "versions_crossed": len(cross),
            "transfer_s": round(statistics.mean(c["model_s"] for c in cross), 2) if cross else None,
            "wire_bytes": sum(c["wire_bytes"] for c in cross)}


async def amain(args) -> dict:
    rates = args.rates
    byte_scale = args.wire_mb_s * 1e6 * args.time_scale / (max(rates) * 1e9 / 8)
    version_bytes = args.model_gb * 1e9
    wire = int(version_bytes * byte_scale)
    rtt = args.rtt_ms / 1e3
    out = {"byte_scale": byte_scale, "version_bytes": int(version_bytes),
           "wire_bytes_per_version": wire, "rates": []}
    with tempfile.TemporaryDirectory(prefix="rollart-sites-") as tmp:
        eargs = bench_args(args, Path(tmp))
        async with ByteSource() as src:
            if not args.quick:
                r = await one_run(args, eargs, "local", None)
                say(f"local: step {r['step_s']} s (modelled), wall {r['wall_s']} s")
                out["local"] = r
            rows = {}
            for rnd in range(args.rounds):
                for k, gbit in enumerate(rates):
                    delay, rate = scaled_link(gbit, rtt, time_scale=args.time_scale,
                                              byte_scale=byte_scale)
                    expected = version_bytes * 8 / (gbit * 1e9) + rtt
                    row = rows.setdefault(gbit, {
                        "gbit_s": gbit, "rtt_ms": args.rtt_ms, "relay_delay_s": delay,
                        "relay_rate_bytes_s": round(rate), "expected_transfer_s": round(expected, 2),
                        "runs": []})
                    for mode in in_turn(("sync", "async"), k + rnd):
                        async with DelayRelay(("127.0.0.1", src.port), delay_s=delay,
                                              rate=rate) as relay:
                            link = {"host": "127.0.0.1", "port": relay.port, "wire_bytes": wire,
                                    "mode": mode, "time_scale": args.time_scale}
                            r = await one_run(args, eargs, f"{gbit:g} Gbit/s {mode}", link)
                        r.update(mode=mode, round=rnd)
                        row["runs"].append(r)
                        say(f"round {rnd + 1}, {gbit:g} Gbit/s {mode}: step {r['step_s']} s, "
                            f"generation paused {r['pause_s']} s a version, transfer "
                            f"{r['transfer_s']} s (expected {expected:.2f}), wall {r['wall_s']} s")
            for gbit in rates:
                row = rows[gbit]
                for mode in ("sync", "async"):
                    runs = [r for r in row["runs"] if r["mode"] == mode]
                    row[mode] = {k: round(statistics.mean(r[k] for r in runs), 2)
                                 for k in ("step_s", "pause_s", "transfer_s")}
                    row[mode]["versions_crossed"] = sum(r["versions_crossed"] for r in runs)
                s_, a_ = row["sync"]["step_s"], row["async"]["step_s"]
                row["ratio"] = round(s_ / a_, 3)
                per = [rs["step_s"] / ra["step_s"] for rs, ra in
                       zip([r for r in row["runs"] if r["mode"] == "sync"],
                           [r for r in row["runs"] if r["mode"] == "async"])]
                row["ratio_rounds"] = [round(x, 3) for x in per]
                if out.get("local"):
                    row["async_over_local"] = round(a_ / out["local"]["step_s"], 3)
                say(f"{gbit:g} Gbit/s: sync / async step time {row['ratio']}x "
                    f"(rounds {row['ratio_rounds']})")
                out["rates"].append(row)
    return out


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.0f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def section(res: dict) -> str:
    c = res["config"]
    rows = []
    for r in res["rates"]:
        per = r.get("ratio_rounds") or []
        spread = f" ({min(per):.2f}-{max(per):.2f})" if len(per) > 1 else ""
        rows.append([f"{r['gbit_s']:g} Gbit/s", _fmt_bytes(res["version_bytes"]),
                     r["expected_transfer_s"], r["sync"]["transfer_s"],
                     r["sync"]["step_s"], r["async"]["step_s"],
                     r["sync"]["pause_s"], r["async"]["pause_s"],
                     f"{r['ratio']:.2f}x{spread}", f"{PAPER[0]:.2f}-{PAPER[1]:.2f}x"])
    local = res.get("local") or {}
    return render(NAME, table=table(
        [f"link ({c['rtt_ms']:g} ms RTT)",
         "bytes / version", "transfer s (model)", "transfer s (relay)", "step s sync",
         "step s async", "paused s / version (sync)", "paused s (async)",
         "sync / async (rounds)", "paper"],
        rows),
        model_gb=f"{c['model_gb']:g}", steps=c["steps"], rounds=c["rounds"], alpha=c["alpha"],
        time_scale=c["time_scale"], local_step=local.get("step_s", "-"),
        wire=_fmt_bytes(res["wire_bytes_per_version"]),
        byte_scale=f"{res['byte_scale']:.2e}", wire_mb_s=f"{c['wire_mb_s']:g}",
        wall=res["wall_s"], machine=describe_machine(res["machine"]),
        date=res["timestamp"][:10])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.0, 10.0, 25.0], help="link rates in Gbit/s (default 1,10,25)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="round trip (default 20 ms)")
    p.add_argument("--steps", type=int, default=9, help="training steps per run (default 9: 8 intervals)")
    p.add_argument("--alpha", type=int, default=1, help="rollout.alpha (default 1)")
    p.add_argument("--model-gb", type=float, default=16.0,
                   help="weight bytes per version, GB (default 16: an 8B model in bf16, the "
                        "emulate profiles' model)")
    p.add_argument("--time-scale", type=float, default=0.04,
                   help="wall seconds per modelled second (default 0.04; quick 0.01)")
    p.add_argument("--wire-mb-s", type=float, default=32.0,
                   help="real MB/s through the relay at the fastest rate (default 32)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each link and mode, in alternating order (default 2; quick 1)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="per run, wall seconds")
    add_run_flags(p, quick="10 Gbit/s only, 3 steps of 2 groups x 4, x0.01")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.steps, args.time_scale, args.rounds = [10.0], 3, 0.01, 1
        args.group_size, args.batch_groups = 4, 2
    res = begin(NAME, args, ("rates", "rtt_ms", "steps", "alpha", "model_gb", "time_scale",
                             "wire_mb_s", "rounds", "group_size", "batch_groups"))
    t0 = time.perf_counter()
    res.update(asyncio.run(amain(args)))
    res["paper"] = list(PAPER)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return finish(res, writes(args), RESULTS / f"{NAME}.json", NAME, section, say)


if __name__ == "__main__":
    sys.exit(main())
