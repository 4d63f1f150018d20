"""The OpenAI-compatible HTTP endpoint an EnvManager serves to the agents it runs.

One server per EnvManager (Starlette on uvicorn, on the EnvManager's own event loop), one
base URL per trajectory: ``http://<host>:<port>/t/<traj_id>/<secret>/v1``. The secret is
random per trajectory, so an agent can only speak for its own trajectory, and a URL stops
working when its trajectory ends (HTTP 404). Routes under a base URL:

- ``POST chat/completions``: the OpenAI chat-completions request (``messages``, ``tools``,
  ``max_tokens`` / ``max_completion_tokens``, ``logprobs``, ``stream``; vLLM's
  ``guided_choice`` / ``structured_outputs.choice`` constrain the reply to one of a few
  strings; ``return_token_ids`` adds ``token_ids`` to the choice and ``prompt_token_ids``
  to the response, as vLLM does). The model name is not checked.
- ``GET models``: the one model this endpoint serves.

Errors are OpenAI-shaped (``{"error": {"message", "type", "code"}}``): 400 for a request
that breaks the contract, 404 for an unknown or finished trajectory, 408 for a body that
did not arrive in time, 413 for a body over the limit, 503 when the trajectory could not
get a generation (it is over then).

Fails closed (issue 43): any local process can reach the port, and an agent is code the
run does not control, so the server bounds what a peer can hold before it is trusted.

- Connections: at most ``max_connections``; one more closes the oldest connection with no
  request in progress (idle, or still sending its head), so a flood of idle connections
  cannot lock out a live agent, and the process never runs out of file descriptors.
- Time: a connection must send a request head within ``request_timeout`` of opening or of
  its previous response (bytes trickled in do not extend it), and the body within
  ``request_timeout`` again (else 408).
- Size: a head is at most 16 KiB (h11's bound), a body ``max_request_bytes``: a larger
  ``Content-Length`` is answered 413 before any of it is read, a chunked body once it
  passes the bound.
- Shape: the body is decoded by msgspec into
  :class:`~rollart.agents.chat_request.ChatRequest` (unknown fields are ignored, as a wire
  type should): bad JSON, a wrong type, an integer beyond 64 bits or nesting deeper than
  :data:`~rollart.agents.chat_request.MAX_DEPTH` is a 400 that names it, and the trajectory is
  dead-lettered as ``agent_contract``. Nothing is ever unpickled or evaluated.
- The trajectory's key is compared as bytes, so a non-ASCII one is a 404, not a crash.

Served by uvicorn with its h11 protocol (bounded heads; httptools' is not), extended by
:func:`_guarded_protocol` for the first two points.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import resource
import secrets
import socket
import time
from typing import Any, Protocol

from rollart.agents.chat_request import EndpointError, decode_request

log = logging.getLogger(__name__)

MODEL_NAME = "rollart-policy"
"""The model id ``GET /v1/models`` names (requests may name any model)."""
MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (request line and headers) read."""
ACCEPT_BATCH = 64
"""The listening socket's backlog, which is also how many connections asyncio accepts in
one go before any of them runs ``connection_made`` (where the cap evicts): a flood is taken
in batches this size, so the open files stay near the cap (at uvicorn's 2,048, 1,100 idle
connections took every file of a process at the usual 1,024)."""


class Session(Protocol):
    """What the endpoint calls for one trajectory's requests (``AgentTrajectory``)."""

    async def complete(self, body: dict) -> dict:
        """The chat-completion response for ``body``; raises :class:`EndpointError`."""
        ...

    def refuse(self, reason: str) -> None:
        """A request that could not be read at all (``reason``): the trajectory fails."""
        ...


def _error(status: int, message: str, kind: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


def _chunks(resp: dict) -> list[dict]:
    """A finished completion as the stream of chunks an OpenAI server would send."""
    choice = resp["choices"][0]
    msg = choice["message"]
    head = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"],
            "model": resp["model"]}
    delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
    first = {"index": 0, "delta": delta, "finish_reason": None}
    if choice.get("logprobs") is not None:
        first["logprobs"] = choice["logprobs"]
    return [{**head, "choices": [first]},
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
             "usage": resp.get("usage")}]


class _Server:
    """uvicorn's server without its signal handlers (the node owns SIGINT/SIGTERM)."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the embedding process handles signals
                yield

        return Quiet(config)


class _Connections:
    """The endpoint's open connections, oldest first, with the counters tests read."""

    def __init__(self, cap: int, timeout: float) -> None:
        self.cap, self.timeout = cap, timeout
        self.open: dict[Any, None] = {}
        """Protocol objects of the open connections, in the order they opened."""
        self.evicted = 0
        """Connections closed to make room for a newer one."""
        self.refused = 0
        """Connections closed at once: every open one had a request in progress."""
        self.timed_out = 0
        """Connections closed for sending no whole request head in time."""


def _guarded_protocol(conns: _Connections) -> type:
    """uvicorn's h11 protocol, bounded by ``conns``: a cap on connections (evicting the
    oldest one without a request in progress) and a deadline for each request head. It
    relies on uvicorn's ``H11Protocol`` attributes ``transport`` and ``cycle`` (the request
    in progress, None before the first) and on its hooks ``connection_made``,
    ``connection_lost`` and ``on_response_complete`` (tests/security/test_agent_surfaces.py
    holds each behaviour)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def busy(self) -> bool:
            """A request's head arrived and its response has not ended."""
            return self.cycle is not None and not self.cycle.response_complete

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            conns.open[self] = None
            if len(conns.open) > conns.cap:
                idle = next((c for c in conns.open if not c.busy()), None)
                if idle is None or idle is self:
                    conns.refused += 1
                    del conns.open[self]
                    self.transport.close()
                    return
                conns.evicted += 1
                del conns.open[idle]  # now: its connection_lost comes in a later callback
                idle.transport.close()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            conns.open.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            """From now the next request head must arrive within ``conns.timeout``; bytes
            trickling in do not extend it."""
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(conns.timeout, self._expire, self.cycle)

        def _expire(self, cycle: Any) -> None:
            self._deadline = None
            if self.cycle is cycle and not self.busy() and not self.transport.is_closing():
                conns.timed_out += 1  # no new request head since it was armed
                conns.open.pop(self, None)
                self.transport.close()

    return Guarded


