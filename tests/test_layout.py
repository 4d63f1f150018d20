"""The package layout of docs/design.md § 7, checked from the source: which way imports go.

Every import counts, wherever it is written (module top, inside a function, under
``if TYPE_CHECKING:``): a cycle hidden in a function is still a cycle for a reader.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "rollart"

LAYERS = [
    # leaves: no rollart import at all
    {"rollart.errors", "rollart.aio", "rollart.procs", "rollart.bus.base", "rollart.bus.codec",
     "rollart.algos"},
    {"rollart.messages"},  # the wire contract
    {"rollart.envs"},
    {"rollart.config"},
    {"rollart.sandbox"},  # isolated workspaces for model-written code: config only
    {"rollart.bus"},  # connections read the nats section of a config
    {"rollart.telemetry"},  # instrumentation
    {"rollart.engines"},
    {"rollart.agents"},  # the agents' endpoint and protocols: nothing of the actors
    {"rollart.code"},  # tasks that run code (envs, scorers, agents) over rollart.sandbox
    {"rollart.actors.kernel"},  # how any actor runs
    {"rollart.actors.groups"},  # what scheduler and trainer share
    {"rollart.actors"},  # the roles (apart from each other: test_roles_stay_apart)
    {"rollart.emulate"},  # latency models behind the actors' extension points (benchmarks)
    {"rollart.node"},
    {"rollart.security", "rollart.deploy"},
    {"rollart.app"},  # commands and entry points; nothing imports it
]
"""Bottom to top: a module imports only from its own layer or the ones below."""

def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            cands = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for c in cands:
            while c and c not in MODULES:
                c = c.rpartition(".")[0]
            if c and c != name:
                found.add(c)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(mod: str) -> int:
    if mod.endswith(".__main__"):  # an entry point (python -m ...): the app layer's
        return len(LAYERS) - 1
    best, depth = None, -1
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    return best if best is not None else -1


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "rollart" and _layer(m) < 0] == []


def test_no_import_goes_up_a_layer():
    up = sorted(f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
                if _layer(a) >= 0 and _layer(b) > _layer(a)
                and b != "rollart")  # the package root holds only the version
    assert up == []


def test_no_library_imports_the_app_layer():
    lib = sorted(f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
                 if b.startswith("rollart.app") and _layer(a) < len(LAYERS) - 1)
    assert lib == []


ROLES = ["scheduler", "env", "generate", "trainer", "reward"]
"""Role packages under rollart.actors: each imports the kernel and groups, never another role."""


def _role(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["rollart", "actors"] and parts[2] in ROLES else None


def test_every_actor_module_is_in_the_kernel_groups_or_a_role():
    loose = sorted(m for m in MODULES if m.startswith("rollart.actors.")
                   and m.split(".")[2] not in (*ROLES, "kernel", "groups"))
    assert loose == []


def test_roles_stay_apart():
    crossing = sorted(f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
                      if _role(a) and _role(b) and _role(a) != _role(b))
    assert crossing == []


def test_the_agents_know_nothing_of_the_actors():
    tied = sorted(f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
                  if a.startswith("rollart.agents") and b.startswith("rollart.actors"))
    assert tied == []


MAX_LINES = 450
"""A module longer than this says in its docstring why it is kept whole ("Kept whole (...):")."""


def test_a_long_module_says_why_it_is_kept_whole():
    long = []
    for name, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Kept whole (" not in doc:
                long.append(f"{name}: {text.count(chr(10))} lines")
    assert long == []


def test_there_is_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("module", ["rollart.app.cli", "rollart.app.node", "rollart.node",
                                    "rollart.actors.env.manager"])
def test_a_command_or_an_env_node_does_not_import_torch(module):
    """torch is the optional ``train`` extra: ``rollart tap`` or an env-only node never loads it."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
