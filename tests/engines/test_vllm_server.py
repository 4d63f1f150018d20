"""``proxy.engine: vllm-server`` (:mod:`rollart.engines.vllm_server_engine`) on vLLM's CPU build.

The engine contract suite runs for it too (``test_engine_contract.py``). Here: the same
greedy requests give the same tokens and log-probs as the in-process ``vllm`` engine; a
weight update changes the outputs and the server confirms its version; a server killed -9
mid-generation fails its requests as unavailable and is started again, and later requests
succeed on the weights loaded before; the LLMProxy's node stopping, and the node's process
killed -9, leave no server process; a LoRA version (``kind: lora``) is served as a vLLM
adapter, gives the merged model's outputs, replaces the previous adapter, and one whose
digest does not match is refused. Starting a server takes 50-100 s on this machine, so the
tests that need no process of their own share the session's (``vllm_server`` in
``tests/engines/conftest.py``, LoRA on, which the contract suite's ``vllm-server`` case
started). Needs vLLM (``make test-vllm``); skipped without it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

from rollart.engines import build_engine
from rollart.engines.base import EngineUnavailable, GenInput
from rollart.engines.vllm_server import server_command
from tests.engines.conftest import VLLM_SERVER_ARGS
from tests.waiting import until, until_sync

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (make test-vllm)")

PROMPTS = ["SFFF\nFHFH\nFFFH\nHFFG", "What is 3 + 4 ?", "L",
           "You are on a frozen lake . Reach the goal G without falling into a hole H .",
           "Push every box onto a target ."]
ARGS = {"max_model_len": 2048}
TOL = 1e-4


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the name (state first); [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return []


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    st = _stat(pid)
    return bool(st) and st[0] != "Z"


def group(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group ``pgid``."""
    out = []
    for p in os.listdir("/proc"):
        st = _stat(p) if p.isdigit() else []
        if st and st[0] != "Z" and int(st[2]) == pgid:
            out.append(int(p))
    return out


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture
def srv(vllm_server):
    """The session's server (``tests/engines/conftest.py``, LoRA on), shared with the
    contract suite."""
    return vllm_server


def test_bad_engine_args_are_refused_before_anything_starts(tiny_model_dir):
    with pytest.raises(ValueError, match="set by the vllm-server engine itself"):
        build_engine("vllm-server", str(tiny_model_dir), engine_args={"port": 8000})
    with pytest.raises(ValueError, match="attaches to http://127.0.0.1:1"):
        build_engine("vllm-server", str(tiny_model_dir),
                     engine_args={"url": "http://127.0.0.1:1", "max_model_len": 64})
    cmd = server_command(tiny_model_dir, port=1234, args={"max_model_len": 64})
    assert "--api-key" not in cmd and "--logprobs-mode" in cmd and "127.0.0.1" in cmd


