"""The trainer's checkpoints (:mod:`rollart.actors.trainer.checkpoint`): the journal of the
steps since the last full checkpoint, the full checkpoint written in the background, and the
replay that joins them: the weights after a replay are the weights of the run, bit for bit."""

from __future__ import annotations

import dataclasses
import json
import random

import msgspec
import pytest
import torch

from rollart import messages as m
from rollart.actors.trainer.checkpoint_store import JOURNAL, STATE, fetch_checkpoint
from rollart.actors.trainer.batch import build_samples
from rollart.actors.trainer.checkpoint import (
    Checkpoints,
    StepRecord,
    replay,
    rng_state,
    snapshot,
)
from rollart.actors.trainer.files import RunFiles
from rollart.algos.losses import LossConfig
from rollart.config import TrainerConfig
from rollart.engines.torch_trainer import TorchTrainBackend

LOSS = LossConfig(entropy_coef=0.01)
KW = {"lr": 1e-2, "grad_clip": 1.0, "threads": 1, "seed": 0, "micro_batch_tokens": 64}
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.3, "targets": ["q_proj", "v_proj"]}


def _traj(step: int, g: int, i: int, rng: random.Random) -> m.RolloutCompleted:
    n_prompt, n_resp = rng.randint(3, 6), rng.randint(2, 6)
    ids = [rng.randrange(1, 500) for _ in range(n_prompt + n_resp)]
    return m.RolloutCompleted(
        traj_id=f"g{g:06d}-{i}", group_id=f"g{g:06d}", env="main", seed=g, index_in_group=i,
        token_ids=ids, response_mask=[0] * n_prompt + [1] * n_resp,
        logprobs=[0.0] * n_prompt + [-rng.uniform(0.5, 3.0) for _ in range(n_resp)],
        reward=float(rng.random() < 0.5), min_version=step, max_version=step, group_index=g)


def _batch(step: int, groups: int = 2, size: int = 4) -> tuple[list[int], list[m.RolloutCompleted]]:
    rng = random.Random(step)
    gi = [step * groups + j for j in range(groups) for _ in range(size)]
    return gi, [_traj(step, step * groups + j, i, rng) for j in range(groups) for i in range(size)]


def _train(backend, ckpt: Checkpoints, step: int) -> None:
    gi, trajs = _batch(step)
    rng = rng_state(backend)
    backend.train_step(build_samples(trajs, gi, "grpo"), loss_cfg=LOSS)
    ckpt.record(step, gi, trajs, rng)


def _ledger_state(version: int) -> dict:
    return {"version": version, "ledger": {"closed": {"low": 2 * version}}, "counts": {}, "wall_s": 0.0}


def _full(backend) -> dict:
    return {"backend": backend.state_dict_for_checkpoint(), **_ledger_state(backend.version)}


def _fresh(tiny_model, **kw) -> TorchTrainBackend:
    return TorchTrainBackend(tiny_model, **{**KW, **kw})


def _resume(tiny_model, files: RunFiles, **kw) -> TorchTrainBackend:
    b = _fresh(tiny_model, **kw)
    full = files.load_checkpoint()
    held = 0
    if full is not None:
        b.load_checkpoint_state(full["backend"])
        held = full["journal_seq"]
    replay(files, b, after=held, upto=files.load_state()["seq"], advantage="grpo", loss_cfg=LOSS)
    return b


def _rewrite(files: RunFiles, seq: int, rec: StepRecord) -> None:
    """Write ``rec`` as step ``seq``'s record and record its SHA-256 in the durable state,
    as the trainer would have (the controls below change what a step did, not tamper)."""
    import hashlib

    data = msgspec.msgpack.encode(rec)
    files.journal_path(seq).write_bytes(data)
    state = files.load_state()
    state["journal_sha256"][str(seq)] = hashlib.sha256(data).hexdigest()
    files.save_state(state)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora-dropout"])
