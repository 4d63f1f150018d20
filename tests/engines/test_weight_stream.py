"""Streamed weight versions (:mod:`rollart.engines.weight_stream`): anchors and XOR deltas in
the serving dtype, after real optimizer steps on a tiny model, assembled bit-identical to a
direct load; and every way an assembly can fail leaves the base untouched and says why."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollart.config import RunConfig, load
from rollart.engines.digest import file_bucket_digest
from rollart.engines.weight_decode import Undo, apply_manifest, assemble_version
from rollart.engines.weight_encode import TorchTensors, TrainerBase, write_version
from rollart.engines.weight_staging import SPARE, retire
from rollart.engines.weight_stream import (
    LEAF_BYTES,
    StreamError,
    leaf_sizes,
    manifest_name,
    plan_buckets,
    read_manifest,
)
from rollart.engines.weight_blobs import DirBlobs
from tests.waiting import until_sync

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


class Trainer:
    """A tiny model, its AdamW and the trainer's side of the stream (a base file on disk)."""

    def __init__(self, model_dir, tmp: Path, dtype: str, lr: float = 3e-3, seed: int = 0,
                 bucket_bytes: int = 1 << 16, anchor_every: int = 8, leaf_bytes: int = LEAF_BYTES):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.dtype, self.bucket_bytes, self.anchor_every = dtype, bucket_bytes, anchor_every
        self.leaf_bytes = leaf_bytes
        self.dir = tmp / "trainer"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.blobs = DirBlobs(tmp / "store")
        self.base: TrainerBase | None = None
        self.version = 0

    def step(self, tokens=None) -> None:
        ids = tokens if tokens is not None else torch.randint(0, 300, (8, 24))
        self.model(ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.version += 1

    def expected(self) -> dict:
        target = getattr(torch, self.dtype)
        return {k: v.detach().to(target).clone() for k, v in self.model.state_dict().items()}

    async def publish(self, blobs=None):
        nxt = self.dir / "next.safetensors"
        man, name = await write_version(
            blobs or self.blobs, TorchTensors(dict(self.model.state_dict()), self.dtype),
            version=self.version, dtype=self.dtype, bucket_bytes=self.bucket_bytes,
            base=self.base, delta=True, anchor_every=self.anchor_every, base_out=nxt,
            leaf_bytes=self.leaf_bytes)
        os.replace(nxt, self.dir / "base.safetensors")
        self.base = TrainerBase(self.dir / "base.safetensors", self.version, man.digest, man.anchor)
        return man, name


def staged_digest(path: Path, man) -> str:
    """The bucket-tree digest of a staged file, every byte of it read."""
    return file_bucket_digest(path, [n for b in man.buckets for n in leaf_sizes(b.raw, man.leaf_bytes)])


def same_tensors(path: Path, expected: dict) -> bool:
    from safetensors.torch import load_file

    got = load_file(str(path))
    return set(got) == set(expected) and all(
        got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_anchor_and_deltas_assemble_bit_identical(tiny_model_dir, tmp_path, dtype):
    from rollart.engines.torch_engine import TorchGenerationEngine

    tr = Trainer(tiny_model_dir, tmp_path, dtype)
    stage = tmp_path / "stage"
    base = None
    for v in range(4):
        if v:
            tr.step()
        man, name = await tr.publish()
        assert man.kind == ("full" if v == 0 else "delta") and man.dtype == dtype
        if v:
            assert man.parent_version == v - 1 and man.anchor == 0
            assert 0 < man.stats.changed <= man.stats.total
        got, info = await assemble_version(tr.blobs, name, stage, base=base, digest=man.digest)
        assert info["path"] == ("full" if v == 0 else "delta")
        assert got.digest == man.digest == staged_digest(got.path, man)
        assert same_tensors(got.path, tr.expected()), f"v{v} differs from a direct load"
        if base is not None:
            base.path.unlink()
        base = got
        print(f"{dtype} v{v} {man.kind}: wire/full {man.stats.wire_bytes / man.stats.full_bytes:.3f}, "
              f"changed {man.stats.changed / man.stats.total:.3f}")
    eng = TorchGenerationEngine(tiny_model_dir, threads=1, dtype=dtype)
    eng.load_weights(base.path, 3)
    exp = tr.expected()
    own = eng.model.state_dict()
    assert all(torch.equal(own[k], exp[k]) for k in exp), "the engine holds the trainer's tensors"
    left = sorted(p.name for p in stage.iterdir() if p.name != SPARE)  # the spare: see retire()
    assert left == [base.path.name], "no temp or chain files left"


async def test_without_deltas_every_version_is_full_and_no_base_file_is_written(tiny_model_dir, tmp_path):
    """``trainer.sync.delta: false``: anchors only, and the trainer keeps no base file (the
    digest is computed on the way, no model-sized write per version)."""
    tr = Trainer(tiny_model_dir, tmp_path, "bfloat16")
    for v in range(2):
        if v:
            tr.step()
        man, name = await write_version(
            tr.blobs, TorchTensors(dict(tr.model.state_dict()), "bfloat16"), version=v,
            dtype="bfloat16", bucket_bytes=tr.bucket_bytes, base=tr.base, delta=False,
            anchor_every=8, base_out=None)
        assert man.kind == "full" and man.parent_version is None
        got, _ = await assemble_version(tr.blobs, name, tmp_path / "stage", base=None, digest=man.digest)
        assert got.digest == man.digest and same_tensors(got.path, tr.expected())
    assert not any(tr.dir.iterdir()), "no base file"


async def test_small_buckets_split_tensors(tiny_model_dir, tmp_path):
    tr = Trainer(tiny_model_dir, tmp_path, "bfloat16", bucket_bytes=3000)
    man0, name0 = await tr.publish()
    tr.step()
    man1, name1 = await tr.publish()
    split = {s.tensor for b in man1.buckets for s in b.spans if s.offset > 0}
    assert split and len(man1.buckets) > len(man1.tensors), "large tensors span several buckets"
    assert all(b.raw <= 3000 for b in man1.buckets)
    base, _ = await assemble_version(tr.blobs, name0, tmp_path / "stage", base=None, digest=man0.digest)
    got, info = await assemble_version(tr.blobs, name1, tmp_path / "stage", base=base, digest=man1.digest)
    assert info["path"] == "delta" and same_tensors(got.path, tr.expected())


async def test_corrupt_bucket_is_refused_naming_it_and_the_base_is_kept(tiny_model_dir, tmp_path):
    tr = Trainer(tiny_model_dir, tmp_path, "float32")
    man0, name0 = await tr.publish()
    tr.step()
    man1, name1 = await tr.publish()
    stage = tmp_path / "stage"
    base, _ = await assemble_version(tr.blobs, name0, stage, base=None, digest=man0.digest)
    before = base.path.read_bytes()
    bad = tr.blobs.root / man1.buckets[1].name
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(StreamError) as e:
        await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest)
    msg = str(e.value)
    assert f"bucket 1 ({man1.buckets[1].name})" in msg and man1.buckets[1].xxh3 in msg, msg
    assert base.path.read_bytes() == before and staged_digest(base.path, man0) == man0.digest
    assert sorted(p.name for p in stage.iterdir() if p.name != SPARE) == [base.path.name], \
        "nothing half-staged (a refused file is the spare)"
    # a wrong published digest is refused before any bucket is fetched
    with pytest.raises(StreamError, match="published one is"):
        await assemble_version(tr.blobs, name0, stage, base=None, digest="tensors-sha256:00")


async def test_missing_base_falls_back_to_the_anchor_chain(tiny_model_dir, tmp_path):
    tr = Trainer(tiny_model_dir, tmp_path, "bfloat16")
    pubs = []
    for v in range(4):
        if v:
            tr.step()
        pubs.append(await tr.publish())
    stage = tmp_path / "stage"
    man3, name3 = pubs[3]
    got, info = await assemble_version(tr.blobs, name3, stage, base=None, digest=man3.digest)
    assert info["path"] == "chain" and info["manifests"] == 4
    assert same_tensors(got.path, tr.expected())
    # a replica that skipped versions: from its own v1, not the anchor
    v1, _ = await assemble_version(tr.blobs, pubs[1][1], tmp_path / "s1", base=None,
                                   digest=pubs[1][0].digest)
    got2, info2 = await assemble_version(tr.blobs, name3, tmp_path / "s1", base=v1, digest=man3.digest)
    assert info2["path"] == "chain" and info2["manifests"] == 2 and got2.digest == man3.digest
    # a base whose file is broken: the direct delta fails, the anchor chain still works
    stale = got._replace(path=tmp_path / "nothing.safetensors", digest=pubs[2][0].digest, version=2)
    got3, info3 = await assemble_version(tr.blobs, name3, tmp_path / "s2", base=stale, digest=man3.digest)
    assert info3["path"] == "chain" and info3["manifests"] == 4 and got3.digest == man3.digest


async def test_missing_anchor_is_refused_with_the_reason(tiny_model_dir, tmp_path):
    tr = Trainer(tiny_model_dir, tmp_path, "bfloat16")
    man0, _ = await tr.publish()
    tr.step()
    man1, name1 = await tr.publish()
    await tr.blobs.delete(manifest_name(0, man0.digest))
    with pytest.raises(StreamError) as e:
        await assemble_version(tr.blobs, name1, tmp_path / "stage", base=None, digest=man1.digest)
    msg = str(e.value)
    assert "cannot assemble version 1" in msg and "incomplete: v0 (parent of v1)" in msg, msg
    assert "never committed" in msg and not list((tmp_path / "stage").glob("*.safetensors"))


async def test_buckets_without_a_manifest_are_no_version(tiny_model_dir, tmp_path):
    """A trainer killed mid-publish: its buckets are stored, its manifest (the commit point,
    written last) is not, so the version does not exist for a reader."""
    tr = Trainer(tiny_model_dir, tmp_path, "float32", bucket_bytes=1 << 14)

    class Killed(DirBlobs):
        async def put(self, name, data):
            if name.endswith(".manifest"):
                raise RuntimeError("killed before the commit point")
            await super().put(name, data)

    with pytest.raises(RuntimeError, match="commit point"):
        await tr.publish(Killed(tr.blobs.root))
    stored = sorted(p.name for p in tr.blobs.root.iterdir())
    assert stored and all(".b" in n for n in stored), stored
    specs = TorchTensors(dict(tr.model.state_dict()), tr.dtype).specs
    sizes = [n for spans in plan_buckets(specs, tr.bucket_bytes)
             for n in leaf_sizes(sum(s.length for s in spans), LEAF_BYTES)]
    digest = file_bucket_digest(tr.dir / "next.safetensors", sizes)  # what it would have published
    with pytest.raises(StreamError, match="never committed"):
        await read_manifest(tr.blobs, manifest_name(0, digest))


async def test_a_generator_killed_mid_assembly_leaves_a_temp_file_only(tiny_model_dir, tmp_path):
    tr = Trainer(tiny_model_dir, tmp_path, "float32", bucket_bytes=1 << 14)
    man, name = await tr.publish()
    stage = tmp_path / "stage"
    marker = tmp_path / "holding"
    script = textwrap.dedent(f"""
        import asyncio, pathlib, threading
        from rollart.engines.weight_decode import Undo, apply_manifest, assemble_version
        from rollart.engines.weight_blobs import DirBlobs

        class Slow(DirBlobs):
            n = 0
            async def get(self, name, max_bytes=None):
                self.n += 1
                if self.n == 4:  # the manifest and two buckets are in: hold here
                    pathlib.Path({str(marker)!r}).write_text("x")
                    await asyncio.Event().wait()
                return await super().get(name, max_bytes)

        asyncio.run(assemble_version(Slow({str(tr.blobs.root)!r}), {name!r}, {str(stage)!r},
                                     base=None, digest={man.digest!r}))
    """)

    def kill_mid_assembly() -> None:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
        try:
            until_sync(marker.exists, deadline=60, what="the generator mid-assembly",
                       abort=lambda: proc.poll() is not None and f"it exited with {proc.returncode}")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()

    await asyncio.to_thread(kill_mid_assembly)
    left = sorted(p.name for p in stage.iterdir())
    assert len(left) == 1 and left[0].startswith(".") and left[0].endswith(".tmp"), left
    got, _ = await assemble_version(tr.blobs, name, stage, base=None, digest=man.digest)
    assert same_tensors(got.path, tr.expected()) and got.digest == man.digest
    # the next one is written over a spare (here: a longer file) and cut to its own size
    spare = stage / SPARE
    spare.write_bytes(b"\xff" * (got.path.stat().st_size + 12345))
    retire(got.path)  # the spare is replaced by the staged file just made
    spare.write_bytes(b"\xff" * (spare.stat().st_size + 12345))
    again, _ = await assemble_version(tr.blobs, name, stage, base=None, digest=man.digest)
    assert not spare.exists() and same_tensors(again.path, tr.expected())
    assert staged_digest(again.path, man) == man.digest


async def test_bf16_delta_after_one_step_at_the_quickstart_lr_is_well_under_full(tmp_path):
    from transformers import AutoTokenizer

    from rollart.engines.tiny import build_tiny_model

    cfg = load(ROOT / "configs" / "quickstart.yaml", RunConfig)
    t = cfg.model.tiny
    model_dir = await asyncio.to_thread(
        build_tiny_model, tmp_path / "model", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        num_layers=t.num_layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        intermediate_size=t.intermediate_size, seed=t.seed)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    texts = ["FrozenLake\nSFFF\nFHFH\nFFFH\nHFFG\nD", "FrozenLake\nSFFF\nFPFH\nFFFH\nHFFG\nR"]
    ids = [tok.encode(x) for x in texts * 4]
    n = min(map(len, ids))
    batch = torch.tensor([i[:n] for i in ids])
    tr = Trainer(model_dir, tmp_path, "bfloat16", lr=cfg.trainer.lr)
    full, _ = await tr.publish()
    tr.step(batch)
    man, _ = await tr.publish()
    ratio = man.stats.wire_bytes / full.stats.full_bytes
    print(f"bf16 delta after one step at lr {cfg.trainer.lr}: {man.stats.wire_bytes} of "
          f"{full.stats.full_bytes} bytes ({ratio:.3f} of full; the anchor is "
          f"{full.stats.wire_bytes / full.stats.full_bytes:.3f}), "
          f"{man.stats.changed / man.stats.total:.3f} of the elements changed")
    assert man.kind == "delta" and ratio < 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_a_delta_streams_out_of_zstd_in_chunks_that_split_elements(tiny_model_dir, tmp_path,
                                                                         dtype, monkeypatch):
    """A delta bucket is never decoded whole: it is XORed into the base as it leaves zstd, in
    chunks; a chunk of an odd size splits elements and byte planes, and the result is still
    the trainer's tensors (the assembled digest is checked, and compared here)."""
    from rollart.engines import weight_decode

    monkeypatch.setattr(weight_decode, "_CHUNK", 777)
    tr = Trainer(tiny_model_dir, tmp_path, dtype, bucket_bytes=1 << 20)
    man0, name0 = await tr.publish()
    tr.step()
    man1, name1 = await tr.publish()
    assert man1.kind == "delta" and max(b.raw for b in man1.buckets) > 777
    stage = tmp_path / "stage"
    base, _ = await assemble_version(tr.blobs, name0, stage, base=None, digest=man0.digest)
    got, info = await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest)
    assert info["path"] == "delta" and same_tensors(got.path, tr.expected())


