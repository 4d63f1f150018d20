"""Sharded trainer ranks (``trainer.shard: fsdp2``; gloo, real processes): world size 2 takes
the step of world size 1 for every loss aggregation with the clip on the global norm, each
rank holding half of the AdamW state; a version is gathered one tensor at a time; a
checkpoint resumes at world size 1, plain or sharded."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from rollart.algos.losses import LossConfig
from rollart.engines.digest import file_content_digest
from rollart.engines.rank_launch import start_ranks
from rollart.engines.torch_trainer import TorchTrainBackend, tensors_digest
from tests.engines.test_torch_trainer import _build, make_samples

torch.set_num_threads(1)
KW = {"lr": 1e-3, "grad_clip": 0.5, "threads": 1, "seed": 0, "micro_batch_tokens": 24}
"""Small micro-batches (the two ranks' shares take different numbers of them: the rank with
fewer back-propagates blank ones); a clip that binds (global norm)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("fsdp2_model"), tie=False)


@pytest.fixture(scope="module")
def sharded(model_dir, tmp_path_factory):
    b = start_ranks(model_dir, world_size=2, dist_timeout=30, shard="fsdp2",
                    log_dir=tmp_path_factory.mktemp("logs"), **KW)
    init = copy.deepcopy(TorchTrainBackend(model_dir, **KW).state_dict_for_checkpoint())
    yield b, init
    b.shutdown()
    assert all(p.returncode == 0 for p in b.procs.values()), "rank 1 stops cleanly on 'stop'"


def _close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        # a step moves weights by ~lr (1e-3); the ranks sum the gradient in another order
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_two_sharded_ranks_take_the_step_of_one(sharded, model_dir, agg):
    b, init = sharded
    b.load_checkpoint_state(copy.deepcopy(init))  # scattered into both ranks' shards
    single = TorchTrainBackend(model_dir, **KW)
    samples = make_samples(9, seed=3)  # odd: the ranks' shares differ in samples and micro-batches
    cfg = LossConfig(agg=agg, entropy_coef=0.01, is_cap=2.0)
    for step in range(2):  # the second step uses the AdamW moments of the first
        m1 = single.train_step(samples, loss_cfg=cfg)
        m2 = b.train_step(samples, loss_cfg=cfg)
        assert m2["world_size"] == 2 and m2["version"] == m1["version"] == step + 1
        assert m1["grad_norm"] > KW["grad_clip"], "the clip binds: it must use the global norm"
        for k in ("loss", "pg_loss", "entropy", "grad_norm", "ratio_mean", "tokens", "samples"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), (step, k)
    _close(dict(b.weight_tensors()), single.model.state_dict())
    full = sum(p.numel() for p in single.model.parameters())
    assert b.local_elements("params") == full // 2
    # AdamW's two moments: 2 x the parameters at world size 1, half of that on each rank
    assert b.local_elements("optimizer") == full
    assert sum(v.numel() for st in single.optimizer.state.values() for k, v in st.items()
               if k != "step") == 2 * full


@pytest.mark.timeout(180)
def test_a_version_is_gathered_one_tensor_at_a_time(sharded, tmp_path):
    from safetensors.torch import load_file

    from rollart.engines.weight_encode import TorchTensors

    b, init = sharded
    b.load_checkpoint_state(copy.deepcopy(init))
    b.train_step(make_samples(6, seed=5), loss_cfg=LossConfig())
    lazy = b.weight_tensors()
    before = b.gathers
    source = TorchTensors(lazy, "bfloat16")  # what a streamed version's encoder holds
    assert b.gathers == before, "the encoder's plan needs shapes only: nothing gathered"
    for i, name in enumerate(source.names):
        source.read(i, 0, 2)
        assert b.gathers == before + i + 1, "one tensor gathered per tensor read"
    whole = {name: lazy[name] for name in lazy}
    want = b.state_dict_for_checkpoint()["model"]
    _close(whole, want)
    digest = b.save_weights(tmp_path / "v.safetensors")
    assert digest == file_content_digest(tmp_path / "v.safetensors") == tensors_digest(want)
    for name, t in load_file(tmp_path / "v.safetensors").items():
        assert torch.equal(t, want[name]), name
    from transformers import AutoModelForCausalLM

    assert b.export_hf(tmp_path / "hf") == digest
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    for name, t in hf.state_dict().items():
        assert torch.equal(t, want[name]), name


