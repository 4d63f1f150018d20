"""Plain ``def`` agents (issue 43, finding 8): they run on the EnvManager's own bounded pool
of threads, not on asyncio's default executor, which the policy loader, payload hashing and
reward scoring share. Filled by blocking agents (6 threads on a 2-core host), that executor
once starved the generator of its policy load: every request then waited for v1, and a
SIGTERM ended in a SIGKILL, the interpreter joining threads stuck in user code."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rollart.app.run import train
from rollart.config import RunConfig, convert

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

AT_ONCE = 64
"""Agents that must run at the same time (the config's ``rollout.concurrency``)."""
_gate: dict[str, object] = {}


def blocking_agent(base_url: str, task: dict) -> dict:
    """A plain function agent that blocks its thread: the first ``AT_ONCE`` of them meet at a
    barrier (so they must all hold a thread at once), then each asks for one reply with the
    sync client and "runs a tool" (a blocking sleep) before it returns a reward."""
    from openai import OpenAI

    if next(_gate["started"]) < AT_ONCE:
        _gate["barrier"].wait()  # BrokenBarrierError when they cannot all run at once
    with OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60) as client:
        r = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": f"task {task['seed']}"}],
            max_tokens=3)
        time.sleep(0.05)  # a blocking tool call
    return {"reward": float(len(r.choices[0].message.content or "") % 2), "success": False}


@pytest.mark.slow
async def test_64_plain_def_agents_at_once_train_a_run_to_its_end(tmp_path, tiny_model):
    _gate["started"] = itertools.count()
    _gate["barrier"] = threading.Barrier(AT_ONCE, timeout=30)
    cfg = convert({"run": "blocking-agents", "run_dir": str(tmp_path / "runs"),
                   "model": {"path": str(tiny_model)},
                   "envs": {"main": {"type": "agent:tests.agents.test_blocking_agents:blocking_agent",
                                     "max_turns": 2, "check": False}},
                   "rollout": {"group_size": 8, "batch_groups": 8, "alpha": 1,
                               "concurrency": AT_ONCE},
                   "trainer": {"steps": 3, "eval_groups": 1}}, RunConfig)
    summary = await asyncio.wait_for(
        train(cfg, nats="memory", resume=False, quiet=True, single_process=True), 300)
    assert summary["steps"] == 3 and not summary["interrupted"], summary
    assert not _gate["barrier"].broken, "the 64 agents never ran at once"


def test_an_agent_stuck_in_user_code_does_not_hold_the_process_at_exit(tmp_path):
    """The pool's threads are daemons and closing it waits for none of them: a process whose
    agent thread never returns still exits (a thread of asyncio's default executor is joined
    by ``asyncio.run`` for ever, so SIGTERM ended in SIGKILL)."""
    script = textwrap.dedent("""
        import asyncio, threading
        from rollart.agents.threads import AgentThreads

        async def main():
            pool = AgentThreads(2, name="agents")
            stuck = asyncio.ensure_future(pool.run(threading.Event().wait))
            assert await pool.run(lambda: 41 + 1) == 42
            await asyncio.sleep(0)
            stuck.cancel()
            pool.close()
            print("closed", flush=True)

        asyncio.run(main())
    """)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr[-2000:]
    assert time.monotonic() - t0 < 30
