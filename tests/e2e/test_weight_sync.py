"""Weight sync as messages: every LLMProxy loads a published version; bad digests are refused."""

from __future__ import annotations

import time


from rollart import messages as m
from rollart.actors.llm_proxy import LLMProxy
from rollart.actors.policy import set_policy, sha256_digest
from rollart.node import Node
from tests.actors.sample_actors import collect, new_run


def perturbed_weights(model_dir, path, scale: float) -> str:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    g = torch.Generator().manual_seed(int(scale * 1000))
    sd = {k: (v + scale * torch.randn(v.shape, generator=g)).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(path))
    return sha256_digest(path.read_bytes())


async def publish(bus, run, version, path, digest):
    pub = m.PolicyPublished(version=version, uri=path.resolve().as_uri(), digest=digest)
    await bus.publish(m.subject(run, "policy.published"), __import__("rollart.bus.codec", fromlist=["encode"]).encode(pub))
    await set_policy(bus, run, pub)


async def generate(proxy, prompt):
    return await proxy.request("generate.request", m.GenerateRequest(
        traj_id="probe", prompt_ids=prompt, greedy=True,
        sampling=m.SamplingParams(max_new_tokens=4)), timeout=30)


async def test_every_proxy_loads_new_version_and_refuses_bad_digest(bus, tiny_model, tmp_path):
    run = new_run()
    proxies = [LLMProxy(run=run, name=f"gen-{i}", model_dir=str(tiny_model), seed=i) for i in range(2)]
    async with Node(bus, proxies, heartbeat_every=0):
        prompt = [1, 5, 6, 7, 8]
        before = await generate(proxies[0], prompt)
        assert before.version == 0
        w1 = tmp_path / "v1.safetensors"
        await publish(bus, run, 1, w1, perturbed_weights(tiny_model, w1, 0.5))
        loaded = await collect(bus, run, "policy.loaded", 2, deadline=30)
        assert sorted(x.replica for x in loaded) == ["gen-0", "gen-1"]
        assert all(x.version == 1 and not x.error for x in loaded)
        after = await generate(proxies[1], prompt)
        assert after.version == 1

        # a corrupted file: the digest no longer matches what was published
        w2 = tmp_path / "v2.safetensors"
        digest = perturbed_weights(tiny_model, w2, 0.7)
        w2.write_bytes(w2.read_bytes()[:-16] + b"\0" * 16)
        await publish(bus, run, 2, w2, digest)
        refused = (await collect(bus, run, "policy.loaded", 4, deadline=30))[2:]
        assert len(refused) == 2
        assert all("digest" in x.error and "refusing" in x.error for x in refused)
        assert all(p.version == 1 for p in proxies), "the old weights keep serving"
        still = await generate(proxies[0], prompt)
        assert still.version == 1 and still.token_ids == (await generate(proxies[1], prompt)).token_ids


async def test_request_for_newer_version_waits_for_the_load(memory_bus_only, tiny_model, tmp_path):
    bus, run = memory_bus_only, new_run()
    proxy = LLMProxy(run=run, model_dir=str(tiny_model))
    async with Node(bus, [proxy], heartbeat_every=0):
        import asyncio

        pending = asyncio.ensure_future(proxy.request("generate.request", m.GenerateRequest(
            traj_id="x", prompt_ids=[1, 5, 6], min_version=1,
            sampling=m.SamplingParams(max_new_tokens=2)), timeout=30))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.3:  # it must not be answered by v0 meanwhile
            assert not pending.done()
            await asyncio.sleep(0.02)
        w1 = tmp_path / "v1.safetensors"
        await publish(bus, run, 1, w1, perturbed_weights(tiny_model, w1, 0.1))
        res = await asyncio.wait_for(pending, 30)
        assert res.version == 1


async def test_weights_through_the_object_store(bus, tiny_model, tmp_path):
    run = new_run()
    proxy = LLMProxy(run=run, model_dir=str(tiny_model))
    async with Node(bus, [proxy], heartbeat_every=0):
        w1 = tmp_path / "v1.safetensors"
        digest = perturbed_weights(tiny_model, w1, 0.3)
        store = await bus.object_store(m.object_bucket(run))
        await store.put("v000001", w1.read_bytes())
        pub = m.PolicyPublished(version=1, uri=f"obj://{m.object_bucket(run)}/v000001", digest=digest)
        await set_policy(bus, run, pub)
        loaded = await collect(bus, run, "policy.loaded", 1, deadline=30)
        assert loaded[0].version == 1 and not loaded[0].error
        assert (await generate(proxy, [1, 5, 6])).version == 1
