"""NATS subject grammar: validity checks and wildcard matching, for the in-memory bus.

nats-server enforces these rules itself; :class:`rollart.bus.memory.MemoryBus` checks them
here so a subject that a real server would refuse is refused in one process too.
"""

from __future__ import annotations

from collections.abc import Callable

from rollart.bus.base import BusError


def _tokens_ok(subject: str, wildcards: bool) -> bool:
    if not subject or any(c.isspace() for c in subject):
        return False
    toks = subject.split(".")
    for i, t in enumerate(toks):
        if not t:
            return False
        if t in ("*", ">"):
            if not wildcards or (t == ">" and i != len(toks) - 1):
                return False
    return True


def check_subject(subject: str, *, wildcards: bool = False) -> None:
    """Raise :class:`BusError` unless ``subject`` is a valid NATS subject (or pattern)."""
    if not isinstance(subject, str) or not _tokens_ok(subject, wildcards):
        kind = "subject pattern" if wildcards else "subject"
        raise BusError(f"invalid {kind} {subject!r}")


def check_name(name: str, what: str) -> None:
    """Stream and durable names: no dots, wildcards, separators or whitespace."""
    if (
        not isinstance(name, str)
        or not name
        or any(c in ".*>/\\" or c.isspace() for c in name)
    ):
        raise BusError(f"invalid {what} name {name!r}")


def compile_matcher(pattern: str) -> Callable[[str], bool]:
    """A predicate for NATS matching: ``*`` is one token, ``>`` one or more trailing ones.

    The empty pattern matches everything (an unfiltered consumer).
    """
    if pattern in ("", ">"):
        return bool
    toks = pattern.split(".")
    if "*" not in toks and ">" not in toks:
        return pattern.__eq__
    if toks[-1] == ">" and "*" not in toks:
        prefix = pattern[:-1]  # keeps the trailing dot
        n = len(prefix)
        return lambda s: len(s) > n and s.startswith(prefix)
    last = len(toks) - 1

    def match(subject: str) -> bool:
        st = subject.split(".")
        for i, t in enumerate(toks):
            if t == ">":
                return len(st) > i
            if i >= len(st) or (t != "*" and t != st[i]):
                return False
        return len(st) == last + 1

    return match


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both patterns (``""`` stands for everything)."""
    ta, tb = (a or ">").split("."), (b or ">").split(".")
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x is None or y is None:
            return False
        if x == ">" or y == ">":
            return True
        if x != "*" and y != "*" and x != y:
            return False
    return True
