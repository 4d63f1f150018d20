"""``trainer.sync.format: stream`` between real actors over a real nats-server: the trainer's
WeightPublisher streams anchors and deltas into the run's object store, an LLMProxy (torch
engine) assembles and loads each, reports ``pause_s``/``fetch_s``, and holds exactly the
trainer's tensors in the serving dtype."""

from __future__ import annotations

import msgspec
import pytest

from rollart import messages as m
from rollart.actors.generate.proxy import LLMProxy
from rollart.config import RunConfig, convert
from rollart.engines.weight_stream import Manifest
from rollart.node import Node, ensure_run_streams
from rollart.node.build import training_actors
from tests.actors.sample_actors import collect, new_run
from tests.waiting import until

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(("on_update", "weights"), [("finish", "object"), ("interrupt", "object"),
                                                    ("finish", "tcp")])
async def test_proxy_loads_streamed_anchors_and_deltas(nats_bus, tiny_model, tmp_path, on_update,
                                                       weights):
    bus, run = nats_bus, new_run()
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"), "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake"}}, "proxy": {"dtype": "bfloat16"},
                   "trainer": {"steps": 5, "weights": weights, "keep_weights": 2,
                               "sync": {"format": "stream", "bucket_mb": 0.05, "anchor_every": 3}}},
                  RunConfig)
    _, trainer, _ = training_actors(cfg)
    trainer.bus = bus
    await trainer.setup()
    await ensure_run_streams(bus, run)
    model = trainer.backend.model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    proxy = LLMProxy(run=run, name="gen-0", model_dir=str(tiny_model), dtype="bfloat16",
                     on_update=on_update)
    store = await bus.object_store(m.object_bucket(run))
    kinds = []
    async with Node(bus, [proxy], heartbeat_every=0):
        assert proxy.async_engine.engine.dtype == torch.bfloat16, "proxy.dtype reaches the engine"
        for v in range(6):
            if v == 5:  # one element of one tensor: a delta the proxy patches in place
                with torch.no_grad():
                    model.get_parameter("model.norm.weight").view(-1)[0] += 1.0
                trainer.backend.version = v
            elif v:  # a real optimizer step on the trainer's model
                ids = torch.randint(0, 300, (4, 16))
                model.train()
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                model.eval()
                trainer.backend.version = v
            await trainer.weights.publish()
            pub = await until(lambda v=v: _current(bus, run, v), deadline=30, what=f"v{v} announced")
            name = pub.uri.rsplit("/", 1)[1]
            if weights == "object":
                assert pub.layout == "stream" and pub.uri.startswith(f"obj://{m.object_bucket(run)}/")
                raw = await store.get(name)
            else:  # the trainer's weight server, on the loopback of a local NATS server
                srv = trainer.weights.stream.server
                # no token in what every role reads: it is in the weights store (issue 43)
                assert pub.uri == f"tcp://127.0.0.1:{srv.port}/{name}" and srv.token not in pub.uri
                from rollart.engines.weight_tcp import TOKEN_OBJECT

                assert bytes(await store.get(TOKEN_OBJECT)).decode() == srv.token
                raw = (trainer.files.weights / "stream" / name).read_bytes()
            man = msgspec.json.decode(raw, type=Manifest)
            kinds.append(man.kind)
            await until(lambda v=v: proxy.version == v, deadline=60, what=f"the proxy on v{v}")
            exp = {k: t.detach().to(torch.bfloat16) for k, t in trainer.backend.weight_tensors().items()}
            own = proxy.async_engine.engine.model.state_dict()
            assert all(torch.equal(own[k], exp[k]) for k in exp), f"v{v}: the engine holds the trainer's tensors"
            if v == 1:  # the model folder is no staged base: v1 came by the chain from v0
                assert proxy._stage.last.startswith("chain, 2 manifest(s)"), proxy._stage.last
            elif v == 5:  # the changed bucket only, and the engine loaded the changed tensor
                assert proxy._stage.last.startswith("patch, 1 manifest(s)"), proxy._stage.last
                assert man.stats.changed == 1 and proxy._stage.base.undo is None
            elif v > 1:
                assert proxy._stage.last.startswith("delta" if kinds[-1] == "delta" else "full")
        loaded = await collect(bus, run, "policy.loaded", 5, deadline=30)
        stage = proxy._stage.dir
        assert proxy._stage.base.version == 5 and proxy._stage.base.path.exists()
        from rollart.engines.weight_staging import SPARE

        # one base, and the previous one as the spare the next version is written over
        assert sorted(p.name for p in stage.iterdir()) == sorted([proxy._stage.base.path.name, SPARE])
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta"], kinds
    # v0 is the model folder's own weights: nothing to load
    assert [x.version for x in loaded] == [1, 2, 3, 4, 5] and not any(x.error for x in loaded)
    assert all(x.pause_s > 0 and x.fetch_s > 0 and x.load_s >= x.fetch_s for x in loaded), loaded
    assert [v for v, _ in proxy.pauses] == [1, 2, 3, 4, 5]
    assert trainer.weights.stream.last["stream_wire_ratio"] < 1.0
    for x in loaded:  # what the trainer's policy.loaded consumer hands its publisher
        trainer.weights.loaded(x)
    row = trainer.weights.sync_row(5)  # the metrics row of the step trained from v5
    assert row["sync_version"] == 5 and row["sync_replicas"] == 1, row
    assert row["sync_pause_s_max"] == loaded[-1].pause_s and row["stream_wire_ratio"] < 1.0, row
    assert trainer.weights.sync_row(0) == {}, "v0 is the model folder's: nothing travelled"
    # keep_weights 2: v4 and v5 kept, their anchor is v3, so v0..v2 are gone
    assert sorted(trainer.weights.stream.versions) == [3, 4, 5]
    assert not stage.exists(), "the staging folder goes with the proxy"
    if weights == "tcp":
        srv = trainer.weights.stream.server
        assert srv.served > 0
        port = srv.port
        await trainer.weights.close()  # the trainer's teardown stops its weight server
        from rollart.engines.weight_tcp_client import fetch_blob

        with pytest.raises(OSError, match="cannot reach the trainer's weight server"):
            fetch_blob("127.0.0.1", port, "t", "x", stall_s=2.0)


