"""A broken env fails ``rollart config``/``run``/``rollout``/``node`` at once, naming the env.

Unit tests call :func:`rollart.envs.check.check_envs`; the CLI tests start real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollart.config import ConfigError, RunConfig, convert
from rollart.envs.check import EnvCheckError, check_envs, check_envs_async

ROOT = Path(__file__).resolve().parents[2]
FAKE = "tests.envs.fake_envs"


def cfg_of(envs: dict | None = None, **top) -> RunConfig:
    data = {"envs": envs if envs is not None else {"main": {"type": "frozenlake"}}, **top}
    return convert(data, RunConfig, source="run.yaml")


def problem(envs: dict, **top) -> str:
    with pytest.raises(EnvCheckError) as ei:
        check_envs(cfg_of(envs, **top))
    return str(ei.value)


# -- what the check finds ----------------------------------------------------------------


def test_good_envs_pass():
    check_envs(cfg_of({"main": {"type": "frozenlake", "args": {"size": 4}},
                       "echo": {"type": f"{FAKE}:EchoEnv", "args": {"prefix": "x"}},
                       "async": {"type": f"{FAKE}:AsyncEchoEnv"},
                       "proc": {"type": f"{FAKE}:EchoEnv", "executor": "process"},
                       "soko": {"type": "sokoban"}}))


def test_unknown_module_names_env_and_module():
    msg = problem({"main": {"type": "my_pkg.envs:Nope"}})
    assert msg.startswith("envs.main.type: cannot import 'my_pkg.envs:Nope': No module named 'my_pkg'"), msg


def test_unknown_class_suggests_a_near_name():
    msg = problem({"main": {"type": f"{FAKE}:EchoEnvv"}})
    assert msg.startswith(f"envs.main.type: cannot import '{FAKE}:EchoEnvv': module '{FAKE}' has "
                          f"no attribute 'EchoEnvv'; did you mean 'EchoEnv'?"), msg


def test_unknown_builtin_short_name():
    msg = problem({"main": {"type": "frozen_lake"}})
    assert msg.startswith("envs.main.type: unknown env type 'frozen_lake'") and "frozenlake" in msg, msg


def test_bad_argument_name():
    msg = problem({"main": {"type": "frozenlake", "args": {"sizee": 4}}})
    assert msg.startswith("envs.main.args: unknown argument 'sizee' for FrozenLakeEnv(size=4, "), msg
    assert "did you mean 'size'?" in msg and "slippery" in msg, msg


def test_missing_required_argument():
    msg = problem({"main": {"type": f"{FAKE}:NeedsArgEnv"}})
    assert msg.startswith("envs.main.args: missing required argument 'level' of NeedsArgEnv(level, "), msg


def test_constructor_raising():
    msg = problem({"main": {"type": f"{FAKE}:RaisingCtorEnv", "args": {"level": 7}}})
    assert msg.startswith(f"envs.main: cannot construct '{FAKE}:RaisingCtorEnv'"), msg
    assert "ValueError: no such level 7" in msg, msg


def test_constructor_invalid_value_of_builtin():
    msg = problem({"main": {"type": "frozenlake", "args": {"max_steps": 0}}})
    assert msg.startswith("envs.main: cannot construct 'frozenlake'") and "max_steps" in msg, msg


def test_not_an_env():
    msg = problem({"main": {"type": f"{FAKE}:NotAnEnv"}})
    assert msg.startswith("envs.main: cannot construct") and "reset() and step()" in msg, msg


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_reset_wrong_shape(executor):
    msg = problem({"main": {"type": f"{FAKE}:BadResetEnv", "executor": executor}})
    assert msg.startswith("envs.main: ") and "reset() must return (observation: str, info: dict)" in msg, msg
    assert "failed 4 times" not in msg  # a contract error is not retried


def test_reset_info_not_a_dict():
    msg = problem({"main": {"type": f"{FAKE}:BadInfoEnv"}})
    assert msg.startswith("envs.main: reset() ") and "info" in msg and "dict" in msg, msg


@pytest.mark.parametrize("env", ["BadStepEnv", "AsyncBadStepEnv"])
def test_step_wrong_shape(env):
    msg = problem({"main": {"type": f"{FAKE}:{env}"}})
    assert msg.startswith("envs.main: step() must return (obs: str, reward, terminated, truncated, info)"), msg


def test_step_wrong_shape_in_a_worker_process():
    msg = problem({"main": {"type": f"{FAKE}:BadStepEnv", "executor": "process"}})
    assert msg.startswith("envs.main: step() must return"), msg


def test_reset_raising_is_retried_then_named():
    msg = problem({"main": {"type": f"{FAKE}:FailingEnv", "reset_retries": 1}})
    assert msg == ("envs.main: reset(0) failed 2 times (1 + envs.main.reset_retries): ValueError: "
                   "kaboom 0; every one of the 4 task seeds checked failed (envs.main.check_seeds)"), msg


def test_flaky_reset_and_flaky_construction_pass():
    check_envs(cfg_of({"main": {"type": f"{FAKE}:FlakyResetEnv", "reset_retries": 2},
                       "ctor": {"type": f"{FAKE}:FlakyCtorEnv", "reset_retries": 2}}))


def test_step_raising():
    msg = problem({"main": {"type": f"{FAKE}:RaisingStepEnv"}})
    assert msg == ("envs.main: step('a') after reset(0) failed: KeyError: 'a'; every one of the 4 "
                   "task seeds checked failed (envs.main.check_seeds)"), msg
    one = problem({"main": {"type": f"{FAKE}:RaisingStepEnv", "check_seeds": 1}})
    assert one == "envs.main: step('a') after reset(0) failed: KeyError: 'a'", one


def test_a_task_that_fails_is_a_warning_not_a_refusal(caplog):
    """An env whose reset raises for one seed in three (a broken task, not a broken env):
    the check warns once with the count and the run may start; a construction or contract
    error still refuses at once."""
    caplog.set_level("WARNING", logger="rollart.envs.check")
    warned = check_envs(cfg_of({"main": {"type": f"{FAKE}:OneInThreeEnv", "reset_retries": 1}}))
    assert warned == ["envs.main: 2 of the 4 task seeds checked failed (first: reset(0) failed 2 "
                      "times (1 + envs.main.reset_retries): RuntimeError: seed 0 cannot be reset); "
                      "the run starts anyway: a trajectory whose task fails is dead-lettered with "
                      "its reason and its group replaced"], warned
    assert warned[0] in caplog.text
    warned = check_envs(cfg_of({"main": {"type": f"{FAKE}:OneInThreeEnv"}}, rollout={"seed": 1}))
    assert len(warned) == 1 and warned[0].startswith(
        "envs.main: 1 of the 4 task seeds checked failed (first: reset(3) failed 4 times "
        "(1 + envs.main.reset_retries): RuntimeError: seed 3 cannot be reset)"), warned
    msg = problem({"main": {"type": f"{FAKE}:OneInThreeEnv", "check_seeds": 1}})
    assert msg.startswith("envs.main: reset(0) failed 4 times"), msg


def test_hanging_reset_and_step_give_up_at_their_timeouts():
    t0 = time.monotonic()
    msg = problem({"r": {"type": f"{FAKE}:HangResetEnv", "reset_timeout": 0.5},
                   "s": {"type": f"{FAKE}:HangStepEnv", "step_timeout": 0.5}}, rollout={"env": "r"})
    assert time.monotonic() - t0 < 10  # the envs are checked concurrently, each under its timeout
    assert msg.startswith("2 env problems:"), msg
    assert "envs.r: reset(0) did not return within 0.5s (envs.r.reset_timeout" in msg, msg
    assert "envs.s: step('a') did not return within 0.5s (envs.s.step_timeout" in msg, msg


def test_check_false_skips_construction_but_not_the_argument_names():
    check_envs(cfg_of({"main": {"type": f"{FAKE}:RaisingCtorEnv", "check": False}}))
    msg = problem({"main": {"type": f"{FAKE}:RaisingCtorEnv", "check": False, "args": {"levl": 1}}})
    assert msg.startswith("envs.main.args: unknown argument 'levl'") and "did you mean 'level'?" in msg, msg


def test_action_pattern_and_turn_template():
    """Both are caught when the config loads, before any env is checked."""
    from rollart.config import ConfigError

    with pytest.raises(ConfigError, match=r"envs\.main\.action_pattern"):
        cfg_of({"main": {"type": "frozenlake", "action_pattern": "(a)(b)"}})
    with pytest.raises(ConfigError, match=r"envs\.main\.turn_template .*\{answer\}|answer"):
        cfg_of({"main": {"type": "frozenlake", "turn_template": "{observation} {answer}"}})


def test_every_failing_env_is_named():
    msg = problem({"main": {"type": "frozenlake"},
                   "a": {"type": "nope.mod:X"},
                   "b": {"type": f"{FAKE}:BadResetEnv"}})
    assert msg.startswith("2 env problems:") and "envs.a.type:" in msg and "envs.b:" in msg, msg


def test_names_selects_envs_and_unknown_names_fail():
    cfg = cfg_of({"main": {"type": "frozenlake"}, "broken": {"type": "nope.mod:X"}})
    check_envs(cfg, ["main"])
    with pytest.raises(EnvCheckError, match=r"envs.other: no such env; configured envs: main, broken"):
        check_envs(cfg, ["other"])


async def test_async_check_keeps_the_loop_free():
    import asyncio

    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    t = asyncio.ensure_future(tick())
    try:
        with pytest.raises(EnvCheckError, match="reset_timeout"):
            await check_envs_async(cfg_of({"main": {"type": f"{FAKE}:HangResetEnv", "reset_timeout": 0.5}}))
    finally:
        t.cancel()
    assert ticks > 10


# -- config-level cross-field checks ----------------------------------------------------------


def test_missing_rollout_env_key():
    with pytest.raises(ConfigError, match=r"rollout.env: 'main' is not a key of envs; allowed: 'lake'"):
        cfg_of({"lake": {"type": "frozenlake"}})
    cfg_of({"lake": {"type": "frozenlake"}}, rollout={"env": "lake"})


def test_no_envs():
    with pytest.raises(ConfigError, match="envs: no environment is configured"):
        cfg_of({})


# -- the commands -------------------------------------------------------------------------------

BAD = {
    "unknown-module": ({"main": {"type": "my_pkg.envs:Nope"}}, {},
                       "envs.main.type: cannot import 'my_pkg.envs:Nope': No module named 'my_pkg'"),
    "unknown-class": ({"main": {"type": f"{FAKE}:Nope"}}, {}, "has no attribute 'Nope'"),
    "bad-arg": ({"main": {"type": "frozenlake", "args": {"sizee": 4}}}, {},
                "envs.main.args: unknown argument 'sizee' for FrozenLakeEnv("),
    "ctor-raises": ({"main": {"type": f"{FAKE}:RaisingCtorEnv"}}, {}, "ValueError: no such level 1"),
    "reset-shape": ({"main": {"type": f"{FAKE}:BadResetEnv"}}, {}, "envs.main: reset() must return"),
    "step-shape": ({"main": {"type": f"{FAKE}:BadStepEnv"}}, {}, "envs.main: step() must return"),
    "no-rollout-env": ({"lake": {"type": "frozenlake"}}, {},
                       "rollout.env: 'main' is not a key of envs"),
    "no-envs": ({}, {}, "envs: no environment is configured"),
}


def write_cfg(tmp_path: Path, envs: dict, **top) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({"run": "chk", "run_dir": str(tmp_path / "runs"), "envs": envs, **top}))
    return p


def rollart(*argv: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("case", list(BAD))
def test_cli_config_fails_naming_the_env(tmp_path, case):
    envs, top, needle = BAD[case]
    r, _ = rollart("-m", "rollart", "config", str(write_cfg(tmp_path, envs, **top)))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "ok" not in r.stdout and needle in r.stderr, r.stderr


@pytest.mark.parametrize("case", list(BAD))
def test_cli_run_fails_fast(tmp_path, case):
    envs, top, needle = BAD[case]
    r, wall = rollart("-m", "rollart", "run", str(write_cfg(tmp_path, envs, **top)), "--quiet")
    assert r.returncode == 2 and needle in r.stderr, (r.stdout, r.stderr)
    assert wall < 30, wall
    assert not (tmp_path / "runs" / "chk").exists()  # nothing started, no run folder to --resume


def test_cli_rollout_and_node_fail_fast(tmp_path):
    cfg = str(write_cfg(tmp_path, {"main": {"type": f"{FAKE}:BadStepEnv"}}))
    r, wall = rollart("-m", "rollart", "rollout", cfg, "--quiet", "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "envs.main: step() must return" in r.stderr and wall < 30, r.stderr
    r, wall = rollart("-m", "rollart.node", "--config", cfg, "--roles", "env", "--pool", "cpu")
    assert r.returncode == 2 and "envs.main: step() must return" in r.stderr and wall < 30, r.stderr
    assert "embedded nats-server" not in r.stdout + r.stderr


def test_cli_config_good_and_skips(tmp_path):
    r, _ = rollart("-m", "rollart", "config", str(ROOT / "configs" / "quickstart.yaml"))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    good = write_cfg(tmp_path, {"main": {"type": f"{FAKE}:EchoEnv", "args": {"prefix": "p"}}})
    r, _ = rollart("-m", "rollart", "config", str(good))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    skipped = write_cfg(tmp_path, {"main": {"type": f"{FAKE}:RaisingCtorEnv", "check": False}})
    r, _ = rollart("-m", "rollart", "config", str(skipped))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    bad = write_cfg(tmp_path, {"main": {"type": "my_pkg.envs:Nope"}})
    r, _ = rollart("-m", "rollart", "config", "--static", str(bad))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
