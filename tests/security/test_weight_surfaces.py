"""The weight surfaces fail closed (issue 43, findings 2, 3, 4 and the weight server's half of
9): streamed-weights manifests, the trainer's TCP weight server and its client, and the
policy gate's judgement of a version's URI.

Each test first reproduced its attack against the code before the fix (real files, real
sockets, real threads); the fuzz tests throw random manifests, request lines and server
answers at the same code and want a named refusal every time, never another exception."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import msgspec
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollart import messages as m
from rollart.actors.kernel.policy_gate import PolicyGate
from rollart.engines.digest import bucket_tree_digest
from rollart.engines.weight_decode import assemble_version
from rollart.engines.weight_staging import SPARE
from rollart.engines.weight_stream import (
    BucketEntry,
    Manifest,
    Span,
    StreamError,
    StreamLimits,
    StreamStats,
    TensorSpec,
    header_bytes,
    manifest_name,
    read_manifest,
)
from rollart.engines.weight_blobs import DirBlobs, blobs_for_uri
from rollart.engines.weight_tcp import TOKEN_OBJECT
from rollart.engines.weight_tcp_client import TcpBlobs, fetch_blob, parse_tcp_uri
from rollart.engines.weight_tcp_server import WeightServer
from tests.waiting import until, until_sync

ROOT = Path(__file__).resolve().parents[2]


# ======================================================================================
# Helpers: a real (tiny) streamed version on disk, written as the trainer writes one
# ======================================================================================
def _digest(data: bytes) -> str:
    """The digest of a version of one U8 tensor ``w`` holding ``data`` in one bucket."""
    return bucket_tree_digest(header_bytes([TensorSpec("w", "U8", [len(data)])]),
                              [(len(data), hashlib.sha256(data).hexdigest())])


def write_anchor(store: Path, data: bytes, version: int = 0) -> tuple[Manifest, str]:
    """An anchor of one U8 tensor ``w`` holding ``data``, in one raw bucket."""
    store.mkdir(parents=True, exist_ok=True)
    bname = f"stream.v{version:06d}-0000.b0000"
    (store / bname).write_bytes(data)
    digest = _digest(data)
    man = Manifest(version=version, kind="full", anchor=version, dtype="float32",
                   tensors=[TensorSpec("w", "U8", [len(data)])],
                   buckets=[BucketEntry(name=bname, raw=len(data), wire=len(data),
                                        xxh3=xxhash.xxh3_128_hexdigest(data),
                                        leaves=[hashlib.sha256(data).hexdigest()],
                                        spans=[Span(0, 0, len(data))], codec="raw")],
                   digest=digest, stats=StreamStats(changed=len(data), total=len(data),
                                                    wire_bytes=len(data), full_bytes=len(data),
                                                    encode_s=0.0))
    name = manifest_name(version, digest)
    (store / name).write_bytes(msgspec.json.encode(man))
    return man, name


def put_manifest(store: Path, name: str, man: dict) -> None:
    """A manifest as raw JSON: what a forger who can write the store writes."""
    store.mkdir(parents=True, exist_ok=True)
    (store / name).write_bytes(json.dumps(man).encode())


def files_under(root: Path, *, but: tuple[Path, ...]) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and not any(p.is_relative_to(b) for b in but)}


# ======================================================================================
# Finding 2: a manifest writes outside its staging folder, or echoes a local file
# ======================================================================================
async def test_a_parent_digest_that_is_a_path_writes_nothing_outside_the_stage(tmp_path):
    """``parent_digest: "x:../../../pwned/"`` named a parent manifest outside the store and
    a staged file outside the stage (attacker bytes were written there)."""
    store, stage = tmp_path / "a" / "store", tmp_path / "b" / "stage"
    write_anchor(store, b"base" * 64)
    evil = "x:../../../pwned/"
    # the forger's "parent": a full version whose digest is the path, and its bucket
    (store / "stream.v000000-..").mkdir(parents=True)  # the name's first component
    payload = b"ATTACKER" * 32
    (store / "stream.v000000-evil.b0000").write_bytes(payload)
    parent = {"version": 0, "kind": "full", "anchor": 0, "dtype": "float32",
              "tensors": [["w", "U8", [len(payload)]]],
              "buckets": [{"name": "stream.v000000-evil.b0000", "raw": len(payload),
                           "wire": len(payload), "xxh3": xxhash.xxh3_128_hexdigest(payload),
                           "leaves": ["0" * 64],
                           "spans": [[0, 0, len(payload)]], "codec": "raw"}],
              "digest": evil, "stats": {"changed": 1, "total": 1, "wire_bytes": 1,
                                        "full_bytes": 1, "encode_s": 0.0}}
    # <store>/stream.v000000-../../../pwned/.manifest is <store>/../pwned/.manifest
    put_manifest(store.parent / "pwned", ".manifest", parent)
    before = files_under(tmp_path, but=(store, stage))
    delta = dict(parent, version=1, kind="delta", parent_version=0, parent_digest=evil,
                 digest=_digest(payload))
    put_manifest(store, "stream.v000001-delta.manifest", delta)
    with pytest.raises(StreamError, match="parent_digest is not a content digest"):
        await assemble_version(DirBlobs(store, reuse=True), "stream.v000001-delta.manifest",
                               stage, base=None, digest=delta["digest"])
    assert files_under(tmp_path, but=(store, stage)) == before, "a file was written outside"


@pytest.mark.parametrize("field", ["digest", "parent_digest"])
@pytest.mark.parametrize("value", ["buckets-sha256:../../etc", "buckets-sha256:" + "A" * 64,
                                   "buckets-sha256:" + "0" * 63, "sha256:" + "0" * 64,
                                   "buckets-sha256:" + "0" * 64 + "/"])
async def test_digests_are_hex_of_the_right_length(tmp_path, field, value):
    man, _ = write_anchor(tmp_path / "s", b"x" * 16)
    raw = msgspec.to_builtins(man)
    raw.update(kind="delta", parent_version=0, parent_digest=man.digest, version=1)
    raw[field] = value
    put_manifest(tmp_path / "s", "m", raw)
    with pytest.raises(StreamError, match=f"{field} is not a content digest"):
        await read_manifest(DirBlobs(tmp_path / "s"), "m")


def test_a_manifest_name_is_never_built_from_a_bad_digest():
    with pytest.raises(StreamError, match="not a content digest"):
        manifest_name(0, "x:../../../pwned/")


@pytest.mark.parametrize("bucket", ["ABS", "../secret.txt", ".hidden", "a/b", ""])
async def test_a_bucket_named_by_a_path_is_refused_and_nothing_of_the_file_echoed(tmp_path, bucket):
    """A bucket named ``/etc/hostname`` on a ``file://`` store: the refusal (published in
    ``policy.loaded``) carried the size and XXH3 of the local file."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"s3cr3t-" * 111)  # 777 bytes
    store = tmp_path / "store"
    man, _ = write_anchor(store, b"y" * 32)
    raw = msgspec.to_builtins(man)
    raw["buckets"][0]["name"] = str(secret) if bucket == "ABS" else bucket
    put_manifest(store, "m", raw)
    with pytest.raises(StreamError) as e:
        await assemble_version(DirBlobs(store, reuse=True), "m", tmp_path / "stage", base=None,
                               digest=man.digest)
    text = str(e.value)
    assert "bucket 0 name" in text, text
    assert "777" not in text and xxhash.xxh3_128_hexdigest(secret.read_bytes()) not in text, text


