"""The trainer's files under ``<run_dir>/<run>``: the checkpoint (durable state, step journal,
full checkpoint), the metrics record and the weight versions (:class:`RunFiles`). Blocking:
the trainer calls them off the event loop."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import msgspec

from rollart.engines.checkpoint_codec import CheckpointRefused, load_file, save_file
from rollart.engines.safe_files import read_regular

log = logging.getLogger(__name__)

STATE_FORMAT = 3
"""3: the state records the SHA-256 of each journal record it counts (``journal_sha256``);
2 (read, never written): it does not, its records are read unchecked with a warning; 1 (read,
never written): it names no full checkpoint, which was ``latest.pt``, a pickle that is
refused."""
MAX_STATE_BYTES = 64 << 20
"""Bytes a durable state may have (its ledger is a few ranges: kilobytes)."""
LEGACY = "latest.pt"


class FullRef(msgspec.Struct, forbid_unknown_fields=True):
    """The full checkpoint a durable state counts on: the file ``full-<seq>.safetensors``
    and the size and SHA-256 the trainer wrote it with; it is loaded only if they match."""

    seq: Annotated[int, msgspec.Meta(ge=0, le=10**12)]
    """The last step it holds."""
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)]


Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class StateHead(msgspec.Struct):
    """The fields of a durable state that name files and objects (validated before any is
    opened); the rest (ledger, counts) is the trainer's."""

    format: int
    version: Annotated[int, msgspec.Meta(ge=0)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=10**12)] = 0
    journal_from: Annotated[int, msgspec.Meta(ge=1, le=10**12 + 1)] = 1
    full: FullRef | None = None
    journal_sha256: dict[Annotated[str, msgspec.Meta(pattern="^[1-9][0-9]{0,12}$")],
                         Sha256] | None = None
    """Step (decimal) -> the SHA-256 of its record, for each step ``journal_from..seq``
    (format 3; None in a format 2 state)."""


def check_record(head: StateHead, seq: int, data: bytes, what: str) -> None:
    """Refuse step ``seq``'s record ``data`` (named ``what``) unless its SHA-256 is the one
    the durable state ``head`` records (checked before it is decoded). A state without
    digests (format 2) checks nothing: the caller warns once (:func:`unchecked_warning`)."""
    if head.journal_sha256 is None:
        return
    want = head.journal_sha256.get(str(seq))
    if want is None:
        raise CheckpointRefused(f"{what}: the durable state records no SHA-256 for step {seq}")
    if hashlib.sha256(data).hexdigest() != want:
        raise CheckpointRefused(f"{what}: {len(data)} bytes whose SHA-256 is not the one the "
                                f"durable state recorded for step {seq}")


def unchecked_warning(head: StateHead, what: str) -> None:
    """Log that ``head`` (a format 2 state) has records that are read unchecked."""
    if head.journal_sha256 is None and head.seq >= head.journal_from:
        log.warning("%s (format %d, rollart from before the record digests) records no SHA-256 "
                    "of its journal records: steps %d..%d are read unchecked (their full "
                    "checkpoint is checked; the next durable state covers them)", what,
                    head.format, head.journal_from, head.seq)


