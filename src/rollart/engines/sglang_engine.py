"""``proxy.engine: sglang``: an SGLang server driven through its native HTTP API.

:class:`SglangEngine` is an :class:`~rollart.engines.base.AsyncEngine` whose requests are
``POST /generate`` calls to an SGLang server (``python -m sglang.launch_server``), which
batches them continuously on the GPU. The server is either

- **launched** by the engine (the default): a child process on a free loopback port, with
  the remaining ``proxy.engine_args`` as its command-line flags, killed (its whole process
  group) on :meth:`~SglangEngine.close`; or
- **attached** with ``engine_args.url`` (a server someone else started and stops).

It runs where SGLang runs (CUDA GPUs); the module itself imports nothing beyond the
standard library, so it loads everywhere. The HTTP client is ``aiohttp`` (the ``sglang``
extra: ``pip install 'rollart[sglang]'``), imported when the engine starts: it pools
keep-alive connections for hundreds of concurrent long requests (its connector limit is
raised to ``max_connections``), handles chunked bodies and timeouts, and SGLang itself
depends on it, so it is already there wherever the server is. SGLang is installed per its
own docs on the GPU machine (``pip install uv && uv pip install sglang``); when its torch
conflicts with this project's, install it in a second environment and point
``engine_args.python`` (or ``ROLLART_SGLANG_PYTHON``) at that interpreter.

``engine_args`` (``proxy.engine_args``)
--------------------------------------
Read by the engine: ``url`` (attach instead of launching), ``python`` (interpreter that runs
the server; default ``$ROLLART_SGLANG_PYTHON`` or this one), ``startup_timeout_s`` (900, or
120 attached), ``request_timeout_s`` (none), ``max_connections`` (1024), ``weights_dir``
(where weight updates are staged; a temporary folder by default; it must be visible to the
server, so an attached server on another host needs a shared path), ``env`` (extra
environment of the server process), ``check_logprobs`` (true: probe the log-prob semantics
at start), ``log_file`` (the launched server's output; default
``rollart-sglang-server-<port>.log`` in ``weights_dir`` or the system's temporary folder,
kept after close).
Every other key is a server flag: ``mem_fraction_static: 0.5`` -> ``--mem-fraction-static
0.5``, ``disable_cuda_graph: true`` -> ``--disable-cuda-graph`` (false/null: left out), a
list -> the flag followed by its items. The engine always passes ``--model-path``,
``--host``, ``--port``, ``--skip-tokenizer-init`` (token ids in, token ids out) and
``--enable-custom-logit-processor`` (constrained turns); ``--random-seed`` is the engine's
seed unless given; ``--attention-backend triton`` is added for a head size FlashInfer lacks
(not 64, 128 or 256: the tiny test models) unless given.

SGLang API facts this relies on (``python/sglang/srt``, SGLang 0.4.x-0.5.x)
-----------------------------------------------------------------------
- ``POST /generate`` (``entrypoints/http_server.py``) with a ``GenerateReqInput``
  (``managers/io_struct.py``): ``input_ids``, ``rid``, ``sampling_params`` (``temperature``
  (0 = greedy), ``top_p``, ``max_new_tokens``, ``stop_token_ids``, ``custom_params``),
  ``return_logprob``, ``token_ids_logprob``, ``custom_logit_processor``. With
  ``--skip-tokenizer-init`` the answer is ``{"output_ids": [...], "meta_info": {...}}``;
  ``meta_info.output_token_logprobs`` is one ``[logprob, token_id, text|null]`` per output
  token, ``meta_info.output_token_ids_logprobs`` one list of such triples (the requested
  ids) per output token, ``meta_info.finish_reason`` ``{"type": "stop", "matched": id}``,
  ``{"type": "length", "length": n}`` or ``{"type": "abort", "message": ...}``. A request
  aborted before prefill answers with no ``output_ids``; one aborted while running answers
  with the tokens it has. A stop or eos token is in ``output_ids``. Invalid requests answer
  HTTP 400 with ``{"message": ...}`` or ``{"error": {"message": ...}}``.
- ``POST /abort_request {"rid": ...}`` aborts one request; the server ignores a rid it has
  not registered yet, so :meth:`SglangEngine.abort` repeats it until the request returns.
- ``POST /update_weights_from_disk {"model_path": DIR, "weight_version": "N"}`` reloads
  every ``*.safetensors`` in DIR (a model folder) in place; it takes the model-update
  writer lock (waits for requests in flight), rolls back on a load error, flushes the
  radix cache itself, and answers ``{"success", "message"}`` (HTTP 400 on failure). It
  loads whatever names the file holds and leaves the others as they were, hence the
  client-side name/shape check first. ``/flush_cache`` is called after it as well.
- ``GET /health_generate`` is 200 once the server generates; ``GET /get_server_info``
  carries the SGLang ``version``.
- Log-probs (``layers/sampler.py``): the custom logit processor runs first, then the
  returned log-probs are ``log_softmax(logits / T)`` (the temperature-scaled, processed
  distribution) unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``
  (``RETURN_ORIGINAL_LOGPROB`` in older versions), which returns ``log_softmax(logits)``
  of the processed logits before the temperature; greedy rows always get the latter; top-p
  never changes them. The engine sets both variables on the server it launches and
  :meth:`SglangEngine.start` probes the semantics (greedy vs T = 0.25 on one prompt):
  where the server returns scaled log-probs (an attached server started without the
  variable) only T = 1 and greedy rows are served, others are refused (``ValueError``).
- Custom logit processors (``sampling/custom_logit_processor.py``, with
  ``--enable-custom-logit-processor``): ``custom_logit_processor`` is
  ``json.dumps({"callable": <hex of a dill pickle of a class>})``; the server unpickles it
  (``dill.loads``, cached per string), instantiates it and calls
  ``instance(logits[rows], [custom_params of each row])``. The processor here is a plain
  class built by ``exec`` of its source from a standard pickle (``builtins.eval`` of a
  small expression), so neither dill nor sglang nor rollart is needed to build it, and the
  server needs no rollart to run it.

Constrained turns (``choices``)
-------------------------------
One token per request: each step sends the prompt plus the prefix chosen so far with
``max_new_tokens: 1``, the processor masking every token but those that continue some
still-possible choice (``custom_params.allowed``), and ``token_ids_logprob`` = those tokens.
The reported log-prob is renormalised over them from ``output_token_ids_logprobs``
(``logprob[t] - logsumexp(logprob[allowed])``: exact for the T = 1 distribution whether or
not the mask reached the log-probs). A step with a single allowed token sends nothing
(log-prob 0). Per-step requests keep the mask a function of the request alone: a processor
that reads the request's generated tokens (``custom_params["__req__"].output_ids``) could
see them one step late under the overlap scheduler. The radix cache makes each step's
prefill a cache hit.

Pause and abort
---------------
:meth:`~SglangEngine.pause` closes a local gate (new requests wait in the engine) and,
in ``wait`` mode, returns once the requests in flight have finished; in ``abort`` mode it
aborts them (``/abort_request`` per rid) and returns once they have answered. SGLang's
``/pause_generation`` is not used: its ``abort`` mode aborts every client's requests and
polls at 1 s, and its ``in_place``/``retract`` modes keep requests inside the server, where
they hold the model-update lock that ``/update_weights_from_disk`` waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .base import (
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    PAUSE_MODES,
    AsyncEngine,
    EngineAborted,
    GenInput,
    GenOutput,
    validate_choices,
)

__all__ = [
    "SglangEngine",
    "INSTALL_HINT",
    "ModelInfo",
    "read_model_info",
    "processor_string",
    "build_processor",
    "allowed_next",
    "is_complete_choice",
    "generate_payload",
    "choice_step_payload",
    "parse_generate_response",
    "parse_choice_step",
    "renormalized_logprob",
    "finish_kind",
    "safetensors_header",
    "read_safetensors_header",
    "rename_safetensors_tensor",
    "check_weights",
    "server_command",
    "server_flags",
    "sglang_unavailable_reason",
]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install SGLang on the GPU machine per https://docs.sglang.io/get_started/install.html "
    "(`pip install uv && uv pip install sglang`), in this environment or in another one whose "
    "interpreter you give as proxy.engine_args.python (or $ROLLART_SGLANG_PYTHON); or attach "
    "to a running server with proxy.engine_args.url"
)
AIOHTTP_HINT = ("proxy.engine sglang needs aiohttp on the client side: "
                "pip install 'rollart[sglang]'")

ENGINE_KEYS = ("url", "python", "startup_timeout_s", "request_timeout_s", "max_connections",
               "weights_dir", "env", "check_logprobs", "log_file")
"""``engine_args`` keys the engine reads; every other key is a server flag."""
FIXED_FLAGS = ("model_path", "port", "skip_tokenizer_init", "enable_custom_logit_processor")
"""Server flags the engine sets itself (refused in ``engine_args``)."""
FLASHINFER_HEAD_DIMS = (64, 128, 256)
LOGPROB_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "RETURN_ORIGINAL_LOGPROB": "1"}
"""Set on a launched server: log-probs of the distribution before the temperature."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
ABORT_RETRY_S = 0.05
ABORT_GIVE_UP_S = 10.0


