"""Hung env steps never leak threads without bound (issue 8 item 4).

A thread cannot be killed: a thread-mode step that times out leaves its thread running,
accounted for per env type; once ``max_abandoned_threads`` of them are still running, that
env type fails fast with a permanent ``env_contract`` error naming the fix (the process
executor, where a hung step's worker is killed). A thread whose call returns stops counting.
"""

from __future__ import annotations

import os
import threading

import pytest

from rollart import messages as m
from rollart.envs import EnvRunner, EnvTimeout
from rollart.envs.runner import EnvContractError, abandoned_threads
from tests.envs import fake_envs
from tests.waiting import until

FAKE = "tests.envs.fake_envs"
HANG = f"{FAKE}:ReleasableHangStepEnv"


def env_threads() -> int:
    return sum(t.name.startswith("env-") for t in threading.enumerate())


@pytest.fixture
def hang():
    fake_envs.HANG_RELEASE.clear()
    try:
        yield
    finally:
        fake_envs.HANG_RELEASE.set()  # let every hung step return: its thread exits


async def test_hung_steps_leave_a_bounded_number_of_threads(hang):
    cap, n = 3, 10
    await until(lambda: abandoned_threads(HANG) == 0, what="threads of earlier tests", deadline=30)
    base = env_threads()
    held = EnvRunner(HANG, timeout=0.2, max_abandoned_threads=cap)
    await held.reset(0)  # reset before the cap is reached; its next step comes after
    outcomes = []
    for i in range(n):
        runner = EnvRunner(HANG, timeout=0.2, max_abandoned_threads=cap)
        try:
            await runner.reset(i)
            await runner.step("a")
            outcomes.append("ok")
        except EnvTimeout:
            outcomes.append("timeout")
        except EnvContractError as e:
            outcomes.append("contract")
            assert "steps hang; use executor: process" in str(e) and f"{cap} threads" in str(e)
        finally:
            await runner.close()
        assert env_threads() <= base + cap + 1, outcomes  # + the held runner's idle thread
    assert outcomes == ["timeout"] * cap + ["contract"] * (n - cap)
    assert abandoned_threads(HANG) == cap
    with pytest.raises(EnvContractError, match="steps hang"):  # a live runner's next step too
        await held.step("a")
    await held.close()
    # the hung calls return: their threads exit and stop counting; the env type works again
    fake_envs.HANG_RELEASE.set()
    await until(lambda: abandoned_threads(HANG) == 0 and env_threads() <= base,
                     what="released threads to exit", deadline=30)
    async with EnvRunner(HANG, timeout=5, max_abandoned_threads=cap) as runner:
        await runner.reset(0)
        assert (await runner.step("a"))[0] == "late"


async def test_without_a_cap_each_hung_step_holds_a_thread(hang):
    """What the cap prevents: with none, every timed-out step keeps its thread."""
    await until(lambda: abandoned_threads(HANG) == 0, what="threads of earlier tests", deadline=30)
    # threads, not a count: an idle env thread of an earlier test may still be exiting (a
    # count taken before it did came out one short in CI)
    before = {t for t in threading.enumerate() if t.name.startswith("env-")}
    for i in range(4):
        async with EnvRunner(HANG, timeout=0.1) as runner:
            await runner.reset(i)
            with pytest.raises(EnvTimeout):
                await runner.step("a")
    new = [t for t in threading.enumerate() if t.name.startswith("env-") and t not in before]
    assert abandoned_threads(HANG) == 4 and len(new) == 4, [t.name for t in new]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_process_executor_kills_hung_steps():
    base = env_threads()
    pids = []
    for i in range(3):
        runner = EnvRunner(f"{FAKE}:HangEnv", executor="process", timeout=0.3,
                           max_abandoned_threads=1)
        obs, _ = await runner.reset(i)  # HangEnv's observation is its worker's pid
        pids.append(int(obs))
        with pytest.raises(EnvTimeout):
            await runner.step("a")
        await runner.close()
    await until(lambda: all(_gone(p) for p in pids), what="hung workers to be killed", deadline=30)
    assert env_threads() <= base and abandoned_threads(f"{FAKE}:HangEnv") == 0


async def test_env_manager_dead_letters_once_the_cap_is_reached(memory_bus_only, tiny_model, hang):
    """Through the EnvManager: the first hung steps end their trajectories as env_timeout;
    after the cap, trajectories are dead-lettered at once with the env_contract reason."""
    from rollart.node import Node
    from tests.actors.sample_actors import collect
    from tests.actors.test_env_failures import build, make_cfg, submit

    await until(lambda: abandoned_threads(HANG) == 0, what="threads of earlier tests", deadline=30)
    bus = memory_bus_only
    cfg = make_cfg(tiny_model, {"hang": {"type": HANG, "step_timeout": 0.3, "max_turns": 2,
                                         "max_abandoned_threads": 2}}, concurrency=2)
    env, gen = build(cfg, "env"), build(cfg, "generate")
    base = env_threads()
    async with Node(bus, [env, gen], heartbeat_every=0, grace=1):
        await submit(bus, cfg.run, ["hang"] * 8)
        done = await collect(bus, cfg.run, "rollout.completed", 2, deadline=60)
        dead = await collect(bus, cfg.run, "dead", 4, deadline=60)
        peak = env_threads()
    assert all(d.stop_reason == "env_timeout" for d in done)
    assert dead and all(d.reason.startswith("env_contract: ") and
                        "steps hang; use executor: process" in d.reason for d in dead), dead
    assert abandoned_threads(HANG) <= 2 + 2  # the cap, plus what was running when it was hit
    assert peak <= base + 2 + 2
    assert m.dead_request(dead[0]).env == "hang"
