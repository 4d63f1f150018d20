"""LLMProxy around an AsyncEngine: ``proxy.on_update`` (finish / interrupt: a partial rollout
that keeps each token's version) and group cancels that abort requests in flight."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart import messages as m
from rollart.actors.kernel.base import RemoteError
from rollart.actors.generate.proxy import LLMProxy
from rollart.bus.codec import encode
from rollart.node import Node
from tests.actors.sample_actors import collect, new_run
from tests.e2e.test_weight_sync import perturbed_weights, publish
from tests.waiting import until, until_sync

torch = pytest.importorskip("torch")

STEP_S = 0.01
"""Extra seconds per decode step of the slow engine: a long generation stays in flight."""


def slow_engine(model_dir, hold_at: int | None = None):
    """A torch engine whose every decode step takes ``STEP_S`` more (the same tokens); it
    counts its decode steps (``steps``) and the rows of each call (``calls``). With
    ``hold_at``, decode step ``hold_at`` of a call waits until a row of it is stopped (an
    ``interrupt`` update or an abort reached it), so such an update lands mid-generation
    however slow the machine is."""
    from rollart.engines.torch_engine import TorchGenerationEngine

    class Slow(TorchGenerationEngine):
        steps = 0
        calls: list[int] = []

        def generate(self, inputs, stop_rows=None):
            self.calls = [*self.calls, len(inputs)]
            self._stop, self._call_steps = stop_rows, 0
            return super().generate(inputs, stop_rows=stop_rows)

        def _pick(self, *a, **kw):
            self.steps += 1
            self._call_steps += 1
            if self._call_steps == hold_at and len(self.calls) == 1:
                until_sync(lambda: self._stop, deadline=120, step=0.005,
                           what="an update to stop the rows of the first call")
            time.sleep(STEP_S)
            return super()._pick(*a, **kw)

    return Slow(model_dir, threads=1, seed=0)


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    return tok.encode("SFFF\nFHFH\nFFFH\nHFFG", add_special_tokens=False)


def reference_logprobs(model_dir, weights, prompt, response):
    """Log-probs of ``response`` after ``prompt`` under ``weights`` (None: the model's own)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    if weights is not None:
        model.load_state_dict(load_file(str(weights)))
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + k, t].item() for k, t in enumerate(response)]


def request(traj_id: str, prompt: list[int], n: int) -> m.GenerateRequest:
    return m.GenerateRequest(traj_id=traj_id, prompt_ids=prompt, greedy=True,
                             sampling=m.SamplingParams(max_new_tokens=n),
                             request_id=f"req-{traj_id}")


async def _update_mid_generation(bus, run, proxy, engine, tiny_model, tmp_path, prompt, n=150):
    """Start a long generation, publish v1 once it has decoded a few tokens; return (result,
    v1 file)."""
    w1 = tmp_path / "v1.safetensors"
    digest = perturbed_weights(tiny_model, w1, 0.3)
    pending = asyncio.ensure_future(proxy.request("generate.request",
                                                  request("g000000-0", prompt, n), timeout=120))
    await until(lambda: engine.steps >= 5 or pending.done(), deadline=60,
                what="the generation to decode a few tokens")
    assert not pending.done()
    await publish(bus, run, 1, w1, digest)
    res = await asyncio.wait_for(pending, 120)
    loaded = await collect(bus, run, "policy.loaded", 1, deadline=30)
    assert loaded and loaded[0].version == 1 and not loaded[0].error
    return res, w1


async def test_interrupt_continues_on_the_new_weights_token_by_token(memory_bus_only, tiny_model,
                                                                     tmp_path, prompt):
    bus, run = memory_bus_only, new_run()
    engine = slow_engine(tiny_model, hold_at=10)
    proxy = LLMProxy(run=run, name="gen-0", model_dir=str(tiny_model), on_update="interrupt",
                     engine_obj=engine)
    async with Node(bus, [proxy], heartbeat_every=0):
        res, w1 = await _update_mid_generation(bus, run, proxy, engine, tiny_model, tmp_path,
                                               prompt)
        assert proxy.version == 1 and proxy.interrupted >= 1
    n = len(res.token_ids)
    assert res.finish_reason in ("length", "stop") and 0 < n <= 150, (res.finish_reason, n)
    assert len(res.logprobs) == n and len(res.token_versions) == n
    k = res.token_versions.index(1)
    assert 0 < k < n, "tokens from both versions"
    assert res.token_versions == [0] * k + [1] * (n - k), "versions in order, never back"
    assert res.version == 1
    # each token's log-prob is its own version's: v0 for the prefix, v1 after it
    old = reference_logprobs(tiny_model, None, prompt, res.token_ids[:k])
    new = reference_logprobs(tiny_model, w1, prompt, res.token_ids)
    assert res.logprobs[:k] == pytest.approx(old, abs=1e-4)
    assert res.logprobs[k:] == pytest.approx(new[k:], abs=1e-4)
    m.validate(res)