# ======================================================================================
# Deltas that cost what changed (issue 45 §2): unchanged buckets are not stored, fetched,
# read or written; a delta is patched into the held version's file in place, with an undo
# ======================================================================================
def touch_one(tr: Trainer, name: str) -> None:
    """A new version that differs from the last in one element of tensor ``name``."""
    with torch.no_grad():
        tr.model.state_dict()[name].view(-1)[0] += 1.0
    tr.version += 1


def bucket_ranges(man, header: int) -> list[tuple[int, int]]:
    out, pos = [], header
    for b in man.buckets:
        out.append((pos, pos + b.raw))
        pos += b.raw
    return out


async def test_a_delta_touching_one_tensor_rewrites_only_its_leaf(tiny_model_dir, tmp_path):
    from rollart.engines.torch_engine import TorchGenerationEngine
    from rollart.engines.weight_stream import header_bytes

    tr = Trainer(tiny_model_dir, tmp_path, "bfloat16", bucket_bytes=1 << 15, leaf_bytes=4096)
    man0, name0 = await tr.publish()
    target = "model.norm.weight"
    touch_one(tr, target)
    man1, name1 = await tr.publish()
    changed = [j for j, b in enumerate(man1.buckets) if b.codec != "same"]
    assert len(changed) == 1 and len(man1.buckets) > 20, "one bucket of many changed"
    j = changed[0]
    assert {man1.tensors[s.tensor].name for s in man1.buckets[j].spans} >= {target}
    assert all(b.wire == 0 and not (tr.blobs.root / b.name).exists()
               for b in man1.buckets if b.codec == "same"), "unchanged buckets are not stored"
    assert man1.stats.wire_bytes == man1.buckets[j].wire and man1.stats.changed == 1

    stage = tmp_path / "stage"
    base, _ = await assemble_version(tr.blobs, name0, stage, base=None, digest=man0.digest)
    before = base.path.read_bytes()
    got, info = await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest,
                                       in_place=True)
    assert info["path"] == "patch" and info["wire_bytes"] == man1.buckets[j].wire
    assert got.changed == {target} and got.undo is not None
    assert not base.path.exists() and got.path.exists(), "the held file, renamed to the version"
    after = got.path.read_bytes()
    lo, _ = bucket_ranges(man1, len(header_bytes(man1.tensors)))[j]
    diff = [i for i in range(len(before)) if before[i] != after[i]]
    assert len(after) == len(before) and diff, "the file changed"
    leaf = (diff[0] - lo) // 4096
    assert all((i - lo) // 4096 == leaf for i in diff) and diff[0] >= lo, "within one leaf"
    assert info["written_bytes"] == got.written == leaf_sizes(man1.buckets[j].raw, 4096)[leaf], \
        "only that leaf written, of a 32 KiB bucket"
    assert same_tensors(got.path, tr.expected()) and staged_digest(got.path, man1) == man1.digest

    # the engine reads only the named tensors: one that holds other weights keeps them
    eng = TorchGenerationEngine(tiny_model_dir, threads=1, dtype="bfloat16")
    own = eng.model.state_dict()
    keep = {k: v.clone() for k, v in own.items()}
    eng.load_weights(got.path, 1, changed=got.changed)
    exp = tr.expected()
    assert eng.version == 1 and torch.equal(own[target], exp[target])
    assert all(torch.equal(own[k], keep[k]) for k in own if k != target), "others not read"
    # over the version it holds (v0), the engine ends at the trainer's v1
    eng.load_weights(got.path, 1)  # a whole load: the reference
    whole = {k: v.clone() for k, v in own.items()}
    eng2 = TorchGenerationEngine(tiny_model_dir, threads=1, dtype="bfloat16")
    await asyncio.to_thread(got.undo.revert)
    assert base.path.read_bytes() == before and not got.path.exists(), "the undo puts v0 back"
    eng2.load_weights(base.path, 0)
    again, _ = await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest,
                                      in_place=True)
    eng2.load_weights(again.path, 1, changed=again.changed)
    assert all(torch.equal(eng2.model.state_dict()[k], whole[k]) for k in whole)