async def test_full_checkpoint_then_replay_gives_the_same_weights(tmp_path, tiny_model, lora):
    """Steps 1-3, a full checkpoint (in the background, while step 4 trains), steps 4-5
    journaled: a fresh backend that loads the full checkpoint and replays 4-5 holds exactly
    the weights the run has (with LoRA dropout too: the journal restores each step's RNG)."""
    files = RunFiles(tmp_path / "run")
    files.make()
    cfg = TrainerConfig(full_checkpoint_every=3)
    ckpt = Checkpoints(files, cfg)
    run = _fresh(tiny_model, lora=lora)
    for step in range(5):
        _train(run, ckpt, step)
        await ckpt.commit(_ledger_state(run.version))
        if ckpt.full_due(run.version):
            await ckpt.start_full(lambda: _full(run), run.version)
            assert run.version == 3 and ckpt.task is not None  # written while the next steps train
    await ckpt.wait()
    assert ckpt.full_seq == 3 and files.journal_seqs() == [4, 5], "held steps pruned"
    state = files.load_state()
    assert (state["version"], state["seq"]) == (5, 5) and state["journal_from"] <= 4
    assert files.load_checkpoint()["journal_seq"] == 3

    again = _resume(tiny_model, files, lora=lora)
    assert again.version == 5
    assert again.weights_digest() == run.weights_digest()

    if lora:  # the control: the same replay from other RNG draws gives other weights
        import msgspec

        path = files.journal_path(4)
        rec = msgspec.msgpack.decode(path.read_bytes(), type=StepRecord)
        torch.manual_seed(12345)
        other = msgspec.structs.replace(rec, rng=rng_state(run))
        _rewrite(files, 4, other)
        assert _resume(tiny_model, files, lora=lora).weights_digest() != run.weights_digest()


async def test_replay_from_the_initial_model_and_a_missing_record(tmp_path, tiny_model):
    """Before the first full checkpoint the journal holds every step and the replay starts
    from the model folder; a record the state counts but that is gone fails the resume with
    the file's name (training on would publish other weights than the run did)."""
    files = RunFiles(tmp_path / "run")
    files.make()
    ckpt = Checkpoints(files, TrainerConfig(full_checkpoint_every=100))
    run = _fresh(tiny_model)
    for step in range(3):
        _train(run, ckpt, step)
        if step != 1:  # checkpoint_every 2-like: step 1's record waits for the next commit
            await ckpt.commit(_ledger_state(run.version))
    assert files.journal_seqs() == [1, 2, 3] and files.full_seqs() == []
    assert _resume(tiny_model, files).weights_digest() == run.weights_digest()
    files.journal_path(2).unlink()
    with pytest.raises(ValueError, match=r"00000002\.msgpack is missing.*counts step 2"):
        _resume(tiny_model, files)


async def test_a_tampered_local_record_is_refused_at_replay(tmp_path, tiny_model):
    """A journal record in the run folder changed after the trainer wrote it (another valid
    record: the step's rewards flipped; or bytes that do not decode) is refused by the SHA-256
    the durable state records for its step, before it is decoded or trained on; the
    untouched journal replays to the run's weights (the control)."""
    from rollart.engines.checkpoint_codec import CheckpointRefused

    files = RunFiles(tmp_path / "run")
    files.make()
    ckpt = Checkpoints(files, TrainerConfig(full_checkpoint_every=100))
    run = _fresh(tiny_model)
    for step in range(2):
        _train(run, ckpt, step)
    await ckpt.commit(_ledger_state(run.version))
    assert _resume(tiny_model, files).weights_digest() == run.weights_digest()
    path = files.journal_path(1)
    good = path.read_bytes()
    rec = msgspec.msgpack.decode(good, type=StepRecord)
    flipped = [msgspec.structs.replace(t, reward=1.0 - t.reward) for t in rec.trajectories]
    for bad in (msgspec.msgpack.encode(msgspec.structs.replace(rec, trajectories=flipped)),
                good[:-1] + bytes([good[-1] ^ 1]), b"\xc1"):
        path.write_bytes(bad)
        fresh = _fresh(tiny_model)
        with pytest.raises(CheckpointRefused, match=r"00000001\.msgpack: \d+ bytes whose SHA-256 "
                                                    r"is not the one the durable state recorded "
                                                    r"for step 1"):
            replay(files, fresh, after=0, upto=2, advantage="grpo", loss_cfg=LOSS)
        assert fresh.version == 0, "nothing was trained on the tampered record"


