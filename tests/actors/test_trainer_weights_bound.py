"""Weights in the object store stay bounded (issue 8 item 4): the trainer keeps as many
versions there as in its weights folder (``keep_weights``), and a model bigger than a
message (nats-server's default max_payload is 1 MB) travels chunked."""

from __future__ import annotations

import pytest

from rollart import messages as m
from rollart.actors.kernel.policy import content_digest, current_policy, fetch_weights
from rollart.config import RunConfig, convert
from rollart.node.build import training_actors
from rollart.node import ensure_run_streams
from tests.actors.sample_actors import new_run


async def test_object_store_keeps_only_the_kept_versions(bus, tiny_model, tmp_path):
    run = new_run()
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"), "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake"}},
                   "trainer": {"steps": 10, "weights": "object", "keep_weights": 2,
                               "sync": {"format": "file"}}}, RunConfig)
    _, trainer, _ = training_actors(cfg)
    trainer.bus = bus
    await trainer.setup()
    await ensure_run_streams(bus, run)
    store = await bus.object_store(m.object_bucket(run))
    for v in range(5):
        trainer.backend.version = v
        await trainer.weights.publish()
    pub = await current_policy(bus, run)
    data = await fetch_weights(bus, pub)
    assert pub.version == 4 and len(data) > 1024 * 1024  # more than one message holds
    assert content_digest(data) == pub.digest
    for v in range(5):
        if v >= 3:
            assert await store.get(f"v{v:06d}")
        else:
            with pytest.raises(KeyError):
                await store.get(f"v{v:06d}")
    files = sorted(p.name for p in (tmp_path / "runs" / run / "weights").glob("v*.safetensors"))
    assert files == ["v000003.safetensors", "v000004.safetensors"]
