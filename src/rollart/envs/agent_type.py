"""Env types that name a user's agent: ``agent:pkg.module:function``.

Such an env is not built and stepped: an EnvManager runs the agent function against an
OpenAI-compatible endpoint (:mod:`rollart.agents`). This module only resolves the name, for
the EnvManager and the config check.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

AGENT_PREFIX = "agent:"
"""Env type prefix: ``agent:pkg.module:function``."""

_agents: dict[str, Callable] = {}


def is_agent(env_type: str) -> bool:
    return env_type.startswith(AGENT_PREFIX)


def resolve_agent(env_type: str) -> Callable:
    """The agent function an ``agent:pkg.module:function`` type names; ValueError saying
    what is wrong otherwise."""
    fn = _agents.get(env_type)
    if fn is not None:
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