async def test_a_corrupt_delta_bucket_patched_in_place_leaves_the_old_version(tiny_model_dir,
                                                                            tmp_path):
    from rollart.engines.weight_stream import header_bytes

    tr = Trainer(tiny_model_dir, tmp_path, "float32", bucket_bytes=1 << 14)
    man0, name0 = await tr.publish()
    touch_one(tr, "model.norm.weight")
    touch_one(tr, "lm_head.weight")
    tr.version -= 1
    man1, name1 = await tr.publish()
    changed = [j for j, b in enumerate(man1.buckets) if b.codec != "same"]
    assert len(changed) == 2
    stage = tmp_path / "stage"
    base, _ = await assemble_version(tr.blobs, name0, stage, base=None, digest=man0.digest)
    before = base.path.read_bytes()
    # the second changed bucket is damaged in the store: the first was patched already
    j = changed[1]
    bad = tr.blobs.root / man1.buckets[j].name
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(StreamError) as e:
        await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest, in_place=True)
    assert f"bucket {j} ({man1.buckets[j].name})" in str(e.value), str(e.value)
    assert base.path.read_bytes() == before, "the held version is back, byte for byte"
    assert sorted(p.name for p in stage.iterdir() if p.name != SPARE) == [base.path.name]
    bad.write_bytes(bytes(data[:len(data) // 2]) + bytes([data[len(data) // 2] ^ 0xFF]) +
                    bytes(data[len(data) // 2 + 1:]))  # repaired

    # a held file that is not what it was verified as (its bytes changed on disk): the
    # decoded bucket's SHA-256 is not the manifest's; named, and the file left as it was
    k = changed[0]
    lo, _ = bucket_ranges(man1, len(header_bytes(man1.tensors)))[k]
    broken = bytearray(before)
    broken[lo] ^= 0x01
    base.path.write_bytes(bytes(broken))
    undo = Undo(base.path)
    with pytest.raises(StreamError) as e:
        await apply_manifest(tr.blobs, man1, stage, base, undo=undo)
    assert f"bucket {k} ({man1.buckets[k].name}): leaf 0: its decoded bytes have SHA-256" \
        in str(e.value)
    await asyncio.to_thread(undo.revert)
    assert base.path.read_bytes() == bytes(broken)
    # assemble_version reverts it itself and falls back to the anchor's chain (a new file)
    got, info = await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest,
                                       in_place=True)
    assert info["path"] == "chain" and info["manifests"] == 2 and got.undo is None
    assert base.path.read_bytes() == bytes(broken) and same_tensors(got.path, tr.expected())
    # repaired, it applies in place
    base.path.write_bytes(before)
    got, info = await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest,
                                       in_place=True)
    assert info["path"] == "patch" and same_tensors(got.path, tr.expected())


async def test_a_generator_two_versions_behind_walks_the_deltas_in_place(tiny_model_dir, tmp_path):
    tr = Trainer(tiny_model_dir, tmp_path, "bfloat16", bucket_bytes=1 << 14)
    pubs = [await tr.publish()]
    touch_one(tr, "model.norm.weight")
    pubs.append(await tr.publish())
    touch_one(tr, "lm_head.weight")
    pubs.append(await tr.publish())
    stage = tmp_path / "stage"
    base, _ = await assemble_version(tr.blobs, pubs[0][1], stage, base=None, digest=pubs[0][0].digest)
    before = base.path.read_bytes()
    man2, name2 = pubs[2]
    got, info = await assemble_version(tr.blobs, name2, stage, base=base, digest=man2.digest,
                                       in_place=True)
    assert info["path"] == "chain" and info["manifests"] == 2, info
    assert got.changed == {"model.norm.weight", "lm_head.weight"} and got.undo is not None
    assert info["written_bytes"] == sum(b.raw for m_, _ in pubs[1:] for b in m_.buckets
                                        if b.codec != "same")
    assert same_tensors(got.path, tr.expected()) and staged_digest(got.path, man2) == man2.digest
    assert sorted(p.name for p in stage.iterdir() if p.name != SPARE) == [got.path.name]
    await asyncio.to_thread(got.undo.revert)  # the engine refused v2: v0 as it was
    assert base.path.read_bytes() == before
    # without a base: the anchor written, the deltas patched into it
    got2, info2 = await assemble_version(tr.blobs, name2, tmp_path / "s2", base=None,
                                         digest=man2.digest, in_place=True)
    assert info2["path"] == "chain" and info2["manifests"] == 3
    assert got2.undo is None and got2.changed is None, "a file of its own: loaded whole"
    assert same_tensors(got2.path, tr.expected())
    assert sorted(p.name for p in (tmp_path / "s2").iterdir() if p.name != SPARE) == [got2.path.name]
    # a delta that changes most buckets is written into a new file, not patched
    tr.step()
    man3, name3 = await tr.publish()
    got3, info3 = await assemble_version(tr.blobs, name3, tmp_path / "s2", base=got2,
                                         digest=man3.digest, in_place=True)
    assert info3["path"] == "delta" and got3.undo is None and got3.changed is None
    assert got2.path.exists() and same_tensors(got3.path, tr.expected())


async def test_a_manifest_commits_to_its_bucket_digests(tiny_model_dir, tmp_path):
    import json

    tr = Trainer(tiny_model_dir, tmp_path, "float32", bucket_bytes=1 << 14)
    man, name = await tr.publish()
    # the trainer's digest is the bucket tree of the file it wrote (its next base)
    assert staged_digest(tr.dir / "base.safetensors", man) == man.digest
    raw = json.loads((tr.blobs.root / name).read_bytes())
    raw["buckets"][3]["leaves"][0] = "0" * 64
    (tr.blobs.root / name).write_text(json.dumps(raw))
    with pytest.raises(StreamError, match="is not the bucket tree"):
        await read_manifest(tr.blobs, name)


async def test_a_delta_that_rewrites_a_whole_tensor_is_patched_densely(tiny_model_dir, tmp_path):
    """Buckets most of whose bytes changed are read whole and compared leaf by leaf (the
    sparse scan would hold too many positions); the result is the same."""
    tr = Trainer(tiny_model_dir, tmp_path, "bfloat16", bucket_bytes=1 << 15, leaf_bytes=4096)
    man0, name0 = await tr.publish()
    target = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        tr.model.get_parameter(target).add_(1.0)
    tr.version += 1
    man1, name1 = await tr.publish()
    changed = [b for b in man1.buckets if b.codec != "same"]
    assert 1 < len(changed) and sum(b.raw for b in changed) < 0.5 * man1.stats.full_bytes
    stage = tmp_path / "stage"
    base, _ = await assemble_version(tr.blobs, name0, stage, base=None, digest=man0.digest)
    before = base.path.read_bytes()
    got, info = await assemble_version(tr.blobs, name1, stage, base=base, digest=man1.digest,
                                       in_place=True)
    assert info["path"] == "patch" and got.changed == {target}
    nbytes = dict(zip([t.name for t in man1.tensors], [t.nbytes for t in man1.tensors]))[target]
    assert nbytes <= info["written_bytes"] <= nbytes + 2 * 4096, "its leaves, no more"
    assert same_tensors(got.path, tr.expected()) and staged_digest(got.path, man1) == man1.digest
    await asyncio.to_thread(got.undo.revert)
    assert base.path.read_bytes() == before