async def _current(bus, run, v):
    from rollart.actors.kernel.policy import current_policy

    pub = await current_policy(bus, run)
    return pub if pub is not None and pub.version == v else None


async def test_a_refused_patched_version_puts_the_held_file_back_and_the_next_load_is_whole(
        tiny_model, tmp_path):
    """The engine refused a delta patched into the held staged file: the file is the held
    version's again, byte for byte and by name, and the next version is loaded whole (the
    engine may hold part of the refused one)."""
    from rollart.actors.generate.policy import StreamStage
    from rollart.engines.weight_blobs import DirBlobs
    from rollart.engines.weight_decode import assemble_version
    from rollart.engines.weight_encode import TorchTensors, TrainerBase, write_version
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    blobs, pubs, base = DirBlobs(tmp_path / "store"), [], None
    for v in range(3):
        if v:
            with torch.no_grad():
                model.get_parameter("model.norm.weight").view(-1)[v] += 1.0
        out = tmp_path / f"t{v}.safetensors"
        man, name = await write_version(blobs, TorchTensors(dict(model.state_dict()), "bfloat16"),
                                        version=v, dtype="bfloat16", bucket_bytes=1 << 15,
                                        base=base, delta=True, anchor_every=8, base_out=out)
        base = TrainerBase(out, v, man.digest, man.anchor)
        pubs.append((man, name))
    stage = StreamStage("gen-0", in_place=True)
    try:
        got0, _ = await assemble_version(blobs, pubs[0][1], stage.dir, base=None,
                                         digest=pubs[0][0].digest)
        stage.loaded(got0)
        before = got0.path.read_bytes()
        got1, info = await assemble_version(blobs, pubs[1][1], stage.dir, base=stage.base,
                                            digest=pubs[1][0].digest, in_place=stage.in_place)
        assert info["path"] == "patch" and got1.changed == {"model.norm.weight"}
        stage.discard(got1)  # the engine refused v1
        assert got0.path.read_bytes() == before and not got1.path.exists()
        assert stage._whole, "the next load reads every tensor"
        got1b, _ = await assemble_version(blobs, pubs[1][1], stage.dir, base=stage.base,
                                          digest=pubs[1][0].digest, in_place=True)
        stage.loaded(got1b)
        assert stage.base.undo is None and stage.base.path == got1b.path and not stage._whole
    finally:
        stage.close()