@pytest.mark.timeout(900)  # two server starts: 50-90 s each on this machine under load
async def test_a_server_killed_mid_generation_restarts_and_the_node_stop_leaves_none(
        memory_bus_only, tiny_model_dir, prompts, tmp_path):
    from safetensors.torch import load_file, save_file

    from rollart.actors.generate.proxy import LLMProxy
    from rollart.node import Node
    from tests.actors.sample_actors import new_run

    proxy = LLMProxy(run=new_run(), name="gen-0", model_dir=str(tiny_model_dir),
                     engine="vllm-server", engine_args={**ARGS, "enable_lora": True,
                                                        "max_lora_rank": 8})
    async with Node(memory_bus_only, [proxy], heartbeat_every=0):
        eng = proxy.async_engine
        sd = load_file(str(tiny_model_dir / "model.safetensors"))
        save_file({k: v * 1.5 if v.dim() == 2 else v for k, v in sd.items()},
                  str(tmp_path / "w.safetensors"))
        _lora_version(tiny_model_dir, 3, tmp_path / "a.safetensors")
        await eng.pause("wait")  # full weights, then an adapter over them: both come back
        await eng.load_weights(tmp_path / "w.safetensors", 6)
        await eng.load_weights(tmp_path / "a.safetensors", 7)
        await eng.resume()
        assert eng.adapter is not None
        probe = GenInput(prompts[1], max_new_tokens=8, greedy=True)
        want = await eng.generate(probe, "probe-0")
        first = eng.proc.pid
        assert group(first), "the server's process group"
        long = [asyncio.ensure_future(eng.generate(GenInput(p, max_new_tokens=1500, greedy=True),
                                                   f"long{k}")) for k, p in enumerate(prompts)]
        await until(lambda: all(r.active and r.sid for r in eng._reqs.values())
                    and len(eng._reqs) == len(long), deadline=60, what="requests in the server")
        os.kill(first, signal.SIGKILL)
        results = await asyncio.gather(*long, return_exceptions=True)
        assert any(isinstance(r, EngineUnavailable) for r in results), results
        assert all(isinstance(r, EngineUnavailable) or r.token_ids for r in results), results
        await until(lambda: eng.restarts == 1 and eng.serving, deadline=600,
                    what="the server started again")
        second = eng.proc.pid
        assert second != first and not alive(first) and not group(first)
        again = await eng.generate(probe, "probe-1")
        assert again.token_ids == want.token_ids and again.version == 7
        assert eng.adapter is not None, "the adapter is served again"
        assert again.logprobs == pytest.approx(want.logprobs, abs=TOL)
    await until(lambda: not alive(second) and not group(second), deadline=30,
                state=lambda: group(second), what="the node stopped: its server gone")


@pytest.mark.timeout(600)
def test_the_node_killed_minus_9_leaves_no_server(tiny_model_dir):
    code = ("import asyncio, sys\n"
            "from rollart.engines import build_engine\n"
            "async def main():\n"
            f"    e = build_engine('vllm-server', {str(tiny_model_dir)!r}, engine_args={ARGS!r})\n"
            "    await e.start()\n"
            "    print(e.proc.pid, flush=True)\n"
            "    await asyncio.Event().wait()\n"
            "asyncio.run(main())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env,
                             text=True)
    try:
        line = child.stdout.readline()  # the server's pid once it is healthy
        assert line.strip().isdigit(), f"the child exited: {child.wait()}"
        server = int(line)
        assert alive(server)
        child.kill()
        child.wait()
        until_sync(lambda: not group(server), deadline=60, state=lambda: group(server),
                   what="the server and its EngineCore (its process group) to exit")
    finally:
        if child.poll() is None:
            child.kill()


# -- the session's server (tests/engines/conftest.py) for the tests below
async def test_a_call_without_the_key_is_refused_on_every_path(srv):
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(srv.url + "/health") as r:
            assert r.status == 401
        for path in ("/collective_rpc", "/pause", "/update_weight_version",
                     "/inference/v1/generate"):
            async with s.post(srv.url + path, json={}) as r:
                assert r.status == 401, path


