"""Child Python processes whose combined output a thread reads, so their pipe never fills
(for tests that start ``rollart run`` or ``python -m rollart.node`` as a user would).

:class:`ReadProcess` is any ``python ARGV...`` child; :class:`NodeProcess` is a
``python -m rollart.node --config CFG --roles ROLES ...``. Both wait for a line of output
with :meth:`ReadProcess.line_with` (failing at once, with the output, if the process exits
first) and are stopped with :meth:`ReadProcess.stop` or :meth:`ReadProcess.kill`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.waiting import until, until_sync

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH``."""
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                **extra)


class ReadProcess:
    """``python ARGV...`` with this checkout on ``PYTHONPATH``; ``lines`` fills as it prints."""

    def __init__(self, argv: list[str], *, cwd: Path, name: str = "", env: dict | None = None,
                 **popen) -> None:
        self.name = name or " ".join(argv[:2])
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=cwd,
                                     env=env if env is not None else child_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     **popen)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self, last: int | None = None) -> str:
        """What it printed so far (the ``last`` lines only, when given)."""
        lines = list(self.lines)
        return "".join(lines[-last:] if last else lines)

    def saw(self, needle: str) -> bool:
        return any(needle in line for line in list(self.lines))

    def exited(self) -> str:
        """Empty while it runs, else why waiting for it is pointless (its exit status);
        an ``abort`` for :func:`tests.waiting.until`."""
        rc = self.proc.poll()
        if rc is None:
            return ""
        self.reader.join(5)  # the last lines it printed
        return f"{self.name} exited with status {rc} while"

    def _line(self, needle: str) -> str | None:
        return next((ln for ln in list(self.lines) if needle in ln), None)

    async def line_with(self, needle: str, deadline: float = 60.0) -> str:
        """The first line that contains ``needle``, once printed."""
        return await until(lambda: self._line(needle), deadline=deadline,
                           what=f"{self.name} to print {needle!r}", step=0.05,
                           abort=self.exited, state=lambda: self.output(last=80))

    def line_with_sync(self, needle: str, deadline: float = 60.0) -> str:
        """:meth:`line_with` for tests that are not coroutines."""
        return until_sync(lambda: self._line(needle), deadline=deadline,
                          what=f"{self.name} to print {needle!r}", abort=self.exited,
                          state=lambda: self.output(last=80))

    async def exit_code(self, deadline: float) -> int:
        """Its exit status, once it exits by itself (fails after ``deadline`` seconds)."""
        try:
            rc = await asyncio.to_thread(self.proc.wait, deadline)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs after {deadline:g}s:\n"
                                 f"{self.output(last=80)}") from None
        await asyncio.to_thread(self.reader.join, 10)
        return rc

    def stop(self, sig: int = signal.SIGTERM, wait: float = 15.0) -> None:
        """Send ``sig``; kill it if it still runs after ``wait`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class NodeProcess(ReadProcess):
    """``python -m rollart.node --config CFG --roles ROLES EXTRA...``, run in ``CFG``'s folder."""

    def __init__(self, cfg: Path, roles: str, *extra: str, name: str = "", **popen) -> None:
        self.roles = roles
        super().__init__(["-m", "rollart.node", "--config", str(cfg), "--roles", roles, *extra],
                         cwd=cfg.parent, name=name or f"{roles} node", **popen)


def all_exited(procs: list[ReadProcess]) -> bool:
    return all(p.proc.poll() is not None for p in procs)


def outputs_of(procs: list[ReadProcess], last: int = 40) -> str:
    """The last lines of each process, for a failure message."""
    return "\n".join(f"--- {p.name} (rc {p.proc.poll()}):\n{p.output(last=last)}" for p in procs)
