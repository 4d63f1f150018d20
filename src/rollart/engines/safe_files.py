"""One way to read a file whose name came from elsewhere: no link followed, nothing but a
regular file, and a size cap checked before a byte is read.

A weight record, a manifest, a request line or the run folder names the file, so what is
there may be a link to a secret, a FIFO (a read that blocks forever) or ``/dev/zero`` (a
read that never ends). Each reader used to open such a file its own way; this module is the
one way, so the checks cannot drift apart. A refusal names only ``what`` the caller calls the
file, never its size or content (that would tell a forger about a local file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO, TypeVar

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""No link followed; O_NONBLOCK so that opening a FIFO does not wait for a writer."""


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, max_bytes: int | None, what: str,
                 error: type[Exception] = OSError) -> Iterator[tuple[BinaryIO, int]]:
    """``(file, size)`` of the regular file at ``path`` (closed on exit).

    ``FileNotFoundError`` when nothing is there (callers treat absence their own way); else
    ``error`` naming ``what`` when it cannot be opened (a link, a permission), is not a
    regular file, or is larger than ``max_bytes`` (None: no cap)."""
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        why = "a link, not a regular file" if e.errno == errno.ELOOP else os.strerror(e.errno or 0)
        raise error(f"cannot open {what} ({why}; links are not followed)") from None
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise error(f"{what} is over its cap: larger than the {max_bytes} bytes expected")
        yield f, st.st_size  # type: ignore[misc]


Buf = TypeVar("Buf")


def read_regular(path: str | os.PathLike, max_bytes: int | None, what: str,
                 error: type[Exception] = OSError) -> bytes:
    """The whole of the regular file at ``path``, refused as :func:`open_regular` says, and
    as ``error`` when its size changed while it was read."""
    with open_regular(path, max_bytes, what, error) as (f, size):
        data = f.read(size + 1)
    if len(data) != size:
        raise error(f"{what} changed while it was read")
    return data


def read_regular_into(path: str | os.PathLike, max_bytes: int | None, what: str,
                      error: type[Exception], buffer: Callable[[int], Buf]) -> Buf:
    """:func:`read_regular` into ``buffer(size)``, a writable buffer of exactly ``size``
    bytes that the caller recycles (a fresh buffer per read costs its page faults)."""
    with open_regular(path, max_bytes, what, error) as (f, size):
        out = buffer(size)
        view = memoryview(out).cast("B")
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        if got != size or f.read(1):
            raise error(f"{what} changed while it was read")
    return out
