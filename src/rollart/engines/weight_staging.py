"""Staged files of streamed versions (:mod:`rollart.engines.weight_stream`): a safetensors
file written front to back with its content digest computed on the way, renamed into place
only when whole and right; the base file a delta reads; the byte planes deltas are stored as.
Shared by the trainer's side (:mod:`rollart.engines.weight_encode`, whose serving-dtype file
is the next delta's base) and the generator's (:mod:`rollart.engines.weight_decode`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .digest import bucket_tree_digest
from .weight_files import DTYPE_BYTES
from .weight_stream import Span, StreamError, TensorSpec, header_bytes

__all__ = ["SPARE", "BaseReader", "StagedFile", "byte_planes", "changed_elements", "retire"]

SPARE = ".spare.safetensors"
"""A staged file no one needs any more, kept in its folder to be written over by the next
:class:`StagedFile` there (see :func:`retire`)."""


def retire(path: str | os.PathLike) -> None:
    """Put a staged file no one needs (an old base, a refused or intermediate version) aside
    as its folder's spare instead of deleting it: the next staged file of the folder is
    written over its pages. Why: writing a model's worth of new pages runs at the page
    allocator's speed (~0.4 GB/s into a new file on this machine's disk, ~1.4 GB/s into a new
    one in /dev/shm), rewriting pages the file already has at memcpy's."""
    p = Path(path)
    with contextlib.suppress(FileNotFoundError):
        os.replace(p, p.parent / SPARE)


