"""Env types that name a user's agent: ``agent:pkg.module:function``, or a verifiers
environment: ``verifiers:<taskset-id>`` (:mod:`rollart.agents.verifiers_agent`, the agent
that runs verifiers' own episode).

Such an env is not built and stepped: an EnvManager runs the agent function against an
OpenAI-compatible endpoint (:mod:`rollart.agents`). This module only resolves the name, for
the EnvManager and the config check.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable

AGENT_PREFIX = "agent:"
"""Env type prefix: ``agent:pkg.module:function``."""
VERIFIERS_PREFIX = "verifiers:"
"""Env type prefix: ``verifiers:<taskset-id>``, a verifiers environment."""

_agents: dict[str, Callable] = {}


def is_agent(env_type: str) -> bool:
    return env_type.startswith((AGENT_PREFIX, VERIFIERS_PREFIX))


def _verifiers_agent(env_type: str) -> Callable:
    """The verifiers agent bound to the taskset id of ``verifiers:<taskset-id>``: checked to
    be installed, not imported (verifiers loads it in the EnvManager). The adapter is an
    agent like a user's, so it is imported by name, as theirs are: the envs layer does
    not depend on rollart.agents."""
    verifiers_agent = importlib.import_module("rollart.agents.verifiers_agent")

    env_id = env_type[len(VERIFIERS_PREFIX):]
    try:
        verifiers_agent.check_env_id(env_id)
    except ValueError as e:
        raise ValueError(f"env type {env_type!r}: {e}") from None
    return functools.partial(verifiers_agent.run, env_id=env_id)


def resolve_agent(env_type: str) -> Callable:
    """The agent function an ``agent:pkg.module:function`` type names (for
    ``verifiers:<taskset-id>``, the verifiers agent bound to it); ValueError saying what is
    wrong otherwise."""
    fn = _agents.get(env_type)
    if fn is not None:
        return fn
    if env_type.startswith(VERIFIERS_PREFIX):
        fn = _agents[env_type] = _verifiers_agent(env_type)
        return fn
    path = env_type[len(AGENT_PREFIX):]
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"agent type {env_type!r}: use 'agent:pkg.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"agent type {env_type!r}: cannot import {mod_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"agent type {env_type!r}: module {mod_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"agent type {env_type!r}: {attr!r} is not a function")
    try:
        inspect.signature(fn).bind("http://x/v1", {})
    except TypeError as e:
        raise ValueError(f"agent type {env_type!r}: {attr} must take (base_url, task): {e}") from None
    except ValueError:
        pass  # no signature to check (a builtin)
    _agents[env_type] = fn
    return fn
