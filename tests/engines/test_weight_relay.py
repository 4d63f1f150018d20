"""A site's weight relay (issue 48, §2/§3): each version crosses the link once, whatever the
number of generators at the site; a relay cut off mid-transfer, killed, or restarted
empty leaves every generator with a correct version. Real parts: the trainer's
:class:`WeightServer` over the stream folder a real tiny model's versions are written to, a
TCP proxy standing for the link, the relay actor on a bus, the generators' own
:class:`StreamStage`."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import msgspec
import pytest

from rollart import messages as m
from rollart.actors.generate.policy import StreamStage
from rollart.actors.generate.relay import WeightRelay
from rollart.actors.kernel.policy import set_policy
from rollart.engines.weight_relay import RelayInfo, decode_relay, relay_key
from rollart.engines.weight_stream import StreamError
from rollart.engines.weight_tcp import TOKEN_OBJECT
from rollart.engines.weight_tcp_server import WeightServer
from rollart.node import Node
from tests.actors.sample_actors import new_run
from tests.engines.test_weight_stream import Trainer, same_tensors
from tests.waiting import until

REPLICAS = 3


class Link:
    """A TCP proxy from a local port to ``target`` (the leaf link): counts the bytes it carried
    down; ``cut_after``: the first connection to carry that many bytes is closed there."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.down = 0
        self.cuts = 0
        self.cut_after: int | None = None
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(c,), daemon=True).start()

    def _pipe(self, c: socket.socket) -> None:
        with c, socket.create_connection(self.target) as s:
            threading.Thread(target=self._copy, args=(c, s), daemon=True).start()
            sent = 0
            while True:
                try:
                    data = s.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                cut = self.cut_after  # armed: the first connection to carry that many bytes
                if cut is not None and sent + len(data) >= cut:
                    self.cut_after = None
                    c.sendall(data[:cut - sent])
                    self.down += cut - sent
                    self.cuts += 1
                    c.shutdown(socket.SHUT_RDWR)
                    return
                c.sendall(data)
                sent += len(data)
                self.down += len(data)

    @staticmethod
    def _copy(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(4096):
                b.sendall(data)
        except OSError:
            pass

    def uri(self, name: str) -> str:
        return f"tcp://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        self._stop = True
        self.lsock.close()


async def _setup(bus, tmp_path, tiny_model_dir):
    run = new_run()
    tr = Trainer(tiny_model_dir, tmp_path, "float32", bucket_bytes=1 << 16)
    srv = WeightServer(tr.blobs.root, host="127.0.0.1")
    await srv.start()
    await (await bus.object_store(m.object_bucket(run))).put(TOKEN_OBJECT, srv.access_object())
    return run, tr, srv, Link(("127.0.0.1", srv.port))


async def _publish(bus, run, tr, link, step=True):
    if step:
        tr.step()
    man, name = await tr.publish()
    pub = m.PolicyPublished(version=tr.version, uri=link.uri(name), digest=man.digest,
                            layout="stream")
    await set_policy(bus, run, pub)
    return man, pub


async def _load_all(bus, stages, pub, man, tr):
    """Every replica fetches ``pub`` (concurrently, as replicas do) and holds it checked."""
    got = await asyncio.gather(*(s.fetch(bus, pub) for s in stages))
    for s, g in zip(stages, got, strict=True):
        assert g.digest == man.digest
        s.loaded(g)
    assert same_tensors(stages[0].base.path, tr.expected())
    return [s.route for s in stages]


async def test_a_relay_fetches_each_version_once_for_every_replica(memory_bus_only, tmp_path,
                                                                  tiny_model_dir):
    bus = memory_bus_only
    run, tr, srv, link = await _setup(bus, tmp_path, tiny_model_dir)
    relay = WeightRelay(run=run, site="gen", host="127.0.0.1", retry_s=0.1)
    stages = [StreamStage(f"g{i}", run=run, token_bucket=m.object_bucket(run), site="gen",
                          relay_wait=30.0, in_place=bool(i % 2)) for i in range(REPLICAS)]
    wire = 0
    try:
        async with Node(bus, [relay], heartbeat_every=0):
            for v in range(4):
                before = link.down
                man, pub = await _publish(bus, run, tr, link, step=v > 0)
                routes = await _load_all(bus, stages, pub, man, tr)
                assert routes == ["relay"] * REPLICAS
                wire += man.stats.wire_bytes
                crossed = link.down - before
                print(f"v{v} {man.kind}: {crossed} bytes crossed the link for {REPLICAS} replicas; "
                      f"version wire {man.stats.wire_bytes}, full {man.stats.full_bytes}")
                # once: the wire bytes plus the manifest (and the token), never per replica
                assert man.stats.wire_bytes <= crossed < man.stats.wire_bytes + (64 << 10)
            assert [v for v, _ in relay.mirrored] == [0, 1, 2, 3]
            info = decode_relay(bytes((await (await bus.key_value(m.kv_bucket(run))).get(
                relay_key("gen"))).value), "gen")
            assert (info.version, info.digest) == (3, man.digest)
            assert sum(n for _, n in relay.mirrored) < wire + (64 << 10) * 4
            # the same replicas without the relay: each crosses the link itself
            for s in stages:
                s.site = ""
            before = link.down
            man, pub = await _publish(bus, run, tr, link)
            assert await _load_all(bus, stages, pub, man, tr) == ["tcp"] * REPLICAS
            crossed = link.down - before
            print(f"v4 without the relay: {crossed} bytes crossed the link for {REPLICAS} replicas")
            assert crossed >= REPLICAS * man.stats.wire_bytes
    finally:
        for s in stages:
            s.close()
        link.close()
        await srv.close()


async def test_a_cut_link_and_a_killed_relay_leave_every_generator_a_correct_version(
        memory_bus_only, tmp_path, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="rollart.actors.generate.policy")
    bus = memory_bus_only
    run, tr, srv, link = await _setup(bus, tmp_path, tiny_model_dir)
    relay = WeightRelay(run=run, site="gen", host="127.0.0.1", retry_s=0.1)
    stages = [StreamStage(f"g{i}", run=run, token_bucket=m.object_bucket(run), site="gen",
                          relay_wait=30.0) for i in range(2)]
    try:
        async with Node(bus, [relay], heartbeat_every=0):
            man, pub = await _publish(bus, run, tr, link, step=False)
            assert await _load_all(bus, stages, pub, man, tr) == ["relay"] * 2
            # the link is cut mid-bucket while the relay mirrors v1: the relay tries again,
            # the generators keep v0 meanwhile and then load v1 from the relay
            link.cut_after = 30000  # past the manifest, inside the first bucket
            man, pub = await _publish(bus, run, tr, link)
            assert await _load_all(bus, stages, pub, man, tr) == ["relay"] * 2
            assert link.cuts == 1 and [v for v, _ in relay.mirrored] == [0, 1]
            # the relay killed (its server gone, its record left behind): the generators read
            # the trainer's store, logging why
            man, pub = await _publish(bus, run, tr, link)
            await until(lambda: relay.mirrored[-1][0] == 2, deadline=30, what="relay holds v2")
            relay.server.close_sync()
            assert await _load_all(bus, stages, pub, man, tr) == ["tcp"] * 2
            assert "not site gen's relay" in caplog.text
            stale = (await (await bus.key_value(m.kv_bucket(run))).get(relay_key("gen"))).value
        # killed without its teardown: its record stays, at an address nobody listens on;
        # the generators do not wait relay_wait for it
        await (await bus.key_value(m.kv_bucket(run))).put(relay_key("gen"), stale)
        man, pub = await _publish(bus, run, tr, link)
        t0 = time.monotonic()
        assert await _load_all(bus, stages, pub, man, tr) == ["tcp"] * 2
        assert time.monotonic() - t0 < 15 and "unreachable" in caplog.text
        # a relay started again (an empty folder) after a version it missed: it takes the
        # newest, walking its deltas back to the anchor, and serves it
        man, pub = await _publish(bus, run, tr, link)
        again = WeightRelay(run=run, site="gen", host="127.0.0.1", retry_s=0.1)
        async with Node(bus, [again], heartbeat_every=0):
            assert await _load_all(bus, stages, pub, man, tr) == ["relay"] * 2
            assert [v for v, _ in again.mirrored] == [4]
            assert len(again.mirror.held) == 5  # v0 (the anchor) .. v4
    finally:
        for s in stages:
            s.close()
        link.close()
        await srv.close()


def test_a_relay_record_is_decoded_typed_and_bounded():
    ok = RelayInfo(site="gen", uri="tcp://10.0.0.2:4100", version=3,
                   digest="buckets-sha256:" + "a" * 64)
    assert decode_relay(msgspec.json.encode(ok), "gen") == ok
    for raw, why in [(b"x" * 2000, "larger than"), (b'{"site":"gen","uri":"file:///etc"}', "not a relay"),
                     (msgspec.json.encode(ok), "site 'gen'")]:
        with pytest.raises(StreamError, match=why):
            decode_relay(raw, "other" if why.startswith("site") else "gen")
    with pytest.raises(ValueError, match="not a site name"):
        relay_key("../x")


async def test_a_damaged_bucket_or_another_digest_is_refused_and_nothing_is_served(
        tmp_path, tiny_model_dir):
    from rollart.engines.weight_relay import WeightMirror

    tr = Trainer(tiny_model_dir, tmp_path, "float32", bucket_bytes=1 << 16)
    man, name = await tr.publish()
    mirror = WeightMirror(tmp_path / "relay")
    with pytest.raises(StreamError, match="the published one is"):
        await mirror.take(tr.blobs, name, "buckets-sha256:" + "0" * 64)
    victim = tr.blobs.root / man.buckets[3].name
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 1
    victim.write_bytes(bytes(raw))
    with pytest.raises(StreamError, match=f"bucket {man.buckets[3].name} does not match"):
        await mirror.take(tr.blobs, name, man.digest)
    assert not any(p.name.endswith(".manifest") for p in (tmp_path / "relay").iterdir())
    assert mirror.newest is None and mirror.prune() == 3  # the three checked buckets go


async def test_a_generator_waits_for_its_relay_while_the_bus_does_not_answer():
    """The site's link cut: reading KV ``relay.<site>`` times out. The generator keeps waiting
    for the relay (within ``relay_wait``) instead of turning to the trainer's store, which is
    across the same link; a bus that stays silent past ``relay_wait`` is a reason to."""
    from rollart.actors.generate.relay import relay_route
    from rollart.bus import BusTimeout
    from rollart.engines.weight_stream import manifest_name

    digest = "buckets-sha256:" + "ab" * 32
    info = RelayInfo(site="gen", uri="tcp://127.0.0.1:9", version=1, digest=digest)
    pub = m.PolicyPublished(version=1, uri=f"tcp://10.0.0.1:5/{manifest_name(1, digest)}",
                            digest=digest, layout="stream")

    class Entry:
        value, deleted = msgspec.json.encode(info), False

    class KV:
        silent_until = 0.0

        async def get(self, key):
            assert key == relay_key("gen")
            if time.monotonic() < self.silent_until:
                raise BusTimeout("kv bucket X: timed out")
            return Entry()

    class Bus:
        kv = KV()

        async def key_value(self, bucket):
            return self.kv

    bus = Bus()
    bus.kv.silent_until = time.monotonic() + 0.5
    got = await relay_route(bus, "r1", "gen", pub, 10.0, "obj")
    assert not isinstance(got, str), got
    assert got[1] == manifest_name(1, digest) and got[0].port == 9
    bus.kv.silent_until = time.monotonic() + 60
    t0 = time.monotonic()
    why = await relay_route(bus, "r1", "gen", pub, 0.5, "obj")
    assert isinstance(why, str) and "could not be read for 0.5s" in why and "timed out" in why, why
    assert time.monotonic() - t0 < 5
