"""Checkpoints never run code (issue 43, finding 1).

A head with no local checkpoint fetches the one in the run's object store
(:func:`rollart.actors.trainer.checkpoint_store.fetch_checkpoint`), which whoever can write that
bucket could have written; a run folder may hold an old ``latest.pt``. Both used to be
unpickled (``torch.load(weights_only=False)``): a pickled object ran a shell command. Now a
full checkpoint is safetensors plus a msgspec record (:mod:`rollart.engines.checkpoint_codec`),
loaded only when its bytes have the SHA-256 the durable state records, and a pickle is
refused with a reason that names it. The same codec carries rank 0's state to the other ranks.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import os
import pickle
import struct
import tracemalloc

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollart import messages as m
from rollart.actors.trainer.checkpoint_store import CHECKPOINT, STATE, fetch_checkpoint
from rollart.actors.trainer.files import RunFiles
from rollart.app.launch import checkpoint_version
from rollart.engines import checkpoint_codec as codec


class _Evil:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickled_checkpoint(marker) -> bytes:
    buf = io.BytesIO()
    torch.save({"backend": {"version": 7, "payload": _Evil(marker)}, "journal_seq": 0}, buf)
    return buf.getvalue()


async def test_a_pickled_checkpoint_in_the_object_store_never_runs(tmp_path, memory_bus_only):
    """The attack of finding 1: ``checkpoint-latest`` in the store is a pickle whose object
    runs ``touch``. The head's fetch (and the resume after it) refuses it as the old pickle
    format; the command never runs and nothing is written to the run folder."""
    bus, marker = memory_bus_only, tmp_path / "pwned"
    store = await bus.object_store(m.object_bucket("evil"))
    await store.put(CHECKPOINT, _pickled_checkpoint(marker))
    files = RunFiles(tmp_path / "head")
    with pytest.raises(ValueError, match=r"old pickle format.*never loaded"):
        await fetch_checkpoint(bus, "evil", files)
        files.durable_version()  # what `rollart run --resume` asks first
        files.load_checkpoint()
    assert not marker.exists(), "the pickled object ran a command on the head"
    assert not files.has_checkpoint()


def test_a_pickle_checkpoint_in_the_run_folder_is_refused_not_loaded(tmp_path):
    """An old run folder's ``checkpoints/latest.pt`` (or one planted there): the resume names
    the file and says how to go on; it is never unpickled."""
    marker = tmp_path / "pwned"
    files = RunFiles(tmp_path / "run")
    files.make()
    (files.path / "checkpoints" / "latest.pt").write_bytes(_pickled_checkpoint(marker))
    with pytest.raises(ValueError, match=r"latest\.pt is a full checkpoint in the old pickle "
                                         r"format.*python -m rollart\.actors\.trainer\.files"):
        checkpoint_version(files.path)
    with pytest.raises(ValueError, match="old pickle format"):
        files.load_checkpoint()
    assert not marker.exists()


def _state(version: int = 1) -> dict:
    return {"backend": {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
                        "version": version}, "journal_seq": version, "version": version}


def _durable(files: RunFiles, ref, version: int = 1) -> None:
    files.save_state({"version": version, "seq": ref.seq, "journal_from": ref.seq + 1,
                      "full": msgspec.to_builtins(ref), "ledger": {}, "counts": {},
                      "journal_sha256": {}})


def test_a_full_checkpoint_is_loaded_only_with_the_recorded_digest(tmp_path):
    """A file changed after the trainer wrote it (same size, one byte), or replaced by another
    valid checkpoint, is refused before it is parsed; the recorded one loads."""
    files = RunFiles(tmp_path / "run")
    files.make()
    ref = files.save_checkpoint(_state())
    _durable(files, ref)
    assert torch.equal(files.load_checkpoint()["backend"]["model"]["w"], _state()["backend"]["model"]["w"])

    path = files.full_path(ref.seq)
    good = path.read_bytes()
    bad = bytearray(good)
    bad[-1] ^= 1
    path.write_bytes(bytes(bad))
    with pytest.raises(codec.CheckpointRefused, match=r"full-00000001\.safetensors: its SHA-256 "
                                                      r"is not the one the durable state recorded"):
        files.load_checkpoint()
    path.unlink()
    os.symlink(tmp_path / "elsewhere", path)  # never followed
    (tmp_path / "elsewhere").write_bytes(good)
    with pytest.raises(codec.CheckpointRefused, match="not a regular file"):
        files.load_checkpoint()


async def test_a_forged_checkpoint_in_the_object_store_is_refused(tmp_path, bus):
    """What a fetch trusts is the state's digest: a full checkpoint object that is not the
    recorded bytes, a state whose digest is not hex, a state that counts a step the store
    has no record of (even 10^12 of them), a full checkpoint larger than the state says (never
    read past it): each is refused at once, the folder stays empty. On both buses."""
    from rollart.actors.trainer.checkpoint_store import full_name, put_full, put_state

    old = RunFiles(tmp_path / "old")
    old.make()
    ref = old.save_checkpoint(_state())
    _durable(old, ref)
    await put_full(bus, "forge", old, ref)
    await put_state(bus, "forge", old, [])
    store = await bus.object_store(m.object_bucket("forge"))

    assert await fetch_checkpoint(bus, "forge", RunFiles(tmp_path / "ok"))  # the control

    other = RunFiles(tmp_path / "other")
    other.make()
    forged = other.save_checkpoint(_state(version=1) | {"version": 99})
    await store.put(full_name(1), other.full_path(forged.seq).read_bytes())
    head = RunFiles(tmp_path / "head")
    with pytest.raises(codec.CheckpointRefused, match=r"checkpoint-full-00000001: \d+ bytes whose "
                                                      r"SHA-256 is not the one"):
        await fetch_checkpoint(bus, "forge", head)
    assert not head.path.exists()

    await store.put(full_name(1), old.full_path(ref.seq).read_bytes())  # the real one again
    state = json.loads(old.state.read_bytes())
    for bad, why in [({"full": {**state["full"], "sha256": "../../x"}}, r"sha256"),
                     ({"seq": 10**12}, r"SHA-256 of 0 journal records, it counts 999999999999"),
                     ({"seq": 10**12, "format": 2, "journal_sha256": None},
                      r"counts step 2, whose record"),
                     ({"full": {**state["full"], "seq": -1}}, r"seq"),
                     ({"format": 9}, r"format 9")]:
        await store.put(STATE, json.dumps({**state, **bad}).encode())
        with pytest.raises(codec.CheckpointRefused, match=why):
            await fetch_checkpoint(bus, "forge", head)
        assert not head.path.exists()
    big = {**state, "full": {**state["full"], "bytes": 10}}  # the object is larger: never read whole
    await store.put(STATE, json.dumps(big).encode())
    with pytest.raises(codec.CheckpointRefused, match=r"checkpoint-full-00000001 .*larger than the 10"):
        await fetch_checkpoint(bus, "forge", head)
    await store.put(STATE, b"[" * 100_000)  # deeper than any parser's stack
    with pytest.raises(codec.CheckpointRefused, match="not a durable state"):
        await fetch_checkpoint(bus, "forge", head)


def test_the_codec_keeps_the_tree_and_refuses_what_it_cannot_store():
    """Int keys stay ints (optimizer state), tuples stay tuples (betas, Python's RNG state),
    tied tensors stay one, bytes and non-finite floats survive; an object is a TypeError
    that names where it is."""
    w = torch.randn(4, 3)
    tree = {"model": {"embed": w, "lm_head": w, "half": torch.ones(2, dtype=torch.bfloat16),
                      "mask": torch.tensor([True, False])},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3)}},
                          "param_groups": [{"betas": (0.9, 0.999), "foreach": None, "params": [0]}]},
            "rng": {"python": (3, tuple(range(5)), None), "raw": b"\x00\xff"},
            "floats": [math.inf, -0.0, 1e-300], "strided": torch.arange(12).reshape(3, 4).t()}
    back = codec.loads(codec.dumps(tree))
    assert list(back["optimizer"]["state"]) == [0]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["rng"]["python"] == (3, (0, 1, 2, 3, 4), None) and back["rng"]["raw"] == b"\x00\xff"
    assert back["model"]["embed"] is back["model"]["lm_head"] and torch.equal(back["model"]["embed"], w)
    assert back["model"]["half"].dtype == torch.bfloat16 and back["floats"][0] == math.inf
    assert torch.equal(back["strided"], tree["strided"])
    assert math.isnan(codec.loads(codec.dumps({"x": math.nan}))["x"])
    with pytest.raises(TypeError, match=r"checkpoint value at /a/1: object is not storable"):
        codec.dumps({"a": [1, object()]})
    with pytest.raises(TypeError, match=r"a key of type tuple"):
        codec.dumps({(1, 2): 3})


def test_the_ranks_state_is_never_unpickled(tmp_path):
    """Rank 0's state to the other ranks is the same codec: a pickle (or ``torch.save``
    bytes) arriving there is refused, not run."""
    marker = tmp_path / "pwned"
    for blob in (_pickled_checkpoint(marker), pickle.dumps(_Evil(marker))):
        with pytest.raises(codec.CheckpointRefused):
            codec.loads(blob, what="rank 0's checkpoint state")
    assert not marker.exists()


def _valid() -> bytes:
    return codec.dumps({"m": {"a": torch.arange(8, dtype=torch.float32)}, "s": {1: (2, "x")}})


def _record_bytes(tree: object) -> bytes:
    """A file whose record is ``tree`` raw (what an attacker with the bucket could put)."""
    meta = {codec.META_KEY: base64.b64encode(msgspec.msgpack.encode(tree)).decode()}
    header = json.dumps({"__metadata__": meta}).encode()
    return struct.pack("<Q", len(header)) + header


MAX_PY_BYTES = 8 << 20
"""What decoding a fuzzed file of a few KB may allocate in Python at most."""


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=256),
    st.builds(lambda b, i, x: b[:i % (len(b) + 1)] + bytes([x]) + b[i % (len(b) + 1) + 1:],
              st.just(_valid()), st.integers(0, 4096), st.integers(0, 255)),
    st.builds(lambda n, b: struct.pack("<Q", n) + b[8:], st.integers(0, 2**64 - 1), st.just(_valid())),
    st.builds(lambda k: _valid()[:k], st.integers(0, 600)),
    st.builds(_record_bytes, st.recursive(
        st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8),
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
        max_leaves=20)),
))
def test_fuzz_checkpoint_bytes_end_in_a_named_refusal(blob):
    """Random, mutated, truncated, oversized-header and forged-record files: each decodes to
    a tree or is a :class:`CheckpointRefused`; nothing else is raised, and Python never
    allocates more than a small bound (a header's length is checked before it is read)."""
    tracemalloc.start()
    try:
        try:
            codec.loads(blob)
        except codec.CheckpointRefused as e:
            assert str(e).startswith("checkpoint state")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_PY_BYTES, peak


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.one_of(
    st.binary(max_size=128),
    st.dictionaries(st.sampled_from(["format", "version", "seq", "journal_from", "full", "ledger",
                                     "journal_sha256"]),
                    st.none() | st.integers(-5, 10**13) | st.text(max_size=70)
                    | st.fixed_dictionaries({"seq": st.integers(-1, 3), "sha256": st.text(max_size=70),
                                             "bytes": st.integers(-1, 10)})
                    | st.dictionaries(st.sampled_from(["1", "2", "3", "01", "-1", "x", ""]),
                                      st.sampled_from(["a" * 64, "A" * 64, "a" * 63, "../x", 3]),
                                      max_size=4)).map(
        lambda d: json.dumps(d).encode()),
    st.builds(lambda seq, start, fmt, keys: json.dumps(
        {"format": fmt, "version": 1, "seq": seq, "journal_from": start,
         "journal_sha256": {str(k): "b" * 64 for k in keys}}).encode(),
        st.integers(0, 5), st.integers(1, 6), st.sampled_from([2, 3]),
        st.lists(st.integers(-1, 7), max_size=6)),
))
def test_fuzz_durable_states_end_in_a_named_refusal(data):
    """A state from the store is parsed into a validated head before any file or object name
    is built from it: random states are a head or a named refusal, and an accepted head's
    digest is hex of the right length and its steps in range."""
    from rollart.actors.trainer.files import parse_state

    try:
        _, head = parse_state(data, "fuzzed state")
    except codec.CheckpointRefused as e:
        assert str(e).startswith("fuzzed state")
        return
    assert head.seq + 1 >= head.journal_from >= 1
    if head.format >= 3 or head.journal_sha256 is not None:  # one hex digest per counted step
        assert sorted(map(int, head.journal_sha256)) == list(range(head.journal_from, head.seq + 1))
        assert all(len(d) == 64 and int(d, 16) >= 0 for d in head.journal_sha256.values())
    if head.full is not None:
        assert len(head.full.sha256) == 64 and int(head.full.sha256, 16) >= 0
        assert head.journal_from == head.full.seq + 1


