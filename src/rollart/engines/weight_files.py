"""Weight files and model folders, read without torch (standard library only).

What the engines that load weights by file (``proxy.engine: vllm`` and ``sglang``) need to
know before a weight update reaches their server, where a wrong shape kills the engine and
a missing name loads silently:

- :func:`read_header`: the tensors (dtype, shape) of a safetensors file or of its bytes,
  from the header only, with the file's layout checked (known dtypes, each tensor's data
  inside the file and of its dtype's size);
- :func:`read_model_info`: a HF model folder's vocabulary, eos tokens, tied embeddings,
  head size and tensor shapes (:func:`model_weight_shapes`, sharded folders included);
- :func:`check_weights`: names, shapes and float dtypes of an update against the model;
- :func:`read_metadata` and :func:`weights_kind`: whether a file is a LoRA adapter
  (``trainer.lora``) or full weights;
- :func:`rename_tensor` and :func:`place_weights`: what staging an update takes.

The safetensors format: a u64 little-endian header size N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the data section), then the data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import struct
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "DTYPE_BYTES",
    "LORA_KIND",
    "ModelInfo",
    "TIED",
    "Tensor",
    "check_weights",
    "data_layout",
    "model_weight_shapes",
    "place_weights",
    "is_adapter_metadata",
    "read_header",
    "read_metadata",
    "read_model_info",
    "rename_tensor",
    "weights_kind",
]

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
               "BOOL": 1}
"""Bytes per element of the safetensors dtypes."""

TIED = ("lm_head.weight", "model.embed_tokens.weight")
"""The output head and the input embedding, one matrix when a model ties them."""

_INDEX = "model.safetensors.index.json"

Source = str | os.PathLike | bytes | bytearray | memoryview


class Tensor(NamedTuple):
    """A tensor of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]


# ======================================================================================
# safetensors headers
# ======================================================================================
def read_header(source: Source) -> dict[str, Tensor]:
    """``{name: Tensor(dtype, shape)}`` of a safetensors file (a path, of which only the
    header is read) or of its bytes. ``ValueError`` unless it is a complete safetensors file:
    a header that parses, known dtypes, every tensor's data inside the file and of the
    size its dtype and shape make; the message names the file (``weights`` for bytes)."""
    raw, data_len, what = _raw_header(source)
    return _parse(raw, data_len, what)


def data_layout(path: str | os.PathLike) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """``(data_start, {name: (dtype, shape, begin, end)})`` of a safetensors file: where each
    tensor's bytes are (``data_start + begin`` up to ``data_start + end``), checked as
    :func:`read_header` checks them; for reads straight into a model's tensors."""
    raw, data_len, what = _raw_header(path)
    tensors = _parse(raw, data_len, what)
    header = json.loads(raw)
    out = {name: (t.dtype, t.shape, *(int(x) for x in header[name]["data_offsets"]))
           for name, t in tensors.items()}
    return 8 + len(raw), out


def read_metadata(source: Source) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file or of its bytes (empty when it has none)."""
    raw, _, what = _raw_header(source)
    try:
        meta = json.loads(raw).get("__metadata__") or {}
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{what}: not a safetensors file (bad header: {e})") from None
    if not isinstance(meta, dict):  # a bad file, not a bad call: ValueError as the others
        raise ValueError(f"{what}: not a safetensors file (__metadata__ is not an object)")  # noqa: TRY004
    return {str(k): str(v) for k, v in meta.items()}


LORA_KIND = "lora"
"""``__metadata__["rollart_kind"]`` of a LoRA adapter file, and ``PolicyPublished.kind`` of
a version published as one (:mod:`rollart.engines.lora`)."""


def is_adapter_metadata(meta: Mapping[str, str]) -> bool:
    return meta.get("rollart_kind") == LORA_KIND


def weights_kind(source: Source) -> str:
    """``"lora"`` for a LoRA adapter file (by its metadata), else ``"full"``."""
    return LORA_KIND if is_adapter_metadata(read_metadata(source)) else "full"


def _raw_header(source: Source) -> tuple[bytes, int, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        mv = memoryview(source)
        what, total = "weights", len(mv)
        n = _header_size(bytes(mv[:8]), total, what)
        raw = bytes(mv[8:8 + n])
    else:
        p = Path(source)
        what = str(p)
        try:
            total = p.stat().st_size
            with open(p, "rb") as f:
                n = _header_size(f.read(8), total, what)
                raw = f.read(n)
        except OSError as e:
            raise ValueError(f"cannot read weights from {p}: {e}") from e
    return raw, total - 8 - n, what


def _header_size(head: bytes, total: int, what: str) -> int:
    if len(head) < 8:
        raise ValueError(f"{what}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    if n > total - 8:
        raise ValueError(f"{what}: not a safetensors file (header size beyond the data)")
    return n


def _parse(raw: bytes, data_len: int, what: str) -> dict[str, Tensor]:
    try:
        header = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{what}: not a safetensors file (bad header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what}: not a safetensors file (header is not an object)")
    out: dict[str, Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(meta["dtype"])
            shape = tuple(int(s) for s in meta["shape"])
            lo, hi = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{what}: not a safetensors file (bad entry {name!r})") from None
        size = DTYPE_BYTES.get(dtype)
        if size is None:
            raise ValueError(f"{what}: not a safetensors file ({name}: unknown dtype {dtype})")
        if hi > data_len:
            raise ValueError(f"{what}: truncated safetensors file ({data_len} data bytes, "
                             f"{name} needs {hi})")
        if not 0 <= lo <= hi or hi - lo != size * math.prod(shape):
            raise ValueError(f"{what}: not a safetensors file ({name}: {hi - lo} data bytes "
                             f"for {dtype} {list(shape)})")
        out[name] = Tensor(dtype, shape)
    return out


def rename_tensor(data: bytes, old: str, new: str) -> bytes:
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


# ======================================================================================
# Model folders
# ======================================================================================
@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What an engine needs to know of a model folder (no torch, no weights read)."""

    vocab_size: int | None
    eos_token_ids: tuple[int, ...]
    tied: bool
    head_dim: int | None
    shapes: dict[str, tuple[int, ...]]
    """Tensor name -> shape, from the safetensors headers of the folder (empty if none)."""


