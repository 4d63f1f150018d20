"""VllmEngine (``proxy.engine: vllm``): the log-prob contract against the trainer's recompute,
constrained decoding, stopping, abort, pause, and in-place weight updates.

The engine tests need vLLM (``make test-vllm`` runs them in ``.venv-vllm``) and share one
engine per module (starting vLLM takes 30-60 s on CPU). The missing-vLLM message is checked
everywhere; the safetensors checks are in ``test_weight_files.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest
import torch

from rollart.engines import build_engine
from rollart.engines.base import AsyncEngine, EngineAborted, GenInput, GenOutput
from rollart.engines.torch_engine import allowed_after
from rollart.engines.vllm_engine import INSTALL_HINT

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make test-vllm)")

PROMPTS = [
    "SFFF\nFHFH\nFFFH\nHFFG",
    "What is 3 + 4 ?",
    "L",
    "You are on a frozen lake . Reach the goal G without falling into a hole H . Your action :",
    "Push every box onto a target .",
]
TOL = 1e-4


# ---------------------------------------------------------------------------- no vLLM needed
@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
async def test_without_vllm_a_clear_error(tiny_model_dir):
    eng = build_engine("vllm", str(tiny_model_dir), engine_args={"max_model_len": 256})
    with pytest.raises(RuntimeError) as e:
        await eng.start()
    assert str(e.value) == INSTALL_HINT


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def actions(tiny_tokenizer):
    return [tiny_tokenizer.encode(a, add_special_tokens=False) for a in "LDRU"]


@pytest.fixture(scope="module")
def weights(tiny_model_dir, tmp_path_factory):
    """Two safetensors files: A (the model folder's weights) and B (perturbed, with a 20x
    lm_head so that its distributions are peaked and differ clearly from A's)."""
    from safetensors.torch import load_file, save_file

    a = load_file(str(tiny_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    b = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in a.items()}
    b["lm_head.weight"] = b["lm_head.weight"] * 20
    d = tmp_path_factory.mktemp("vllm-weights")
    save_file(a, str(d / "a.safetensors"))
    save_file(b, str(d / "b.safetensors"))
    return {"A": d / "a.safetensors", "B": d / "b.safetensors", "dir": d}


@pytest.fixture(scope="module")
def trainers(tiny_model_dir, weights):
    """The trainer's recompute (TorchTrainBackend.token_logprobs) on weights A and B."""
    from safetensors.torch import load_file

    from rollart.engines.torch_trainer import TorchTrainBackend

    out = {}
    for name in ("A", "B"):
        tr = TorchTrainBackend(tiny_model_dir, threads=1)
        tr.model.load_state_dict(load_file(str(weights[name])))
        out[name] = tr
    return out


@pytest.fixture(scope="module")
async def vengine(tiny_model_dir):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm)")
    eng = build_engine("vllm", str(tiny_model_dir), seed=0, engine_args={"max_model_len": 1024})
    t0 = time.perf_counter()
    await eng.start()
    print(f"\n[vllm] engine start: {time.perf_counter() - t0:.1f} s")
    try:
        yield eng
    finally:
        await eng.close()


async def use(eng, weights, name: str, version: int) -> None:
    """Serve weights `name` (A or B) under `version` (cheap: ~0.1 s)."""
    if eng.version != version:
        await eng.load_weights(weights[name], version)
    assert eng.version == version


def recompute(tr, prompt, resp, choices=None) -> list[float]:
    """The trainer's log-probs of `resp` after `prompt` (renormalised when constrained)."""
    from rollart.engines.train_samples import TrainSample

    ids = list(prompt) + list(resp)
    allowed = None
    if choices is not None:
        allowed = [None] * len(prompt) + [allowed_after(choices, resp[:k]) for k in range(len(resp))]
    s = TrainSample(ids, [0] * len(prompt) + [1] * len(resp), [0.0] * len(ids), 0.0, allowed)
    return tr.token_logprobs([s])[0][len(prompt):].tolist()


async def gen_all(eng, inputs, prefix="r"):
    return await asyncio.gather(*(eng.generate(inp, f"{prefix}{i}") for i, inp in enumerate(inputs)))


# ---------------------------------------------------------------------------- the contract
@needs_vllm
async def test_is_an_async_engine(vengine, tiny_model_dir, prompts, weights):
    from rollart.engines.torch_engine import TorchGenerationEngine

    await use(vengine, weights, "A", 0)
    tor = TorchGenerationEngine(tiny_model_dir, threads=1)
    assert isinstance(vengine, AsyncEngine)
    assert vengine.eos_token_ids == tor.eos_token_ids and vengine.eos_token_ids
    assert vengine.vocab_size == tor.vocab_size == 512
    outs = await gen_all(vengine, [GenInput(p, max_new_tokens=7) for p in prompts])
    eos = set(vengine.eos_token_ids)
    for o in outs:
        assert isinstance(o, GenOutput) and o.version == 0
        assert 1 <= len(o.token_ids) <= 7 and len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 1e-6 for lp in o.logprobs)
        if o.finish_reason == "length":
            assert len(o.token_ids) == 7 and not set(o.token_ids) & eos
        else:
            assert o.finish_reason == "stop" and o.token_ids[-1] in eos
            assert not set(o.token_ids[:-1]) & eos
    assert await vengine.generate(GenInput(prompts[0], max_new_tokens=0), "zero") == GenOutput([], [], "length", 0)
    for bad in (GenInput([], max_new_tokens=3), GenInput([10**6]), GenInput(prompts[0], top_p=0.0),
                GenInput(prompts[0], choices=[[5], [5, 6]]), GenInput(prompts[0], choices=[]),
                GenInput(prompts[0], choices=[[10**6]]), GenInput(list(range(1, 400)) * 3)):
        with pytest.raises(ValueError):
            await vengine.generate(bad, "bad")