def test_the_recorded_digest_is_the_files_sha256(tmp_path):
    """The digest a state records is the SHA-256 of the file's bytes (what a fetch checks)."""
    files = RunFiles(tmp_path / "run")
    files.make()
    ref = files.save_checkpoint(_state())
    assert ref.sha256 == hashlib.sha256(files.full_path(1).read_bytes()).hexdigest()


@pytest.mark.slow  # two processes that import torch: ~15 s on a loaded machine
def test_an_old_checkpoint_of_ones_own_converts_with_the_restricted_loader(tmp_path):
    """The way on that the refusal names: ``python -m rollart.actors.trainer.files <run>``
    reads ``latest.pt`` with torch's weights-only loader (a pickled object is refused there
    too) and writes a full checkpoint and a state naming it; the resume then loads it."""
    import subprocess
    import sys

    files = RunFiles(tmp_path / "run")
    files.make()
    old = {**_state(version=4), "ledger": {"closed": {"low": 8}}, "counts": {}, "wall_s": 1.0}
    del old["journal_seq"]  # a checkpoint from before the journal
    torch.save(old, files.legacy)
    r = subprocess.run([sys.executable, "-m", "rollart.actors.trainer.files", str(files.path)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "full-00000004.safetensors" in r.stdout
    assert checkpoint_version(files.path) == 4
    back = files.load_checkpoint()
    assert back["journal_seq"] == 4 and torch.equal(back["backend"]["model"]["w"], old["backend"]["model"]["w"])
    assert files.load_state()["ledger"] == {"closed": {"low": 8}}

    marker = tmp_path / "pwned"
    evil = RunFiles(tmp_path / "evil")
    evil.make()
    evil.legacy.write_bytes(_pickled_checkpoint(marker))
    r = subprocess.run([sys.executable, "-m", "rollart.actors.trainer.files", str(evil.path)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and "Weights only load failed" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()


# -- the journal's records are digest-covered (issue 43, after finding 1) ------------------------
def _traj(g: int, i: int, reward: float = 1.0) -> m.RolloutCompleted:
    return m.RolloutCompleted(traj_id=f"g{g:06d}-{i}", group_id=f"g{g:06d}", env="main", seed=g,
                              index_in_group=i, token_ids=[1, 2, 3, 4], response_mask=[0, 0, 1, 1],
                              logprobs=[0.0, 0.0, -1.0, -2.0], reward=reward, min_version=0,
                              max_version=0, group_index=g)


async def _journaled(files: RunFiles, steps: int, **kw):
    """``steps`` committed steps (records and states; no training needed to write them)."""
    from rollart.actors.trainer.checkpoint import Checkpoints
    from rollart.config import TrainerConfig

    files.make()
    ckpt = Checkpoints(files, TrainerConfig(full_checkpoint_every=100), **kw)
    for step in range(steps):
        ckpt.record(step, [step, step], [_traj(step, 0), _traj(step, 1, 0.0)], {})
        await ckpt.commit({"version": step + 1, "ledger": {}, "counts": {}})
    return ckpt


def _forged_record(data: bytes) -> bytes:
    """The same step with one trajectory's reward flipped: a valid record, other data."""
    from rollart.actors.trainer.checkpoint import StepRecord

    rec = msgspec.msgpack.decode(data, type=StepRecord)
    trajs = [msgspec.structs.replace(t, reward=1.0 - t.reward) for t in rec.trajectories]
    return msgspec.msgpack.encode(msgspec.structs.replace(rec, trajectories=trajs))


async def test_a_tampered_journal_record_in_the_object_store_is_refused_at_fetch(tmp_path, bus):
    """A journal record in the store replaced by another valid record (the step's rewards
    flipped: a resume would train on other data than the run did) or by bytes that do not
    decode: the fetch refuses it by the SHA-256 the durable state records for that step,
    before decoding it, and writes nothing to the head's folder. On both buses."""
    from rollart.actors.trainer.checkpoint_store import journal_name

    old = RunFiles(tmp_path / "old")
    await _journaled(old, 3, bus=bus, run="tamper", object_store=True)
    state = json.loads(old.state.read_bytes())
    assert state["format"] == 3 and sorted(state["journal_sha256"]) == ["1", "2", "3"]
    assert state["journal_sha256"]["2"] == hashlib.sha256(old.read_journal(2)).hexdigest()
    assert await fetch_checkpoint(bus, "tamper", RunFiles(tmp_path / "ok"))  # the control

    store = await bus.object_store(m.object_bucket("tamper"))
    head = RunFiles(tmp_path / "head")
    for bad in (_forged_record(old.read_journal(2)), b"\xc1" * 40):
        await store.put(journal_name(2), bad)
        with pytest.raises(codec.CheckpointRefused, match=r"checkpoint-journal-00000002: \d+ bytes "
                                                          r"whose SHA-256 is not the one .* step 2"):
            await fetch_checkpoint(bus, "tamper", head)
        assert not head.path.exists()
    state["journal_sha256"]["2"] = "0" * 64  # a state that lacks one of its steps' digests
    del state["journal_sha256"]["3"]
    await store.put(STATE, json.dumps(state).encode())
    with pytest.raises(codec.CheckpointRefused, match=r"records the SHA-256 of 2 journal records, "
                                                      r"it counts 3"):
        await fetch_checkpoint(bus, "tamper", head)
    assert not head.path.exists()


async def test_a_state_without_record_digests_is_read_with_a_warning(tmp_path, memory_bus_only, caplog):
    """A durable state of format 2 (rollart from before the digests) records none: its
    records are fetched and replayed with a warning that says so (its full checkpoint is
    still digest-checked), and the next state the trainer writes covers them."""
    from rollart.actors.trainer.checkpoint_store import put_state

    bus = memory_bus_only
    old = RunFiles(tmp_path / "old")
    await _journaled(old, 2)
    state = json.loads(old.state.read_bytes())
    del state["journal_sha256"]
    old.save_state(state)
    old.state.write_text(json.dumps({**state, "format": 2}))
    await put_state(bus, "legacy", old, [1, 2])
    new = RunFiles(tmp_path / "new")
    with caplog.at_level("WARNING"):
        assert await fetch_checkpoint(bus, "legacy", new)
    assert "records no SHA-256 of its journal records" in caplog.text
    assert new.journal_seqs() == [1, 2]

    from rollart.actors.trainer.checkpoint import Checkpoints
    from rollart.config import TrainerConfig

    ckpt = Checkpoints(new, TrainerConfig(full_checkpoint_every=100))
    ckpt.resumed(seq=2, full_seq=0, full_version=0)
    ckpt.record(2, [2], [_traj(2, 0)], {})
    await ckpt.commit({"version": 3, "ledger": {}, "counts": {}})
    digests = json.loads(new.state.read_bytes())["journal_sha256"]
    assert digests == {str(s): hashlib.sha256(new.read_journal(s)).hexdigest() for s in (1, 2, 3)}
