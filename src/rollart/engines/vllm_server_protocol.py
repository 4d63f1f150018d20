"""What ``proxy.engine: vllm-server`` sends to vLLM's server and how it reads the answers.

Pure translation, standard library and msgspec only (no I/O): the ``SamplingParams`` of a
free row and of a constrained one (:func:`sampling_params`, :func:`choice_params`), the
typed decoding of an answer (:func:`decode_answer`: every answer is read up to
:data:`MAX_ANSWER_BYTES` by the engine, then decoded into the structs here, each list
bounded; what is not vLLM's shape is a :class:`VllmAnswerError` naming the field), and the
tokens and log-probs of a free row (:func:`free_tokens`) or the raw log-probs of a
constrained one's steps (:func:`step_logprobs`).
:class:`~rollart.engines.vllm_server_engine.VllmServerEngine` does the I/O.

vLLM 0.32 server API used (``vllm/entrypoints``)
-------------------------------------------------
- ``POST /inference/v1/generate`` (``scale_out/token_in_token_out``): token ids in, a full
  ``SamplingParams`` (the same fields the in-process engine sets: ``logprobs: 0``,
  ``ignore_eos`` with rollart's eos set in ``stop_token_ids``, ``seed``, ``detokenize:
  false``; for choices ``extra_args`` of :mod:`~rollart.engines.vllm_choices` and
  ``logprob_token_ids``), ``output_mode: tokens``; the answer's ``choices[0]`` has
  ``token_ids``, ``finish_reason`` (``stop``/``length``/``abort``) and
  ``logprobs.content[i]`` (``logprob``, ``top_logprobs``; -inf is sent as -9999). The
  server's request id is ``generate-tokens-<request_id>``.
- ``POST /inference/v1/abort_requests {"request_ids": [...]}``: aborts by that id; the
  request answers with what it has and ``finish_reason: abort`` (an id not registered yet is
  ignored, so the abort is repeated until the call returns, as for SGLang).
- dev mode: ``POST /pause?mode=abort|wait`` and ``/resume`` around a weight update,
  ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  (the in-process engine's reload, string kwargs only: no pickle), ``/reset_prefix_cache``,
  ``/update_weight_version`` then ``GET /weight_info`` (the server confirms the version).
- ``GET /health`` (behind the key, see :mod:`~rollart.engines.vllm_server`).
- LoRA (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): ``POST
  /v1/load_lora_adapter {"lora_name", "lora_path"}`` reads a peft folder on the server's
  host and preloads it into the engine (``add_lora``: a bad adapter is refused there, HTTP
  500 with vLLM's message); a name may be loaded once (a new name per version, which also
  keys the prefix cache); a request names it in ``model``. ``/v1/unload_lora_adapter
  {"lora_name"}`` only drops the name from the served list: the worker's adapter cache
  (``max_cpu_loras``, default ``max_loras`` = 1) evicts the old adapter when the next loads.
Not used: ``/update_weights`` (its transfer engines are NCCL/IPC/... tensor transports, none
reads a staged file), ``/sleep``/``/wake_up`` (nothing else shares the device here), client
disconnect as abort (the answer is then an error without the partial tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from .base import GenInput

__all__ = ["MAX_ANSWER_BYTES", "MAX_LOGPROB_IDS", "VllmAnswerError", "sampling_params",
           "choice_params", "decode_answer", "decode_weight_version", "free_tokens",
           "step_logprobs", "server_rid", "AnswerChoice"]

MAX_ANSWER_BYTES = 64 << 20
"""Bytes an answer may have (read no further)."""
MAX_TOKENS = 1 << 20
"""Entries a list of an answer may have."""
MAX_LOGPROB_IDS = 128  # vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS


class VllmAnswerError(ValueError):
    """An answer of the vLLM server that is not the shape described above."""


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]


class _Top(msgspec.Struct):
    token_id: TokenId
    logprob: float


class _Step(msgspec.Struct):
    token_id: TokenId
    logprob: float
    top_logprobs: Annotated[list[_Top], msgspec.Meta(max_length=4096)] = []


class _LogProbs(msgspec.Struct):
    content: Annotated[list[_Step], msgspec.Meta(max_length=MAX_TOKENS)] | None = None


class AnswerChoice(msgspec.Struct):
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)] | None = None
    finish_reason: str | None = None
    logprobs: _LogProbs | None = None


class _Answer(msgspec.Struct):
    choices: Annotated[list[AnswerChoice], msgspec.Meta(min_length=1, max_length=1)]


class _WeightInfo(msgspec.Struct):
    weight_version: str | int | None = None


def server_rid(request_id: str) -> str:
    """The server's id of the call ``request_id`` (what ``abort_requests`` takes)."""
    return f"generate-tokens-{request_id}"