async def test_replay_trains_each_step_with_its_recorded_entropy_coef(tmp_path, tiny_model):
    """``trainer.entropy_target`` changes the entropy coefficient from step to step: each
    journaled step keeps its own, so the replay reaches the run's weights exactly; replayed
    with the config's one instead, the weights differ (the control)."""
    import msgspec

    files = RunFiles(tmp_path / "run")
    files.make()
    ckpt = Checkpoints(files, TrainerConfig(full_checkpoint_every=100))
    run = _fresh(tiny_model)
    for step, coef in enumerate([0.0, 0.05, 0.1]):
        gi, trajs = _batch(step)
        rng = rng_state(run)
        run.train_step(build_samples(trajs, gi, "grpo"), loss_cfg=LossConfig(entropy_coef=coef))
        ckpt.record(step, gi, trajs, rng, coef)
    await ckpt.commit(_ledger_state(run.version))
    assert _resume(tiny_model, files).weights_digest() == run.weights_digest()
    for seq in files.journal_seqs():
        path = files.journal_path(seq)
        rec = msgspec.msgpack.decode(path.read_bytes(), type=StepRecord)
        _rewrite(files, seq, msgspec.structs.replace(rec, entropy_coef=None))
    assert _resume(tiny_model, files).weights_digest() != run.weights_digest()


def test_snapshot_is_a_copy_the_next_step_does_not_change(tiny_model):
    b = _fresh(tiny_model)
    b.train_step(build_samples(*reversed(_batch(0)), "grpo"), loss_cfg=LOSS)
    live = b.state_dict_for_checkpoint()
    snap = snapshot(live)
    name = next(k for k, v in live["model"].items() if v.dtype.is_floating_point and v.dim() == 2)
    before = snap["model"][name].clone()
    moments = {k: v["exp_avg"].clone() for k, v in snap["optimizer"]["state"].items()}
    b.train_step(build_samples(*reversed(_batch(1)), "grpo"), loss_cfg=LOSS)
    assert not torch.equal(b.model.state_dict()[name], before), "the step changed the model"
    assert torch.equal(snap["model"][name], before)
    assert all(torch.equal(snap["optimizer"]["state"][k]["exp_avg"], v) for k, v in moments.items())
    tied = [k for k in live["model"] if k.endswith("embed_tokens.weight") or k == "lm_head.weight"]
    if len(tied) == 2 and live["model"][tied[0]].data_ptr() == live["model"][tied[1]].data_ptr():
        assert snap["model"][tied[0]].data_ptr() == snap["model"][tied[1]].data_ptr(), \
            "tied weights stay one copy"


def test_the_last_steps_snapshot_holds_the_cpu_tensors_themselves(tiny_model):
    """The final checkpoint (no step follows) is written from the live CPU tensors: no second
    copy of the weights and AdamW state at the run's peak; containers are still its own."""
    b = _fresh(tiny_model)
    b.train_step(build_samples(*reversed(_batch(0)), "grpo"), loss_cfg=LOSS)
    live = b.state_dict_for_checkpoint()
    kept = snapshot(live, copy_tensors=False)
    copied = snapshot(live)
    name = next(k for k, v in live["model"].items() if v.dtype.is_floating_point and v.dim() == 2)
    assert kept["model"][name].data_ptr() == live["model"][name].data_ptr()
    assert copied["model"][name].data_ptr() != live["model"][name].data_ptr()
    assert kept["model"] is not live["model"]
    k = next(iter(live["optimizer"]["state"]))
    assert (kept["optimizer"]["state"][k]["exp_avg"].data_ptr()
            == live["optimizer"]["state"][k]["exp_avg"].data_ptr())


async def test_a_full_checkpoint_waits_for_the_previous_one(tmp_path, tiny_model, monkeypatch):
    """Never two full checkpoints written at once: the next one starts once the previous is
    on disk (its write is made slow here by holding it on an event the test sets)."""
    import threading

    files = RunFiles(tmp_path / "run")
    files.make()
    ckpt = Checkpoints(files, TrainerConfig(full_checkpoint_every=1))
    run = _fresh(tiny_model)
    release, writing, active, most = threading.Event(), threading.Event(), [0], [0]
    real = files.save_checkpoint

    def slow(state):
        active[0] += 1
        most[0] = max(most[0], active[0])
        writing.set()
        release.wait(60)
        try:
            return real(state)
        finally:
            active[0] -= 1

    monkeypatch.setattr(files, "save_checkpoint", slow)
    _train(run, ckpt, 0)
    await ckpt.commit(_ledger_state(run.version))
    await ckpt.start_full(lambda: _full(run), run.version)
    import asyncio

    await asyncio.to_thread(writing.wait, 60)
    _train(run, ckpt, 1)  # trains while the first write is held
    await ckpt.commit(_ledger_state(run.version))
    second = asyncio.create_task(ckpt.start_full(lambda: _full(run), run.version))
    await asyncio.sleep(0)
    assert not second.done() and files.full_seqs() == []
    release.set()
    await second
    await ckpt.wait()
    assert most[0] == 1
    assert files.load_checkpoint()["journal_seq"] == 2 and files.journal_seqs() == []
    assert files.full_seqs() == [2], "the previous full checkpoint is deleted once the state names the new one"
    done = ckpt.take_done()
    assert done["full_checkpoint_version"] == 2 and done["full_checkpoint_bytes"] > 0


