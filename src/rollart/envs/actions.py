"""Parse an action out of a model's text.

The format penalty for unparsable text is the EnvManager's business (configured there);
this module only says whether and what could be parsed.
"""

from __future__ import annotations

import functools
import re

ANSWER_PATTERN = r"<answer>(.*?)</answer>"
"""The default answer format that built-in env instructions ask for."""


@functools.lru_cache(maxsize=64)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile ``pattern`` with ``re.DOTALL`` (answers may span lines).

    Raises ``ValueError`` naming the pattern when it is not a valid regex or has more than
    one capturing group.
    """
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"action pattern {pattern!r} is not a valid regex: {e}") from e
    if rx.groups > 1:
        raise ValueError(f"action pattern {pattern!r} must have at most one capturing group, has {rx.groups}")
    return rx


def parse_action(text: str, pattern: str | None) -> str | None:
    """Return the action in ``text``, or None when it cannot be parsed.

    Args:
        text: the model's generated text for this turn.
        pattern: a regex with one capturing group, e.g. ``<answer>(.*?)</answer>``; the
            stripped group of the *last* match is the action (with no group, the whole
            match). None: the whole stripped text is the action.

    An empty result (e.g. ``<answer> </answer>`` or blank text) counts as unparsable.
    """
    if pattern is None:
        out = text.strip()
        return out or None
    rx = compile_pattern(pattern)
    last = None
    for last in rx.finditer(text):
        pass
    if last is None:
        return None
    out = (last.group(1) if rx.groups else last.group(0)) or ""
    out = out.strip()
    return out or None
