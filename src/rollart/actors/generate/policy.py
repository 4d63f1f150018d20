"""How a generation replica follows the policy: which records it loads, when a refused one is
tried again (:class:`PolicyFollow`), and the loads themselves between the engine's
``pause()`` and ``resume()`` (:class:`PolicyLoading`, a part of
:class:`rollart.actors.generate.proxy.LLMProxy`)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from urllib.parse import urlparse
from pathlib import Path
from typing import Any

from rollart import messages as m
from rollart.actors.kernel.policy import current_policy, fetch_weights
from rollart.actors.kernel.policy_gate import PolicyGate, follow_policy
from rollart.bus import BusError
from rollart.bus.codec import DecodeError
from rollart.engines.base import AsyncEngine
from rollart.engines.weight_files import LORA_KIND, weights_kind
from rollart.engines.weight_staging import retire
from rollart.engines.weight_stream import DEFAULT_LIMITS, StreamError
from rollart.engines.weight_blobs import blobs_for_uri, local_blobs
from rollart.telemetry import tracing

log = logging.getLogger(__name__)


class StalePolicy(RuntimeError):
    """The proxy cannot serve a version as new as the request needs."""


class PolicyLoading:
    """The policy side of :class:`rollart.actors.generate.proxy.LLMProxy` (a mixin: the state it
    works on is declared, and set up, by the proxy; the names below say which)."""

    name: str
    pool: str
    run: str
    bus: Any
    on_update: str
    version_wait: float
    version: int
    async_engine: AsyncEngine | None
    gate: PolicyGate
    _follow: PolicyFollow
    _target: m.PolicyPublished | None
    _lock: asyncio.Lock
    _loaded: asyncio.Condition
    loads: list[tuple[int, float]]
    pauses: list[tuple[int, float]]
    _stage: StreamStage | None
    stream_limits: Any
    """What a streamed version may make this replica allocate and stage
    (:class:`~rollart.engines.weight_stream.StreamLimits`; None: the defaults)."""
    publish_patiently: Any
    site: str
    """The site this replica is at (``--site``; "": none): it reads streamed versions from
    the site's weight relay when one is up (:mod:`rollart.actors.generate.relay`)."""
    relay_wait: float

    @property
    def policy_follow(self) -> PolicyFollow:
        """Which policy records this replica loaded or refused, and its retry settings."""
        return self._follow

    async def _watch(self) -> None:
        """Follow KV ``policy.version`` through the policy gate (:class:`PolicyGate`: only
        versions the trainer's ledger and announcements confirm, one by one); load each newer
        version (and a version already loaded whose digest changed). A refused record is tried
        again when it is announced again (a new KV record, even an identical one) and
        otherwise after a backoff."""
        follow = self._follow

        async def accepted(pub: m.PolicyPublished) -> None:
            if follow.wanted(pub, self.version):
                self._target = pub
                follow.announced(pub)  # wakes loads()

        async def records() -> None:  # only what the gate accepts (see PolicyGate)
            await follow_policy(self, self.gate, accepted, announcements=True)

        async def loads() -> None:
            # Loads run here, not in the gate's callback: a slow or failed weight read must
            # not hold up judging the records after it (a newer version supersedes it).
            while True:
                follow.changed.clear()
                pub = self._target
                await self._maybe_load()
                if pub is not None and not follow.wanted(pub, self.version):
                    follow.refused.pop(follow.key(pub), None)  # superseded: no retry
                due = follow.due_at(self._target)
                timeout = None if due is None else max(0.0, due - time.monotonic())
                try:
                    await asyncio.wait_for(follow.changed.wait(), timeout)
                except TimeoutError:
                    pass

        async with asyncio.TaskGroup() as tg:
            tg.create_task(records())
            tg.create_task(loads())

    async def _maybe_load(self) -> None:
        """Load ``self._target`` if it is newer than the loaded weights: fetch it, then
        ``pause`` the engine (``wait`` or ``abort`` by ``on_update``), load, ``resume``.
        Never raises for a bad record or a failed status publish: a refused record keeps
        the old weights serving."""
        follow = self._follow
        pub = self._target
        if pub is None or not follow.wanted(pub, self.version) or follow.blocked(pub):
            return
        async with self._lock:
            if not follow.wanted(pub, self.version) or follow.blocked(pub):
                return
            t0 = time.perf_counter()
            staged = None
            fetch_s = pause_s = 0.0
            try:
                with tracing.span("policy.load", {"version": pub.version, "replica": self.name,
                                                  "on_update": self.on_update}):
                    # the engine serves meanwhile
                    if pub.layout == "stream":
                        if self._stage is None:
                            self._stage = await asyncio.to_thread(
                                StreamStage, self.name, token_bucket=m.object_bucket(self.run),
                                limits=self.stream_limits, run=self.run,
                                in_place=bool(getattr(self.async_engine, "partial_loads", False)),
                                site=self.site, relay_wait=self.relay_wait)
                        staged = await self._stage.fetch(self.bus, pub)
                        source: Any = staged.path
                        changed = staged.changed  # patched in place: only these differ
                    else:
                        source = await fetch_weights(self.bus, pub)
                        self._check_kind(source, pub)
                        changed = None
                    fetch_s = time.perf_counter() - t0
                    pause_s, apply_s = await self._load_paused(source, pub.version, changed)
                if staged is not None:
                    await asyncio.to_thread(self._stage.loaded, staged)
            except Exception as e:  # noqa: BLE001 - refuse, keep serving the old weights
                if staged is not None:
                    try:
                        await asyncio.to_thread(self._stage.discard, staged)
                    except OSError as d:  # the staged base is lost: the next version is assembled whole
                        log.warning("%s: could not put the staged v%s back (%s)", self.name,
                                    self.version, d)
                        self._stage.base = None
                tries, delay = follow.refuse(pub)
                log.error("%s refused policy v%s (try %d, again in %.0fs or when announced "
                          "again): %s", self.name, pub.version, tries, delay, e)
                report = m.PolicyLoaded(version=self.version, replica=self.name, pool=self.pool,
                                        error=str(e))
                msg_id = f"refused:{self.name}:{pub.version}:{pub.digest.rsplit(':', 1)[-1][:16]}:{tries}"
            else:
                dt = time.perf_counter() - t0
                follow.loaded_ok(pub)
                self.gate.loaded(pub)
                self.loads.append((pub.version, dt))
                self.pauses.append((pub.version, pause_s))
                log.info("%s loaded policy v%s in %.2fs (fetch%s %.3fs while serving; generation "
                         "paused %.3fs, of which the load %.3fs)%s", self.name, pub.version, dt,
                         "+assembly" if staged is not None else "", fetch_s, pause_s, apply_s,
                         f" [{self._stage.last}]" if staged is not None else "")
                report = m.PolicyLoaded(version=pub.version, replica=self.name, pool=self.pool,
                                        load_s=dt, fetch_s=fetch_s, pause_s=pause_s,
                                        route=self._stage.route if staged is not None else "")
                msg_id = f"loaded:{self.name}:{pub.version}:{pub.digest.rsplit(':', 1)[-1][:16]}"
        if not report.error:
            async with self._loaded:
                self._loaded.notify_all()
        await self._report_loaded(report, msg_id)

    async def _report_loaded(self, report: m.PolicyLoaded, msg_id: str) -> None:
        """Publish ``policy.loaded``: bus errors are retried briefly, then logged, never raised
        (a status report must not take the proxy down)."""
        try:
            await self.publish_patiently("policy.loaded", report, msg_id=msg_id,
                                         deadline=self._follow.report_deadline)
        except Exception as e:  # noqa: BLE001 - a lost status report is not fatal
            log.warning("%s: policy.loaded report (v%s%s) not published: %s", self.name,
                        report.version, ", refused" if report.error else "", e)

    def _check_kind(self, data: bytes, pub: m.PolicyPublished) -> None:
        """The file is what the record says (``kind``: full weights or a LoRA adapter), and an
        adapter goes only to an engine that applies adapters (``ValueError`` otherwise)."""
        kind = weights_kind(data)
        if kind != pub.kind:
            raise ValueError(f"policy v{pub.version} is announced as {pub.kind!r} weights but its "
                             f"file holds {kind!r} weights")
        if kind == LORA_KIND and not getattr(self.async_engine, "applies_adapters", False):
            raise ValueError(f"policy v{pub.version} is a LoRA adapter (trainer.lora) and this "
                             f"replica's engine ({type(self.async_engine).__name__}) applies none: "
                             f"the trainer publishes merged weights to engines that apply none")

    async def _load_paused(self, data: bytes | Path, version: int,
                           changed: Any = None) -> tuple[float, float]:
        """Load weights between ``pause()`` and ``resume()`` of the engine: ``finish`` waits
        for the requests in flight, ``interrupt`` aborts them (they continue afterwards, see
        :meth:`_serve`). A refused file raises; the engine resumes on its old weights.
        Returns the seconds from ``pause()`` to ``resume()`` returning (generation paused)
        and those of the load itself. ``changed``: the only tensors that differ from the
        weights held (a streamed delta patched in place; the engine's ``partial_loads``)."""
        eng = self.async_engine
        t0 = time.perf_counter()
        await eng.pause("abort" if self.on_update == "interrupt" else "wait")
        try:
            t1 = time.perf_counter()
            if changed is not None:
                await eng.load_weights(data, version, changed=changed)
            else:
                await eng.load_weights(data, version)
            apply_s = time.perf_counter() - t1
        finally:
            await eng.resume()
        return time.perf_counter() - t0, apply_s


    async def _check_reachable(self, v: int) -> None:
        """Refuse at once a ``min_version`` beyond the published policy (+1): no requester
        can have seen it, and waiting ``version_wait`` for it holds the caller for nothing."""
        known = max(self.version, self._target.version if self._target is not None else 0)
        if v <= known + 1:
            return
        try:  # the watch may lag: ask KV itself before refusing
            pub = await current_policy(self.bus, self.run)
        except (BusError, DecodeError):
            return
        latest = max(known, pub.version if pub is not None else 0)
        if v > latest + 1:
            raise ValueError(f"invalid: min_version {v} is beyond the published policy v{latest}")

    async def _wait_for_version(self, v: int) -> None:
        deadline = time.monotonic() + self.version_wait
        async with self._loaded:
            while self.version < v:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StalePolicy(f"{self.name} serves v{self.version}, request needs >= v{v}")
                try:
                    await asyncio.wait_for(self._loaded.wait(), left)
                except TimeoutError:
                    pass


