"""What every benchmark script shares: progress lines, the machine it ran on, the ``--quick`` /
``--write`` / ``--no-write`` flags and the end of ``main()`` (print the JSON; on a full run store
it under ``results/`` and rewrite the script's section of ``README.md``), the one markdown table
renderer, the section templates in ``prose/``, a bus to run on, and the wait for a scheduler to
finish.

The scripts import it as ``common`` (a script run as ``python benchmarks/x.py`` has its own folder
on ``sys.path``; the tests load the scripts with ``tests/bench_module.py``, which puts it there).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path

from rollart.bus.memory import MemoryBus
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer, find_binary
from rollart.config import RunConfig, convert
from rollart.config.loader import load_yaml
from rollart.telemetry.hardware import describe_hardware, host_hardware

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
README = HERE / "README.md"
PROSE = HERE / "prose"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
HEADER = """# Benchmarks

Each script here measures one part of rollart on the machine it runs on. A full run writes its
numbers to `results/<name>.json` and rewrites its own section of this file (between its markers)
from them, with the words of `prose/<name>.md`; `--quick` is a smoke run that writes nothing.
`python benchmarks/readme.py` rebuilds every section from `results/`. Earlier numbers live in git
history.
"""


# -- progress ---------------------------------------------------------------------------------
def sayer(name: str) -> Callable[[str], None]:
    """A ``say(text)`` that prints ``[name HH:MM:SS] text`` to stderr (stdout is the JSON)."""

    def say(text: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    return say


def quiet_transformers() -> None:
    """No download progress bars or info lines from transformers (when it is installed)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # optional: only the torch benchmarks have it
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


# -- the machine ------------------------------------------------------------------------------
def version(dist: str) -> str | None:
    """The installed version of the distribution ``dist``; None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def machine(*dists: str, **extra: object) -> dict:
    """What a result was measured on: ``rollart.telemetry.hardware`` (cpus, memory, GPUs in use),
    the CPU model, the load at the start, Python, the versions of ``dists`` and ``extra``."""
    return {**host_hardware(), "cpu_model": cpu_model(), "loadavg_start": loadavg(),
            "platform": platform.platform(), "python": platform.python_version(),
            **{d: version(d) for d in dists}, **extra}


def describe_machine(mi: dict) -> str:
    """``2 cpu, 7.8 GiB, load 1.3 at start, Python 3.11.9`` for a result's ``machine``."""
    hw = dict(mi, cpus=mi.get("cpus") or mi.get("cpu_count"))
    load = mi.get("loadavg_start") or [mi.get("load_start")]
    out = describe_hardware(hw)
    if load and load[0] is not None:
        out += f", load {load[0]:.2f} at start"
    return out + (f", Python {mi['python']}" if mi.get("python") else "")


# -- flags, the start and the end of main() ------------------------------------------------
def add_run_flags(p: argparse.ArgumentParser, quick: str = "a smoke run") -> None:
    """``--quick`` (writes nothing unless ``--write``), ``--write`` and ``--no-write``."""
    p.add_argument("--quick", action="store_true", help=f"{quick}; writes nothing unless --write")
    p.add_argument("--write", action="store_true",
                   help="write results and README even with --quick")
    p.add_argument("--no-write", action="store_true", help="print only")


def writes(args: argparse.Namespace) -> bool:
    """A full run writes; ``--quick`` only with ``--write``; ``--no-write`` never."""
    return not getattr(args, "no_write", False) and (getattr(args, "write", False)
                                                     or not getattr(args, "quick", False))


def begin(name: str, args: argparse.Namespace, keys: Iterable[str]) -> dict:
    """The start of a measured run: warnings-only logging, quiet transformers, and the head of
    its result (name, time, ``--quick``, the settings ``keys`` of ``args``, the machine)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_transformers()
    return {"benchmark": name, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "quick": args.quick, "config": {k: getattr(args, k) for k in keys},
            "machine": machine()}


def finish(res: dict, write: bool, path: Path, name: str, section: Callable[[dict], str],
           say: Callable[[str], None] | None = None) -> int:
    """The end of a benchmark's ``main()``: the JSON on stdout; when ``write``, ``res`` into
    ``path`` and ``section(res)`` into the README. Returns the exit status 0."""
    print(json.dumps(res, indent=2, ensure_ascii=False))
    if write:
        store(path, res, name, section(res))
        (say or sayer(name))(f"wrote {path} and the README section {name}")
    return 0


def store(path: Path, results: dict, name: str, section: str) -> None:
    """``results`` as JSON in ``path`` and ``section`` as the README's section ``name``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    replace_section(name, section)


