"""A running OpenEnv server as a text environment: ``type: "openenv:<url>"``.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ (``openenv-core``) serves an environment
over HTTP and WebSocket. This adapter speaks that wire protocol itself, so neither
``openenv-core`` nor the environment's own client package is needed::

    envs:
      main:
        type: "openenv:http://127.0.0.1:8000"     # the server's base URL (http, https, ws, wss)
        args: {action_field: message}            # the echo env's action is {"message": text}

The protocol (``openenv-core`` 0.2/0.3, ``src/openenv/core/env_server/http_server.py``):

- ``GET /health`` answers ``{"status": "healthy"}``; ``GET /schema`` the JSON schemas of the
  ``action``, ``observation`` and ``state``; ``GET /metadata`` the env's ``name`` and
  ``description``.
- ``/ws`` (WebSocket) is a *session*: each connection gets an env instance of its own on the
  server. The client sends ``{"type": "reset", "data": {"seed": ...}}`` and
  ``{"type": "step", "data": <action fields>}``, the server answers each with
  ``{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`` or
  ``{"type": "error", "data": {"message": ..., "code": ...}}``; ``{"type": "close"}`` ends it.
  A server admits ``max_concurrent_envs`` sessions at once (1 unless the env is marked safe
  for more); past that a connection is answered with ``CAPACITY_REACHED``.
- ``POST /reset`` (``{"seed": ...}``) and ``POST /step`` (``{"action": {...}}``) answer
  ``{"observation", "reward", "done"}``; an action that fails the action schema is a 422.
  Since ``openenv-core`` 0.2 these build a *fresh* env for every request (stateless), so an
  episode of more than one step works only over ``/ws``; servers before 0.2 (and servers
  whose env factory returns one shared instance) keep one env for every HTTP client.

``transport: ws`` (the default, what OpenEnv's own client uses) runs one session per env
instance, so one server serves as many trajectories at once as it admits sessions; it
needs the ``websockets`` package. ``transport: http`` uses ``POST /reset``/``/step``
through ``httpx``: for servers whose HTTP endpoints keep state, and then one trajectory at
a time per server. A ``ws`` URL is the same server as its ``http`` one.

Args (besides the URL, which ``type`` gives):

- ``action_field``: the action field the reply's text goes into (default ``message``: the
  action is ``{"message": text}``); ``null``: the text is the action's JSON object itself
  (text that is not a JSON object is an invalid action, never sent). When the server's
  schema lists the action's fields, a field it lacks fails at construction, naming them;
  when the field's schema is an ``enum`` of strings, ``legal_actions()`` returns it, so
  decoding is constrained to them.
- ``observation_field``: the observation field that is the text the model sees; default:
  the observation's only string field, else the whole observation as JSON.
- ``instruction``: the system prompt; default: one naming the env (``/metadata``).
- ``success_field`` (default ``success``): a field of the observation that says the episode
  was won; without it in an observation, success is an observation with ``done`` and a
  reward ``>= success_reward`` (default: a reward ``> 0``).
- ``invalid_reward``: the reward of an action the server rejects as invalid (HTTP 422, or
  the ``VALIDATION_ERROR`` code over ``/ws``): the env stays as it was and
  ``info["valid_action"]`` is False (``info["error"]`` says why).
- ``reset_args``: more keyword arguments of the server env's ``reset`` (``seed`` is the
  trajectory's; a server passes on only the ones its env's ``reset`` takes).
- ``timeout``: seconds any one request may take, whole (connecting, sending and the entire
  answer; a server that trickles its answer byte by byte is cut off too), default 30.
- ``max_response_bytes``: bytes one answer may have (an HTTP body, a WebSocket message),
  default 16 MiB; a larger one is refused before it is read whole.

``info`` carries ``valid_action``, ``success`` and ``observation`` (the observation's fields;
OpenEnv does not send an observation's ``metadata``). ``done`` is ``terminated`` (OpenEnv
has no truncation).

The server is another process, so its answers are bounded: an HTTP body is read in chunks up
to ``max_response_bytes`` (its ``Content-Length`` is checked first), compressed bodies are
refused (``Accept-Encoding: identity``: a small gzip can inflate to gigabytes), redirects are
refused rather than followed (the config names the server; a redirect could point anywhere),
a WebSocket message is at most ``max_response_bytes`` with at most two frames buffered, and
JSON nested too deeply for the parser is an unexpected answer, not a ``RecursionError``. Each
refusal is a ``RuntimeError`` naming the server, the request and what was wrong.

Failures: a server that cannot be reached when the env is built, or at a ``reset``, raises
``ConnectionError``/``TimeoutError`` (the runner retries: transient); a URL with nothing
OpenEnv behind it (``/health`` answers 404) or an ``action_field`` the schema lacks is a
``ValueError`` (permanent). A step the server fails (a 4xx other than 422, a 5xx, an
``EXECUTION_ERROR``) raises ``RuntimeError`` naming the status and the body; a server that
goes away mid-episode raises ``ConnectionError`` at once; a server that stops answering
raises ``TimeoutError`` after ``timeout``. Connections to a loopback host bypass proxies.

How the wire is spoken (the bounds and failures above) is
:mod:`rollart.envs.openenv_wire`; this module is the adapter: args, schema, text in and out.

The env is ``async``: run it with ``executor: thread`` (the default), where it is awaited on
the event loop; with ``executor: process`` the worker's loop runs only during a call, so a
session can miss the server's WebSocket pings while the model thinks, and be closed.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import urllib.parse
from typing import Any, Callable, Literal

from rollart.envs.openenv_wire import BODY_CHARS, PREFIX, OpenEnvWire, body_text

log = logging.getLogger(__name__)

_EXAMPLE = "e.g. 'openenv:http://127.0.0.1:8000'"
_MAX_RESPONSE = 16 * 2**20  # default bytes of one answer (observations can carry images)
_OBS_RESERVED = ("done", "reward", "metadata")  # Observation fields that are not the observation


def base_url(url: str) -> str:
    """``url`` as the server's ``http(s)://host[:port][/path]`` base (no trailing slash);
    ``ws``/``wss`` become ``http``/``https``. Raises ``ValueError`` saying what is wrong."""
    shown = f"env type {PREFIX + str(url)!r}"
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"env type {PREFIX!r} needs the server's URL, {_EXAMPLE}")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{shown}: not a URL ({e}); {_EXAMPLE}") from None
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme.lower(), parts.scheme.lower())
    if scheme not in ("http", "https"):
        raise ValueError(f"{shown}: the URL must start with http://, https://, ws:// or wss:// "
                         f"(got {parts.scheme + '://' if parts.scheme else 'no scheme'}); {_EXAMPLE}")
    if not parts.hostname:
        raise ValueError(f"{shown}: the URL names no host; {_EXAMPLE}")
    if parts.query or parts.fragment:
        raise ValueError(f"{shown}: the URL is the server's base URL, without ?query or #fragment")
    if parts.username or parts.password:
        raise ValueError(f"{shown}: no credentials in the URL (a config is not a place for secrets)")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host if port is None else f"{host}:{port}"
    return urllib.parse.urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))




def factory(url: str) -> Callable[..., "OpenEnvEnv"]:
    """The constructor behind ``type: "openenv:<url>"`` (checks the URL; contacts nothing)."""
    base_url(url)
    make = functools.partial(OpenEnvEnv, url)
    make.__name__ = f"{PREFIX}{url}"  # type: ignore[attr-defined]  # shown in messages
    return make














_described: dict[str, tuple[dict, dict]] = {}
"""base URL -> ({"action": schema, "observation": schema}, metadata), once ``/schema`` answered:
they do not change while a server runs (a server restarted as another env needs a new process)."""
_described_lock = threading.Lock()


class OpenEnvEnv:
    """An OpenEnv server's environment as a text env (see the module doc for the args)."""

    def __init__(self, url: str, *, transport: Literal["ws", "http"] = "ws",
                 action_field: str | None = "message", observation_field: str | None = None,
                 instruction: str | None = None, success_field: str | None = "success",
                 success_reward: float | None = None, invalid_reward: float = 0.0,
                 reset_args: dict[str, Any] | None = None, timeout: float = 30.0,
                 max_response_bytes: int = _MAX_RESPONSE) -> None:
        self.url = base_url(url)
        where = f"env {PREFIX}{self.url}"
        if transport not in ("ws", "http"):
            raise ValueError(f"{where}: arg 'transport' must be 'ws' or 'http', got {transport!r}")
        for arg, value in (("action_field", action_field), ("observation_field", observation_field),
                           ("success_field", success_field)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{where}: arg {arg!r} must be a field name or null, got {value!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"{where}: arg 'timeout' must be a number of seconds > 0, got {timeout!r}")
        if (not isinstance(max_response_bytes, int) or isinstance(max_response_bytes, bool)
                or max_response_bytes < 1024):
            raise ValueError(f"{where}: arg 'max_response_bytes' must be a number of bytes >= "
                             f"1024, got {max_response_bytes!r}")
        if reset_args is not None and not isinstance(reset_args, dict):
            raise ValueError(f"{where}: arg 'reset_args' must be a mapping, got {reset_args!r}")
        if reset_args and "seed" in reset_args:
            raise ValueError(f"{where}: arg 'reset_args' may not set 'seed' (each trajectory's seed is sent)")
        self.transport = transport
        self.action_field, self.observation_field = action_field, observation_field
        self.success_field = success_field
        self.success_reward = None if success_reward is None else float(success_reward)
        self.invalid_reward = float(invalid_reward)
        self.reset_args = dict(reset_args or {})
        self.timeout = float(timeout)
        self.max_response_bytes = max_response_bytes
        self._wire = OpenEnvWire(self.url, transport, self.timeout, max_response_bytes)
        self._probe()
        action_schema, meta = self._describe()
        self._legal = self._enum_of(action_schema)
        self.instruction = instruction if instruction is not None else self._default_instruction(meta)
        self._last = ""
        self.done = True

    # -- construction: is a server there, what does it take ------------------------------



    def _probe(self) -> None:
        resp = self._wire.get("/health")
        if resp.status_code >= 500 or resp.status_code == 429:  # starting, overloaded: later
            raise ConnectionError(f"OpenEnv server {self.url} is not ready: GET /health answered "
                                  f"HTTP {resp.status_code}: {body_text(resp)}")
        if resp.status_code != 200:
            raise ValueError(f"no OpenEnv server at {self.url}: GET /health answered HTTP "
                             f"{resp.status_code}: {body_text(resp)} (is the URL the server's base URL?)")
        try:
            status = str(resp.json().get("status", "healthy"))
        except (ValueError, AttributeError):
            status = "healthy"
        if status.lower() == "unhealthy":
            raise ConnectionError(f"OpenEnv server {self.url} reports itself unhealthy")

    def _json_of(self, path: str) -> dict:
        """The JSON object at ``path``, or {} when the server has none there."""
        try:
            resp = self._wire.get(path)
            if resp.status_code == 200 and isinstance(data := resp.json(), dict):
                return data
        except (ConnectionError, TimeoutError, ValueError) as e:
            log.debug("OpenEnv server %s: GET %s: %s", self.url, path, e)
        return {}

    def _describe(self) -> tuple[dict, dict]:
        """The action schema and metadata (cached per server), the args checked against them."""
        with _described_lock:
            known = _described.get(self.url)
        if known is None:
            schema = self._json_of("/schema")
            action = schema.get("action") if isinstance(schema.get("action"), dict) else {}
            obs = schema.get("observation") if isinstance(schema.get("observation"), dict) else {}
            known = ({"action": action, "observation": obs}, self._json_of("/metadata"))
            if schema:  # a server that did not answer this time is asked again next time
                with _described_lock:
                    _described[self.url] = known
        schemas, meta = known
        where = f"env {PREFIX}{self.url}"
        for arg, value, kind in (("action_field", self.action_field, "action"),
                                 ("observation_field", self.observation_field, "observation")):
            props = schemas[kind].get("properties")
            if value is not None and isinstance(props, dict) and props and value not in props:
                fields = [f for f in props if f not in _OBS_RESERVED]
                raise ValueError(f"{where}: arg {arg!r}: the server's {kind} has no field {value!r}; "
                                 f"its fields: {', '.join(fields) or '(none)'}")
        return schemas["action"], meta

    def _enum_of(self, action_schema: dict) -> list[str] | None:
        prop = (action_schema.get("properties") or {}).get(self.action_field or "")
        values = prop.get("enum") if isinstance(prop, dict) else None
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return list(values)
        return None

    def _default_instruction(self, meta: dict) -> str:
        name = str(meta.get("name") or self.url)
        desc = str(meta.get("description") or "").strip().rstrip(".")
        how = ("Reply with your action." if self.action_field is not None
               else "Reply with your action as a JSON object of the action's fields.")
        return f"You act in the OpenEnv environment {name}{': ' + desc if desc else ''}. " \
               f"Each turn shows the current observation. {how}"






    # -- text in and out --------------------------------------------------------------------

    def _parse(self, kind: str, payload: Any) -> tuple[dict[str, Any], float, bool]:
        obs = payload.get("observation") if isinstance(payload, dict) else None
        reward = payload.get("reward") if isinstance(payload, dict) else None
        if (not isinstance(obs, dict) or not isinstance(payload.get("done", False), bool)
                or not (reward is None or isinstance(reward, (int, float)))):
            raise RuntimeError(f"OpenEnv server {self.url} answered {kind} with an unexpected "
                               f"payload (want observation, reward, done): {str(payload)[:BODY_CHARS]}")
        return obs, 0.0 if reward is None else float(reward), bool(payload.get("done", False))

    def _text(self, obs: dict[str, Any]) -> str:
        field = self.observation_field
        if field is not None:
            if field not in obs:
                raise RuntimeError(f"OpenEnv server {self.url}: the observation has no field "
                                   f"{field!r} (arg observation_field); it has: {', '.join(obs)}")
            value = obs[field]
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        texts = [v for v in obs.values() if isinstance(v, str)]
        if len(texts) == 1:
            return texts[0]
        return json.dumps(obs, ensure_ascii=False)

    def _success(self, obs: dict[str, Any], reward: float, done: bool) -> bool:
        if self.success_field is not None and obs.get(self.success_field) is not None:
            return bool(obs[self.success_field])
        if not done:
            return False
        return reward > 0 if self.success_reward is None else reward >= self.success_reward

    def _action(self, text: str) -> dict[str, Any] | None:
        if self.action_field is not None:
            return {self.action_field: text}
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _invalid(self, why: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self._last, self.invalid_reward, False, False, {
            "valid_action": False, "success": False, "error": why}

    # -- the Env protocol -------------------------------------------------------------------

    def legal_actions(self) -> list[str] | None:
        return None if self._legal is None else list(self._legal)

    async def close(self) -> None:
        """End the session and release the connections. Idempotent."""
        await self._wire.close()


    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.done = True
        payload, _ = await self._wire.request("reset", {**self.reset_args, "seed": int(seed)})
        obs, _, done = self._parse("reset", payload)
        self._last = self._text(obs)
        self.done = done
        return self._last, {"valid_action": True, "success": False, "observation": obs}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError(f"env {PREFIX}{self.url}: step() before reset() or after the episode ended")
        act = self._action(action)
        if act is None:
            return self._invalid("the action is not a JSON object (action_field is null)")
        payload, invalid = await self._wire.request("step", act)
        if invalid is not None:
            return self._invalid(invalid)
        obs, reward, done = self._parse("step", payload)
        self._last = self._text(obs)
        self.done = done
        return self._last, reward, done, False, {
            "valid_action": True, "success": self._success(obs, reward, done), "observation": obs}