async def test_the_same_greedy_tokens_and_logprobs_as_in_process_vllm(srv, prompts,
                                                                      tiny_model_dir):
    inputs = [GenInput(p, max_new_tokens=24, greedy=True) for p in prompts]
    actions = [[t] for t in prompts[2][:1]] + [[prompts[1][0]], [prompts[1][1]]]
    choice_in = [GenInput(p, choices=actions, greedy=True) for p in prompts]
    bulk = [GenInput(prompts[i % len(prompts)], max_new_tokens=32, greedy=True)
            for i in range(64)]
    got = [await srv.generate(i, f"s{k}") for k, i in enumerate(inputs + choice_in)]
    t0 = time.monotonic()
    outs = await asyncio.gather(*(srv.generate(i, f"sb{k}") for k, i in enumerate(bulk)))
    srv_s, srv_n = time.monotonic() - t0, sum(len(o.token_ids) for o in outs)
    ref = build_engine("vllm", str(tiny_model_dir), seed=0, threads=1,
                       engine_args={k: v for k, v in VLLM_SERVER_ARGS.items()
                                    if "lora" not in k})
    await ref.start()
    try:
        want = [await ref.generate(i, f"r{k}") for k, i in enumerate(inputs + choice_in)]
        t0 = time.monotonic()
        outs = await asyncio.gather(*(ref.generate(i, f"rb{k}") for k, i in enumerate(bulk)))
        ref_s, ref_n = time.monotonic() - t0, sum(len(o.token_ids) for o in outs)
    finally:
        await ref.close()
    print(f"\n64 x 32 greedy tokens: vllm-server {srv_n / srv_s:.0f} tok/s ({srv_s:.2f} s), "
          f"in-process vllm {ref_n / ref_s:.0f} tok/s ({ref_s:.2f} s)")
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=TOL)


async def test_a_weight_update_changes_outputs_and_the_server_confirms_its_version(
        srv, prompts, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tiny_model_dir / "model.safetensors"))
    new = {k: v * 1.5 if k.endswith("weight") and v.dim() == 2 else v for k, v in sd.items()}
    save_file(new, str(tmp_path / "new.safetensors"))
    inputs = [GenInput(p, max_new_tokens=12, greedy=True) for p in prompts]
    before = [await srv.generate(i, f"w{k}") for k, i in enumerate(inputs)]
    v = srv.version + 3
    await srv.pause("abort")
    try:
        await srv.load_weights(tmp_path / "new.safetensors", v)
    finally:
        await srv.resume()
    print(f"\nvllm-server weight update: {srv.last_load_s:.2f} s")
    assert srv.version == v
    after = [await srv.generate(i, f"x{k}") for k, i in enumerate(inputs)]
    assert all(o.version == v for o in after)
    assert max(abs(a - b) for x, y in zip(after, before)
               for a, b in zip(x.logprobs, y.logprobs)) > 1e-2, "the new weights serve"
    info = await srv._call("GET", "/weight_info")
    assert f'"{v}"' in info.decode()
    await srv.pause("wait")  # back to the model folder's weights, from bytes
    try:
        await srv.load_weights((tiny_model_dir / "model.safetensors").read_bytes(), v + 1)
    finally:
        await srv.resume()
    again = [await srv.generate(i, f"y{k}") for k, i in enumerate(inputs)]
    assert [o.token_ids for o in again] == [o.token_ids for o in before]


