"""Every config value is checked when loaded: a bad one fails at once with a ConfigError that
names its full key and the allowed range, never later as a traceback, a hang or a run that
"succeeds" doing nothing (issue 8 item 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from rollart.actors.trainer.actor import Trainer
from rollart.config import ActorConfig, ConfigError, RunConfig, convert, load
from rollart.config.schema import trainer_buffer
from rollart.engines import missing_for

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
NAN, INF = float("nan"), float("inf")


def nest(section: str, key: str, value) -> dict:
    """``("envs.lake", "max_turns", 0)`` -> ``{"envs": {"lake": {"max_turns": 0}}}``."""
    data: dict = {key: value}
    for part in reversed(section.split(".")) if section else ():
        data = {part: data}
    return data


H = "actors.env.handlers.on_request"
BAD = [
    # the review's list
    ("envs.main", "max_turns", 0),
    ("trainer", "checkpoint_every", 0),
    ("trainer", "lr", -1),
    ("model.tiny", "hidden_size", 63),
    ("", "run", "bad name!"),
    ("trainer", "steps", -5),
    ("envs.main", "step_timeout", -1),
    ("rollout", "group_size", 1),
    # every other numeric key
    ("trainer", "steps", 0),
    ("trainer", "lr", 0),
    ("trainer", "lr", NAN),
    ("trainer", "lr", INF),
    ("trainer", "weight_decay", -0.1),
    ("trainer", "grad_clip", 0),
    ("trainer", "warmup_steps", -1),
    ("trainer", "clip_low", -0.1),
    ("trainer", "clip_low", 1.0),
    ("trainer", "clip_high", -0.1),
    ("trainer", "is_cap", 0),
    ("trainer", "entropy_coef", -0.01),
    ("trainer", "entropy_target", 0),
    ("trainer", "entropy_coef_step", -0.001),
    ("trainer", "entropy_coef_max", -0.1),
    ("trainer", "adam_betas", [0.9, 1.0]),
    ("trainer", "adam_betas", [-0.1, 0.95]),
    ("trainer", "kl_coef", -0.01),
    ("trainer", "micro_batch_tokens", 0),
    ("trainer", "keep_weights", 0),
    ("trainer", "seed", -1),
    ("trainer", "eval_groups", 0),
    ("trainer", "stall_after", 0),
    ("trainer", "checkpoint_every", 100),  # more steps than the trainer can hold un-acked
    ("rollout", "group_size", 0),
    ("rollout", "batch_groups", 0),
    ("rollout", "concurrency", 0),
    ("rollout", "redundancy", -1),
    ("rollout", "alpha", -1),
    ("rollout", "generate_timeout", 0),
    ("rollout", "generate_retries", -1),
    ("rollout", "service_wait", NAN),
    ("rollout", "replica_timeout", -1),
    ("rollout", "ack_wait", 0),
    ("rollout", "seed", -1),
    ("rollout", "fail_after_groups", -1),
    ("envs.main", "max_turns", -3),
    ("envs.main", "max_context_tokens", 0),
    ("envs.main", "reset_timeout", 0),
    ("envs.main", "reset_retries", -1),
    ("envs.main", "step_timeout", 0),
    ("envs.main", "format_penalty", NAN),
    ("envs.main", "turn_template", "{obs}"),
    ("envs.main", "action_pattern", "(unclosed"),
    ("envs.main.sampling", "max_new_tokens", 0),
    ("envs.main.sampling", "temperature", -0.5),
    ("envs.main.sampling", "top_p", 0),
    ("envs.main.sampling", "top_p", 1.5),
    ("model", "threads", 0),
    ("model.tiny", "vocab_size", 100),
    ("model.tiny", "hidden_size", 0),
    ("model.tiny", "hidden_size", 66),  # head size 33: rotary embeddings need an even one
    ("model.tiny", "num_layers", 0),
    ("model.tiny", "num_heads", 0),
    ("model.tiny", "num_heads", 3),
    ("model.tiny", "num_kv_heads", 3),
    ("model.tiny", "intermediate_size", 0),
    ("model.tiny", "seed", -1),
    ("node", "grace", -1),
    ("node", "heartbeat_every", -1),
    ("node", "events_max_age", 5),  # 0 (no limit) or >= 60 s
    ("node", "events_max_age", -1),
    ("node", "events_max_bytes", 1000),  # 0 (no limit) or >= 1 MiB
    ("node", "events_max_bytes", -1),
    ("node", "bus_outage_max", -1),
    ("node", "bus_outage_max", NAN),
    ("node", "stuck_after", -1),
    ("node", "stuck_after", 10),  # 0 (never) or >= 3 x heartbeat_every (5 s)
    ("envs.main", "max_abandoned_threads", 0),
    ("proxy", "engine", "tensorrt"),
    ("proxy", "gather_ms", -1),
    ("proxy", "max_batch", 0),
    ("actors.generate", "replicas", -1),
    ("actors.reward", "replicas", -1),
    ("reward", "gather_ms", -1),
    ("actors.env", "replicas", -1),
    ("actors.env", "type", "not an import path"),
    (H, "ack_wait", 0),
    (H, "max_deliver", 0),
    (H, "max_inflight", 0),
    (H, "max_ack_pending", 0),
    (H, "heartbeat", -1),
    (H, "pool", "gpu.a"),
    (H, "durable", "my durable"),
    (H, "queue", "a*"),
    ("actors.trainer.handlers.on_completed", "max_inflight", 16),  # less than one step holds
]


@pytest.mark.parametrize("section,key,value", BAD, ids=[f"{s}.{k}={v!r}".lstrip(".") for s, k, v in BAD])
def test_bad_value_names_its_key(section, key, value):
    full = f"{section}.{key}".lstrip(".")
    with pytest.raises(ConfigError) as e:
        convert(nest(section, key, value), RunConfig, source="run.yaml")
    msg = str(e.value)
    assert msg.startswith("run.yaml: ") and full in msg, msg


@pytest.mark.parametrize("data,needle", [
    ({"trainer": {"checkpoint_every": 0}}, "trainer.checkpoint_every must be >= 1 (it is 0)"),
    ({"trainer": {"lr": -1}}, "trainer.lr must be > 0 (it is -1.0)"),
    ({"envs": {"lake": {"max_turns": 0}}, "rollout": {"env": "lake"}},
     "envs.lake.max_turns must be >= 1 (it is 0)"),
    ({"envs": {"main": {"sampling": {"top_p": 2}}}}, "envs.main.sampling.top_p must be in (0, 1]"),
    ({"trainer": {"clip_low": 1}}, "trainer.clip_low must be in [0, 1)"),
    ({"model": {"tiny": {"hidden_size": 63}}},
     "model.tiny.hidden_size (63) must be divisible by model.tiny.num_heads (4)"),
    ({"model": {"tiny": {"num_heads": 4, "num_kv_heads": 3}}},
     "model.tiny.num_heads (4) must be divisible by model.tiny.num_kv_heads (3)"),
    ({"run": "bad name!"}, "run: run 'bad name!' is not a valid subject token"),
    ({"rollout": {"group_size": 1}, "trainer": {"advantage": "rloo"}},
     "rollout.group_size must be >= 2 with trainer.advantage 'rloo'"),
    ({"trainer": {"checkpoint_every": 100}}, "trainer.checkpoint_every: the trainer acks"),
    ({"trainer": {"checkpoint_every": 100}}, "Set trainer.checkpoint_every <= 11, or raise "
     "actors.trainer.handlers.on_completed.max_inflight and max_ack_pending to >= 6464"),
    ({"actors": {"env": {"handlers": {"on_request": {"max_deliver": 0}}}}},
     "actors.env.handlers.on_request.max_deliver must be -1 (no limit) or >= 1"),
    ({"trainer": {"shard": "fsdp2", "backend": "megatron"}},
     "trainer.shard: fsdp2 needs trainer.backend: torch (it is 'megatron'"),
    ({"trainer": {"shard": "fsdp2", "lora": {"rank": 4}}},
     "trainer.shard: fsdp2 does not train trainer.lora adapters"),
    ({"trainer": {"shard": "zero3"}}, "trainer.shard"),
])
def test_message_says_the_allowed_range(data, needle):
    with pytest.raises(ConfigError) as e:
        convert(data, RunConfig, source="run.yaml")
    assert str(e.value).startswith("run.yaml: ") and needle in str(e.value), str(e.value)


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo", "reinforce_pp"])
def test_every_estimator_needs_a_group(advantage):
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        convert({"rollout": {"group_size": 1}, "trainer": {"advantage": advantage}}, RunConfig)
    convert({"rollout": {"group_size": 2}, "trainer": {"advantage": advantage}}, RunConfig)


@pytest.mark.parametrize("data", [
    # in trajectory mode each trajectory advances on its own: a concurrency below one group
    # or one batch only runs slower, so it is accepted
    {"rollout": {"batch_groups": 100000, "concurrency": 64}},
    {"rollout": {"group_size": 8, "concurrency": 1}},
    {"trainer": {"checkpoint_every": 11}},  # the most the default buffer holds (alpha 1)
    {"trainer": {"checkpoint_every": 100},
     "actors": {"trainer": {"handlers": {"on_completed": {"max_inflight": 6464, "max_ack_pending": 6464}}}}},
    {"trainer": {"is_cap": None, "clip_low": 0, "clip_high": 0, "warmup_steps": 0}},
    {"envs": {"main": {"sampling": {"temperature": 0, "top_p": 1}}}},
    {"node": {"grace": 0, "heartbeat_every": 0, "bus_outage_max": 0}},
    {"rollout": {"replica_timeout": 0, "fail_after_groups": 0, "redundancy": 2, "alpha": 0}},
    {"actors": {"env": {"handlers": {"on_request": {"max_deliver": -1, "pool": "gpu-a_1"}}}}},
    {"actors": {"reward": {"replicas": 0}}},
    {"trainer": {"shard": "fsdp2", "world_size": 2}},
    {"trainer": {"shard": "fsdp2"}},  # one rank: fully_shard over a group of one
])
def test_edge_values_that_work_are_accepted(data):
    convert(data, RunConfig)


def test_checks_also_run_on_replace():
    """``rollart run --steps N`` replaces a field: the same check applies."""
    cfg = RunConfig()
    with pytest.raises(ValueError, match="trainer.steps must be >= 1"):
        msgspec.structs.replace(cfg.trainer, steps=-5)


def test_trainer_buffer_is_what_the_trainer_uses(tmp_path):
    cfg = convert({"run_dir": str(tmp_path), "rollout": {"batch_groups": 40, "alpha": 2}}, RunConfig)
    t = Trainer.from_config(cfg, ActorConfig(), pool="default")
    assert t.settings["on_completed"]["max_inflight"] == trainer_buffer(cfg.rollout) > 256


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_passes_rollart_config(path):
    """Every shipped config passes ``rollart config``; one whose engine is not installed here
    (``quickstart-vllm`` outside the vLLM venv) fails with the line that installs it."""
    missing = missing_for(load(path, RunConfig).proxy.engine)
    r = subprocess.run([sys.executable, "-m", "rollart", "config", str(path)],
                       capture_output=True, text=True, timeout=300)
    if missing is not None:
        assert r.returncode != 0 and missing in r.stderr and "Traceback" not in r.stderr, r.stderr
        return
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_an_unknown_torch_engine_arg_fails_rollart_config_naming_it(tmp_path):
    raw = yaml.safe_load((CONFIGS[0].parent / "quickstart.yaml").read_text())
    raw.setdefault("proxy", {})["engine_args"] = {"kv_cache": 64}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "rollart", "config", "--static", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "proxy.engine_args.kv_cache" in r.stderr + r.stdout, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("section,moved_to", [("proxy", "actors.generate.replicas"),
                                              ("reward", "actors.reward.replicas")])
def test_a_replica_key_of_an_earlier_release_names_its_new_place(section, moved_to):
    with pytest.raises(ConfigError) as e:
        convert({section: {"replicas": 2}}, RunConfig, source="run.yaml")
    assert str(e.value) == f"run.yaml: '{section}.replicas' is now '{moved_to}'"