class AgentEndpoint:
    """The HTTP server; :meth:`open` gives a trajectory its base URL, :meth:`close` ends it.
    ``max_connections``, ``request_timeout`` and ``max_request_bytes`` bound what a peer can
    hold (the module doc; ``rollout.agent_*`` in a run's config)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None, *, max_connections: int = 320,
                 request_timeout: float = 30.0, max_request_bytes: int = 4 << 20) -> None:
        self.host, self.port = host, port
        self.advertise = advertise or host
        """The host name put in base URLs (``host`` unless it listens on all addresses)."""
        self.max_request_bytes = max_request_bytes
        self.request_timeout = request_timeout
        self.connections = _Connections(max_connections, request_timeout)
        self._sessions: dict[str, tuple[str, Session]] = {}
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self.requests = 0
        """Requests answered (any status)."""

    async def _body(self, request: Any, session: Session) -> bytes:
        """The request's body, read only while it stays within ``max_request_bytes`` and
        arrives within ``request_timeout``; else :class:`EndpointError` (413, which also
        refuses the trajectory, or 408)."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            reason = (f"the request body is {int(declared)} bytes; this endpoint reads at most "
                      f"{limit} (rollout.agent_max_request_bytes)")
            session.refuse(reason)
            raise EndpointError(413, reason)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.request_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        reason = (f"the request body passed {limit} bytes, the most this "
                                  f"endpoint reads (rollout.agent_max_request_bytes)")
                        session.refuse(reason)
                        raise EndpointError(413, reason)
                    chunks.append(chunk)
        except TimeoutError:
            raise EndpointError(408, f"the request body did not arrive within "
                                     f"{self.request_timeout:g} s (rollout.agent_request_timeout)",
                                "timeout") from None
        return b"".join(chunks)

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        def session_of(request: Any) -> Session:
            tid, key = request.path_params["traj"], request.path_params["key"]
            entry = self._sessions.get(tid)
            # bytes: compare_digest refuses a str with non-ASCII characters (a TypeError)
            if entry is None or not hmac.compare_digest(
                    entry[0].encode(), key.encode("utf-8", "replace")):
                raise EndpointError(404, f"no running trajectory at this URL ({tid!r:.80}): it "
                                         f"ended or never ran here", "not_found_error")
            return entry[1]

        async def chat(request: Any) -> Any:
            self.requests += 1
            try:
                session = session_of(request)
                data = await self._body(request, session)
                try:
                    body = decode_request(data)
                except EndpointError as e:
                    session.refuse(str(e))
                    raise
                resp = await session.complete(body)
            except EndpointError as e:
                out = _error(e.status, str(e), e.kind)
                if e.status in (408, 413):  # the rest of the body is not read: close
                    out.headers["connection"] = "close"
                return out
            if not body.get("stream"):
                return JSONResponse(resp)

            async def sse():
                for c in _chunks(resp):
                    yield f"data: {json.dumps(c)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def models(request: Any) -> Any:
            self.requests += 1
            try:
                session_of(request)
            except EndpointError as e:
                return _error(e.status, str(e), e.kind)
            return JSONResponse({"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "rollart"}]})

        base = "/t/{traj}/{key}/v1"
        return Starlette(routes=[Route(f"{base}/chat/completions", chat, methods=["POST"]),
                                 Route(f"{base}/models", models, methods=["GET"])])

    async def start(self) -> None:
        """Listen (on a free port when ``port`` is 0) and serve in a task of this object."""
        try:
            import uvicorn
        except ImportError as e:
            raise RuntimeError(f"an agent env needs the agent extra: pip install "
                               f"'rollart[agent]' ({e})") from None
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it (Linux): uvicorn writes a response's head and body
        # apart, and with Nagle on, the body waited for the client's delayed ACK, ~40 ms a
        # turn (benchmarks/agent_endpoint.py: serial round trip 47 -> ~2 ms)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and self.connections.cap > soft // 2:
            log.warning("agent endpoint: %d connections at most, not %d: the process may open "
                        "%d files (ulimit -n)", soft // 2, self.connections.cap, soft)
            self.connections.cap = max(1, soft // 2)
        config = uvicorn.Config(self._app(), lifespan="off", log_level="warning",
                                access_log=False, timeout_graceful_shutdown=5,
                                http=_guarded_protocol(self.connections),
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                                backlog=ACCEPT_BATCH)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]),
                                         name=f"agent-endpoint:{self.port}")
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the agent endpoint stopped while starting")
            if time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start within 30 s")
            await asyncio.sleep(0.01)
        log.info("agent endpoint on http://%s:%d", self.advertise, self.port)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), 10)
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self._task = None

    def open(self, traj_id: str, session: Session) -> str:
        """Serve ``traj_id`` through ``session``; returns its base URL."""
        key = secrets.token_urlsafe(12)
        self._sessions[traj_id] = (key, session)
        return f"http://{self.advertise}:{self.port}/t/{traj_id}/{key}/v1"

    def close(self, traj_id: str) -> None:
        """``traj_id``'s URL answers 404 from now on (idempotent)."""
        self._sessions.pop(traj_id, None)

    def __len__(self) -> int:
        return len(self._sessions)