async def test_object_store_holds_what_a_new_head_resumes_from(tmp_path, tiny_model, memory_bus_only):
    """``checkpoint_store: object``: records, metrics and state go to the store at each
    commit, the full checkpoint after its write (the records it holds deleted then); an
    empty run folder fetches all of it and resumes to the run's exact weights."""
    bus = memory_bus_only
    files = RunFiles(tmp_path / "old")
    files.make()
    ckpt = Checkpoints(files, TrainerConfig(full_checkpoint_every=2), bus=bus, run="obj",
                       object_store=True)
    run = _fresh(tiny_model)
    for step in range(3):
        _train(run, ckpt, step)
        files.write_metrics({"step": run.version})
        await ckpt.commit(_ledger_state(run.version))
        if ckpt.full_due(run.version):
            await ckpt.start_full(lambda: _full(run), run.version)
    await ckpt.wait()
    store = await bus.object_store(m.object_bucket("obj"))
    assert not await store.exists(f"{JOURNAL}00000001") and not await store.exists(f"{JOURNAL}00000002")
    assert json.loads(await store.get(STATE))["seq"] == 3

    new = RunFiles(tmp_path / "new")
    assert await fetch_checkpoint(bus, "obj", new)
    assert new.journal_seqs() == [3] and new.load_checkpoint()["journal_seq"] == 2
    assert [json.loads(x)["step"] for x in new.metrics.read_text().splitlines()] == [1, 2, 3]
    assert _resume(tiny_model, new).weights_digest() == run.weights_digest()
    assert not await fetch_checkpoint(bus, "obj", new), "a folder with a checkpoint keeps its own"


async def test_replay_holds_the_schedule_where_the_run_held_it(tmp_path, tiny_model):
    """``trainer.schedule_clock: signal``: a step whose trajectories all failed alike does not
    move the LR schedule; the journal's replay decides each step by the same rule, so a
    resume has the run's weights and its next LR (a replay that moved it on every step
    would not)."""
    from rollart.actors.trainer.batch import advances_schedule

    files = RunFiles(tmp_path / "run")
    files.make()
    tcfg = TrainerConfig(schedule_clock="signal", full_checkpoint_every=100)
    ckpt = Checkpoints(files, tcfg)
    kw = {"warmup_steps": 1, "total_steps": 6, "schedule": "cosine"}
    run = _fresh(tiny_model, **kw)
    held = []
    for step in range(4):
        gi, trajs = _batch(step)
        if step in (1, 2):  # every member failed alike: no signal
            trajs = [msgspec.structs.replace(t, reward=0.0, success=False) for t in trajs]
        samples = build_samples(trajs, gi, "grpo")
        advance = advances_schedule(tcfg, trajs, samples)
        held.append(not advance)
        rng = rng_state(run)
        run.train_step(samples, loss_cfg=dataclasses.replace(LOSS, advance_schedule=advance))
        ckpt.record(step, gi, trajs, rng)
        await ckpt.commit(_ledger_state(run.version))
    assert held == [False, True, True, False]
    assert advances_schedule(TrainerConfig(schedule_clock="steps"), trajs, samples)
    lr = run.scheduler.get_last_lr()[0]

    again = _fresh(tiny_model, **kw)
    replay(files, again, after=0, upto=4, advantage="grpo", loss_cfg=LOSS,
           trainer_cfg=tcfg)
    assert again.weights_digest() == run.weights_digest()
    assert again.scheduler.get_last_lr()[0] == lr
    every = _fresh(tiny_model, **kw)
    replay(files, every, after=0, upto=4, advantage="grpo", loss_cfg=LOSS)
    assert every.scheduler.get_last_lr()[0] != lr
