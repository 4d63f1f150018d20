"""Token-level chat bookkeeping: prompts are appended as ids, history is never re-tokenised."""

from __future__ import annotations

from pathlib import Path

_A, _U = "\x00ASSISTANT\x00", "\x00USER\x00"

CACHE_ENTRIES = 4096
"""Prompts (their ids) a :class:`ChatFormat` keeps, oldest dropped first."""
CACHE_MAX_CHARS = 4096
"""Longer texts are encoded every time (a cache of them would mostly hold misses)."""


class ChatFormat:
    """Renders turns with the tokenizer's chat template, one delta at a time.

    ``first_prompt`` renders system + first user message + generation prompt.
    ``next_prompt`` renders only what follows a generated response: the end of the
    assistant turn (unless the response already ended with it), the next user message
    and the generation prompt. Decoding the concatenated ids gives the same text as
    rendering the whole conversation at once.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": _A}]
        a = self.render(msgs, generation_prompt=False)
        b = self.render(msgs + [{"role": "user", "content": _U}], generation_prompt=True)
        tail = b[a.index(_A) + len(_A):]
        self._before_user, self._after_user = tail.split(_U)
        self._eos_ids = {i for i in (tokenizer.eos_token_id,) if i is not None}
        self._eos_text = tokenizer.eos_token or ""
        # A fast tokenizer's Rust backend gives the same ids and text at about half the cost
        # per call (transformers' encode wraps it in a batch of one): this runs every turn of
        # every trajectory, on the EnvManager's event loop.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "split_special_tokens", False):
            self._backend = None  # transformers toggles the backend for that: keep its path
        # The ids of recent prompts, by their text (next turns) or (system, user) (first
        # turns): envs repeat observations (a fixed map has a few states), and the encoding of
        # a text never changes, so a hit gives the ids the tokenizer would.
        self._cache: dict[object, tuple[int, ...]] = {}

    @classmethod
    def load(cls, model_dir: str | Path) -> "ChatFormat":
        from transformers import AutoTokenizer  # optional: the train extra

        return cls(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))

    @property
    def fast(self) -> bool:
        """Whether encode and decode call the fast tokenizer's Rust backend directly."""
        return self._backend is not None

    def user_turn(self, user: str) -> str:
        """The text after an assistant turn: its end, the user's message, the generation prompt."""
        return self._before_user + user + self._after_user

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        if self._backend is not None and not getattr(self.tok, "clean_up_tokenization_spaces", False):
            return self._backend.decode(ids, skip_special_tokens=skip_special)
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def _cached(self, key: object, size: int, make) -> list[int]:
        if size > CACHE_MAX_CHARS:
            return make()
        ids = self._cache.get(key)
        if ids is None:
            if len(self._cache) >= CACHE_ENTRIES:
                del self._cache[next(iter(self._cache))]
            ids = self._cache[key] = tuple(make())
        return list(ids)  # the caller's own list: the cached ids never change

    def first_prompt(self, system: str, user: str) -> list[int]:
        def make() -> list[int]:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return self.encode(self.render(msgs, generation_prompt=True))

        return self._cached(("first", system, user), len(system) + len(user), make)

    def after_reply(self, response_ids: list[int], text: str) -> str:
        """``text`` (what the template renders after an assistant turn's content) without
        the end-of-turn token when the generated ``response_ids`` already end with it."""
        if response_ids and response_ids[-1] in self._eos_ids and self._eos_text \
                and text.startswith(self._eos_text):
            return text[len(self._eos_text):]
        return text

    def next_prompt(self, response_ids: list[int], user: str) -> list[int]:
        text = self.after_reply(response_ids, self._before_user) + user + self._after_user
        return self._cached(text, len(text), lambda: self.encode(text))