@needs_vllm
@pytest.mark.parametrize("name", ["A", "B"])
async def test_free_logprobs_equal_trainer_recompute(vengine, prompts, weights, trainers, name):
    await use(vengine, weights, name, 0 if name == "A" else 1)
    inputs = []
    for i, p in enumerate(prompts * 3):
        kw = [dict(temperature=1.0), dict(temperature=1.7, top_p=0.9), dict(temperature=0.4),
              dict(greedy=True)][i % 4]
        inputs.append(GenInput(p, max_new_tokens=12, **kw))
    outs = await gen_all(vengine, inputs)
    worst = 0.0
    for inp, o in zip(inputs, outs):
        ref = recompute(trainers[name], inp.prompt_ids, o.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(o.logprobs, ref)))
        assert o.logprobs == pytest.approx(ref, abs=TOL)
    print(f"[vllm] free rows on {name}: max |engine - trainer| = {worst:.2e}")


@needs_vllm
async def test_greedy_matches_torch_engine(vengine, tiny_model_dir, prompts, weights):
    from rollart.engines.torch_engine import TorchGenerationEngine

    await use(vengine, weights, "B", 1)  # peaked: no near-ties between the two engines' argmax
    tor = TorchGenerationEngine(tiny_model_dir, threads=1)
    tor.load_weights(weights["B"], 1)
    inputs = [GenInput(p, max_new_tokens=10, greedy=True) for p in prompts]
    want = tor.generate(inputs)
    got = await gen_all(vengine, inputs)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=TOL)
        assert g.version == 1
    # temperature <= 0 and a vanishing top_p are greedy too
    t0 = await gen_all(vengine, [GenInput(p, max_new_tokens=10, temperature=0.0) for p in prompts])
    tp = await gen_all(vengine, [GenInput(p, max_new_tokens=10, top_p=1e-6) for p in prompts])
    assert [o.token_ids for o in t0] == [o.token_ids for o in tp] == [o.token_ids for o in want]


@needs_vllm
async def test_constrained_rows_renormalised(vengine, prompts, actions, tiny_tokenizer, weights, trainers):
    await use(vengine, weights, "B", 1)
    multi = [tiny_tokenizer.encode(s, add_special_tokens=False)
             for s in ("<answer>L</answer>", "<answer>R</answer>", "12 + 34", "Push")]
    assert len({len(c) for c in multi}) > 1
    eos = list(vengine.eos_token_ids)
    with_eos = [a + [eos[0]] for a in actions]  # choices may contain the eos token
    inputs = []
    for i in range(30):
        p = prompts[i % len(prompts)]
        k = i % 5
        if k == 0:
            inputs.append(GenInput(p, choices=actions, temperature=1.0))
        elif k == 1:  # max_new_tokens and stop tokens do not cut a constrained response short
            inputs.append(GenInput(p, choices=multi, max_new_tokens=1, stop_token_ids=tuple(multi[0]),
                                   temperature=1.5))
        elif k == 2:
            inputs.append(GenInput(p, choices=with_eos, temperature=2.0, top_p=0.95))
        elif k == 3:
            inputs.append(GenInput(p, choices=multi, greedy=True))
        else:
            inputs.append(GenInput(p, max_new_tokens=6))
    outs = await gen_all(vengine, inputs)
    seen, worst = set(), 0.0
    for inp, o in zip(inputs, outs):
        if inp.choices is None:
            assert o.finish_reason in ("stop", "length")
        else:
            assert o.finish_reason == "choice" and o.token_ids in inp.choices
            seen.add(tuple(o.token_ids))
        ref = recompute(trainers["B"], inp.prompt_ids, o.token_ids, inp.choices)
        worst = max(worst, max(abs(a - b) for a, b in zip(o.logprobs, ref)))
        assert o.logprobs == pytest.approx(ref, abs=TOL)
    assert len(seen) >= 3
    print(f"[vllm] constrained + free rows: max |engine - trainer| = {worst:.2e}")
    # greedy picks the best allowed token
    tr = trainers["B"]
    for p in prompts:
        o = await vengine.generate(GenInput(p, choices=actions, greedy=True), "g")
        with torch.no_grad():
            row = tr.model(torch.tensor([p])).logits[0, -1]
        allowed = torch.tensor([a[0] for a in actions])
        assert o.token_ids == [allowed[row[allowed].argmax()].item()]


