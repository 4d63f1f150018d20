"""The weight relay of a site (``python -m rollart.node --roles relay --site NAME``): one copy
of each policy version per site (issue 48, §2), served to the site's generators
(:mod:`rollart.engines.weight_relay` says what is checked and who may fetch); and the
generator's side of it, :func:`relay_route`.

The relay follows KV ``policy.version`` through the policy gate, as generators do
(:class:`~rollart.actors.kernel.policy_gate.PolicyGate`: a record's URI is where the relay
sends the trainer's token), and always mirrors the newest record it accepts: a relay that falls behind, or loses the link, takes the
newest version when it can (its chain of deltas back to a version it holds, or to the
anchor), never a queue of the versions it missed. A failed mirror is tried again with a
backoff (``retry_s`` doubling to ``max_retry_s``) or at once when a newer version is
announced. Once a version is whole it advertises ``relay.<site>`` (:class:`RelayInfo`); the
generators of the site wait for it there (``relay_wait`` seconds, serving their version
meanwhile) and fall back to the trainer's store, logging why once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import msgspec

from rollart import messages as m
from rollart.actors.kernel.base import Actor
from rollart.actors.kernel.policy_gate import PolicyGate, follow_policy
from rollart.actors.kernel.records import put_record
from rollart.bus import BusError
from rollart.engines.weight_blobs import blobs_for_uri
from rollart.engines.weight_limits import DEFAULT_LIMITS, StreamError
from rollart.engines.weight_relay import (KEEP_VERSIONS, RelayInfo, WeightMirror, read_relay,
                                          relay_access, relay_key)
from rollart.engines.weight_tcp_client import TcpBlobs, token_reader

log = logging.getLogger(__name__)

__all__ = ["WeightRelay", "relay_route"]


@dataclass(kw_only=True)
class WeightRelay(Actor):
    role = "relay"
    site: str = ""
    """The site it serves (``--site``): its KV record is ``relay.<site>``."""
    folder: str = ""
    """Where the versions are kept ("": a new temporary folder, removed at the end)."""
    host: str = ""
    """Address to listen on ("": ``advertise``)."""
    port: int = 0
    advertise: str = ""
    """Address the site's generators reach it at ("": this host's on the route to NATS)."""
    keep: int = KEEP_VERSIONS
    retry_s: float = 1.0
    max_retry_s: float = 30.0
    tls: Any = "auto"
    """Serve TLS (``trainer.sync.tls``: true, false, or ``auto``: when this node's NATS
    connection uses TLS, as the trainer's server): the record pins the relay's certificate."""
    stream_limits: Any = None
    mirror: WeightMirror | None = field(default=None, init=False, repr=False)
    server: Any = field(default=None, init=False, repr=False)
    _own_folder: bool = field(default=False, init=False, repr=False)
    _target: m.PolicyPublished | None = field(default=None, init=False, repr=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    mirrored: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False)
    """``(version, bytes fetched upstream)`` of each version mirrored."""

    @classmethod
    def from_config(cls, run_cfg: Any, actor_cfg: Any, *, pool: str, index: int = 0) -> WeightRelay:
        from rollart.engines.weight_limits import StreamLimits
        sync = run_cfg.trainer.sync
        return cls.configured(actor_cfg, dict(run=run_cfg.run, pool=pool,
                                              tls=sync.tls,
                                              stream_limits=StreamLimits.of(sync)))

    async def setup(self) -> None:
        relay_key(self.site)  # a ValueError naming a bad or missing site, now
        if not self.folder:
            self.folder = tempfile.mkdtemp(prefix=f"rollart-relay-{self.site}-")
            self._own_folder = True
        self.mirror = WeightMirror(self.folder, limits=self.stream_limits or DEFAULT_LIMITS,
                                   keep=self.keep)
        self.mirror.prune()  # a folder of an earlier relay: nothing in it is trusted
        # serving (with a token nobody holds until the first version's) and advertised from
        # the start: the site's generators wait for this relay rather than cross the link
        from rollart.engines.weight_tcp import advertised_host, tls_wanted
        from rollart.engines.weight_tcp_server import WeightServer

        advertise = self.advertise or advertised_host(getattr(self.bus, "url", None))
        self.server = WeightServer(self.folder, host=self.host or advertise, port=self.port,
                                   advertise=advertise,
                                   tls=tls_wanted(self.tls, getattr(self.bus, "settings", None)))
        await self.server.start()
        await self._advertise()

    async def main(self) -> None:
        async def accepted(pub: m.PolicyPublished) -> None:
            if pub.layout == "stream" and (self._target is None
                                           or pub.version >= self._target.version):
                self._target = pub
                self._wake.set()

        async def follow() -> None:  # through the gate, as generators: a record's URI is
            # where the relay sends the trainer's token, so only a plausible one is followed
            await follow_policy(self, PolicyGate(), accepted, announcements=True)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow())
            tg.create_task(self._mirror_loop())

    async def _mirror_loop(self) -> None:
        delay, done = self.retry_s, None
        while True:
            self._wake.clear()
            pub = self._target
            if pub is None or (pub.version, pub.digest) == done:
                await self._wake.wait()
                continue
            try:
                await self.take(pub)
                done, delay = (pub.version, pub.digest), self.retry_s
            except (StreamError, OSError, KeyError, BusError) as e:
                log.warning("relay %s: v%s not mirrored (again in %.1fs or when a newer version "
                            "is announced): %s", self.site, pub.version, delay, e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                delay = min(self.max_retry_s, 2 * delay)

    async def take(self, pub: m.PolicyPublished) -> None:
        """Mirror ``pub`` once, then serve it and advertise it."""
        upstream, name = await blobs_for_uri(self.bus, pub.uri, token_bucket=m.object_bucket(self.run))
        t0 = time.perf_counter()
        man, n = await self.mirror.take(upstream, name, pub.digest)
        await self._serve(upstream)
        self.mirror.prune()
        self.mirrored.append((man.version, n))
        log.info("relay %s: v%s mirrored (%.2f MiB over the link, %.3fs)", self.site, man.version,
                 n / 2**20, time.perf_counter() - t0)
        await self._advertise()

    async def _serve(self, upstream: Any) -> None:
        """Serve with the trainer's token from now on (read with the version: a restarted
        trainer's new token is taken at its first version)."""
        if isinstance(upstream, TcpBlobs) and upstream.token:
            token = upstream.token
        else:  # the object store: the token object is the trainer's all the same
            try:
                token = (await token_reader(self.bus, m.object_bucket(self.run))()).token
            except StreamError as e:
                raise StreamError(f"a relay serves with the token of the trainer's weight server "
                                  f"(trainer.weights: tcp or auto), and there is none: {e}") from None
        self.server.token = token  # the handler threads read it per request

    async def _advertise(self) -> None:
        info = self.mirror.record(self.site, self.server.base_uri, self.server.cert_sha256)
        await put_record(self.bus, self.run, relay_key(self.site), msgspec.json.encode(info),
                         what=f"relay {self.site} record", deadline=10.0, logger=log)

    async def teardown(self) -> None:
        if self.server is not None:
            with contextlib.suppress(BusError, OSError):
                kv = await self.bus.key_value(m.kv_bucket(self.run))
                await kv.delete(relay_key(self.site))
            await self.server.close()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)


