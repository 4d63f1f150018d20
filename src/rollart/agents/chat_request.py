"""The chat-completions request an agent sends to :mod:`rollart.agents.endpoint`, as types,
and the one decoder that reads it: a field the endpoint does not read is ignored, a field of
the wrong type, bad JSON or nesting deeper than :data:`MAX_DEPTH` is an :class:`EndpointError`
(400) that names it. Nothing is ever unpickled or evaluated."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["MAX_DEPTH", "ChatRequest", "EndpointError", "Message", "Tool", "decode_request",
           "nesting_depth"]


MAX_DEPTH = 32
"""Deepest nesting of lists and objects a request may have (a tool's JSON schema is the
deepest part of a real one): deeper input is refused before the chat template renders it."""


UNSET: Any = msgspec.UNSET


class EndpointError(Exception):
    """An error answered to the agent: HTTP ``status`` with an OpenAI-style body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any] = UNSET


class ToolCall(msgspec.Struct, kw_only=True):  # kw_only: fields in OpenAI's order
    id: str = UNSET
    type: str = UNSET
    function: FunctionCall


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = UNSET
    name: str = UNSET
    tool_calls: list[ToolCall] | None = UNSET
    tool_call_id: str = UNSET


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = UNSET
    parameters: dict[str, Any] = UNSET
    strict: bool | None = UNSET


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = UNSET
    function: FunctionDef


class StructuredOutputs(msgspec.Struct):
    choice: list[str] | None = UNSET


class ChatRequest(msgspec.Struct):
    """The part of an OpenAI chat-completions request the endpoint reads, as types: a
    field that is not one of these is ignored, a field of the wrong type refuses the
    request. Optional fields stay absent when absent (``UNSET``), so what the chat template
    renders is what the agent sent."""

    messages: list[Message]
    model: str = UNSET
    tools: list[Tool] | None = UNSET
    max_tokens: int | None = UNSET
    max_completion_tokens: int | None = UNSET
    n: int | None = UNSET
    logprobs: bool | None = UNSET
    stream: bool | None = UNSET
    return_token_ids: bool | None = UNSET
    guided_choice: list[str] | None = UNSET
    structured_outputs: StructuredOutputs | None = UNSET


_DECODER = msgspec.json.Decoder(ChatRequest)


def decode_request(data: bytes) -> dict:
    """The request ``data`` as plain Python objects, or :class:`EndpointError` (400) naming
    what is wrong with it: not JSON, the wrong shape (with msgspec's path to the field),
    numbers out of range, nesting deeper than :data:`MAX_DEPTH`."""
    try:
        req = _DECODER.decode(data)
    except msgspec.ValidationError as e:
        raise EndpointError(400, f"the request does not match the chat-completions "
                                 f"contract: {e}") from None
    except msgspec.DecodeError as e:
        raise EndpointError(400, f"the body is not JSON: {e}") from None
    except RecursionError:
        raise EndpointError(400, f"the body is nested too deeply (at most {MAX_DEPTH} "
                                 f"levels)") from None
    body = msgspec.to_builtins(req)
    if nesting_depth(body) > MAX_DEPTH:
        raise EndpointError(400, f"the body is nested too deeply (at most {MAX_DEPTH} levels)")
    return body


def nesting_depth(obj: Any) -> int:
    """How deep lists and dicts nest in ``obj`` (iteratively: no recursion limit to hit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = o.values()
        elif not isinstance(o, list):
            continue
        deepest = max(deepest, d)
        if d <= MAX_DEPTH:  # past it the answer is known: do not walk further down
            stack.extend((x, d + 1) for x in o)
    return deepest
