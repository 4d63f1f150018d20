"""What ``proxy.engine: sglang`` sends to SGLang and how it reads the answers.

Pure translation, standard library and msgspec only (no I/O, no torch, no aiohttp): the
``/generate`` bodies of free rows and of constrained steps (:func:`generate_payload`,
:func:`choice_step_payload`), the parsing of the answers (:func:`parse_generate_response`,
:func:`parse_choice_step`), the renormalisation of a constrained step's log-prob over the
allowed tokens (:func:`renormalized_logprob`), the logit bias that keeps a constrained step
to its allowed tokens (:func:`allowed_bias`), the checks of an input
before it is sent (:func:`check_input`), the log-prob semantics probe's requests
(:func:`probe_payload`, :func:`probe_spread`) and the text of SGLang's error bodies
(:func:`error_text`). :class:`~rollart.engines.sglang_engine.SglangEngine` does the I/O.

An answer is another process's data: it is decoded into typed structs (:class:`_Answer`,
the fields used, each list bounded by :data:`MAX_ANSWER_TOKENS`) before any field is read,
and whatever is not SGLang's shape, or contradicts itself, is a :class:`SglangAnswerError`
(a ``ValueError``) that names the field, never a ``TypeError`` from deep in the parsing.

SGLang API facts this relies on (``python/sglang/srt``, SGLang 0.4.x-0.5.x)
-----------------------------------------------------------------------
- ``POST /generate`` (``entrypoints/http_server.py``) with a ``GenerateReqInput``
  (``managers/io_struct.py``): ``input_ids``, ``rid``, ``sampling_params`` (``temperature``
  (0 = greedy), ``top_p``, ``max_new_tokens``, ``stop_token_ids``, ``logit_bias``),
  ``return_logprob``, ``token_ids_logprob``. With
  ``--skip-tokenizer-init`` the answer is ``{"output_ids": [...], "meta_info": {...}}``;
  ``meta_info.output_token_logprobs`` is one ``[logprob, token_id, text|null]`` per output
  token, ``meta_info.output_token_ids_logprobs`` one list of such triples (the requested
  ids) per output token, ``meta_info.finish_reason`` ``{"type": "stop", "matched": id}``,
  ``{"type": "length", "length": n}`` or ``{"type": "abort", "message": ...}``. A request
  aborted before prefill answers with no ``output_ids``; one aborted while running answers
  with the tokens it has. A stop or eos token is in ``output_ids``. Invalid requests answer
  HTTP 400 with ``{"message": ...}`` or ``{"error": {"message": ...}}``.
- Log-probs (``layers/sampler.py``): the logit bias is added first (float32 logits), then
  the returned log-probs are ``log_softmax(logits / T)`` (the temperature-scaled, processed
  distribution) unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``
  (``RETURN_ORIGINAL_LOGPROB`` in older versions), which returns ``log_softmax(logits)``
  of the processed logits before the temperature; greedy rows always get the latter; top-p
  never changes them. The engine sets both variables on the server it launches and
  :meth:`~rollart.engines.sglang_engine.SglangEngine.start` probes the semantics (greedy
  vs T = 0.25 on one prompt): where the server returns scaled log-probs (an attached
  server started without the variable) only T = 1 and greedy rows are served, others are
  refused (``ValueError``).
- ``sampling_params.logit_bias`` (``{"<token id>": bias}``, SGLang >= 0.4.7; older servers
  ignore it) is added to the row's float32 logits before sampling and log-probs
  (``sampling/sampling_batch_info.py``, ``apply_logits_bias``). A constrained step biases
  its allowed tokens by :data:`ALLOWED_BIAS`: every other token becomes ``exp(-1000)``
  times as likely as it was, nothing in practice, and a constant added to all allowed
  tokens changes neither their sampling distribution nor their renormalised log-probs (up
  to the float32 rounding of ``logit + 1000``, ~3e-5). A step that still picks another
  token is refused (:func:`parse_choice_step`).
- Not used: custom logit processors (``--enable-custom-logit-processor``): the server
  unpickles (``dill.loads``) a class from any request's ``custom_logit_processor`` field,
  so that flag lets every client that reaches the port run code on the GPU host. rollart
  never passes it and refuses it in ``proxy.engine_args``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any

import msgspec

from .base import GenInput, validate_choices

__all__ = [
    "ALLOWED_BIAS",
    "MAX_ANSWER_BYTES",
    "MAX_ANSWER_TOKENS",
    "SglangAnswerError",
    "allowed_bias",
    "allowed_next",
    "is_complete_choice",
    "check_input",
    "generate_payload",
    "choice_step_payload",
    "probe_payload",
    "probe_spread",
    "parse_generate_response",
    "parse_choice_step",
    "renormalized_logprob",
    "finish_kind",
    "error_text",
]


# ======================================================================================
# Constrained turns: a logit bias over the allowed tokens
# ======================================================================================
ALLOWED_BIAS = 1000.0
"""Added to each allowed token's logit (see the module docstring)."""


