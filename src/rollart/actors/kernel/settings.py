"""One merge of a role's settings: what the role reads of its config, then what the user sets.

Every role builds its actor from defaults it reads of the run's config (a section such as
``rollout`` or ``proxy``, and settings of its own handlers) with ``actors.<role>.args`` and
``actors.<role>.handlers`` on top. There is one meaning for every role: the user's values
replace the defaults *key by key*, so a user who sets one key keeps every other default,
and a key that is no constructor argument (or no handler setting) is an error that names it.
:meth:`rollart.actors.kernel.base.Actor.configured` applies it.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["constructor_args", "merged", "merged_handlers"]


def merged(defaults: Mapping[str, Any], overrides: Mapping[str, Any], *,
           allowed: Collection[str] | None = None, what: str = "setting") -> dict[str, Any]:
    """``defaults`` with ``overrides`` on top, key by key (a key not overridden keeps its
    default). ``allowed``: the keys ``overrides`` may hold (None: any); another one raises a
    ValueError that names it, as an unknown ``what``."""
    if allowed is not None:
        unknown = sorted(set(overrides) - set(allowed))
        if unknown:
            raise ValueError(f"unknown {what} {', '.join(map(repr, unknown))}; "
                             f"allowed: {', '.join(sorted(allowed))}")
    return {**defaults, **overrides}


def merged_handlers(*layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Settings per handler (handler name -> its settings), each layer merged over the ones
    before it handler by handler and key by key (:func:`merged`)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for handler, values in layer.items():
            out[handler] = merged(out.get(handler, {}), values)
    return out


def constructor_args(cls: type) -> frozenset[str] | None:
    """The keyword arguments ``cls(...)`` takes; None when it takes any (``**kwargs``)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
