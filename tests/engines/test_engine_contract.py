"""The AsyncEngine contract, one suite for every engine ``proxy.engine`` names.

Each engine is built with ``build_engine(name, <tiny model>)`` once per module (vLLM takes
~30-45 s to start) and must: answer free rows with valid token ids whose log-probs equal a
plain forward pass over prompt + response (what the trainer recomputes) to 1e-4; answer
constrained rows with exactly one choice, log-probs renormalised over the allowed tokens;
include stop tokens; respect ``max_new_tokens``; decode greedily the same way every time;
answer 64 concurrent requests; raise :class:`EngineAborted` with a prefix of the response
for an aborted request and for every request in flight at ``pause("abort")``; serve new
weights (and their version) after ``pause`` / ``load_weights`` / ``resume``; refuse a file of
the wrong shape with ``ValueError`` and keep serving the old weights.

vLLM runs where it is installed (its CPU build works here), in-process (``vllm``) and as a
server the engine launches (``vllm-server``); SGLang needs CUDA.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools

import pytest
import torch

from rollart.engines import build_engine
from rollart.engines.base import (
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    AsyncEngine,
    EngineAborted,
    GenInput,
    GenOutput,
    save_weights,
)
from rollart.engines.torch_engine import allowed_after

PROMPTS = [
    "SFFF\nFHFH\nFFFH\nHFFG",
    "What is 3 + 4 ?",
    "L",
    "You are on a frozen lake . Reach the goal G without falling into a hole H . Your action :",
    "Push every box onto a target .",
]
TOL = 1e-4
_ids = itertools.count()


def _unavailable(name: str) -> str | None:
    if name in ("vllm", "vllm-server") and importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'rollart[vllm]')"
    if name == "sglang":
        if not torch.cuda.is_available():
            return "sglang needs a CUDA GPU"
        if importlib.util.find_spec("sglang") is None:
            return "sglang is not installed"
    return None


ENGINE_ARGS = {"torch": {}, "vllm": {"dtype": "float32"}, "sglang": {"dtype": "float32"}}


@pytest.fixture(scope="module", params=["torch", "vllm", "vllm-server", "sglang"])
def engine_name(request):
    why = _unavailable(request.param)
    if why:
        pytest.skip(why)
    return request.param


@pytest.fixture(scope="module")
async def own_engine(engine_name, tiny_model):
    """An engine of this module's own (every engine but ``vllm-server``)."""
    e = build_engine(engine_name, str(tiny_model), seed=0, threads=1,
                     engine_args=ENGINE_ARGS[engine_name])
    assert isinstance(e, AsyncEngine)
    await e.start()
    try:
        yield e
    finally:
        await e.close()


@pytest.fixture(scope="module")
def eng(request, engine_name):
    """The engine under contract: ``vllm-server`` is the session's server
    (``tests/engines/conftest.py``, shared with ``test_vllm_server.py``); a sync fixture, so
    that pytest-asyncio may set up either async fixture from here."""
    return request.getfixturevalue("vllm_server" if engine_name == "vllm-server"
                                   else "own_engine")


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def ref(tiny_model):
    """The model as the trainer sees it: a plain transformers forward, float32."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, local_files_only=True)
    return m.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def weights(tiny_model, ref, tmp_path_factory):
    """Files of other weights: ``new`` (perturbed), ``orig`` (as bytes), ``bad`` (a wrong
    shape); and the reference model of ``new``."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("weights")
    sd = ref.state_dict()
    gen = torch.Generator().manual_seed(123)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sd.items()}
    bad = dict(sd)
    name = "model.embed_tokens.weight"
    bad[name] = torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1])
    new_ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                   local_files_only=True)
    new_ref.load_state_dict(new)
    return {"new": save_weights(new, d / "new.safetensors"),
            "orig": save_weights(sd, d / "orig.safetensors").read_bytes(),
            "bad": save_weights(bad, d / "bad.safetensors"),
            "new_ref": new_ref.eval().requires_grad_(False)}


