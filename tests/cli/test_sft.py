"""A warm start by supervised fine-tuning (issue 28): `rollart demos` writes a demonstrator's
episodes as conversations, `rollart sft` fine-tunes on them with the token layout of an RL
trajectory, and `trainer.init_from` starts an RL run (trainer and generators) from the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

QUICKSTART_MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]


def rollart(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollart", *args], cwd=cwd, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def _rl_trajectory(chat, system: str, turns: list[tuple[str, str]], *, free_text: bool):
    """The ids and mask the EnvManager's turn loop records for these (user, assistant) turns,
    through the real ChatFormat and Trace: first_prompt, the generated ids (a free-text turn
    ends with the eos the engine stopped on; a constrained one is the choice's ids), then
    next_prompt after each turn but the last."""
    from rollart.actors.env.trajectory import Trace

    tr = Trace()
    tr.add_prompt(chat.first_prompt(system, turns[0][0]))
    for k, (_, answer) in enumerate(turns):
        resp = chat.encode(answer) + ([chat.tok.eos_token_id] if free_text else [])
        tr.add_response(resp, [0.0] * len(resp), 0)
        if k + 1 < len(turns):
            tr.add_prompt(chat.next_prompt(resp, turns[k + 1][0]))
    return tr.token_ids, tr.mask


def _messages(system: str, turns: list[tuple[str, str]]) -> list[dict]:
    out = [{"role": "system", "content": system}]
    for u, a in turns:
        out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return out


def test_sft_layout_is_the_rl_layout(tiny_model):
    """For the same conversation, SFT's ids are the RL trajectory's, and the loss mask is 1
    exactly on the tokens the policy generates: constrained (the moves; the end of turn is
    prompt) and free text (the answer and its end-of-turn token); a demo line from
    `rollart demos` plays through the same path."""
    import asyncio

    from rollart.actors.env.chat import ChatFormat
    from rollart.app.demos import env_config, play_demo
    from rollart.app.sft_data import conversation_layout, train_samples
    from rollart.envs import make_env
    from rollart.envs.demonstrators import make_demonstrator

    chat = ChatFormat.load(tiny_model)
    cfg, _, _ = env_config("frozenlake", args={"map": QUICKSTART_MAP})
    env = make_env(cfg.type, cfg.args)
    import random

    row = asyncio.run(play_demo(env, cfg, make_demonstrator("frozenlake", "bfs", env, random.Random(0)), 0))
    assert row["success"] and row["constrained"] and row["turns"] == 6
    msgs = row["messages"]
    system, turns = msgs[0]["content"], [(msgs[i]["content"], msgs[i + 1]["content"])
                                         for i in range(1, len(msgs), 2)]
    assert system == env.instruction and [a for _, a in turns] == list("DDRDRR")

    rl_ids, rl_mask = _rl_trajectory(chat, system, turns, free_text=False)
    (sample,) = train_samples(chat, [row])  # eot auto: constrained, as the line says
    assert sample.token_ids == rl_ids and sample.response_mask == rl_mask
    assert chat.decode([t for t, m in zip(rl_ids, rl_mask) if m]) == "DDRDRR"
    assert sum(rl_mask) == 6  # one token a move, nothing else trained

    free = [("What is 2 + 3 ?", "<answer>5</answer>"), ("And 4 + 4 ?", "I think <answer>8</answer>")]
    rl_ids, rl_mask = _rl_trajectory(chat, "Answer in tags.", free, free_text=True)
    ids, mask = conversation_layout(chat, _messages("Answer in tags.", free), eot=True)
    assert ids == rl_ids and mask == rl_mask
    eos = chat.tok.eos_token_id
    trained = [t for t, m in zip(ids, mask) if m]
    assert trained.count(eos) == 2 and chat.decode(trained) == "<answer>5</answer>I think <answer>8</answer>"
    # the whole conversation, rendered at once by the chat template, is the same text
    assert chat.decode(ids, skip_special=False) == chat.render(_messages("Answer in tags.", free),
                                                               generation_prompt=False).rstrip("\n")
    # --eot always on a constrained conversation: the same ids, the end of each turn trained too
    (always,) = train_samples(chat, [row], eot="always")
    assert always.token_ids[:len(sample.token_ids)] == sample.token_ids
    assert always.token_ids[len(sample.token_ids):] == [eos]
    assert sum(always.response_mask) == 12


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """BFS demos of the quickstart's fixed map, and an SFT run on them (the quickstart's own
    tiny model, built under the cwd's runs/_models)."""
    cwd = tmp_path_factory.mktemp("sft")
    r = _ok(rollart("demos", "quickstart", "--policy", "bfs", "--episodes", "32",
                    "--out", "demos.jsonl", cwd=cwd))
    assert json.loads(r.stdout)["success_rate"] == 1.0
    _ok(rollart("sft", "quickstart", "--data", "demos.jsonl", "--steps", "40", "--batch", "8",
                "--eval", "2", "--eval-sampled", "1", "--out", "runs/qs-sft", cwd=cwd))
    return cwd / "runs" / "qs-sft"


def _greedy_hf(folder: Path, grid: list[str], max_turns: int = 16) -> tuple[bool, list[str]]:
    """Play FrozenLake on ``grid`` with a plain HF forward: each turn the argmax of the last
    logits over the four action tokens; prompts as the EnvManager builds them."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollart.actors.env.chat import ChatFormat
    from rollart.envs.frozenlake import FrozenLakeEnv

    chat = ChatFormat.load(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    env = FrozenLakeEnv(map=grid, max_steps=max_turns)
    obs, _ = env.reset(0)
    actions = env.legal_actions()
    action_ids = [chat.encode(a) for a in actions]
    assert all(len(a) == 1 for a in action_ids)
    ids, moves = chat.first_prompt("FrozenLake", obs), []
    for _ in range(max_turns):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        k = int(torch.argmax(logits[[a[0] for a in action_ids]]))
        moves.append(actions[k])
        obs, _, term, trunc, info = env.step(actions[k])
        if term or trunc:
            return bool(info["success"]), moves
        ids += action_ids[k] + chat.next_prompt(action_ids[k], obs)
    return False, moves


def test_sft_on_bfs_demos_lowers_its_loss_and_solves_the_map(sft_run):
    """The loss falls, every trained token is right, the folder is a complete model, and its
    greedy policy walks the shortest path (played by a plain HF forward here, by the torch
    generation engine in the run's --eval)."""
    rows = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["loss"] < rows[0]["loss"] / 5
    assert rows[-1]["token_acc"] == 1.0
    summary = json.loads((sft_run / "summary.json").read_text())
    assert summary["eval"]["greedy_success"] == 1.0 and summary["trained_tokens_per_conversation"] == 6
    # --eval-sampled 1: the first held-out task played group_size (8) times at temperature 1:
    # it samples (greedy solves every time; 40 steps leave the policy soft) and it is the
    # trained policy (a random-init one solves ~1% of episodes)
    assert summary["eval"]["sampled_episodes"] == 8
    assert 0.125 < summary["eval"]["sampled_success"] < 1.0
    assert (sft_run / "learning.png").stat().st_size > 1000
    model = sft_run / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model.iterdir()}
    assert not (model / "rollart_tiny.json").exists()  # no longer the tiny build it came from
    solved, moves = _greedy_hf(model, QUICKSTART_MAP)
    assert solved and len(moves) == 6, moves


def test_sft_eval_sampled_needs_eval(tmp_path):
    """--eval-sampled samples on the first of --eval's tasks: without --eval, or below 0, it is
    refused naming the flag, before anything is trained."""
    (tmp_path / "d.jsonl").write_text("")
    r = rollart("sft", "quickstart", "--data", "d.jsonl", "--eval-sampled", "2", cwd=tmp_path)
    assert r.returncode == 2 and "--eval-sampled needs --eval N" in r.stderr, r.stderr[-2000:]
    r = rollart("sft", "quickstart", "--data", "d.jsonl", "--eval", "2", "--eval-sampled", "-1",
                cwd=tmp_path)
    assert r.returncode == 2 and "--eval-sampled must be >= 0" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def _rl_config(cwd: Path, init_from: str) -> Path:
    raw = yaml.safe_load((cwd / "runs" / "qs-sft" / "config.yaml").read_text())  # quickstart
    raw["run"] = "rl"
    raw["trainer"].update(init_from=init_from, eval_groups=1)
    p = cwd / "rl.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


def test_rl_run_with_init_from_starts_from_the_sft_weights(sft_run):
    """`trainer.init_from` is the model folder of every role: the trainer's initial weights
    digest is the SFT model's; generators and EnvManagers load that folder; a real run's
    first step samples like the SFT policy (random init: ~1% success) with importance weights
    of 1 (trainer and generators hold the same weights); a folder without a model is a
    ConfigError naming the key, before the run starts."""
    from safetensors.torch import load_file

    from rollart.actors.env.manager import EnvManager
    from rollart.actors.generate.proxy import LLMProxy
    from rollart.actors.trainer.actor import Trainer
    from rollart.config import ActorConfig, ConfigError, RunConfig, load
    from rollart.engines.provision import model_dir
    from rollart.engines.torch_trainer import tensors_digest

    cwd = sft_run.parents[1]
    summary = json.loads((sft_run / "summary.json").read_text())
    cfg = load(_rl_config(cwd, str(sft_run)), RunConfig)
    assert model_dir(cfg) == sft_run / "model"
    trainer = Trainer.from_config(cfg, ActorConfig(), pool="default")
    backend = trainer.build_backend()
    assert backend.weights_digest() == summary["weights_digest"]
    assert tensors_digest(load_file(sft_run / "model" / "model.safetensors")) == summary["weights_digest"]
    for actor in (LLMProxy, EnvManager):
        assert actor.from_config(cfg, ActorConfig(), pool="default").model_dir == str(sft_run / "model")

    cfg_path = _rl_config(cwd, "runs/nothing-here")
    with pytest.raises(ConfigError, match="trainer.init_from"):
        model_dir(load(cfg_path, RunConfig))
    r = rollart("run", str(cfg_path), "--nats", "memory", "--quiet", cwd=cwd)
    assert r.returncode == 2 and "trainer.init_from: 'runs/nothing-here' does not exist" in r.stderr
    assert not (cwd / "runs" / "rl").exists()

    # the command line's --init-from, on a config without it: one real step
    plain = yaml.safe_load(cfg_path.read_text())
    del plain["trainer"]["init_from"]
    cfg_path.write_text(yaml.safe_dump(plain, sort_keys=False))
    _ok(rollart("run", str(cfg_path), "--init-from", "runs/qs-sft", "--steps", "1", "--nats", "memory",
                "--quiet", cwd=cwd))
    run = cwd / "runs" / "rl"
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["init_from"] == "runs/qs-sft"
    (step1,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert step1["success"] > 0.3, step1  # the SFT policy's samples
    assert abs(step1["is_weight_mean"] - 1.0) < 1e-3, step1  # the same weights on both sides