def _lora_version(model_dir, seed: int, path, merged_path=None) -> str:
    """A LoRA version as the trainer publishes it (the adapter file, rank 4, every
    projection, B random so that it changes the model), and optionally the same model's
    merged full weights; returns the adapter's content digest."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rollart.config.trainer import LORA_TARGETS
    from rollart.engines import lora
    from rollart.engines.digest import file_content_digest

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    peft_model = lora.wrap_model(model, rank=4, alpha=8.0, targets=LORA_TARGETS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    save_file(lora.adapter_tensors(peft_model), str(path),
              metadata=lora.adapter_metadata(4, 8.0, LORA_TARGETS))
    if merged_path is not None:
        save_file({k: v.contiguous() for k, v in lora.merged_tensors(peft_model).items()},
                  str(merged_path))
    return file_content_digest(path)


@pytest.mark.timeout(300)
async def test_a_lora_version_is_served_as_an_adapter_and_a_bad_digest_is_refused(
        srv, memory_bus_only, prompts, tiny_model_dir, tmp_path):
    from rollart import messages as m
    from rollart.actors.generate.proxy import LLMProxy
    from rollart.actors.kernel.policy import set_policy
    from rollart.bus.codec import encode
    from rollart.node import Node
    from tests.actors.sample_actors import new_run

    bus, run = memory_bus_only, new_run()
    a1, a2, merged = (tmp_path / n for n in ("a1.safetensors", "a2.safetensors", "m.safetensors"))
    d1, d2 = _lora_version(tiny_model_dir, 1, a1), _lora_version(tiny_model_dir, 2, a2, merged)
    print(f"\nbytes per version: LoRA rank 4 {a1.stat().st_size}, merged full "
          f"{merged.stat().st_size}")

    async def publish(version, path, digest):
        pub = m.PolicyPublished(version=version, uri=path.resolve().as_uri(), digest=digest,
                                kind="lora")
        await bus.publish(m.subject(run, "policy.published"), encode(pub))
        await set_policy(bus, run, pub)

    async def served():
        return (await srv._call("GET", "/v1/models")).decode()

    inputs = [GenInput(p, max_new_tokens=12, greedy=True) for p in prompts]
    before = [await srv.generate(i, f"lb{k}") for k, i in enumerate(inputs)]
    v = srv.version + 10
    proxy = LLMProxy(run=run, name="gen-lora", model_dir=str(tiny_model_dir),
                     engine="vllm-server", engine_obj=srv)
    async with Node(bus, [proxy], heartbeat_every=0):
        follow = proxy.policy_follow  # no retry after a backoff: only announcements count
        follow.first_retry = follow.max_retry = 3600.0
        await until(lambda: proxy.gate.held is not None, deadline=60,
                    what="the proxy following the policy (it sees every record)")
        await publish(v, a1, d1)
        await until(lambda: proxy.version == v, deadline=120, what="the first adapter loaded")
        print(f"vllm-server LoRA load: {srv.last_load_s:.2f} s")
        first, first_dir = srv.adapter, srv._adapter_dir
        assert first and first_dir.parent == srv._wdir and first in await served()
        one = [await srv.generate(i, f"l1{k}") for k, i in enumerate(inputs)]
        assert all(o.version == v for o in one)
        assert max(abs(a - b) for x, y in zip(one, before)
                   for a, b in zip(x.logprobs, y.logprobs)) > 1e-2, "the adapter serves"

        await publish(v + 1, a2, d1)  # the second adapter announced with the first's digest
        await until(lambda: any(k[0] == v + 1 for k in proxy.policy_follow.refused),
                    deadline=60, what="the mismatched version refused")
        assert proxy.version == v and srv.adapter == first, "the first adapter keeps serving"
        from safetensors.torch import load_file, save_file

        from rollart.engines.weight_files import read_metadata

        bad = load_file(str(a1))  # an adapter of another model: refused before the server
        k = next(n for n in bad if ".lora_A." in n)
        bad[k] = bad[k][:, :-1].contiguous()
        save_file(bad, str(tmp_path / "bad.safetensors"), metadata=read_metadata(a1))
        await srv.pause("wait")
        try:
            with pytest.raises(ValueError, match="does not match the model"):
                await srv.load_weights(tmp_path / "bad.safetensors", v + 1)
        finally:
            await srv.resume()
        assert srv.version == v and srv.adapter == first

        await publish(v + 2, a2, d2)
        await until(lambda: proxy.version == v + 2, deadline=120, what="the second adapter")
        assert srv.adapter != first and first not in await served(), "the first is unloaded"
        assert not first_dir.exists() and srv.adapter in await served()
    two = [await srv.generate(i, f"l2{k}") for k, i in enumerate(inputs)]
    await srv.pause("wait")  # the same model as merged full weights
    try:
        await srv.load_weights(merged, v + 3)
    finally:
        await srv.resume()
    assert srv.adapter is None and srv.version == v + 3
    full = [await srv.generate(i, f"l3{k}") for k, i in enumerate(inputs)]
    for x, y in zip(two, full):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=TOL)
    await srv.pause("wait")  # back to the base
    try:
        await srv.load_weights(tiny_model_dir / "model.safetensors", v + 4)
    finally:
        await srv.resume()
