"""The scale-out trainer learns the quickstart: ``trainer.world_size: 2`` (rank 1 a child
process of the run, gloo), ``trainer.lora`` (adapters only, published as adapter files) and
``trainer.sync.format: stream`` (versions as buckets and deltas),
reach greedy success >= 0.9 under the rules of :mod:`tests.e2e.test_learning`: one run, the
packaged config as it is (LoRA: its rank, alpha and LR, below), no retry with another seed, no
``--resume``. Run by ``make test-scale`` (marked ``scale``)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rollart.app.launch import with_overrides
from tests.e2e.test_learning import learns, quickstart

pytestmark = [pytest.mark.slow, pytest.mark.scale, pytest.mark.xdist_group("learn")]
# xdist_group: `make test-scale` (--dist loadgroup) runs every learning run on one worker, one
# at a time; the multi-host tests take the other


@pytest.mark.timeout(1500)
async def test_quickstart_learns_with_two_trainer_ranks(tmp_path):
    cfg = with_overrides(quickstart(tmp_path, "learn-ranks2", 1), trainer={"world_size": 2})
    _, rows = await learns(cfg, "world_size 2")
    assert all(r["world_size"] == 2 for r in rows), "every step was computed by two ranks"
    log = Path(cfg.run_dir) / cfg.run / "logs" / "trainer-rank1.log"
    assert f"step -> version {cfg.trainer.steps}" in log.read_text(), "rank 1 took every step"


LORA = {"rank": 64, "alpha": 64.0,
        "targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "lm_head")}
LORA_LR = 0.001
"""LoRA on the quickstart: the tiny model is random-init and 64 wide, and its head's weights
are small (initializer_range 0.02: the four actions' logits differ by ~0.2), so adapters on
the projections alone cannot make the policy confident (with rank 32 it stayed at sampled
success ~0.1 for 100 steps): the head gets an adapter too, and the rank is the width (rank 16
reached sampled 0.45 in 100 steps). The LR is a third of the quickstart's: at its 0.003 (and at
0.01) the adapted policy turned confident on a failing path by step ~30 and never recovered
(greedy 0.0 after 100 steps, in CI once and on seed 0 of ``benchmarks/quickstart_seeds.py
--variants lora-r64,...``), while 0.001 and 0.0015 learned on every seed measured
(``benchmarks/README.md``, "Quickstart over seeds: lora-a1")."""


@pytest.mark.timeout(1800)
async def test_quickstart_learns_with_lora(tmp_path):
    """``trainer.lora`` (adapters on the 7 projections and the head; base weights and
    embeddings frozen): the quickstart learns, every version published as an adapter file
    the generators apply."""
    from rollart.config.trainer import LoraConfig
    from rollart.engines.weight_files import read_header, weights_kind

    cfg = with_overrides(quickstart(tmp_path, "learn-lora", 1),
                         trainer={"lora": LoraConfig(**LORA), "lr": LORA_LR})
    await learns(cfg, f"lora {LORA} lr {LORA_LR}")
    weights = sorted((Path(cfg.run_dir) / cfg.run / "weights").glob("v*.safetensors"))
    assert weights and all(weights_kind(p) == "lora" for p in weights), "versions are adapters"
    assert all(".lora_" in n for n in read_header(weights[-1]))


@pytest.mark.timeout(1200)
async def test_quickstart_learns_with_streamed_deltas(tmp_path):
    """``trainer.sync.format: stream`` (deltas on, anchors every 8 versions) kept in the run
    folder (``trainer.weights: file``, so the kept versions can be read after the run: the
    default ``auto`` keeps them in shared memory, removed at the end; `make test`'s learning
    run is on that default): the quickstart learns the same, every version after the first
    assembled from a delta or a chain."""
    from rollart.config.trainer import SyncConfig

    cfg = with_overrides(quickstart(tmp_path, "learn-stream", 1),
                         trainer={"sync": SyncConfig(format="stream"), "weights": "file"})
    assert cfg.trainer.sync.format == "stream" and cfg.trainer.sync.delta
    await learns(cfg, "stream")
    stream = Path(cfg.run_dir) / cfg.run / "weights" / "stream"
    manifests = sorted(stream.glob("*.manifest"))
    kept = [msgspec.json.decode(p.read_bytes()) for p in manifests]
    assert "delta" in [k["kind"] for k in kept] and kept[0]["kind"] == "full", \
        [(k["version"], k["kind"]) for k in kept]  # the kept versions start at their anchor
    assert all(k["stats"]["wire_bytes"] < k["stats"]["full_bytes"] for k in kept if k["kind"] == "delta")


@pytest.mark.timeout(1800)
async def test_the_readme_agent_learns(tmp_path):
    """``configs/agent-frozenlake.yaml`` as packaged: the README's openai-client agent,
    every move a request to its trajectory's endpoint. Asserted: it starts unable to do the
    task and its sampled success rises (the mean of the last 10 steps at least 0.4; 3 seeds
    of 3 reached greedy 1.0 at 100 steps); greedy success is printed."""
    import json

    from rollart.app.run import train
    from rollart.config import RunConfig, load
    from tests.e2e.test_learning import ROOT

    cfg = with_overrides(load(ROOT / "configs" / "agent-frozenlake.yaml", RunConfig),
                         run="learn-agent", run_dir=str(tmp_path / "runs"))
    summary = await train(cfg, nats="memory", resume=False, quiet=True)
    rows = [json.loads(x) for x in
            (Path(cfg.run_dir) / cfg.run / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["success"], 2) for r in rows]
    late = sum(curve[-10:]) / 10
    print(f"agent: sampled success {curve}; greedy {summary.get('greedy_success')}; "
          f"{summary.get('wall_s', 0):.0f} s")
    assert summary["steps"] == cfg.trainer.steps and not summary["interrupted"], summary
    assert curve[0] < 0.5, "it must start from a policy that cannot do the task"
    assert late >= 0.4, f"the agent did not learn: last 10 steps' sampled success {late:.2f}"
    ids = [t for r in rows for t in r["traj_ids"]]
    assert len(ids) == len(set(ids)), "no trajectory trained twice"
