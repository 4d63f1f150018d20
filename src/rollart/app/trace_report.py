"""Figures from a run's ``traces.jsonl`` (``tracing: {exporter: jsonl}``): where time goes.

Reading and arithmetic first (:func:`load`, :func:`trajectory_rows`, :func:`step_rows`,
:func:`summarize`: plain dicts, no matplotlib), drawing after (:func:`plot_gantt`,
:func:`plot_steps`, :func:`plot_staleness`; matplotlib's Agg backend, imported lazily).

A trajectory's time is tiled into segments that never overlap and cover its span exactly:

- ``env_init`` / ``env_step`` / ``reward``: the EnvManager's ``env.reset`` / ``env.step`` /
  ``reward`` spans;
- ``queued`` and ``engine``: inside each ``generate`` span, its ``generate.request``'s start to
  the start of the ``generate.batch`` that served it (the batch's ``links`` name its requests;
  without one, the request's ``queue_wait_s``), then that batch's own time;
- ``generate``: a ``generate`` span (or request) that cannot be split: the generator's spans
  are missing, or no batch served the request;
- ``waiting``: the rest (transport between processes, the EnvManager's own scheduling).

So the time split of a run sums to 1. Times are seconds since the run's first span.

One module (~420 lines): every figure and table reads the span table built at its top.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

# kind: (label, colour); the Okabe-Ito palette, distinguishable with colour-blindness
KINDS = {"engine": ("generate: engine batch", "#0072B2"),
         "queued": ("generate: queued at generator", "#56B4E9"),
         "generate": ("generate (not split)", "#7F9FBF"), "env_init": ("env init (reset)", "#CC79A7"),
         "env_step": ("env step", "#E69F00"), "reward": ("reward", "#009E73"),
         "waiting": ("waiting (transport, scheduling)", "#D9D9D9")}
LABELS = {k: v[0] for k, v in KINDS.items()}
CHILD = {"env.reset": "env_init", "env.step": "env_step", "reward": "reward"}
STEP_PARTS = {"get_batch": ("get_batch (waiting for samples)", "#BBBBBB"),
              "train": ("train", "#0072B2"), "checkpoint": ("checkpoint (+ metrics)", "#E69F00"),
              "publish": ("publish weights", "#009E73"), "other": ("other", "#CC79A7")}
GANTT_ROWS = 48
GANTT_STEPS = 4


class Traces:
    """The spans of one ``traces.jsonl`` (``bad_lines``: lines skipped), ``t0``: the first
    span's start (ns)."""

    def __init__(self, spans: list[dict], bad_lines: int = 0) -> None:
        self.spans, self.bad_lines = spans, bad_lines
        self.t0 = min((s["start_ns"] for s in spans), default=0)
        self.kids: dict[str, list[dict]] = defaultdict(list)
        for s in spans:
            if s.get("parent_id"):
                self.kids[s["parent_id"]].append(s)

    def named(self, name: str) -> list[dict]:
        return sorted((s for s in self.spans if s["name"] == name), key=lambda s: s["start_ns"])

    def sec(self, ns: int) -> float:
        return (ns - self.t0) / 1e9


def read_spans(path: str | Path) -> tuple[list[dict], int]:
    """The spans of a ``traces.jsonl`` and the number of lines skipped: garbage, or the half
    line a live run (several processes append to the file) is writing. Each span is kept
    slim (long runs have millions): name, span_id, parent_id, start_ns, end_ns, attributes,
    links (the linked span ids) and resource (a shared (service, host, pid) tuple)."""
    spans, bad, shared = [], 0, {}
    with open(path, "rb") as f:
        for line in f:
            try:
                s = json.loads(line) if line.strip() else None
                ok = s is None or (isinstance(s["name"], str) and isinstance(s["span_id"], str)
                                   and 0 < s["start_ns"] <= s["end_ns"] and isinstance(s["end_ns"], int))
            except (ValueError, TypeError, KeyError):  # UnicodeDecodeError is a ValueError
                ok = False
            if not ok or s is None:
                bad += not ok
                continue
            res, links, attrs = s.get("resource"), s.get("links"), s.get("attributes")
            res = tuple(str(res.get(k)) for k in ("service.name", "host.name", "process.pid")) \
                if isinstance(res, dict) else None
            spans.append({"name": shared.setdefault(s["name"], s["name"]), "span_id": s["span_id"],
                          "parent_id": s.get("parent_id"), "start_ns": s["start_ns"],
                          "end_ns": s["end_ns"], "attributes": attrs if isinstance(attrs, dict) else {},
                          "links": [ln.get("span_id") for ln in links or () if isinstance(ln, dict)],
                          "resource": shared.setdefault(res, res)})
    return spans, bad