# ======================================================================================
# Model folder facts
# ======================================================================================
@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know of the model folder (no torch, no weights read)."""

    vocab_size: int | None
    eos_token_ids: tuple[int, ...]
    tied: bool
    head_dim: int | None
    shapes: dict[str, tuple[int, ...]]
    """Tensor name -> shape, from the safetensors headers of the folder."""


def _ids(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(t) for t in x]
    return [int(x)]


def read_model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """Vocabulary size, eos tokens (``generation_config.json`` then ``config.json``: the set
    SGLang stops on), tied embeddings, head size and tensor shapes of a HF model folder."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{d} is not a model folder (config.json: {e})") from e
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    gen: dict = {}
    with contextlib.suppress(OSError, ValueError):
        gen = json.loads((d / "generation_config.json").read_text())
    eos: list[int] = []
    for src in (gen.get("eos_token_id"), text.get("eos_token_id"), cfg.get("eos_token_id")):
        for t in _ids(src):
            if t not in eos:
                eos.append(t)
    head_dim = text.get("head_dim")
    if head_dim is None and text.get("hidden_size") and text.get("num_attention_heads"):
        head_dim = int(text["hidden_size"]) // int(text["num_attention_heads"])
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(d.glob("*.safetensors")):
        shapes.update(read_safetensors_header(f))
    vocab = text.get("vocab_size", cfg.get("vocab_size"))
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    return ModelInfo(vocab_size=int(vocab) if vocab is not None else None,
                     eos_token_ids=tuple(eos), tied=tied,
                     head_dim=int(head_dim) if head_dim else None, shapes=shapes)


