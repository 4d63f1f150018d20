"""Hardware profiles of the emulated generation engine, and the global time scale.

All numbers are **approximations** from a roofline model of public specs, sized for a dense
~8B-parameter model in bf16 (Qwen3-8B-like: 16 GB of weights, GQA with 8 K/V heads of 128 over
36 layers, i.e. ~147 KB of K/V per token), with efficiency factors in line with what public
vLLM / SGLang benchmarks report for 7-8B models on Hopper (batch-1 decode ~120-160 tokens/s on
H100-class parts, i.e. 6-8 ms per step; prefill a few tens of thousands of tokens/s):

- **H800** (NVIDIA H100 SXM silicon with reduced NVLink; NVIDIA H100 datasheet): ~989 dense BF16
  TFLOPS, 3.35 TB/s HBM3, 80 GB.
  decode step at batch b: weights read once per step, 16 GB / (3.35 TB/s x 0.7) = 6.8 ms, plus per
  sequence K/V reads (~2k-token context: 0.3 GB / 2.3 TB/s = 0.13 ms) and compute
  (16 GFLOP / (989 TFLOPS x 0.5) = 0.03 ms): ``decode_s(b) = 6.8 ms + 0.16 ms x b``.
  prefill: compute-bound, 16 GFLOP per token at ~50% MFU: 0.032 ms per prompt token.
- **H20** (NVIDIA H20, public spec sheets as reported at its 2024 launch): ~148 dense BF16
  TFLOPS, 4.0 TB/s HBM3, 96 GB.
  decode: 16 GB / (4.0 TB/s x 0.7) = 5.7 ms per step, per sequence 0.11 ms of K/V plus
  16 GFLOP / (148 TFLOPS x 0.5) = 0.22 ms of compute: ``decode_s(b) = 5.7 ms + 0.33 ms x b``.
  prefill: 16 GFLOP / (148 TFLOPS x 0.5) = 0.22 ms per prompt token (about 7x the H800's).

So H800 is the prefill-heavy and large-batch part, H20 the bandwidth (small-batch decode) part,
which is the asymmetry the paper's hardware-affinity mapping exploits. Weight loading into an
engine: ``load_gbps`` (host-to-device copy plus re-sharding, ~10 GB/s effective).

Nothing here is a measurement of a GPU: the emulation reproduces the *shape* of the costs
(a batch-size-dependent step, a prompt-length-dependent prefill), not a specific kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TIME_SCALE_ENV = "ROLLART_EMULATE_TIME_SCALE"
"""Environment variable holding the default time scale (wall seconds per modelled second)."""


def time_scale(given: float | None = None) -> float:
    """Wall seconds slept per modelled second: ``given``, else ``$ROLLART_EMULATE_TIME_SCALE``,
    else 1.0."""
    if given is not None:
        v = float(given)
    else:
        v = float(os.environ.get(TIME_SCALE_ENV, "1.0"))
    if not v > 0:
        raise ValueError(f"time_scale must be > 0, got {v!r}")
    return v


@dataclass(frozen=True)
class HardwareProfile:
    """Modelled costs of one generation replica (one engine) on one hardware class."""

    name: str
    decode_base_s: float
    """Seconds of one decode step independent of the batch (reading the weights)."""
    decode_per_seq_s: float
    """Seconds a decode step grows per running sequence (its K/V reads and compute)."""
    prefill_per_token_s: float
    """Seconds of prefill per prompt token not in the replica's cache."""
    max_batch: int = 256
    """Sequences running at once at most (continuous batching); more queue."""
    load_gbps: float = 10.0
    """GB/s at which new weights are loaded into the engine."""
    source: str = ""

    def decode_s(self, batch: int) -> float:
        """Modelled seconds of one decode step with ``batch`` sequences running."""
        return self.decode_base_s + self.decode_per_seq_s * max(1, batch)

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_per_token_s * max(0, tokens)


PROFILES: dict[str, HardwareProfile] = {
    "h800": HardwareProfile("h800", decode_base_s=6.8e-3, decode_per_seq_s=0.16e-3,
                            prefill_per_token_s=0.032e-3, max_batch=256,
                            source="roofline of the H100 SXM datasheet (989 TFLOPS bf16, "
                                   "3.35 TB/s) for an 8B bf16 model; approximation"),
    "h20": HardwareProfile("h20", decode_base_s=5.7e-3, decode_per_seq_s=0.33e-3,
                           prefill_per_token_s=0.22e-3, max_batch=256,
                           source="roofline of public H20 specs (148 TFLOPS bf16, 4.0 TB/s) "
                                  "for an 8B bf16 model; approximation"),
}
"""The built-in profiles by name."""


def profile(spec: str | dict | HardwareProfile) -> HardwareProfile:
    """A profile by name (``h800``, ``h20``), or built from a dict of its fields (a name of a
    built-in under ``base`` is the default of the fields not given)."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, str):
        try:
            return PROFILES[spec]
        except KeyError:
            raise ValueError(f"unknown hardware profile {spec!r}: one of {sorted(PROFILES)}") from None
    d = dict(spec)
    base = PROFILES[d.pop("base", "h800")]
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    bad = sorted(set(d) - set(fields))
    if bad:
        raise ValueError(f"hardware profile: unknown field {bad[0]!r}")
    fields.update(d)
    return HardwareProfile(**fields)
