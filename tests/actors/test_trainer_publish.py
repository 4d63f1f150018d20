"""The trainer's WeightPublisher: weights by content; a published version's file is never rewritten."""

from __future__ import annotations

import pytest

from rollart import messages as m
from rollart.actors.kernel.policy import content_digest, current_policy, fetch_weights, file_content_digest
from rollart.config import RunConfig, convert
from rollart.node.build import training_actors
from tests.actors.sample_actors import new_run


@pytest.mark.parametrize("weights", ["file", "object"])
async def test_publish_reuses_a_version_file_and_never_overwrites_it(bus, tiny_model, tmp_path, weights):
    import torch

    run = new_run()
    cfg = convert({"run": run, "run_dir": str(tmp_path / "runs"), "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "frozenlake"}},
                   "trainer": {"steps": 2, "weights": weights, "sync": {"format": "file"}}},
                  RunConfig)
    _, trainer, _ = training_actors(cfg)
    trainer.bus = bus
    await trainer.setup()
    from rollart.node import ensure_run_streams

    await ensure_run_streams(bus, run)

    await trainer.weights.publish()
    pub = await current_policy(bus, run)
    path = tmp_path / "runs" / run / "weights" / "v000000.safetensors"
    stat = path.stat()
    assert pub.version == 0 and pub.digest == file_content_digest(path) == trainer.backend.weights_digest()
    assert pub.uri.startswith("obj://" if weights == "object" else "file://")
    assert await fetch_weights(bus, pub)

    await trainer.weights.publish()  # announced again (a resume): the same file, the same digest
    again = await current_policy(bus, run)
    assert (again.digest, again.uri) == (pub.digest, pub.uri)
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_ino == stat.st_ino

    with torch.no_grad():  # other tensors under the same version: a new file, the old one kept
        next(trainer.backend.model.parameters()).add_(1.0)
    old_bytes = path.read_bytes()
    await trainer.weights.publish()
    moved = await current_policy(bus, run)
    assert moved.version == 0 and moved.digest == trainer.backend.weights_digest() != pub.digest
    assert moved.uri != pub.uri and path.read_bytes() == old_bytes
    data = await fetch_weights(bus, moved)
    assert content_digest(data) == moved.digest
    files = sorted(p.name for p in path.parent.glob("v*.safetensors"))
    assert files[0].startswith("v000000-") and files[1] == "v000000.safetensors"
    if weights == "object":
        store = await bus.object_store(m.object_bucket(run))
        assert content_digest(await store.get("v000000")) == pub.digest