def sampling_params(inp: GenInput, seed: int, **kw: Any) -> dict:
    """The ``SamplingParams`` of a row: greedy or temperature/top-p with the per-request
    ``seed``, vLLM's eos handling off (rollart's stop tokens go in ``stop_token_ids``), no
    detokenization; ``kw`` adds or overrides fields."""
    greedy = inp.greedy or inp.temperature <= 0
    sp: dict[str, Any] = {"temperature": 0.0 if greedy else float(inp.temperature),
                          "top_p": 1.0 if greedy else float(inp.top_p), "ignore_eos": True,
                          "detokenize": False, "skip_special_tokens": False}
    if not greedy:
        sp["seed"] = int(seed)
    sp.update(kw)
    return sp


def choice_params(inp: GenInput, seed: int, choices: list[list[int]], end: int,
                  branch: Sequence[int]) -> dict:
    """A constrained row's ``SamplingParams``: rollart's choice processor
    (:mod:`~rollart.engines.vllm_choices`, by ``extra_args``) masks every step, ``end`` (a
    token in no choice) ends it, and the raw log-probs of the ``branch`` tokens come back
    at every step when there are at most :data:`MAX_LOGPROB_IDS` of them (else only the
    sampled token's: the engine scores the branching steps afterwards)."""
    lengths = {len(c) for c in choices}
    direct = 0 < len(branch) <= MAX_LOGPROB_IDS
    lp = ({"logprobs": len(branch), "logprob_token_ids": list(branch)} if direct
          else {"logprobs": 0})
    return sampling_params(inp, seed, max_tokens=max(lengths) + (0 if len(lengths) == 1 else 1),
                           stop_token_ids=[end], **lp,
                           extra_args={"rollart_choices": choices, "rollart_choice_end": end})


def decode_answer(data: bytes) -> AnswerChoice:
    """The one choice of a ``/inference/v1/generate`` answer."""
    try:
        return msgspec.json.decode(data, type=_Answer).choices[0]
    except msgspec.DecodeError as e:
        raise VllmAnswerError(f"vllm /inference/v1/generate answer: not vLLM's shape: "
                              f"{e}") from None


def decode_weight_version(data: bytes) -> str:
    """``weight_version`` of a ``/weight_info`` answer, as a string."""
    try:
        return str(msgspec.json.decode(data, type=_WeightInfo).weight_version)
    except msgspec.DecodeError as e:
        raise VllmAnswerError(f"vllm /weight_info answer: not vLLM's shape: {e}") from None


def free_tokens(c: AnswerChoice, max_tokens: int) -> tuple[list[int], list[float]]:
    """A free row's tokens and their raw log-probs; :class:`VllmAnswerError` when there
    are more tokens than asked for or fewer log-probs than tokens."""
    tokens = list(c.token_ids or [])
    steps = (c.logprobs.content if c.logprobs else None) or []
    if len(tokens) > max_tokens or len(steps) < len(tokens):
        raise VllmAnswerError(f"vllm answered {len(tokens)} tokens with {len(steps)} "
                              f"log-probs for max_tokens {max_tokens}")
    return tokens, [float(s.logprob) for s in steps[:len(tokens)]]


def step_logprobs(c: AnswerChoice) -> list[dict[int, float]]:
    """Per output step: token id -> raw log-prob, of the sampled token and the requested
    ``logprob_token_ids``."""
    steps = (c.logprobs.content if c.logprobs else None) or []
    return [{s.token_id: s.logprob, **{t.token_id: t.logprob for t in s.top_logprobs}}
            for s in steps]