@needs_vllm
async def test_constrained_many_tokens_fallback(vengine, prompts, weights, trainers):
    # 150 single-token choices: more branching ids than vLLM returns log-probs for (128).
    await use(vengine, weights, "B", 1)
    choices = [[t] for t in range(3, 153)] + [[200, 201], [200, 202]]
    inputs = [GenInput(p, choices=choices, temperature=1.0) for p in prompts]
    outs = await gen_all(vengine, inputs)
    for inp, o in zip(inputs, outs):
        assert o.finish_reason == "choice" and o.token_ids in choices
        assert o.logprobs == pytest.approx(recompute(trainers["B"], inp.prompt_ids, o.token_ids, choices), abs=TOL)


@needs_vllm
async def test_stop_tokens_end_each_row(vengine, prompts, weights):
    await use(vengine, weights, "B", 1)
    greedy = await gen_all(vengine, [GenInput(p, max_new_tokens=10, greedy=True) for p in prompts])
    inputs, expect = [], []
    for p, g in zip(prompts, greedy):
        stop = g.token_ids[3 if len(g.token_ids) > 3 else 0]
        inputs.append(GenInput(p, max_new_tokens=10, greedy=True, stop_token_ids=(stop,)))
        expect.append(g.token_ids[: g.token_ids.index(stop) + 1])
    outs = await gen_all(vengine, inputs)
    for o, e, g in zip(outs, expect, greedy):
        assert o.token_ids == e and o.finish_reason == "stop"
        assert o.logprobs == pytest.approx(g.logprobs[: len(e)], abs=TOL)


@needs_vllm
async def test_sampling_is_random_and_seeded(vengine, prompts, weights):
    await use(vengine, weights, "A", 0)
    outs = await gen_all(vengine, [GenInput(prompts[1], max_new_tokens=8) for _ in range(8)])
    assert len({tuple(o.token_ids) for o in outs}) > 1  # each request draws its own seed


async def _abort_soon(eng, inputs, delay):
    tasks = [asyncio.ensure_future(eng.generate(inp, f"long{i}")) for i, inp in enumerate(inputs)]
    await asyncio.sleep(delay)
    await eng.abort([f"long{i}" for i in range(len(inputs))] + ["not-in-flight"])
    return await asyncio.gather(*tasks, return_exceptions=True)


@needs_vllm
async def test_abort_gives_partial(vengine, prompts, weights, trainers):
    await use(vengine, weights, "A", 0)
    inputs = [GenInput(prompts[i % 5], max_new_tokens=900) for i in range(16)]
    results = await _abort_soon(vengine, inputs, 0.8)  # 900 tokens each: still running then
    aborted = [r for r in results if isinstance(r, EngineAborted)]
    assert aborted and all(isinstance(r, (EngineAborted, GenOutput)) for r in results)
    eos = set(vengine.eos_token_ids)
    for e in aborted:
        part = e.partial
        assert e.partial_version == 0 and part.finish_reason == "interrupted"
        assert len(part.token_ids) == len(part.logprobs) < 900 and not set(part.token_ids) & eos
        inp = inputs[int(e.request_id[4:])]
        if part.token_ids:
            assert part.logprobs == pytest.approx(recompute(trainers["A"], inp.prompt_ids, part.token_ids), abs=TOL)
    # the engine serves on
    o = await vengine.generate(GenInput(prompts[0], max_new_tokens=3), "after")
    assert len(o.token_ids) >= 1