def load(run_path: str | Path) -> Traces | None:
    """The run folder's traces, or None when it has no ``traces.jsonl``."""
    p = Path(run_path) / "traces.jsonl"
    return Traces(*read_spans(p)) if p.exists() else None


def _num(x: Any) -> float | None:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def _generate(tr: Traces, g: dict, batch_of: dict[str, dict]) -> list[tuple[str, int, int]]:
    """Segments of one ``generate`` span (ns): queued and engine per request it made."""
    reqs = [r for r in tr.kids.get(g["span_id"], ()) if r["name"] == "generate.request"]
    if not reqs:
        return [("generate", g["start_ns"], g["end_ns"])]
    out = []
    for r in reqs:
        b, qw = batch_of.get(r["span_id"]), _num(r["attributes"].get("queue_wait_s"))
        if b is not None:
            out += [("queued", r["start_ns"], b["start_ns"]), ("engine", b["start_ns"], b["end_ns"])]
        elif qw is not None:
            mid = r["start_ns"] + int(qw * 1e9)
            out += [("queued", r["start_ns"], mid), ("engine", mid, r["end_ns"])]
        else:  # unknown: a request that failed, or traces from before queue_wait_s
            out.append(("generate", r["start_ns"], r["end_ns"]))
    return [(k, max(a, g["start_ns"]), min(b, g["end_ns"])) for k, a, b in out]


def _tile(segs: list[tuple[str, int, int]], a: int, b: int) -> list[tuple[str, int, int]]:
    """``segs`` clipped to [a, b], overlaps trimmed (the earlier wins), gaps filled with
    ``waiting``: they cover [a, b] exactly."""
    out, cur = [], a
    for kind, s, e in sorted(segs, key=lambda x: x[1]):
        s, e = max(s, cur), min(e, b)
        if e <= s:
            continue
        if s > cur:
            out.append(("waiting", cur, s))
        out.append((kind, s, e))
        cur = e
    if cur < b:
        out.append(("waiting", cur, b))
    return out


def trajectory_rows(tr: Traces) -> list[dict]:
    """One dict per ``trajectory`` span, by start: ``traj_id``, ``outcome``, ``start``/``end``
    (s), ``segments`` [(kind, start, end)] tiling it, ``admission_s`` (its ``queue_wait_s``:
    the wait in JetStream before an EnvManager took it, or None)."""
    batch_of = {ln: b for b in tr.named("generate.batch") for ln in b.get("links", ())}
    rows = []
    for t in tr.named("trajectory"):
        segs = []
        for c in tr.kids.get(t["span_id"], ()):
            if c["name"] == "generate":
                segs += _generate(tr, c, batch_of)
            elif c["name"] in CHILD:
                segs.append((CHILD[c["name"]], c["start_ns"], c["end_ns"]))
        tiles = _tile(segs, t["start_ns"], t["end_ns"])
        rows.append({"traj_id": str(t["attributes"].get("traj_id") or t["span_id"]),
                     "outcome": t["attributes"].get("outcome"), "start": tr.sec(t["start_ns"]),
                     "end": tr.sec(t["end_ns"]), "admission_s": _num(t["attributes"].get("queue_wait_s")),
                     "segments": [(k, tr.sec(s), tr.sec(e)) for k, s, e in tiles],
                     "ns": {k: sum(e - s for kk, s, e in tiles if kk == k) for k in KINDS}})
    return rows