@pytest.mark.parametrize(("size", "why"), [(100, "do not match the manifest"),
                                            (777, "larger than the 100 bytes expected"),
                                            (77, "do not match the manifest")])
async def test_a_bucket_that_does_not_match_says_so_without_its_size_or_hash(tmp_path, size, why):
    store = tmp_path / "store"
    man, name = write_anchor(store, b"z" * 100)
    other = b"q" * size
    (store / man.buckets[0].name).write_bytes(other)
    with pytest.raises(StreamError, match=why) as e:
        await assemble_version(DirBlobs(store, reuse=True), name, tmp_path / "stage", base=None,
                               digest=man.digest)
    assert xxhash.xxh3_128_hexdigest(other) not in str(e.value), "the hash of what was read"
    assert size == 100 or f"{size} " not in str(e.value), "the size of what was read"


@pytest.mark.parametrize("link", ["symbolic", "hard"])
async def test_staging_does_not_follow_a_spare_that_is_a_link(tmp_path, link):
    """The staged file was opened ``r+b`` over the folder's spare, following a symlink: a
    link planted there made the next version's bytes land in the file it points to."""
    store, stage = tmp_path / "store", tmp_path / "stage"
    man, name = write_anchor(store, b"w" * 4096)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious" * 1000)
    stage.mkdir()
    if link == "symbolic":
        (stage / SPARE).symlink_to(victim)
    else:
        os.link(victim, stage / SPARE)
    got, _ = await assemble_version(DirBlobs(store, reuse=True), name, stage, base=None,
                                    digest=man.digest)
    assert victim.read_bytes() == b"precious" * 1000, "the link was followed"
    assert got.path.parent == stage and not got.path.is_symlink()


