"""``proxy.engine: vllm-server``: a vLLM server driven over HTTP, supervised by the engine.

:class:`VllmServerEngine` is an :class:`~rollart.engines.base.AsyncEngine` whose requests
are calls to vLLM's OpenAI-compatible server (``vllm.entrypoints.openai.api_server``), so
vLLM's torch pin, its crashes and its processes stay out of rollart's interpreter. The server
is **launched** by the engine (the default: :mod:`~rollart.engines.vllm_server`, from
``engine_args.python``, its own venv if need be; a free loopback port, a per-launch API key)
or **attached** with ``engine_args.url`` (a server started with ``VLLM_SERVER_DEV_MODE=1``,
``--logprobs-mode raw_logprobs``, ``--enable-scale-out`` and rollart's choice processor in
``--logits-processors``; its key in the variable ``engine_args.api_key_env`` names).

What vLLM's server is asked and how its answers are read:
:mod:`~rollart.engines.vllm_server_protocol` (its docstring lists the API facts relied on);
the server's command line and launch: :mod:`~rollart.engines.vllm_server`.

Supervision: a task owned by the engine awaits the launched server's exit; requests in flight
then fail with :class:`~rollart.engines.base.EngineUnavailable` (the LLMProxy answers
"unavailable", so the turn is sent again), new ones wait, and the server is started again
(up to ``max_restarts`` times) and given the last loaded weights (and LoRA adapter) before
it serves.

Kept whole (~560 lines): a request's path (the pause gate, the server's life, the abort of
its call, the adapter it names) and the server's life (launch, supervision, restart, reload
of full weights and of adapters) share one request table, one HTTP session and one gate; the
pure parts are in :mod:`~rollart.engines.vllm_server_protocol` and
:mod:`~rollart.engines.lora_files`, the process in :mod:`~rollart.engines.vllm_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.aio import first_of

from .base import (FINISH_CHOICE, FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP, PAUSE_MODES,
                   AsyncEngine, EngineAborted, EngineUnavailable, GenInput, GenOutput)
from .choice_trie import accepted_prefix, branch_ids, choice_trie, renormalised_logprobs
from .server_http import free_port, kill_group, read_bounded, tail
from .sglang_protocol import check_input, error_text
from .vllm_server import require_vllm, server_command, shown, spawn_server, wait_healthy
from .vllm_server_protocol import (MAX_ANSWER_BYTES, MAX_LOGPROB_IDS, AnswerChoice,
                                   VllmAnswerError, choice_params, decode_answer, decode_weight_version,
                                   free_tokens, sampling_params, server_rid, step_logprobs)
from .vllm_engine import SIDE_FILES
from .lora_files import adapter_config, write_adapter_folder
from .weight_files import (LORA_KIND, check_weights, place_weights, read_header, read_metadata,
                           read_model_info)

__all__ = ["VllmServerEngine"]

log = logging.getLogger(__name__)



@dataclass(eq=False)
class _Req:
    sid: str = ""
    """The current server call's request id (one per call)."""
    aborted: bool = False
    active: bool = False
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class VllmServerEngine(AsyncEngine):
    """A vLLM server as an :class:`AsyncEngine` (see the module docstring).

    ``engine_args`` read by the engine: ``url`` (attach), ``python`` (the interpreter that
    runs a launched server; default this one), ``api_key_env`` (the variable holding an
    attached server's key; default ``VLLM_API_KEY``), ``startup_timeout_s`` (600, or 120
    attached), ``request_timeout_s`` (none), ``max_connections`` (1024), ``env`` (extra
    environment of the server), ``log_file`` (the launched server's output, 0600; default
    ``rollart-vllm-server-<port>.log`` in the system's temporary folder), ``max_restarts``
    (3: how often a launched server that died is started again), ``weights_dir`` (where
    versions are staged for the server to read: a temporary folder by default; an attached
    server on another host needs a shared path), ``enable_lora`` (LoRA versions are loaded as
    adapters, :attr:`applies_adapters`: a launched server gets ``--enable-lora``,
    ``--max-lora-rank`` ``max_lora_rank`` (default 16) and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; an attached one must have been started so).
    Every other key is a server flag (``max_model_len: 512`` -> ``--max-model-len 512``).

    A LoRA version (``kind: lora``; :meth:`load_weights` tells it by the file's metadata) is
    checked against the model (:func:`~rollart.engines.lora_files.adapter_config`), written
    as a peft folder ``lora-<version>-<n>`` in the engine's weights folder and loaded with
    ``POST /v1/load_lora_adapter`` under the name ``rollart-v<version>-<n>``; requests then
    name it as their ``model``, and the previous adapter is unloaded
    (``/v1/unload_lora_adapter``) and its folder removed. The adapter applies over the
    weights the server holds (the model folder's, or the last full weights loaded); a full
    version loaded after it replaces it (requests go to the base again)."""

    def __init__(self, model_dir: str | os.PathLike, *, seed: int = 0,
                 engine_args: dict[str, Any] | None = None) -> None:
        args = {str(k).replace("-", "_"): v for k, v in dict(engine_args or {}).items()}
        self.model_dir = Path(model_dir)
        self.seed = int(seed)
        self.url: str | None = str(args.pop("url")).rstrip("/") if args.get("url") else None
        args.pop("url", None)
        self.python = str(args.pop("python", None) or sys.executable)
        self.api_key_env = str(args.pop("api_key_env", None) or "VLLM_API_KEY")
        self.startup_timeout_s = float(args.pop("startup_timeout_s", 120.0 if self.url else 600.0))
        rt = args.pop("request_timeout_s", None)
        self.request_timeout_s = float(rt) if rt else None
        self.max_connections = int(args.pop("max_connections", 1024))
        self.server_env = {str(k): str(v) for k, v in dict(args.pop("env", None) or {}).items()}
        self._log_file = args.pop("log_file", None)
        self._weights_root = args.pop("weights_dir", None)
        self.max_restarts = int(args.pop("max_restarts", 3))
        self.applies_adapters = bool(args.pop("enable_lora", False))
        rank = args.pop("max_lora_rank", None)
        self.max_lora_rank: int | None = int(rank) if rank is not None else (
            16 if self.applies_adapters else None)
        if self.applies_adapters and self.url is None:
            args.update(enable_lora=True, max_lora_rank=self.max_lora_rank)
            self.server_env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        self.server_args = args
        if self.url is None:  # refuse bad flags now, not after a minute of start-up
            server_command(self.model_dir, port=0, args=args)
        elif args:
            raise ValueError(f"proxy.engine_args: {sorted(args)} are server flags, but the "
                             f"engine attaches to {self.url} (url) and launches nothing")
        self.info = read_model_info(self.model_dir)
        self.vocab_size = self.info.vocab_size
        self.version = 0
        self.restarts = 0
        self.start_s: float | None = None
        """Seconds the last launch took until ``/health`` answered."""
        self.last_load_s: float | None = None
        """Seconds the last weight update took on the server (reload + cache reset)."""
        self.command: list[str] | None = None
        self.log_path: Path | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._key: str | None = None
        self._session: Any = None
        self._aiohttp: Any = None
        self._wdir: Path | None = None
        self._loaded = False  # the weights folder holds a version a new server must reload
        self.adapter: str | None = None
        """The LoRA adapter requests name as their ``model`` (None: the base weights)."""
        self._adapter_dir: Path | None = None
        self._adapters = 0  # adapter folders made (their names)
        self._reqs: dict[str, _Req] = {}
        self._active = 0
        self._n = 0  # requests seen (per-request seeds, as the in-process engine draws them)
        self._calls = 0  # server calls made (their request ids)
        self._open = asyncio.Event()  # not paused
        self._open.set()
        self._up = asyncio.Event()  # the server serves
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self._supervisor: asyncio.Task | None = None
        self._closed = False
        self._dead: str | None = None  # why there is no server any more

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids

    @property
    def serving(self) -> bool:
        """The server is up (False while a launched server that died is started again)."""
        return self._up.is_set() and self._dead is None

    # ---------------------------------------------------------------- start / stop
    async def start(self) -> None:
        """Launch (or attach to) the server and wait until it answers ``/health``."""
        if self._session is not None:
            return
        if self._closed:
            raise RuntimeError("the vllm-server engine is closed")
        try:  # optional dependency (vLLM depends on it)
            import aiohttp
        except ImportError:
            raise RuntimeError("proxy.engine vllm-server needs aiohttp: pip install "
                               "'rollart[sglang]'") from None
        self._aiohttp = aiohttp
        if not self.info.shapes:
            raise ValueError(f"no *.safetensors weights in {self.model_dir}")
        self._wdir = Path(tempfile.mkdtemp(prefix="rollart-vllm-server-weights-",
                                           dir=self._weights_root))
        for name in SIDE_FILES:
            if (self.model_dir / name).exists():
                os.symlink((self.model_dir / name).resolve(), self._wdir / name)
        try:
            if self.url is None:
                await require_vllm(self.python)
                await self._launch()
            else:
                self._key = os.environ.get(self.api_key_env) or None
                self._new_session()
                await self._wait_health()
            self._up.set()
        except BaseException:
            await self.close()
            raise
        log.info("vllm-server engine ready at %s (%.1f s)", self.url, self.start_s or 0.0)

    def _new_session(self) -> None:
        a = self._aiohttp
        auth = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._session = a.ClientSession(
            connector=a.TCPConnector(limit=self.max_connections, limit_per_host=0),
            timeout=a.ClientTimeout(total=self.request_timeout_s, sock_connect=30),
            headers=auth)

    async def _launch(self) -> None:
        """Start the server on a fresh port and key, wait for it, own its supervisor."""
        t0 = time.monotonic()
        self._key = secrets.token_urlsafe(32)
        port = free_port()
        self.command = server_command(self.model_dir, port=port, seed=self.seed,
                                      args=self.server_args, python=self.python)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = (Path(self._log_file) if self._log_file else
                         Path(tempfile.gettempdir()) / f"rollart-vllm-server-{port}.log")
        log.info("starting the vLLM server: %s (log: %s)", shown(self.command), self.log_path)
        self.proc = await spawn_server(self.command, self.log_path, self.server_env, self._key)
        if self._session is not None:
            await self._session.close()
        self._new_session()
        await self._wait_health()
        self.start_s = time.monotonic() - t0
        self._supervisor = asyncio.ensure_future(self._supervise(self.proc))
        self._supervisor.add_done_callback(_log_failure)

    async def _wait_health(self) -> None:
        await wait_healthy(self._session, self._aiohttp, self.url,
                           timeout_s=self.startup_timeout_s, proc=self.proc,
                           command=self.command, log_path=self.log_path, secret=self._key)

    async def _supervise(self, proc: asyncio.subprocess.Process) -> None:
        """Await the server's exit; start it again (requests wait meanwhile)."""
        rc = await proc.wait()
        if self._closed:
            return
        self._up.clear()
        log.warning("the vLLM server (pid %d) died (code %s); in-flight requests are "
                    "answered unavailable\n%s", proc.pid, rc, tail(self.log_path, 15, self._key))
        kill_group(proc.pid, signal.SIGKILL)  # its EngineCore and worker too
        if self.restarts >= self.max_restarts:
            self._given_up(f"the vLLM server died {self.restarts + 1} times (max_restarts "
                           f"{self.max_restarts}); it is not started again")
            return
        self.restarts += 1
        self._supervisor = None
        try:
            await self._launch()
            if self._loaded:
                await self._reload(self.version)
            if self.adapter is not None:  # the new server knows no adapter yet
                self.adapter = None
                await self._serve_adapter(self._adapter_dir, self.version)
        except Exception as e:
            self._given_up(f"starting the vLLM server again failed: {e}")
            return
        self._up.set()
        log.info("the vLLM server is back (restart %d, %.1f s)", self.restarts, self.start_s)

    def _given_up(self, why: str) -> None:
        """No server any more: waiting requests and new ones fail as unavailable."""
        log.error("%s", why)
        self._dead = why
        self._up.set()

    async def close(self) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL to what is left after
        20 s, or at once when this is cancelled (a node that stops re-cancels its actors'
        mains every second)."""
        if self._closed:
            return
        self._closed = True
        self._open.set()
        sup, self._supervisor = self._supervisor, None
        for t in [*self._tasks, *([sup] if sup else [])]:
            t.cancel()
        proc, self.proc = self.proc, None
        wdir, self._wdir = self._wdir, None
        try:
            if proc is not None and proc.returncode is None:
                kill_group(proc.pid, signal.SIGTERM)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 20)
        finally:
            if proc is not None:
                kill_group(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
            if wdir is not None:
                shutil.rmtree(wdir, True)  # a few links: not worth a thread
            session, self._session = self._session, None
            if session is not None:
                with contextlib.suppress(Exception):
                    await session.close()

    # ---------------------------------------------------------------- HTTP
    async def _call(self, method: str, path: str, body: Any = None, *,
                    timeout: float | None = None) -> bytes:
        """One call; its body read up to :data:`MAX_ANSWER_BYTES`. HTTP 4xx on generate:
        ``ValueError``; a server that is gone: :class:`EngineUnavailable`."""
        if self._session is None:
            raise RuntimeError("the vllm-server engine is not started (or closed)")
        a = self._aiohttp
        kw = {"timeout": a.ClientTimeout(total=timeout)} if timeout else {}
        try:
            async with self._session.request(method, self.url + path, json=body, **kw) as r:
                data = await read_bounded(r, f"vllm {path}", MAX_ANSWER_BYTES, VllmAnswerError)
                status = r.status
        except (a.ClientConnectionError, a.ServerDisconnectedError) as e:
            raise EngineUnavailable(f"the vLLM server at {self.url} is gone ({path}: "
                                    f"{type(e).__name__}: {e})") from None
        if status == 200:
            return data
        if path.startswith("/inference") and 400 <= status < 500 and status != 401:
            raise ValueError(f"vllm refused the request (HTTP {status}): {error_text(data)}")
        raise RuntimeError(f"vllm {path} answered HTTP {status}: {error_text(data)}")

    async def _post_quietly(self, path: str, body: Any) -> None:
        with contextlib.suppress(Exception):
            await self._call("POST", path, body, timeout=10)

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- generation
    async def generate(self, inp: GenInput, request_id: str) -> GenOutput:
        check_input(inp, vocab_size=self.vocab_size, raw_logprobs=True, url=self.url)
        if self._session is None:
            raise RuntimeError("the vllm-server engine is not started (or closed)")
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._n += 1
        seed = (self.seed * 1_000_003 + self._n) % (2**31 - 1)
        req = self._reqs[request_id] = _Req()
        try:
            while not (self._open.is_set() and self._up.is_set()) and not req.aborted:
                await first_of(self._open.wait(), req.woken.wait(), self._up.wait())
            version = int(self.version)
            if self._dead is not None:
                raise EngineUnavailable(self._dead)
            if req.aborted:
                raise EngineAborted(request_id, GenOutput([], [], FINISH_INTERRUPTED, version),
                                    version)
            req.active = True
            self._active += 1
            self._idle.clear()
            try:
                if inp.choices is None:
                    return await self._free(inp, request_id, req, seed, version)
                return await self._choice(inp, request_id, req, seed, version)
            finally:
                self._active -= 1
                req.active = False
                if self._active == 0:
                    self._idle.set()
        finally:
            del self._reqs[request_id]

    async def _run(self, req: _Req, prompt: list[int], sp: dict) -> AnswerChoice:
        """One ``/inference/v1/generate`` call; an abort that came meanwhile is repeated
        until it returns; cancelling the caller aborts it on the server."""
        self._calls += 1
        req.sid = f"{os.getpid()}-{self._calls}-{secrets.token_hex(4)}"
        req.done = asyncio.Event()
        body = {"request_id": req.sid, "token_ids": prompt, "sampling_params": sp,
                "output_mode": "tokens", "stream": False}
        if self.adapter is not None:
            body["model"] = self.adapter
        if req.aborted:
            self._spawn(self._abort_until_done(req))
        try:
            data = await self._call("POST", "/inference/v1/generate", body)
        except asyncio.CancelledError:
            self._spawn(self._post_quietly("/inference/v1/abort_requests",
                                           {"request_ids": [server_rid(req.sid)]}))
            raise
        finally:
            req.done.set()
        return decode_answer(data)

    async def _free(self, inp: GenInput, rid: str, req: _Req, seed: int, version: int
                    ) -> GenOutput:
        stops = sorted(set(self.eos_token_ids) | {int(t) for t in inp.stop_token_ids})
        c = await self._run(req, list(inp.prompt_ids), sampling_params(
            inp, seed, max_tokens=int(inp.max_new_tokens), logprobs=0, stop_token_ids=stops))
        tokens, lps = free_tokens(c, int(inp.max_new_tokens))
        if c.finish_reason == "abort" or req.aborted:  # aborted: never served as complete
            raise EngineAborted(rid, GenOutput(tokens, lps, FINISH_INTERRUPTED, version), version)
        finish = FINISH_STOP if tokens and tokens[-1] in stops else FINISH_LENGTH
        return GenOutput(tokens, lps, finish, version)

    async def _choice(self, inp: GenInput, rid: str, req: _Req, seed: int, version: int
                      ) -> GenOutput:
        choices = [[int(t) for t in c] for c in inp.choices or ()]
        trie = choice_trie(choices)
        union = {t for c in choices for t in c}
        end = next(t for t in (*self.eos_token_ids, *range(self.vocab_size or 1 << 31))
                   if t not in union)
        branch = branch_ids(trie)
        c = await self._run(req, list(inp.prompt_ids),
                            choice_params(inp, seed, choices, end, branch))
        resp, complete = accepted_prefix(trie, list(c.token_ids or []))
        raw = step_logprobs(c) if 0 < len(branch) <= MAX_LOGPROB_IDS else None
        prompt = list(inp.prompt_ids)

        async def score(k: int, allowed: list[int]) -> dict[int, float]:
            got: dict[int, float] = {}
            for i in range(0, len(allowed), MAX_LOGPROB_IDS):
                part = allowed[i:i + MAX_LOGPROB_IDS]
                one = await self._run(req, prompt + resp[:k], sampling_params(
                    GenInput(prompt, greedy=True), seed, max_tokens=1, logprobs=len(part),
                    logprob_token_ids=part))
                steps = step_logprobs(one)
                if one.finish_reason == "abort" or not steps:
                    raise EngineAborted(rid, GenOutput([], [], FINISH_INTERRUPTED, version),
                                        version)
                got.update(steps[0])
            return got

        lps = await renormalised_logprobs(trie, resp, raw, score)
        if complete:
            return GenOutput(resp, lps, FINISH_CHOICE, version)
        if c.finish_reason == "abort" or req.aborted:
            raise EngineAborted(rid, GenOutput(resp, lps, FINISH_INTERRUPTED, version), version)
        raise VllmAnswerError(f"vllm returned {c.token_ids} ({c.finish_reason}), not a whole "
                              "choice: is rollart's choice processor in --logits-processors?")

    # ---------------------------------------------------------------- control
    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self._reqs.get(rid)
            if req is None or req.aborted:
                continue
            req.aborted = True
            req.woken.set()
            if req.active and req.sid:
                self._spawn(self._abort_until_done(req))

    async def _abort_until_done(self, req: _Req) -> None:
        # until its generate call returns: on a loaded host the server may register the
        # request seconds after it was sent, and an abort before that is a no-op (a 10 s
        # limit here let a CI run's request generate all its tokens)
        done, body = req.done, {"request_ids": [server_rid(req.sid)]}
        while not done.is_set() and self._session is not None:
            await self._post_quietly("/inference/v1/abort_requests", body)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 0.05)

    async def pause(self, mode: str = "wait") -> None:
        """Close the engine's gate, abort (``abort``) or let finish (``wait``) the requests
        in flight, then pause the server itself (``POST /pause`` in the same mode)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._open.clear()
        if mode == "abort":
            await self.abort([r for r, q in self._reqs.items() if q.active])
        await self._idle.wait()
        if self._up.is_set():
            await self._call("POST", f"/pause?mode={mode}&clear_cache=false", timeout=60)

    async def resume(self) -> None:
        if self._up.is_set():
            await self._call("POST", "/resume", timeout=60)
        self._open.set()

    # ---------------------------------------------------------------- weights
    async def load_weights(self, source: str | Path | bytes, version: int) -> None:
        """Check the file's names and shapes, stage it in the weights folder (a hard link
        or the bytes written), have the server reload it, and take ``version`` once the
        server reports it (``/weight_info``). A LoRA adapter file (its metadata) is served
        as an adapter instead (see the class docstring)."""
        if self._session is None or self._wdir is None:
            raise RuntimeError("the vllm-server engine is not started (or closed)")
        is_bytes = isinstance(source, (bytes, bytearray, memoryview))
        what = "weights bytes" if is_bytes else f"weights in {source}"
        given = await asyncio.to_thread(read_header, source)
        meta = await asyncio.to_thread(read_metadata, source)
        if meta.get("rollart_kind") == LORA_KIND:
            await self._load_adapter(source, given, meta, int(version), what)
            return
        check_weights(given, self.info.shapes,
                      optional={"lm_head.weight"} if self.info.tied else set(), what=what)
        await asyncio.to_thread(place_weights, source, self._wdir / "model.safetensors",
                                hard_link=True)
        self._loaded = True
        await self._reload(int(version))
        self.version = int(version)
        await self._drop_adapter()  # full weights: requests go to the base again

    async def _load_adapter(self, source: Any, given: dict, meta: dict, version: int,
                            what: str) -> None:
        """Check the adapter against the model, write its peft folder, have the server
        load it, name it in requests from now on, unload the previous one."""
        if not self.applies_adapters:
            raise ValueError(f"{what}: a LoRA adapter, and this vllm-server engine does not "
                             f"serve adapters (proxy.engine_args.enable_lora)")
        config = adapter_config(given, meta, self.info.shapes, max_rank=self.max_lora_rank,
                                what=what)
        self._adapters += 1
        folder = self._wdir / f"lora-{version}-{self._adapters}"
        await asyncio.to_thread(write_adapter_folder, source, config, folder)
        try:
            await self._serve_adapter(folder, version)
        except BaseException:
            shutil.rmtree(folder, True)
            raise
        self.version = version

    async def _serve_adapter(self, folder: Path, version: int) -> None:
        """Load the peft ``folder`` on the server under a new name, confirm ``version``, then
        name it in requests and unload the previous adapter (its folder removed)."""
        t0 = time.monotonic()
        self._adapters += 1
        name = f"rollart-v{version}-{self._adapters}"
        await self._call("POST", "/v1/load_lora_adapter",
                         {"lora_name": name, "lora_path": str(folder)})
        try:  # requests name it only once the server confirms the version
            await self._confirm_version(version, "adapter version")
        except Exception:
            await self._post_quietly("/v1/unload_lora_adapter", {"lora_name": name})
            raise
        old, old_dir = self.adapter, self._adapter_dir
        self.adapter, self._adapter_dir = name, folder
        if old is not None:
            await self._post_quietly("/v1/unload_lora_adapter", {"lora_name": old})
        if old_dir is not None and old_dir != folder:
            shutil.rmtree(old_dir, True)
        self.last_load_s = time.monotonic() - t0

    async def _drop_adapter(self) -> None:
        """Requests go to the base weights; the adapter is unloaded, its folder removed."""
        old, old_dir = self.adapter, self._adapter_dir
        self.adapter = self._adapter_dir = None
        if old is not None:
            await self._post_quietly("/v1/unload_lora_adapter", {"lora_name": old})
        if old_dir is not None:
            shutil.rmtree(old_dir, True)

    async def _reload(self, version: int) -> None:
        t0 = time.monotonic()
        await self._call("POST", "/collective_rpc", {
            "method": "reload_weights", "kwargs": {"weights_path": str(self._wdir)}})
        await self._confirm_version(version, "version")
        self.last_load_s = time.monotonic() - t0

    async def _confirm_version(self, version: int, what: str) -> None:
        """After a load: the prefix cache reset, the server told ``version`` and its own
        report of it checked (``RuntimeError`` naming ``what`` otherwise)."""
        await self._call("POST", "/reset_prefix_cache")
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})
        got = decode_weight_version(await self._call("GET", "/weight_info"))
        if got != str(version):
            raise RuntimeError(f"the vLLM server reports weight version {got!r} after loading "
                               f"{what} {version}")


def _log_failure(task: asyncio.Task) -> None:
    """A supervisor that failed says so (it is awaited by nobody while it runs)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the vLLM server's supervisor failed", exc_info=task.exception())
