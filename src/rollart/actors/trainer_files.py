"""The trainer's files under ``<run_dir>/<run>``: the checkpoint (durable state, step journal,
full checkpoint), the metrics record and the weight versions (:class:`RunFiles`). Blocking:
the trainer calls them off the event loop."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_FORMAT = 1


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a crash of the host must not undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never a torn mix: a temp file,
    fsynced, renamed over it, the folder fsynced."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


EVAL_FILE = "eval.jsonl"
"""The held-out evaluations of ``trainer.eval_every`` (:mod:`rollart.app.periodic_eval`)."""


def read_evals(run_path: str | Path) -> list[dict[str, Any]]:
    """The rows of ``<run>/eval.jsonl`` by version (a half-written last line is skipped; a
    version evaluated twice keeps its latest row); [] when there is none."""
    p = Path(run_path) / EVAL_FILE
    if not p.exists():
        return []
    last: dict[int, dict] = {}
    for line in p.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("version"), int):
            last[row["version"]] = row
    return [last[k] for k in sorted(last)]


class RunFiles:
    """``<run_dir>/<run>``: ``weights/v<version>*.safetensors``, ``metrics.jsonl`` (one row
    per step; a resume keeps exactly the rows of the steps its checkpoint holds) and the
    checkpoint in ``checkpoints/``:

    - ``state.json``, the durable state, rewritten at every checkpoint (``trainer.checkpoint_every``):
      the ledger, counters, the version and the step sequence number it reached;
    - ``journal/<seq>.msgpack``, one per step since the last full checkpoint: the
      trajectories the step trained on, in order, and the RNG state it started from
      (:class:`rollart.actors.trainer_checkpoint.StepRecord`), written before the state
      that counts it;
    - ``latest.pt``, the full checkpoint (model, optimizer, scheduler, RNG, and
      ``journal_seq``: the last step it holds), every ``trainer.full_checkpoint_every`` steps.

    A resume loads ``latest.pt`` and trains the journal's steps after its ``journal_seq``
    again (:mod:`rollart.actors.trainer_checkpoint`).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.weights = self.path / "weights"
        self.checkpoint = self.path / "checkpoints" / "latest.pt"
        self.state = self.path / "checkpoints" / "state.json"
        self.journal = self.path / "checkpoints" / "journal"
        self.metrics = self.path / "metrics.jsonl"
        self.evals = self.path / EVAL_FILE

    def make(self) -> None:
        """Create the weights, checkpoints and journal folders."""
        self.weights.mkdir(parents=True, exist_ok=True)
        self.journal.mkdir(parents=True, exist_ok=True)

    def weight_versions(self) -> list[int]:
        """The versions of the weight files in the weights folder."""
        return [int(p.name[1:7]) for p in self.weights.glob("v*.safetensors")
                if p.name[1:7].isdigit()]

    def has_checkpoint(self) -> bool:
        """Whether the folder holds anything a resume continues from."""
        return self.state.exists() or self.checkpoint.exists()

    # -- the full checkpoint ---------------------------------------------------------
    def load_checkpoint(self) -> dict[str, Any] | None:
        """The saved full checkpoint, None when there is none."""
        if not self.checkpoint.exists():
            return None
        import torch  # optional dependency: only a training process reads checkpoints

        return torch.load(self.checkpoint, weights_only=False)

    def save_checkpoint(self, state: dict[str, Any]) -> int:
        """Write ``state`` as the full checkpoint (a temp file, fsynced, renamed over the old
        one); returns its bytes."""
        import torch  # optional dependency: only a training process writes checkpoints

        tmp = self.checkpoint.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, self.checkpoint)
        _fsync_dir(self.checkpoint.parent)
        return size

    # -- the durable state and the journal ---------------------------------------------
    def load_state(self) -> dict[str, Any] | None:
        """The durable state (``state.json``), None when there is none."""
        if not self.state.exists():
            return None
        state = json.loads(self.state.read_text())
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{self.state}: format {state.get('format')!r}, this trainer reads "
                             f"format {STATE_FORMAT}")
        return state

    def save_state(self, state: dict[str, Any]) -> int:
        """Write the durable state atomically; returns its bytes."""
        data = json.dumps({"format": STATE_FORMAT, **state}).encode()
        write_atomic(self.state, data)
        return len(data)

    def journal_path(self, seq: int) -> Path:
        return self.journal / f"{seq:08d}.msgpack"

    def write_journal(self, seq: int, data: bytes) -> None:
        """Write step ``seq``'s record (durable before the state that counts it is written)."""
        write_atomic(self.journal_path(seq), data)

    def read_journal(self, seq: int) -> bytes:
        """Step ``seq``'s record; ``FileNotFoundError`` when it is missing."""
        return self.journal_path(seq).read_bytes()

    def journal_seqs(self) -> list[int]:
        """The steps whose records are in the folder, in order."""
        if not self.journal.exists():
            return []
        return sorted(int(p.stem) for p in self.journal.glob("*.msgpack") if p.stem.isdigit())

    def prune_journal(self, upto: int) -> list[int]:
        """Delete the records of steps ``<= upto`` (a full checkpoint holds them); returns
        their sequence numbers."""
        gone = [s for s in self.journal_seqs() if s <= upto]
        for s in gone:
            self.journal_path(s).unlink(missing_ok=True)
        return gone

    def durable_version(self) -> int | None:
        """The policy version a resume continues from (the durable state's, or an older run
        folder's full checkpoint's); None: nothing to continue from."""
        if self.state.exists():
            return int(self.load_state()["version"])
        if not self.checkpoint.exists():
            return None
        import torch  # optional dependency: the train extra (a trainer's host has it)

        state = torch.load(self.checkpoint, map_location="cpu", weights_only=False, mmap=True)
        return int(state["backend"]["version"])

    # -- the metrics record ----------------------------------------------------------
    def rewrite_metrics(self, version: int) -> None:
        """After a resume: the record is the steps up to ``version`` (what the checkpoint
        holds), nothing after; so is ``eval.jsonl`` (``trainer.eval_every``)."""
        evals = [json.dumps(r) + "\n" for r in read_evals(self.path) if r["version"] <= version]
        if self.evals.exists():
            tmp = self.evals.with_suffix(".tmp")
            tmp.write_text("".join(evals))
            tmp.replace(self.evals)
        p = self.metrics
        if not p.exists():
            return
        keep = []
        for line in p.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by the kill
                continue
            if row.get("step", 0) <= version:
                keep.append(line + "\n")
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(p)

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        """Append one step's row to the record."""
        with self.metrics.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
