"""``trainer.weights: auto``: a version's ``local`` URI (the trainer's shared-memory folder)
is used only by a generator on the trainer's host, and only inside the run's own folder."""

from __future__ import annotations

import shutil

import msgspec
import pytest

from rollart import messages as m
from rollart.bus.codec import DecodeError, decode, encode
from rollart.engines.weight_blobs import (
    SHM,
    DirBlobs,
    host_identity,
    local_blobs,
    shm_dir,
    shm_key,
)
from tests.actors.sample_actors import new_run

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this host")


@pytest.fixture
def folder(tmp_path):
    run = new_run()
    d = shm_dir(run, shm_key(tmp_path))
    d.mkdir()
    (d / "stream.v000001-abc.manifest").write_bytes(b"{}")
    yield run, d
    shutil.rmtree(d, ignore_errors=True)


def test_same_host_reads_the_folder(folder):
    run, d = folder
    got = local_blobs((d / "stream.v000001-abc.manifest").as_uri(), run, host_identity())
    assert isinstance(got, tuple), got
    blobs, name = got
    assert isinstance(blobs, DirBlobs) and blobs.root == d and name == "stream.v000001-abc.manifest"


def test_another_host_or_no_offer_reads_over_the_network(folder):
    run, d = folder
    uri = (d / "stream.v000001-abc.manifest").as_uri()
    assert local_blobs(uri, run, "another-boot/123") == "the trainer is on another host"
    assert local_blobs("", run, host_identity()) == "the trainer offers no shared-memory folder"


def test_same_identity_without_the_folder_says_another_shm(tmp_path):
    run = new_run()
    d = shm_dir(run, shm_key(tmp_path))  # never made: a container with its own /dev/shm
    why = local_blobs((d / "stream.v1.manifest").as_uri(), run, host_identity())
    assert isinstance(why, str) and "another /dev/shm" in why


@pytest.mark.parametrize("uri", [
    "file:///dev/shm/rollart-{other}-0123456789ab/stream.v1.manifest",  # another run's folder
    "file:///dev/shm/rollart-{run}-0123456789ab/../x/stream.v1.manifest",
    "file:///dev/shm/rollart-{run}/stream.v1.manifest",  # no key
    "file:///dev/shm/stream.v1.manifest",
    "file:///tmp/rollart-{run}-0123456789ab/stream.v1.manifest",
    "file://host/dev/shm/rollart-{run}-0123456789ab/stream.v1.manifest",
    "file:///dev/shm/rollart-{run}-0123456789ab/.hidden",
])
def test_a_local_uri_outside_the_runs_folder_is_refused(uri):
    run = new_run()
    why = local_blobs(uri.format(run=run, other=new_run()), run, host_identity())
    assert isinstance(why, str), why


def test_the_record_bounds_its_local_uri():
    pub = m.PolicyPublished(version=1, uri="tcp://127.0.0.1:1/x", digest="tensors-sha256:ab",
                            layout="stream", local="file:///dev/shm/rollart-r-0123456789ab/x",
                            host=host_identity())
    assert decode(m.PolicyPublished, encode(pub)) == pub
    for bad in ("file:///etc/passwd", "file:///dev/shm/a/b/c", "tcp://h:1/x"):
        raw = encode(msgspec.structs.replace(pub, local=bad))
        with pytest.raises(DecodeError):
            decode(m.PolicyPublished, raw)