# ======================================================================================
# safetensors headers (the format: u64 little-endian header size, JSON header, data)
# ======================================================================================
def _parse_header(raw: bytes, total: int | None, what: str) -> dict[str, tuple[int, ...]]:
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{what}: not a safetensors file (bad header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what}: not a safetensors file (header is not an object)")
    shapes: dict[str, tuple[int, ...]] = {}
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(s) for s in meta["shape"])
            lo, hi = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{what}: not a safetensors file (bad entry {name!r})") from None
        shapes[name] = shape
        end = max(end, hi)
    if total is not None and end > total:
        raise ValueError(f"{what}: truncated safetensors file ({total} data bytes, the header "
                         f"needs {end})")
    return shapes


def safetensors_header(data: bytes | bytearray | memoryview) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of safetensors bytes (``ValueError`` if they are not)."""
    mv = memoryview(data)
    if len(mv) < 8:
        raise ValueError("weights: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > len(mv) - 8:
        raise ValueError("weights: not a safetensors file (header size beyond the data)")
    return _parse_header(bytes(mv[8:8 + n]), len(mv) - 8 - n, "weights")


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, reading only its header."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{p}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"{p}: not a safetensors file (header size beyond the file)")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"cannot read weights from {p}: {e}") from e
    return _parse_header(raw, size - 8 - n, str(p))


def rename_safetensors_tensor(data: bytes, old: str, new: str) -> bytes:
    """The same safetensors bytes with tensor ``old`` named ``new`` (header rewritten, data
    untouched: offsets are relative to the data section)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    if old not in header or new in header:
        raise ValueError(f"cannot rename {old!r} to {new!r}")
    header = {(new if k == old else k): v for k, v in header.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


TIED = ("lm_head.weight", "model.embed_tokens.weight")


def check_weights(expected: Mapping[str, Sequence[int]], given: Mapping[str, Sequence[int]],
                  *, tied: bool = False, what: str = "weights") -> None:
    """``ValueError`` unless ``given`` has every name of ``expected`` with its shape and no
    other name. With tied embeddings either of ``lm_head.weight`` and
    ``model.embed_tokens.weight`` stands for both."""
    exp = {k: tuple(v) for k, v in expected.items()}
    giv = {k: tuple(v) for k, v in given.items()}
    if tied:
        head, embed = TIED
        shape = exp.get(embed, exp.get(head))
        if shape is not None:
            exp.setdefault(head, shape)
            exp.setdefault(embed, shape)
            if head in giv or embed in giv:  # one of the two is enough
                for k in TIED:
                    if k not in giv:
                        exp.pop(k, None)
    missing = sorted(set(exp) - set(giv))
    unexpected = sorted(set(giv) - set(exp))
    bad = [f"{k}: {giv[k]} != {exp[k]}" for k in sorted(set(exp) & set(giv)) if giv[k] != exp[k]]
    if missing or unexpected or bad:
        raise ValueError(f"{what} do not match the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]} shape mismatches={bad[:5]}")


# ======================================================================================
# The custom logit processor (constrained turns)
# ======================================================================================
PROCESSOR_CLASS = "RollartAllowedTokens"
PROCESSOR_SOURCE = '''
class RollartAllowedTokens:
    """rollart: keep only custom_params["allowed"] (token ids) of each row; rows without
    it are left as they are. Built by rollart.engines.sglang_engine."""

    def __call__(self, logits, custom_param_list=None):
        import torch

        for i, params in enumerate(custom_param_list or ()):
            allowed = (params or {}).get("allowed") if hasattr(params, "get") else None
            if allowed is None:
                continue
            idx = torch.as_tensor(list(allowed), dtype=torch.long, device=logits.device)
            keep = logits[i].index_select(0, idx)
            logits[i].fill_(float("-inf"))
            logits[i].index_copy_(0, idx, keep)
        return logits
'''


class _BuildFromSource:
    """Pickles as ``builtins.eval(expr, {})``, whose value is the class ``PROCESSOR_SOURCE``
    defines (``exec`` in a fresh namespace): a standard pickle that ``pickle.loads`` and
    ``dill.loads`` both turn into the class, with no import of rollart."""

    def __init__(self, source: str, name: str) -> None:
        self.source, self.name = source, name

    def __reduce__(self):
        import builtins

        expr = (f"(lambda ns: (exec({self.source!r}, ns), ns[{self.name!r}])[1])"
                f"({{'__name__': 'rollart_sglang_processor'}})")
        return (builtins.eval, (expr, {}))


@functools.lru_cache(maxsize=None)
def processor_string() -> str:
    """The ``custom_logit_processor`` field: SGLang's ``CustomLogitProcessor.to_str()``
    format, ``{"callable": <hex pickle of the class>}``."""
    blob = pickle.dumps(_BuildFromSource(PROCESSOR_SOURCE, PROCESSOR_CLASS), protocol=4)
    return json.dumps({"callable": blob.hex()})


def build_processor(serialized: str | None = None, *, loads=pickle.loads):
    """What the server does with the field (``CustomLogitProcessor.from_str``): the
    processor instance. ``loads`` is ``dill.loads`` on the server."""
    data = json.loads(serialized or processor_string())
    return loads(bytes.fromhex(data["callable"]))()


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
          "custom_params": {"allowed": allowed}}
    return {"rid": rid, "input_ids": [int(t) for t in (*inp.prompt_ids, *prefix)],
            "sampling_params": sp, "return_logprob": True, "token_ids_logprob": allowed,
            "custom_logit_processor": processor_string(), "stream": False}


