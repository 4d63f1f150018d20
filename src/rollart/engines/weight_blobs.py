"""Where a streamed version's manifest and buckets are kept: a folder (the run folder or
``/dev/shm``), the bus object store, or the trainer's weight server; :func:`blobs_for_uri`
picks one from a version's URI. The format they carry is :mod:`rollart.engines.weight_stream`."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import socket
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import numpy as np

from rollart.bus.base import ObjectTooLarge

from .safe_files import read_regular, read_regular_into
from .weight_limits import StreamError, check_blob_name
from .weight_tcp_client import TcpBlobs, parse_tcp_uri, token_reader

__all__ = ["Blobs", "Buffers", "DirBlobs", "ObjectBlobs", "ServedDirBlobs", "blobs_for_uri",
           "host_identity", "local_blobs", "shm_dir", "shm_key"]


# ======================================================================================
# Where versions are stored: a directory, or the run's object store
# ======================================================================================
class Blobs(Protocol):
    where: str

    async def get(self, name: str, max_bytes: int | None = None) -> bytes:
        """Raise ``KeyError`` when ``name`` is not stored, ``StreamError`` when ``name`` is no
        plain object name or (``max_bytes``) the object is larger, before reading it."""

    async def put(self, name: str, data: bytes) -> None: ...

    async def delete(self, name: str) -> None: ...

    async def exists(self, name: str) -> bool: ...

    def uri(self, name: str) -> str: ...



class Buffers:
    """Byte buffers reused bucket after bucket, ``n`` in turn: a buffer handed to
    :meth:`StagedFile.write` is hashed while the next bucket is made, so what goes there
    needs two. Why: a fresh 64 MiB buffer per bucket costs its page faults, which on this
    machine run at ~0.4 GB/s, slower than anything else a load does."""

    def __init__(self, n: int = 2):
        self._bufs: list[np.ndarray | None] = [None] * n
        self._i = 0

    def take(self, size: int) -> np.ndarray:
        i = self._i
        self._i = (i + 1) % len(self._bufs)
        b = self._bufs[i]
        if b is None or len(b) < size:
            b = self._bufs[i] = np.empty(size, np.uint8)
        return b[:size]



class DirBlobs:
    """Blobs as files of one directory (``<run>/weights/stream`` or ``/dev/shm/rollart-<run>``);
    each put is a temp file, then a rename (a reader sees a whole blob or none). No fsync:
    the order readers see (buckets, then the manifest that names them) holds in the page
    cache whatever happens to the trainer's process; a host that loses its page cache
    loses the trainer with it, which resumes from its checkpoint and publishes again (a
    generator that meets a torn bucket refuses it by its check). An fsync per bucket cost
    ~0.3 s per 150 MB on this machine's disk."""

    def __init__(self, root: str | os.PathLike, *, reuse: bool = False):
        self.root = Path(root)
        self.where = str(self.root)
        self._bufs = Buffers(2) if reuse else None
        """``reuse`` (a generator's assembler): :meth:`get` reads into two buffers in turn,
        so a blob's bytes stay valid until the second ``get`` after it (see Buffers)."""

    def _put(self, name: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.root / name)

    def _get(self, name: str, max_bytes: int | None) -> bytes | memoryview:
        path = self.root / check_blob_name(name, f"{name[:80]!r}")
        what = f"{name} in {self.where}"
        try:
            if self._bufs is None:
                return read_regular(path, max_bytes, what, StreamError)
            return memoryview(read_regular_into(path, max_bytes, what, StreamError,
                                                self._bufs.take))
        except FileNotFoundError:
            raise KeyError(name) from None

    async def get(self, name: str, max_bytes: int | None = None) -> bytes:
        return await asyncio.to_thread(self._get, name, max_bytes)

    async def put(self, name: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, name, data)

    async def delete(self, name: str) -> None:
        await asyncio.to_thread((self.root / name).unlink, missing_ok=True)

    async def exists(self, name: str) -> bool:
        return await asyncio.to_thread((self.root / name).exists)

    def uri(self, name: str) -> str:
        return (self.root / name).resolve().as_uri()



class ObjectBlobs:
    """Blobs in the run's object store (``trainer.weights: object``)."""

    def __init__(self, store: Any, bucket: str):
        self.store = store
        self.bucket = bucket
        self.where = f"object store {bucket}"

    async def get(self, name: str, max_bytes: int | None = None) -> bytes:
        check_blob_name(name, f"{name[:80]!r}")
        try:  # refused by the object's info before its chunks are read
            return await self.store.get(name, max_bytes=max_bytes)
        except ObjectTooLarge:
            raise StreamError(f"{name} in {self.where} is larger than the {max_bytes} bytes "
                              f"expected") from None

    async def put(self, name: str, data: bytes) -> None:
        await self.store.put(name, data if isinstance(data, bytes) else bytes(data))

    async def delete(self, name: str) -> None:
        await self.store.delete(name)

    async def exists(self, name: str) -> bool:
        return await self.store.exists(name)

    def uri(self, name: str) -> str:
        return f"obj://{self.bucket}/{name}"



