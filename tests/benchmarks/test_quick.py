"""Every benchmark's ``--quick`` mode runs against the code as it is now: a benchmark that
nobody runs rots (a renamed key, a moved method) until the day its numbers are needed.
Asserted: it exits 0, prints its JSON, and writes nothing under ``benchmarks/`` (a quick run
is a smoke run; the README's numbers come from full runs). Not its speed.

Run by ``make bench-smoke`` (marked ``bench``, left out of ``make test``); CI runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
pytestmark = pytest.mark.bench

QUICK = sorted(p.stem for p in BENCH.glob("*.py")
               if "--quick" in (text := p.read_text()) and '__name__ == "__main__"' in text
               and p.stem not in ("gpu_check",))
"""Scripts with a ``--quick`` mode (gpu_check needs a GPU: it says so and exits; ``common`` is
the scripts' shared module, not a script)."""


def _stamps() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in BENCH.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def _last_json(out: str):
    """The JSON document the script printed last (some print progress lines first)."""
    start = out.find("{")
    while start != -1:
        try:
            return json.loads(out[start:])
        except ValueError:
            start = out.find("{", start + 1)
    return None


def test_the_quick_list_is_not_empty():
    assert {"learning", "weight_sync", "affinity", "cpu_per_turn"} <= set(QUICK), QUICK


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", QUICK)
def test_quick_mode_runs(name, tmp_path):
    before = _stamps()
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--quick"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, f"{name} --quick exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert _last_json(r.stdout) is not None, f"{name} --quick printed no JSON:\n{r.stdout[-1500:]}"
    changed = sorted(k for k, t in _stamps().items() if before.get(k) != t)
    assert not changed, f"{name} --quick wrote {changed}"
