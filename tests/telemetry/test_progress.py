"""The progress line of `rollart run` fits 80 columns; `rollart top` reads the run's progress
from the trainer's ledger summary, not from what it counted since it started."""

from __future__ import annotations

import re
import time

from rollart import messages as m
from rollart.app.monitor import RunMonitor
from rollart.telemetry.progress import StepClock, fmt_duration, step_line

METRICS = {  # one step's metrics as the trainer reports them (version comes back as a float)
    "step": 12.0, "version": 12.0, "reward": 0.531, "success": 0.5, "gen_tokens": 4096.0,
    "train_s": 0.61, "wait_s": 0.2, "staleness": 0.4, "traj_generate_s": 0.123,
    "traj_step_s": 0.01, "wall_s": 15.2,
}


def test_bar_fields_fit_80_columns_in_priority_order():
    line = step_line(METRICS, 100, eta_s=83.4, elapsed_s=15.0, width=80)
    assert len(line) <= 80, line
    assert line.startswith("step 12/100 v12 success 0.50 reward 0.53 ETA 1:23"), line
    assert "v12.0" not in line
    assert "tok/s" in line  # room left at 80 columns: the next field in priority order


def test_bar_keeps_the_required_fields_when_narrow_and_shows_all_when_wide():
    narrow = step_line(METRICS, 100, eta_s=83.4, width=56)
    assert narrow == "step 12/100 v12 success 0.50 reward 0.53 ETA 1:23"
    full = step_line(METRICS, 100, eta_s=3725, elapsed_s=15.0, width=None)
    for field in ("ETA 1:02:05", "tok/s", "stale 0.4", "traj gen 0.12s env 0.01s",
                  "train 0.61s wait 0.20s", "elapsed 0:15"):
        assert field in full, full


def test_eta_from_the_steps_of_this_process():
    clock = StepClock(now=0.0)
    assert clock.eta(10) is None
    clock.step(1, now=5.0)   # model loading and the first batch
    assert clock.eta(10) == 9 * 5.0
    clock.step(3, now=9.0)   # 2 s per step since
    assert clock.eta(10) == 7 * 2.0
    assert fmt_duration(None) == "?" and fmt_duration(59.6) == "1:00"


def test_top_shows_step_eta_and_totals_since_the_run_started():
    mon = RunMonitor("r1")
    assert "no progress" in mon.progress()
    now = time.time()
    mon.ledger = m.LedgerSummary(version=40, steps_total=100, started_at=now - 600, step_s=2.0,
                                 last_step_s=1.5, trained=320, trajectories=2560, lost=3,
                                 dead=5, ts=now)
    mon.streams = {"events": {"messages": 9000, "last_seq": 9100}, "work": {"messages": 64}}
    text = mon.progress(now)
    assert text.startswith("step 40/100"), text
    assert "ETA 2:00" in text and "elapsed 10:00" in text and "last step 1.50s" in text
    totals = mon.totals()
    assert "2560 trajectories in 320 groups" in totals and "3 groups lost" in totals
    assert "5 dead letters" in totals and "9100 events" in totals and "64 requests queued" in totals
    # the end of this run (not one left by an earlier process) is shown instead of an ETA
    mon.run_end = m.RunEnd(stage="ended", version=100, steps=100, ts=now - 700)
    assert "ETA" in mon.progress(now)
    mon.ledger = m.LedgerSummary(version=100, steps_total=100, started_at=now - 600, ts=now)
    mon.run_end = m.RunEnd(stage="ended", version=100, steps=100, ts=now,
                           result={"greedy_success": 1.0})
    assert re.search(r"step 100/100, run ended, greedy success 1\.00", mon.progress(now))
    from rich.console import Console

    console = Console(file=open("/dev/null", "w"), width=100)
    console.print(mon.render())


def test_top_counts_completions_by_stop_reason():
    """A trajectory cut by ``max_trajectory_s`` shows in ``rollart top`` (and its snapshot)."""
    from rich.console import Console

    from rollart.app.queues import snapshot
    from rollart.bus.codec import encode

    mon = RunMonitor("r1")
    subj = m.subject("r1", "rollout.completed")
    for i, stop in enumerate(["max_time", "terminated", "max_time"]):
        done = m.RolloutCompleted(traj_id=f"g000000-{i}", group_id="g000000", env="main", seed=0,
                                  token_ids=[1, 2], response_mask=[0, 1], logprobs=[0.0, -0.5],
                                  reward=0.0, stop_reason=stop, finished_at=1.0)
        mon.observe(subj, encode(done))
    assert dict(mon.stops) == {"max_time": 2, "terminated": 1}
    assert snapshot(mon)["stop_reasons"] == {"max_time": 2, "terminated": 1}
    console = Console(file=open("/dev/null", "w"), width=120, record=True)
    console.print(mon.render())
    assert "max_time 2, terminated 1" in console.export_text()
