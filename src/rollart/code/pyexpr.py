"""Generated code tasks within a tiny model's reach: a Python expression from examples.

Each episode shows three input/output pairs of a hidden one-line function of ``x`` and asks
for an expression that computes it::

    f(3) = 6
    f(-2) = 1
    f(10) = 13          -> x + 3

The functions are a small family (:data:`TASKS`, 61 of them): ``x + k``, ``x - k``,
``x * k``, ``x % k``, ``x // k``, ``x * x``, ``-x``, ``abs(x)`` on ints, and ``x[::-1]``,
``x.upper()``, ``len(x)``, ``x[:k]``, ``x[-k:]``, ``x[k:]``, ``x * k`` on short words. The
examples shown are drawn until no other task of the family fits them all, so the answer is
always determined by what the policy sees. The answer is checked by hidden tests (fixed
inputs per type, :data:`HIDDEN`) run in a sandbox: any expression that computes the same
values of the same type passes (``x+x`` for ``x * 2``).

Held out: a prompt (the shown examples) whose text hashes below ``heldout_share`` is never
shown in training; evaluation seeds draw only those. The functions are shared: what is held
out is new examples of them, so evaluation measures reading examples, not recalling prompts.
"""

from __future__ import annotations

import ast
import hashlib
import random
import warnings
from typing import Any, Callable

from rollart.code.execute import run_program, tested_step
from rollart.envs.base import HELDOUT_SEED_OFFSET, is_heldout_seed
from rollart.envs.demonstrators import register

MAX_EXPRESSION = 200
"""Characters of an answer at most."""
INSTRUCTION = "Write a Python expression in x that computes f(x). Reply with the expression only."
EXAMPLES = 3
DRAWS = 200
"""Example sets drawn at most for one task seed before giving up (none has needed 20)."""

_WORDS = ("cat", "dog", "sun", "tree", "book", "lamp", "river", "stone", "apple", "house",
          "green", "planet", "window", "garden", "rocket", "yellow", "mirror", "bridge")