async def test_finish_lets_the_request_end_on_the_old_weights(memory_bus_only, tiny_model, tmp_path,
                                                               prompt):
    bus, run = memory_bus_only, new_run()
    engine = slow_engine(tiny_model)
    proxy = LLMProxy(run=run, name="gen-0", model_dir=str(tiny_model), on_update="finish",
                     engine_obj=engine)
    async with Node(bus, [proxy], heartbeat_every=0):
        res, _ = await _update_mid_generation(bus, run, proxy, engine, tiny_model, tmp_path,
                                              prompt)
        assert proxy.version == 1 and proxy.interrupted == 0
    assert len(res.token_ids) == 150 and res.version == 0 and res.token_versions == []
    ref = reference_logprobs(tiny_model, None, prompt, res.token_ids)
    assert res.logprobs == pytest.approx(ref, abs=1e-4)


async def test_a_cancelled_group_aborts_its_requests_in_flight(memory_bus_only, tiny_model, prompt):
    bus, run = memory_bus_only, new_run()
    engine = slow_engine(tiny_model)
    proxy = LLMProxy(run=run, name="gen-0", model_dir=str(tiny_model), gather_ms=100,
                     engine_obj=engine)
    async with Node(bus, [proxy], heartbeat_every=0):
        # one batch: the cancelled rows would run 1000 steps (>= 10 s); the others 20
        lengths = {"g000001-0": 20, "g000001-1": 1000, "g000001-2": 1000, "g000002-1": 20,
                   "g000001-r1-1": 20}
        calls = {t: asyncio.ensure_future(proxy.request("generate.request",
                                                        request(t, prompt, n), timeout=120))
                 for t, n in lengths.items()}
        await until(lambda: engine.steps > 0, deadline=60, what="the generations to start",
                    state=lambda: f"engine calls {engine.calls}")
        await bus.publish_core(m.subject(run, "rollout.cancel"),
                               encode(m.CancelGroup(group_id="g000001", keep=["g000001-0"])))
        for t in ("g000001-1", "g000001-2"):  # cancelled: their rows stop, answered unavailable
            with pytest.raises(RemoteError, match="cancelled"):
                await asyncio.wait_for(calls[t], 60)
        assert engine.steps < 1000, "aborted, not run to the end"
        for t in ("g000001-0", "g000002-1", "g000001-r1-1"):  # kept, other groups: served
            res = await asyncio.wait_for(calls[t], 120)
            assert len(res.token_ids) == 20
        assert proxy.batcher.sizes == [len(lengths)] and engine.calls == [len(lengths)]
        # a late request of a cancelled trajectory is refused at once
        with pytest.raises(RemoteError, match="cancelled"):
            await proxy.request("generate.request", request("g000001-2", prompt, 4), timeout=30)
        assert not proxy.in_flight and not proxy.aborting


async def test_engine_occupancy_reaches_the_node_heartbeat(memory_bus_only, tiny_model, prompt):
    """``<replica>.engine.*`` in the node's stats (what its heartbeats carry): calls, rows,
    rows per call against requests waiting, busy seconds."""
    bus, run = memory_bus_only, new_run()
    proxy = LLMProxy(run=run, name="gen-0", model_dir=str(tiny_model), gather_ms=50)
    async with Node(bus, [proxy], heartbeat_every=0) as node:
        outs = await asyncio.gather(*(
            proxy.request("generate.request", request(f"g000001-{i}", prompt, 2), timeout=60)
            for i in range(3)))
        assert all(len(o.token_ids) == 2 for o in outs)
        st = node.stats()
    b = proxy.batcher
    assert st["gen-0.engine.batches"] == b.batches >= 1
    assert st["gen-0.engine.rows"] == 3
    assert st["gen-0.engine.mean_rows"] == pytest.approx(3 / b.batches)
    assert st["gen-0.engine.busy_s"] > 0
