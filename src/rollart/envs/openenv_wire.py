"""The wire of an OpenEnv server (:mod:`rollart.envs.openenv`): bounded HTTP requests and a
WebSocket session, each answer read whole within ``timeout`` and ``max_response_bytes``.

The protocol it speaks and why each bound is there are in :mod:`rollart.envs.openenv`'s
docstring; this module is how: one :class:`OpenEnvWire` per env instance, which the adapter
asks for ``reset`` and ``step`` payloads and which turns every way a server can fail into a
``ConnectionError``, ``TimeoutError`` or ``RuntimeError`` naming the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import ipaddress
import json
import logging
import urllib.parse
from typing import Any, Literal

log = logging.getLogger(__name__)

PREFIX = "openenv:"
"""``type: "openenv:<url>"`` selects this adapter."""

_WS_QUEUE = 2  # WebSocket frames buffered before the client reads them
BODY_CHARS = 500
"""Characters of an error body (or an unexpected message) quoted in a message."""


def _loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

def _httpx() -> Any:
    try:
        import httpx  # optional: the openenv extra
    except ImportError as e:
        raise ImportError(f"env type '{PREFIX}<url>' needs httpx: pip install httpx: {e}") from e
    return httpx

def _websockets() -> Any:
    try:
        import websockets.asyncio.client  # optional: the openenv extra
        import websockets.exceptions
    except ImportError as e:
        raise ImportError(f"env type '{PREFIX}<url>' with transport: ws needs websockets>=15: "
                          f"pip install websockets (or use transport: http): {e}") from e
    return websockets

@functools.cache
def _connect_no_redirects(ws_lib: Any) -> Any:
    """``websockets``' ``connect`` that raises a redirect's ``InvalidStatus`` instead of
    following it."""

    class Connect(ws_lib.asyncio.client.connect):
        def process_redirect(self, exc: Exception) -> Exception:
            return exc

    return Connect

@dataclasses.dataclass(frozen=True)
class Response:
    """One HTTP answer, read whole within the bounds (:meth:`OpenEnvWire.fetch`)."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` when it is not (nested too deeply included)."""
        try:
            return json.loads(self.content)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None