async def _unreachable(info: RelayInfo) -> str:
    """Why the relay's address takes no connection ("": it does)."""
    import socket

    from rollart.engines.weight_tcp_client import parse_tcp_uri

    host, port, _, _ = parse_tcp_uri(info.uri + "/x")
    try:
        await asyncio.to_thread(lambda: socket.create_connection((host, port), 2.0).close())
    except OSError as e:
        return str(e) or type(e).__name__
    return ""


async def relay_route(bus: Any, run: str, site: str, pub: m.PolicyPublished, wait_s: float,
                      token_bucket: str) -> tuple[Any, str] | str:
    """The site's relay as a blob store for ``pub``: ``(blobs, manifest name)`` once the relay
    holds ``pub`` (waiting up to ``wait_s`` seconds for it; the engine serves meanwhile), else
    why not (a string: no relay advertised, a bad record, not there in time)."""
    from rollart.engines.weight_limits import check_blob_name
    from rollart.engines.weight_tcp_client import parse_tcp_uri

    try:
        name = check_blob_name(urlparse(pub.uri).path.rsplit("/", 1)[-1], "the version's manifest")
    except StreamError as e:
        return str(e)
    deadline = time.monotonic() + wait_s
    delay, checked = 0.05, False
    while True:
        try:
            info: RelayInfo | None = await read_relay(bus, run, site)
        except StreamError as e:
            return f"the relay record of site {site} is unusable: {e}"
        except BusError as e:  # the bus unanswered (the site's link cut, say): the trainer's
            # store is across that link too, so wait for the record as for the version
            if time.monotonic() >= deadline:
                return f"the relay record of site {site} could not be read for {wait_s:g}s: {e}"
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(1.0, 2 * delay)
            continue
        if info is None:
            return f"no relay advertised for site {site} (KV {relay_key(site)})"
        if info.version > pub.version or (info.version, info.digest) == (pub.version, pub.digest):
            break
        if not checked and (why := await _unreachable(info)):  # a killed relay's record
            return f"the relay of site {site} at {info.uri} is unreachable ({why})"
        checked = True
        left = deadline - time.monotonic()
        if left <= 0:
            return (f"the relay of site {site} holds v{info.version}, not v{pub.version}, after "
                    f"{wait_s:.0f}s")
        await asyncio.sleep(min(delay, left))  # a KV read per poll, backing off to 1 s
        delay = min(1.0, 2 * delay)
    host, port, _, _ = parse_tcp_uri(info.uri + "/x")
    trainer = token_reader(bus, token_bucket)
    blobs = TcpBlobs(host, port, None, token_source=relay_access(trainer, info))
    blobs.where = f"the weight relay of site {site} at {host}:{port}"
    return blobs, name
