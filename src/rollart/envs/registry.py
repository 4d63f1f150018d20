"""Build environments by name: a built-in short name, ``"gym:<id>"``, ``"openenv:<url>"`` or a
``"pkg.module:ClassName"`` path."""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable

from rollart.envs.agent_type import is_agent
from rollart.envs.base import Env
from rollart.envs.gym import factory

BUILTIN_ENVS: dict[str, str] = {
    "frozenlake": "rollart.envs.frozenlake:FrozenLakeEnv",
    "sokoban": "rollart.envs.sokoban:SokobanEnv",
    "reasoning_gym": "rollart.envs.reasoning:ReasoningGymEnv",
    "humaneval": "rollart.code.humaneval:HumanEvalEnv",
    "pyexpr": "rollart.code.pyexpr:PyExprEnv",
}
"""Short name -> import path. Modules are imported only when their env is made."""

GYM_PREFIX = "gym:"
"""``"gym:<id>"``: any registered gymnasium environment, through :mod:`rollart.envs.gym`."""

OPENENV_PREFIX = "openenv:"
"""``"openenv:<url>"``: a running OpenEnv server, through :mod:`rollart.envs.openenv`."""


def resolve_env_class(type: str) -> Callable[..., Env]:
    """The class behind a built-in name or a ``"pkg.module:ClassName"`` import path.

    Raises ``ValueError`` naming ``type`` (and listing the built-ins) when it is neither.
    ``ImportError`` from the module itself (e.g. a missing optional dependency) propagates.
    ``"gym:<id>"`` is the gymnasium adapter bound to that id (``ValueError`` for an id that
    gymnasium does not know). ``"openenv:<url>"`` is the OpenEnv adapter bound to that server
    (``ValueError`` for a malformed URL; nothing is contacted here).
    """
    if type.startswith(GYM_PREFIX):
        return factory(type[len(GYM_PREFIX):])
    if type.startswith(OPENENV_PREFIX):
        from rollart.envs.openenv import factory as openenv_factory  # httpx only when used

        return openenv_factory(type[len(OPENENV_PREFIX):])
    if is_agent(type):
        raise ValueError(f"{type!r} is an agent (rollart.agents), not an env class: an "
                         f"EnvManager runs it through its endpoint")
    path = BUILTIN_ENVS.get(type, type)
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"unknown env type {type!r}: use a built-in ({', '.join(sorted(BUILTIN_ENVS))}), "
                         f"a gymnasium id 'gym:<id>', an OpenEnv server 'openenv:<url>' or an "
                         f"import path 'pkg.module:ClassName'")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):  # the named module itself is missing
            raise ValueError(f"cannot import {path!r}: {e} (not found; built-ins are "
                             f"{', '.join(sorted(BUILTIN_ENVS))})") from e
        raise
    cls = getattr(module, attr, None)
    if cls is None:
        near = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], 1)
        raise ValueError(f"cannot import {path!r}: module {mod_name!r} has no attribute {attr!r}"
                         + (f"; did you mean {near[0]!r}?" if near else ""))
    if not callable(cls):
        raise ValueError(f"{path!r} is not a class (not callable)")
    return cls


def make_env(type: str, args: dict[str, Any] | None = None) -> Env:
    """Construct an environment.

    Args:
        type: ``"frozenlake"``, ``"sokoban"``, ``"reasoning_gym"``, ``"humaneval"``,
            ``"pyexpr"``, ``"gym:<gymnasium id>"``,
            ``"openenv:<server url>"`` or ``"pkg.module:ClassName"``.
        args: keyword arguments for the env class (from config).

    Raises ``ValueError`` naming the type when it is unknown, and naming the argument when
    an argument is unknown, missing or invalid.
    """
    args = dict(args or {})
    cls = resolve_env_class(type)
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = sig.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = {n: p for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not takes_any:
            for key in args:
                if key not in named:
                    raise ValueError(f"env {type!r}: unknown arg {key!r}; allowed: {', '.join(named) or '(none)'}")
        for n, p in named.items():
            if p.default is p.empty and n not in args:
                raise ValueError(f"env {type!r}: missing required arg {n!r}")
    try:
        env = cls(**args)
    except TypeError as e:
        raise ValueError(f"env {type!r}: bad args: {e}") from e
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise ValueError(f"env type {type!r}: {cls!r} does not have reset() and step()")
    instruction = getattr(env, "instruction", None)  # optional: config, then env, then ""
    if instruction is not None and not isinstance(instruction, str):
        raise ValueError(f"env type {type!r}: {cls!r} has an 'instruction' that is not a string "
                         f"({instruction!r:.80})")
    return env