def _open_over_spare(tmp: Path) -> int:
    """A descriptor of ``tmp`` for writing: the folder's spare renamed to it (its pages), else
    a new file. Never through a link: a spare (or anything at ``tmp``) that is a symbolic
    link, a file with another name too (a hard link: an engine's folder may hold one of a
    retired version, :func:`~rollart.engines.weight_files.place_weights`) or no regular file
    is removed and a new file made, so nothing planted in a staging folder redirects a
    version's bytes elsewhere."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.replace(tmp.parent / SPARE, tmp)
        fd = os.open(tmp, flags | os.O_NONBLOCK)
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            os.set_blocking(fd, True)
            return fd
        os.close(fd)
    except FileNotFoundError:
        pass
    except OSError:  # ELOOP: a link; ENXIO and the like: a FIFO or device
        pass
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    return os.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o600)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

class StagedFile:
    """A safetensors file written front to back (header from the tensors, then their data
    in order, in pieces of any size) under a temp name, each leaf of ``sizes`` bytes
    hashed (SHA-256) on the way and checked against ``expect`` (its manifest's digests)
    when given (``bucket_of``: the bucket of each leaf, for the error); :meth:`commit`
    checks it is whole and its bucket-tree digest
    (:func:`rollart.engines.digest.bucket_tree_digest`) and renames it into place (no fsync:
    a staged file, or the trainer's base, is rebuilt after a crash, never trusted across
    one). Blocking.

    ``final`` None: no file, the digest alone (a trainer that sends no deltas needs no
    base)."""

    def __init__(self, final: str | os.PathLike | None, tensors: Sequence[TensorSpec],
                 sizes: Sequence[int], expect: Sequence[str] | None = None,
                 bucket_of: Sequence[int] | None = None):
        self.final = Path(final) if final is not None else None
        self.tensors = list(tensors)
        self.header = header_bytes(self.tensors)
        self.sizes = [int(n) for n in sizes]
        if sum(self.sizes) != sum(t.nbytes for t in self.tensors):
            raise StreamError(f"buckets of {sum(self.sizes)} bytes for tensors of "
                              f"{sum(t.nbytes for t in self.tensors)}")
        self.expect = list(expect) if expect is not None else None
        self.bucket_of = list(bucket_of) if bucket_of is not None else None
        self.digests: list[str] = []
        """Hex SHA-256 of each leaf hashed so far."""
        self._h = hashlib.sha256()
        self._left = self.sizes[0] if self.sizes else 0
        # SHA-256 (~1.5 GB/s) runs in its own thread, one piece behind the file write and the
        # caller's next fetch: SHA-256 and file writes release the GIL, so on two cores a
        # version assembles at the speed of the slower of the two, not of their sum. One
        # piece at a time: a caller may reuse a piece's buffer after the next write() returns
        # (TcpBlobs and DirBlobs(reuse=True) alternate two buffers for that).
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-digest")
        self._pending: concurrent.futures.Future | None = None
        self._f = None
        self._close_empty()
        if self.final is None:
            return
        self.tmp = self.final.with_name(f".{self.final.name}.{os.getpid()}.tmp")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(_open_over_spare(self.tmp), "r+b")  # noqa: SIM115 - closed in commit() or abort()
        self._f.write(self.header)

    @property
    def _name(self) -> str:
        return self.final.name if self.final is not None else "the version"

    def write(self, data: Any) -> None:
        """The next bytes of the data section (the buffer must stay unchanged until the next
        write() or commit() returns)."""
        mv = memoryview(data).cast("B")
        self._wait()
        self._pending = self._hasher.submit(self._hash, mv)
        if self._f is not None:
            self._f.write(mv)

    def _close_empty(self) -> None:
        while self._left == 0 and len(self.digests) < len(self.sizes):
            self._end_bucket()

    def _end_bucket(self) -> None:
        j, d = len(self.digests), self._h.hexdigest()
        if self.expect is not None and self.expect[j] != d:
            where = f"bucket {self.bucket_of[j]}, " if self.bucket_of is not None else ""
            raise StreamError(f"{where}leaf {j}: its bytes have SHA-256 {d}, the manifest says "
                              f"{self.expect[j]}")
        self.digests.append(d)
        self._h = hashlib.sha256()
        if len(self.digests) < len(self.sizes):
            self._left = self.sizes[len(self.digests)]

    def _hash(self, mv: memoryview) -> None:
        pos = 0
        while pos < len(mv):
            if len(self.digests) >= len(self.sizes):
                raise StreamError(f"{self._name}: more data than its tensors hold")
            n = min(self._left, len(mv) - pos)
            self._h.update(mv[pos:pos + n])
            pos += n
            self._left -= n
            self._close_empty()

    def _wait(self) -> None:
        """The previous piece hashed (its error raised here)."""
        if self._pending is not None:
            p, self._pending = self._pending, None
            p.result()

    def commit(self, expected: str | None = None) -> str:
        """Rename the whole file into place and return its digest; ``StreamError`` (and no
        file) when data is missing or the digest is not ``expected``."""
        try:
            self._wait()
            if len(self.digests) < len(self.sizes):
                raise StreamError(f"{self._name}: incomplete, leaf {len(self.digests)} "
                                  f"lacks {self._left} bytes")
            digest = bucket_tree_digest(self.header, zip(self.sizes, self.digests, strict=True))
            if expected is not None and digest != expected:
                raise StreamError(f"assembled digest {digest} is not the published {expected}")
            if self._f is not None:
                self._f.truncate()  # a spare written over may have been longer
                self._f.close()
                os.replace(self.tmp, self.final)
            self._hasher.shutdown()
            return digest
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._wait()
        self._hasher.shutdown()
        if self._f is None:
            return
        with contextlib.suppress(OSError):
            self._f.close()
        retire(self.tmp)  # garbage, but its pages serve the next one


class BaseReader:
    """Byte ranges of a base version's staged file, checked to have the given layout."""

    def __init__(self, path: Path, tensors: Sequence[TensorSpec], what: str):
        want = header_bytes(tensors)
        try:
            self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise StreamError(f"{what}: base {path} cannot be read: {e}") from None
        if self._f.read(len(want)) != want:
            self._f.close()
            raise StreamError(f"{what}: base {path.name} holds other tensors than the delta's")
        self._start = len(want)

    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        """``out`` filled with the ``len(out)`` data bytes from ``offset``."""
        self._f.seek(self._start + offset)
        if self._f.readinto(memoryview(out)) != len(out):
            raise StreamError(f"base file truncated at data byte {offset + len(out)}")
        return out

    def close(self) -> None:
        self._f.close()


def byte_planes(buf: np.ndarray, spans: Sequence[Span], tensors: Sequence[TensorSpec],
            *, undo: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """``buf`` (the bytes of ``spans``) with each span's elements split into byte planes
    (``undo``: joined back)."""
    out = np.empty_like(buf) if out is None else out
    pos = 0
    for s in spans:
        es = DTYPE_BYTES[tensors[s.tensor].dtype]
        seg = buf[pos:pos + s.length]
        dst = out[pos:pos + s.length]
        if es == 1:
            dst[...] = seg
        else:  # one plane at a time: contiguous on one side (a 2-D transposed copy is 6-15x slower)
            elements, planes = (dst.reshape(-1, es), seg.reshape(es, -1)) if undo else \
                (seg.reshape(-1, es), dst.reshape(es, -1))
            for k in range(es):
                if undo:
                    elements[:, k] = planes[k]
                else:
                    planes[k] = elements[:, k]
        pos += s.length
    return out


def changed_elements(xor: np.ndarray, spans: Sequence[Span], tensors: Sequence[TensorSpec]) -> int:
    n, pos = 0, 0
    for s in spans:
        es = DTYPE_BYTES[tensors[s.tensor].dtype]
        n += int(np.count_nonzero(xor[pos:pos + s.length].view(_UINT[es])))
        pos += s.length
    return n

