"""BatchedEngine: an :class:`AsyncEngine` around a synchronous, batched `GenerationEngine`.

Requests that arrive while a batch runs share the next engine call (at most ``max_batch``
rows). Before a call the engine gathers adaptively: it keeps waiting while requests keep
arriving (each within ``gather_s`` of the one before; within a quarter of the window while
fewer are queued than the last round had requesters), up to ``gather_max_s`` after the first
(by default the duration of the last engine call, at most 50 ms), so trajectories that drift
apart still share calls; a lone request waits only ``gather_s``. Why: a call's fixed cost
(Python, kernel launches) is most of a small model's step, so rows that join an existing call
are nearly free, and CPU not burnt on tiny calls goes to the other processes of the host.
The engine runs in one worker thread of its own, one batch (or weight load) at a time, so the
event loop keeps serving meanwhile.

- ``abort``: a queued request is removed at once; a running one stops at the engine's next
  decode step when the engine takes ``stop_rows`` (the torch engine does), else its batch
  finishes it. Either way ``generate`` raises :class:`EngineAborted` with what it has (a
  request that completed before the abort took effect returns normally). Cancelling the
  task awaiting ``generate`` aborts it the same way.
- ``pause("wait")`` lets the running batch finish; ``pause("abort")`` stops its rows; both
  keep queued requests for after :meth:`resume`, under the weights then loaded.
- Every output carries the ``version`` of the weights of its batch; each batch is a
  ``generate.batch`` span (``batch_size``, ``replica``, ``version``; linked to the spans that
  were current when its requests called ``generate``) and one ``otel_metrics.engine_batch``.

Kept whole (~450 lines): the gather window, the rows of a batch and pause/abort share one
lock and one queue, so they are read together.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import tempfile
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart.telemetry import otel_metrics, tracing

from .base import (
    FINISH_INTERRUPTED,
    PAUSE_MODES,
    AsyncEngine,
    EngineAborted,
    GenerationEngine,
    GenInput,
    GenOutput,
    validate_choices,
)

__all__ = ["BatchedEngine", "EngineClosed"]

log = logging.getLogger(__name__)


class EngineClosed(RuntimeError):
    """``generate`` on (or left in) a closed :class:`BatchedEngine`."""


@dataclass(eq=False)
class _Req:
    inp: GenInput
    request_id: str
    fut: asyncio.Future
    link: dict[str, str] | None = None
    """Tracing on: the headers of the span current when ``generate`` was called."""
    row: int = -1
    """Index in the running batch; -1 while queued."""


class BatchedEngine(AsyncEngine):
    """An :class:`AsyncEngine` that gathers requests into calls of a `GenerationEngine`.

    Args:
        engine: the engine to drive (not closed by :meth:`close` unless ``owns``), or None
            with ``factory``.
        factory: builds the engine in the worker thread on :meth:`start` (then owned).
        gather_s: the quiet gap: a gathering batch is cut once no request arrived for this
            many seconds (not when full).
        gather_max_s: the longest a batch gathers after its first request; None: the
            duration of the last engine call, at most 50 ms (and at least ``gather_s``).
        max_batch: rows per engine call at most.
        replica, pool: the ``replica`` attribute of ``generate.batch`` spans and the ``pool``
            of the engine metrics (the LLMProxy sets them).

    Statistics (read by benchmarks and tests): ``batches``, ``items``, ``sizes`` (rows per
    batch), ``waiting_sizes`` (requests left queued when each batch was cut), ``busy_s``
    (seconds in engine calls), :attr:`mean_batch`, :attr:`queued`, :meth:`stats`.
    ``on_start``, if set, is called with the request ids of each batch as it starts.
    """

    def __init__(self, engine: GenerationEngine | None = None, *,
                 factory: Callable[[], GenerationEngine] | None = None,
                 gather_s: float = 0.002, max_batch: int = 128, owns: bool | None = None,
                 replica: str = "", pool: str = "default",
                 gather_max_s: float | None = None) -> None:
        if (engine is None) == (factory is None):
            raise ValueError("give an engine or a factory, not both or neither")
        if max_batch < 1 or gather_s < 0 or (gather_max_s is not None and gather_max_s < 0):
            raise ValueError(f"max_batch must be >= 1 and gather_s, gather_max_s >= 0, got "
                             f"{max_batch}, {gather_s}, {gather_max_s}")
        self.engine = engine
        self._factory = factory
        self.owns = engine is None if owns is None else owns
        self.gather_s = gather_s
        self.gather_max_s = gather_max_s
        self.max_batch = max_batch
        self.replica = replica
        self.pool = pool
        self.on_start: Callable[[list[str]], None] | None = None
        self._queue: list[_Req] = []
        self._running: dict[str, _Req] = {}
        self._stop_rows: set[int] = set()
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stoppable = False
        self.stopped = False
        """Set by :meth:`close` (or if the batching loop died): nothing more will run."""
        self.batches = 0
        self.items = 0
        self.sizes: list[int] = []
        self.waiting_sizes: list[int] = []
        self.waited = 0
        """Sum of ``waiting_sizes``."""
        self.busy_s = 0.0
        self._last_call_s = 0.0
        self._last_arrival = 0.0
        self._expect = 0
        """Requesters of the last round: its call's rows plus what queued during the call."""

    @classmethod
    def torch(cls, model_dir: str | os.PathLike, *, seed: int = 0, threads: int | None = 1,
              gather_s: float = 0.002, max_batch: int = 128, **engine_kw: Any) -> "BatchedEngine":
        """A BatchedEngine of a ``TorchGenerationEngine`` (built on :meth:`start`)."""

        def build() -> GenerationEngine:
            # optional dependency: this module imports torch
            from .torch_engine import TorchGenerationEngine

            return TorchGenerationEngine(model_dir, threads=threads, seed=seed, **engine_kw)

        return cls(factory=build, gather_s=gather_s, max_batch=max_batch)

    # -- properties ----------------------------------------------------------------------
    @property  # type: ignore[override]
    def version(self) -> int:
        return int(self.engine.version) if self.engine is not None else 0

    @property  # type: ignore[override]
    def vocab_size(self) -> int | None:
        v = getattr(self.engine, "vocab_size", None)
        return int(v) if v is not None else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.engine, "eos_token_ids", ()) or ())

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (not counting the running one)."""
        return len(self._queue)

    @property
    def mean_batch(self) -> float:
        return self.items / self.batches if self.batches else 0.0

    def stats(self) -> dict[str, float]:
        """Engine occupancy so far: calls, rows, mean rows per call against the mean requests
        left waiting when a call was cut, seconds busy; plus the engine's own ``kv_stats()``
        (prefix-cache counters) when it has them."""
        n = self.batches
        out = {"batches": float(n), "rows": float(self.items), "mean_rows": self.mean_batch,
               "mean_waiting": self.waited / n if n else 0.0,
               "busy_s": self.busy_s}
        kv = getattr(self.engine, "kv_stats", None)
        if callable(kv):
            try:
                out.update({f"kv_{k}": float(v) for k, v in kv().items()})
            except Exception:  # noqa: BLE001 - statistics must never fail the caller
                log.debug("kv_stats failed", exc_info=True)
        return out

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        if self.stopped:
            raise EngineClosed("the engine is closed")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollart-engine")
        if self.engine is None:
            assert self._factory is not None
            self.engine = await self._in_thread(self._factory)
        try:
            self._stoppable = "stop_rows" in inspect.signature(self.engine.generate).parameters
        except (TypeError, ValueError):
            self._stoppable = False
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batched-engine")
        self._task.add_done_callback(self._loop_ended)

    async def close(self) -> None:
        self.stopped = True
        task, self._task = self._task, None
        self._stop_rows.update(r.row for r in self._running.values())
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._fail_all(EngineClosed("the engine was closed"))
        ex, self._executor = self._executor, None
        if ex is not None:
            # after the batch still in the thread (its rows were stopped above): the engine
            # may be handed to another BatchedEngine next
            close = self.engine.close if self.owns and hasattr(self.engine, "close") else None
            await asyncio.get_running_loop().run_in_executor(ex, close or (lambda: None))
            ex.shutdown(wait=False)

    def _loop_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug: tell every waiter rather than leave them hanging
            log.error("batched engine loop died: %r", exc)
            self.stopped = True
            self._fail_all(EngineClosed(f"the engine's batching loop died: {exc!r}"))

    def _fail_all(self, exc: Exception) -> None:
        for r in [*self._queue, *self._running.values()]:
            if not r.fut.done():
                r.fut.set_exception(exc)
        self._queue.clear()

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            raise EngineClosed("the engine is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- requests ------------------------------------------------------------------------
    async def generate(self, inp: GenInput, request_id: str) -> GenOutput:
        if self.stopped or self._task is None:
            raise EngineClosed("the engine is closed" if self.stopped else "start() it first")
        self._check(inp)
        req = _Req(inp, request_id, asyncio.get_running_loop().create_future(),
                   tracing.headers() if tracing.enabled() else None)
        self._queue.append(req)
        self._last_arrival = time.monotonic()
        self._wake.set()
        try:
            return await req.fut
        except asyncio.CancelledError:  # the caller gave up: free its row
            self._abort_req(req)
            raise

    def _check(self, inp: GenInput) -> None:
        """Refuse one bad input here, rather than fail the whole batch it would join."""
        if not inp.prompt_ids:
            raise ValueError("prompt_ids is empty")
        vocab = self.vocab_size
        if inp.choices is not None:
            validate_choices(inp.choices)
            ids = [t for c in inp.choices for t in c]
        else:
            if not 0 < inp.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {inp.top_p}")
            ids = []
        if vocab is not None:
            lo = min(min(inp.prompt_ids), min(ids, default=0))
            hi = max(max(inp.prompt_ids), max(ids, default=0))
            if lo < 0 or hi >= vocab:
                raise ValueError(f"token ids outside the vocabulary [0, {vocab}): "
                                 f"{lo if lo < 0 else hi}")

    async def abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        for r in [r for r in self._queue if r.request_id in ids]:
            self._abort_req(r)
        for rid in ids:
            r = self._running.get(rid)
            if r is not None:
                self._abort_req(r)

    def _abort_req(self, r: _Req) -> None:
        if r.row >= 0:  # running: the engine stops its row at the next decode step
            if self._running.get(r.request_id) is r:
                self._stop_rows.add(r.row)
            return
        try:
            self._queue.remove(r)
        except ValueError:
            return
        if not r.fut.done():
            v = self.version
            r.fut.set_exception(EngineAborted(r.request_id, GenOutput([], [], FINISH_INTERRUPTED, v), v))

    async def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._resumed.clear()
        if mode == "abort":
            self._stop_rows.update(r.row for r in self._running.values())
        await self._idle.wait()

    async def resume(self) -> None:
        self._resumed.set()
        if self._queue:
            self._wake.set()

    @property
    def applies_adapters(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.engine, "applies_adapters", False))

    @property
    def partial_loads(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.engine, "partial_loads", False))

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    # -- weights -------------------------------------------------------------------------
    async def load_weights(self, source: str | Path | bytes, version: int, *,
                           changed: Collection[str] | None = None) -> None:
        """``changed``: see :attr:`partial_loads` (the engine's)."""
        if self.engine is None:
            raise EngineClosed("start() the engine first")
        if isinstance(source, (bytes, bytearray, memoryview)):
            await self._in_thread(self._load_bytes, bytes(source), int(version))
        elif changed is not None and self.partial_loads:
            await self._in_thread(functools.partial(self.engine.load_weights, changed=changed),
                                  source, int(version))
        else:
            await self._in_thread(self.engine.load_weights, source, int(version))

    def _load_bytes(self, data: bytes, version: int) -> None:
        eng = self.engine
        if hasattr(eng, "load_state_dict"):
            from safetensors.torch import load  # optional dependency

            from .weight_files import LORA_KIND, read_metadata, weights_kind

            try:
                sd = load(data)
                kind = weights_kind(data)
            except Exception as e:  # noqa: BLE001 - safetensors raises several types
                raise ValueError(f"cannot read weights: {e}") from e
            if kind == LORA_KIND:  # an adapter over the base (trainer.lora)
                eng.load_state_dict(sd, version, metadata=read_metadata(data), what="weights")
            else:
                eng.load_state_dict(sd, version)  # checks names and shapes first
            return
        fd, tmp = tempfile.mkstemp(suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            eng.load_weights(tmp, version)
        finally:
            os.unlink(tmp)

    # -- the batching loop ---------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            if not self._resumed.is_set():
                await self._resumed.wait()
                continue
            if len(self._queue) < self.max_batch and self.gather_s > 0:
                await self._gather()
                if not self._resumed.is_set():
                    continue  # paused while gathering
            take, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
            if not self._queue:
                self._wake.clear()
            take = [r for r in take if not r.fut.done()]  # requester gave up
            if take:
                await self._run(take)

    async def _gather(self) -> None:
        """Wait while requests keep arriving, the queue is not full, and the window
        (:attr:`gather_max_s`, else the last call's duration, at most 50 ms) is not over.

        "Keep arriving": a gap under ``gather_s``; while fewer are queued than the last round
        had requesters (the last call's rows, which come back for their next turn, plus what
        queued during it), a gap under a quarter of the window: the rows that just returned
        need a bus round trip and an env step before they ask again, which is longer than
        ``gather_s``, and a call without them would split the round in two for good."""
        t0 = time.monotonic()
        window = self.gather_max_s
        if window is None:
            window = min(0.05, self._last_call_s)
        window = max(window, self.gather_s)
        end, slow_gap = t0 + window, max(self.gather_s, window / 4)
        while len(self._queue) < self.max_batch:
            now = time.monotonic()
            gap = slow_gap if len(self._queue) < self._expect else self.gather_s
            wait = min(max(self._last_arrival, t0) + gap, end) - now
            if wait <= 0:
                return
            await asyncio.sleep(wait)

    async def _run(self, take: list[_Req]) -> None:
        version = self.version
        waiting = len(self._queue)  # left queued when this batch was cut
        stop = self._stop_rows = set()
        for row, r in enumerate(take):
            r.row = row
            self._running[r.request_id] = r
        self._idle.clear()
        if self.on_start is not None:
            try:
                self.on_start([r.request_id for r in take])
            except Exception:  # noqa: BLE001 - a hook must not fail the batch
                log.exception("on_start hook failed")
        links = [r.link for r in take if r.link] if tracing.enabled() else None
        inputs = [r.inp for r in take]
        t0 = time.perf_counter()
        try:
            with tracing.span("generate.batch", {"batch_size": len(take), "replica": self.replica,
                                                 "version": version}, links=links or None):
                if self._stoppable:
                    outs = await self._in_thread(self._call_stoppable, inputs, stop)
                else:
                    outs = await self._in_thread(self.engine.generate, inputs)
        except asyncio.CancelledError:  # closing: the thread ends the stopped rows
            for r in take:
                if not r.fut.done():
                    r.fut.set_exception(EngineClosed("the engine was closed mid-batch"))
            raise
        except Exception as e:  # noqa: BLE001 - every request of the batch gets the error
            for r in take:
                if not r.fut.done():
                    r.fut.set_exception(e)
            return
        finally:
            self._last_call_s = time.perf_counter() - t0
            self.busy_s += self._last_call_s
            for r in take:
                if self._running.get(r.request_id) is r:
                    del self._running[r.request_id]
            self._idle.set()
        self.batches += 1
        self.items += len(take)
        self.sizes.append(len(take))
        self.waiting_sizes.append(waiting)
        self.waited += waiting
        self._expect = min(self.max_batch, len(take) + len(self._queue))
        otel_metrics.engine_batch(len(take), waiting, self.pool)
        for r, o in zip(take, outs):
            if r.fut.done():
                continue
            o.version = version
            if o.finish_reason == FINISH_INTERRUPTED:
                r.fut.set_exception(EngineAborted(r.request_id, o, version))
            else:
                r.fut.set_result(o)

    def _call_stoppable(self, inputs: list[GenInput], stop: set[int]) -> list[GenOutput]:
        return self.engine.generate(inputs, stop_rows=stop)