# -- README sections --------------------------------------------------------------------------
def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(name: str, section: str, path: Path = README) -> None:
    """Put ``section`` (which includes its own markers) in place of the old one, or append it."""
    begin, end = markers(name)
    text = path.read_text() if path.exists() else HEADER
    b, e = text.find(begin), text.find(end)
    if b != -1 and e > b:
        text = text[:b] + section + text[e + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


_NUMERIC = re.compile(r"^[-+~<>≤≥]?\s*[\d.,]+(e[-+]?\d+)?\s*"
                      r"(%|x|s|ms|µs|us|B|M|MB|GB|MiB|GiB|/s)?"
                      r"(\s*\(.*\))?$")


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """The one markdown table renderer: ``columns`` headers, one row per item of ``rows`` (cells
    already formatted, or numbers and None, shown as ``-``). A column whose cells all read as
    numbers is right-aligned."""
    body = [["-" if c is None else str(c) for c in row] for row in rows]
    for row in body:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells under {len(columns)} columns: {row}")
    right = [bool(body) and all(r[i] == "-" or _NUMERIC.match(r[i]) for r in body)
             for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


_PLACEHOLDER = re.compile(r"{{(\w+)}}")


def render(name: str, template: str | None = None, **values: object) -> str:
    """README section ``name``: ``prose/<template or name>.md`` with each ``{{key}}`` replaced by
    ``values[key]`` (a table from :func:`table`, a number, a line), between the markers. A
    placeholder without a value raises KeyError: a template and its script must agree."""
    text = (PROSE / f"{template or name}.md").read_text().strip("\n")

    def fill(m: re.Match) -> str:
        return str(values[m.group(1)])

    begin, end = markers(name)
    return "\n".join((begin, _PLACEHOLDER.sub(fill, text), end))


# -- running ----------------------------------------------------------------------------------
def quickstart_cfg(tag: str, run_dir: Path, *, rollout: dict, actors: dict, threads: int = 1,
                   env: Callable[[dict], dict] | None = None) -> RunConfig:
    """``configs/quickstart.yaml`` for one measured run: a fresh run name (``tag`` + 8 hex
    digits) in ``run_dir``, ``threads`` torch threads, ``rollout`` merged over the quickstart's,
    ``actors`` in place of its, and its env changed by ``env`` when given."""
    data = load_yaml(QUICKSTART)
    data.update(run=f"{tag}{uuid.uuid4().hex[:8]}", run_dir=str(run_dir), actors=actors)
    data["model"] = {**data.get("model", {}), "threads": threads}
    data["rollout"] = {**data.get("rollout", {}), **rollout}
    if env is not None:
        data["envs"] = {"main": env(dict(data["envs"]["main"]))}
    return convert(data, RunConfig)


@contextlib.asynccontextmanager
async def open_bus(kind: str, url: str | None = None, name: str = "rollart-bench") -> AsyncIterator:
    """A connected bus: ``memory`` (a MemoryBus), or ``nats`` to ``url`` or, without one, to an
    embedded nats-server in a temporary folder that goes with it."""
    async with contextlib.AsyncExitStack() as stack:
        if kind == "memory":
            bus = MemoryBus()
        else:
            if url is None:
                d = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{name}-nats-"))
                url = stack.enter_context(EmbeddedServer(Path(d) / "nats")).url
            bus = NatsBus(url, name=name)
        await bus.connect()
        stack.push_async_callback(bus.close)
        yield bus


async def until_done(sched, timeout: float, label: str, groups: int,
                     tick: Callable[[], None] | None = None) -> None:
    """Wait for a RolloutScheduler's ``all_done``, calling ``tick()`` about once a second; a
    TimeoutError naming ``label`` and the groups settled after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not sched.all_done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sched.all_done.wait(), 1.0)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label}: {sched.groups_settled}/{groups} groups after "
                               f"{timeout:.0f} s")
        if tick is not None:
            tick()


def public(obj: object) -> object:
    """``obj`` without the dict keys that start with ``_`` (a run's private working data)."""
    if isinstance(obj, dict):
        return {k: public(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [public(v) for v in obj]
    return obj


def nats_server_version() -> str | None:
    """``nats-server --version`` of the binary rollart runs; None when there is none."""
    try:
        return subprocess.run([find_binary(), "--version"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None


def labelled(name: str, res: dict | None = None) -> list[dict]:
    """Every stored result of benchmark ``name`` (``results/<name>.json`` and the labelled
    ``results/<name>_<label>.json``), with ``res`` in place of its label's, in label order: the
    rows of the benchmark's one README table."""
    runs = {}
    for path in sorted(RESULTS.glob(f"{name}*.json")):
        if path.stem == name or path.stem.startswith(f"{name}_"):
            r = json.loads(path.read_text())
            runs[r.get("label") or ""] = r
    if res is not None:
        runs[res.get("label") or ""] = res
    return [runs[k] for k in sorted(runs)]


def child_env(*first: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child (a ``rollart`` command, a worker): ``first``, then
    the repo's ``src`` on ``PYTHONPATH`` before what was there (so a checkout runs its own code
    without an install), and ``extra``."""
    path = [str(p) for p in (*first, ROOT / "src")] + [os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)


def event_loop() -> tuple[Callable, str]:
    """``(run, name)``: uvloop's ``run`` where it is installed, else ``asyncio.run``."""
    try:
        import uvloop  # optional: the bench extra
    except ImportError:
        return asyncio.run, "asyncio"
    return uvloop.run, f"uvloop {version('uvloop')}"


def in_turn(items: Sequence, k: int) -> Sequence:
    """``items`` in order in round ``k`` when it is even, reversed when odd: no variant of a
    comparison always runs first (and so always on the colder or the busier machine)."""
    return items if k % 2 == 0 else items[::-1]
