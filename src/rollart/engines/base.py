"""The generation-engine interfaces.

The `LLMProxy` drives an `AsyncEngine`: per request, async, abortable, with weight loads
between `pause()` and `resume()` (vLLM and SGLang are ones; `BatchedEngine` makes one of a
`GenerationEngine`). A `GenerationEngine` is synchronous and batched: `generate(inputs)`
takes one `GenInput` per turn (from any number of trajectories) and returns one `GenOutput`
per input, in order (the torch engine). Engines work in token ids only; tokenization is the
caller's.

A `GenInput` may name its `session` (the trajectory it belongs to): a multi-turn prompt is the
previous prompt + response + new tokens, so an engine that caches K/V per session (the torch
engine does) prefills only the new tokens. The session is a hint for speed, never for results.

Log-prob semantics (the contract with the trainer)
--------------------------------------------------
`GenOutput.logprobs[i]` is the log-probability of `token_ids[i]` under the policy's own
distribution at temperature 1, i.e. `log_softmax(logits)[token]` of the raw model logits at
that position, *restricted to what was allowed*:

- free rows: the full vocabulary, so it equals `log_softmax(logits, -1)[token]`;
- constrained rows (`choices` given): the softmax is renormalised over the tokens allowed
  at that step (those that continue some still-possible choice), so it equals
  `logits[token] - logsumexp(logits[allowed])`.

Temperature, top-p and greedy change how the token is *picked*, never the reported
log-prob. This is exactly what the trainer recomputes with a forward pass over
prompt + response (applying the same per-step mask for constrained turns).

Stopping
--------
A row stops when it emits an end-of-sequence token of the model or one of its
`stop_token_ids` (finish_reason "stop"; the stop token *is* included in `token_ids`, with its
log-prob), when it has produced `max_new_tokens` tokens ("length"), or, for a constrained row,
when its tokens spell a complete choice ("choice"). A constrained row ignores
`max_new_tokens` and stop tokens: its response is always exactly one whole choice.
No choice may be a proper prefix of another, and none may be empty.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "GenInput",
    "GenOutput",
    "GenerationEngine",
    "AsyncEngine",
    "EngineAborted",
    "EngineUnavailable",
    "FINISH_INTERRUPTED",
    "PAUSE_MODES",
    "FINISH_STOP",
    "FINISH_LENGTH",
    "FINISH_CHOICE",
    "validate_choices",
    "save_weights",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CHOICE = "choice"


@dataclass
class GenInput:
    """One generation request (one turn)."""

    prompt_ids: list[int]
    """Token ids of the prompt (chat template already applied). Must be non-empty."""
    max_new_tokens: int = 32
    """Most tokens to generate for a free row. Ignored by constrained rows."""
    temperature: float = 1.0
    """Sampling temperature; <= 0 means greedy. Does not change the reported log-probs."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]. Does not change the reported log-probs."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end the response (the model's eos tokens always do)."""
    choices: list[list[int]] | None = None
    """If given, the response is exactly one of these token sequences."""
    greedy: bool = False
    """Pick the most likely (allowed) token at each step."""
    session: str = ""
    """An opaque key of the conversation this input continues (the trajectory id). Engines
    that keep a KV cache per session reuse it when the prompt extends the cached tokens;
    empty: no reuse. Never changes the tokens or log-probs, only the work done."""


@dataclass
class GenOutput:
    """The result for one `GenInput`."""

    token_ids: list[int]
    """Generated tokens (including a final stop/eos token when finish_reason is "stop")."""
    logprobs: list[float]
    """Per-token log-prob at temperature 1 over the allowed tokens (see module docstring)."""
    finish_reason: str
    """"stop" | "length" | "choice" (| "interrupted" in :class:`EngineAborted`)."""
    version: int = -1
    """Policy version of the weights that produced the tokens (set by an :class:`AsyncEngine`;
    -1 from a :class:`GenerationEngine`, whose caller knows the version)."""


def validate_choices(choices: list[list[int]]) -> None:
    """Raise ValueError unless `choices` is a non-empty list of non-empty token sequences
    none of which is a proper prefix of another (duplicates are allowed)."""
    if not choices:
        raise ValueError("choices must not be empty")
    seqs = {tuple(int(t) for t in c) for c in choices}
    if any(len(s) == 0 for s in seqs):
        raise ValueError("a choice must have at least one token")
    ordered = sorted(seqs)
    # In lexicographic order a sequence is immediately followed by its extensions, if any.
    for a, b in zip(ordered, ordered[1:]):
        if b[: len(a)] == a:
            raise ValueError(f"choice {list(a)} is a prefix of choice {list(b)}")


class GenerationEngine(abc.ABC):
    """A batched, synchronous generator for one policy.

    `version` is the policy version of the weights currently loaded (0 for the initial
    weights). Implementations are not thread-safe: one `generate` or `load_weights` at a time.
    """

    version: int = 0
    applies_adapters: bool = False
    """Whether `load_weights` applies a LoRA adapter file over the base (``trainer.lora``)."""
    partial_loads: bool = False
    """Whether `load_weights` takes ``changed=`` (the names of the only tensors that differ
    from the weights held) and reads the file only inside the call (so a streamed delta may be
    patched into the staged file in place, :mod:`rollart.engines.weight_decode`)."""

    @abc.abstractmethod
    def generate(self, inputs: list[GenInput]) -> list[GenOutput]:
        """Generate a response for every input; outputs are in input order.

        An engine may take a keyword ``stop_rows``: a collection of input indices that
        another thread adds to while the call runs; a row found in it at a decode step ends
        there with :data:`FINISH_INTERRUPTED` and its partial output (the torch engine does;
        :class:`~rollart.engines.batched.BatchedEngine` uses it to abort running requests).
        """

    @abc.abstractmethod
    def load_weights(self, path: str | Path, version: int) -> None:
        """Load a full state dict from a safetensors file and set `version`.

        Raises (and leaves the current weights and version untouched) if the file is
        unreadable or its names or shapes do not match the model.
        """

    def state_dict_bytes(self) -> bytes:
        """The current weights as safetensors bytes (optional)."""
        raise NotImplementedError

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that always end a free response."""
        return ()

    def close(self) -> None:
        """Release resources (optional)."""


FINISH_INTERRUPTED = "interrupted"
"""An :class:`AsyncEngine` stopped the row before it finished (``abort`` or an ``interrupt``
pause): :class:`EngineAborted` carries what it generated so far."""


class EngineAborted(RuntimeError):
    """``AsyncEngine.generate`` of a request that :meth:`AsyncEngine.abort` (or a pause with
    ``mode="abort"``) stopped. ``partial`` holds the tokens and log-probs generated so far
    (``finish_reason`` :data:`FINISH_INTERRUPTED`), all under ``partial_version``; the LLMProxy
    continues an interrupted turn from them under the new weights (``proxy.on_update:
    interrupt``)."""

    def __init__(self, request_id: str, partial: GenOutput | None = None,
                 partial_version: int = 0) -> None:
        super().__init__(f"request {request_id} was aborted")
        self.request_id = request_id
        self.partial = partial or GenOutput([], [], FINISH_INTERRUPTED)
        self.partial_version = partial_version


class EngineUnavailable(RuntimeError):
    """``AsyncEngine.generate`` of a request that the engine could not finish because its
    server went away (it died and is being restarted, ``proxy.engine: vllm-server``): the
    work is not wrong, only this replica cannot do it now; the LLMProxy answers
    "unavailable", so the requester sends the turn again."""


PAUSE_MODES = ("wait", "abort")


class AsyncEngine(abc.ABC):
    """A per-request, asynchronous generator: what the LLMProxy drives (``proxy.engine``).

    Requests arrive one at a time from many trajectories; the engine batches them as it likes
    (continuous batching in vLLM and SGLang; a gather window in :class:`BatchedEngine` around
    a synchronous :class:`GenerationEngine`). Outputs follow the log-prob contract and the
    stopping rules of this module's docstring. ``version`` is the policy version of the loaded
    weights. All methods are called from one event loop.
    """

    version: int = 0
    vocab_size: int | None = None
    """Tokens the model embeds (a prompt or choice id at or above it is refused), if known."""
    applies_adapters: bool = False
    """Whether :meth:`load_weights` applies a LoRA adapter file (``PolicyPublished.kind``
    ``lora``, ``trainer.lora``) over the base weights; the proxy refuses adapters otherwise."""
    partial_loads: bool = False
    """Whether `load_weights` takes ``changed=`` and reads a file only inside the call (see
    :attr:`GenerationEngine.partial_loads`). vLLM and SGLang do not: they link the staged
    file into their weights folder and reload it whole; loading part of it would take their
    per-tensor update path (``update_weights_from_tensor`` / ``load_weights`` of named
    tensors) and a staged file they no longer link."""

    async def start(self) -> None:
        """Load the model and start serving (may take minutes); called once, before anything
        else. The default does nothing (an engine built ready)."""

    @abc.abstractmethod
    async def generate(self, inp: GenInput, request_id: str) -> GenOutput:
        """Generate one response. ``request_id`` is unique among the requests in flight.
        Raises :class:`EngineAborted` (with the partial output) if :meth:`abort` or a
        ``pause(mode="abort")`` stopped it, ``ValueError`` for an input it cannot serve."""

    @abc.abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (ids not in flight are ignored): their ``generate`` raises
        :class:`EngineAborted` soon after, with what they produced so far (one that completed
        before the abort took effect may still return its output normally)."""

    @abc.abstractmethod
    async def pause(self, mode: str = "wait") -> None:
        """Stop starting new work (new requests queue until :meth:`resume`). ``wait``: return
        once every request in flight has finished; ``abort``: abort every request in flight
        (:class:`EngineAborted` with their partial outputs) and return once they stopped.
        Requests the engine had not started yet may either stay queued for after
        :meth:`resume` or be aborted with an empty partial output."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Serve again after :meth:`pause` (queued requests start under the current weights)."""

    @abc.abstractmethod
    async def load_weights(self, source: str | Path | bytes, version: int) -> None:
        """Load a full state dict, a safetensors file (path) or its bytes, and set ``version``.
        Checks names and shapes first: on a mismatch it raises ``ValueError`` and keeps the
        current weights and version (and keeps serving). Callers pause around it."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that always end a free response."""
        return ()

    async def close(self) -> None:
        """Stop serving and release resources (processes, memory)."""


def save_weights(state_dict: dict[str, Any], path: str | Path) -> Path:
    """Write a torch state dict to a safetensors file atomically (temp file + rename).

    Tensors are copied to contiguous CPU tensors first, so tied (shared) parameters are
    written as separate entries and `load_weights(strict)` finds every name.
    """
    import torch  # optional dependency
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {
        k: v.detach().to("cpu").contiguous().clone()
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor)
    }
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return path
