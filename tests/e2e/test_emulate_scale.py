"""``benchmarks/emulate_scale.py --quick``: one nats-server and real ``python -m rollart.node``
processes (a scheduler head, two generate nodes of emulated replicas, an env node) run every
admitted trajectory to completion, and the accounting adds up: completed == admitted, CPU
time measured for every role, percentiles in order, every node exited by itself and none is
left behind. Not its speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bench_module import load_bench

pytestmark = pytest.mark.slow


def _bench():
    return load_bench("emulate_scale")


def test_quick_scale_run_adds_up(tmp_path, capsys):
    b = _bench()
    before = b.RESULT_FILE.stat().st_mtime if b.RESULT_FILE.exists() else None
    readme = (b.HERE / "README.md").read_text()
    rc = b.main(["--quick", "--run-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 0, out.err[-4000:]
    res = json.loads(out.out)
    assert res["quick"] and res["accounting_errors"] == []

    t = res["trajectories"]
    assert t["completed"] == t["admitted"] == 64 and t["dead"] == 0 and t["cancelled"] == 0
    assert 3 * t["completed"] <= res["turns"] <= 6 * t["completed"]
    assert 0 < res["in_flight"]["peak_trajectories"] <= t["admitted"]
    assert res["layout"]["nodes"] == 4 and res["layout"]["generate_replicas"] == 4
    assert res["events"] == 3 * t["completed"] + 3 * res["turns"] and res["events_per_s"] > 0
    assert res["bus"]["messages_in"] > 2 * res["turns"]  # at least a request and a reply a turn

    roles = res["cpu"]["roles"]
    assert set(roles) == {"scheduler", "env", "generate", "nats-server"}
    for name, r in roles.items():
        assert r["cpu_s"] > 0 and r["cpu_ms_per_trajectory"] > 0, (name, r)
    assert abs(sum(r["cpu_s"] for r in roles.values()) - res["cpu"]["rollart_total_cpu_s"]) < 0.01

    for name, d in res["latency"].items():
        assert d["n"] > 0, name
        assert 0 <= d["p50_ms"] <= d["p90_ms"] <= d["p99_ms"] <= d["max_ms"], (name, d)
    hops = res["latency"]
    assert hops["env_to_generate"]["n"] == hops["generate_to_env"]["n"] == res["traces"]["turns_traced"]
    share = res["bus_share"]
    assert share["n"] == res["traces"]["trajectories_traced"] > 0
    assert 0 <= share["p50"] <= share["p99"] <= share["max"] <= 1

    # every node drained and exited by itself; no process of the run is left
    assert res["node_exit_codes"] and all(rc == 0 for rc in res["node_exit_codes"].values()), \
        res["node_exit_codes"]
    for p in res["processes"]:
        assert not os.path.exists(f"/proc/{p['pid']}") or _zombie(p["pid"]), p
    # a quick run writes nothing under benchmarks/
    assert (b.RESULT_FILE.stat().st_mtime if b.RESULT_FILE.exists() else None) == before
    assert (b.HERE / "README.md").read_text() == readme
    assert "Scale" in b.section(res)  # the README section renders from a result


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def test_bad_arguments_are_refused_with_a_message(capsys):
    b = _bench()
    with pytest.raises(SystemExit) as e:
        b.parse(["--env-nodes", "0"])
    assert e.value.code == 2 and "--env-nodes must be >= 1" in capsys.readouterr().err
