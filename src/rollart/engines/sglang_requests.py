"""How :class:`~rollart.engines.sglang_engine.SglangEngine` talks to its SGLang server.

:class:`SglangRequests` is the part of the engine that makes HTTP calls (a mixin of
:class:`~rollart.engines.sglang_engine.SglangEngine`, which owns the state it uses): JSON
posts with SGLang's error text (an answer is read up to
:data:`~rollart.engines.sglang_protocol.MAX_ANSWER_BYTES` and must be a JSON object, else a
:class:`~rollart.engines.sglang_protocol.SglangAnswerError`), the ``/generate`` call of one request that an abort can
interrupt (:meth:`SglangRequests._send`), and the calls that serve one row, free
(:meth:`SglangRequests._generate_free`) or constrained
(:meth:`SglangRequests._generate_choice`). The bodies and the parsing of the answers are
:mod:`rollart.engines.sglang_protocol`'s.

``POST /abort_request {"rid": ...}`` aborts one request; the server ignores a rid it has
not registered yet, so :meth:`~rollart.engines.sglang_engine.SglangEngine.abort` repeats
it until the request returns.

Constrained turns (``choices``)
-------------------------------
One token per request: each step sends the prompt plus the prefix chosen so far with
``max_new_tokens: 1``, a logit bias over the tokens that continue some still-possible
choice (:func:`~rollart.engines.sglang_protocol.allowed_bias`: the others become
negligible), and ``token_ids_logprob`` = those tokens. The reported log-prob is renormalised
over them from ``output_token_ids_logprobs`` (``logprob[t] - logsumexp(logprob[allowed])``:
exact for the T = 1 distribution whether or not the bias reached the log-probs). A step with
a single allowed token sends nothing (log-prob 0). Per-step requests keep the constraint a
function of the request alone. The radix cache makes each step's prefill a cache hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import Any

from .base import (
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineAborted,
    GenInput,
    GenOutput,
)
from .server_http import read_bounded
from .sglang_protocol import (
    MAX_ANSWER_BYTES,
    SglangAnswerError,
    allowed_next,
    choice_step_payload,
    error_text,
    generate_payload,
    is_complete_choice,
    parse_choice_step,
    parse_generate_response,
)

__all__ = ["ReqState", "SglangRequests"]

ABORT_RETRY_S = 0.05
ABORT_GIVE_UP_S = 10.0


@dataclasses.dataclass(eq=False)
class ReqState:
    """One engine request in flight (it may make several ``/generate`` calls)."""

    request_id: str
    server_rid: str | None = None
    aborted: bool = False
    active: bool = False
    posting: bool = False
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set when the current ``/generate`` call returns (a new one per call)."""
    woken: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set by an abort (wakes a request waiting at the pause gate)."""


async def _read_bounded(r: Any, path: str) -> bytes:
    """The body of the answer ``r``, no further than
    :data:`~rollart.engines.sglang_protocol.MAX_ANSWER_BYTES`."""
    return await read_bounded(r, f"sglang {path}", MAX_ANSWER_BYTES, SglangAnswerError)


def _json_object(data: bytes, path: str) -> dict:
    """``data`` as a JSON object; :class:`SglangAnswerError` when it is not one (not JSON,
    nested deeper than the parser's stack, an integer of thousands of digits, a list...)."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SglangAnswerError(f"sglang {path} answer: not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise SglangAnswerError(f"sglang {path} answer: not an object (a {type(obj).__name__})")
    return obj


class SglangRequests:
    """HTTP calls of :class:`~rollart.engines.sglang_engine.SglangEngine`, which provides
    ``base_url``, ``eos_token_ids`` and the attributes annotated here."""

    _session: Any
    """The ``aiohttp.ClientSession`` (None: not started, or closed)."""
    _aiohttp: Any
    _tasks: set[asyncio.Task]
    """Background abort calls (cancelled on close)."""

    async def _post(self, path: str, body: dict, *, timeout: float | None = None
                    ) -> tuple[int, bytes]:
        if self._session is None:
            raise RuntimeError("the sglang engine is not started (or closed)")
        kw = {"timeout": self._aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        async with self._session.post(self.base_url + path, json=body, **kw) as r:
            return r.status, await _read_bounded(r, path)

    async def _post_json(self, path: str, body: dict, *, timeout: float | None = None) -> dict:
        status, data = await self._post(path, body, timeout=timeout)
        if status == 200:
            return _json_object(data, path) if data.strip() else {}
        msg = error_text(data)
        if path == "/generate" and 400 <= status < 500:
            raise ValueError(f"sglang refused the request (HTTP {status}): {msg}")
        raise RuntimeError(f"sglang {path} answered HTTP {status}: {msg}")

    async def _get_json(self, path: str, *, timeout: float | None = None) -> dict:
        kw = {"timeout": self._aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        async with self._session.get(self.base_url + path, **kw) as r:
            data = await _read_bounded(r, path)
            if r.status != 200:
                raise RuntimeError(f"sglang {path} answered HTTP {r.status}: {error_text(data)}")
            return _json_object(data, path)

    async def _send(self, st: ReqState, body: dict) -> dict:
        """One ``/generate`` for request ``st``; an abort that arrived meanwhile is sent
        (again) until the answer comes; cancelling the caller aborts the server request."""
        st.server_rid = body["rid"]
        st.posting = True
        try:
            if st.aborted:
                self._spawn(self._abort_until_done(st, body["rid"]))
            return await self._post_json("/generate", body)
        except asyncio.CancelledError:
            self._spawn(self._post_quietly("/abort_request", {"rid": body["rid"]}))
            raise
        finally:
            st.posting = False
            st.done.set()
            st.done = asyncio.Event()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post_quietly(self, path: str, body: dict) -> None:
        with contextlib.suppress(Exception):
            await self._post(path, body, timeout=10)

    async def _abort_until_done(self, st: ReqState, rid: str) -> None:
        done = st.done
        give_up = time.monotonic() + ABORT_GIVE_UP_S
        while not done.is_set() and time.monotonic() < give_up and self._session is not None:
            await self._post_quietly("/abort_request", {"rid": rid})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), ABORT_RETRY_S)

    # ---------------------------------------------------------------- one row
    def _new_rid(self, st: ReqState) -> str:
        return f"{st.request_id}.{uuid.uuid4().hex[:10]}"

    async def _generate_free(self, inp: GenInput, st: ReqState, version: int) -> GenOutput:
        body = generate_payload(inp, self._new_rid(st), eos_token_ids=self.eos_token_ids)
        resp = await self._send(st, body)
        ids, lps, finish = parse_generate_response(resp, max_tokens=int(inp.max_new_tokens))
        if finish == "abort":
            raise EngineAborted(st.request_id, GenOutput(ids, lps, FINISH_INTERRUPTED, version),
                                version)
        return GenOutput(ids, lps, FINISH_STOP if finish == "stop" else FINISH_LENGTH, version)

    async def _generate_choice(self, inp: GenInput, st: ReqState, version: int) -> GenOutput:
        choices = [[int(t) for t in c] for c in inp.choices or ()]
        prefix: list[int] = []
        lps: list[float] = []
        while not is_complete_choice(choices, prefix):
            allowed = allowed_next(choices, prefix)
            if st.aborted:
                raise EngineAborted(st.request_id, GenOutput(list(prefix), list(lps),
                                                             FINISH_INTERRUPTED, version), version)
            if len(allowed) == 1:  # forced: log-prob 0 under the renormalised distribution
                prefix.append(allowed[0])
                lps.append(0.0)
                continue
            resp = await self._send(st, choice_step_payload(inp, self._new_rid(st), prefix,
                                                            allowed))
            tok, lp, finish = parse_choice_step(resp, allowed)
            if tok is not None:
                prefix.append(tok)
                lps.append(float(lp))
            if finish == "abort" and not is_complete_choice(choices, prefix):
                raise EngineAborted(st.request_id, GenOutput(list(prefix), list(lps),
                                                             FINISH_INTERRUPTED, version), version)
        return GenOutput(prefix, lps, FINISH_CHOICE, version)