@needs_vllm
async def test_pause_wait_abort_resume(vengine, prompts, weights):
    await use(vengine, weights, "A", 0)
    # wait: in-flight requests finish under the old version; new ones queue until resume
    running = [asyncio.ensure_future(vengine.generate(GenInput(p, max_new_tokens=20), f"w{i}"))
               for i, p in enumerate(prompts)]
    await asyncio.sleep(0.05)
    await vengine.pause("wait")
    assert all(t.done() for t in running)
    assert all(t.result().version == 0 for t in running)
    queued = asyncio.ensure_future(vengine.generate(GenInput(prompts[0], max_new_tokens=4), "queued"))
    await vengine.load_weights(weights["B"], 1)
    assert not queued.done()
    await vengine.resume()
    # it waited for resume: it ran under the weights loaded meanwhile, not the old ones
    assert (await asyncio.wait_for(queued, 30)).version == 1
    # abort: in-flight requests raise EngineAborted under the old version
    long = [GenInput(prompts[i % 5], max_new_tokens=900) for i in range(8)]
    tasks = [asyncio.ensure_future(vengine.generate(inp, f"a{i}")) for i, inp in enumerate(long)]
    await asyncio.sleep(0.5)
    await vengine.pause("abort")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert any(isinstance(r, EngineAborted) for r in results)
    assert all(r.partial_version == 1 for r in results if isinstance(r, EngineAborted))
    # a request queued during the pause and aborted there raises at once, with nothing
    q2 = asyncio.ensure_future(vengine.generate(GenInput(prompts[0], max_new_tokens=4), "q2"))
    await asyncio.sleep(0.05)
    await vengine.abort(["q2"])
    with pytest.raises(EngineAborted) as e:
        await asyncio.wait_for(q2, 10)
    assert e.value.partial.token_ids == []
    await vengine.load_weights(weights["A"], 2)
    await vengine.resume()
    o = await vengine.generate(GenInput(prompts[0], max_new_tokens=4), "after-resume")
    assert o.version == 2


@needs_vllm
async def test_weight_update_in_place(vengine, prompts, weights, trainers):
    await use(vengine, weights, "A", 0)
    inputs = [GenInput(p, max_new_tokens=8, greedy=True) for p in prompts]
    before = await gen_all(vengine, inputs)
    t0 = time.perf_counter()
    await vengine.load_weights(weights["B"].read_bytes(), 7)  # bytes, as from the object store
    print(f"\n[vllm] load_weights (bytes) + prefix-cache reset: {time.perf_counter() - t0:.3f} s")
    assert vengine.version == 7
    after = await gen_all(vengine, inputs)  # same prompts: the prefix cache must not serve A's KV
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    for inp, o in zip(inputs, after):
        assert o.version == 7
        assert o.logprobs == pytest.approx(recompute(trainers["B"], inp.prompt_ids, o.token_ids), abs=TOL)
        assert o.logprobs != pytest.approx(recompute(trainers["A"], inp.prompt_ids, o.token_ids), abs=1e-2)
    await vengine.load_weights(weights["A"], 8)  # a path
    again = await gen_all(vengine, inputs)
    assert [o.token_ids for o in again] == [o.token_ids for o in before]
    for a, b in zip(again, before):
        assert a.logprobs == pytest.approx(b.logprobs, abs=TOL)


@needs_vllm
async def test_bad_weights_raise_and_engine_serves_on(vengine, prompts, weights, tmp_path):
    from safetensors.torch import load_file, save, save_file

    await use(vengine, weights, "B", 1)
    ref = await vengine.generate(GenInput(prompts[0], max_new_tokens=6, greedy=True), "ref")
    good = load_file(str(weights["A"]))
    wrong_shape = dict(good)
    wrong_shape["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    missing = {k: v for k, v in good.items() if "layers.1." not in k}
    extra = {**good, "model.extra.weight": torch.zeros(2)}
    save_file(wrong_shape, str(tmp_path / "wrong.safetensors"))
    cases = [tmp_path / "wrong.safetensors", save(wrong_shape), save(missing), save(extra),
             save(good)[:-100], b"not safetensors", tmp_path / "no-such-file.safetensors"]
    for bad in cases:
        with pytest.raises(ValueError):
            await vengine.load_weights(bad, 99)
        assert vengine.version == 1
    o = await vengine.generate(GenInput(prompts[0], max_new_tokens=6, greedy=True), "still")
    assert o.token_ids == ref.token_ids and o.version == 1
    assert o.logprobs == pytest.approx(ref.logprobs, abs=TOL)
