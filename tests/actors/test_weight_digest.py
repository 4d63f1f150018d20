"""Weights by content: the digest names the tensors (names, dtypes, shapes, data), not a
safetensors file's bytes, whose header order differs per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.actors.kernel.policy import (DigestMismatch, check_digest, content_digest,
                                   file_content_digest, sha256_digest)

ROOT = Path(__file__).resolve().parents[2]

SAVE = """
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
ts = {f"layer.{i}.w": torch.randn(8, 4, generator=g) for i in range(12)}
ts["embed"] = torch.randn(16, 4, generator=g).to(torch.bfloat16)
ts["count"] = torch.tensor(7)
ts["mask"] = torch.tensor([True, False, True])
if sys.argv[2] == "changed":
    ts["layer.3.w"][1, 2] += 1e-3
save_file(ts, sys.argv[1], metadata={k: k * 3 for k in "abcdef"})
"""


def _save_in_processes(tmp_path: Path, kinds: list[str]) -> list[Path]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    paths = [tmp_path / f"w{i}-{k}.safetensors" for i, k in enumerate(kinds)]
    procs = [subprocess.Popen([sys.executable, "-c", SAVE, str(p), k], env=env)
             for p, k in zip(paths, kinds)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    return paths


def test_same_tensors_saved_by_two_processes_have_one_digest(tmp_path):
    same = _save_in_processes(tmp_path, ["same", "same", "same", "changed"])
    changed = same.pop()
    if len({p.read_bytes() for p in same}) == 1:  # header order is random per process: more
        (tmp_path / "more").mkdir()
        same += _save_in_processes(tmp_path / "more", ["same"] * 4)
    assert len({p.read_bytes() for p in same}) > 1, "every process wrote the same bytes"
    digests = {file_content_digest(p) for p in same}
    assert len(digests) == 1 and next(iter(digests)).startswith("tensors-sha256:")
    assert {content_digest(p.read_bytes()) for p in same} == digests
    assert file_content_digest(changed) not in digests, "one changed value changes the digest"

    import torch
    from safetensors.torch import load_file

    from rollart.engines.torch_trainer import tensors_digest

    assert tensors_digest(load_file(str(same[0]))) in digests  # from memory, the same digest
    t = load_file(str(changed))
    t["extra"] = torch.zeros(1)
    assert tensors_digest(t) != file_content_digest(changed)


def test_check_digest_schemes_and_broken_files(tmp_path):
    (path,) = _save_in_processes(tmp_path, ["same"])
    data = path.read_bytes()
    digest = file_content_digest(path)
    assert check_digest(data, digest) == digest
    assert check_digest(data, sha256_digest(data)) == sha256_digest(data)  # the older scheme
    with pytest.raises(DigestMismatch):
        check_digest(data[:-4] + b"\1\2\3\4", digest)  # a changed value
    with pytest.raises(DigestMismatch, match="truncated|malformed"):
        check_digest(data[:-4], digest)
    with pytest.raises(DigestMismatch, match="safetensors"):
        check_digest(b"\xff" * 16, digest)
    with pytest.raises(DigestMismatch, match="scheme"):
        check_digest(data, "md5:00")