class ServedDirBlobs(DirBlobs):
    """``trainer.weights: tcp``: the trainer's stream folder, written as a :class:`DirBlobs`,
    named to generators by the URIs of the weight server that serves it."""

    def __init__(self, root: str | os.PathLike, server: Any):
        super().__init__(root)
        self.server = server
        self.where = f"{self.root} (served at {server.base_uri})"

    def uri(self, name: str) -> str:
        return self.server.uri(name)



SHM = Path("/dev/shm")


def shm_key(run_folder: str | os.PathLike) -> str:
    """Twelve hex digits of the run folder's absolute path: two runs of the same name on one
    host (two users, two test workers) get two shared-memory folders."""
    return hashlib.sha256(str(Path(run_folder).resolve()).encode()).hexdigest()[:12]


def shm_dir(run: str, key: str = "") -> Path:
    """``trainer.weights: shm`` or ``auto``: where a run's streamed versions live on the
    trainer's host (``/dev/shm/rollart-<run>-<key>``, :func:`shm_key`)."""
    return SHM / (f"rollart-{run}-{key}" if key else f"rollart-{run}")


def host_identity() -> str:
    """Which host this process is on, for the weights' route (``trainer.weights: auto``): the
    kernel's boot id and the inode of the process's network namespace. Two processes with the
    same identity share a kernel and a network, so a network namespace counts as a host (as
    the test harness's hosts are); a same identity is still checked by finding the folder."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:64]
    except OSError:
        boot = socket.gethostname()[:64]
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    return f"{boot}/{net}"


def local_blobs(local: str, run: str, host: str) -> tuple[DirBlobs, str] | str:
    """The trainer's shared-memory folder behind a version's ``local`` URI, for a generator
    on the trainer's host: ``(blobs, manifest name)``, or why not (a string: another host,
    no such folder here, or a URI outside ``/dev/shm/rollart-<run>-*``, which is refused
    whatever the record says)."""
    if not local:
        return "the trainer offers no shared-memory folder"
    if host != host_identity():
        return "the trainer is on another host"
    u = urlparse(local)
    path = Path(unquote(u.path))
    folder = path.parent
    if (u.scheme != "file" or u.netloc or folder.parent != SHM
            or not re.fullmatch(rf"rollart-{re.escape(run)}-[0-9a-f]{{12}}", folder.name)
            or ".." in path.parts):
        return f"{local[:200]!r} is not a shared-memory folder of run {run!r}"
    try:
        check_blob_name(path.name, f"{path.name[:80]!r}")
    except StreamError as e:
        return str(e)
    if not folder.is_dir():
        return f"{folder} is not on this host (another /dev/shm)"
    return DirBlobs(folder, reuse=True), path.name



async def blobs_for_uri(bus: Any, uri: str, *, token_bucket: str | None = None) -> tuple[Any, str]:
    """The store and the manifest's name behind a stream version's uri (``file:///...``,
    ``obj://bucket/name`` or ``tcp://host:port/name``); ``StreamError`` for a shared-memory
    folder this host lacks. ``token_bucket``: the run's weights store
    (:func:`rollart.messages.object_bucket`), which holds the weight server's token (a
    ``tcp://`` uri carries none: :mod:`rollart.engines.weight_tcp`)."""
    u = urlparse(uri)
    if u.scheme == "file":
        path = Path(unquote(u.path))
        if path.parts[:3] == ("/", "dev", "shm") and not await asyncio.to_thread(path.parent.is_dir):
            raise StreamError(f"{uri}: the trainer's shared-memory folder {path.parent} is not on "
                              f"this host (trainer.weights: shm serves generators on the trainer's "
                              f"host only): use trainer.weights: auto or tcp for generators elsewhere")
        return DirBlobs(path.parent, reuse=True), path.name
    if u.scheme == "obj":
        return ObjectBlobs(await bus.object_store(u.netloc), u.netloc), u.path.lstrip("/")
    if u.scheme == "tcp":
        try:
            host, port, token, name = parse_tcp_uri(uri)
        except ValueError as e:
            raise StreamError(str(e)) from None
        if token:  # an older trainer's uri, the token in it
            return TcpBlobs(host, port, token), name
        if token_bucket is None:
            raise StreamError(f"{uri}: the weight server's token is in the run's weights store, "
                              f"and no store was given to read it from")
        return TcpBlobs(host, port, None, token_source=token_reader(bus, token_bucket)), name
    raise StreamError(f"unsupported stream uri {uri!r}: use file://, obj:// or tcp://")