async def test_a_stage_that_is_a_link_is_refused(tmp_path):
    store, real = tmp_path / "store", tmp_path / "elsewhere"
    man, name = write_anchor(store, b"v" * 64)
    real.mkdir()
    (tmp_path / "stage").symlink_to(real)
    with pytest.raises(StreamError, match="staging folder"):
        await assemble_version(DirBlobs(store, reuse=True), name, tmp_path / "stage", base=None,
                               digest=man.digest)
    assert not any(real.iterdir())


async def test_a_delta_chain_that_loops_is_refused(tmp_path):
    """A delta whose parent is itself (same version and digest) was walked forever."""
    store = tmp_path / "store"
    man, _ = write_anchor(store, b"l" * 64)
    raw = msgspec.to_builtins(man)
    raw.update(version=3, kind="delta", parent_version=3, parent_digest=man.digest, anchor=0)
    raw["buckets"][0]["codec"] = "zstd"
    name = manifest_name(3, man.digest)
    put_manifest(store, name, raw)
    with pytest.raises(StreamError, match="parent_version must be below"):
        await asyncio.wait_for(assemble_version(DirBlobs(store, reuse=True), name,
                                                tmp_path / "stage", base=None, digest=man.digest), 20)


# ======================================================================================
# Finding 3: memory set by the peer before any check
# ======================================================================================
_HWM = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    import msgspec, numpy, xxhash, zstandard
    from rollart.engines.weight_decode import assemble_version
    from rollart.engines.weight_blobs import DirBlobs
    from rollart.engines.weight_stream import StreamError

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    store, stage, raw = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    wire = zstandard.ZstdCompressor().compress(b"\\0" * 16)
    (store / "b0").write_bytes(wire)
    man = {"version": 0, "kind": "full", "anchor": 0, "dtype": "float32",
           "tensors": [["w", "U8", [raw]]],
           "buckets": [{"name": "b0", "raw": raw, "wire": len(wire),
                        "xxh3": xxhash.xxh3_128_hexdigest(wire), "leaves": ["0" * 64], "spans": [[0, 0, raw]],
                        "codec": "zstd"}],
           "digest": "buckets-sha256:" + "0" * 64,
           "stats": {"changed": 1, "total": 1, "wire_bytes": 1, "full_bytes": 1, "encode_s": 0}}
    (store / "m").write_bytes(json.dumps(man).encode())
    before = hwm()
    try:
        asyncio.run(assemble_version(DirBlobs(store, reuse=True), "m", stage, base=None,
                                     digest=man["digest"]))
        why = "accepted"
    except StreamError as e:
        why = str(e)
    print(json.dumps({"grew": hwm() - before, "why": why, "manifest_bytes": len(json.dumps(man))}))
