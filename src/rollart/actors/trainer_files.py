"""The trainer's files under ``<run_dir>/<run>``: the checkpoint, the metrics record and the
weight versions (:class:`RunFiles`). Blocking: the trainer calls them off the event loop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RunFiles:
    """``<run_dir>/<run>``: ``weights/v<version>*.safetensors``, ``checkpoints/latest.pt``
    and ``metrics.jsonl`` (one row per step; a resume keeps exactly the rows of the steps
    its checkpoint holds)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.weights = self.path / "weights"
        self.checkpoint = self.path / "checkpoints" / "latest.pt"
        self.metrics = self.path / "metrics.jsonl"

    def make(self) -> None:
        """Create the weights and checkpoints folders."""
        self.weights.mkdir(parents=True, exist_ok=True)
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)

    def weight_versions(self) -> list[int]:
        """The versions of the weight files in the weights folder."""
        return [int(p.name[1:7]) for p in self.weights.glob("v*.safetensors")
                if p.name[1:7].isdigit()]

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The saved checkpoint state, None when there is none."""
        if not self.checkpoint.exists():
            return None
        import torch  # optional dependency: only a training process reads checkpoints

        return torch.load(self.checkpoint, weights_only=False)

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write ``state`` as the checkpoint (a temp file, then renamed over the old one)."""
        import torch  # optional dependency: only a training process writes checkpoints

        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint)

    def rewrite_metrics(self, version: int) -> None:
        """After a resume: the record is the steps up to ``version`` (what the checkpoint
        holds), nothing after."""
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
