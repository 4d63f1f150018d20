"""ChatFormat's per-turn encode and decode take the fast tokenizer's backend directly; they
must give exactly what the transformers tokenizer gives (ids and text), special tokens and
odd text included, and fall back to the tokenizer where there is no backend."""

from __future__ import annotations

from rollart.actors.chat import ChatFormat

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
