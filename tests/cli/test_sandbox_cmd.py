"""``rollart sandbox check`` and ``rollart sandbox run``, as a user runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.sandbox.conftest import needs_bwrap

pytestmark = needs_bwrap


def _rollart(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollart", "sandbox", *args], capture_output=True,
                          text=True, timeout=120)


def test_check_probes_every_containment_and_passes_here():
    r = _rollart("check", "--config", "quickstart")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("ok    start a bwrap sandbox")
    assert sum(line.startswith("ok ") for line in lines) == 8
    assert lines[-1] == "all probes contained"


def test_a_configs_binds_are_seen_read_only(tmp_path):
    data = Path(tempfile.mkdtemp(prefix="rollart-bind-"))  # readable by the sandbox's user
    try:
        data.chmod(0o755)
        (data / "visible").write_text("x")
        (data / "visible").chmod(0o644)
        cfg = tmp_path / "binds.yaml"
        cfg.write_text(f"sandbox: {{binds: ['{data}']}}\n")
        r = _rollart("run", "--config", str(cfg), "--json", "--", f"ls {data}; touch {data}/new")
        out = json.loads(r.stdout)
        assert r.returncode == 1 and out["stdout"] == "visible\n"
        assert "Read-only file system" in out["stderr"] and not (data / "new").exists()
    finally:
        shutil.rmtree(data)


def test_run_prints_output_exit_code_and_times():
    r = _rollart("run", "--", "echo out; echo err >&2; exit 3")
    assert r.returncode == 1
    assert r.stdout.splitlines()[:2] == ["out", "err"]
    assert r.stdout.splitlines()[-1].startswith("[exit 3; wall ")
    r = _rollart("run")
    assert r.returncode == 2 and "give the command after --" in r.stderr