def allowed_bias(allowed: Iterable[int]) -> dict[str, float]:
    """``sampling_params.logit_bias`` of a constrained step: each allowed token id (a string
    key, as SGLang takes it) with :data:`ALLOWED_BIAS`."""
    return {str(int(t)): ALLOWED_BIAS for t in allowed}


def allowed_next(choices: Iterable[Sequence[int]], prefix: Sequence[int]) -> list[int]:
    """Sorted tokens that continue ``prefix`` towards some choice."""
    n, pre = len(prefix), list(prefix)
    return sorted({int(c[n]) for c in choices if len(c) > n and list(c[:n]) == pre})


def is_complete_choice(choices: Iterable[Sequence[int]], prefix: Sequence[int]) -> bool:
    pre = list(prefix)
    return any(list(c) == pre for c in choices)


# ======================================================================================
# Requests and responses
# ======================================================================================
def _temperature(inp: GenInput) -> float:
    return 0.0 if (inp.greedy or inp.temperature <= 0) else float(inp.temperature)


def check_input(inp: GenInput, *, vocab_size: int | None, raw_logprobs: bool | None,
                url: str | None) -> None:
    """``ValueError`` unless ``inp`` can be sent: token ids within the vocabulary
    (``vocab_size``), valid choices or ``max_new_tokens``, ``top_p`` in (0, 1], and a
    temperature the server at ``url`` reports log-probs of (``raw_logprobs`` False: only
    greedy and T = 1 rows)."""
    if not inp.prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    vocab = vocab_size
    top = max([*inp.prompt_ids, *(t for c in (inp.choices or ()) for t in c)], default=0)
    if vocab is not None and top >= vocab:
        raise ValueError(f"token id {top} is outside the model's vocabulary ({vocab} tokens)")
    if min([*inp.prompt_ids, *(t for c in (inp.choices or ()) for t in c)], default=0) < 0:
        raise ValueError("token ids must not be negative")
    if inp.choices is not None:
        validate_choices(inp.choices)
    elif inp.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if not 0.0 < inp.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {inp.top_p}")
    t = _temperature(inp)
    if raw_logprobs is False and t not in (0.0, 1.0):
        raise ValueError(
            f"temperature {t}: the SGLang server at {url} returns temperature-scaled "
            "log-probs, so only temperature 1 and greedy rows are served (start it with "
            "SGLANG_RETURN_ORIGINAL_LOGPROB=1, as a launched server is)")


def generate_payload(inp: GenInput, rid: str, *, eos_token_ids: Sequence[int] = ()) -> dict:
    """The ``/generate`` body of a free (unconstrained) row."""
    stops = list(dict.fromkeys([*(int(t) for t in inp.stop_token_ids),
                                *(int(t) for t in eos_token_ids)]))
    sp: dict[str, Any] = {"max_new_tokens": int(inp.max_new_tokens),
                          "temperature": _temperature(inp), "top_p": float(inp.top_p)}
    if stops:
        sp["stop_token_ids"] = stops
    return {"rid": rid, "input_ids": [int(t) for t in inp.prompt_ids], "sampling_params": sp,
            "return_logprob": True, "stream": False}


