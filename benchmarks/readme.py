"""Rebuild ``benchmarks/README.md`` from ``results/``: every benchmark's section rendered from
its stored numbers, as its last full run wrote it, in the order below. For after a change to a
template in ``prose/`` or to a section renderer; a benchmark's own full run rewrites only its
section.

::

    python benchmarks/readme.py
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable

from common import HEADER, README, RESULTS


def _stored(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _section(script: str, function: str, result: str, read: Callable[[dict], object] = lambda r: r):
    """The section of ``script``: ``function(read(results/<result>.json))``."""
    return lambda: getattr(importlib.import_module(script), function)(read(_stored(result)))


def _emulate() -> str:
    """E1-E6's sections, each from its stored results and the settings that run recorded."""
    emulate = importlib.import_module("emulate")
    parts = []
    for exp in emulate.EXPERIMENTS:
        res = _stored(f"emulate_{exp}")
        args = emulate.for_experiment(emulate.parse([exp]), exp)
        args.time_scale, args.bus, args.profile = res["time_scale"], res["bus"], res["profile"]
        parts.append(emulate.SECTIONS[exp](res, args))
    return "\n\n".join(parts)


SECTIONS: list[tuple[str, Callable]] = [
    ("bus", _section("bus", "readme_section", "bus")),
    ("rollout_modes", _section("rollout_modes", "readme_section", "rollout_modes")),
    ("learning", _section("learning", "readme_section", "learning")),
    ("soak", _section("soak", "readme_section", "soak", lambda r: r["runs"])),
    ("routing", _section("routing", "readme_section", "routing")),
    ("tracing", _section("tracing_overhead", "section", "tracing")),
    ("affinity", _section("affinity", "readme_section", "affinity")),
    ("agent_endpoint", _section("agent_endpoint", "readme_section", "agent_endpoint")),
    ("cpu_per_turn", _section("cpu_per_turn", "readme_section", "cpu_per_turn")),
    ("weight_sync", _section("weight_sync", "section", "weight_sync")),
    ("weight_delta", _section("weight_sync", "delta_section", "weight_delta")),
    ("real_size", _section("real_size", "section", "real_size")),
    ("checkpoint_cost", _section("checkpoint_cost", "section", "checkpoint_cost")),
    ("trainer_ranks", _section("trainer_ranks", "section", "trainer_ranks")),
    ("fsdp2", _section("fsdp2", "section", "fsdp2")),
    ("lora", _section("lora", "section", "lora")),
    ("megatron", _section("megatron_backend", "section", "megatron_backend")),
    ("quickstart_seeds", _section("quickstart_seeds", "readme_section", "quickstart_seeds")),
    ("collapse_recovery", _section("collapse_recovery", "readme_section", "collapse_recovery")),
    ("beyond_demo", _section("beyond_demo", "readme_section", "beyond_demo_sokoban")),
    ("terminal_agent", _section("terminal_agent", "readme_section", "terminal_agent")),
    ("emulate", _emulate),
    ("emulate_scale", _section("emulate_scale", "section", "emulate_scale")),
    ("sandbox", _section("sandbox", "readme_section", "sandbox")),
    ("eval_share", _section("eval_share", "section", "eval_share")),
    ("sites", _section("sites", "section", "sites")),
]
"""(README section, what renders it from results/), in the README's order."""


def build() -> str:
    """The whole README, rendered from ``results/``."""
    return HEADER + "".join(f"\n{render()}\n" for _, render in SECTIONS)


def main() -> int:
    README.write_text(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