def reference_logprobs(model, prompt, response, choices=None):
    """Log-probs of ``response`` after ``prompt`` from one forward pass at temperature 1,
    renormalised over the allowed tokens when constrained (what the trainer recomputes)."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    out = []
    for k, t in enumerate(response):
        row = logits[len(prompt) - 1 + k]
        if choices is not None:
            mask = torch.full_like(row, float("-inf"))
            mask[torch.tensor(allowed_after(choices, list(response[:k])))] = 0.0
            row = row + mask
        out.append(torch.log_softmax(row, -1)[t].item())
    return out


async def gen(e: AsyncEngine, inp: GenInput) -> GenOutput:
    return await e.generate(inp, f"r{next(_ids)}")


async def gen_all(e: AsyncEngine, inputs: list[GenInput]) -> list[GenOutput]:
    return list(await asyncio.gather(*(gen(e, i) for i in inputs)))


async def long_greedy(e: AsyncEngine, prompts) -> tuple[list[int], list[int]]:
    """A prompt whose greedy response runs to ``max_new_tokens`` (no eos) and that response."""
    outs = await gen_all(e, [GenInput(p, max_new_tokens=256, greedy=True) for p in prompts])
    for p, o in zip(prompts, outs):
        if o.finish_reason == "length":
            return p, o.token_ids
    pytest.skip("no prompt runs 256 greedy tokens without an eos on this model")


# -- outputs -----------------------------------------------------------------------------
async def test_free_rows_match_the_trainers_recompute(eng, prompts, ref):
    inputs = [GenInput(p, max_new_tokens=10, temperature=t, top_p=tp)
              for p in prompts for t, tp in ((1.0, 1.0), (1.3, 0.9))]
    outs = await gen_all(eng, inputs)
    vocab = eng.vocab_size or ref.config.vocab_size
    for inp, o in zip(inputs, outs):
        assert o.finish_reason in ("stop", "length")
        assert 1 <= len(o.token_ids) <= 10 and len(o.logprobs) == len(o.token_ids)
        assert all(0 <= t < vocab for t in o.token_ids)
        assert o.version == eng.version
        ref_lp = reference_logprobs(ref, inp.prompt_ids, o.token_ids)
        assert o.logprobs == pytest.approx(ref_lp, abs=TOL)


async def test_constrained_rows_are_one_whole_choice(eng, prompts, tok, ref):
    multi = [tok.encode(s, add_special_tokens=False)
             for s in ("<answer>L</answer>", "<answer>R</answer>", "12 + 34", "Push")]
    actions = [tok.encode(a, add_special_tokens=False) for a in "LDRU"]
    assert max(len(c) for c in multi) > 1
    inputs = []
    for i in range(20):
        p = prompts[i % len(prompts)]
        if i % 2:  # neither max_new_tokens nor stop tokens cut a constrained response
            inputs.append(GenInput(p, choices=multi, max_new_tokens=1,
                                   stop_token_ids=tuple(multi[0])))
        else:
            inputs.append(GenInput(p, choices=actions, greedy=i % 4 == 0))
    outs = await gen_all(eng, inputs)
    for inp, o in zip(inputs, outs):
        assert o.finish_reason == FINISH_CHOICE
        assert o.token_ids in inp.choices
        ref_lp = reference_logprobs(ref, inp.prompt_ids, o.token_ids, inp.choices)
        assert o.logprobs == pytest.approx(ref_lp, abs=TOL)


async def test_stop_tokens_end_the_response_and_are_included(eng, prompts):
    greedy = await gen_all(eng, [GenInput(p, max_new_tokens=12, greedy=True) for p in prompts])
    eos = set(eng.eos_token_ids)
    checked = 0
    for p, g in zip(prompts, greedy):
        ks = [k for k in range(1, len(g.token_ids))
              if g.token_ids[k] not in g.token_ids[:k] and g.token_ids[k] not in eos]
        if not ks:
            continue
        k = ks[0]
        o = await gen(eng, GenInput(p, max_new_tokens=12, greedy=True,
                                    stop_token_ids=(g.token_ids[k],)))
        assert o.finish_reason == "stop"
        assert o.token_ids == g.token_ids[:k + 1]
        assert o.logprobs == pytest.approx(g.logprobs[:k + 1], abs=TOL)
        checked += 1
    assert checked
    for g in greedy:  # an eos always stops, and is the last token
        if g.finish_reason == "stop":
            assert g.token_ids[-1] in eos and not set(g.token_ids[:-1]) & eos


async def test_max_new_tokens_is_respected(eng, prompts):
    inputs = [GenInput(p, max_new_tokens=n, temperature=1.0)
              for p in prompts for n in (1, 3, 7)]
    for inp, o in zip(inputs, await gen_all(eng, inputs)):
        assert 1 <= len(o.token_ids) <= inp.max_new_tokens
        if o.finish_reason == "length":
            assert len(o.token_ids) == inp.max_new_tokens


async def test_greedy_is_deterministic(eng, prompts):
    inputs = [GenInput(p, max_new_tokens=16, greedy=True) for p in prompts]
    a = await gen_all(eng, inputs)
    b = await gen_all(eng, inputs[::-1])  # other batch neighbours
    c = [await gen(eng, i) for i in inputs]  # one at a time
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]] == [o.token_ids for o in c]
    for x, y in zip(a, c):
        assert x.logprobs == pytest.approx(y.logprobs, abs=TOL)


async def test_64_concurrent_requests_are_all_answered(eng, prompts):
    inputs = [GenInput(prompts[i % len(prompts)], max_new_tokens=1 + i % 8, temperature=1.0)
              for i in range(64)]
    outs = await asyncio.wait_for(gen_all(eng, inputs), 300)
    assert len(outs) == 64
    for inp, o in zip(inputs, outs):
        assert 1 <= len(o.token_ids) <= inp.max_new_tokens
        assert len(o.logprobs) == len(o.token_ids)


async def test_a_bad_input_is_refused_alone(eng, prompts):
    with pytest.raises(ValueError):
        await gen(eng, GenInput([], max_new_tokens=3))
    with pytest.raises(ValueError):
        await gen(eng, GenInput(prompts[0], choices=[[5], [5, 6]]))  # a prefix of another
    ok = await gen(eng, GenInput(prompts[0], max_new_tokens=2))
    assert 1 <= len(ok.token_ids) <= 2


# -- abort and pause -----------------------------------------------------------------------
async def _started(task: asyncio.Task, wait: float = 0.3) -> None:
    await asyncio.sleep(wait)
    assert not task.done(), "the request finished before the test could stop it"


async def test_abort_stops_a_request_in_flight_with_its_partial_output(eng, prompts):
    p, full = await long_greedy(eng, prompts)
    task = asyncio.ensure_future(eng.generate(GenInput(p, max_new_tokens=1500, greedy=True),
                                              "to-abort"))
    await _started(task)
    await eng.abort(["to-abort", "unknown-id"])
    with pytest.raises(EngineAborted) as ei:
        await asyncio.wait_for(task, 60)
    e = ei.value
    assert e.request_id == "to-abort"
    part = e.partial
    assert part.finish_reason == FINISH_INTERRUPTED
    assert len(part.token_ids) < 1500 and len(part.logprobs) == len(part.token_ids)
    n = min(len(part.token_ids), len(full))
    assert part.token_ids[:n] == full[:n], "the partial output is a prefix of the response"
    assert e.partial_version == eng.version
    await eng.abort(["to-abort"])  # no longer in flight: ignored
    assert (await gen(eng, GenInput(p, max_new_tokens=4, greedy=True))).token_ids == full[:4]


async def test_pause_abort_stops_everything_in_flight(eng, prompts):
    p, full = await long_greedy(eng, prompts)
    tasks = [asyncio.ensure_future(eng.generate(GenInput(p, max_new_tokens=1500, greedy=True),
                                                f"pa{i}")) for i in range(3)]
    await _started(tasks[0])
    await asyncio.wait_for(eng.pause("abort"), 60)
    try:
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    finally:
        await eng.resume()
    for r in results:
        assert isinstance(r, EngineAborted), r
        n = min(len(r.partial.token_ids), len(full))
        assert r.partial.token_ids[:n] == full[:n]
    assert (await gen(eng, GenInput(p, max_new_tokens=4, greedy=True))).token_ids == full[:4]


# -- weights ------------------------------------------------------------------------------
async def test_pause_load_resume_serves_the_new_weights(eng, prompts, ref, weights):
    inputs = [GenInput(p, max_new_tokens=8, greedy=True) for p in prompts]
    before = await gen_all(eng, inputs)
    v0 = eng.version
    await eng.pause("wait")
    queued = asyncio.ensure_future(gen(eng, inputs[0]))  # waits for resume
    await asyncio.sleep(0.2)
    assert not queued.done()
    try:
        await eng.load_weights(weights["new"], v0 + 5)
    finally:
        await eng.resume()
    assert eng.version == v0 + 5
    first = await asyncio.wait_for(queued, 60)
    after = await gen_all(eng, inputs)
    assert first.token_ids == after[0].token_ids and first.version == v0 + 5
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    for inp, o in zip(inputs, after):
        assert o.version == v0 + 5
        ref_lp = reference_logprobs(weights["new_ref"], inp.prompt_ids, o.token_ids)
        assert o.logprobs == pytest.approx(ref_lp, abs=TOL)
    # back to the original weights, from bytes
    await eng.pause("wait")
    try:
        await eng.load_weights(weights["orig"], v0 + 6)
    finally:
        await eng.resume()
    again = await gen_all(eng, inputs)
    assert eng.version == v0 + 6 and all(o.version == v0 + 6 for o in again)
    assert [o.token_ids for o in again] == [o.token_ids for o in before]


async def test_a_wrong_shape_is_refused_and_the_old_weights_serve_on(eng, prompts, weights):
    inputs = [GenInput(p, max_new_tokens=6, greedy=True) for p in prompts]
    before = await gen_all(eng, inputs)
    v = eng.version
    await eng.pause("wait")
    try:
        with pytest.raises(ValueError):
            await eng.load_weights(weights["bad"], v + 1)
    finally:
        await eng.resume()
    assert eng.version == v
    after = await gen_all(eng, inputs)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert all(o.version == v for o in after)