def parse_state(data: bytes, what: str) -> tuple[dict[str, Any], StateHead]:
    """A durable state's bytes as the dict and its validated head; ``CheckpointRefused``
    naming ``what`` when they are not one this trainer reads."""
    if len(data) > MAX_STATE_BYTES:
        raise CheckpointRefused(f"{what}: {len(data)} bytes, a durable state has at most "
                                f"{MAX_STATE_BYTES}")
    try:
        state = json.loads(data)
        head = msgspec.convert(state, StateHead)
    except (ValueError, RecursionError, msgspec.ValidationError) as e:
        raise CheckpointRefused(f"{what}: not a durable state ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None
    if head.format not in (1, 2, STATE_FORMAT):
        raise CheckpointRefused(f"{what}: format {head.format!r}, this trainer reads formats "
                                f"2 and {STATE_FORMAT}")
    if head.full is not None and head.journal_from != head.full.seq + 1:
        raise CheckpointRefused(f"{what}: the journal starts at step {head.journal_from}, its "
                                f"full checkpoint holds steps up to {head.full.seq}")
    if head.seq + 1 < head.journal_from:
        raise CheckpointRefused(f"{what}: step {head.seq} is before the journal's start "
                                f"({head.journal_from})")
    if head.journal_sha256 is None and head.format >= 3:
        raise CheckpointRefused(f"{what}: format {head.format} without journal_sha256")
    if head.journal_sha256 is not None:  # exactly the steps it counts (len first: bounded)
        n = head.seq - head.journal_from + 1
        if len(head.journal_sha256) != n or not all(
                head.journal_from <= int(k) <= head.seq for k in head.journal_sha256):
            raise CheckpointRefused(f"{what}: records the SHA-256 of {len(head.journal_sha256)} "
                                    f"journal records, it counts {n} (steps "
                                    f"{head.journal_from}..{head.seq})")
    return state, head


def legacy_refusal(path: Path | str) -> CheckpointRefused:
    return CheckpointRefused(
        f"{path} is a full checkpoint in the old pickle format (rollart before the safetensors "
        f"checkpoint), which is never loaded: unpickling runs code the file names. Start the "
        f"run again in a new folder, or, if you wrote that file yourself, convert it with "
        f"`python -m rollart.actors.trainer.files {Path(path).parent.parent}` (torch's "
        f"restricted weights_only loader) and resume")


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
      the ledger, counters, the version and the step sequence number it reached, the full
      checkpoint it counts on (``full``: a :class:`FullRef`, None before the first) and the
      SHA-256 of each journal record it counts (``journal_sha256``);
    - ``journal/<seq>.msgpack``, one per step since the last full checkpoint: the
      trajectories the step trained on, in order, and the RNG state it started from
      (:class:`rollart.actors.trainer.checkpoint.StepRecord`), written before the state
      that counts it;
    - ``full-<seq>.safetensors``, the full checkpoint (model, optimizer, scheduler, RNG, and
      ``journal_seq``: the last step it holds; :mod:`rollart.engines.checkpoint_codec`), every
      ``trainer.full_checkpoint_every`` steps. A new one gets a new name: the one the durable
      state names stays until a state naming the new one is durable.

    A resume loads the full checkpoint the state names, only if its bytes have the SHA-256
    recorded there, and trains the journal's steps after its ``journal_seq`` again (each
    record only if its bytes have the SHA-256 recorded there too)
    (:mod:`rollart.actors.trainer.checkpoint`). A ``latest.pt`` (the pickle format of older
    versions) is refused, never unpickled.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.weights = self.path / "weights"
        self.folder = self.path / "checkpoints"
        self.legacy = self.folder / LEGACY
        self.state = self.folder / "state.json"
        self.journal = self.folder / "journal"
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
        """Whether the folder holds anything a resume continues from (or refuses to)."""
        return self.state.exists() or self.legacy.exists()

    # -- the full checkpoint ---------------------------------------------------------
    def full_path(self, seq: int) -> Path:
        return self.folder / f"full-{int(seq):08d}.safetensors"

    def full_seqs(self) -> list[int]:
        """The steps of the full checkpoint files in the folder, in order."""
        return sorted(int(p.name[5:13]) for p in self.folder.glob("full-*.safetensors")
                      if len(p.name) == 25 and p.name[5:13].isdigit())

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The full checkpoint the durable state names, None when it names none;
        :class:`CheckpointRefused` when its bytes are not the ones recorded, or the folder
        holds an old pickle checkpoint."""
        loaded = self.load_state_head()
        if loaded is None or loaded[1].full is None:
            if self.legacy.exists():
                raise legacy_refusal(self.legacy)
            return None
        ref = loaded[1].full
        path = self.full_path(ref.seq)
        state = load_file(path, sha256=ref.sha256, size=ref.bytes)
        if not isinstance(state, dict) or state.get("journal_seq") != ref.seq:
            raise CheckpointRefused(f"{path}: it does not hold step {ref.seq}, which the "
                                    f"durable state names")
        return state

    def save_checkpoint(self, state: dict[str, Any]) -> FullRef:
        """Write ``state`` (its ``journal_seq``: the last step it holds) as a new full
        checkpoint file (atomically); returns what a durable state names it by."""
        seq = int(state["journal_seq"])
        size, digest = save_file(state, self.full_path(seq))
        return FullRef(seq=seq, sha256=digest, bytes=size)

    def write_full(self, ref: FullRef, data: bytes) -> None:
        """Write ``data``, fetched from elsewhere, as the full checkpoint ``ref`` names: only
        if they are its bytes."""
        if len(data) != ref.bytes or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise CheckpointRefused(f"full checkpoint of step {ref.seq}: {len(data)} bytes "
                                    f"whose SHA-256 is not the one the durable state recorded")
        write_atomic(self.full_path(ref.seq), data)

    def prune_full(self, keep: int) -> list[int]:
        """Delete the full checkpoint files other than step ``keep``'s (and temp files a
        crash left); returns their steps."""
        gone = [s for s in self.full_seqs() if s != keep]
        for s in gone:
            self.full_path(s).unlink(missing_ok=True)
        for p in self.folder.glob("full-*.safetensors.tmp*"):
            p.unlink(missing_ok=True)
        return gone

    # -- the durable state and the journal ---------------------------------------------
    def load_state_head(self) -> tuple[dict[str, Any], StateHead] | None:
        """The durable state and its validated head, None when there is none."""
        try:
            data = read_regular(self.state, MAX_STATE_BYTES, str(self.state), CheckpointRefused)
        except FileNotFoundError:
            return None
        return parse_state(data, str(self.state))

    def load_state(self) -> dict[str, Any] | None:
        """The durable state (``state.json``), None when there is none."""
        loaded = self.load_state_head()
        return None if loaded is None else loaded[0]

    def save_state(self, state: dict[str, Any]) -> int:
        """Write the durable state atomically; returns its bytes."""
        data = json.dumps({**state, "format": STATE_FORMAT}).encode()
        write_atomic(self.state, data)
        return len(data)

    def journal_path(self, seq: int) -> Path:
        return self.journal / f"{int(seq):08d}.msgpack"

    def write_journal(self, seq: int, data: bytes) -> None:
        """Write step ``seq``'s record (durable before the state that counts it is written)."""
        write_atomic(self.journal_path(seq), data)

    def read_journal(self, seq: int) -> bytes:
        """Step ``seq``'s record; ``FileNotFoundError`` when it is missing."""
        return self.journal_path(seq).read_bytes()

    def journal_digests(self, first: int, last: int) -> dict[str, str]:
        """The SHA-256 of the local records of steps ``first..last`` (``journal_sha256``)."""
        return {str(s): hashlib.sha256(self.read_journal(s)).hexdigest()
                for s in range(first, last + 1)}

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
        """The policy version a resume continues from (the durable state's); None: nothing to
        continue from. A folder with only an old pickle checkpoint is refused."""
        loaded = self.load_state_head()
        if loaded is not None:
            return loaded[1].version
        if self.legacy.exists():
            raise legacy_refusal(self.legacy)
        return None

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


