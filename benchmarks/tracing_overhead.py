"""What tracing costs: the learning job with ``tracing.exporter`` ``none`` against ``jsonl``.

::

    python benchmarks/tracing_overhead.py                 # 3 rounds x 30 steps, writes README + JSON
    python benchmarks/tracing_overhead.py --quick         # 1 round x 4 steps; prints JSON only
    python benchmarks/tracing_overhead.py --repeats 5 --steps 40

Runs ``learning.py``'s variants ``alpha1`` (the quickstart job on the MemoryBus, α = 1, tracing
off as configured) and ``alpha1-traced`` (the same with ``tracing: {exporter: jsonl}`` and the
OpenTelemetry metrics beside it), each in a fresh process, interleaved (order reversed every
other round, repeat k sampling with seed k), and reports seconds per step (the trainer's
``wall_s`` over its steps: setup excluded), CPU seconds per step, the spans written per step
and the size of ``traces.jsonl``. Greedy success is not evaluated (this measures cost, not
learning). The machine is a shared 2-core one: the CPU other processes used meanwhile is
reported beside each run. Writes ``benchmarks/results/tracing.json`` and the ``tracing``
section of ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import learning  # noqa: E402  (benchmarks/ is not a package)
from common import (RESULTS as RESULTS_DIR, describe_machine, finish, in_turn, loadavg, machine,
                    render, replace_section, table)

RESULTS = RESULTS_DIR / "tracing.json"
VARIANTS = ("alpha1", "alpha1-traced")


def one_run(res: dict) -> dict:
    hist = res["history"]
    n = len(hist)
    last = hist[-1] if hist else {}
    run = {
        "steps": n,
        "s_per_step": round(float(last["wall_s"]) / n, 4) if n else None,
        "cpu_s_per_step": round(float(last["cpu_s"]) / n, 4) if n and "cpu_s" in last else None,
        "others_cores_busy": (res.get("process") or {}).get("others_cores_busy"),
    }
    traces = Path(res.get("run_path", "")) / "traces.jsonl"
    if traces.exists():
        lines = traces.read_text().splitlines()
        run["spans"] = len(lines)
        run["spans_per_step"] = round(len(lines) / max(1, n), 1)
        run["traces_mb"] = round(traces.stat().st_size / 1e6, 2)
    metrics = Path(res.get("run_path", "")) / "otel-metrics.jsonl"
    if metrics.exists():
        run["otel_metric_points"] = sum(1 for _ in metrics.open())
    return run


def off_cost_ns(n: int = 200_000) -> dict:
    """What one call site costs with tracing and metrics off (``exporter: none``), in ns:
    a ``with tracing.span(...)`` block and one ``otel_metrics`` call, best of 5."""
    import timeit

    from rollart.telemetry import otel_metrics, tracing

    assert not tracing.enabled() and not otel_metrics.enabled()

    def site() -> None:
        with tracing.span("generate", {"turn": 1}):
            pass

    def meter() -> None:
        otel_metrics.trajectory("completed", "main")

    return {"span_ns": round(min(timeit.repeat(site, number=n, repeat=5)) / n * 1e9, 1),
            "metric_ns": round(min(timeit.repeat(meter, number=n, repeat=5)) / n * 1e9, 1)}


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def section(results: dict) -> str:
    v = results["variants"]
    rows = []
    for name in VARIANTS:
        runs = v[name]["runs"]
        mb = _median([x.get("traces_mb") for x in runs])
        rows.append([v[name]["label"],
                     f"{v[name]['s_per_step']} ({', '.join(str(x['s_per_step']) for x in runs)})",
                     v[name]["cpu_s_per_step"], _median([x.get("spans_per_step") for x in runs]),
                     None if mb is None else f"{mb} MB",
                     _median([x.get("others_cores_busy") for x in runs])])
    spans = _median([x.get("spans_per_step") for x in v["alpha1-traced"]["runs"]]) or 0
    off_s = spans * results["off"]["span_ns"] * 1e-9
    return render("tracing", config=results["config"], steps=results["steps"],
                  repeats=results["repeats"], ratio=results["ratio_s_per_step"],
                  span_ns=results["off"]["span_ns"],
                  off_share=f"{off_s / v['alpha1']['s_per_step'] * 100:.3f}",
                  machine=describe_machine(results["machine"]), date=results["timestamp"][:10],
                  table=table(["variant", "s/step", "CPU s/step", "spans per step", "traces.jsonl",
                               "others' cores"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of both variants (default 3)")
    p.add_argument("--quick", action="store_true", help="1 round of 4 steps; prints JSON only")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--render", default=None, metavar="RESULTS_JSON",
                   help="only rewrite the README section from a saved results file")
    args = p.parse_args(argv)
    if args.render:
        results = json.loads(Path(args.render).read_text())
        results.setdefault("off", off_cost_ns())
        replace_section("tracing", section(results))
        return 0
    if args.quick:
        args.steps, args.repeats = 4, 1
    write = not (args.quick or args.no_write)
    learning._quiet()
    results: dict = {"benchmark": "tracing", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "config": args.config, "steps": args.steps, "repeats": args.repeats,
                     "machine": machine()}
    runs: dict[str, list[dict]] = {n: [] for n in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rollart-tracing-") as workdir:
        from rollart.engines.provision import model_dir

        model_dir(learning.job_config(args.config, run_dir=workdir, steps=args.steps))
        for k in range(args.repeats):
            for name in in_turn(VARIANTS, k):
                res = learning.run_variant(name, args, workdir, f"{name}-r{k}", k or None)
                runs[name].append(one_run(res))
    results["machine"]["loadavg_end"] = loadavg()
    results["variants"] = {
        name: {"label": learning.VARIANTS[name]["label"], "runs": rs,
               "s_per_step": _median([r["s_per_step"] for r in rs]),
               "cpu_s_per_step": _median([r["cpu_s_per_step"] for r in rs])}
        for name, rs in runs.items()}
    results["round_ratios"] = [round(t["s_per_step"] / b["s_per_step"], 3)
                               for b, t in zip(runs["alpha1"], runs["alpha1-traced"])]
    results["ratio_s_per_step"] = _median(results["round_ratios"])
    results["off"] = off_cost_ns()
    return finish(results, write, RESULTS, "tracing", section, learning.say)


if __name__ == "__main__":
    raise SystemExit(main())
