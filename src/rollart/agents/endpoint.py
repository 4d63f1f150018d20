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
that breaks the contract, 404 for an unknown or finished trajectory, 503 when the
trajectory could not get a generation (it is over then).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import socket
import time
from typing import Any, Protocol

log = logging.getLogger(__name__)

MODEL_NAME = "rollart-policy"
"""The model id ``GET /v1/models`` names (requests may name any model)."""


class EndpointError(Exception):
    """An error answered to the agent: HTTP ``status`` with an OpenAI-style body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


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


class AgentEndpoint:
    """The HTTP server; :meth:`open` gives a trajectory its base URL, :meth:`close` ends it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None) -> None:
        self.host, self.port = host, port
        self.advertise = advertise or host
        """The host name put in base URLs (``host`` unless it listens on all addresses)."""
        self._sessions: dict[str, tuple[str, Session]] = {}
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self.requests = 0
        """Requests answered (any status)."""

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        def session_of(request: Any) -> Session:
            tid, key = request.path_params["traj"], request.path_params["key"]
            entry = self._sessions.get(tid)
            if entry is None or not hmac.compare_digest(entry[0], key):
                raise EndpointError(404, f"no running trajectory at this URL ({tid}): it ended "
                                         f"or never ran here", "not_found_error")
            return entry[1]

        async def chat(request: Any) -> Any:
            self.requests += 1
            try:
                session = session_of(request)
                try:
                    body = json.loads(await request.body())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    body = f"the body is not JSON: {e}"
                if not isinstance(body, dict):
                    reason = body if isinstance(body, str) else "the body must be a JSON object"
                    session.refuse(reason)
                    raise EndpointError(400, reason)
                resp = await session.complete(body)
            except EndpointError as e:
                return _error(e.status, str(e), e.kind)
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
        config = uvicorn.Config(self._app(), lifespan="off", log_level="warning",
                                access_log=False, timeout_graceful_shutdown=5)
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
