"""A vLLM (v1) logits processor that restricts a request to one of N token-id sequences.

Loaded by vLLM's worker process by its path, ``rollart.engines.vllm_choices:ChoiceLogitsProcessor``
(``AsyncEngineArgs(logits_processors=[...])``); :class:`rollart.engines.vllm_engine.VllmEngine`
registers it. Per request: ``SamplingParams(extra_args={"rollart_choices": [[ids], ...],
"rollart_choice_end": id})``. At each step only the children of the choice trie after the
tokens generated so far are allowed; once a choice is complete only ``rollart_choice_end`` is
(a token in no choice that the request stops on; the engine strips it). Requests without
``rollart_choices`` are untouched.

vLLM's raw log-probs are taken before logits processors, so they ignore this mask: the engine
renormalises a constrained row's log-probs over the allowed tokens itself.

Imports vLLM at module level: import it only where vLLM is installed.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from .choice_trie import choice_trie

CHOICES_KEY = "rollart_choices"
END_KEY = "rollart_choice_end"

__all__ = ["CHOICES_KEY", "END_KEY", "ChoiceLogitsProcessor"]


class ChoiceLogitsProcessor(AdapterLogitsProcessor):
    """Masks every token but the allowed continuations of the request's choices."""

    @classmethod
    def validate_params(cls, params) -> None:
        extra = params.extra_args or {}
        choices = extra.get(CHOICES_KEY)
        if choices is None:
            return
        if not choices or any(len(c) == 0 for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty token-id lists")
        if END_KEY not in extra:
            raise ValueError(f"{CHOICES_KEY} needs {END_KEY}")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        extra = params.extra_args or {}
        choices = extra.get(CHOICES_KEY)
        if not choices:
            return None
        trie = choice_trie(choices)
        end = int(extra[END_KEY])
        index_cache: dict[tuple[int, ...], torch.Tensor] = {}

        def constrain(output_ids, logits: torch.Tensor) -> torch.Tensor:
            node = trie
            for t in output_ids:
                node = node.get(t)
                if node is None:  # cannot happen while the mask holds; allow only the end
                    break
            key = tuple(node) if node else (end,)
            idx = index_cache.get(key)
            if idx is None:
                idx = index_cache[key] = torch.tensor(key, dtype=torch.long, device=logits.device)
            out = torch.full_like(logits, float("-inf"))
            out[idx] = logits[idx]
            return out

        return constrain