""")


def test_a_small_manifest_cannot_make_the_decoder_allocate_its_sizes(tmp_path):
    """A ~500-byte manifest declaring a 768 MiB zstd bucket made the decoder allocate and
    zero-fill 768 MiB before its first check (the host has no swap)."""
    for d in ("store", "stage"):
        (tmp_path / d).mkdir()
    out = subprocess.run([sys.executable, "-c", _HWM, str(tmp_path / "store"),
                          str(tmp_path / "stage"), str(768 << 20)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"manifest {res['manifest_bytes']} B, peak RSS growth {res['grew'] / 2**20:.1f} MiB: "
          f"{res['why']}")
    assert res["grew"] < 32 << 20, res
    assert "bucket 0" in res["why"] and "max_bucket_mb" in res["why"], res


def test_the_caps_come_from_the_sync_settings():
    from rollart.config.trainer import SyncConfig

    lim = StreamLimits.of(SyncConfig(bucket_mb=8))
    assert lim.bucket_bytes == 16 << 20  # twice bucket_mb by default
    lim = StreamLimits.of(SyncConfig(bucket_mb=8, max_bucket_mb=100, max_version_gb=2))
    assert (lim.bucket_bytes, lim.version_bytes) == (100 << 20, 2 << 30)


async def test_a_manifest_beyond_the_version_cap_is_refused(tmp_path):
    man, name = write_anchor(tmp_path / "s", b"k" * 4096)
    with pytest.raises(StreamError, match="max_version_gb"):
        await read_manifest(DirBlobs(tmp_path / "s"), name,
                            StreamLimits(bucket_bytes=1 << 20, version_bytes=1024))
    with pytest.raises(StreamError, match="max_bucket_mb"):
        await read_manifest(DirBlobs(tmp_path / "s"), name,
                            StreamLimits(bucket_bytes=1024, version_bytes=1 << 20))


async def test_an_oversized_manifest_file_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "s").mkdir()
    with open(tmp_path / "s" / "m", "wb") as f:
        f.truncate(64 << 20)  # sparse: costs nothing on disk
    with pytest.raises(StreamError, match="larger than"):
        await read_manifest(DirBlobs(tmp_path / "s"), "m",
                            StreamLimits(bucket_bytes=1 << 20, version_bytes=1 << 30,
                                         manifest_bytes=1 << 20))


class FakeServer:
    """A hostile weight server: answers every request with ``answer`` (then closes)."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                try:
                    c.recv(600)
                    c.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept() (a close alone does not)
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


def test_the_client_refuses_an_announced_size_beyond_what_it_expects():
    """``OK <size>`` from the server became ``bytearray(size)``: a server (or a forged URI)
    announcing 2**60 bytes gave MemoryError; 20 GiB would have been allocated."""
    srv = FakeServer(b"OK 1152921504606846976\n")
    try:
        with pytest.raises(OSError, match="more than the 4096 bytes expected"):
            fetch_blob("127.0.0.1", srv.port, "t", "b", max_size=4096, stall_s=5.0)
    finally:
        srv.close()


async def test_tcp_blobs_bound_a_bucket_by_its_manifest_entry(tmp_path):
    (tmp_path / "b").write_bytes(b"x" * 5000)
    async with WeightServer(tmp_path) as srv:
        blobs = TcpBlobs("127.0.0.1", srv.port, srv.token)
        with pytest.raises(StreamError, match="more than the 100 bytes expected"):
            await blobs.get("b", max_bytes=100)
        assert len(await blobs.get("b", max_bytes=5000)) == 5000


async def test_object_blobs_bound_a_bucket_by_its_manifest_entry(memory_bus_only):
    from rollart.engines.weight_blobs import ObjectBlobs

    store = await memory_bus_only.object_store("B")
    await store.put("b", b"x" * 5000)
    blobs = ObjectBlobs(store, "B")
    with pytest.raises(StreamError, match="larger than the 100 bytes expected"):
        await blobs.get("b", max_bytes=100)
    with pytest.raises(StreamError, match="not a stream object name"):
        await blobs.get("../b")
    assert len(await blobs.get("b", max_bytes=5000)) == 5000


