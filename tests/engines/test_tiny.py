"""The tiny model builder: offline reload, tokenizer properties, chat template, caching."""

from __future__ import annotations

import json

import pytest
import torch


def test_reloads_offline_with_safe_tokenizer(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.model_type == "qwen3"
    vocab = model.config.vocab_size
    assert vocab == 512
    # transformers maps qwen3 to Qwen2Tokenizer, which adds tokens past a small vocab.
    assert type(tiny_tokenizer).__name__ != "Qwen2Tokenizer"
    assert len(tiny_tokenizer) <= vocab
    assert max(tiny_tokenizer.get_vocab().values()) < vocab
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.eos_token_id in list(model.generation_config.eos_token_id)
    # Every id the tokenizer can produce is embeddable.
    ids = tiny_tokenizer.encode("SFFF\nFHFH <answer>L</answer> 12 + 34 = 46 héllo ✓")
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    assert out.logits.shape == (1, len(ids), vocab)
    assert torch.isfinite(out.logits).all()


def test_actions_are_single_distinct_tokens(tiny_tokenizer):
    ids = []
    for a in ("L", "D", "R", "U"):
        for text in (a, " " + a):
            enc = tiny_tokenizer.encode(text, add_special_tokens=False)
            assert len(enc) == 1, (text, enc)
            assert tiny_tokenizer.decode(enc) == text
            ids.append(enc[0])
    assert len(set(ids)) == 8
    # In context the action stays its own token.
    enc = tiny_tokenizer.encode("<answer>R</answer>", add_special_tokens=False)
    assert tiny_tokenizer.convert_tokens_to_ids("R") in enc


def test_chat_template(tiny_tokenizer):
    msgs = [
        {"role": "system", "content": "You are on a frozen lake."},
        {"role": "user", "content": "SFFF\nFHFH\nFFFH\nHFFG\nYour action:"},
    ]
    text = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are on a frozen lake.<|im_end|>\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tiny_tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(ids) == tiny_tokenizer.encode(text, add_special_tokens=False)
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert list(ids).count(start) == 3 and list(ids).count(end) == 2
    assert tiny_tokenizer.decode(ids) == text
    no_prompt = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


def test_build_is_cached_and_keyed_by_args(tiny_model_dir, tmp_path):
    from rollart.engines.tiny import MANIFEST, build_tiny_model

    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    after = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    assert before == after
    assert json.loads((tiny_model_dir / MANIFEST).read_text())["vocab_size"] == 512

    # Other arguments in the same directory rebuild it.
    small = build_tiny_model(
        tmp_path / "m", hidden_size=64, num_layers=1, intermediate_size=64, corpus=["Tower of Hanoi"]
    )
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(small, local_files_only=True)
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (64, 1)
    build_tiny_model(small, hidden_size=64, num_layers=2, intermediate_size=64, corpus=["Tower of Hanoi"])
    cfg = AutoConfig.from_pretrained(small, local_files_only=True)
    assert cfg.num_hidden_layers == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_bad_args():
    from rollart.engines.tiny import build_tiny_model

    with pytest.raises(ValueError):
        build_tiny_model("/nonexistent/never", hidden_size=100, num_heads=3)
    with pytest.raises(ValueError):
        build_tiny_model("/nonexistent/never", vocab_size=100)
