"""EnvRunner tells permanent failures (setup, contract) from transient ones."""

from __future__ import annotations

import pytest

from rollart.envs.runner import EnvContractError, EnvError, EnvRunner, EnvSetupError

BROKEN = "tests.actors.broken_envs"


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("type_,args,match", [
    (f"{BROKEN}:CtorFails", {}, "RuntimeError: no licence"),
    ("frozenlake", {"nope": 1}, "'nope'"),
    ("tests.actors.broken_import_env:Env", {}, "rollart_test_package_that_is_not_installed"),
    ("no.such.module:Env", {}, "not found"),
])
async def test_construction_failures_are_setup_errors(executor, type_, args, match):
    runner = EnvRunner(type_, args, executor=executor, timeout=10)
    with pytest.raises(EnvSetupError, match=match):
        await runner.reset(0)
    await runner.close()


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_an_unreachable_sandbox_is_not_a_setup_error(executor):
    runner = EnvRunner(f"{BROKEN}:SandboxAway", executor=executor, timeout=10)
    with pytest.raises(EnvError, match="sandbox pool unreachable") as ei:
        await runner.reset(0)
    assert not isinstance(ei.value, EnvSetupError)
    await runner.close()


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("type_,method,match", [
    ("ObsOnlyReset", "reset", r"reset\(\) must return"),
    ("ShortStep", "step", r"step\(\) must return"),
    ("WordReward", "step", "reward must be a number"),
])
async def test_wrong_shapes_are_contract_errors(executor, type_, method, match):
    runner = EnvRunner(f"{BROKEN}:{type_}", executor=executor, timeout=10)
    try:
        with pytest.raises(EnvContractError, match=match):
            await runner.reset(0)
            await runner.step("L")
    finally:
        await runner.close()


async def test_an_exception_inside_reset_stays_transient():
    runner = EnvRunner("tests.envs.fake_envs:FailingEnv", timeout=10)
    with pytest.raises(EnvError, match="kaboom") as ei:
        await runner.reset(1)
    assert not isinstance(ei.value, (EnvSetupError, EnvContractError))
    await runner.close()