# ======================================================================================
# Finding 4: where the weight server listens, who learns its token, what the gate judges
# ======================================================================================
async def test_the_weight_server_binds_the_advertised_address_by_default(tmp_path):
    async with WeightServer(tmp_path) as srv:
        assert srv._server.server_address[0] == "127.0.0.1"
        assert srv.base_uri == f"tcp://127.0.0.1:{srv.port}"
    async with WeightServer(tmp_path, advertise="127.0.0.1") as srv:
        assert srv._server.server_address[0] == "127.0.0.1"
    async with WeightServer(tmp_path, host="0.0.0.0", advertise="127.0.0.1") as srv:  # asked for
        assert srv._server.server_address[0] == "0.0.0.0"


def test_the_sync_settings_bind_the_advertised_address_unless_told():
    from rollart.config.trainer import SyncConfig

    assert SyncConfig().host == ""


async def test_the_token_is_not_in_the_uri_and_travels_in_the_weights_store(tmp_path, memory_bus_only):
    """The token sat in the version's URI, which env, monitor and scheduler credentials read
    (KV ``policy.version``, ``policy.published``). Now it is an object of the run's weights
    store, which only the trainer and generate roles may read."""
    from rollart.security.permissions import OBJECTS

    bus, run = memory_bus_only, "tokrun"
    (tmp_path / "b").write_bytes(b"bucket")
    async with WeightServer(tmp_path) as srv:
        uri = srv.uri("b")
        assert srv.token not in uri and parse_tcp_uri(uri) == ("127.0.0.1", srv.port, "", "b")
        with pytest.raises(StreamError, match="token"):  # the trainer has not stored it yet
            blobs, name = await blobs_for_uri(bus, uri, token_bucket=m.object_bucket(run))
            await blobs.get(name)
        store = await bus.object_store(m.object_bucket(run))
        await store.put(TOKEN_OBJECT, srv.token.encode())
        blobs, name = await blobs_for_uri(bus, uri, token_bucket=m.object_bucket(run))
        assert bytes(await blobs.get(name)) == b"bucket"
        # a trainer restarted with a new token: the reader takes the new one from the store
        srv.token = "another-token-of-a-new-trainer"
        await store.put(TOKEN_OBJECT, srv.token.encode())
        assert bytes(await blobs.get(name)) == b"bucket"
    assert set(OBJECTS) == {"trainer", "generate"}, "who may read the token"


def _pub(v: int, uri: str, digest: str = "buckets-sha256:" + "a" * 64) -> m.PolicyPublished:
    return m.PolicyPublished(version=v, uri=uri, digest=digest, layout="stream")


def test_the_gate_judges_the_uri_of_an_announced_version():
    """The same version and digest with another URI (a forger's weight server) was accepted
    at once as announced."""
    gate = PolicyGate(digests=True)
    gate.watched_from_start()
    gate.see_ledger(m.LedgerSummary(version=1, steps_total=10))
    real = _pub(1, "tcp://127.0.0.1:4000/stream.v000001-aaaa.manifest")
    gate.see_announcement(real)
    forged = _pub(1, "tcp://10.9.9.9:4000/stream.v000001-aaaa.manifest")
    verdict, why, _ = gate.judge(forged, time.monotonic())
    assert verdict == "settle" and "announcement" in why, (verdict, why)
    assert gate.judge(real, time.monotonic())[0] == "accept"


# ======================================================================================
# Finding 9 (the weight server): slow or hostile peers hold resources
# ======================================================================================
def _answer(port: int, line: bytes, deadline: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=deadline) as s:
        s.sendall(line)
        out = b""
        while not out.endswith(b"\n"):
            c = s.recv(100)
            if not c:
                break
            out += c
        return out


async def test_a_non_ascii_token_is_refused_cleanly(tmp_path):
    """A non-ASCII token raised TypeError inside ``compare_digest`` in the handler thread
    (no answer, a traceback)."""
    (tmp_path / "b").write_bytes(b"x")
    async with WeightServer(tmp_path) as srv:
        got = await asyncio.to_thread(_answer, srv.port, "GET tökén b\n".encode())
        assert got == b"ERR bad token\n"
        got = await asyncio.to_thread(_answer, srv.port, b"GET \xff\xfe b\n")
        assert got == b"ERR bad token\n"


