"""Trainer ranks over torch.distributed (gloo, real processes): world size 2 takes the step
world size 1 takes, for every loss aggregation; a rank killed mid-step fails the step with one
message naming it, within ``dist_timeout``, and nothing of the step is applied."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from rollart.algos.losses import LossConfig
from rollart.engines.torch_trainer import TorchTrainBackend
from rollart.engines.trainer_ranks import RankFailed
from rollart.engines.rank_launch import start_ranks
from tests.engines.test_torch_trainer import _build, make_samples

torch.set_num_threads(1)
KW = {"lr": 1e-3, "grad_clip": 0.5, "threads": 1, "seed": 0, "micro_batch_tokens": 24}
"""Small micro-batches: each rank accumulates over several; a clip that binds (global norm)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("ranks_model"), tie=False)


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    b = start_ranks(model_dir, world_size=2, dist_timeout=30, log_dir=tmp_path_factory.mktemp("logs"), **KW)
    init = copy.deepcopy(b.state_dict_for_checkpoint())
    yield b, init
    b.shutdown()
    assert all(p.returncode == 0 for p in b.procs.values()), "rank 1 stops cleanly on 'stop'"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_two_ranks_take_the_step_of_one(ranks, model_dir, agg):
    ranked, init = ranks
    ranked.load_checkpoint_state(copy.deepcopy(init))  # rank 1 gets it too
    single = TorchTrainBackend(model_dir, **KW)
    samples = make_samples(9, seed=3)  # odd: the ranks' shares differ in samples and tokens
    cfg = LossConfig(agg=agg, entropy_coef=0.01, is_cap=2.0)
    m1 = single.train_step(samples, loss_cfg=cfg)
    m2 = ranked.train_step(samples, loss_cfg=cfg)
    assert m2["world_size"] == 2 and m2["version"] == m1["version"] == 1
    assert m1["grad_norm"] > KW["grad_clip"], "the clip binds: it must use the global norm"
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "ratio_mean", "is_weight_mean", "tokens", "samples"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    p1 = dict(single.model.named_parameters())
    for name, p in ranked.model.named_parameters():
        # a step moves weights by ~lr (1e-3); two ranks sum the gradient in another order,
        # which moved one weight of 4096 by 2.4e-6 (measured)
        torch.testing.assert_close(p, p1[name], rtol=1e-5, atol=1e-5, msg=name)
    assert ranked.weights_digest() == ranked.weights_digest()


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_step_fails_the_step_naming_it(model_dir, tmp_path):
    b = start_ranks(model_dir, world_size=2, dist_timeout=5, log_dir=tmp_path, **KW)
    try:
        before = {k: v.clone() for k, v in b.model.state_dict().items()}
        r1 = b.procs[1]
        os.kill(r1.pid, signal.SIGSTOP)  # rank 1 takes the command but never reaches the all-reduce
        out: dict = {}

        def step():
            try:
                out["metrics"] = b.train_step(make_samples(8), loss_cfg=LossConfig())
            except Exception as e:  # noqa: BLE001 - the test looks at it
                out["error"] = e

        t0 = time.monotonic()
        th = threading.Thread(target=step, daemon=True)
        th.start()
        deadline = time.monotonic() + 10  # kill it once rank 0 is inside the step
        while not b._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b._lock.locked() and th.is_alive(), out
        os.kill(r1.pid, signal.SIGKILL)
        th.join(15)
        took = time.monotonic() - t0
        assert not th.is_alive(), "rank 0 hangs in a collective"
        err = out.get("error")
        assert isinstance(err, RankFailed), out
        msg = str(err)
        assert "trainer rank 1" in msg and "SIGKILL" in msg and "trainer-rank1.log" in msg, msg
        assert took < 5 + 5, took
        assert b.version == 0, "nothing of the failed step is applied"
        for k, v in b.model.state_dict().items():
            assert torch.equal(v, before[k]), k
        with pytest.raises(RankFailed, match="trainer rank 1"):  # the group stays failed: no retry
            b.train_step(make_samples(8), loss_cfg=LossConfig())
        assert b.version == 0
    finally:
        b.shutdown(kill=True)


@pytest.mark.slow  # starts a rank process that imports torch: ~10-15 s on a loaded machine
@pytest.mark.timeout(120)
def test_a_rank_refuses_a_command_larger_than_its_cap(model_dir, tmp_path):
    """Issue 43 (memory set by a peer): ranks 1..N-1 allocated whatever size rank 0
    announced. Here 'rank 0' announces 8 GiB (the tiny model's cap is ~1 GiB: 4 × its fp32
    state + a step's samples): rank 1 refuses it before allocating, with a message naming
    the size and the cap, and exits (status 2) instead of waiting to receive it."""
    from rollart.engines.trainer_ranks import COMMAND_MARGIN_BYTES

    b = start_ranks(model_dir, world_size=2, dist_timeout=5, log_dir=tmp_path, **KW)
    try:
        cap = b.command_cap
        n_params = sum(p.numel() for p in b.model.parameters())
        assert 16 * n_params + COMMAND_MARGIN_BYTES <= cap < 16 * n_params + COMMAND_MARGIN_BYTES + (64 << 20)
        r1 = b.procs[1]
        with b._lock:  # no idle ping meanwhile: this process is a hostile rank 0
            b._wait(b.pg.broadcast(torch.tensor([8 << 30], dtype=torch.int64), 0))
            r1.wait(30)
        assert r1.returncode == 2, r1.returncode
        text = (tmp_path / "trainer-rank1.log").read_text()
        assert f"rank 0 announced a command of {8 << 30} bytes, more than the cap of {cap}" in text, text[-2000:]
    finally:
        b.shutdown(kill=True)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.one_of(st.binary(max_size=64),
                 st.builds(lambda kind, state: msgspec.msgpack.encode([kind, [], None, state]),
                           st.text(max_size=8), st.binary(max_size=16)),
                 st.builds(msgspec.msgpack.encode, st.recursive(
                     st.none() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=4),
                     lambda k: st.lists(k, max_size=4), max_leaves=12))),
       st.integers(-2**63, 2**63 - 1))
def test_fuzz_commands_end_in_a_command_or_a_named_refusal(raw, announced):
    """What a rank receives: an announced size is checked against the cap before anything is
    allocated, and the bytes decode to a known command or are a :class:`CommandRefused`."""
    from rollart.engines.trainer_ranks import CommandRefused, checked_size, decode_command

    cap = 1 << 20
    try:
        assert 0 <= checked_size(announced, cap, rank=1) <= cap
    except CommandRefused as e:
        assert "announced a command of" in str(e) and not 0 <= announced <= cap
    try:
        cmd = decode_command(raw, rank=1)
    except CommandRefused as e:
        assert str(e).startswith("trainer rank 1: rank 0's command")
    else:
        assert cmd.kind in ("step", "load", "ping", "stop")