def step_rows(tr: Traces) -> list[dict]:
    """One dict per ``trainer.step`` span, by start: ``step`` (its version + 1), seconds of
    each of :data:`STEP_PARTS` (``other``: the step's time outside its children), ``total``,
    ``end`` (s since the run's start), ``staleness`` (its counts, or None)."""
    out = []
    for i, st in enumerate(tr.named("trainer.step")):
        v = st["attributes"].get("version")
        total = (st["end_ns"] - st["start_ns"]) / 1e9
        row: dict[str, Any] = {"step": int(v) + 1 if _num(v) is not None else i + 1,
                               "end": tr.sec(st["end_ns"]), "total": total}
        kids = tr.kids.get(st["span_id"], ())
        for part in list(STEP_PARTS)[:-1]:
            row[part] = sum((k["end_ns"] - k["start_ns"]) / 1e9 for k in kids if k["name"] == part)
        row["other"] = max(0.0, total - sum(row[p] for p in list(STEP_PARTS)[:-1]))
        st_counts = st["attributes"].get("staleness")
        ok = isinstance(st_counts, list) and all(_num(c) is not None for c in st_counts)
        row["staleness"] = [int(c) for c in st_counts] if ok else None
        out.append(row)
    return out


def _staleness(steps: list[dict], metrics: list[dict] | None) -> dict:
    """Samples by staleness: from the traces' ``trainer.step`` counts, else per sample from
    metrics.jsonl's ``traj_min_versions``, else steps by their ``max_staleness``."""
    counts: Counter = Counter()
    if any(s["staleness"] is not None for s in steps):
        per_step = []
        for s in steps:
            c = s["staleness"] or []
            counts.update({k: n for k, n in enumerate(c) if n})
            per_step.append((s["step"], sum(k * n for k, n in enumerate(c)) / max(1, sum(c))))
        return {"source": "traces", "unit": "samples", "counts": dict(sorted(counts.items())),
                "mean_by_step": per_step}
    rows = [r for r in metrics or () if _num(r.get("staleness")) is not None]
    if not rows:
        return {"source": None, "unit": None, "counts": {}, "mean_by_step": []}
    exact = all(isinstance(r.get("traj_min_versions"), list) and r["traj_min_versions"] and abs(
        sum(r["step"] - 1 - v for v in r["traj_min_versions"]) / len(r["traj_min_versions"])
        - r["staleness"]) < 1e-6 for r in rows)  # staleness = version before the step - min_version
    for r in rows:
        if exact:
            counts.update(int(r["step"] - 1 - v) for v in r["traj_min_versions"])
        else:
            counts[round(_num(r.get("max_staleness")) or 0.0)] += 1
    return {"source": "metrics" if exact else "metrics_max", "unit": "samples" if exact else "steps",
            "counts": dict(sorted(counts.items())),
            "mean_by_step": [(r["step"], float(r["staleness"])) for r in rows]}


def summarize(tr: Traces | None, metrics: list[dict] | None = None, *,
              trajs: list[dict] | None = None, steps: list[dict] | None = None) -> dict:
    """The numbers of the report and its figures: ``split`` (fraction of all trajectory time
    by kind, sums to 1), ``split_s`` (seconds), ``steps`` (per trainer step seconds),
    ``staleness``, counts of ``spans``/``trajectories``/``bad_lines``, ``processes`` seen
    (service, host, pid), ``hosts``, ``admission_mean_s``, ``wall_s``."""
    trajs = trajectory_rows(tr) if trajs is None and tr is not None else trajs or []
    steps = step_rows(tr) if steps is None and tr is not None else steps or []
    spans = tr.spans if tr is not None else []
    ns = {k: sum(r["ns"][k] for r in trajs) for k in KINDS}
    total = sum(ns.values())
    procs = sorted({s["resource"] for s in spans if s.get("resource")})
    adm = [r["admission_s"] for r in trajs if r["admission_s"] is not None]
    return {"spans": len(spans), "bad_lines": tr.bad_lines if tr is not None else 0,
            "trajectories": len(trajs), "traj_s": total / 1e9,
            "split_s": {k: v / 1e9 for k, v in ns.items()},
            "split": {k: (v / total if total else 0.0) for k, v in ns.items()},
            "steps": [{k: v for k, v in s.items() if k != "staleness"} for s in steps],
            "staleness": _staleness(steps, metrics),
            "processes": procs, "hosts": sorted({p[1] for p in procs}),
            "admission_mean_s": sum(adm) / len(adm) if adm else None,
            "wall_s": (max(s["end_ns"] for s in spans) - tr.t0) / 1e9 if spans else 0.0}