async def test_connections_beyond_the_cap_are_refused(tmp_path):
    (tmp_path / "b").write_bytes(b"x" * 10)
    async with WeightServer(tmp_path, max_connections=3, request_s=30.0) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        try:
            await until(lambda: srv.active == 3, deadline=10, what="3 connections held")
            got = await asyncio.to_thread(_answer, srv.port, f"GET {srv.token} b\n".encode())
            assert got == b"ERR busy\n"
        finally:
            for s in idle:
                s.close()
        await until(lambda: srv.active == 0, deadline=10, what="the held connections freed")
        got = await asyncio.to_thread(fetch_blob, "127.0.0.1", srv.port, srv.token, "b")
        assert bytes(got) == b"x" * 10


async def test_a_client_that_waits_for_a_free_place_gets_it(tmp_path):
    """``ERR busy`` is a wait, not a failure, for a real reader: it asks again until its
    stall deadline."""
    (tmp_path / "b").write_bytes(b"y" * 10)
    async with WeightServer(tmp_path, max_connections=1, request_s=30.0) as srv:
        hog = socket.create_connection(("127.0.0.1", srv.port))
        await until(lambda: srv.active == 1, deadline=10, what="the place taken")
        fut = asyncio.ensure_future(asyncio.to_thread(fetch_blob, "127.0.0.1", srv.port,
                                                      srv.token, "b", stall_s=20.0))
        await until(lambda: srv.refused_busy > 0, deadline=10, what="the reader refused once")
        hog.close()
        assert bytes(await fut) == b"y" * 10


async def test_a_trickled_request_line_is_cut_at_the_request_deadline(tmp_path):
    """A client sending a byte every 20 s was held for minutes: the timeout was per read."""
    (tmp_path / "b").write_bytes(b"x")
    async with WeightServer(tmp_path, request_s=1.0) as srv:
        def trickle() -> float:
            t0 = time.monotonic()
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.settimeout(0.3)
                for c in b"GET " + srv.token.encode():
                    try:
                        s.sendall(bytes([c]))
                        if s.recv(100) == b"" or time.monotonic() - t0 > 8:
                            break  # closed by the server (or the test gives up)
                    except TimeoutError:
                        continue
                    except OSError:
                        break
            return time.monotonic() - t0

        held = await asyncio.to_thread(trickle)
        assert held < 4.0, f"held {held:.1f}s with a 1s request deadline"
        await until(lambda: srv.active == 0, deadline=10, what="its place freed")


# ======================================================================================
# Fuzz: each surface ends in a named refusal
# ======================================================================================
_VALID_RAW = None


def _valid_raw() -> dict:
    global _VALID_RAW
    if _VALID_RAW is None:
        data = b"f" * 64
        digest = _digest(data)
        _VALID_RAW = {"version": 0, "kind": "full", "anchor": 0, "dtype": "float32",
                      "tensors": [["w", "U8", [64]]],
                      "buckets": [{"name": "b0", "raw": 64, "wire": 64,
                                   "xxh3": xxhash.xxh3_128_hexdigest(data), "leaves": ["0" * 64],
                                   "spans": [[0, 0, 64]], "codec": "raw"}],
                      "digest": digest, "stats": {"changed": 64, "total": 64, "wire_bytes": 64,
                                                  "full_bytes": 64, "encode_s": 0.0}}
    return json.loads(json.dumps(_VALID_RAW))


_JUNK = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
                     | st.floats(allow_nan=False) | st.text(max_size=40),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                         max_size=4),
                     max_leaves=12)
_PATHS = [("version",), ("kind",), ("anchor",), ("parent_version",), ("parent_digest",),
          ("digest",), ("tensors", 0, 0), ("tensors", 0, 1), ("tensors", 0, 2),
          ("tensors", 0, 2, 0), ("buckets", 0, "name"), ("buckets", 0, "raw"),
          ("buckets", 0, "wire"), ("buckets", 0, "xxh3"), ("buckets", 0, "spans", 0, 2),
          ("buckets", 0, "spans", 0, 1), ("buckets", 0, "codec"), ("tensors",), ("buckets",)]
