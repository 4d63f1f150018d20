"""Generated terminal tasks for :mod:`rollart.code.terminal`: files set up in a sandbox's
workspace, a question about them or a fault to fix, and a checker that decides success.

Three kinds, each at levels 0-2 (more files, more rows, more candidates):

- ``find``: which file under ``notes/`` mentions a word (``grep -l``);
- ``count``: how many rows of ``data.csv`` have a colour (``grep -c``);
- ``fix``: ``python3 check.py`` fails until a typo in ``config.ini`` (levels 0-1) or a wrong
  operator in ``app.py`` (level 2) is fixed.

A task is a pure function of its seed and level (``random.Random`` seeded with a string is
stable across processes and Python versions). ``find`` and ``count`` are scored by comparing
the final answer with the truth the generator wrote into the files; ``fix`` by running the
task's own check source in the sandbox after the episode (``python3 -c``: the agent may
have edited ``check.py``, never the check that scores it).

Each task also lists a *menu*: candidate commands (helpful and not) and candidate final
answers. An agent in menu mode constrains the model's reply to one of them (vLLM's
``guided_choice``), which puts every task within a random-init model's luck (level 0 ``find``
by answering at once: 1 in 2), the way the quickstart's FrozenLake keeps moves legal.
"""

from __future__ import annotations

import posixpath
import random
import re
from dataclasses import dataclass

from rollart.sandbox import Sandbox

KINDS = ("find", "count", "fix")
LEVELS = (0, 1, 2)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

_WORDS = ("apple", "river", "stone", "cloud", "lemon", "tiger", "piano", "maple", "ocean",
          "candle", "rocket", "garden", "silver", "violet", "forest", "castle")
_FILLER = ("the", "meeting", "is", "on", "monday", "bring", "notes", "and", "a", "list",
           "of", "ideas", "for", "next", "week", "call", "me", "later", "about", "plan")
