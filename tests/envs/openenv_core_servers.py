"""Real OpenEnv servers for tests: text FrozenLake as an ``openenv-core`` ``Environment``,
served by openenv-core's own ``create_app`` (its HTTP and WebSocket routes, its sessions,
its validation), not a stand-in written from the protocol.

``python -m tests.envs.openenv_core_servers [--max-sessions N] [--actions free|enum]
[--shared]`` listens on a free loopback port and prints ``PORT <n>`` once bound, then serves
with uvicorn as an OpenEnv env's ``server/app.py`` does. It needs ``openenv-core`` (``make
test-openenv`` sets up a venv with it; the default install does without).

- The action is ``MoveAction(move: str)`` (``--actions free``: at least one character; a move
  the game does not know wastes a step) or ``EnumMoveAction(move: Literal["L", "D", "R",
  "U"])`` (``--actions enum``: the schema lists the moves); no other field (openenv-core's
  ``Action`` forbids extra ones). The observation is ``BoardObservation(board, steps)``;
  reward 1.0 on the goal; ``done`` on the goal, a hole or after 100 steps.
- Each WebSocket session gets an env of its own (``SUPPORTS_CONCURRENT_SESSIONS``), at most
  ``--max-sessions`` at once. openenv-core's ``POST /reset`` and ``/step`` call the env
  factory for every request; with ``--shared`` the factory returns one env, so the HTTP
  endpoints keep one episode for every client (what servers before openenv-core 0.2 did).
- A step outside an episode raises ``LookupError`` in the env: openenv-core answers it with
  an ``EXECUTION_ERROR`` over ``/ws`` and HTTP 500 over ``POST /step``.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any, Literal, Optional

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from openenv.core.env_server.types import EnvironmentMetadata
from pydantic import Field

from rollart.envs.frozenlake import FrozenLakeEnv

NAME = "CoreFrozenLake"
DESCRIPTION = "Walk from P to G; avoid holes H."


class MoveAction(Action):
    """One move as free text (the game decides what it means)."""

    move: str = Field(min_length=1, description="L, D, R or U")


class EnumMoveAction(Action):
    """One of the four moves, as the schema's enum."""

    move: Literal["L", "D", "R", "U"]


class BoardObservation(Observation):
    """The board as text (``P`` marks the player) and the steps taken in the episode."""

    board: str = ""
    steps: int = 0


class LakeEnvironment(Environment[Action, BoardObservation, State]):
    """Text FrozenLake 4x4 (the classic map) in openenv-core's terms."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.lake = FrozenLakeEnv(size=4)
        self._state = State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> BoardObservation:
        board, _ = self.lake.reset(seed or 0)
        self._state = State(episode_id=episode_id or f"ep-{seed}", step_count=0)
        return BoardObservation(board=board, steps=0, done=False, reward=None)

    def step(self, action: Action, timeout_s: Optional[float] = None,
             **kwargs: Any) -> BoardObservation:
        if self.lake.done:
            raise LookupError("step() outside an episode: reset first")
        board, reward, term, trunc, _ = self.lake.step(action.move)  # type: ignore[attr-defined]
        self._state.step_count = self.lake.steps
        return BoardObservation(board=board, steps=self.lake.steps, done=bool(term or trunc),
                                reward=reward)

    @property
    def state(self) -> State:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name=NAME, description=DESCRIPTION, version="0.0.1")


def make_app(max_sessions: int, actions: str, shared: bool) -> Any:
    """openenv-core's FastAPI app for :class:`LakeEnvironment`."""
    action_cls = EnumMoveAction if actions == "enum" else MoveAction
    if shared:
        one = LakeEnvironment()
        factory: Any = lambda: one  # noqa: E731  # every request and session: the same env
    else:
        factory = LakeEnvironment
    return create_app(factory, action_cls, BoardObservation, env_name=NAME,
                      max_concurrent_envs=max_sessions)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-sessions", type=int, default=8)
    p.add_argument("--actions", choices=["free", "enum"], default="free")
    p.add_argument("--shared", action="store_true", help="one env for every request")
    args = p.parse_args(argv)
    app = make_app(args.max_sessions, args.actions, args.shared)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # bound before the port is printed: no race for it
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
