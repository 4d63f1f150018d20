"""A site's copy of the streamed versions (issue 48, §2: each version crosses the link once):
the **weight relay** a site runs (``python -m rollart.node --roles relay --site NAME``,
:class:`rollart.actors.generate.relay.WeightRelay`) fetches each version's manifest and
buckets once from the trainer's store (the weight server, or the object store at the hub),
keeps them in a folder of its own and serves that folder to the site's generators with the
trainer's protocol (:class:`~rollart.engines.weight_tcp_server.WeightServer`).

What crosses, and what is checked:

- a version is mirrored as the trainer stored it: a delta's changed buckets only (``same``
  ones are never fetched), its parents back to a version the relay holds or to the anchor
  (a relay that was cut off catches up by that walk: one version's chain, however many
  versions it missed); every manifest is decoded typed and checked
  (:func:`~rollart.engines.weight_stream.read_manifest`: sizes within
  ``trainer.sync``'s caps before any bucket is fetched, the bucket tree makes the digest),
  the newest one must have the digest announced on the bus, and each bucket its manifest's
  wire size and XXH3 before it is kept. The generators check every leaf they assemble
  against the manifest as from the trainer, so the relay adds no trust in the bytes;
- the manifest is written last (the commit point, as at the trainer): a relay killed or
  cut off mid-version has buckets no manifest names, which the next prune removes;
- names are the manifest's checked object names (:data:`BLOB_NAME_RE`), joined to the
  relay's own folder only: nothing received becomes a path otherwise.

Who may fetch: the relay serves with the trainer's token (the ``weight-server.token``
object of the run's weights store, which only the trainer and generate roles may read; a
relay runs with a generate credential), so a generator asks the relay with the token it
already holds, and under TLS (the trainer's server has a certificate) the relay serves TLS
with a certificate of its own, pinned by the KV record it advertises (:class:`RelayInfo`,
key :func:`relay_key`). A trainer restarted with a new token: the relay reads it at its next
upstream refusal and serves with it from then on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import xxhash

from rollart import messages as m

from .weight_blobs import DirBlobs
from .weight_limits import DEFAULT_LIMITS, Digest, Size, StreamError, StreamLimits
from .weight_stream import Manifest, manifest_name, read_manifest
from .weight_tcp import WeightAccess

__all__ = ["KEEP_VERSIONS", "RELAY_PREFIX", "RelayInfo", "WeightMirror", "read_relay",
           "relay_access", "relay_key"]

log = logging.getLogger(__name__)

RELAY_PREFIX = "relay."
"""KV keys of the run's bucket that relays advertise themselves under (``relay.<site>``)."""
KEEP_VERSIONS = 4
"""Versions a relay keeps servable (each with the chain back to its anchor)."""
MAX_RECORD = 1024
"""Bytes a :class:`RelayInfo` record may hold (one is ~250)."""


class RelayInfo(msgspec.Struct, frozen=True, kw_only=True):
    """KV ``relay.<site>``: where a site's relay serves and the newest version it holds."""

    site: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    uri: Annotated[str, msgspec.Meta(pattern=r"^tcp://[A-Za-z0-9.:\[\]_-]{1,200}$")]
    """``tcp://host:port`` of its weight server."""
    cert_sha256: Annotated[str, msgspec.Meta(pattern=r"^(|[0-9a-f]{64})$")] = ""
    """Its certificate (TLS; "": cleartext, as the trainer's server)."""
    version: Size = 0
    digest: Annotated[str, msgspec.Meta(pattern=r"^(|buckets-sha256:[0-9a-f]{64})$")] = ""
    """The newest version it holds, whole (0 and "": none yet)."""
    at: float = 0.0


