"""The field types of the wire contract: what a receiver accepts, stated in the type.

msgspec checks these constraints while it decodes (in C, for every element of a list), so a
payload that breaks one never becomes a message: the codec raises ``DecodeError`` naming the
field (``Expected `int` >= 0 - at `$.seed```) and the runtime dead-letters it as a
``malformed payload``. Constructing a message in Python does not check them; a sender's
mistake is caught by its receiver, as a peer's would be.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

PREFIX = "rollart"
"""First token of every subject."""
I64_MAX = (1 << 63) - 1
MAX_TOKENS = 1 << 22
"""Longest token list a message may carry (prompt, trajectory)."""
MAX_NEW_TOKENS = 1 << 20
"""Most tokens one generate request may ask for."""

Count = Annotated[int, Meta(ge=0, le=I64_MAX)]
"""Seeds, versions, indices, counts: a non-negative int64."""
Index = Annotated[int, Meta(ge=-1, le=I64_MAX)]
"""An index or version where ``-1`` means none or unknown."""
Attempt = Annotated[int, Meta(ge=1, le=I64_MAX)]

_ID_CHARS = r"[A-Za-z0-9_.:@+/-]"
Id = Annotated[str, Meta(pattern=rf"^{_ID_CHARS}{{1,200}}$")]
"""Trajectory, group, wave and request ids: 1-200 of letters, digits and ``_.:@+/-``."""
OptionalId = Annotated[str, Meta(pattern=rf"^{_ID_CHARS}{{0,200}}$")]
"""An :data:`Id` or empty (not given)."""

Text = Annotated[str, Meta(min_length=1, max_length=256)]
"""A name (env, scorer, replica, node): 1-256 characters, printable (:mod:`.checks`)."""
ShortText = Annotated[str, Meta(min_length=1, max_length=64)]
"""A role, pool or hardware key: 1-64 characters, printable (:mod:`.checks`)."""

TokenId = Annotated[int, Meta(ge=0, lt=1 << 31)]
Tokens = Annotated[list[TokenId], Meta(max_length=MAX_TOKENS)]
SomeTokens = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_TOKENS)]
"""A token list that must not be empty (a prompt, one allowed choice)."""
Bit = Annotated[int, Meta(ge=0, le=1)]

NonNegative = Annotated[float, Meta(ge=0.0)]
"""A duration, load, temperature or timestamp; also finite (:mod:`.checks`)."""
Probability = Annotated[float, Meta(gt=0.0, le=1.0)]
