"""Run one test program in a sandbox of this process's pool and say whether it passed.

Every code task here reduces to one Python program (the candidate and its tests) whose
clean end is a pass. A clean end is more than exit status 0: the harness reads a fresh
random token on stdin *before* the candidate's code runs, executes the program in a
namespace of its own and prints the token last, so a candidate that ends the process early
(``sys.exit(0)``, ``os._exit(0)``, a killed parent) fails like any other. What this does not
stop is a candidate that rewrites the program's own checks from inside (an object whose
``__eq__`` is always true, a frame walk to the token): the tests of HumanEval compare with
``==`` and the tiny model's tasks compare plain ints and strings (:mod:`rollart.code.pyexpr`
checks the type too).

Outcomes are cached by program text (a program with no timeout gives the same outcome every
time, and a policy that has learnt a task repeats its answer many times a step); a timeout is
not cached (it may be the host's load). A :class:`~rollart.sandbox.SandboxError` (the
sandbox could not start or died of the host) propagates: it is an infrastructure failure,
never the candidate's, and must never become a reward of 0.
"""

from __future__ import annotations

import collections
import hashlib
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable

from rollart import sandbox

PROGRAM = "main.py"
"""The file the program is written to in the sandbox's workspace."""
MAX_PROGRAM = 256 << 10
"""Characters of a program at most (a longer candidate is refused before it is run)."""
HARNESS = ("import os, sys\n"
           "t = sys.stdin.readline().strip()\n"
           "out, sys.stdout = sys.stdout, open(os.devnull, 'w')\n"
           "src = open('main.py', encoding='utf-8').read()\n"
           "exec(compile(src, 'main.py', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})\n"
           "out.write(t + '\\n')\n")
"""Run as ``python3 -I -c``: the token first, then the program (its prints go nowhere: a
chatty candidate cannot push the token past the output cap), then the token on stdout."""
CACHE_SIZE = 4096


@dataclass(frozen=True)
class Outcome:
    """What one program did: ``passed`` (it ran to its end, every test with it), and what
    ended it otherwise: ``limit`` (``timeout``, ``memory``, ... see
    :class:`~rollart.sandbox.Result`) and the tail of its stderr."""

    passed: bool
    exit_code: int
    limit: str | None = None
    stderr_tail: str = ""
    wall_s: float = 0.0


_cache: collections.OrderedDict[tuple[bytes, float], Outcome] = collections.OrderedDict()
"""(digest of the program, timeout) -> its outcome: the text itself is not kept."""
_cache_lock = threading.Lock()


def run_program(program: str, *, timeout: float = 5.0, cache: bool = True) -> Outcome:
    """Run ``program`` in a sandbox of :func:`rollart.sandbox.pool` under ``timeout``
    seconds (blocking; the sandbox is released after). ``ValueError`` for a program over
    :data:`MAX_PROGRAM` characters; ``SandboxError`` propagates (see the module docstring)."""
    if not isinstance(program, str):
        raise TypeError(f"run_program: the program must be a str, not {type(program).__name__}")
    if len(program) > MAX_PROGRAM:
        raise ValueError(f"run_program: the program is {len(program)} characters (max {MAX_PROGRAM})")
    if not timeout > 0:
        raise ValueError(f"run_program: timeout must be > 0, got {timeout!r}")
    data = program.encode("utf-8", "replace")  # a lone surrogate is the candidate's error, run as "?"
    key = (hashlib.blake2b(data, digest_size=16).digest(), float(timeout))
    if cache:
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
    token = secrets.token_hex(16)
    with sandbox.pool().session() as sb:
        sb.write(PROGRAM, data)
        r = sb.run(["python3", "-I", "-c", HARNESS], stdin=token + "\n", timeout=timeout)
    passed = r.exit_code == 0 and not r.timed_out and r.stdout.rstrip().endswith(token.encode())
    out = Outcome(passed=passed, exit_code=r.exit_code, limit=r.limit,
                  stderr_tail=r.stderr[-1000:].decode("utf-8", "replace"), wall_s=r.wall_s)
    if cache and not r.timed_out:
        with _cache_lock:
            _cache[key] = out
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
    return out


def tested_step(info: dict[str, Any], execute: bool, make_program: Callable[[], str],
                timeout: float) -> tuple[str, float, bool, bool, dict[str, Any]]:
    """The last ``step`` of a single-turn code env, once its action was found valid: the
    program run (``execute``) and scored 1.0 or 0.0, or reward 0 for the reward service's
    ``code_tests`` to score (``execute: false``). The episode ends either way."""
    info["valid_action"] = True
    if not execute:
        return "", 0.0, True, False, info
    out = run_program(make_program(), timeout=timeout)
    info.update(success=out.passed, limit=out.limit or "")
    return "", float(out.passed), True, False, info
