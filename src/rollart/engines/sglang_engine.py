"""``proxy.engine: sglang``: an SGLang server driven through its native HTTP API.

:class:`SglangEngine` is an :class:`~rollart.engines.base.AsyncEngine` whose requests are
``POST /generate`` calls to an SGLang server (``python -m sglang.launch_server``), which
batches them continuously on the GPU. The server is either

- **launched** by the engine (the default): a child process on a free loopback port, with
  the remaining ``proxy.engine_args`` as its command-line flags, killed (its whole process
  group) on :meth:`~SglangEngine.close`; or
- **attached** with ``engine_args.url`` (a server someone else started and stops).

It runs where SGLang runs (CUDA GPUs); the module itself imports nothing beyond the
standard library, so it loads everywhere. The HTTP client is ``aiohttp`` (the ``sglang``
extra: ``pip install 'rollart[sglang]'``), imported when the engine starts: it pools
keep-alive connections for hundreds of concurrent long requests (its connector limit is
raised to ``max_connections``), handles chunked bodies and timeouts, and SGLang itself
depends on it, so it is already there wherever the server is. SGLang is installed per its
own docs on the GPU machine (``pip install uv && uv pip install sglang``); when its torch
conflicts with this project's, install it in a second environment and point
``engine_args.python`` (or ``ROLLART_SGLANG_PYTHON``) at that interpreter.

``engine_args`` (``proxy.engine_args``)
--------------------------------------
Read by the engine: ``url`` (attach instead of launching), ``python`` (interpreter that runs
the server; default ``$ROLLART_SGLANG_PYTHON`` or this one), ``startup_timeout_s`` (900, or
120 attached), ``request_timeout_s`` (none), ``max_connections`` (1024), ``weights_dir``
(where weight updates are staged; a temporary folder by default; it must be visible to the
server, so an attached server on another host needs a shared path), ``env`` (extra
environment of the server process), ``check_logprobs`` (true: probe the log-prob semantics
and ``logit_bias`` support at start), ``log_file`` (the launched server's output, private
to its user; default ``rollart-sglang-server-<port>.log`` in ``weights_dir`` or the
system's temporary folder, kept after close), ``api_key`` (an attached server's ``--api-key``; default
``$ROLLART_SGLANG_API_KEY``; refused for a launched server, whose key the engine makes).
Every other key is a server flag: ``mem_fraction_static: 0.5`` -> ``--mem-fraction-static
0.5``, ``disable_cuda_graph: true`` -> ``--disable-cuda-graph`` (false/null: left out), a
list -> the flag followed by its items. The engine always passes ``--model-path``,
``--host``, ``--port``, ``--skip-tokenizer-init`` (token ids in, token ids out) and
``--api-key`` (a fresh key per launch, handed over in the environment, sent on every
request: no other process may call the server); ``--enable-custom-logit-processor`` is
refused (it lets any client run code, see :mod:`~rollart.engines.sglang_server`);
``--random-seed`` is the engine's
seed unless given; ``--attention-backend triton`` is added for a head size FlashInfer lacks
(not 64, 128 or 256: the tiny test models) unless given.

Where the rest lives (each module's docstring lists the SGLang API facts it relies on):

- :mod:`~rollart.engines.sglang_protocol`: the ``/generate`` bodies, the parsing of the
  answers, the logit bias of constrained steps, the log-prob semantics;
- :mod:`~rollart.engines.sglang_requests`: the engine's HTTP calls (abortable
  ``/generate`` calls, free and constrained rows);
- :mod:`~rollart.engines.sglang_server`: the server process (command line, launch, health
  wait, stop);
- :mod:`~rollart.engines.sglang_weights`: the staging of weight updates;
  :mod:`~rollart.engines.weight_files` (shared with the vLLM engine): model folder facts,
  safetensors headers and the name/shape check.

Pause and abort
---------------
:meth:`~SglangEngine.pause` closes a local gate (new requests wait in the engine) and,
in ``wait`` mode, returns once the requests in flight have finished; in ``abort`` mode it
aborts them (``/abort_request`` per rid) and returns once they have answered. SGLang's
``/pause_generation`` is not used: its ``abort`` mode aborts every client's requests and
polls at 1 s, and its ``in_place``/``retract`` modes keep requests inside the server, where
they hold the model-update lock that ``/update_weights_from_disk`` waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollart.aio import first_of

from .base import (
    FINISH_INTERRUPTED,
    PAUSE_MODES,
    AsyncEngine,
    EngineAborted,
    GenInput,
    GenOutput,
)
from .sglang_protocol import (
    allowed_bias,
    check_input,
    decode_answer,
    probe_payload,
    probe_spread,
)
from .sglang_requests import ReqState, SglangRequests
from .sglang_server import (
    API_KEY_ENV,
    free_port,
    kill_server,
    require_sglang,
    server_command,
    spawn_server,
    wait_ready,
)
from .sglang_weights import stage_weights
from .weight_files import TIED, check_weights, read_header, read_model_info, rename_tensor

__all__ = ["SglangEngine"]

log = logging.getLogger(__name__)

AIOHTTP_HINT = ("proxy.engine sglang needs aiohttp on the client side: "
                "pip install 'rollart[sglang]'")

ENGINE_KEYS = ("url", "python", "startup_timeout_s", "request_timeout_s", "max_connections",
               "weights_dir", "env", "check_logprobs", "log_file", "api_key")
"""``engine_args`` keys the engine reads; every other key is a server flag."""


# ======================================================================================
# The engine
# ======================================================================================
class SglangEngine(SglangRequests, AsyncEngine):
    """An SGLang server as an :class:`AsyncEngine` (see the module docstring)."""

    def __init__(self, model_dir: str | os.PathLike, *, seed: int = 0,
                 engine_args: Mapping[str, Any] | None = None) -> None:
        args = dict(engine_args or {})
        self.model_dir = Path(model_dir)
        self.seed = int(seed)
        self.url: str | None = (str(args.pop("url")).rstrip("/") if args.get("url") else None)
        args.pop("url", None)
        self.python = (args.pop("python", None) or os.environ.get("ROLLART_SGLANG_PYTHON")
                       or sys.executable)
        self.startup_timeout_s = float(args.pop("startup_timeout_s",
                                                120.0 if self.url else 900.0))
        rt = args.pop("request_timeout_s", None)
        self.request_timeout_s = float(rt) if rt else None
        self.max_connections = int(args.pop("max_connections", 1024))
        wd = args.pop("weights_dir", None)
        self._weights_root = Path(wd) if wd else None
        self.server_env = {str(k): str(v) for k, v in dict(args.pop("env", None) or {}).items()}
        self.check_logprobs = bool(args.pop("check_logprobs", True))
        self._log_file = args.pop("log_file", None)
        key = args.pop("api_key", None)
        if key and self.url is None:
            raise ValueError("proxy.engine_args.api_key is for an attached server (url): a "
                             "launched server gets a fresh key from the engine")
        if not key and self.url:
            key = os.environ.get(API_KEY_ENV)
        self._api_key: str | None = str(key) if key else None
        """The server's API key, sent as ``Authorization: Bearer``: made per launch (see
        :mod:`~rollart.engines.sglang_server`), or an attached server's."""
        self.logit_bias_ok: bool | None = None
        """Whether the server honours ``logit_bias`` (probed at start; False: constrained
        rows are refused, the server is older than SGLang 0.4.7)."""
        self.server_args = args
        if self.url is None:  # refuse bad flags now, not after minutes of start-up
            server_command(self.model_dir, port=0, args=args)
        self.info = read_model_info(self.model_dir)
        self.vocab_size = self.info.vocab_size
        self.version = 0
        self.raw_logprobs: bool | None = None
        """Whether the server returns log-probs before the temperature (probed at start;
        None: not probed or inconclusive)."""
        self.server_version: str | None = None
        self.command: list[str] | None = None
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._session: Any = None
        self._aiohttp: Any = None
        self._work: Path | None = None
        self._own_work = False
        self._staged: list[Path] = []
        self._reqs: dict[str, ReqState] = {}
        self._active = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # ---------------------------------------------------------------- properties
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids

    @property
    def base_url(self) -> str:
        if self.url is None:
            raise RuntimeError("the sglang engine is not started")
        return self.url

    # ---------------------------------------------------------------- start / close
    async def start(self) -> None:
        """Launch (or attach to) the server and wait until it generates. Idempotent."""
        if self._session is not None:
            return
        if self._closed:
            raise RuntimeError("the sglang engine is closed")
        try:  # optional dependency
            import aiohttp
        except ImportError:
            raise RuntimeError(AIOHTTP_HINT) from None
        self._aiohttp = aiohttp
        try:
            self._work = self._weights_root
            if self._work is None:
                self._work = Path(tempfile.mkdtemp(prefix="rollart-sglang-"))
                self._own_work = True
            self._work.mkdir(parents=True, exist_ok=True)
            if self.url is None:
                await self._launch()
            auth = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=30),
                headers=auth)
            await wait_ready(self._session, aiohttp, self.url,
                             startup_timeout_s=self.startup_timeout_s, proc=self._proc,
                             command=self.command, log_path=self.log_path,
                             secret=self._api_key)
            with contextlib.suppress(Exception):
                info = await self._get_json("/get_server_info", timeout=30)
                self.server_version = str(info.get("version")) if info.get("version") else None
            if self.check_logprobs:
                try:
                    self.raw_logprobs = await self._probe_logprobs()
                except (RuntimeError, ValueError) as e:  # e.g. no token_ids_logprob (old)
                    log.warning("sglang log-prob probe failed, semantics unknown: %s", e)
                try:
                    self.logit_bias_ok = await self._probe_logit_bias()
                except (RuntimeError, ValueError) as e:
                    log.warning("sglang logit_bias probe failed: %s", e)
                if self.logit_bias_ok is False:
                    log.warning("the SGLang server at %s ignores logit_bias (SGLang < 0.4.7): "
                                "constrained turns (choices) are refused", self.url)
        except BaseException:
            await self.close()
            raise
        log.info("sglang engine ready at %s (sglang %s, raw log-probs: %s)", self.url,
                 self.server_version, self.raw_logprobs)

    async def _launch(self) -> None:
        """Start the server (``self.command``) on a free port; :meth:`start` waits for it."""
        await require_sglang(self.python)
        self._api_key = secrets.token_urlsafe(32)
        port = free_port()
        self.command = server_command(self.model_dir, port=port, seed=self.seed,
                                      args=self.server_args, python=self.python,
                                      head_dim=self.info.head_dim)
        host = self.command[self.command.index("--host") + 1]
        connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{connect}:{port}"
        assert self._work is not None
        self.log_path = (Path(self._log_file) if self._log_file else
                         (self._work if not self._own_work else Path(tempfile.gettempdir()))
                         / f"rollart-sglang-server-{port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting the SGLang server: %s (log: %s)", " ".join(self.command),
                 self.log_path)
        self._proc = spawn_server(self.command, self.log_path, self.server_env, self._api_key)

    async def _probe_logprobs(self) -> bool | None:
        """Greedy vs T = 0.25 log-probs of the same first step: equal when the server
        returns log-probs before the temperature, 4 times as spread when after."""
        spreads = []
        for t in (0.0, 0.25):
            body = probe_payload(self.vocab_size, t, f"rollart-probe-{uuid.uuid4().hex[:12]}")
            spread = probe_spread(await self._post_json("/generate", body, timeout=120))
            if spread is None:
                return None
            spreads.append(spread)
        if spreads[0] < 0.05:
            log.warning("sglang log-prob probe inconclusive (near-uniform first step)")
            return None
        ratio = spreads[1] / spreads[0]
        if ratio < 1.5:
            return True
        if ratio > 2.5:
            log.warning("the SGLang server at %s returns temperature-scaled log-probs; rows "
                        "sampled at a temperature other than 1 are refused (start it with "
                        "SGLANG_RETURN_ORIGINAL_LOGPROB=1)", self.url)
            return False
        return None

    async def _probe_logit_bias(self) -> bool:
        """One greedy step biased towards two tokens the unbiased greedy step does not
        pick: whether the answer is one of them."""
        free = await self._post_json("/generate", probe_payload(
            self.vocab_size, 0.0, f"rollart-probe-{uuid.uuid4().hex[:12]}"), timeout=120)
        picked = (decode_answer(free).output_ids or [0])[0]
        vocab = int(self.vocab_size or 32)
        allowed = [t for t in (vocab - 1, vocab - 2, vocab - 3) if t != picked][:2]
        body = probe_payload(self.vocab_size, 0.0, f"rollart-probe-{uuid.uuid4().hex[:12]}")
        body["sampling_params"]["logit_bias"] = allowed_bias(allowed)
        got = decode_answer(await self._post_json("/generate", body, timeout=120)).output_ids or []
        return bool(got) and got[0] in allowed

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._open.set()
        for t in list(self._tasks):
            t.cancel()
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            await asyncio.to_thread(kill_server, proc)
        if self._own_work and self._work is not None:
            await asyncio.to_thread(shutil.rmtree, self._work, True)

    # ---------------------------------------------------------------- generation
    async def generate(self, inp: GenInput, request_id: str) -> GenOutput:
        check_input(inp, vocab_size=self.vocab_size, raw_logprobs=self.raw_logprobs,
                    url=self.url)
        if inp.choices is not None and self.logit_bias_ok is False:
            raise ValueError(f"the SGLang server at {self.url} ignores logit_bias (SGLang < "
                             "0.4.7), which constrained turns (choices) need: upgrade it")
        if self._session is None:
            raise RuntimeError("the sglang engine is not started (or closed)")
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in flight")
        st = ReqState(request_id)
        self._reqs[request_id] = st
        try:
            while not self._open.is_set() and not st.aborted:  # paused: wait for resume
                await first_of(self._open.wait(), st.woken.wait())
            version = int(self.version)
            if st.aborted:
                raise EngineAborted(request_id, GenOutput([], [], FINISH_INTERRUPTED, version),
                                    version)
            st.active = True
            self._active += 1
            self._idle.clear()
            try:
                if inp.choices is None:
                    out = await self._generate_free(inp, st, version)
                else:
                    out = await self._generate_choice(inp, st, version)
            finally:
                self._active -= 1
                st.active = False
                if self._active == 0:
                    self._idle.set()
            out.version = version
            return out
        finally:
            self._reqs.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            st = self._reqs.get(rid)
            if st is None or st.aborted:
                continue
            st.aborted = True
            st.woken.set()
            if st.posting and st.server_rid:
                self._spawn(self._abort_until_done(st, st.server_rid))

    async def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._open.clear()
        if mode == "abort":
            await self.abort([r for r, st in self._reqs.items() if st.active])
        await self._idle.wait()

    async def resume(self) -> None:
        self._open.set()

    async def flush_cache(self) -> bool:
        """``POST /flush_cache``: empty the server's radix (prefix) cache; False when SGLang
        refused (it does while requests run)."""
        status, _ = await self._post("/flush_cache", {}, timeout=60)
        return status == 200

    # ---------------------------------------------------------------- weights
    async def load_weights(self, source: str | Path | bytes, version: int) -> None:
        data: bytes | None = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            given = read_header(data)
            what = "weights (bytes)"
        else:
            path = Path(source)
            given = await asyncio.to_thread(read_header, path)
            what = f"weights in {path}"
        if not self.info.shapes:
            raise ValueError(f"cannot check {what}: the model folder {self.model_dir} has no "
                             "safetensors weights to compare names and shapes with")
        check_weights(given, self.info.shapes, tied=self.info.tied, what=what)
        if self._session is None:
            raise RuntimeError("the sglang engine is not started (or closed)")
        head, embed = TIED
        if self.info.tied and embed not in given:  # SGLang skips lm_head of a tied model
            if data is None:
                data = await asyncio.to_thread(Path(source).read_bytes)
            data = rename_tensor(data, head, embed)
        assert self._work is not None
        folder = await asyncio.to_thread(stage_weights, self._work, self.model_dir,
                                         data if data is not None else Path(source),
                                         int(version))
        try:
            resp = await self._post_json("/update_weights_from_disk",
                                         {"model_path": str(folder),
                                          "weight_version": str(int(version))})
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise
        if not resp.get("success", True):
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise RuntimeError(f"sglang could not load the weights: {str(resp.get('message'))[:500]}")
        await self._post_quietly("/flush_cache", {})
        self.version = int(version)
        old, self._staged = self._staged, [folder]
        for f in old:
            await asyncio.to_thread(shutil.rmtree, f, True)
