"""What a host has and how busy it is, for node heartbeats (``rollart nodes``, ``rollart top``).

Cheap and side-effect free: GPUs are described only when the process already uses CUDA
through torch (torch imported and CUDA initialised by an engine); this module never imports
torch nor initialises CUDA itself.
"""

from __future__ import annotations

import os
import sys
from collections import Counter


def host_hardware() -> dict[str, str | int | float]:
    """``cpus``, ``mem_gib`` and, when this process uses CUDA, ``gpus`` (``"NAME x N"``,
    several names joined with ``", "``) and ``gpu_mem_gib`` (per GPU, the smallest).
    Never raises: what cannot be read is left out."""
    out: dict[str, str | int | float] = {}
    try:
        out["cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        out["cpus"] = os.cpu_count() or 0
    try:
        out["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, ValueError, OSError):
        pass
    out.update(_gpus())
    return out


def _gpus() -> dict[str, str | float]:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():  # never start CUDA for a heartbeat
            return {}
        props = [cuda.get_device_properties(i) for i in range(cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken driver must not stop a heartbeat
        return {}
    if not props:
        return {}
    names = Counter(str(p.name) for p in props)
    return {"gpus": ", ".join(f"{n} x {k}" for n, k in names.items())[:256],
            "gpu_mem_gib": round(min(p.total_memory for p in props) / 2**30, 1)}


def host_load() -> float:
    """The 1-minute load average; 0.0 where the OS has none."""
    try:
        return max(0.0, float(os.getloadavg()[0]))
    except (AttributeError, OSError):
        return 0.0


def describe_hardware(hw: dict) -> str:
    """One short line: ``16 cpu, 125 GiB, NVIDIA H200 x 1 (139 GiB)``; ``-`` when unknown."""
    parts = []
    if hw.get("cpus"):
        parts.append(f"{hw['cpus']} cpu")
    if hw.get("mem_gib"):
        parts.append(f"{hw['mem_gib']:g} GiB" if isinstance(hw["mem_gib"], (int, float))
                     else str(hw["mem_gib"]))
    if hw.get("gpus"):
        mem = hw.get("gpu_mem_gib")
        parts.append(f"{hw['gpus']}" + (f" ({mem:g} GiB)" if isinstance(mem, (int, float)) else ""))
    return ", ".join(parts) or "-"


def describe_versions(versions: dict[str, int], most: int = 3) -> str:
    """``generate v3`` / ``generate-a-0 v3, generate-a-1 v2``; past ``most`` actors only the
    range: ``v2-v3 (8 actors)``; ``-`` when none."""
    if not versions:
        return "-"
    if len(versions) <= most:
        return ", ".join(f"{k} v{v}" for k, v in sorted(versions.items()))
    lo, hi = min(versions.values()), max(versions.values())
    return f"v{lo}" + (f"-v{hi}" if hi != lo else "") + f" ({len(versions)} actors)"