def convert_legacy(run_path: str | Path) -> FullRef:
    """Convert ``<run>/checkpoints/latest.pt`` (the pickle format of older versions) into a
    full checkpoint file and a durable state naming it; ``latest.pt`` is renamed
    ``latest.pt.converted``. It is read with torch's restricted loader (``weights_only=True``:
    tensors, containers and numbers only, no constructor the file names); run it only on a
    file your own trainer wrote."""
    import torch  # optional dependency: only a training process reads checkpoints

    files = RunFiles(run_path)
    state = torch.load(files.legacy, map_location="cpu", weights_only=True)
    loaded = files.load_state_head()
    seq = int(state.get("journal_seq", state["backend"]["version"]))
    ref = files.save_checkpoint({**state, "journal_seq": seq})
    durable = {k: v for k, v in (loaded[0] if loaded else state).items()
               if k in ("version", "ledger", "counts", "wall_s", "entropy_coef")}
    durable.setdefault("version", int(state["backend"]["version"]))
    last = max(seq, loaded[1].seq if loaded else seq)
    files.save_state({**durable, "seq": last, "journal_from": seq + 1,
                      "full": msgspec.to_builtins(ref),
                      "journal_sha256": files.journal_digests(seq + 1, last)})
    os.replace(files.legacy, files.legacy.with_name(f"{LEGACY}.converted"))
    return ref


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m rollart.actors.trainer.files <run folder>")
    ref = convert_legacy(sys.argv[1])
    print(f"converted: checkpoints/full-{ref.seq:08d}.safetensors ({ref.bytes} bytes, "
          f"sha256 {ref.sha256})")
