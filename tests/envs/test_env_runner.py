import asyncio
import os
import threading
import time

import pytest

from rollart.envs import EnvError, EnvRunner, EnvTimeout
from tests.envs.fake_envs import AsyncEchoEnv, EchoEnv, HangEnv
from tests.waiting import until

FAKE = "tests.envs.fake_envs"


def pid_gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Heartbeat:
    """Measures the event loop's responsiveness while something else is awaited."""

    def __init__(self):
        self.beats = []
        self._stop = asyncio.Event()

    async def run(self):
        while not self._stop.is_set():
            self.beats.append(time.monotonic())
            await asyncio.sleep(0.01)

    def max_gap(self):
        self._stop.set()
        return max(b - a for a, b in zip(self.beats, self.beats[1:]))


async def test_thread_mode_runs_frozenlake_off_the_loop():
    async with EnvRunner("frozenlake", {}, timeout=5) as runner:
        obs, info = await runner.reset(0)
        assert obs.startswith("P") and "FrozenLake" in runner.instruction
        assert runner.legal_actions() == ["L", "D", "R", "U"]
        for a in "DDRRD":
            assert (await runner.step(a))[2] is False
        obs, r, term, trunc, info = await runner.step("R")
        assert (r, term, info["success"]) == (1.0, True, True)
    env = EchoEnv()
    runner = EnvRunner.from_env(env)
    _, info = await runner.reset(1)
    assert info["thread"] != threading.get_ident()
    await runner.close()
    assert env.closed


async def test_process_mode_env_lives_in_a_worker():
    runner = EnvRunner(f"{FAKE}:EchoEnv", {"prefix": ">"}, executor="process", timeout=10)
    obs, info = await runner.reset(7)
    assert obs == ">7" and info["pid"] != os.getpid()
    assert runner.instruction == "echo" and runner.legal_actions() == ["a", "stop"]
    assert await runner.step("stop") == (">stop", 0.5, True, False, {"success": True})
    await runner.close()
    await until(lambda: pid_gone(info["pid"]), deadline=30, what="the env worker process to exit")
    with pytest.raises(EnvError, match="closed"):
        await runner.reset(0)


async def test_inline_mode_calls_the_env_on_the_loop_and_reports_a_slow_one(caplog):
    from rollart.envs import inline_backend

    inline_backend._warned.discard(f"{FAKE}:EchoEnv")
    runner = EnvRunner(f"{FAKE}:EchoEnv", {"prefix": ">"}, executor="inline", timeout=10)
    obs, info = await runner.reset(7)
    assert obs == ">7" and info["thread"] == threading.get_ident() and info["pid"] == os.getpid()
    assert runner.instruction == "echo" and runner.legal_actions() == ["a", "stop"]
    assert await runner.step("a") == (">a", 0.5, False, False, {"success": False})
    assert "event loop" not in caplog.text
    with caplog.at_level("WARNING", logger="rollart.envs.inline_backend"):
        await runner.step("slow")  # 0.3 s on the loop: said once
        await runner.step("slow")
    assert caplog.text.count("belongs on executor: thread") == 1, caplog.text
    await runner.close()
    async with EnvRunner("frozenlake", {}, executor="inline", timeout=5) as lake:
        await lake.reset(0)
        for a in "DDRRD":
            assert (await lake.step(a))[2] is False
        assert (await lake.step("R"))[1:3] == (1.0, True)


async def test_async_env_is_awaited_on_the_loop():
    env = AsyncEchoEnv()
    runner = EnvRunner.from_env(env, timeout=5)
    assert await runner.reset(3) == ("3", {})
    assert env.loop_thread == threading.get_ident()
    _, r, term, _, info = await runner.step("x")
    assert (r, term, info["thread"]) == (1.0, True, threading.get_ident())
    with pytest.raises(EnvTimeout):
        await runner.step("hang", timeout=0.2)
    assert runner.broken


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_hanging_env_times_out_without_blocking_the_loop(executor):
    release = threading.Event()
    if executor == "thread":
        runner = EnvRunner.from_env(HangEnv(release=release), timeout=30)
    else:
        runner = EnvRunner(f"{FAKE}:HangEnv", executor="process", timeout=30)
    try:
        obs, _ = await runner.reset(0)
        hb = Heartbeat()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(hb.run())
            t0 = time.monotonic()
            # the step's own timeout ended it, not the runner's (30 s)
            with pytest.raises(EnvTimeout, match=r"step timed out after 0\.4s"):
                await runner.step("x", timeout=0.4)
            elapsed = time.monotonic() - t0
            gap = hb.max_gap()
        assert elapsed >= 0.39
        # a blocked loop would show one gap as long as the whole wait; measured side by side,
        # so a busy machine stretches both
        assert len(hb.beats) >= 5 and gap < elapsed / 2, (gap, elapsed)
        assert runner.broken
        with pytest.raises(EnvError, match="broken"):
            await runner.step("x")
        if executor == "process":
            await until(lambda: pid_gone(int(obs)), deadline=30, what="the env worker process to exit")  # the worker was killed
    finally:
        release.set()
        await runner.close()


