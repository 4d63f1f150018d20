"""What the trainer announces: the weights of each version (:class:`WeightPublisher`) and
the KV records only it writes, put back when another client changes them (:class:`KvGuard`).

Weights by content (DESIGN.md §5): the digest names the tensors, and a version's file is
written once, never rewritten.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any

from rollart import messages as m
from rollart.actors.kernel.base import Actor
from rollart.actors.kernel.policy import content_digest, file_content_digest, set_policy
from rollart.aio import retry
from rollart.bus import BusError, BusTimeout
from rollart.bus.codec import encode
from rollart.config import TrainerConfig, nats_settings
from rollart.telemetry import otel_metrics

log = logging.getLogger(__name__)

GUARDED_KEYS = (m.POLICY_KEY, m.LEDGER_KEY)
"""The KV keys only the trainer writes."""


class KvGuard:
    """The trainer's own records of :data:`GUARDED_KEYS`, and the watch that puts them back.

    The trainer is the only writer of ``policy.version`` and ``trainer.ledger``: when another
    client overwrote or deleted one, :meth:`guard` puts this trainer's record back, so a
    forged record lives milliseconds, and policy holders, which accept jumps and unannounced
    records only when they stay (:class:`rollart.actors.kernel.policy_gate.PolicyGate`), never take
    it. Only once this process wrote the key (before, it holds an earlier process's record).
    """

    def __init__(self, actor: Actor, counts: dict[str, int]):
        self.actor = actor
        self.counts = counts
        """The trainer's counters (``kv_restored`` is counted here)."""
        self.own: dict[str, deque[bytes]] = {k: deque(maxlen=256) for k in GUARDED_KEYS}
        """The latest records this process wrote per KV key (others are put back)."""

    def wrote(self, key: str, record: Any) -> None:
        """Remember ``record`` as this process's own (call it before the put)."""
        self.own[key].append(encode(record))

    async def guard(self, key: str) -> None:
        """Watch ``key`` and put this process's latest record back over another client's.
        Never raises."""
        a = self.actor
        own = self.own[key]
        last_log = 0.0
        try:
            kv = await a.bus.key_value(m.kv_bucket(a.run))
            # Revisions up to the one there now are an earlier process's (a resumed run) or this
            # one's: the watch may deliver them after this process wrote its own, so they are
            # no sign of another client.
            start = await kv.get(key)
            start_rev = start.revision if start is not None else 0
            async for e in kv.watch(key):
                if not own or e.revision <= start_rev or (not e.deleted and e.value in own):
                    continue
                self.counts["kv_restored"] += 1
                if time.monotonic() - last_log > 10.0:
                    last_log = time.monotonic()
                    log.error("%s: KV %s was %s by another client (revision %d); the trainer "
                              "puts its own record back (%d times so far)", a.name, key,
                              "deleted" if e.deleted else "overwritten", e.revision,
                              self.counts["kv_restored"])
                try:
                    await kv.put(key, own[-1])
                    await a.publish("dead", m.DeadLetter(
                        subject=f"{m.PREFIX}.{a.run}.kv.{key}", payload=e.value or b"",
                        reason=f"not_admitted: KV {key} revision {e.revision} was "
                               f"{'deleted' if e.deleted else 'written'} by another client "
                               f"than the trainer; its record was put back",
                        actor=a.name, kind="permanent"),
                        msg_id=f"dead:kv:{a.run}:{key}:{e.revision}")
                    otel_metrics.dead_letter("not_admitted: KV record put back")
                except BusError as err:
                    log.warning("%s: restoring KV %s failed: %s", a.name, key, err)
        except BusError as e:
            log.warning("%s: cannot guard KV %s: %s", a.name, key, e)


class WeightPublisher:
    """Announces the trainer's current weights: ``policy.published`` and KV ``policy.version``.

    A resume announces the existing file again (same content digest, so a replica that
    loaded it before keeps it). A file that holds other tensors than the model is left alone
    and the model goes to a new file name. Keeps ``keep_weights`` versions in the weights
    folder and, with ``trainer.weights: object``, in the object store.
    """

    def __init__(self, actor: Actor, cfg: TrainerConfig, weights: Path, backend: Any,
                 guard: KvGuard, announced_max: int = 0):
        self.actor = actor
        self.cfg = cfg
        self.weights = weights
        """The weights folder (``<run>/weights``)."""
        self.backend = backend
        """The training backend (:class:`rollart.engines.torch_trainer.TorchTrainBackend`)."""
        self.guard = guard
        self.announced: dict[int, str] = {}
        """Version -> digest of what this process announced."""
        self.announced_max = announced_max
        """The newest version this run's trainer announced (a version file is written before
        its announcement, and the newest is never deleted)."""
        self.prune_store = True
        """Delete old versions from the object store (off after the first refusal)."""
        self.stream = StreamPublisher(self) if cfg.sync.format == "stream" else None
        self.reports: dict[int, dict[str, m.PolicyLoaded]] = {}
        """Version -> replica -> its ``policy.loaded`` (see :meth:`loaded`)."""
        """``trainer.sync.format: stream``: versions as manifests and buckets."""

    async def publish(self) -> None:
        """Announce the backend's current version (see the class docstring)."""
        a, t, wdir = self.actor, self.cfg, self.weights
        v = self.backend.version
        if self.stream is not None and getattr(self.backend, "weights_kind", "full") == "full":
            await self.stream.publish(v)  # LoRA adapters (small) keep the single file
            return

        def existing(p: Path) -> str | None:
            try:
                return file_content_digest(p) if p.exists() else None
            except (OSError, ValueError) as e:  # torn or foreign: never overwrite it either
                return f"unreadable ({e})"

        path = wdir / f"v{v:06d}.safetensors"
        digest = await asyncio.to_thread(existing, path)
        if digest is not None:
            current = await asyncio.to_thread(self.backend.weights_digest)
            n = 0
            while digest is not None and digest != current:
                retrained = v % max(1, t.checkpoint_every) != 0 and v < t.steps
                (log.warning if retrained and n == 0 else log.error)(
                    "%s: %s holds other tensors (%s) than version %d of the model (%s)%s; "
                    "it is left as it is and the model is published under a new name",
                    a.name, path.name, digest, v, current,
                    ": this version was trained again after a resume from an earlier checkpoint"
                    if retrained else "")
                n += 1
                path = wdir / f"v{v:06d}-{current.rsplit(':', 1)[-1][:16]}" \
                              f"{'' if n == 1 else f'-{n}'}.safetensors"
                digest = await asyncio.to_thread(existing, path)
        reused = digest is not None
        if reused:
            log.info("%s: announcing the existing %s again (%s)", a.name, path.name, digest)
        else:
            digest = await asyncio.to_thread(self.backend.save_weights, path)
        uri = path.resolve().as_uri()
        store = None
        if t.weights == "object":
            name = path.name.removesuffix(".safetensors")
            store = await a.bus.object_store(m.object_bucket(a.run))
            same = False
            if reused:  # put only what the store does not hold yet: no rewrite under a reader
                try:
                    same = await asyncio.to_thread(content_digest, await store.get(name)) == digest
                except (KeyError, ValueError):
                    same = False
            if not same:
                await store.put(name, await asyncio.to_thread(path.read_bytes))
            uri = f"obj://{m.object_bucket(a.run)}/{name}"
        pub = m.PolicyPublished(version=v, uri=uri, digest=digest, created_at=time.time(),
                                kind=getattr(self.backend, "weights_kind", "full"))
        await self.announce(pub)
        await self._prune(v, path, store)

    def loaded(self, report: m.PolicyLoaded) -> None:
        """A replica's ``policy.loaded``: kept for :meth:`sync_row` (a few versions back)."""
        if not report.error:
            self.reports.setdefault(report.version, {})[report.replica] = report
            for old in [k for k in self.reports if k < report.version - 8]:
                del self.reports[old]

    def sync_row(self, v: int) -> dict[str, float]:
        """Metrics-row fields of version ``v``'s trip to the generators (``sync_*``): the
        longest generation pause and fetch among the replicas that reported loading it so
        far, how many did, and for a streamed version the changed-element fraction, wire
        bytes against full and encode seconds (none for v0, the model folder's weights)."""
        out: dict[str, float] = {}
        got = self.reports.get(v)
        if got:
            out.update(sync_version=float(v), sync_replicas=float(len(got)),
                       sync_pause_s_max=max(r.pause_s for r in got.values()),
                       sync_fetch_s_max=max(r.fetch_s for r in got.values()))
        if self.stream is not None and self.stream.last.get("version") == v:
            out.update({k: x for k, x in self.stream.last.items() if k != "version"},
                       sync_version=float(v))
        return out

    async def close(self) -> None:
        """Stop what serves weights (the weight server of ``trainer.weights: tcp``)."""
        if self.stream is not None:
            await self.stream.close()

    async def announce(self, pub: m.PolicyPublished) -> None:
        """``policy.published`` and KV ``policy.version`` for ``pub`` (whose weights are stored)."""
        a, v, digest = self.actor, pub.version, pub.digest
        self.announced[v] = digest
        self.announced_max = max(self.announced_max, v)
        self.guard.wrote(m.POLICY_KEY, pub)
        await a.publish_patiently("policy.published", pub,
                                  msg_id=f"policy:{a.run}:{v}:{digest.rsplit(':', 1)[-1][:16]}")
        await retry(lambda: set_policy(a.bus, a.run, pub), retry_on=BusError,
                    what=f"{a.name}: setting policy v{v}", attempts=60, base=0.2, cap=5.0,
                    logger=log)

    async def _prune(self, v: int, path: Path, store: Any) -> None:
        """Delete the versions older than the ``keep_weights`` newest (by version, never the
        file just announced), in the folder and in the object store."""
        t = self.cfg
        keep = max(1, t.keep_weights)
        for old in self.weights.glob("v*.safetensors"):
            ver = old.name[1:7]
            if old != path and ver.isdigit() and int(ver) <= v - keep:
                old.unlink(missing_ok=True)
                if store is not None and self.prune_store:  # no more versions than the folder
                    try:
                        await store.delete(old.name.removesuffix(".safetensors"))
                    except BusError as e:  # left behind, not fatal: the stream's data only
                        self.prune_store = False  # one wait and one line, not one per step
                        log.warning("%s: deleting %s from the object store failed (%s): old weights "
                                    "stay in the store from now on (under `rollart secure` "
                                    "credentials made without --run the trainer may not purge)",
                                    self.actor.name, old.name, e)


def _rotate(base: Path, nxt: Path) -> None:
    """``nxt`` becomes the base; the old base the folder's spare, written over by the next
    version (:func:`~rollart.engines.weight_staging.retire`: no new pages per version)."""
    from rollart.engines.weight_staging import retire  # optional dependency: numpy

    retire(base)
    nxt.replace(base)


class StreamPublisher:
    """``trainer.sync.format: stream``: each version as a manifest and buckets in the
    serving dtype (:mod:`rollart.engines.weight_stream`), a delta over the previous version
    between anchors. The previous version's serving-dtype file (``<run>/weights/stream-base``,
    on disk) is the base; without it (a fresh or resumed trainer) the version is an anchor.
    Keeps every version from the anchor that the ``keep_weights`` newest need."""

    def __init__(self, owner: WeightPublisher):
        self.owner = owner
        self.base: Any = None
        """:class:`~rollart.engines.weight_stream.TrainerBase` of the last version published."""
        self.versions: dict[int, tuple[int, list[str]]] = {}
        """Version -> (its anchor, its object names) of what this process stored."""
        self.last: dict[str, float] = {}
        """Stats of the last version (``stream_*``: changed fraction, wire/full, encode s)."""
        self._blobs: Any = None
        self._dtype: str | None = None
        self.server: Any = None
        """``trainer.weights: tcp`` or ``auto``: the
        :class:`~rollart.engines.weight_tcp_server.WeightServer`."""
        self.local: Path | None = None
        """``trainer.weights: auto``: the shared-memory folder the versions are written to
        (None: the run folder's ``weights/stream``, or another ``trainer.weights``)."""
        self.host = ""
        """This process's host identity (``trainer.weights: auto``)."""

    async def close(self) -> None:
        """Stop the weight server (``trainer.weights: tcp`` or ``auto``), if one runs, and
        remove the shared-memory folder of ``auto`` (memory, not disk: a killed trainer's
        folder is taken over by the resumed one, and gone at the next boot)."""
        if self.server is not None:
            await self.server.close()
            self.server = None
        if self.local is not None:
            await asyncio.to_thread(shutil.rmtree, self.local, True)
            self.local = None

    def _auto_root(self, nbytes: int) -> Path:
        """``trainer.weights: auto``: the shared-memory folder when ``/dev/shm`` has room for
        three full versions beyond what it holds, else the run folder (the reason logged)."""
        from rollart.engines import weight_blobs as ws  # optional dependency: numpy

        a, folder = self.owner.actor, self.owner.weights / "stream"
        try:
            st = os.statvfs(ws.SHM)
            free = st.f_bavail * st.f_frsize
        except OSError as e:
            log.warning("%s: no shared memory for weights (%s): versions go to %s", a.name, e,
                        folder)
            return folder
        shm = ws.shm_dir(a.run, ws.shm_key(self.owner.weights.parent))
        held = sum(p.stat().st_size for p in shm.glob("*") if p.is_file()) if shm.is_dir() else 0
        if free + held < 3 * nbytes:
            log.warning("%s: /dev/shm has %.2f GiB free, less than three versions (%.2f GiB): "
                        "versions go to %s", a.name, free / 2**30, 3 * nbytes / 2**30, folder)
            return folder
        shm.mkdir(mode=0o700, exist_ok=True)
        self.local = shm
        return shm

    async def blobs(self, nbytes: int = 0) -> Any:
        """Where versions are written (made at the first version; ``nbytes``: its size in
        the serving dtype, for ``trainer.weights: auto``'s room check)."""
        from rollart.engines import weight_blobs as ws  # optional dependency: numpy

        if self._blobs is None:
            a, t = self.owner.actor, self.owner.cfg
            if t.weights == "object":
                bucket = m.object_bucket(a.run)
                self._blobs = ws.ObjectBlobs(await a.bus.object_store(bucket), bucket)
            elif t.weights == "shm":
                self._blobs = ws.DirBlobs(ws.shm_dir(a.run, ws.shm_key(self.owner.weights.parent)))
            elif t.weights in ("tcp", "auto"):
                # deferred: trainer.sync.weights tcp only (its server, TLS, a token)
                from rollart.engines.weight_tcp import TOKEN_OBJECT, advertised_host, tls_wanted
                from rollart.engines.weight_tcp_server import WeightServer

                if t.weights == "auto":
                    root = await asyncio.to_thread(self._auto_root, nbytes)
                    self.host = ws.host_identity()
                else:
                    root = self.owner.weights / "stream"
                await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
                s = t.sync
                advertise = s.advertise or advertised_host(getattr(a.bus, "url", None))
                # the NATS settings the bus connected with (command-line overrides included),
                # else the config's (an in-process bus has none)
                nats = getattr(a.bus, "settings", None)
                if nats is None and getattr(a, "cfg", None) is not None:
                    nats = nats_settings(a.cfg)
                self.server = WeightServer(root, host=s.host or advertise, port=s.port,
                                           advertise=advertise, max_connections=s.max_connections,
                                           tls=tls_wanted(s.tls, nats))
                await self.server.start()
                # The token (and under TLS the certificate to pin) goes where only the roles
                # that read weights may read (the weights store, permissions.OBJECTS), not into
                # the version's URI, which every role reads (KV policy.version, policy.published).
                # retried like the policy record: a JetStream cluster electing a leader (a
                # server killed) answers nothing for seconds, and this is the first write
                # of a version's publish

                async def put_token() -> None:
                    store = await a.bus.object_store(m.object_bucket(a.run))
                    await store.put(TOKEN_OBJECT, self.server.access_object())

                await retry(put_token, retry_on=BusTimeout,
                            what=f"{a.name}: storing the weight server's token", attempts=60,
                            base=0.2, cap=5.0, logger=log)
                log.info("%s: weight server for generators at %s (listening on %s, %s)", a.name,
                         self.server.base_uri, self.server.host,
                         "TLS" if self.server.cert_sha256 else "cleartext")
                self._blobs = ws.ServedDirBlobs(root, self.server)
            else:
                self._blobs = ws.DirBlobs(self.owner.weights / "stream")
        return self._blobs

    def serving_dtype(self) -> str:
        # optional dependency: numpy
        from rollart.engines.weight_stream import serving_dtype

        if self._dtype is None:
            a = self.owner.actor
            cfg = getattr(a, "cfg", None)
            self._dtype = serving_dtype(cfg.proxy.dtype if cfg is not None else "auto",
                                        getattr(a, "model_dir", None))
        return self._dtype

    async def publish(self, v: int) -> None:
        # optional dependency: xxhash and zstandard (the train extra)
        from rollart.engines import weight_encode as enc

        owner, sync = self.owner, self.owner.cfg.sync
        a = owner.actor
        dtype = self.serving_dtype()
        tensors = await asyncio.to_thread(owner.backend.weight_tensors)
        width = 4 if dtype == "float32" else 2  # the serving dtype's bytes per element
        blobs = await self.blobs(sum(x.numel() for x in tensors.values()) * width)
        source = await asyncio.to_thread(enc.TorchTensors, tensors, dtype)
        base_path = owner.weights / "stream-base.safetensors"
        nxt = owner.weights / "stream-base.next.safetensors"
        base = self.base if self.base is not None and self.base.version < v else None
        man, name = await enc.write_version(
            blobs, source, version=v, dtype=dtype, bucket_bytes=int(sync.bucket_mb * 2**20),
            base=base, delta=sync.delta, anchor_every=sync.anchor_every,
            base_out=nxt if sync.delta else None)  # no deltas: no base to keep
        del tensors, source
        st = man.stats
        self.last = {"version": v, "stream_changed": st.changed / max(1, st.total),
                     "stream_wire_ratio": st.wire_bytes / max(1, st.full_bytes),
                     "stream_wire_bytes": float(st.wire_bytes), "stream_encode_s": st.encode_s}
        log.info("%s: v%d streamed as %s%s: %d buckets, %.2f MiB on the wire of %.2f MiB full "
                 "(%.1f%%), %.1f%% of the elements changed, encoded in %.3fs (%s, %s)",
                 a.name, v, "a delta over v" if man.kind == "delta" else "an anchor",
                 man.parent_version if man.kind == "delta" else "", len(man.buckets),
                 st.wire_bytes / 2**20, st.full_bytes / 2**20,
                 100 * st.wire_bytes / max(1, st.full_bytes), 100 * st.changed / max(1, st.total),
                 st.encode_s, dtype, blobs.where)
        local = (self.local / name).as_uri() if self.local is not None else ""
        pub = m.PolicyPublished(version=v, uri=blobs.uri(name), digest=man.digest,
                                created_at=time.time(), kind="full", layout="stream",
                                local=local, host=self.host if local else "")
        await owner.announce(pub)
        if sync.delta:
            await asyncio.to_thread(_rotate, base_path, nxt)  # the base of the next delta
            self.base = enc.TrainerBase(base_path, v, man.digest, man.anchor)
        self.versions[v] = (man.anchor, [name, *(b.name for b in man.buckets
                                                 if b.codec != "same")])  # manifest first
        await self._prune(v, blobs)

    async def _prune(self, v: int, blobs: Any) -> None:
        """Delete the versions below the anchor the ``keep_weights`` newest need."""
        keep = [k for k in self.versions if k > v - max(1, self.owner.cfg.keep_weights)]
        floor = min(self.versions[k][0] for k in keep)
        for old in [k for k in self.versions if k < floor]:
            try:
                for n in self.versions[old][1]:
                    await blobs.delete(n)
            except BusError as e:  # left behind, not fatal
                log.warning("%s: deleting stream version %d failed (%s)", self.owner.actor.name,
                            old, e)
                return
            del self.versions[old]
