"""The model folder and weight files of ``proxy.engine: sglang`` (standard library only).

- :func:`read_model_info`: what :class:`~rollart.engines.sglang_engine.SglangEngine` needs
  to know of a HF model folder (vocabulary, eos tokens, tied embeddings, head size, tensor
  shapes), read without torch and without loading weights.
- safetensors headers (:func:`safetensors_header`, :func:`read_safetensors_header`) and
  :func:`rename_safetensors_tensor` (the tied ``lm_head.weight`` saved under the name
  SGLang loads).
- :func:`check_weights`: the client-side name/shape check that runs before a weight update
  reaches the server, and :func:`stage_weights`, the model folder handed to it.

SGLang API fact this relies on (``python/sglang/srt``, SGLang 0.4.x-0.5.x):
``POST /update_weights_from_disk {"model_path": DIR, "weight_version": "N"}`` reloads
every ``*.safetensors`` in DIR (a model folder) in place; it takes the model-update
writer lock (waits for requests in flight), rolls back on a load error, flushes the
radix cache itself, and answers ``{"success", "message"}`` (HTTP 400 on failure). It
loads whatever names the file holds and leaves the others as they were, hence the
client-side name/shape check first. ``/flush_cache`` is called after it as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import struct
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ModelInfo",
    "read_model_info",
    "safetensors_header",
    "read_safetensors_header",
    "rename_safetensors_tensor",
    "check_weights",
    "stage_weights",
    "TIED",
    "WEIGHT_SUFFIXES",
]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


# ======================================================================================
# Model folder facts
# ======================================================================================
@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know of the model folder (no torch, no weights read)."""

    vocab_size: int | None
    eos_token_ids: tuple[int, ...]
    tied: bool
    head_dim: int | None
    shapes: dict[str, tuple[int, ...]]
    """Tensor name -> shape, from the safetensors headers of the folder."""


def _ids(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(t) for t in x]
    return [int(x)]


def read_model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """Vocabulary size, eos tokens (``generation_config.json`` then ``config.json``: the set
    SGLang stops on), tied embeddings, head size and tensor shapes of a HF model folder."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{d} is not a model folder (config.json: {e})") from e
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    gen: dict = {}
    with contextlib.suppress(OSError, ValueError):
        gen = json.loads((d / "generation_config.json").read_text())
    eos: list[int] = []
    for src in (gen.get("eos_token_id"), text.get("eos_token_id"), cfg.get("eos_token_id")):
        for t in _ids(src):
            if t not in eos:
                eos.append(t)
    head_dim = text.get("head_dim")
    if head_dim is None and text.get("hidden_size") and text.get("num_attention_heads"):
        head_dim = int(text["hidden_size"]) // int(text["num_attention_heads"])
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(d.glob("*.safetensors")):
        shapes.update(read_safetensors_header(f))
    vocab = text.get("vocab_size", cfg.get("vocab_size"))
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    return ModelInfo(vocab_size=int(vocab) if vocab is not None else None,
                     eos_token_ids=tuple(eos), tied=tied,
                     head_dim=int(head_dim) if head_dim else None, shapes=shapes)


# ======================================================================================
# safetensors headers (the format: u64 little-endian header size, JSON header, data)
# ======================================================================================
def _parse_header(raw: bytes, total: int | None, what: str) -> dict[str, tuple[int, ...]]:
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{what}: not a safetensors file (bad header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what}: not a safetensors file (header is not an object)")
    shapes: dict[str, tuple[int, ...]] = {}
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(s) for s in meta["shape"])
            lo, hi = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{what}: not a safetensors file (bad entry {name!r})") from None
        shapes[name] = shape
        end = max(end, hi)
    if total is not None and end > total:
        raise ValueError(f"{what}: truncated safetensors file ({total} data bytes, the header "
                         f"needs {end})")
    return shapes


def safetensors_header(data: bytes | bytearray | memoryview) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of safetensors bytes (``ValueError`` if they are not)."""
    mv = memoryview(data)
    if len(mv) < 8:
        raise ValueError("weights: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > len(mv) - 8:
        raise ValueError("weights: not a safetensors file (header size beyond the data)")
    return _parse_header(bytes(mv[8:8 + n]), len(mv) - 8 - n, "weights")


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, reading only its header."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{p}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"{p}: not a safetensors file (header size beyond the file)")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"cannot read weights from {p}: {e}") from e
    return _parse_header(raw, size - 8 - n, str(p))


def rename_safetensors_tensor(data: bytes, old: str, new: str) -> bytes:
    """The same safetensors bytes with tensor ``old`` named ``new`` (header rewritten, data
    untouched: offsets are relative to the data section)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    if old not in header or new in header:
        raise ValueError(f"cannot rename {old!r} to {new!r}")
    header = {(new if k == old else k): v for k, v in header.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


TIED = ("lm_head.weight", "model.embed_tokens.weight")


def check_weights(expected: Mapping[str, Sequence[int]], given: Mapping[str, Sequence[int]],
                  *, tied: bool = False, what: str = "weights") -> None:
    """``ValueError`` unless ``given`` has every name of ``expected`` with its shape and no
    other name. With tied embeddings either of ``lm_head.weight`` and
    ``model.embed_tokens.weight`` stands for both."""
    exp = {k: tuple(v) for k, v in expected.items()}
    giv = {k: tuple(v) for k, v in given.items()}
    if tied:
        head, embed = TIED
        shape = exp.get(embed, exp.get(head))
        if shape is not None:
            exp.setdefault(head, shape)
            exp.setdefault(embed, shape)
            if head in giv or embed in giv:  # one of the two is enough
                for k in TIED:
                    if k not in giv:
                        exp.pop(k, None)
    missing = sorted(set(exp) - set(giv))
    unexpected = sorted(set(giv) - set(exp))
    bad = [f"{k}: {giv[k]} != {exp[k]}" for k in sorted(set(exp) & set(giv)) if giv[k] != exp[k]]
    if missing or unexpected or bad:
        raise ValueError(f"{what} do not match the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]} shape mismatches={bad[:5]}")



# ======================================================================================
# Staging a weight update
# ======================================================================================
def stage_weights(work: Path, model_dir: Path, source: bytes | Path, version: int) -> Path:
    """A model folder for ``/update_weights_from_disk``: the weights as
    ``model.safetensors`` (written, or a link to the file) and the folder's small
    non-weight files (config, generation config, tokenizer), made under ``work``."""
    folder = work / f"weights-v{version:06d}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    target = folder / "model.safetensors"
    if isinstance(source, (bytes, bytearray)):
        tmp = folder / ".model.safetensors.tmp"
        tmp.write_bytes(source)
        os.replace(tmp, target)
    else:
        try:
            os.symlink(Path(source).resolve(), target)
        except OSError:
            shutil.copyfile(source, target)
    for f in model_dir.iterdir():
        if (f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)
                and not f.name.endswith(".index.json") and f.stat().st_size < 64 << 20):
            shutil.copy2(f, folder / f.name)
    return folder
