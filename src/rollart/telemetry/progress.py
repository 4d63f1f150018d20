"""One line of training progress, fitted to a width: the bar of ``rollart run``, its log
lines when the output is not a terminal, and the step line of ``rollart top``.

Fields in priority order: step/total, policy version, success, reward, ETA; then, as
far as they fit: tokens/s, staleness, the time split (per trajectory: generate, env
step; per step: train, wait) and the elapsed time.
"""

from __future__ import annotations

import time


def fmt_duration(s: float | None) -> str:
    """``1:23``, ``1:02:03`` or ``?`` (unknown)."""
    if s is None or s != s or s < 0 or s == float("inf"):
        return "?"
    s = int(round(s))
    h, rest = divmod(s, 3600)
    mnt, sec = divmod(rest, 60)
    return f"{h}:{mnt:02d}:{sec:02d}" if h else f"{mnt}:{sec:02d}"


def fit(required: list[str], optional: list[str], width: int | None) -> str:
    """``required`` fields, then each ``optional`` one that still fits in ``width``
    (all of them when ``width`` is None); cut to ``width`` if even the required do not fit."""
    line = " ".join(required)
    if width is None:
        return " ".join([line, *optional]) if optional else line
    for f in optional:
        if len(line) + 1 + len(f) <= width:
            line = f"{line} {f}"
    return line[:max(0, width)]


def step_line(mt: dict, total: int, *, eta_s: float | None, width: int | None = None,
              elapsed_s: float | None = None) -> str:
    """The progress of one training step (``mt``: the trainer's step metrics)."""
    tok_s = mt.get("gen_tokens", 0.0) / max(1e-9, mt.get("train_s", 0.0) + mt.get("wait_s", 0.0))
    required = [f"step {int(mt['step'])}/{int(total)}", f"v{int(mt['version'])}",
                f"success {mt['success']:.2f}", f"reward {mt['reward']:.2f}",
                f"ETA {fmt_duration(eta_s)}"]
    optional = [f"tok/s {tok_s:.0f}", f"stale {mt.get('staleness', 0.0):.1f}",
                f"traj gen {mt.get('traj_generate_s', 0.0):.2f}s env {mt.get('traj_step_s', 0.0):.2f}s",
                f"train {mt.get('train_s', 0.0):.2f}s wait {mt.get('wait_s', 0.0):.2f}s"]
    if elapsed_s is not None:
        optional.append(f"elapsed {fmt_duration(elapsed_s)}")
    return fit(required, optional, width)


class StepClock:
    """Seconds per step as this process sees them, for an ETA: from the first step on
    (before a second step, the first one's time, model loading included)."""

    def __init__(self, now: float | None = None):
        self.t0 = time.monotonic() if now is None else now
        self.first: tuple[float, int] | None = None
        self.last: tuple[float, int] | None = None

    def step(self, step: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = (now, step)
        self.last = (now, step)

    def eta(self, total: int) -> float | None:
        if self.first is None or self.last is None:
            return None
        if self.last[1] > self.first[1]:
            per_step = (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])
        else:
            per_step = self.first[0] - self.t0
        return max(0, total - self.last[1]) * per_step

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.t0
