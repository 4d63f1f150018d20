"""The text environment protocol.

An environment has the gymnasium shape, for text::

    obs, info = env.reset(seed)
    obs, reward, terminated, truncated, info = env.step(action)

``reset`` and ``step`` may be plain methods or ``async def``; :class:`~rollart.envs.runner.EnvRunner`
runs plain ones off the event loop and awaits async ones directly.

Conventions every built-in env follows and the EnvManager relies on:

- ``instruction`` (optional) is the task description and answer format, placed in the system
  prompt; the env config's ``instruction:`` wins over it, and without either it is empty.
- ``info["success"]`` (bool) is present in the info of the final step (built-ins put it in
  every step's info, False until the episode is won).
- An action the env cannot interpret never raises: the env returns a no-op (or a small
  negative reward) with ``info["valid_action"] = False``. Every step's info carries
  ``valid_action``.
- ``legal_actions()`` (optional) returns the actions constrained decoding may choose from
  in the current state, or None for free text. ``close()`` (optional) releases resources.
- Calling ``step`` before ``reset`` or after the episode ended raises ``RuntimeError``.

What a failure costs a trajectory (see :mod:`rollart.envs.runner`):

- the env cannot be built (the type does not import, bad args, the constructor raises
  anything but ``ConnectionError``/``TimeoutError``): *permanent*, ``env_setup`` — the
  trajectory is dead-lettered at once, never retried;
- ``reset``/``step`` return the wrong shape or types (not ``(str, dict)`` /
  ``(str, number, bool, bool, dict)``): *permanent*, ``env_contract``;
- ``reset`` raises or times out: *transient*, a fresh env is tried ``reset_retries``
  times; ``step`` times out: the trajectory ends with ``stop_reason="env_timeout"``.
"""

from __future__ import annotations

from typing import Any, Awaitable, Protocol, runtime_checkable

ResetResult = tuple[str, dict[str, Any]]
"""``(observation, info)``"""

StepResult = tuple[str, float, bool, bool, dict[str, Any]]
"""``(observation, reward, terminated, truncated, info)``"""


@runtime_checkable
class Env(Protocol):
    """A text environment. ``instruction`` (a str attribute: what the task is and how to format
    the answer), ``legal_actions`` and ``close`` are optional extras."""

    def reset(self, seed: int) -> ResetResult | Awaitable[ResetResult]:
        """Start a new episode, deterministically from ``seed``."""
        ...

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Apply one action (already parsed out of the model's text)."""
        ...


def legal_actions_of(env: Any) -> list[str] | None:
    """``env.legal_actions()`` if the env defines it, else None (free text)."""
    fn = getattr(env, "legal_actions", None)
    if fn is None:
        return None
    acts = fn()
    return None if acts is None else [str(a) for a in acts]


# Grid worlds (FrozenLake, Sokoban) share the action vocabulary.
HELDOUT_SEED_OFFSET = 1_000_000
"""Task seeds of held-out evaluations start here (the evaluation scheduler's offset; training
seeds start at ``rollout.seed``, far below): an env with a finite item set keeps the items of
these seeds out of training (``reasoning_gym``'s ``heldout``). The held-out window is
``[HELDOUT_SEED_OFFSET, 2 * HELDOUT_SEED_OFFSET)`` (:func:`is_heldout_seed`); every other seed
is a training task (demonstrations played from seed 5,000,000 are)."""


def is_heldout_seed(seed: int) -> bool:
    """Whether task ``seed`` is a held-out evaluation's (see :data:`HELDOUT_SEED_OFFSET`)."""
    return HELDOUT_SEED_OFFSET <= seed < 2 * HELDOUT_SEED_OFFSET


MOVES: dict[str, tuple[int, int]] = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
"""Letter -> (d_row, d_col). The order L, D, R, U matches gymnasium's FrozenLake."""

_WORDS = {"left": "L", "down": "D", "right": "R", "up": "U"}


def normalize_move(action: str) -> str | None:
    """Map ``"L"``/``"left"``/``" Up "`` (case-insensitive) to a letter of :data:`MOVES`;
    anything else to None."""
    a = action.strip().lower()
    if a in _WORDS:
        return _WORDS[a]
    a = a.upper()
    return a if a in MOVES else None
