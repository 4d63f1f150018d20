"""What a trajectory may ask of the EnvManager that runs it: :class:`TrajectoryHost`.

The agent loop (:mod:`.agent_loop`) drives a trajectory from outside the EnvManager's own
turn loop; it generates a turn, scores the last reply and counts an outcome through this
declared interface, never through the actor's private state, so that the actor can change
how it does each of them without breaking the loop (and a test can stand in for it).
:class:`~rollart.actors.env.manager.EnvManager` implements it.
"""

from __future__ import annotations

from typing import Any, Protocol

from rollart import messages as m
from rollart.actors.env.chat import ChatFormat
from rollart.actors.env.trajectory import Trace
from rollart.agents.threads import AgentThreads
from rollart.config import RolloutConfig


class TrajectoryHost(Protocol):
    """The EnvManager as one of its trajectories sees it."""

    name: str
    """The EnvManager's name (for log lines)."""
    version: int
    """The newest policy version it believes (a completion records it)."""
    rollout: RolloutConfig
    """The run's rollout settings (``max_trajectory_s``...)."""
    chat: ChatFormat
    """The model's chat template and tokenizer."""
    agent_threads: AgentThreads
    """The threads a plain ``def`` agent runs on."""
    prompt_threads: AgentThreads
    """One thread that tokenises a long request off the event loop."""

    async def agent_endpoint(self) -> Any:
        """The agents' OpenAI-compatible endpoint, started on first use."""

    async def generate(self, req: m.RolloutRequested, cfg: Any, tr: Trace,
                       legal: list[str] | None, turn: int = 1, *,
                       max_new_tokens: int | None = None,
                       ) -> tuple[m.GenerateResult, list[list[int]], str, int]:
        """One turn's generation: ``(result, choices, pool, route index)``."""

    async def score(self, req: m.RolloutRequested, cfg: Any, tr: Trace, info: dict,
                    text: str) -> tuple[float, bool]:
        """The env's scorer on the last reply ``text``: ``(reward, success)``."""

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to one of the EnvManager's counters (``stats``)."""
