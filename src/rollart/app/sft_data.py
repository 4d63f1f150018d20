"""What ``rollart sft`` trains on: conversations read from a demos file (``rollart demos``)
and laid out in tokens as the RL trajectory of the same turns would be.

**Token layout.** A conversation is tokenized exactly as the EnvManager builds the trajectory
of the same turns (:func:`conversation_layout`): ``ChatFormat.first_prompt(system, user 1)``,
then per turn the assistant's tokens (``ChatFormat.encode``, what a policy generating that
text emits) and ``ChatFormat.next_prompt(those tokens, next user)``; the trajectory ends
after the last assistant turn. The loss (``response_mask`` 1) is on the assistant's tokens
only, and on the end-of-turn token where the RL policy generates it (``eot="auto"``): in a
free-text env the engine stops on it and keeps it in the response; under constrained decoding
(``constrained`` in the demo line) a turn ends with its choice and the end of turn is the next
prompt's first token, so it is not trained, as in RL. ``eot="always"`` trains it every turn
(same ids, one more trained token per turn, and one more token at the end).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollart.config import ConfigError

__all__ = ["conversation_layout", "read_conversations", "train_samples"]


def read_conversations(path: str | Path) -> list[dict]:
    """The JSON lines of ``path``, each with ``messages`` (a ConfigError names a bad line)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--data {p}: no such file (write one with `rollart demos`)")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{p}:{n}: not JSON: {e}") from None
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not all(isinstance(x, dict) and isinstance(x.get("content"), str)
                                                 and x.get("role") in ("system", "user", "assistant")
                                                 for x in msgs):
            raise ConfigError(f"{p}:{n}: needs \"messages\": a list of {{role: system|user|"
                              f"assistant, content: str}}")
        out.append(row)
    if not out:
        raise ConfigError(f"--data {p}: no conversations in it")
    return out


def _turns(messages: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """(system, [(user, assistant), ...]) of a conversation: an optional system message, then
    user and assistant alternating; a trailing user message (never answered) is dropped."""
    msgs = list(messages)
    system = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else ""
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    pairs = []
    for i in range(0, len(msgs), 2):
        u, a = msgs[i], msgs[i + 1] if i + 1 < len(msgs) else None
        if u["role"] != "user" or a is None or a["role"] != "assistant":
            raise ValueError("messages must be [system], user, assistant, user, assistant, ...")
        pairs.append((u["content"], a["content"]))
    if not pairs:
        raise ValueError("a conversation needs at least one user and one assistant message")
    return system, pairs


def conversation_layout(chat: Any, messages: list[dict], *, eot: bool) -> tuple[list[int], list[int]]:
    """``(token_ids, mask)`` of a conversation as an RL trajectory of the same turns holds
    them (see the module docstring); ``chat`` is a :class:`rollart.actors.env.chat.ChatFormat`.
    ``eot``: the end-of-turn token (the tokenizer's eos) closes each assistant turn and is
    trained, as when the policy generated it."""
    system, pairs = _turns(messages)
    eos = chat.tok.eos_token_id
    if eot and eos is None:
        raise ValueError("the tokenizer has no eos token to end a turn with")
    ids = chat.first_prompt(system, pairs[0][0])
    mask = [0] * len(ids)
    for k, (_, answer) in enumerate(pairs):
        resp = chat.encode(answer) + ([eos] if eot else [])
        ids += resp
        mask += [1] * len(resp)
        if k + 1 < len(pairs):
            nxt = chat.next_prompt(resp, pairs[k + 1][0])
            ids += nxt
            mask += [0] * len(nxt)
    return ids, mask


def train_samples(chat: Any, rows: list[dict], *, eot: str = "auto") -> list[Any]:
    """:class:`~rollart.engines.train_samples.TrainSample` per conversation (no advantage)."""
    from rollart.engines.train_samples import TrainSample

    out = []
    for row in rows:
        trained_eot = eot == "always" or (eot == "auto" and not row.get("constrained", False))
        ids, mask = conversation_layout(chat, row["messages"], eot=trained_eot)
        out.append(TrainSample(ids, mask, [0.0] * len(ids), 0.0))
    return out