def _loads(raw: Any) -> Any:
    """JSON of a WebSocket message; None when it is not JSON (or nested too deeply)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None

def body_text(resp: Any) -> str:
    text = resp.text.strip().replace("\n", " ")
    return text if len(text) <= BODY_CHARS else text[:BODY_CHARS] + "..."



class OpenEnvWire:
    """One env instance's connections to the OpenEnv server at ``url`` (a base URL,
    :func:`rollart.envs.openenv.base_url`): an ``httpx`` client (``transport: http``, and the
    constructor's probes either way) and a WebSocket session (``transport: ws``)."""

    def __init__(self, url: str, transport: Literal["ws", "http"], timeout: float,
                 max_response_bytes: int) -> None:
        self.url, self.transport = url, transport
        self.timeout, self.max_response_bytes = timeout, max_response_bytes
        self._httpx = _httpx()
        self._ws_lib = _websockets() if transport == "ws" else None
        self._proxies = not _loopback(url)
        self._client: Any = None  # httpx.AsyncClient (transport http), made on the event loop
        self._ws: Any = None  # the session's connection (transport ws)

    def get(self, path: str) -> Response:
        """``GET`` on the server, sync (the constructor runs off the event loop): the bounded
        :meth:`fetch` on an event loop of its own, in a thread of its own (whoever calls
        may have a loop running)."""
        async def once() -> Response:
            async with self._httpx.AsyncClient(trust_env=self._proxies) as client:
                return await self.fetch(client, "GET", path)

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="openenv-get") as pool:
            return pool.submit(asyncio.run, once()).result()

    async def fetch(self, client: Any, method: str, path: str,
                     body: dict[str, Any] | None = None) -> Response:
        """One request with ``client`` (an ``httpx.AsyncClient``), its whole answer read
        within ``timeout`` and ``max_response_bytes``; a redirect or a compressed body is
        refused (``RuntimeError``), a timeout is ``TimeoutError``, a transport error
        ``ConnectionError``."""
        httpx, cap = self._httpx, self.max_response_bytes
        what = f"OpenEnv server {self.url}: {method} {path}"
        try:
            async with asyncio.timeout(self.timeout):
                async with client.stream(method, self.url + path, json=body,
                                         headers={"Accept-Encoding": "identity"},
                                         follow_redirects=False, timeout=self.timeout) as resp:
                    if 300 <= resp.status_code < 400:
                        where = resp.headers.get("location", "?")[:BODY_CHARS]
                        raise RuntimeError(f"{what} answered a redirect (HTTP {resp.status_code} "
                                           f"to {where!r}): refused; give the server's own URL")
                    encoding = resp.headers.get("content-encoding", "").strip().lower()
                    if encoding not in ("", "identity"):
                        raise RuntimeError(f"{what} answered a {encoding!r}-encoded body: "
                                           "refused (asked for identity)")
                    length = resp.headers.get("content-length", "0").strip()
                    if not length.isdigit() or int(length) > cap:
                        raise RuntimeError(f"{what} announced a body of {length[:40]!r} bytes, "
                                           f"over max_response_bytes ({cap})")
                    data = bytearray()
                    async for chunk in resp.aiter_raw():
                        if len(data) + len(chunk) > cap:
                            raise RuntimeError(f"{what} sent a body over max_response_bytes "
                                               f"({cap})")
                        data += chunk
                    return Response(resp.status_code, bytes(data))
        except (TimeoutError, httpx.TimeoutException):
            raise TimeoutError(f"{what} got no whole answer within {self.timeout:g}s") from None
        except httpx.TransportError as e:
            raise ConnectionError(f"OpenEnv server {self.url} cannot be reached: {method} "
                                  f"{path}: {type(e).__name__}: {e}") from None

    def abort(self) -> None:
        """Drop the session's connection at once (the server then frees the session)."""
        ws, self._ws = self._ws, None
        transport = getattr(ws, "transport", None)
        if transport is not None:
            transport.abort()

    async def connect(self) -> Any:
        if self._ws is not None:
            return self._ws
        ws_lib = self._ws_lib
        url = "ws" + self.url[len("http"):] + "/ws"
        try:
            self._ws = await _connect_no_redirects(ws_lib)(
                url, open_timeout=self.timeout, max_size=self.max_response_bytes,
                max_queue=_WS_QUEUE, compression=None, proxy=True if self._proxies else None)
        except ws_lib.exceptions.InvalidStatus as e:
            status = e.response.status_code
            hint = (" (a server before openenv-core 0.2 has no /ws: use transport: http)"
                    if status in (403, 404) else
                    " (a redirect: refused; give the server's own URL)"
                    if 300 <= status < 400 else "")
            err = ConnectionError if status >= 500 or status == 429 else RuntimeError
            raise err(f"OpenEnv server {self.url}: the WebSocket session at /ws was refused with "
                      f"HTTP {status}{hint}") from None
        except TimeoutError:
            raise TimeoutError(f"OpenEnv server {self.url}: no WebSocket session at /ws within "
                               f"{self.timeout:g}s") from None
        except (OSError, ws_lib.exceptions.InvalidHandshake, ws_lib.exceptions.ConnectionClosed) as e:
            raise ConnectionError(f"OpenEnv server {self.url} cannot be reached at /ws: "
                                  f"{type(e).__name__}: {e}") from None
        return self._ws

    async def ws_call(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one message of the session, return the server's reply (an error reply too)."""
        ws = await self.connect()
        closed = self._ws_lib.exceptions.ConnectionClosed
        try:
            async with asyncio.timeout(self.timeout):
                try:
                    await ws.send(json.dumps({"type": kind, "data": data}))
                except closed:  # what the server said before it closed (CAPACITY_REACHED) is read
                    pass
                raw = await ws.recv()
        except TimeoutError:
            self.abort()
            raise TimeoutError(f"OpenEnv server {self.url} did not answer {kind} within "
                               f"{self.timeout:g}s") from None
        except (closed, OSError) as e:
            self.abort()
            if getattr(getattr(e, "sent", None), "code", None) == 1009:  # message too big
                raise RuntimeError(f"OpenEnv server {self.url} answered {kind} with a message "
                                   f"over max_response_bytes ({self.max_response_bytes})") from None
            raise ConnectionError(f"OpenEnv server {self.url} closed the session during {kind}"
                                  f"{' (mid-episode)' if kind == 'step' else ''}: "
                                  f"{type(e).__name__}: {e}") from None
        except BaseException:  # cancelled (the runner's deadline): the session is unusable
            self.abort()
            raise
        reply = _loads(raw)
        if not isinstance(reply, dict) or reply.get("type") not in ("observation", "error"):
            self.abort()
            raise RuntimeError(f"OpenEnv server {self.url} answered {kind} with an unexpected "
                               f"message: {str(raw)[:BODY_CHARS]!r}")
        if reply["type"] == "error":
            err = reply.get("data") if isinstance(reply.get("data"), dict) else {}
            if err.get("code") == "CAPACITY_REACHED":  # the server closes this connection
                self.abort()
                raise ConnectionError(
                    f"OpenEnv server {self.url} is at capacity ({err.get('active_sessions', '?')} of "
                    f"{err.get('max_sessions', '?')} sessions): start it with more sessions "
                    f"(max_concurrent_envs) or run fewer trajectories at once")
        return reply

    async def post(self, path: str, body: dict[str, Any]) -> Response:
        if self._client is None:
            self._client = self._httpx.AsyncClient(trust_env=self._proxies)
        return await self.fetch(self._client, "POST", path, body)

    async def request(self, kind: str, data: dict) -> tuple[Any, str | None]:
        """One ``reset`` or ``step`` on the server, by either transport: ``(payload, None)``,
        or ``(None, why)`` for a step the server rejected as invalid (its validation error);
        RuntimeError naming the server for any other refusal."""
        if self.transport == "ws":
            reply = await self.ws_call(kind, data)
            if reply["type"] != "error":
                return reply.get("data"), None
            err = reply.get("data") or {}
            msg = f"{err.get('message', err)} (code {err.get('code', '?')})"
            if kind == "step" and err.get("code") == "VALIDATION_ERROR":
                errors = err.get("errors")
                return None, f"{msg}: {json.dumps(errors)[:BODY_CHARS]}" if errors else msg
            raise RuntimeError(f"OpenEnv server {self.url}: {kind} failed: {msg}")
        resp = await self.post(f"/{kind}", data if kind == "reset" else {"action": data})
        if kind == "step" and resp.status_code == 422:
            return None, f"HTTP 422: {body_text(resp)}"
        if resp.status_code != 200:
            raise RuntimeError(f"OpenEnv server {self.url}: POST /{kind} answered HTTP "
                               f"{resp.status_code}: {body_text(resp)}")
        try:
            return resp.json(), None
        except ValueError as e:
            raise RuntimeError(f"OpenEnv server {self.url}: POST /{kind} answered a body that "
                               f"is not JSON ({e}): {body_text(resp)}") from None

    async def close(self) -> None:
        """End the session (``close`` message) and release the connections. Idempotent."""
        ws, client = self._ws, self._client
        self._ws = self._client = None
        try:
            if ws is not None:
                try:
                    async with asyncio.timeout(min(self.timeout, 5.0)):
                        await ws.send(json.dumps({"type": "close"}))
                        await ws.close()
                except Exception as e:  # the server may be gone already
                    log.debug("OpenEnv server %s: closing the session: %s", self.url, e)
                    transport = getattr(ws, "transport", None)
                    if transport is not None:
                        transport.abort()
        finally:
            if client is not None:
                await client.aclose()
