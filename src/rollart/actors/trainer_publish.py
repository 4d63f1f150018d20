"""What the trainer announces: the weights of each version (:class:`WeightPublisher`) and
the KV records only it writes, put back when another client changes them (:class:`KvGuard`).

Weights by content (DESIGN.md §5): the digest names the tensors, and a version's file is
written once, never rewritten.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from rollart import messages as m
from rollart.actors.base import Actor
from rollart.actors.policy import content_digest, file_content_digest, set_policy
from rollart.aio import retry
from rollart.bus import BusError
from rollart.bus.codec import encode
from rollart.config import TrainerConfig
from rollart.telemetry import otel_metrics

log = logging.getLogger("rollart.actors.trainer")  # the trainer's log lines, wherever written

GUARDED_KEYS = (m.POLICY_KEY, m.LEDGER_KEY)
"""The KV keys only the trainer writes."""


class KvGuard:
    """The trainer's own records of :data:`GUARDED_KEYS`, and the watch that puts them back.

    The trainer is the only writer of ``policy.version`` and ``trainer.ledger``: when another
    client overwrote or deleted one, :meth:`guard` puts this trainer's record back, so a
    forged record lives milliseconds, and policy holders, which accept jumps and unannounced
    records only when they stay (:class:`rollart.actors.policy_gate.PolicyGate`), never take
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

    async def publish(self) -> None:
        """Announce the backend's current version (see the class docstring)."""
        a, t, wdir = self.actor, self.cfg, self.weights
        v = self.backend.version

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
        self.announced[v] = digest
        self.announced_max = max(self.announced_max, v)
        self.guard.wrote(m.POLICY_KEY, pub)
        await a.publish_patiently("policy.published", pub,
                                  msg_id=f"policy:{a.run}:{v}:{digest.rsplit(':', 1)[-1][:16]}")
        await retry(lambda: set_policy(a.bus, a.run, pub), retry_on=BusError,
                    what=f"{a.name}: setting policy v{v}", attempts=60, base=0.2, cap=5.0,
                    logger=log)
        await self._prune(v, path, store)

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
