"""An OpenEnv-style server for tests: text FrozenLake over OpenEnv's wire protocol.

``python -m tests.envs.openenv_server [--max-sessions N]`` listens on a free loopback port
and prints ``PORT <n>`` once bound. It serves what ``openenv-core``'s ``HTTPEnvServer``
serves, written from its protocol (see :mod:`rollart.envs.openenv`), without openenv-core:

- ``GET /health`` ``{"status": "healthy"}``, ``GET /metadata``, ``GET /schema``, ``GET /state``;
- ``WebSocket /ws``: one env per connection, at most ``--max-sessions`` at once (past that:
  an ``error`` message with code ``CAPACITY_REACHED``, then close); messages
  ``reset``/``step``/``state``/``close``, answers ``observation``/``state``/``error``;
- ``POST /reset``, ``POST /step``: on one env shared by every HTTP client (what openenv-core
  servers before 0.2 did; since 0.2 they build a fresh env per request).

The action is ``{"move": str}`` (non-empty, no other field; otherwise HTTP 422 or
``VALIDATION_ERROR``); the observation ``{"board": str, "steps": int}``; reward 1.0 on the
goal; ``done`` on the goal, a hole or after ``max_steps``. A move the game does not know
(``"jump"``) is a valid action that wastes a step. Stepping an env that is not in an
episode is a 409 (HTTP) or ``EXECUTION_ERROR`` (``/ws``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rollart.envs.frozenlake import FrozenLakeEnv

ACTION_SCHEMA = {
    "title": "MoveAction", "type": "object", "additionalProperties": False,
    "properties": {"move": {"type": "string", "minLength": 1},
                   "metadata": {"type": "object"}},
    "required": ["move"],
}
OBSERVATION_SCHEMA = {
    "title": "BoardObservation", "type": "object",
    "properties": {"board": {"type": "string"}, "steps": {"type": "integer"},
                   "done": {"type": "boolean"}, "reward": {"type": ["number", "null"]},
                   "metadata": {"type": "object"}},
}
STATE_SCHEMA = {"title": "State", "type": "object",
                "properties": {"episode_id": {"type": ["string", "null"]},
                               "step_count": {"type": "integer"}}}


class Game:
    """One FrozenLake episode at a time, in OpenEnv's terms."""

    def __init__(self) -> None:
        self.env = FrozenLakeEnv(size=4)
        self.episode: str | None = None

    def reset(self, seed: Any) -> dict[str, Any]:
        seed = int(seed) if isinstance(seed, int) else 0
        board, _ = self.env.reset(seed)
        self.episode = f"ep-{seed}"
        return {"observation": {"board": board, "steps": 0}, "reward": None, "done": False}

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        if self.env.done:
            raise LookupError("step() outside an episode: reset first")
        board, reward, term, trunc, _ = self.env.step(action["move"])
        return {"observation": {"board": board, "steps": self.env.steps}, "reward": reward,
                "done": bool(term or trunc)}

    def state(self) -> dict[str, Any]:
        return {"episode_id": self.episode, "step_count": self.env.steps}


def validate(action: Any) -> list[dict[str, Any]]:
    """pydantic-style errors of ``action`` against the action schema ([] when valid)."""
    if not isinstance(action, dict):
        return [{"type": "model_type", "loc": ["action"], "msg": "Input should be an object"}]
    errors = [{"type": "extra_forbidden", "loc": ["action", k], "msg": "Extra inputs are not permitted"}
              for k in action if k not in ACTION_SCHEMA["properties"]]
    move = action.get("move")
    if not isinstance(move, str):
        errors.append({"type": "missing" if move is None else "string_type", "loc": ["action", "move"],
                       "msg": "Field required" if move is None else "Input should be a valid string"})
    elif not move:
        errors.append({"type": "string_too_short", "loc": ["action", "move"],
                       "msg": "String should have at least 1 character"})
    return errors


def make_app(max_sessions: int) -> Starlette:
    shared = Game()  # the HTTP endpoints' env
    sessions: set[int] = set()

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "healthy"})

    async def metadata(request: Request) -> JSONResponse:
        return JSONResponse({"name": "TestFrozenLake", "description": "Walk from P to G; avoid holes H.",
                             "version": "0.0.1"})

    async def schema(request: Request) -> JSONResponse:
        return JSONResponse({"action": ACTION_SCHEMA, "observation": OBSERVATION_SCHEMA,
                             "state": STATE_SCHEMA})

    async def state(request: Request) -> JSONResponse:
        return JSONResponse(shared.state())

    async def reset(request: Request) -> JSONResponse:
        body = await request.body()
        data = json.loads(body) if body else {}
        return JSONResponse(shared.reset(data.get("seed")))

    async def step(request: Request) -> JSONResponse:
        data = await request.json()
        action = data.get("action") if isinstance(data, dict) else None
        errors = validate(action)
        if errors:
            return JSONResponse({"detail": errors}, status_code=422)
        try:
            return JSONResponse(shared.step(action))
        except LookupError as e:
            return JSONResponse({"detail": str(e)}, status_code=409)

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        if len(sessions) >= max_sessions:
            await websocket.send_text(json.dumps({"type": "error", "data": {
                "message": f"Server at capacity ({len(sessions)}/{max_sessions} sessions)",
                "code": "CAPACITY_REACHED", "active_sessions": len(sessions),
                "max_sessions": max_sessions}}))
            await websocket.close()
            return
        key = id(websocket)
        sessions.add(key)
        game = Game()
        try:
            while True:
                raw = await websocket.receive_text()
                try:
                    msg = json.loads(raw)
                except ValueError as e:
                    await websocket.send_text(json.dumps({"type": "error", "data": {
                        "message": f"Invalid JSON: {e}", "code": "INVALID_JSON"}}))
                    continue
                kind, data = msg.get("type"), msg.get("data") or {}
                if kind == "close":
                    break
                if kind == "reset":
                    reply = {"type": "observation", "data": game.reset(data.get("seed"))}
                elif kind == "state":
                    reply = {"type": "state", "data": game.state()}
                elif kind == "step":
                    errors = validate(data)
                    if errors:
                        reply = {"type": "error", "data": {"message": "Invalid message",
                                                           "code": "VALIDATION_ERROR", "errors": errors}}
                    else:
                        try:
                            reply = {"type": "observation", "data": game.step(data)}
                        except LookupError as e:
                            reply = {"type": "error", "data": {"message": str(e), "code": "EXECUTION_ERROR"}}
                else:
                    reply = {"type": "error", "data": {"message": f"Unknown message type: {kind}",
                                                       "code": "UNKNOWN_TYPE"}}
                await websocket.send_text(json.dumps(reply))
            await websocket.close()  # the client said close
        except WebSocketDisconnect:
            pass
        finally:
            sessions.discard(key)

    return Starlette(routes=[
        Route("/health", health), Route("/metadata", metadata), Route("/schema", schema),
        Route("/state", state), Route("/reset", reset, methods=["POST"]),
        Route("/step", step, methods=["POST"]), WebSocketRoute("/ws", ws)])


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-sessions", type=int, default=8)
    args = p.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(make_app(args.max_sessions), log_level="warning",
                            ws="websockets-sansio", lifespan="off")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    sys.exit(main())