def gantt_window(trajs: list[dict], steps: list[dict], wall_s: float = 0.0,
                 n_steps: int = GANTT_STEPS) -> tuple[float, float, str]:
    """(from, to, what) the Gantt shows, in s: the whole run when it is short (up to 25
    typical trajectories long, or 2 x ``n_steps`` trainer steps), else ``n_steps`` trainer
    steps in its middle (from one version's publication to another's), so that a
    trajectory's turns stay visible."""
    end = max([wall_s] + [r["end"] for r in trajs] + [s["end"] for s in steps])
    durs = sorted(r["end"] - r["start"] for r in trajs)
    typical = durs[len(durs) // 2] if durs else 0.0
    if len(steps) <= 2 * n_steps or end <= 25 * typical:
        return 0.0, end, "the whole run"
    k = len(steps) // 2 - n_steps // 2
    return (steps[k - 1]["end"], steps[k + n_steps - 1]["end"],
            f"trainer steps {steps[k]['step']}-{steps[k + n_steps - 1]['step']} of {len(steps)}")


def pick_rows(trajs: list[dict], n: int = GANTT_ROWS,
              window: tuple[float, float] | None = None) -> list[dict]:
    """Up to ``n`` trajectories (of those that start in ``window``), spread evenly by start."""
    if window is not None:
        trajs = [r for r in trajs if window[0] <= r["start"] < window[1]]
    if len(trajs) <= n:
        return list(trajs)
    return [trajs[round(i * (len(trajs) - 1) / (n - 1))] for i in range(n)]


# -- drawing ---------------------------------------------------------------------------
def _plt():
    import matplotlib  # optional: the train extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the train extra

    return plt


def save_png(fig: Any, out: Path, dpi: int = 120) -> Path:
    """Write ``fig`` to ``out`` atomically (a reader never sees half a PNG) and close it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, out)
    finally:
        _plt().close(fig)
        tmp.unlink(missing_ok=True)
    return out


def _version_lines(ax: Any, steps: list[dict], lo: float, hi: float) -> None:
    steps = [s for s in steps if lo <= s["end"] <= hi]
    every = max(1, math.ceil(len(steps) / 30))  # labels stay apart on long runs
    for i, s in enumerate(steps):
        ax.axvline(s["end"], color="#555555", linewidth=0.7, linestyle="--", alpha=0.7, zorder=1)
        if i % every == 0 or i == len(steps) - 1:
            ax.text(s["end"], 1.005, f"v{s['step']}", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7, color="#333333")


def plot_gantt(trajs: list[dict], steps: list[dict], out: Path, *, title: str = "",
               rows: int = GANTT_ROWS, wall_s: float = 0.0) -> Path:
    """Paper Fig. 3: one row per trajectory (up to ``rows``, evenly by start over the
    :func:`gantt_window`), coloured by what it was doing; dashed lines where the trainer
    published a new policy version."""
    plt = _plt()
    lo, hi, what = gantt_window(trajs, steps, wall_s)
    pad = 0.02 * (hi - lo) if lo > 0 else 0.0
    sample = pick_rows(trajs, rows, (lo, hi))
    fig, ax = plt.subplots(figsize=(12, 7))
    for kind in KINDS:
        y, left, width = [], [], []
        for i, r in enumerate(sample):
            for k, s, e in r["segments"]:
                if k == kind:
                    y.append(i), left.append(s), width.append(e - s)
        if y:
            ax.barh(y, width, left=left, height=0.78, color=KINDS[kind][1], label=LABELS[kind],
                    linewidth=0, zorder=2)
    adm = [(i, r["start"] - r["admission_s"], r["start"]) for i, r in enumerate(sample)
           if r["admission_s"]]
    if adm:
        ax.hlines([a[0] for a in adm], [a[1] for a in adm], [a[2] for a in adm], colors="#777777",
                  linewidth=1.2, linestyles=(0, (1, 1)), zorder=2,
                  label="queued for an EnvManager (before the span)")
    _version_lines(ax, steps, lo - pad, hi + pad)
    ax.set_yticks(range(len(sample)))
    ax.set_yticklabels([r["traj_id"] + ("" if r["outcome"] in (None, "completed") else f" ({r['outcome']})")
                        for r in sample], fontsize=6)
    ax.set_ylim(len(sample) - 0.5, -0.5)
    ax.set_xlim(lo - pad, hi + max(pad, 0.005 * hi) or 1)
    ax.set_xlabel("wall time since the run's first span (s)")
    shown = sum(1 for r in trajs if lo <= r["start"] < hi)
    ax.set_ylabel(f"trajectory ({len(sample)} of {shown}" + (f" started here, {len(trajs)} in all"
                                                             if shown < len(trajs) else "") + ")")
    ax.grid(axis="x", alpha=0.25, zorder=0)
    ax.set_title(f"{title}: trajectory timeline, {what}\ndashed: the trainer published a new "
                 f"policy version (v1, v2, ...)", fontsize=10, pad=16)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: "before the span" in labels[i])  # it last
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower center",
               ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return save_png(fig, out)


def plot_steps(numbers: dict, out: Path, *, title: str = "") -> Path:
    """Paper Fig. 4: per trainer step, stacked seconds of its parts; beside it, how all
    trajectory time split (fractions over the run)."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator  # optional: the train extra

    steps = numbers["steps"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [4, 1.25]})
    x = [s["step"] for s in steps]
    bottom = [0.0] * len(steps)
    total = sum(s["total"] for s in steps) or 1.0
    for part, (label, color) in STEP_PARTS.items():
        vals = [s[part] for s in steps]
        if part == "other" and sum(vals) < 0.01 * total:
            continue  # a sliver: the spans' own bookkeeping
        ax.bar(x, vals, bottom=bottom, width=0.8, color=color, label=label, zorder=2)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("trainer step")
    ax.set_ylabel("seconds")
    ax.set_title("trainer: seconds per step", fontsize=10)
    ax.grid(axis="y", alpha=0.25, zorder=0)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if x:
        ax.set_xlim(min(x) - 0.6, max(x) + 0.6)
    split, b = numbers["split"], 0.0
    for kind in KINDS:
        f = split.get(kind, 0.0)
        if f <= 0:
            continue
        ax2.bar([0], [f * 100], bottom=[b], width=0.6, color=KINDS[kind][1], label=LABELS[kind],
                zorder=2)
        if f >= 0.04:
            ax2.text(0, b + f * 50, f"{f:.0%}", ha="center", va="center", fontsize=8,
                     color="white" if kind in ("engine", "reward") else "black")
        b += f * 100
    ax2.set_xlim(-0.5, 0.5)
    ax2.set_ylim(0, 100)
    ax2.set_xticks([])
    ax2.set_ylabel("% of all trajectory time")
    ax2.set_title(f"trajectory time split\n({numbers['trajectories']} trajectories, "
                  f"{numbers['traj_s']:.0f} s)", fontsize=10)
    handles, labels = ax2.get_legend_handles_labels()
    ax2.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper center",
               bbox_to_anchor=(0.5, -0.04), frameon=False)
    fig.suptitle(f"{title}: trainer steps and trajectory time")
    fig.tight_layout()
    return save_png(fig, out)