class StreamStage:
    """A replica's streamed versions (``PolicyPublished.layout: stream``): a private staging
    folder where each version is assembled and checked
    (:func:`rollart.engines.weight_stream.assemble_version`) before the engine loads it, and
    the staged file of the version loaded, kept as the base of the next delta."""

    def __init__(self, name: str, *, token_bucket: str | None = None, limits: Any = None,
                 run: str = "", in_place: bool = False, site: str = "", relay_wait: float = 30.0):
        self.name = name
        self.site = site
        """The replica's site: versions come from its weight relay when it has them."""
        self.relay_wait = relay_wait
        """Seconds to wait for the relay to hold a version before the trainer's store."""
        self._why_not_relay = ""
        self.run = run
        """The run: a version's shared-memory folder must be one of its own."""
        self.dir = Path(tempfile.mkdtemp(prefix=f"rollart-stage-{name[:40]}-"))
        self.token_bucket = token_bucket
        """The run's weights store: where the trainer's weight server token is
        (``trainer.weights: tcp``)."""
        self.limits = limits
        """:class:`~rollart.engines.weight_stream.StreamLimits` (None: the defaults)."""
        self.base: Any = None
        """The :class:`~rollart.engines.weight_stream.Assembled` version the engine holds."""
        self.last = ""
        """How the last version was assembled (for the load's log line)."""
        self.route = ""
        """Where the last version was read from (``policy.loaded``'s ``route``)."""
        self._why_not_local = ""
        """Why the last version offered in shared memory was read another way (logged once
        per reason)."""
        self.in_place = in_place
        """The engine reads the staged file only inside a load (``partial_loads``): a delta is
        patched into the held version's file, and the engine loads the changed tensors."""
        self._whole = False
        """A load was refused: the engine may hold part of it, so the next load is whole."""

    async def fetch(self, bus: Any, pub: m.PolicyPublished) -> Any:
        """Assemble ``pub`` into the staging folder (off the loop; the engine serves)."""
        # optional dependency: xxhash and zstandard (the train extra), for
        # trainer.sync.format: stream only
        from rollart.engines.weight_decode import assemble_version

        if pub.kind != "full":
            raise ValueError(f"policy v{pub.version} is a {pub.kind!r} version in the stream "
                             f"layout: LoRA versions travel as single files")
        t0 = time.perf_counter()
        local = (await asyncio.to_thread(local_blobs, pub.local, self.run, pub.host)
                 if pub.local else "")
        if isinstance(local, tuple):
            (blobs, name), route = local, "shm"
        else:
            if pub.local and local != self._why_not_local:
                log.info("%s: policy v%s read from %s, not the trainer's shared memory: %s",
                         self.name, pub.version, urlparse(pub.uri).scheme, local)
                self._why_not_local = local
            got = await self._from_relay(bus, pub, assemble_version) if self.site else None
            if got is not None:
                (got, info), route = got, "relay"
            else:
                blobs, name = await blobs_for_uri(bus, pub.uri, token_bucket=self.token_bucket)
                route = {"obj": "object", "tcp": "tcp"}.get(urlparse(pub.uri).scheme, "file")
        if route != "relay":
            got, info = await assemble_version(blobs, name, self.dir, base=self.base,
                                               digest=pub.digest, in_place=self.in_place,
                                               limits=self.limits or DEFAULT_LIMITS)
        self.route = route
        self.last = (f"{info['path']}, {info['manifests']} manifest(s), "
                     f"{info['wire_bytes'] / 2**20:.2f} MiB fetched from {route}, "
                     f"{info['written_bytes'] / 2**20:.2f} MiB written, {time.perf_counter() - t0:.3f}s")
        return got._replace(changed=None) if self._whole else got

    async def _from_relay(self, bus: Any, pub: m.PolicyPublished, assemble: Any) -> Any:
        """``pub`` assembled from the site's relay, or None (why logged once per reason: no
        relay, not there in time, a failed fetch); the trainer's store is read then."""
        from rollart.actors.generate.relay import relay_route

        why = await relay_route(bus, self.run, self.site, pub, self.relay_wait,
                                self.token_bucket or m.object_bucket(self.run))
        if not isinstance(why, str):
            blobs, name = why
            try:
                got = await assemble(blobs, name, self.dir, base=self.base, digest=pub.digest,
                                     in_place=self.in_place, limits=self.limits or DEFAULT_LIMITS)
                self._why_not_relay = ""
                return got
            except (StreamError, OSError, KeyError) as e:  # the base is as it was
                why = f"{blobs.where}: {e}"
        if why != self._why_not_relay:
            log.info("%s: policy v%s read from the trainer's store, not site %s's relay: %s",
                     self.name, pub.version, self.site, why)
            self._why_not_relay = why
        return None

    def loaded(self, got: Any) -> None:
        """The engine holds ``got`` now: it is the base; the previous one is the folder's
        spare, which the next version is written over (:func:`~rollart.engines.weight_staging.retire`)."""
        old, self.base = self.base, got
        self._whole = False
        if got.undo is not None:  # patched over old's file: nothing of old is left to retire
            got.undo.drop()
            self.base = got._replace(undo=None, changed=None)
        elif old is not None and old.path != got.path:
            retire(old.path)

    def discard(self, got: Any) -> None:
        """A staged version the engine refused (patched in place: the held version's bytes
        and name are put back)."""
        self._whole = True
        if got.undo is not None:
            got.undo.revert()
        elif self.base is None or got.path != self.base.path:
            retire(got.path)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class PolicyFollow:
    """Which policy records a proxy loaded or refused; when a refused one is tried again."""

    first_retry = 2.0
    max_retry = 60.0
    report_deadline = 2.0
    """Seconds a ``policy.loaded`` report is retried (it delays the next batch meanwhile)."""

    def __init__(self) -> None:
        self.loaded: tuple[int, str] | None = None
        """``(version, digest)`` of the last record loaded."""
        self.refused: dict[tuple[int, str, str], tuple[float, int]] = {}
        """``(version, digest, uri)`` -> ``(monotonic time of the next try, tries)``."""
        self.changed = asyncio.Event()

    @staticmethod
    def key(pub: m.PolicyPublished) -> tuple[int, str, str]:
        return (pub.version, pub.digest, pub.uri)

    def wanted(self, pub: m.PolicyPublished, version: int) -> bool:
        return pub.version > version or (
            pub.version == version and self.loaded is not None
            and self.loaded != (pub.version, pub.digest))

    def blocked(self, pub: m.PolicyPublished) -> bool:
        r = self.refused.get(self.key(pub))
        return r is not None and time.monotonic() < r[0]

    def due_at(self, pub: m.PolicyPublished | None) -> float | None:
        r = self.refused.get(self.key(pub)) if pub is not None else None
        return None if r is None else r[0]

    def announced(self, pub: m.PolicyPublished) -> None:
        """A (re-)announced record: if it was refused, try it now."""
        r = self.refused.get(self.key(pub))
        if r is not None:
            self.refused[self.key(pub)] = (0.0, r[1])
        self.changed.set()

    def refuse(self, pub: m.PolicyPublished) -> tuple[int, float]:
        tries = self.refused.get(self.key(pub), (0.0, 0))[1] + 1
        delay = min(self.max_retry, self.first_retry * 2 ** (tries - 1))
        self.refused[self.key(pub)] = (time.monotonic() + delay, tries)
        self.changed.set()
        return tries, delay

    def loaded_ok(self, pub: m.PolicyPublished) -> None:
        self.loaded = (pub.version, pub.digest)
        self.refused = {k: r for k, r in self.refused.items() if k[0] > pub.version}
        self.changed.set()
