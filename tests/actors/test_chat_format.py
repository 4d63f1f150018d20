"""ChatFormat's per-turn encode and decode take the fast tokenizer's backend directly; they
must give exactly what the transformers tokenizer gives (ids and text), special tokens and
odd text included, and fall back to the tokenizer where there is no backend."""

from __future__ import annotations

from rollart.actors.env.chat import ChatFormat

TEXTS = ["", "hello", "  two  spaces\n\nand lines\t", "Action: <answer>Left</answer>",
         "ünïcødé ✓ 漢字", "SFFF\nFHFH\nFFFH\nHFFG"]


class _SlowOnly:
    """A tokenizer without its fast backend (as a slow tokenizer has none)."""

    def __init__(self, tok):
        self.wrapped = tok

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def test_fast_path_gives_the_tokenizers_ids_and_text(tiny_model):
    chat = ChatFormat.load(tiny_model)
    assert chat.fast  # the locally built tokenizer is a fast one
    tok = chat.tok
    texts = TEXTS + [chat.user_turn(t) for t in TEXTS]
    texts.append((tok.eos_token or "") + "after the end")
    for text in texts:
        ids = chat.encode(text)
        assert ids == list(tok.encode(text, add_special_tokens=False)), text
        for skip in (True, False):
            assert chat.decode(ids, skip_special=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_without_a_backend_the_tokenizer_is_used(tiny_model):
    fast = ChatFormat.load(tiny_model)
    ids = fast.encode("Action: Left")
    chat = ChatFormat(_SlowOnly(fast.tok))
    assert not chat.fast
    assert chat.encode("Action: Left") == ids
    assert chat.decode(ids) == chat.tok.decode(ids, skip_special_tokens=True)


def _conversation(chat: ChatFormat, rng, turns: int) -> tuple[list[int], list[dict]]:
    """A multi-turn conversation the way the EnvManager builds it: the ids, and its messages."""
    maps = ["SFFF\nFHFH\nFFFH\nHFFG", "PFFF\nFHFH\nFFFH\nHFFG", "SFFF\nFHPH\nFFFH\nHFFG"]
    system = rng.choice(["FrozenLake", "Move with L, D, R or U."])
    user = rng.choice(maps) + "\nturn 1"
    ids = chat.first_prompt(system, user)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for turn in range(2, turns + 1):
        text = rng.choice(["L", "D", " R", "U\n", "Action: <answer>Left</answer>"])
        response = chat.encode(text)
        if rng.random() < 0.5 and chat.tok.eos_token_id is not None:
            response = response + [chat.tok.eos_token_id]  # a response that ended itself
        ids = ids + response
        msgs.append({"role": "assistant", "content": text})
        user = rng.choice(maps) + f"\nturn {turn}"
        ids = ids + chat.next_prompt(response, user)
        msgs.append({"role": "user", "content": user})
    return ids, msgs


def test_cached_prompts_are_token_identical_to_encoding_each_time(tiny_model, monkeypatch):
    """The prompt cache (first and next turns, keyed by their text) gives exactly the ids of
    encoding every prompt afresh, over many multi-turn conversations that repeat observations;
    a caller changing the list it got does not change what the cache gives next."""
    import random

    import rollart.actors.env.chat as chat_mod

    cached = ChatFormat.load(tiny_model)
    for seed in range(40):
        ids, msgs = _conversation(cached, random.Random(seed), turns=1 + seed % 8)
        with monkeypatch.context() as mp:
            mp.setattr(chat_mod, "CACHE_MAX_CHARS", -1)  # never cached: every prompt encoded
            fresh = ChatFormat.load(tiny_model)
            again, _ = _conversation(fresh, random.Random(seed), turns=1 + seed % 8)
            assert not fresh._cache
        assert ids == again, seed
        # the whole conversation, rendered at once, is the same text
        full = cached.render(msgs, generation_prompt=True)
        assert cached.decode(ids, skip_special=False) == full, seed
    assert cached._cache  # it did cache
    first = cached.first_prompt("FrozenLake", "SFFF\nFHFH\nFFFH\nHFFG\nturn 1")
    first.append(-1)
    assert cached.first_prompt("FrozenLake", "SFFF\nFHFH\nFFFH\nHFFG\nturn 1") == first[:-1]
