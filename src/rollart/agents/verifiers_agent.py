"""Verifiers environments: envs of ``type: verifiers:<taskset-id>``.

`verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ (``pip install verifiers``,
0.4's ``verifiers.v1`` API) packages an environment as a *taskset*: an importable module
exporting a ``vf.Taskset`` subclass whose ``load()`` yields ``vf.Task`` objects (a
``vf.TaskData`` row: prompt, system prompt, reference answer...) scored by the task's
``@vf.reward`` methods. The id is what ``eval <taskset-id>`` takes: a built-in
(``verifiers.v1.tasksets.<name>``) or a top-level module on ``sys.path``, typically an
environment's installed package (``owner/name[@version]`` or ``name``; verifiers imports
``name`` with dashes as underscores, so a dotted ``pkg.module`` is not an id).

Each trajectory is one verifiers *episode* run by verifiers itself: its env (the taskset's
own ``vf.Env``, else ``SingleAgentEnv``), its harness (the program the model runs in) in its
runtime, model calls through its interception server to the trajectory's endpoint, its
scoring. Only the policy and the endpoint are rollart's; every request of the episode
becomes a turn of the trajectory (:mod:`rollart.actors.env.agent_loop`).

The env's ``args`` are the agent's ``task``:

- ``env_args``: the taskset's config (``TasksetConfig`` fields: ``split``, ``num_tasks``,
  ``task: {...}``... whatever the taskset declares), ``{}`` by default;
- the row: task ``seed % len(tasks)`` of the taskset in ``load()`` order (the seed-th task
  of an infinite one), so a group's trajectories (one seed) play the same task; a taskset
  picks its train or eval split with its own config (``env_args: {split: test}``);
- ``harness``: the verifiers harness, an id (``null``, ``bash``...) or a config dict
  (``{id: bash, ...}``); default the taskset's bundled harness, else ``null`` (verifiers'
  tool-less chat loop; verifiers itself defaults to ``bash``, a shell on the runtime);
- ``runtime``: where the harness runs, a verifiers runtime config, default
  ``{type: subprocess}`` (a local process; ``docker`` to isolate it). verifiers prepares the
  harness program with ``uv`` (``uv sync --script`` per trajectory: PyPI the first time,
  uv's cache after; it runs ``pip install --user uv`` when ``uv`` is missing);
- ``max_tokens``: the cap on each reply (the env's ``sampling.max_new_tokens`` applies too);
  ``sampling``: other verifiers sampling values, sent on every request;
- ``threshold``: the reward at or above which the trajectory counts as a success (1.0).

The reward is the episode's trace reward (the weighted sum of the task's rewards); with
several trainable traces (a multi-agent env) their mean. An episode that fails (its trace
not ``ok``: the harness crashed, scoring raised...) fails the trajectory
(``agent_error:``); one failing on its runtime (``SandboxError``, ``TunnelError``) is
retried as transient.

The env, its taskset and the task list load once per process and env config, on this
module's own two threads (:data:`_threads`), never on asyncio's default executor: the first
trajectories of a run all wait for the one load (``_load_lock``), and waiting there they
would hold every thread the policy loader, payload hashing and reward scoring need (issue
43). The EnvManager's ``agent_threads`` are not reachable from here: an agent is called
with ``(base_url, task)`` only.

Roles of a multi-agent env that call the policy must take turns within one conversation
(the endpoint takes one conversation per trajectory); a role pinned to another ``model`` /
``client`` (a judge) calls that instead.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import threading
from pathlib import Path
from typing import Any

from rollart.agents.threads import AgentThreads

MODEL = "rollart-policy"
"""The model name verifiers sends (the endpoint serves the policy whatever the name)."""

API_KEY_VAR = "ROLLART_VERIFIERS_API_KEY"
"""The variable verifiers reads the endpoint's API key from: the endpoint needs none, so
it is normally unset (verifiers then sends ``EMPTY``)."""

DEFAULT_RUNTIME: dict[str, Any] = {"type": "subprocess"}
DEFAULT_HARNESS = "null"

_TRANSIENT = frozenset({"SandboxError", "TunnelError"})
"""Episode error types of the runtime (not the agent): the trajectory is retried."""


def module_name(env_id: str) -> str:
    """The module a taskset id names, as verifiers imports it: a hub id's
    ``owner/`` and ``@version`` dropped, dashes as underscores."""
    name = env_id.rsplit("/", 1)[-1].split("@", 1)[0]
    return name.replace("-", "_").lower()


def check_env_id(env_id: str) -> None:
    """ValueError unless verifiers (0.4's ``verifiers.v1``) is installed and ``env_id``
    names a built-in taskset or an importable module. Imports no verifiers code."""
    if not env_id:
        raise ValueError("use 'verifiers:<taskset-id>'")
    spec = importlib.util.find_spec("verifiers")
    if spec is None:
        raise ValueError("verifiers is not installed (pip install verifiers)")
    roots = [Path(p) for p in spec.submodule_search_locations or ()]
    if not any((r / "v1" / "__init__.py").exists() for r in roots):
        raise ValueError("needs verifiers>=0.4, its verifiers.v1 API (pip install -U verifiers)")
    mod = module_name(env_id)
    if not mod.isidentifier():
        raise ValueError(f"{env_id!r} is not a taskset id: verifiers imports a taskset as a "
                         f"top-level module (a package name, 'owner/name' or 'name@version')")
    builtin = any((r / "v1" / "tasksets" / mod).is_dir() for r in roots)
    if builtin:
        return
    try:
        found = importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"no verifiers taskset {env_id!r}: not a built-in "
                         f"(verifiers.v1.tasksets) and no module {mod!r} to import "
                         f"(install the environment's package)")


class _Loaded:
    """One env config's verifiers env and its tasks (bounded: all of them, in order)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        taskset = env.taskset
        self.tasks: list[Any] | None = list(taskset) if taskset.bounded else None
        if self.tasks == []:
            raise ValueError(f"verifiers taskset {env.config.taskset.id!r} has no tasks")
        self._lock = threading.Lock()

    def task(self, seed: int) -> Any:
        if self.tasks is not None:
            return self.tasks[seed % len(self.tasks)]
        with self._lock:  # an infinite taskset: its seed-th task
            return next(itertools.islice(iter(self.env.taskset), max(seed, 0), None))


_loaded: dict[str, _Loaded] = {}
_load_lock = threading.Lock()
_threads = AgentThreads(2, name="verifiers-load")
"""Where loads and an infinite taskset's task lookups run (daemon threads, started on first
use, never closed: idle ones cost nothing). Two: a lookup need not wait behind a load."""


def _roles(cfg_cls: Any) -> dict[str, Any]:
    """The env config's agent roles: field name -> declared default ``AgentConfig``."""
    from verifiers.v1 import AgentConfig

    return {n: f.default for n, f in cfg_cls.model_fields.items()
            if isinstance(f.default, AgentConfig)}


def env_config(env_id: str, task: dict) -> Any:
    """The verifiers ``EnvConfig`` for ``env_id`` and the env args in ``task``."""
    from verifiers.v1.utils.loaders import (
        default_harness_id,
        env_config_type,
        resolve_env_config,
    )

    env_args = dict(task.get("env_args") or {})
    runtime = dict(task.get("runtime") or DEFAULT_RUNTIME)
    harness = task.get("harness")
    if isinstance(harness, str):
        harness = {"id": harness}
    if harness is None and default_harness_id(env_id) == "bash":  # the taskset ships none
        harness = {"id": DEFAULT_HARNESS}
    roles: dict[str, Any] = {}
    for name, default in _roles(env_config_type(env_id)).items():
        role: dict[str, Any] = {"runtime": runtime}
        if harness is not None and default.harness is None:
            role["harness"] = harness
        roles[name] = role
    return resolve_env_config({"taskset": {**env_args, "id": env_id}, **roles})


def load(env_id: str, task: dict) -> _Loaded:
    """The cached env of ``env_id`` with ``task``'s env args (loaded on first use)."""
    key = json.dumps([env_id, task.get("env_args"), task.get("harness"), task.get("runtime")],
                     sort_keys=True, default=str)
    with _load_lock:
        got = _loaded.get(key)
        if got is None:
            from verifiers.v1.utils.loaders import load_environment

            got = _loaded[key] = _Loaded(load_environment(env_config(env_id, task)))
        return got


def episode_reward(episode: Any) -> float:
    """The reward of an episode: its trainable traces' (their mean when several)."""
    traces = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
    return sum(t.reward for t in traces) / len(traces)


def _failure(episode: Any) -> Exception | None:
    if episode.ok:  # every trace concluded and scored (errors of retried attempts stay listed)
        return None
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if not errors:
        return RuntimeError("verifiers episode failed (no error recorded)")
    e = errors[-1]
    what = f"verifiers episode failed: {e.type}: {e.message}"[:1000]
    return ConnectionError(what) if e.type in _TRANSIENT else RuntimeError(what)


async def run(base_url: str, task: dict, *, env_id: str) -> dict:
    """Play ``task["seed"]``'s task of the verifiers taskset ``env_id`` against
    ``base_url``: one verifiers episode; ``{"reward": r, "success": r >= threshold}``."""
    import verifiers.v1 as vf

    loaded = await _threads.run(load, env_id, task)
    seed = int(task.get("seed", 0))
    row = loaded.task(seed) if loaded.tasks is not None else await _threads.run(loaded.task, seed)
    sampling = dict(task.get("sampling") or {})
    if task.get("max_tokens") is not None:
        sampling["max_tokens"] = task["max_tokens"]
    ctx = vf.ModelContext(
        model=MODEL, client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
        sampling=vf.SamplingConfig(**sampling))
    # serving() keeps its interception server and tool servers on the env object: a
    # shallow copy per trajectory, so concurrent trajectories each hold their own
    env = copy.copy(loaded.env)
    async with env.serving():
        episode = await env.run_episode(row, ctx)
    failure = _failure(episode)
    if failure is not None:
        raise failure
    reward = episode_reward(episode)
    return {"reward": reward, "success": reward >= float(task.get("threshold", 1.0))}