def choice_step_payload(inp: GenInput, rid: str, prefix: Sequence[int],
                        allowed: Sequence[int]) -> dict:
    """The ``/generate`` body of one step of a constrained row: the next token after
    ``prompt + prefix``, among ``allowed``."""
    allowed = [int(t) for t in allowed]
    sp = {"max_new_tokens": 1, "temperature": _temperature(inp), "top_p": float(inp.top_p),
          "logit_bias": allowed_bias(allowed)}
    return {"rid": rid, "input_ids": [int(t) for t in (*inp.prompt_ids, *prefix)],
            "sampling_params": sp, "return_logprob": True, "token_ids_logprob": allowed,
            "stream": False}


def probe_payload(vocab_size: int | None, temperature: float, rid: str) -> dict:
    """The ``/generate`` body of one request of the log-prob semantics probe: one step at
    ``temperature`` (0: greedy) on a fixed prompt, with the log-probs of the first (up to
    32) token ids."""
    n = min(int(vocab_size or 32), 32)
    ids = list(range(n))
    prompt = [min(3, n - 1)] * 4
    return {"input_ids": prompt, "return_logprob": True, "token_ids_logprob": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": temperature},
            "rid": rid}


MAX_ANSWER_TOKENS = 1 << 20
"""Entries a list of an answer may have (output tokens, log-prob triples, requested ids of
one position): more than any request of rollart asks for."""
MAX_ANSWER_BYTES = 64 << 20
"""Bytes an answer's body may have (read no further): a million tokens with their log-prob
triples are ~40 MB."""


class SglangAnswerError(ValueError):
    """An answer of the SGLang server that is not the shape the protocol describes, or
    contradicts itself or the request; the message names the field."""


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Triple = tuple[float | None, TokenId | None, Any]
"""``[logprob, token_id, text]``: a null log-prob is -inf (orjson writes -inf as null)."""
Triples = Annotated[list[Triple], msgspec.Meta(max_length=MAX_ANSWER_TOKENS)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_ANSWER_TOKENS)]


class _Finish(msgspec.Struct):
    type: Any = None


class _Meta(msgspec.Struct):
    """The fields of ``meta_info`` that are read (the others are ignored)."""

    finish_reason: _Finish | str | None = None
    output_token_logprobs: Triples | None = None
    output_token_ids_logprobs: Annotated[list[Triples | None],
                                         msgspec.Meta(max_length=MAX_ANSWER_TOKENS)] | None = None


class _Answer(msgspec.Struct):
    """The fields of a ``/generate`` answer that are read."""

    output_ids: TokenIds | None = None
    token_ids: TokenIds | None = None
    """Older servers with ``--skip-tokenizer-init``."""
    meta_info: _Meta | None = None


def _refused(why: str) -> SglangAnswerError:
    return SglangAnswerError(f"sglang /generate answer: {why}")


def _convert(obj: Any, typ: Any, what: str) -> Any:
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise _refused(f"{what}: {e}") from None


def decode_answer(resp: Any) -> _Answer:
    """``resp`` (a decoded JSON answer) as the typed fields rollart reads."""
    if isinstance(resp, _Answer):
        return resp
    if not isinstance(resp, Mapping):
        raise _refused(f"not an object (a {type(resp).__name__})")
    return _convert(resp, _Answer, "not SGLang's shape")


def finish_kind(reason: Any) -> str:
    """``meta_info.finish_reason`` -> ``stop`` | ``length`` | ``abort``."""
    kind = reason.get("type") if isinstance(reason, Mapping) else (
        reason.type if isinstance(reason, _Finish) else reason)
    if isinstance(kind, str) and kind in ("stop", "length", "abort"):
        return kind
    if reason is None:
        raise _refused("an unfinished request (finish_reason null)")
    raise _refused(f"finish_reason {str(kind)[:100]!r} is not stop, length or abort")


