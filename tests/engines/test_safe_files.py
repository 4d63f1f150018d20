"""The one bounded, no-link file reader every reader of a file named from elsewhere uses."""

from __future__ import annotations

import os

import pytest

from rollart.engines.safe_files import open_regular, read_regular, read_regular_into


class Refused(Exception):
    pass


def test_a_regular_file_is_read_whole(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"abc" * 1000)
    assert read_regular(f, 3000, "blob", Refused) == b"abc" * 1000
    bufs = []
    out = read_regular_into(f, None, "blob", Refused, lambda n: bufs.append(bytearray(n)) or bufs[-1])
    assert out is bufs[0] and bytes(out) == b"abc" * 1000


def test_absence_is_file_not_found_for_the_caller_to_judge(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "none", None, "none", Refused)


def test_a_link_is_refused_not_followed(tmp_path):
    (tmp_path / "secret").write_bytes(b"s" * 123)
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(Refused, match=r"cannot open the link \(a link, not a regular file; "
                                      r"links are not followed\)") as e:
        read_regular(tmp_path / "link", None, "the link", Refused)
    assert "123" not in str(e.value)


def test_a_fifo_or_device_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a blocking open would hang here
    with pytest.raises(Refused, match="fifo is not a regular file"):
        read_regular(fifo, None, "fifo", Refused)
    with pytest.raises(Refused, match="is not a regular file"):
        read_regular("/dev/zero", None, "/dev/zero", Refused)


def test_the_cap_is_checked_before_a_byte_is_read(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(10 << 20)  # sparse
    with pytest.raises(Refused, match="big is over its cap: larger than the 1024 bytes expected"):
        read_regular(big, 1024, "big", Refused)
    taken = []
    with pytest.raises(Refused):
        read_regular_into(big, 1024, "big", Refused, lambda n: taken.append(n) or bytearray(n))
    assert taken == []  # no buffer asked for
    with open_regular(big, 10 << 20, "big", Refused) as (fh, size):
        assert size == 10 << 20 and fh.read(4) == b"\0" * 4
