"""The model folder a weight update of ``proxy.engine: sglang`` is handed to the server in
(standard library only).

Reading the weights (safetensors headers, the model folder's shapes) and the name/shape check
that runs before an update reaches the server live in :mod:`rollart.engines.weight_files`,
shared with the vLLM engine; :func:`stage_weights` here makes the folder.

SGLang API fact this relies on (``python/sglang/srt``, SGLang 0.4.x-0.5.x):
``POST /update_weights_from_disk {"model_path": DIR, "weight_version": "N"}`` reloads
every ``*.safetensors`` in DIR (a model folder) in place; it takes the model-update
writer lock (waits for requests in flight), rolls back on a load error, flushes the
radix cache itself, and answers ``{"success", "message"}`` (HTTP 400 on failure). It
loads whatever names the file holds and leaves the others as they were, hence the
client-side name/shape check first. ``/flush_cache`` is called after it as well.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from .weight_files import place_weights

__all__ = ["stage_weights", "WEIGHT_SUFFIXES"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def stage_weights(work: Path, model_dir: Path, source: bytes | Path, version: int) -> Path:
    """A model folder for ``/update_weights_from_disk``: the weights as
    ``model.safetensors`` (written, or a symbolic link to the file) and the folder's small
    non-weight files (config, generation config, tokenizer), made under ``work``."""
    folder = work / f"weights-v{version:06d}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    place_weights(source, folder / "model.safetensors")
    for f in model_dir.iterdir():
        if (f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)
                and not f.name.endswith(".index.json") and f.stat().st_size < 64 << 20):
            shutil.copy2(f, folder / f.name)
    return folder