@pytest.mark.parametrize("executor", ["thread", "process", "inline"])
async def test_errors_surface_as_env_error(executor):
    runner = EnvRunner(f"{FAKE}:FailingEnv", executor=executor, timeout=10)
    with pytest.raises(EnvError, match="ValueError: kaboom 4") as ei:
        await runner.reset(4)
    assert not isinstance(ei.value, EnvTimeout) and runner.broken is None
    await runner.close()
    runner = EnvRunner("sokoban", {"nope": 1}, executor=executor)
    with pytest.raises(EnvError, match="'nope'"):
        await runner.reset(0)
    assert bool(runner.broken) == (executor == "process")  # that worker has exited
    await runner.close()


async def test_env_raising_timeout_error_is_not_a_runner_timeout():
    runner = EnvRunner(f"{FAKE}:EchoEnv", timeout=10)
    await runner.reset(0)
    with pytest.raises(EnvError, match="env-internal") as ei:
        await runner.step("timeout-error")
    assert not isinstance(ei.value, EnvTimeout) and runner.broken is None
    assert (await runner.step("a"))[0] == "a"
    await runner.close()


async def test_worker_crash_is_env_error():
    runner = EnvRunner(f"{FAKE}:EchoEnv", executor="process", timeout=10)
    await runner.reset(0)
    with pytest.raises(EnvError, match="died"):
        await runner.step("crash")
    assert runner.broken
    with pytest.raises(EnvError, match="broken"):
        await runner.reset(0)
    await runner.close()


async def test_cancelled_call_does_not_leak_a_stale_reply():
    runner = EnvRunner(f"{FAKE}:EchoEnv", executor="process", timeout=10)
    await runner.reset(0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(runner.step("slow"), 0.05)
    assert runner.broken is None
    assert (await runner.step("fast"))[0] == "fast"
    await runner.close()


async def test_misuse():
    with pytest.raises(ValueError, match="executor"):
        EnvRunner("frozenlake", executor="fork")
    runner = EnvRunner("frozenlake")
    with pytest.raises(EnvError, match="before reset"):
        await runner.step("L")
    with pytest.raises(RuntimeError, match="instruction"):
        runner.instruction
    await runner.close()


async def test_a_closed_env_thread_serves_the_next_env_and_a_hung_one_does_not():
    """A healthy env's thread, once closed, is kept idle (renamed) and runs the next env; the
    thread of a timed-out call is abandoned, never handed to another env."""
    from rollart.envs.thread_backend import IDLE_NAME

    first = EnvRunner(f"{FAKE}:EchoEnv", timeout=5)
    _, info = await first.reset(0)
    used = info["thread"]
    await first.close()
    idle = [t for t in threading.enumerate() if t.ident == used]
    assert idle and idle[0].name == IDLE_NAME and idle[0].is_alive()
    second = EnvRunner(f"{FAKE}:EchoEnv", timeout=5)
    _, info = await second.reset(1)
    assert info["thread"] == used and idle[0].name == f"env-{FAKE}:EchoEnv"
    assert (await second.step("a"))[0] == "a"
    await second.close()

    release = threading.Event()
    hung = EnvRunner.from_env(HangEnv(release=release), timeout=0.1)
    try:
        await hung.reset(0)
        hung_thread = [t for t in threading.enumerate() if t.name == "env-HangEnv"]
        assert hung_thread
        with pytest.raises(EnvTimeout):
            await hung.step("a")
        await hung.close()
        third = EnvRunner(f"{FAKE}:EchoEnv", timeout=5)
        _, info = await third.reset(2)
        assert info["thread"] not in {t.ident for t in hung_thread}
        await third.close()
    finally:
        release.set()