def _tasks() -> dict[str, tuple[str, str, Callable[[Any], Any]]]:
    """Task id -> (input type, canonical expression, the function)."""
    t: dict[str, tuple[str, str, Callable[[Any], Any]]] = {}
    for k in range(1, 10):
        t[f"add:{k}"] = ("int", f"x + {k}", lambda x, k=k: x + k)
        t[f"sub:{k}"] = ("int", f"x - {k}", lambda x, k=k: x - k)
    for k in range(2, 10):
        t[f"mul:{k}"] = ("int", f"x * {k}", lambda x, k=k: x * k)
        t[f"mod:{k}"] = ("int", f"x % {k}", lambda x, k=k: x % k)
        t[f"div:{k}"] = ("int", f"x // {k}", lambda x, k=k: x // k)
    t["square"] = ("int", "x * x", lambda x: x * x)
    t["neg"] = ("int", "-x", lambda x: -x)
    t["abs"] = ("int", "abs(x)", abs)
    t["rev"] = ("str", "x[::-1]", lambda x: x[::-1])
    t["upper"] = ("str", "x.upper()", lambda x: x.upper())
    t["len"] = ("str", "len(x)", len)
    for k in range(1, 5):
        t[f"first:{k}"] = ("str", f"x[:{k}]", lambda x, k=k: x[:k])
        t[f"last:{k}"] = ("str", f"x[-{k}:]", lambda x, k=k: x[-k:])
    for k in range(1, 4):
        t[f"drop:{k}"] = ("str", f"x[{k}:]", lambda x, k=k: x[k:])
    for k in range(2, 4):
        t[f"repeat:{k}"] = ("str", f"x * {k}", lambda x, k=k: x * k)
    return t


TASKS = _tasks()
"""Task id (``"add:3"``) -> (input type, canonical expression, the function)."""
WORD_TASKS = [t for t, (kind, _, _) in TASKS.items() if kind == "str"]
"""The 16 tasks on words (``x[::-1]``, ``x[:k]``, ``len(x)``...): the part of the family the
tiny model reads best from examples (after SFT, 0.65 greedy on held-out prompts of the
slices against 0.06-0.24 for ``x % k``, ``x - k``, ``x + k``)."""
HIDDEN: dict[str, list[Any]] = {
    "int": [-11, -7, -3, -1, 0, 1, 2, 4, 5, 8, 13, 21, 34, 100],
    "str": ["a", "ab", "xyz", "hello", "python", "racecar", "Zebra7", "a b c", "mississippi"],
}
"""The hidden tests' inputs, per input type (the policy never sees them)."""


def _draw(rng: random.Random, kind: str) -> Any:
    return rng.randint(-9, 20) if kind == "int" else rng.choice(_WORDS)


def examples(task: str, rng: random.Random) -> list[tuple[Any, Any]]:
    """``EXAMPLES`` input/output pairs of ``task`` that no other task fits: each set is drawn
    from ``rng`` until one determines the task (``ValueError`` after :data:`DRAWS`)."""
    kind, _, fn = TASKS[task]
    rivals = [(n, f) for n, (k, _, f) in TASKS.items() if k == kind and n != task]
    for _ in range(DRAWS):
        xs: list[Any] = []
        while len(xs) < EXAMPLES:
            x = _draw(rng, kind)
            if x not in xs:
                xs.append(x)
        pairs = [(x, fn(x)) for x in xs]
        if not any(all(f(x) == y and type(f(x)) is type(y) for x, y in pairs)
                   and any(f(h) != fn(h) for h in HIDDEN[kind]) for _, f in rivals):
            return pairs
    raise ValueError(f"pyexpr: no example set of {EXAMPLES} determines task {task!r}")


def prompt(pairs: list[tuple[Any, Any]]) -> str:
    """The observation: one ``f(input) = output`` line per example."""
    return "\n".join(f"f({x!r}) = {y!r}" for x, y in pairs)


def heldout_bucket(text: str) -> float:
    """Where a prompt falls in [0, 1) (a hash of its text, the same in every process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2.0**64


def check_expression(expr: str) -> str | None:
    """Why ``expr`` is not an answer (not one Python expression, too long), or None."""
    if not isinstance(expr, str) or not expr.strip():
        return "empty"
    if len(expr) > MAX_EXPRESSION:
        return f"{len(expr)} characters (max {MAX_EXPRESSION})"
    try:
        with warnings.catch_warnings():  # "1x" warns (invalid decimal literal): it is just wrong
            warnings.simplefilter("ignore", SyntaxWarning)
            ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        return f"not a Python expression ({e.__class__.__name__})"
    return None


def program(task: str, expr: str) -> str:
    """The hidden tests of ``task`` (``KeyError`` for an unknown id) as a program around
    ``expr``: each hidden input's value must equal the task's, with the same type."""
    kind, _, fn = TASKS[task]
    cases = [(x, fn(x)) for x in HIDDEN[kind]]
    return ("def f(x):\n    return (\n" + expr.strip() + "\n    )\n\n\n"
            f"for x, want in {cases!r}:\n"
            "    got = f(x)\n"
            "    assert type(got) is type(want) and got == want, (x, got, want)\n")


def passes(task: str, expr: str, *, timeout: float = 5.0) -> bool:
    """Whether ``expr`` passes the hidden tests of ``task`` (False for a non-expression)."""
    if check_expression(expr) is not None:
        return False
    return run_program(program(task, expr), timeout=timeout).passed


class PyExprEnv:
    """One generated expression task per episode (see the module docstring).

    Args:
        tasks: task ids to draw from (default all of :data:`TASKS`), e.g. ``["add:1",
            "add:2", "rev"]``; a seed picks one uniformly, then its examples.
        heldout_share: the share of prompts held out of training (default 0.1, by a hash of
            the prompt text). A held-out task seed (:func:`~rollart.envs.base.is_heldout_seed`)
            draws until its prompt is held out, any other seed until it is not.
        timeout_s: seconds the hidden tests of one answer may run (default 5).
        execute: run the tests in ``step`` (default). False: ``step`` only ends the episode
            with reward 0, for a run whose ``scorer: code_tests`` runs them on a reward host.
        instruction: override the instruction text.

    ``reset`` returns the examples; ``info`` has ``suite`` and ``task`` (what the
    ``code_tests`` scorer needs) and ``heldout``. ``step(expression)``: reward 1.0 when the
    hidden tests pass, always terminated; ``valid_action`` is false for text that is not one
    Python expression of at most 200 characters (not run, reward 0). A
    :class:`~rollart.sandbox.SandboxError` propagates (the host's failure, not the answer's).
    """

    uses_sandbox = True
    """Its tests run in the env host's sandboxes (:mod:`rollart.actors.kernel.sandboxes`: the
    host keeps ``sandbox.warm`` of them started)."""

    suite = "pyexpr"

    def __init__(self, *, tasks: list[str] | None = None, heldout_share: float = 0.1,
                 timeout_s: float = 5.0, execute: bool = True, instruction: str | None = None) -> None:
        if tasks is not None:
            if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
                raise ValueError("pyexpr arg 'tasks' must be a non-empty list of task ids")
            unknown = [t for t in tasks if t not in TASKS]
            if unknown:
                raise ValueError(f"pyexpr arg 'tasks': unknown task ids {unknown}; known: {', '.join(TASKS)}")
        if isinstance(heldout_share, bool) or not isinstance(heldout_share, (int, float)) \
                or not 0.0 < heldout_share < 1.0:
            raise ValueError(f"pyexpr arg 'heldout_share' must be a number in (0, 1), got {heldout_share!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            raise ValueError(f"pyexpr arg 'timeout_s' must be a number in (0, 600], got {timeout_s!r}")
        if not isinstance(execute, bool):
            raise ValueError(f"pyexpr arg 'execute' must be true or false, got {execute!r}")
        self.tasks = list(tasks or TASKS)
        self.heldout_share, self.timeout_s, self.execute = float(heldout_share), float(timeout_s), execute
        self.instruction = instruction or INSTRUCTION
        self.task: str | None = None

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        """A task and its examples, deterministically from ``seed``."""
        held = is_heldout_seed(seed)
        rng = random.Random(f"pyexpr:{seed}")
        for _ in range(DRAWS):
            task = rng.choice(self.tasks)
            text = prompt(examples(task, rng))
            if (heldout_bucket(text) < self.heldout_share) == held:
                break
        else:
            raise ValueError(f"pyexpr: {DRAWS} prompts drawn for seed {seed}, none "
                             f"{'held out' if held else 'a training one'}: change 'heldout_share'")
        self.task = task
        info = {"valid_action": True, "success": False, "suite": self.suite, "task": task,
                "heldout": held}
        return text, info

    def solution(self) -> str:
        """The canonical expression of the current task (for the demonstrator; never shown)."""
        if self.task is None:
            raise RuntimeError("pyexpr: no current task (reset first)")
        return TASKS[self.task][1]

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run the hidden tests on the expression; the episode always ends."""
        if self.task is None:
            raise RuntimeError("pyexpr: step() before reset() or after the episode ended")
        task, self.task = self.task, None
        info: dict[str, Any] = {"suite": self.suite, "task": task, "success": False}
        why = check_expression(action)
        if why is not None:
            return "", 0.0, True, False, {**info, "valid_action": False, "error": why}
        return tested_step(info, self.execute, lambda: program(task, action), self.timeout_s)

    def legal_actions(self) -> None:
        """Free text."""
        return None


class Solution:
    """``pyexpr`` / ``solution``: the canonical expression of the task the env serves (read
    from the env: the policy sees only the examples)."""

    def __init__(self, env: Any = None, rng: random.Random | None = None) -> None:
        if not isinstance(env, PyExprEnv):
            raise ValueError("the pyexpr 'solution' demonstrator reads the env's current task: "
                             "it needs a pyexpr env")
        self.env = env

    def reset(self, observation: str, info: dict[str, Any]) -> None:
        pass

    def act(self, observation: str, legal: list[str] | None) -> str:
        return self.env.solution()


register("pyexpr", "solution")(Solution)