def finish_kind(reason: Any) -> str:
    """``meta_info.finish_reason`` -> ``stop`` | ``length`` | ``abort``."""
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    if reason is None:
        raise RuntimeError("sglang answered an unfinished request (finish_reason null)")
    raise RuntimeError(f"sglang finish_reason {reason!r} is not stop, length or abort")


def _triples(entries: Any, what: str) -> list[tuple[float, int | None]]:
    out = []
    for e in entries or ():
        if not isinstance(e, (list, tuple)) or len(e) < 2:
            raise RuntimeError(f"sglang {what}: {e!r} is not [logprob, token_id, text]")
        out.append((float(e[0]) if e[0] is not None else -math.inf,
                    int(e[1]) if e[1] is not None else None))
    return out


def parse_generate_response(resp: Mapping[str, Any]) -> tuple[list[int], list[float], str]:
    """``(token_ids, logprobs, finish)`` of a ``/generate`` answer (``finish`` is ``stop``,
    ``length`` or ``abort``; an aborted answer may hold fewer log-probs than tokens, and
    only the tokens with one are kept)."""
    meta = resp.get("meta_info") or {}
    finish = finish_kind(meta.get("finish_reason"))
    ids = resp.get("output_ids")
    if ids is None:
        ids = resp.get("token_ids") or []  # older servers with --skip-tokenizer-init
    ids = [int(t) for t in ids]
    lps = _triples(meta.get("output_token_logprobs"), "output_token_logprobs")
    if len(lps) < len(ids):
        if finish != "abort":
            raise RuntimeError(f"sglang returned {len(ids)} tokens but {len(lps)} log-probs "
                               "(is return_logprob honoured?)")
        ids = ids[:len(lps)]
    lps = lps[:len(ids)]
    for i, (t, (_, lt)) in enumerate(zip(ids, lps)):
        if lt is not None and lt != t:
            raise RuntimeError(f"sglang log-prob {i} is of token {lt}, the output has {t}")
    return ids, [lp for lp, _ in lps], finish


def renormalized_logprob(token: int, pairs: Any) -> float:
    """``logprob[token] - logsumexp(logprob[ids])`` over the ``[logprob, id, text]`` triples
    of one position: the log-prob renormalised over those ids."""
    vals: dict[int, float] = {}
    for lp, t in _triples(pairs, "output_token_ids_logprobs"):
        if t is not None:
            vals[t] = lp
    if token not in vals:
        raise RuntimeError(f"sglang sent no log-prob of token {token} (got ids {sorted(vals)})")
    m = max(vals.values())
    if m == -math.inf:
        raise RuntimeError("sglang gave every allowed token log-prob -inf")
    lse = m + math.log(sum(math.exp(v - m) for v in vals.values()))
    return vals[token] - lse


