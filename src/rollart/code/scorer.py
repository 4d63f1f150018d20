"""``code_tests``: execution-based scoring for the RewardService (stateless, any CPU host).

The request names a suite and a task (the code envs put both in their reset's info, which
the EnvManager sends as metadata); the tests are looked up here, never taken from the
request, and the response runs against them in this host's sandbox pool. Score 1.0 when
every test passes, else 0.0. Everything in the request comes from another process: the
suite is one of :data:`SUITES`, the task an id of that suite of bounded length, the response
bounded too; anything else is a ``ValueError`` that names it.
"""

from __future__ import annotations

from typing import Annotated, Callable, Literal

import msgspec

from rollart.code import humaneval, pyexpr
from rollart.code.execute import run_program

TIMEOUT_S = 5.0
"""Seconds one response's tests may run."""


def _humaneval_program(task: str, response: str) -> str | None:
    if not response.strip() or len(response) > humaneval.MAX_COMPLETION:
        return None
    if task not in humaneval.problems():
        raise ValueError(f"code_tests scorer: unknown humaneval task {task!r}")
    return humaneval.program(task, response)


def _pyexpr_program(task: str, response: str) -> str | None:
    if task not in pyexpr.TASKS:
        raise ValueError(f"code_tests scorer: unknown pyexpr task {task!r}")
    if pyexpr.check_expression(response) is not None:
        return None
    return pyexpr.program(task, response)


SUITES: dict[str, Callable[[str, str], str | None]] = {
    "humaneval": _humaneval_program,
    "pyexpr": _pyexpr_program,
}
"""Suite -> ``(task, response) -> test program`` (None: the response is not an answer, 0)."""


class CodeTask(msgspec.Struct, forbid_unknown_fields=True):
    """What a ``code_tests`` request names (from its metadata)."""

    suite: Literal["humaneval", "pyexpr"]
    task: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_/:.-]+$")]


def code_tests(response: str, answer: str, metadata: dict[str, str]) -> float:
    """1.0 when ``response`` passes the tests of ``metadata``'s ``suite`` and ``task``, else
    0.0 (a :class:`~rollart.sandbox.SandboxError` propagates: the host failed, not the
    response)."""
    try:
        req = msgspec.convert({"suite": metadata.get("suite"), "task": metadata.get("task")}, CodeTask)
    except msgspec.ValidationError as e:
        raise ValueError(f"code_tests scorer: bad metadata: {e} (it needs 'suite': one of "
                         f"{sorted(SUITES)}, and 'task': a task id of that suite)") from None
    if not isinstance(response, str):
        raise ValueError("code_tests scorer: the response is not text")
    prog = SUITES[req.suite](req.task, response)
    if prog is None:
        return 0.0
    return float(run_program(prog, timeout=TIMEOUT_S).passed)


code_tests.uses_sandbox = True  # type: ignore[attr-defined]  # the reward host keeps sandboxes warm
