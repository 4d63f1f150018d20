"""TorchGenerationEngine: batching, stopping, constrained decoding, log-probs, weights."""

from __future__ import annotations

import pytest
import torch

from rollart.engines.base import GenerationEngine, GenInput, GenOutput, save_weights
from rollart.engines.torch_engine import TorchGenerationEngine, allowed_after

PROMPTS = [
    "SFFF\nFHFH\nFFFH\nHFFG",
    "What is 3 + 4 ?",
    "L",
    "You are on a frozen lake . Reach the goal G without falling into a hole H . Your action :",
    "Push every box onto a target .",
]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def actions(tiny_tokenizer):
    return [tiny_tokenizer.encode(a, add_special_tokens=False) for a in "LDRU"]


def reference_logprobs(model, prompt, response, choices=None):
    """Log-probs of `response` after `prompt` from one plain forward pass (no cache, no
    padding), at temperature 1, renormalised over the allowed tokens when constrained."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    out = []
    for k, t in enumerate(response):
        row = logits[len(prompt) - 1 + k]
        if choices is not None:
            allowed = torch.tensor(allowed_after(choices, list(response[:k])))
            mask = torch.full_like(row, float("-inf"))
            mask[allowed] = 0.0
            row = row + mask
        out.append(torch.log_softmax(row, -1)[t].item())
    return out


def new_engine(model_dir, **kw):
    kw.setdefault("threads", 1)
    return TorchGenerationEngine(model_dir, **kw)


def test_is_an_engine_and_shapes(engine, prompts):
    assert isinstance(engine, GenerationEngine)
    assert engine.version == 0
    assert engine.eos_token_ids  # from the model's generation config
    outs = engine.generate([GenInput(p, max_new_tokens=7) for p in prompts])
    assert len(outs) == len(prompts)
    for o in outs:
        assert isinstance(o, GenOutput)
        assert 1 <= len(o.token_ids) <= 7
        assert len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 1e-6 for lp in o.logprobs)
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "length":
            assert len(o.token_ids) == 7
        else:
            assert o.token_ids[-1] in engine.eos_token_ids
            assert not set(o.token_ids[:-1]) & set(engine.eos_token_ids)
    assert engine.generate([]) == []
    zero = engine.generate([GenInput(prompts[0], max_new_tokens=0)])[0]
    assert zero == GenOutput([], [], "length")


def test_batched_greedy_equals_one_at_a_time(engine, prompts):
    # Different prompt lengths (left padding) and different max_new_tokens (rows leave the
    # batch at different steps) must not change any row.
    inputs = [
        GenInput(p, max_new_tokens=n, greedy=True) for p, n in zip(prompts, [12, 3, 9, 12, 1])
    ]
    inputs += [GenInput(prompts[3], max_new_tokens=12, greedy=True)]  # duplicate row
    batched = engine.generate(inputs)
    for inp, b in zip(inputs, batched):
        alone = engine.generate([inp])[0]
        assert b.token_ids == alone.token_ids
        assert b.finish_reason == alone.finish_reason
        assert b.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_free_logprobs_match_plain_forward(engine, prompts):
    outs = engine.generate([GenInput(p, max_new_tokens=10, temperature=1.3, top_p=0.9) for p in prompts])
    model = engine.model
    for p, o in zip(prompts, outs):
        ref = reference_logprobs(model, p, o.token_ids)
        assert o.logprobs == pytest.approx(ref, abs=1e-4)


def test_stop_tokens_stop_each_row_independently(engine, prompts):
    greedy = engine.generate([GenInput(p, max_new_tokens=10, greedy=True) for p in prompts])
    inputs, expect = [], []
    for p, g in zip(prompts, greedy):
        k = 3 if len(g.token_ids) > 3 else 0
        stop = g.token_ids[k]
        first = g.token_ids.index(stop)
        inputs.append(GenInput(p, max_new_tokens=10, greedy=True, stop_token_ids=(stop,)))
        expect.append(g.token_ids[: first + 1])
    outs = engine.generate(inputs)
    for o, e in zip(outs, expect):
        assert o.token_ids == e
        assert o.finish_reason == "stop"


def test_eos_always_stops(tiny_model_dir, prompts):
    eng = new_engine(tiny_model_dir, seed=3)
    outs = eng.generate([GenInput(prompts[i % 5], max_new_tokens=40) for i in range(40)])
    eos = set(eng.eos_token_ids)
    stopped = 0
    for o in outs:
        hits = [k for k, t in enumerate(o.token_ids) if t in eos]
        if hits:
            assert hits == [len(o.token_ids) - 1] and o.finish_reason == "stop"
            stopped += 1
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 40
    assert 0 < stopped < len(outs)  # some rows stopped early, others ran on


def test_constrained_choices_mixed_batch(engine, prompts, actions, tiny_tokenizer):
    multi = [
        tiny_tokenizer.encode(s, add_special_tokens=False)
        for s in ("<answer>L</answer>", "<answer>R</answer>", "12 + 34", "Push")
    ]
    assert max(len(c) for c in multi) > 1
    inputs = []
    for i in range(24):
        p = prompts[i % len(prompts)]
        if i % 3 == 0:
            inputs.append(GenInput(p, choices=actions, temperature=1.0))
        elif i % 3 == 1:
            # max_new_tokens and stop tokens do not cut a constrained response short
            inputs.append(GenInput(p, choices=multi, max_new_tokens=1, stop_token_ids=tuple(multi[0])))
        else:
            inputs.append(GenInput(p, max_new_tokens=6))
    outs = engine.generate(inputs)
    model = engine.model
    seen = set()
    for inp, o in zip(inputs, outs):
        if inp.choices is None:
            assert o.finish_reason in ("stop", "length")
            ref = reference_logprobs(model, inp.prompt_ids, o.token_ids)
        else:
            assert o.finish_reason == "choice"
            assert o.token_ids in inp.choices
            seen.add(tuple(o.token_ids))
            ref = reference_logprobs(model, inp.prompt_ids, o.token_ids, inp.choices)
        assert o.logprobs == pytest.approx(ref, abs=1e-4)
    assert len(seen) >= 3  # sampling over choices does not always pick the same one


def test_constrained_greedy_picks_best_allowed(engine, prompts, actions):
    outs = engine.generate([GenInput(p, choices=actions, greedy=True) for p in prompts])
    model = engine.model
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            row = model(torch.tensor([p])).logits[0, -1]
        allowed = torch.tensor([a[0] for a in actions])
        best = allowed[row[allowed].argmax()].item()
        assert o.token_ids == [best]
        lp = torch.log_softmax(row[allowed], -1).max().item()
        assert o.logprobs[0] == pytest.approx(lp, abs=1e-4)


def test_bad_choices_raise(engine, prompts):
    with pytest.raises(ValueError):
        engine.generate([GenInput(prompts[0], choices=[[5], [5, 6]])])  # prefix
    with pytest.raises(ValueError):
        engine.generate([GenInput(prompts[0], choices=[])])
    with pytest.raises(ValueError):
        engine.generate([GenInput(prompts[0], choices=[[10**6]])])
    with pytest.raises(ValueError):
        engine.generate([GenInput([], max_new_tokens=3)])


def test_determinism(tiny_model_dir, prompts):
    inputs = [GenInput(p, max_new_tokens=8, temperature=1.0) for p in prompts] * 2
    a = new_engine(tiny_model_dir, seed=7).generate(inputs)
    b = new_engine(tiny_model_dir, seed=7).generate(inputs)
    c = new_engine(tiny_model_dir, seed=8).generate(inputs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    g = [GenInput(p, max_new_tokens=8, greedy=True) for p in prompts]
    e1, e2 = new_engine(tiny_model_dir, seed=1), new_engine(tiny_model_dir, seed=2)
    assert [o.token_ids for o in e1.generate(g)] == [o.token_ids for o in e2.generate(g)]
    # temperature <= 0 and a vanishing top_p are greedy too
    ref = [o.token_ids for o in e1.generate(g)]
    t0 = [GenInput(p, max_new_tokens=8, temperature=0.0) for p in prompts]
    tp = [GenInput(p, max_new_tokens=8, top_p=1e-6) for p in prompts]
    assert [o.token_ids for o in e1.generate(t0)] == ref
    assert [o.token_ids for o in e1.generate(tp)] == ref


def test_load_weights(tiny_model_dir, tmp_path, prompts):
    eng = new_engine(tiny_model_dir)
    g = [GenInput(p, max_new_tokens=8, greedy=True) for p in prompts]
    before = eng.generate(g)
    original = eng.state_dict_bytes()

    gen = torch.Generator().manual_seed(123)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in eng.model.state_dict().items()}
    path = save_weights(sd, tmp_path / "v3.safetensors")
    eng.load_weights(path, version=3)
    assert eng.version == 3
    after = eng.generate(g)
    assert [o.logprobs for o in after] != [o.logprobs for o in before]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]

    # bytes round trip back to the original weights
    (tmp_path / "v0.safetensors").write_bytes(original)
    eng.load_weights(tmp_path / "v0.safetensors", version=4)
    again = eng.generate(g)
    assert [o.token_ids for o in again] == [o.token_ids for o in before]
    assert eng.version == 4


def test_bad_weight_files_raise_and_change_nothing(tiny_model_dir, tmp_path, prompts):
    eng = new_engine(tiny_model_dir)
    g = [GenInput(p, max_new_tokens=6, greedy=True) for p in prompts]
    before = eng.generate(g)
    sd = {k: v.clone() for k, v in eng.model.state_dict().items()}

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    missing_key = dict(sd)
    dropped = sorted(missing_key)[0]
    missing_key.pop(dropped)
    extra_key = dict(sd, **{"extra.weight": torch.zeros(2)})
    wrong_shape = dict(sd)
    name = "model.embed_tokens.weight"
    wrong_shape[name] = torch.zeros(wrong_shape[name].shape[0] + 1, wrong_shape[name].shape[1])
    # a partially valid file: the first tensors are fine and changed, one is wrong
    partial = {k: v + 1.0 for k, v in sd.items()}
    partial["lm_head.weight"] = torch.zeros(3, 3)

    cases = [garbage, tmp_path / "does-not-exist.safetensors"]
    for i, bad in enumerate([missing_key, extra_key, wrong_shape, partial]):
        cases.append(save_weights(bad, tmp_path / f"bad{i}.safetensors"))
    for path in cases:
        with pytest.raises(ValueError):
            eng.load_weights(path, version=9)
        assert eng.version == 0
    after = eng.generate(g)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.logprobs for o in after] == [o.logprobs for o in before]
