"""A forged policy record cannot make a weight holder read a device, follow a link, or learn
anything about a local file from the refusal (issue 43, the ``file://`` half of finding 2)."""

from __future__ import annotations

import os

import pytest

from rollart import messages as m
from rollart.actors.kernel.policy import DigestMismatch, fetch_weights
from rollart.engines.digest import sha256_digest

DIGEST = "tensors-sha256:" + "0" * 64


def record(path: str) -> m.PolicyPublished:
    return m.PolicyPublished(version=1, uri="file://" + path, digest=DIGEST)


async def test_a_device_is_refused_before_it_is_read(bus):
    with pytest.raises(DigestMismatch, match="not a regular file"):
        await fetch_weights(bus, record("/dev/zero"))


async def test_a_link_is_not_followed(bus, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 100)
    (tmp_path / "link").symlink_to(secret)
    with pytest.raises(DigestMismatch, match="cannot open") as e:
        await fetch_weights(bus, record(str(tmp_path / "link")))
    assert "100" not in str(e.value)


async def test_a_refusal_does_not_describe_the_file_it_named(bus, tmp_path):
    local = tmp_path / "private.txt"
    data = os.urandom(1234)
    local.write_bytes(data)
    with pytest.raises(DigestMismatch) as e:
        await fetch_weights(bus, record(str(local)))
    text = str(e.value)
    assert "do not match the published digest" in text
    assert "1234" not in text and sha256_digest(data).split(":")[1] not in text
    # the older file-bytes scheme: the digest of the local file is not echoed either
    with pytest.raises(DigestMismatch) as e:
        await fetch_weights(bus, m.PolicyPublished(version=1, uri="file://" + str(local),
                                                   digest="sha256:" + "1" * 64))
    assert sha256_digest(data).split(":")[1] not in str(e.value)


async def test_a_file_over_the_cap_is_refused_unread(bus, tmp_path):
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(10 << 20)  # sparse: the refusal must come from the size, not a read
    with pytest.raises(DigestMismatch, match="cap"):
        await fetch_weights(bus, record(str(big)), max_bytes=1 << 20)
