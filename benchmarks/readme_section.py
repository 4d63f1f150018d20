"""Each benchmark owns one section of benchmarks/README.md, between its markers."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
HEADER = ("# Benchmarks\n\nEach script here measures one part of rollart on the machine it runs on "
          "and rewrites its own section of this file (between its markers) and its file in "
          "`results/`.\n")


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


def store(path: Path, results: dict, name: str, section: str) -> None:
    """A full run's end: ``results`` as JSON in ``path`` (under ``results/``) and ``section``
    as the README's section ``name``."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    replace_section(name, section)


def quiet_transformers() -> None:
    """No download progress bars or info lines from transformers (when it is installed)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def machine() -> dict:
    """What a result was measured on: CPUs, the load at the start, Python."""
    import os
    import platform

    return {"cpu_count": os.cpu_count(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version()}
