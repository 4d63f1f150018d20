"""One trajectory's conversation as the agent's endpoint sees it, kept at token level.

An agent sends the whole conversation with every request (the chat-completions API is
stateless). Tokenising it again each turn would train on tokens the model never produced
(a decode/encode round trip is not the identity, and a template may render an earlier
assistant turn differently). :class:`Conversation` instead keeps the ids of everything so
far, exactly as prompted and generated, and tokenises only what a request adds:

- the first request: its messages rendered with the model's chat template (and its
  ``tools``) and the generation prompt;
- each later request must repeat the conversation so far (the previous request's messages,
  then the assistant reply it got, content and tool calls) and add messages after it
  (user, tool, system). What is added is rendered as the template would render it after an
  assistant turn (the ``ChatFormat.next_prompt`` rule generalised to any messages); the
  reply's own tokens are the generated ones.

A request that does not extend the conversation, or is malformed, raises
:class:`ContractError` (HTTP 400 to the agent; the trajectory is dead-lettered as
``agent_contract:``).

Tool calls: with ``tools`` in the request, ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` blocks in the generated text (the format the chat template renders calls in,
as Qwen's does) become the reply's ``tool_calls``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_MARK = "\x00REPLY\x00"
ROLES = ("system", "user", "assistant", "tool")
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


CHARS_PER_TOKEN = 16
"""A request's text may have at most this many characters per token of the env's
``max_context_tokens`` (real text averages 2-6): a longer one cannot fit, and is refused
by its size before it is tokenised (10 MB once took 10 s on the EnvManager's loop)."""


class ContractError(ValueError):
    """The request breaks the endpoint's contract; its message says how."""


def text_size(*parts: Any) -> int:
    """Characters in every string (keys too) of ``parts``: what a request gives the chat
    template to render, counted without rendering or tokenising it."""
    n, stack = 0, list(parts)
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            n += len(o)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return n


def content_text(msg: dict, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or None (empty)."""
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for i, p in enumerate(c):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise ContractError(f"{where}.content[{i}]: only text parts are supported, got "
                                    f"{p!r:.120}")
            parts.append(p["text"])
        return "".join(parts)
    raise ContractError(f"{where}.content must be a string or a list of text parts, got "
                        f"{type(c).__name__}")


def _arguments(raw: Any, where: str) -> str:
    """Tool-call arguments in one canonical JSON text (sorted keys), whatever spacing the
    agent sent them in."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw  # compared as sent
    return json.dumps(raw, sort_keys=True)


def canonical(msg: Any, where: str) -> tuple:
    """What of a message must repeat exactly in a later request: role, text, tool calls
    (name and arguments), and for a tool result the call it answers. An assistant's text is
    compared stripped (its tokens are the generated ones whatever the agent echoes)."""
    if not isinstance(msg, dict):
        raise ContractError(f"{where} must be an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise ContractError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    text = content_text(msg, where)
    calls: tuple = ()
    if role == "assistant":
        text = text.strip()
        raw = msg.get("tool_calls") or []
        if not isinstance(raw, list):
            raise ContractError(f"{where}.tool_calls must be a list")
        out = []
        for i, c in enumerate(raw):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ContractError(f"{where}.tool_calls[{i}] needs function.name")
            out.append((f["name"], _arguments(f.get("arguments", {}), where)))
        calls = tuple(out)
    return (role, text, calls)


def parse_tool_calls(text: str, turn: int) -> tuple[str, list[dict]]:
    """``(content, tool_calls)`` of a generated text: each well-formed ``<tool_call>`` block
    with a ``name`` becomes a call, the rest of the text is the content."""
    calls = []
    for k, mt in enumerate(_CALL.finditer(text)):
        try:
            obj = json.loads(mt.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        calls.append({"id": f"call_{turn}_{k}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": json.dumps(obj.get("arguments", {}))}})
    if not calls:
        return text, []
    return _CALL.sub("", text).strip(), calls


@dataclass
class Conversation:
    """The token-level record of one agent's conversation (see the module doc).

    ``chat`` is the EnvManager's :class:`~rollart.actors.env.chat.ChatFormat`."""

    chat: Any
    _seen: list[tuple] = field(default_factory=list)
    """Canonical messages so far, the last one the previous reply."""
    _sent: list[dict] = field(default_factory=list)
    """The previous request's messages, as sent."""
    _tools: Any = None
    _last_ids: list[int] = field(default_factory=list)
    """The previous reply's generated ids."""

    @property
    def turns(self) -> int:
        return sum(1 for m in self._seen if m[0] == "assistant")

    def _render(self, messages: list[dict], tools: Any) -> str:
        try:
            return self.chat.tok.apply_chat_template(messages, tools=tools or None,
                                                     tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the model's template refuses them (its raise_exception)
            raise ContractError(f"the model's chat template cannot render these messages: "
                                f"{type(e).__name__}: {e}"[:500]) from None

    def prompt(self, messages: Any, tools: Any = None) -> list[int]:
        """The ids to append before generating for ``messages`` (a whole request's)."""
        if not isinstance(messages, list) or not messages:
            raise ContractError("messages must be a non-empty list")
        canon = [canonical(msg, f"messages[{i}]") for i, msg in enumerate(messages)]
        if canon[-1][0] == "assistant":
            raise ContractError("the last message is the assistant's: nothing to reply to "
                                "(continuing an assistant message is not supported)")
        if tools is not None and not isinstance(tools, list):
            raise ContractError("tools must be a list")
        if not self._seen:
            self._tools = tools
            return self.chat.encode(self._render([self._plain(m) for m in messages], tools))
        if tools != self._tools:
            raise ContractError("tools differ from the conversation's first request (a "
                                "trajectory keeps its tools)")
        k = len(self._seen)
        for i in range(min(k, len(canon))):
            if canon[i] != self._seen[i]:
                what = "the assistant reply it got" if i == k - 1 else "the previous request"
                raise ContractError(
                    f"messages[{i}] differs from {what} ({self._seen[i][0]}: "
                    f"{self._seen[i][1][:60]!r}; got {canon[i][0]}: {canon[i][1][:60]!r}): each "
                    f"request of a trajectory must repeat the conversation so far and add to it")
        if len(canon) <= k:
            raise ContractError(f"the request repeats the conversation ({k} messages) but adds "
                                f"no message after the assistant's reply")
        head = [self._plain(m) for m in self._sent] + [{"role": "assistant", "content": _MARK}]
        text = self._render(head + [self._plain(m) for m in messages[k:]], tools)
        tail = self.chat.after_reply(self._last_ids, text[text.index(_MARK) + len(_MARK):])
        return self.chat.encode(tail)

    @staticmethod
    def _plain(msg: dict) -> dict:
        """A message as the chat template takes it (text content)."""
        out = {k: v for k, v in msg.items() if k in ("role", "name", "tool_calls", "tool_call_id")}
        out["content"] = content_text(msg, "message")
        return out

    def replied(self, messages: list[dict], ids: list[int], text: str, *,
                tools: bool) -> dict:
        """Record the reply generated for ``messages``: returns its OpenAI message."""
        content, calls = parse_tool_calls(text, self.turns + 1) if tools else (text, [])
        reply: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            reply["tool_calls"] = calls
        self._sent = list(messages)
        self._seen = [canonical(m, f"messages[{i}]") for i, m in enumerate(messages)]
        self._seen.append(canonical(reply, "reply"))
        self._last_ids = list(ids)
        return reply