_BIG = st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1, 10**30, -1, 0, 768 << 20])


@st.composite
def manifests(draw) -> bytes:
    how = draw(st.sampled_from(["mutate", "mutate", "big", "junk", "bytes"]))
    if how == "bytes":
        return draw(st.binary(max_size=300))
    if how == "junk":
        return json.dumps(draw(_JUNK)).encode()
    raw = _valid_raw()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_PATHS))
        value = draw(_BIG) if how == "big" else draw(_JUNK | _BIG | st.sampled_from(
            ["../x", "/etc/hostname", "x:../../../pwned/", "delta", "zstd", "F32"]))
        node = raw
        try:  # an earlier change may have replaced the way there
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            raw[path[0]] = value
    return json.dumps(raw).encode()


@settings(max_examples=150, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(manifests())
def test_fuzz_manifests_end_in_a_named_refusal(tmp_path_factory, raw):
    """Random and oversized manifests: a StreamError that says why, or (for an unchanged
    valid one) a staged version; never another exception, never a file outside the stage,
    never more memory than the caps allow."""
    root = tmp_path_factory.mktemp("fuzz")
    store, stage = root / "store", root / "stage"
    store.mkdir()
    (store / "b0").write_bytes(b"f" * 64)
    (store / "m").write_bytes(raw)
    lim = StreamLimits(bucket_bytes=1 << 20, version_bytes=4 << 20, manifest_bytes=1 << 16)

    async def go():
        return await assemble_version(DirBlobs(store, reuse=True), "m", stage, base=None,
                                      digest=_valid_raw()["digest"], limits=lim)

    tracemalloc.start()  # numpy's buffers are traced too
    try:
        got, _ = asyncio.run(go())
        assert got.path.parent == stage
    except StreamError as e:
        assert str(e), "a refusal says why"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # the caps (1 MiB a bucket) and the decoder's 4 MiB chunk, never a size from the manifest
    assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB allocated"
    assert files_under(root, but=(store, stage)) == set()


@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=600) | st.builds(lambda a, b, c: b"GET " + a + b" " + b + c,
                                           st.binary(max_size=40), st.binary(max_size=40),
                                           st.sampled_from([b"\n", b"", b" x\n", b"\r\n"])))
def test_fuzz_weight_server_request_lines(weight_server, line):
    """Any request line: ``ERR <reason>`` or a closed connection, never a crashed handler;
    the server serves the token holder afterwards."""
    srv = weight_server
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(line)
            s.shutdown(socket.SHUT_WR)
            out = b""
            while c := s.recv(4096):
                out += c
    except (ConnectionResetError, BrokenPipeError):
        out = b""
    assert out == b"" or out.startswith((b"ERR ", b"OK ")), out[:100]
    if out.startswith(b"OK "):
        assert line.split()[1] == srv.token.encode()
    assert bytes(fetch_blob("127.0.0.1", srv.port, srv.token, "b")) == b"served"


@pytest.fixture(scope="module")
def weight_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    (root / "b").write_bytes(b"served")
    srv = WeightServer(root, request_s=2.0)
    srv.start_sync()
    yield srv
    srv.close_sync()


@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200) | st.builds(lambda n, tail: b"OK " + n + b"\n" + tail,
                                           st.sampled_from([b"1", b"99999999999999999999999",
                                                            b"-5", b"0x10", b"1e9", b" 3",
                                                            b"\xff", b"4097", b"10"]),
                                           st.binary(max_size=64)))
def test_fuzz_weight_client_answers(answer):
    """Any server answer: the bytes (never more than asked for) or an OSError that says
    what was wrong, never a MemoryError or ValueError."""
    srv = FakeServer(answer)
    try:
        got = fetch_blob("127.0.0.1", srv.port, "t", "b", max_size=4096, stall_s=5.0)
        assert len(got) <= 4096
    except OSError as e:
        assert "weight server" in str(e)
    finally:
        srv.close()