def parse_choice_step(resp: Mapping[str, Any], allowed: Sequence[int]
                      ) -> tuple[int | None, float | None, str]:
    """``(token, logprob, finish)`` of one constrained step; ``token`` is None when the step
    was aborted before producing one."""
    ids, lps, finish = parse_generate_response(resp)
    if not ids:
        if finish == "abort":
            return None, None, finish
        raise RuntimeError("sglang answered a constrained step with no token")
    tok = ids[0]
    if tok not in set(int(a) for a in allowed):
        raise RuntimeError(
            f"sglang picked token {tok}, not one of the allowed {list(allowed)[:8]}: the custom "
            "logit processor was not applied (the server needs --enable-custom-logit-processor)")
    pairs = ((resp.get("meta_info") or {}).get("output_token_ids_logprobs") or [None])[0]
    lp = renormalized_logprob(tok, pairs) if pairs else lps[0]
    return tok, lp, finish


def _error_text(body: bytes) -> str:
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


# ======================================================================================
# Launching a server
# ======================================================================================
def server_flags(args: Mapping[str, Any]) -> list[str]:
    """``{"mem_fraction_static": 0.5, "disable_cuda_graph": True}`` ->
    ``["--mem-fraction-static", "0.5", "--disable-cuda-graph"]``."""
    out: list[str] = []
    for key, val in args.items():
        flag = "--" + str(key).replace("_", "-")
        if val is None or val is False:
            continue
        if val is True:
            out.append(flag)
        elif isinstance(val, (list, tuple)):
            out += [flag, *(str(v) for v in val)]
        elif isinstance(val, Mapping):
            out += [flag, json.dumps(val)]
        else:
            out += [flag, str(val)]
    return out


def server_command(model_dir: str | os.PathLike, *, port: int, seed: int = 0,
                   args: Mapping[str, Any] | None = None, python: str | None = None,
                   head_dim: int | None = None) -> list[str]:
    """The ``sglang.launch_server`` command line of a launched server."""
    args = {str(k).replace("-", "_"): v for k, v in dict(args or {}).items()}
    fixed = sorted(k for k in args if k in FIXED_FLAGS)
    if fixed:
        raise ValueError(f"proxy.engine_args: {fixed} are set by the sglang engine itself")
    host = args.pop("host", "127.0.0.1")
    args.setdefault("random_seed", int(seed))
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        args.setdefault("attention_backend", "triton")
    return [python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_dir), "--host", str(host), "--port", str(int(port)),
            "--skip-tokenizer-init", "--enable-custom-logit-processor", *server_flags(args)]


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@functools.lru_cache(maxsize=8)
def sglang_unavailable_reason(python: str | None = None) -> str | None:
    """None when ``python`` (default ``$ROLLART_SGLANG_PYTHON`` or this interpreter) has
    sglang and sees a CUDA GPU; else why not (a test's skip reason)."""
    python = python or os.environ.get("ROLLART_SGLANG_PYTHON") or sys.executable
    if python == sys.executable:
        if importlib.util.find_spec("sglang") is None:
            return ("sglang is not installed (pip install uv && uv pip install sglang, or "
                    "$ROLLART_SGLANG_PYTHON naming an interpreter that has it)")
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        if not torch.cuda.is_available():
            return "no CUDA GPU (SGLang serves on CUDA)"
        return None
    code = ("import importlib.util, sys\n"
            "if importlib.util.find_spec('sglang') is None: sys.exit('sglang is not installed')\n"
            "import torch\n"
            "sys.exit(None if torch.cuda.is_available() else 'no CUDA GPU')\n")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {python}: {e}"
    if r.returncode:
        return f"{python}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}"
    return None


# ======================================================================================
# The engine
# ======================================================================================
@dataclasses.dataclass(eq=False)
class _Req:
    request_id: str
    server_rid: str | None = None
    aborted: bool = False
    active: bool = False
    posting: bool = False
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set when the current ``/generate`` call returns (a new one per call)."""
    woken: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set by an abort (wakes a request waiting at the pause gate)."""