def relay_key(site: str) -> str:
    """The KV key of ``site``'s relay record (``site``: a run token: letters, digits, ``_-``)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", site or ""):
        raise ValueError(f"site {site[:80]!r} is not a site name (letters, digits, '_', '-')")
    return RELAY_PREFIX + site


def decode_relay(raw: bytes, site: str) -> RelayInfo:
    """A :class:`RelayInfo` from KV bytes (bounded, typed); ``StreamError`` else."""
    if len(raw) > MAX_RECORD:
        raise StreamError(f"KV {relay_key(site)} is larger than {MAX_RECORD} bytes")
    try:
        info = msgspec.json.decode(raw, type=RelayInfo)
    except msgspec.DecodeError as e:  # names the field, never the value
        raise StreamError(f"KV {relay_key(site)} is not a relay record ({str(e)[:120]})") from None
    if info.site != site:
        raise StreamError(f"KV {relay_key(site)} holds the record of site {info.site!r}")
    return info


async def read_relay(bus: Any, run: str, site: str) -> RelayInfo | None:
    """The relay record of ``site`` (None: no relay advertised)."""
    kv = await bus.key_value(m.kv_bucket(run))
    e = await kv.get(relay_key(site))
    if e is None or e.deleted or not e.value:
        return None
    return decode_relay(bytes(e.value), site)


def relay_access(trainer: Any, info: RelayInfo) -> Any:
    """A token source for a relay: the trainer's token (which the relay serves with) and the
    relay's certificate instead of the trainer's."""

    async def read() -> WeightAccess:
        a = await trainer()
        return WeightAccess(token=a.token, cert_sha256=info.cert_sha256)

    return read


def _check_wire(wire: Any, b: Any, what: str) -> None:
    if len(wire) != b.wire or xxhash.xxh3_128_hexdigest(wire) != b.xxh3:
        raise StreamError(f"{what}: bucket {b.name} does not match the manifest's {b.wire} bytes "
                          f"with xxh3 {b.xxh3} (damaged in transit, or replaced)")


class WeightMirror:
    """The relay's folder of versions: :meth:`take` mirrors one from an upstream store
    (any :class:`~rollart.engines.weight_blobs.Blobs`), :meth:`prune` keeps the newest
    :data:`KEEP_VERSIONS`. ``link_bytes``: what was fetched upstream so far."""

    def __init__(self, root: str | os.PathLike, *, limits: StreamLimits = DEFAULT_LIMITS,
                 keep: int = KEEP_VERSIONS):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = DirBlobs(self.root)
        self.limits = limits
        self.keep = max(1, keep)
        self.held: dict[str, Manifest] = {}
        """Manifest name -> manifest, of every version held whole."""
        self.newest: Manifest | None = None
        self.link_bytes = 0
        self.fetches = 0
        """Objects fetched upstream (manifests and buckets)."""
        self._stored: set[str] = set()
        """Buckets this mirror fetched, checked and wrote (a folder's older files are never
        trusted: :meth:`prune` removes them)."""

    async def _manifest(self, upstream: Any, name: str) -> Manifest:
        man = await read_manifest(upstream, name, self.limits)
        self.fetches += 1
        self.link_bytes += len(msgspec.json.encode(man))  # ~ the manifest's bytes
        return man

    async def take(self, upstream: Any, name: str, digest: Digest) -> tuple[Manifest, int]:
        """Mirror the version whose manifest is ``name`` (announced with ``digest``) and the
        parents it needs that the relay lacks; returns it and the bytes fetched for it.
        ``StreamError``/``OSError`` (the link, a bad version): nothing new is servable."""
        before = self.link_bytes
        if name in self.held:
            return self.held[name], 0
        man = await self._manifest(upstream, name)
        if man.digest != digest:
            raise StreamError(f"manifest {name} is of digest {man.digest}, the published one is {digest}")
        chain = [man]
        while chain[-1].kind == "delta":
            cur = chain[-1]
            pname = manifest_name(cur.parent_version or 0, cur.parent_digest)
            if pname in self.held:
                break
            try:
                parent = await self._manifest(upstream, pname)
            except StreamError as e:
                raise StreamError(f"incomplete: v{cur.parent_version} (parent of v{cur.version}): {e}") from None
            if parent.digest != cur.parent_digest or parent.version != cur.parent_version:
                raise StreamError(f"manifest {pname} is not the parent of v{cur.version}")
            chain.append(parent)
        for mm in reversed(chain):
            await self._store(upstream, mm)
        return man, self.link_bytes - before

    async def _store(self, upstream: Any, man: Manifest) -> None:
        what = f"v{man.version}"
        for b in man.buckets:
            if b.codec == "same" or b.name in self._stored:  # checked before a cut
                continue
            wire = await upstream.get(b.name, max_bytes=b.wire)
            self.fetches += 1
            self.link_bytes += len(wire)
            _check_wire(wire, b, what)
            await self.store.put(b.name, wire)  # a temp file, then a rename
            self._stored.add(b.name)
        name = manifest_name(man.version, man.digest)
        await self.store.put(name, msgspec.json.encode(man))  # the commit point
        self.held[name] = man
        if self.newest is None or man.version >= self.newest.version:
            self.newest = man

    def needed(self) -> set[str]:
        """The names the newest :attr:`keep` versions need (their chains to their anchors)."""
        out: set[str] = set()
        for name, man in sorted(self.held.items(), key=lambda kv: -kv[1].version)[:self.keep]:
            cur: Manifest | None = man
            while cur is not None:
                out.add(manifest_name(cur.version, cur.digest))
                out.update(b.name for b in cur.buckets if b.codec != "same")
                pname = (manifest_name(cur.parent_version or 0, cur.parent_digest)
                         if cur.kind == "delta" else None)
                cur = self.held.get(pname) if pname else None
        return out

    def prune(self) -> int:
        """Delete every file of the folder no kept version needs (older versions, buckets of
        a version cut off before its manifest); returns how many."""
        keep = self.needed()
        self.held = {n: mm for n, mm in self.held.items() if n in keep}
        self._stored &= keep
        gone = 0
        for p in self.root.iterdir():
            if p.name not in keep and (p.name.startswith("stream.") or p.name.startswith(".stream.")):
                with contextlib.suppress(OSError):
                    p.unlink()
                    gone += 1
        return gone

    def record(self, site: str, uri: str, cert_sha256: str) -> RelayInfo:
        newest = self.newest
        return RelayInfo(site=site, uri=uri, cert_sha256=cert_sha256,
                         version=newest.version if newest else 0,
                         digest=newest.digest if newest else "", at=time.time())
