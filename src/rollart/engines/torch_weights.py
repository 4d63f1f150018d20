"""Reading a safetensors file straight into a torch model's parameters (the torch engine's
weight load, :meth:`rollart.engines.torch_engine.TorchGenerationEngine.load_weights`)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from .weight_files import data_layout

__all__ = ["read_file_into"]

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F64": torch.float64}
"""The float dtypes of a safetensors file the engine loads weights from."""


def read_file_into(own: dict[str, torch.Tensor], path: Path,
                   names: Collection[str] | None = None) -> None:
    """Copy a checked safetensors file into ``own`` (a model's ``state_dict()``), only the
    tensors ``names`` when given (a delta patched in place: the others are unchanged): read
    straight into each parameter's memory where the file holds its dtype (a staged streamed
    version always does), else through one tensor's buffer and a cast. Plain reads, not a
    memory map: the file's pages stay page cache and do not add a model's worth to the
    process's resident memory while it loads."""
    start, layout = data_layout(path)
    with open(path, "rb", buffering=0) as f, torch.no_grad():
        for k, (dtype, shape, b, e) in layout.items():
            if names is not None and k not in names:
                continue
            dst = own[k]
            src_dtype = _SAFETENSORS_DTYPES.get(dtype)
            if src_dtype is None:
                raise ValueError(f"{path}: tensor {k} has dtype {dtype}, not a float the engine loads")
            direct = src_dtype == dst.dtype and dst.device.type == "cpu" and dst.is_contiguous()
            buf = dst.view(-1).view(torch.uint8) if direct else torch.empty(e - b, dtype=torch.uint8)
            mv = memoryview(buf.numpy())
            f.seek(start + b)
            got = 0
            while got < e - b:
                n = f.readinto(mv[got:])
                if not n:
                    raise ValueError(f"{path}: truncated in tensor {k}")
                got += n
            if not direct:
                dst.copy_(buf.view(src_dtype).view(shape).to(device=dst.device, dtype=dst.dtype))