_NAMES = ("ann", "bob", "cid", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kim", "lee")
_COLOURS = ("red", "blue", "green")


@dataclass(frozen=True)
class TerminalTask:
    """One task: what to write into the workspace, what to ask, how to score."""

    kind: str
    level: int
    seed: int
    prompt: str
    files: dict[str, str]
    """Workspace-relative path -> content, written before the first turn."""
    answer: str | None
    """The right final answer (``find``, ``count``); None when ``check`` decides."""
    check: str | None
    """Python source run in the sandbox after the episode; exit 0 is success (``fix``)."""
    commands: tuple[str, ...]
    """Menu: candidate commands, the helpful ones among them."""
    answers: tuple[str, ...]
    """Menu: candidate final answers (bare, without ``<answer>`` tags)."""


def make_task(seed: int, *, kinds: tuple[str, ...] | list[str] = KINDS,
              levels: tuple[int, ...] | list[int] = (0,)) -> TerminalTask:
    """The task of ``seed``: its kind and level drawn from ``kinds`` and ``levels``."""
    kinds, levels = list(kinds), list(levels)
    bad = [k for k in kinds if k not in KINDS] + [str(v) for v in levels if v not in LEVELS]
    if not kinds or not levels or bad:
        raise ValueError(f"terminal task: kinds must be among {KINDS} and levels among "
                         f"{LEVELS}, got kinds={kinds} levels={levels}")
    rng = random.Random(f"rollart-terminal:{seed}")
    kind, level = rng.choice(kinds), rng.choice(levels)
    return {"find": _find, "count": _count, "fix": _fix}[kind](rng, seed, level)


def _lines(rng: random.Random, n: int, word: str | None) -> str:
    out = [" ".join(rng.choice(_FILLER) for _ in range(rng.randint(3, 6))) for _ in range(n)]
    if word is not None:
        i = rng.randrange(n)
        words = out[i].split()
        words.insert(rng.randrange(len(words) + 1), word)
        out[i] = " ".join(words)
    return "\n".join(out) + "\n"


def _find(rng: random.Random, seed: int, level: int) -> TerminalTask:
    n = (2, 4, 6)[level]
    names = [f"notes/{x}.txt" for x in rng.sample(_NAMES, n)]
    word = rng.choice(_WORDS)
    target = rng.choice(names)
    files = {p: _lines(rng, 2 + level, word if p == target else None) for p in names}
    return TerminalTask(
        kind="find", level=level, seed=seed,
        prompt=f"Which file under notes/ mentions the word {word}? Answer with its path.",
        files=files, answer=target, check=None,
        commands=(f"grep -l {word} notes/*", "ls notes", f"cat {rng.choice(names)}"),
        answers=tuple(sorted(names)))


def _count(rng: random.Random, seed: int, level: int) -> TerminalTask:
    rows = (4, 6, 9)[level]
    colour = rng.choice(_COLOURS)
    body = [f"{rng.choice(_NAMES)},{rng.choice(_COLOURS)},{rng.randint(1, 9)}" for _ in range(rows)]
    if not any(r.split(",")[1] == colour for r in body):
        i = rng.randrange(rows)
        name, _, qty = body[i].split(",")
        body[i] = f"{name},{colour},{qty}"
    truth = sum(r.split(",")[1] == colour for r in body)
    return TerminalTask(
        kind="count", level=level, seed=seed,
        prompt=f"How many rows of data.csv have the colour {colour}? Answer with a number.",
        files={"data.csv": "name,colour,qty\n" + "\n".join(body) + "\n"},
        answer=str(truth), check=None,
        commands=(f"grep -c ,{colour}, data.csv", "cat data.csv", "wc -l data.csv"),
        answers=tuple(str(k) for k in range(rows + 1)))


_CONFIG = {"port": "8080", "host": "localhost", "workers": "4"}
_CONFIG_CHECK = """\
import configparser, sys
c = configparser.ConfigParser()
c.read("config.ini")
s = c["server"] if c.has_section("server") else {}
want = {"port": "8080", "host": "localhost", "workers": "4"}
bad = [k for k in want if s.get(k) != want[k]]
if bad:
    sys.exit("config.ini: [server] needs " + ", ".join(k + " = " + want[k] for k in bad))
print("ok")
"""
_APP_CHECK = """\
import sys
sys.path.insert(0, ".")
import app
cases = [((2, 3), 5), ((10, 4), 14), ((0, 7), 7)]
bad = [(a, got) for a, want in cases if (got := app.total(*a)) != want]
if bad:
    sys.exit(f"app.total is wrong: {bad}")
print("ok")
"""


def _fix(rng: random.Random, seed: int, level: int) -> TerminalTask:
    if level < 2:  # a misspelt key of config.ini
        key = rng.choice(list(_CONFIG))
        typo = key[1] + key[0] + key[2:] if level == 0 else key[:-1]
        text = "[server]\n" + "".join(f"{typo if k == key else k} = {v}\n" for k, v in _CONFIG.items())
        others = [k for k in _CONFIG if k != key]
        fixes = [f"sed -i 's/^{typo} /{key} /' config.ini"] + \
                [f"sed -i 's/^{k} /{k}s /' config.ini" for k in others[:level + 1]]
        rng.shuffle(fixes)
        return TerminalTask(
            kind="fix", level=level, seed=seed,
            prompt="python3 check.py fails. Fix config.ini so that it passes, then answer done.",
            files={"config.ini": text, "check.py": _CONFIG_CHECK}, answer=None,
            check=_CONFIG_CHECK,
            commands=("python3 check.py", "cat config.ini", *fixes), answers=("done",))
    wrong = rng.choice(("-", "%"))  # not "*": a sed pattern would read it as a repeat
    text = f"def total(a, b):\n    return a {wrong} b\n"
    fixes = [f"sed -i 's/a {wrong} b/a + b/' app.py", f"sed -i 's/a {wrong} b/b - a/' app.py"]
    rng.shuffle(fixes)
    return TerminalTask(
        kind="fix", level=level, seed=seed,
        prompt="python3 check.py fails. Fix app.py so that it passes, then answer done.",
        files={"app.py": text, "check.py": _APP_CHECK}, answer=None, check=_APP_CHECK,
        commands=("python3 check.py", "cat app.py", *fixes), answers=("done",))


def final_answer(text: str) -> str:
    """The answer in a reply: the last ``<answer>...</answer>``, else the whole text."""
    found = _ANSWER.findall(text or "")
    return (found[-1] if found else text or "").strip()


def _same_path(got: str, want: str) -> bool:
    """``notes/a.txt``, ``./notes/a.txt``, ``/workspace/notes/a.txt`` and ``a.txt`` name it."""
    got = posixpath.normpath(got.strip().removeprefix("/workspace/"))
    return got in (want, posixpath.basename(want))


async def setup(task: TerminalTask, sb: Sandbox) -> None:
    """Write the task's files into ``sb``'s workspace."""
    for path, content in task.files.items():
        await sb.awrite(path, content)


async def score(task: TerminalTask, sb: Sandbox, reply: str) -> bool:
    """Whether the episode solved ``task``: its final ``reply`` against the truth, or the
    task's check run in ``sb`` (``SandboxError`` propagates: not the policy's failure)."""
    if task.check is not None:
        r = await sb.arun(["python3", "-c", task.check], timeout=10)
        return r.exit_code == 0 and not r.timed_out
    got = final_answer(reply)
    if task.kind == "find":
        return _same_path(got, task.answer or "")
    return got == task.answer