def plot_staleness(numbers: dict, out: Path, *, title: str = "") -> Path:
    """How stale the trained samples' policies were: a histogram, and the mean per step."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator  # optional: the train extra

    st = numbers["staleness"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1, 1.4]})
    src = {"traces": "trainer.step spans, per sample", "metrics": "metrics.jsonl, per sample",
           "metrics_max": "metrics.jsonl: steps by their max staleness"}.get(st["source"], "no data")
    if st["counts"]:
        ks = list(st["counts"])
        bars = ax.bar(ks, [st["counts"][k] for k in ks], width=0.7, color="#0072B2", zorder=2)
        ax.bar_label(bars, fontsize=8)
        ax.set_xticks(ks)
        ax.margins(y=0.1)
    ax.set_xlabel("staleness (policy versions behind the trainer)")
    ax.set_ylabel(st["unit"] or "count")
    ax.set_title(f"staleness ({src})", fontsize=9)
    ax.grid(axis="y", alpha=0.25, zorder=0)
    if st["mean_by_step"]:
        ax2.plot(*zip(*st["mean_by_step"]), marker="o", markersize=3, color="#D55E00")
    ax2.set_xlabel("trainer step")
    ax2.set_ylabel("mean staleness")
    ax2.set_ylim(0, max([1.0] + [m for _, m in st["mean_by_step"]]) * 1.1)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("mean staleness of each step's batch", fontsize=9)
    ax2.grid(alpha=0.25)
    fig.suptitle(f"{title}: policy staleness of the trained samples")
    fig.tight_layout()
    return save_png(fig, out)