def _ids(x: Any) -> list[int]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(t) for t in x]
    return [int(x)]


def read_model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """Vocabulary size, eos tokens (``generation_config.json``'s, then ``config.json``'s:
    the set rollart's torch engine stops on), tied embeddings, head size and tensor shapes
    of a HF model folder; ``ValueError`` without a readable ``config.json``."""
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
    vocab = text.get("vocab_size", cfg.get("vocab_size"))
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    return ModelInfo(vocab_size=int(vocab) if vocab is not None else None,
                     eos_token_ids=tuple(eos), tied=tied,
                     head_dim=int(head_dim) if head_dim else None,
                     shapes=model_weight_shapes(d))


def model_weight_shapes(model_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the weights of a HF model folder: the files its
    ``model.safetensors.index.json`` lists when it is sharded, else every ``*.safetensors``
    (empty when there are none)."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    index = d / _INDEX
    if index.exists():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from e
        files = [d / n for n in sorted(names)]
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update({k: t.shape for k, t in read_header(f).items()})
    return shapes


# ======================================================================================
# The check before an update
# ======================================================================================
def check_weights(given: Mapping[str, Tensor], expected: Mapping[str, Sequence[int]], *,
                  tied: bool = False, optional: Collection[str] = (),
                  what: str = "weights") -> None:
    """``ValueError`` unless ``given`` (a :func:`read_header`) holds every name of
    ``expected`` with its shape, in a float dtype, and no other name.

    ``tied``: either of ``lm_head.weight`` and ``model.embed_tokens.weight`` stands for
    both (an engine that loads the one given into the shared matrix). ``optional``: names
    that may be given or not (an engine that ignores them, e.g. vLLM the ``lm_head.weight``
    of a tied model).
    """
    exp = {k: tuple(v) for k, v in expected.items()}
    if tied:
        head, embed = TIED
        shape = exp.get(embed, exp.get(head))
        if shape is not None:
            exp.setdefault(head, shape)
            exp.setdefault(embed, shape)
            if head in given or embed in given:  # one of the two is enough
                for k in TIED:
                    if k not in given:
                        exp.pop(k, None)
    opt = set(optional)
    missing = sorted(set(exp) - set(given) - opt)
    unexpected = sorted(set(given) - set(exp) - opt)
    both = sorted(set(exp) & set(given))
    bad = [f"{k}: {tuple(given[k].shape)} != {exp[k]}" for k in both
           if tuple(given[k].shape) != exp[k]]
    bad += [f"{k}: dtype {given[k].dtype}" for k in both
            if not given[k].dtype.startswith(("F", "BF"))]
    if missing or unexpected or bad:
        raise ValueError(f"{what} do not match the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]} shape mismatches={bad[:5]}")


def place_weights(source: Source, dest: Path, *, hard_link: bool = False) -> None:
    """Put the weights ``source`` at ``dest`` in one step (a reader never sees half a file):
    bytes are written; a file is linked (``hard_link``: a hard link, which pins the checked
    file even if its path is replaced later; else a symbolic link) or copied where links
    fail."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    if isinstance(source, (bytes, bytearray, memoryview)):
        with open(tmp, "wb") as f:
            f.write(source)
    else:
        try:
            if hard_link:
                os.link(source, tmp)
            else:
                os.symlink(Path(source).resolve(), tmp)
        except OSError:
            shutil.copyfile(source, tmp)
    os.replace(tmp, dest)
