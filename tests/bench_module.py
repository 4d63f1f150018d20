"""A benchmark script (``benchmarks/<name>.py``) loaded as a module, for the tests that call its
functions (the benchmarks are scripts, not a package: they import their shared ``common`` module
from their own folder, which a script run as ``python benchmarks/x.py`` has on ``sys.path``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, executed afresh, registered as ``bench_<name>`` the first time."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(f"bench_{name}", mod)
    spec.loader.exec_module(mod)
    return mod
