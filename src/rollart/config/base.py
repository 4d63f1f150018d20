"""The base of every config Struct and the field checks their ``__post_init__`` share.

:mod:`rollart.config.doc` reads the ``in_range(...)`` and ``subject_token(...)`` calls of each
``__post_init__`` to state the allowed values, so a section states a range once, here.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rollart.messages import check_token


class Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Unknown keys are errors; a loaded config never changes."""


def in_range(struct: Any, prefix: str, names: str, *, ge: float | None = None,
             gt: float | None = None, le: float | None = None, lt: float | None = None) -> None:
    """Raise ``ValueError("<prefix><name> must be <range> (it is <value>)")`` unless every
    field in ``names`` (space-separated; ``None`` means unset and passes) is a finite number
    in the range. ``prefix`` is the section's key (``trainer.``), or empty in Structs that sit
    under a name chosen by the user (``envs.<name>``): the loader then puts the path in front."""
    lo = f">= {ge:g}" if ge is not None else f"> {gt:g}" if gt is not None else ""
    hi = f"<= {le:g}" if le is not None else f"< {lt:g}" if lt is not None else ""
    if lo and hi:
        allowed = f"in {'[' if ge is not None else '('}{ge if ge is not None else gt:g}, " \
                  f"{le if le is not None else lt:g}{']' if le is not None else ')'}"
    else:
        allowed = lo or hi or "a finite number"
    for name in names.split():
        v = getattr(struct, name)
        if v is None:
            continue
        if not (math.isfinite(v) and (ge is None or v >= ge) and (gt is None or v > gt)
                and (le is None or v <= le) and (lt is None or v < lt)):
            raise ValueError(f"{prefix}{name} must be {allowed} (it is {v!r})")


def subject_token(prefix: str, name: str, value: str | None) -> None:
    """A name that becomes a subject token (or consumer name): letters, digits, _ or -."""
    if value is not None:
        try:
            check_token(name, value)
        except ValueError as e:
            raise ValueError(f"{prefix}{name}: {e}") from None