@pytest.mark.slow  # a second process that imports torch and builds a trainer: ~10-20 s
@pytest.mark.timeout(180)
def test_a_sharded_checkpoint_resumes_at_world_size_one(sharded, model_dir, tmp_path):
    """The full checkpoint (gathered, world-size-1 layout) resumes a plain trainer, and the
    ``torch.distributed.checkpoint`` folder (each rank its shards) a sharded trainer of one
    rank (another process: one default process group per process); both then take the
    sharded trainer's next step."""
    b, init = sharded
    b.load_checkpoint_state(copy.deepcopy(init))
    cfg = LossConfig(agg="seq-mean-token-mean")
    b.train_step(make_samples(7, seed=1), loss_cfg=cfg)
    state = copy.deepcopy(b.state_dict_for_checkpoint())
    b.save_sharded(tmp_path / "dcp")
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp") == \
        ["__0_0.distcp", "__1_0.distcp"], "every rank writes its own shards"
    nxt = make_samples(5, seed=2)
    b.train_step(nxt, loss_cfg=cfg)
    after = dict(b.weight_tensors())

    plain = TorchTrainBackend(model_dir, **KW)
    plain.load_checkpoint_state(state)
    assert plain.version == 1
    plain.train_step(nxt, loss_cfg=cfg)
    _close(plain.model.state_dict(), after)

    script = tmp_path / "resume.py"
    script.write_text(
        "import json, sys, torch\n"
        "from rollart.algos.losses import LossConfig\n"
        "from rollart.config.loader import convert\n"
        "from rollart.config.schema import RunConfig\n"
        "from rollart.engines.fsdp2_ranks import Fsdp2TrainBackend\n"
        "from rollart.engines.train_backends import make_backend\n"
        "from tests.engines.test_torch_trainer import make_samples\n"
        f"cfg = convert({{'run_dir': {str(tmp_path)!r}, 'model': {{'threads': 1}}, 'trainer': "
        f"{{'shard': 'fsdp2', 'world_size': 1, 'lr': {KW['lr']}, 'grad_clip': {KW['grad_clip']}, "
        f"'micro_batch_tokens': {KW['micro_batch_tokens']}}}}}, RunConfig)\n"
        f"b = make_backend(cfg, {str(model_dir)!r})\n"
        "assert isinstance(b, Fsdp2TrainBackend) and b.world_size == 1, type(b)\n"
        f"b.load_sharded({str(tmp_path / 'dcp')!r})\n"
        "v = b.version\n"
        "b.train_step(make_samples(5, seed=2), loss_cfg=LossConfig(agg='seq-mean-token-mean'))\n"
        f"b.save_weights({str(tmp_path / 'one.safetensors')!r})\n"
        "print(json.dumps({'version': v, 'after': b.version}))\n"
        "b.shutdown()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in sys.path if p and os.path.isdir(p)]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=150, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"version": 1, "after": 2}
    from safetensors.torch import load_file

    _close(load_file(tmp_path / "one.safetensors"), after)


@pytest.mark.timeout(180)
def test_a_checkpoint_of_another_model_is_refused_before_the_ranks_load_it(sharded):
    b, init = sharded
    bad = copy.deepcopy(init)
    name = next(iter(bad["model"]))
    bad["model"][name] = bad["model"][name][:1]
    with pytest.raises(ValueError, match=f"the checkpoint's {name} is"):
        b.load_checkpoint_state(bad)
    del bad["model"][name]
    with pytest.raises(ValueError, match="the checkpoint is of another model: missing"):
        b.load_checkpoint_state(bad)
    b.load_checkpoint_state(copy.deepcopy(init))  # the group is still usable
    assert b.train_step(make_samples(4), loss_cfg=LossConfig())["version"] == 1


def test_what_fsdp2_refuses_is_named(model_dir):
    from rollart.engines.fsdp2_ranks import Fsdp2TrainBackend
    from rollart.engines.rank_launch import backend_class

    with pytest.raises(ValueError, match="trainer.shard: fsdp2 does not train trainer.lora"):
        Fsdp2TrainBackend(model_dir, rank=0, world_size=2, dist_timeout=5,
                          lora={"rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q_proj"]})
    with pytest.raises(ValueError, match="trainer.shard must be 'none' or 'fsdp2'"):
        backend_class("zero3")
