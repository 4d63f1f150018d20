"""A child Python process whose combined output a thread reads, so its pipe never fills
(for tests that start ``rollart run`` or ``python -m rollart.node`` as a user would)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ReadProcess:
    """``python ARGV...`` with this checkout on ``PYTHONPATH``; ``lines`` fills as it prints."""

    def __init__(self, argv: list[str], *, cwd: Path, **popen) -> None:
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     **popen)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)