class SglangEngine(AsyncEngine):
    """An SGLang server as an :class:`AsyncEngine` (see the module docstring)."""

    def __init__(self, model_dir: str | os.PathLike, *, seed: int = 0,
                 engine_args: Mapping[str, Any] | None = None) -> None:
        args = dict(engine_args or {})
        self.model_dir = Path(model_dir)
        self.seed = int(seed)
        self.url: str | None = (str(args.pop("url")).rstrip("/") if args.get("url") else None)
        args.pop("url", None)
        self.python = (args.pop("python", None) or os.environ.get("ROLLART_SGLANG_PYTHON")
                       or sys.executable)
        self.startup_timeout_s = float(args.pop("startup_timeout_s",
                                                120.0 if self.url else 900.0))
        rt = args.pop("request_timeout_s", None)
        self.request_timeout_s = float(rt) if rt else None
        self.max_connections = int(args.pop("max_connections", 1024))
        wd = args.pop("weights_dir", None)
        self._weights_root = Path(wd) if wd else None
        self.server_env = {str(k): str(v) for k, v in dict(args.pop("env", None) or {}).items()}
        self.check_logprobs = bool(args.pop("check_logprobs", True))
        self._log_file = args.pop("log_file", None)
        self.server_args = args
        if self.url is None:  # refuse bad flags now, not after minutes of start-up
            server_command(self.model_dir, port=0, args=args)
        self.info = read_model_info(self.model_dir)
        self.vocab_size = self.info.vocab_size
        self.version = 0
        self.raw_logprobs: bool | None = None
        """Whether the server returns log-probs before the temperature (probed at start;
        None: not probed or inconclusive)."""
        self.server_version: str | None = None
        self.command: list[str] | None = None
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._session: Any = None
        self._aiohttp: Any = None
        self._work: Path | None = None
        self._own_work = False
        self._staged: list[Path] = []
        self._reqs: dict[str, _Req] = {}
        self._active = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # ---------------------------------------------------------------- properties
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids

    @property
    def base_url(self) -> str:
        if self.url is None:
            raise RuntimeError("the sglang engine is not started")
        return self.url

    # ---------------------------------------------------------------- start / close
    async def start(self) -> None:
        """Launch (or attach to) the server and wait until it generates. Idempotent."""
        if self._session is not None:
            return
        if self._closed:
            raise RuntimeError("the sglang engine is closed")
        try:
            import aiohttp
        except ImportError:
            raise RuntimeError(AIOHTTP_HINT) from None
        self._aiohttp = aiohttp
        try:
            self._work = self._weights_root
            if self._work is None:
                self._work = Path(tempfile.mkdtemp(prefix="rollart-sglang-"))
                self._own_work = True
            self._work.mkdir(parents=True, exist_ok=True)
            if self.url is None:
                await self._launch()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=30))
            await self._wait_ready()
            with contextlib.suppress(Exception):
                info = await self._get_json("/get_server_info", timeout=30)
                self.server_version = str(info.get("version")) if info.get("version") else None
            if self.check_logprobs:
                try:
                    self.raw_logprobs = await self._probe_logprobs()
                except (RuntimeError, ValueError) as e:  # e.g. no token_ids_logprob (old)
                    log.warning("sglang log-prob probe failed, semantics unknown: %s", e)
        except BaseException:
            await self.close()
            raise
        log.info("sglang engine ready at %s (sglang %s, raw log-probs: %s)", self.url,
                 self.server_version, self.raw_logprobs)

    async def _launch(self) -> None:
        if self.python == sys.executable:
            missing = importlib.util.find_spec("sglang") is None
        else:
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.python, "-c", "import importlib.util, sys; "
                    "sys.exit(importlib.util.find_spec('sglang') is None)",
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            except OSError as e:
                raise RuntimeError(f"proxy.engine sglang: cannot run the interpreter "
                                   f"{self.python!r} (proxy.engine_args.python or "
                                   f"$ROLLART_SGLANG_PYTHON): {e}") from None
            missing = (await proc.wait()) != 0
        if missing:
            raise RuntimeError(f"proxy.engine sglang: the sglang package is not available to "
                               f"{self.python}: {INSTALL_HINT}")
        port = _free_port()
        self.command = server_command(self.model_dir, port=port, seed=self.seed,
                                      args=self.server_args, python=self.python,
                                      head_dim=self.info.head_dim)
        host = self.command[self.command.index("--host") + 1]
        connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{connect}:{port}"
        assert self._work is not None
        self.log_path = (Path(self._log_file) if self._log_file else
                         (self._work if not self._own_work else Path(tempfile.gettempdir()))
                         / f"rollart-sglang-server-{port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **LOGPROB_ENV, **self.server_env}
        log.info("starting the SGLang server: %s (log: %s)", " ".join(self.command),
                 self.log_path)
        with open(self.log_path, "wb") as out:
            # its own session: close() signals the whole group (scheduler, detokenizer);
            # on Linux it also gets SIGTERM if this (main) thread dies without close()
            tie = (sys.platform.startswith("linux")
                   and threading.current_thread() is threading.main_thread())
            self._proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, preexec_fn=_die_with_parent if tie else None)

    def _exited_error(self) -> RuntimeError | None:
        if self._proc is None or self._proc.poll() is None:
            return None
        return RuntimeError(
            f"the SGLang server exited with code {self._proc.returncode} before it was ready: "
            f"{' '.join(self.command or [])}\n--- last lines of {self.log_path}:\n"
            f"{_tail(self.log_path)}")

    async def _wait_ready(self) -> None:
        """Poll ``/health_generate`` until it answers 200 (the server generates)."""
        aiohttp = self._aiohttp
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer yet"
        while True:
            err = self._exited_error()
            if err is not None:
                raise err
            try:
                async with self._session.get(self.url + "/health_generate",
                                             timeout=aiohttp.ClientTimeout(total=60)) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                what = (f"the SGLang server it launched ({' '.join(self.command or [])})"
                        if self._proc is not None else "the SGLang server")
                tail = (f"\n--- last lines of {self.log_path}:\n{_tail(self.log_path)}"
                        if self.log_path else "")
                raise RuntimeError(
                    f"proxy.engine sglang: {what} at {self.url} was not ready after "
                    f"{self.startup_timeout_s:.0f} s (GET /health_generate: {last}; raise "
                    f"proxy.engine_args.startup_timeout_s if it is only slow){tail}")
            await asyncio.sleep(0.5)

    async def _probe_logprobs(self) -> bool | None:
        """Greedy vs T = 0.25 log-probs of the same first step: equal when the server
        returns log-probs before the temperature, 4 times as spread when after."""
        n = min(int(self.vocab_size or 32), 32)
        ids = list(range(n))
        prompt = [min(3, n - 1)] * 4
        spreads = []
        for t in (0.0, 0.25):
            body = {"input_ids": prompt, "return_logprob": True, "token_ids_logprob": ids,
                    "sampling_params": {"max_new_tokens": 1, "temperature": t},
                    "rid": f"rollart-probe-{uuid.uuid4().hex[:12]}"}
            resp = await self._post_json("/generate", body, timeout=120)
            pairs = ((resp.get("meta_info") or {}).get("output_token_ids_logprobs") or [None])[0]
            vals = [lp for lp, _ in _triples(pairs, "output_token_ids_logprobs")]
            if not vals:
                return None
            spreads.append(max(vals) - min(vals))
        if spreads[0] < 0.05:
            log.warning("sglang log-prob probe inconclusive (near-uniform first step)")
            return None
        ratio = spreads[1] / spreads[0]
        if ratio < 1.5:
            return True
        if ratio > 2.5:
            log.warning("the SGLang server at %s returns temperature-scaled log-probs; rows "
                        "sampled at a temperature other than 1 are refused (start it with "
                        "SGLANG_RETURN_ORIGINAL_LOGPROB=1)", self.url)
            return False
        return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._open.set()
        for t in list(self._tasks):
            t.cancel()
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            await asyncio.to_thread(self._kill, proc)
        if self._own_work and self._work is not None:
            await asyncio.to_thread(shutil.rmtree, self._work, True)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """SIGTERM the server's process group (it has scheduler and detokenizer children),
        then SIGKILL what is left after 15 s."""
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # children outliving the leader

    # ---------------------------------------------------------------- HTTP
    async def _post(self, path: str, body: dict, *, timeout: float | None = None
                    ) -> tuple[int, bytes]:
        if self._session is None:
            raise RuntimeError("the sglang engine is not started (or closed)")
        kw = {"timeout": self._aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        async with self._session.post(self.base_url + path, json=body, **kw) as r:
            return r.status, await r.read()

    async def _post_json(self, path: str, body: dict, *, timeout: float | None = None) -> dict:
        status, data = await self._post(path, body, timeout=timeout)
        if status == 200:
            return json.loads(data) if data.strip() else {}
        msg = _error_text(data)
        if path == "/generate" and 400 <= status < 500:
            raise ValueError(f"sglang refused the request (HTTP {status}): {msg}")
        raise RuntimeError(f"sglang {path} answered HTTP {status}: {msg}")

    async def _get_json(self, path: str, *, timeout: float | None = None) -> dict:
        kw = {"timeout": self._aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        async with self._session.get(self.base_url + path, **kw) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"sglang {path} answered HTTP {r.status}: {_error_text(data)}")
            return json.loads(data)

    async def _send(self, st: _Req, body: dict) -> dict:
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

    async def _abort_until_done(self, st: _Req, rid: str) -> None:
        done = st.done
        give_up = time.monotonic() + ABORT_GIVE_UP_S
        while not done.is_set() and time.monotonic() < give_up and self._session is not None:
            await self._post_quietly("/abort_request", {"rid": rid})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), ABORT_RETRY_S)

    # ---------------------------------------------------------------- generation
    def _check_input(self, inp: GenInput) -> None:
        if not inp.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        vocab = self.vocab_size
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
        if self.raw_logprobs is False and t not in (0.0, 1.0):
            raise ValueError(
                f"temperature {t}: the SGLang server at {self.url} returns temperature-scaled "
                "log-probs, so only temperature 1 and greedy rows are served (start it with "
                "SGLANG_RETURN_ORIGINAL_LOGPROB=1, as a launched server is)")

    async def generate(self, inp: GenInput, request_id: str) -> GenOutput:
        self._check_input(inp)
        if self._session is None:
            raise RuntimeError("the sglang engine is not started (or closed)")
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        st = _Req(request_id)
        self._reqs[request_id] = st
        try:
            while not self._open.is_set() and not st.aborted:  # paused: wait for resume
                waiters = {asyncio.ensure_future(self._open.wait()),
                           asyncio.ensure_future(st.woken.wait())}
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
            version = int(self.version)
            if st.aborted:
                raise EngineAborted(request_id, GenOutput([], [], FINISH_INTERRUPTED, version),
                                    version)
            st.active = True
            self._active += 1
            self._idle.clear()
            try:
                if inp.choices is None:
                    out = await self._generate_free(inp, st, version)
                else:
                    out = await self._generate_choice(inp, st, version)
            finally:
                self._active -= 1
                st.active = False
                if self._active == 0:
                    self._idle.set()
            out.version = version
            return out
        finally:
            self._reqs.pop(request_id, None)

    def _new_rid(self, st: _Req) -> str:
        return f"{st.request_id}.{uuid.uuid4().hex[:10]}"

    async def _generate_free(self, inp: GenInput, st: _Req, version: int) -> GenOutput:
        body = generate_payload(inp, self._new_rid(st), eos_token_ids=self.eos_token_ids)
        resp = await self._send(st, body)
        ids, lps, finish = parse_generate_response(resp)
        if finish == "abort":
            raise EngineAborted(st.request_id, GenOutput(ids, lps, FINISH_INTERRUPTED, version),
                                version)
        return GenOutput(ids, lps, FINISH_STOP if finish == "stop" else FINISH_LENGTH, version)

    async def _generate_choice(self, inp: GenInput, st: _Req, version: int) -> GenOutput:
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

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            st = self._reqs.get(rid)
            if st is None or st.aborted:
                continue
            st.aborted = True
            st.woken.set()
            if st.posting and st.server_rid:
                self._spawn(self._abort_until_done(st, st.server_rid))

    async def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._open.clear()
        if mode == "abort":
            await self.abort([r for r, st in self._reqs.items() if st.active])
        await self._idle.wait()

    async def resume(self) -> None:
        self._open.set()

    async def flush_cache(self) -> bool:
        """``POST /flush_cache``: empty the server's radix (prefix) cache; False when SGLang
        refused (it does while requests run)."""
        status, _ = await self._post("/flush_cache", {}, timeout=60)
        return status == 200

    # ---------------------------------------------------------------- weights
    async def load_weights(self, source: str | Path | bytes, version: int) -> None:
        data: bytes | None = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            given = safetensors_header(data)
            what = "weights (bytes)"
        else:
            path = Path(source)
            given = await asyncio.to_thread(read_safetensors_header, path)
            what = f"weights in {path}"
        if not self.info.shapes:
            raise ValueError(f"cannot check {what}: the model folder {self.model_dir} has no "
                             "safetensors weights to compare names and shapes with")
        check_weights(self.info.shapes, given, tied=self.info.tied, what=what)
        if self._session is None:
            raise RuntimeError("the sglang engine is not started (or closed)")
        head, embed = TIED
        if self.info.tied and embed not in given:  # SGLang skips lm_head of a tied model
            if data is None:
                data = await asyncio.to_thread(Path(source).read_bytes)
            data = rename_safetensors_tensor(data, head, embed)
        folder = await asyncio.to_thread(self._stage, data if data is not None else Path(source),
                                         int(version))
        try:
            resp = await self._post_json("/update_weights_from_disk",
                                         {"model_path": str(folder),
                                          "weight_version": str(int(version))})
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise
        if not resp.get("success", True):
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise RuntimeError(f"sglang could not load the weights: {resp.get('message')}")
        await self._post_quietly("/flush_cache", {})
        self.version = int(version)
        old, self._staged = self._staged, [folder]
        for f in old:
            await asyncio.to_thread(shutil.rmtree, f, True)

    def _stage(self, source: bytes | Path, version: int) -> Path:
        """A model folder for ``/update_weights_from_disk``: the weights as
        ``model.safetensors`` (written, or a link to the file) and the folder's small
        non-weight files (config, generation config, tokenizer)."""
        assert self._work is not None
        folder = self._work / f"weights-v{version:06d}-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True)
        target = folder / "model.safetensors"
        if isinstance(source, (bytes, bytearray)):
            tmp = folder / ".model.safetensors.tmp"
            tmp.write_bytes(source)
            os.replace(tmp, target)
        else:
            try:
                os.symlink(Path(source).resolve(), target)
            except OSError:
                shutil.copyfile(source, target)
        for f in self.model_dir.iterdir():
            if (f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)
                    and not f.name.endswith(".index.json") and f.stat().st_size < 64 << 20):
                shutil.copy2(f, folder / f.name)
        return folder