def _triples(entries: list[Triple] | None) -> list[tuple[float, int | None]]:
    return [(float(lp) if lp is not None else -math.inf, t) for lp, t, _ in entries or ()]


def parse_generate_response(resp: Any, *, max_tokens: int | None = None
                            ) -> tuple[list[int], list[float], str]:
    """``(token_ids, logprobs, finish)`` of a ``/generate`` answer (``finish`` is ``stop``,
    ``length`` or ``abort``; an aborted answer may hold fewer log-probs than tokens, and
    only the tokens with one are kept). ``max_tokens``: the request's ``max_new_tokens``
    (an answer with more is refused). :class:`SglangAnswerError` when it is malformed."""
    ans = decode_answer(resp)
    meta = ans.meta_info or _Meta()
    finish = finish_kind(meta.finish_reason)
    ids = ans.output_ids if ans.output_ids is not None else (ans.token_ids or [])
    if max_tokens is not None and len(ids) > max_tokens:
        raise _refused(f"{len(ids)} tokens, the request allowed {max_tokens}")
    lps = _triples(meta.output_token_logprobs)
    if len(lps) < len(ids):
        if finish != "abort":
            raise _refused(f"{len(ids)} tokens but {len(lps)} log-probs (is return_logprob "
                           "honoured?)")
        ids = ids[:len(lps)]
    lps = lps[:len(ids)]
    for i, (t, (_, lt)) in enumerate(zip(ids, lps)):
        if lt is not None and lt != t:
            raise _refused(f"log-prob {i} is of token {lt}, the output has {t}")
    return list(ids), [lp for lp, _ in lps], finish


def renormalized_logprob(token: int, pairs: Any) -> float:
    """``logprob[token] - logsumexp(logprob[ids])`` over the ``[logprob, id, text]`` triples
    of one position: the log-prob renormalised over those ids."""
    vals: dict[int, float] = {}
    for lp, t in _triples(_convert(pairs, Triples | None, "output_token_ids_logprobs")):
        if t is not None:
            vals[t] = lp
    if token not in vals:
        raise _refused(f"no log-prob of token {token} (got ids {sorted(vals)[:16]})")
    m = max(vals.values())
    if m == -math.inf or math.isnan(m):
        raise _refused("every allowed token has log-prob -inf (or NaN)")
    lse = m + math.log(sum(math.exp(v - m) for v in vals.values()))
    return vals[token] - lse


def parse_choice_step(resp: Any, allowed: Sequence[int]
                      ) -> tuple[int | None, float | None, str]:
    """``(token, logprob, finish)`` of one constrained step; ``token`` is None when the step
    was aborted before producing one."""
    ans = decode_answer(resp)
    ids, lps, finish = parse_generate_response(ans)
    if not ids:
        if finish == "abort":
            return None, None, finish
        raise _refused("a constrained step with no token")
    tok = ids[0]
    if tok not in set(int(a) for a in allowed):
        raise _refused(
            f"token {tok}, not one of the allowed {list(allowed)[:8]}: the logit bias was not "
            "applied (SGLang before 0.4.7 ignores sampling_params.logit_bias)")
    pairs = ((ans.meta_info.output_token_ids_logprobs if ans.meta_info else None) or [None])[0]
    lp = renormalized_logprob(tok, pairs) if pairs else lps[0]
    return tok, lp, finish


def probe_spread(resp: Any) -> float | None:
    """Max minus min of the requested log-probs in a probe answer (None: it has none)."""
    ans = decode_answer(resp)
    pairs = ((ans.meta_info.output_token_ids_logprobs if ans.meta_info else None) or [None])[0]
    vals = [lp for lp, _ in _triples(pairs)]
    if not vals:
        return None
    return max(vals) - min(vals)


def error_text(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return str(err["message"])
        if data.get("message"):
            return str(data["message"])
        if data.get("detail"):
            return str(data["detail"])
    return json.dumps(data)[:500]

