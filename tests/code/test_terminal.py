"""The terminal agent (:mod:`rollart.code.terminal`) and its generated tasks: real
sandboxes (bubblewrap), the real EnvManager endpoint and ``openai`` client, the tiny model."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from rollart import sandbox
from rollart.code.terminal import MAX_COMMAND, command_of, menu, tool_result
from rollart.code.terminal_tasks import KINDS, LEVELS, make_task, score, setup

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap ('bwrap') is not installed: apt-get install bubblewrap")


@pytest.fixture(autouse=True, scope="module")
def _no_sandbox_left():
    yield
    sandbox.shutdown()  # the process's warm pool the agents used: every sandbox killed


def test_tasks_are_a_function_of_their_seed():
    every = [make_task(s, levels=LEVELS) for s in range(120)]
    assert every == [make_task(s, levels=LEVELS) for s in range(120)]
    assert {(t.kind, t.level) for t in every} == {(k, v) for k in KINDS for v in LEVELS}
    varied = [repr(t.files) for t in every if t.kind != "fix"]  # fix: a handful of faults
    assert len(set(varied)) == len(varied), "seeds give different tasks"
    for t in every:
        if t.kind == "find":  # exactly one file mentions the word, and it is the answer
            word = t.prompt.split("the word ")[1].split("?")[0]
            assert [p for p, c in t.files.items() if word in c.split()] == [t.answer]
        elif t.kind == "count":
            colour = t.prompt.split("colour ")[1].split("?")[0]
            rows = t.files["data.csv"].splitlines()[1:]
            assert t.answer == str(sum(r.split(",")[1] == colour for r in rows)) != "0"
        assert t.answer is None or t.answer in t.answers
    with pytest.raises(ValueError, match="kinds must be among"):
        make_task(0, kinds=["rm -rf"])


def test_malformed_tool_calls_are_the_model_s_mistake():
    def call(name, arguments):
        return SimpleNamespace(id="c", function=SimpleNamespace(name=name, arguments=arguments))

    assert command_of(call("bash", '{"command": "ls -la"}')) == ("ls -la", None)
    for bad, says in [(call("python", '{"command": "ls"}'), "unknown tool"),
                      (call(None, None), "unknown tool"),
                      (SimpleNamespace(id="c"), "unknown tool"),
                      (call("bash", "{not json"), "not JSON"),
                      (call("bash", "[" * 100000), "not JSON"),
                      (call("bash", '["ls"]'), "must be"),
                      (call("bash", '{"command": 3}'), "must be"),
                      (call("bash", '{"command": "  "}'), "empty"),
                      (call("bash", '{"command": "a\\u0000b"}'), "NUL"),
                      (call("bash", '{"command": "%s"}' % ("x" * (MAX_COMMAND + 1))), "at most")]:
        cmd, err = command_of(bad)
        assert cmd is None and err.startswith("error:") and says in err, (bad, err)
    r = sandbox.Result(exit_code=2, stdout=b"x" * 50, stderr=b"boom", wall_s=0, cpu_s=0,
                       stdout_truncated=7)
    assert tool_result(r, limit=40) == ("exit code 2\n" + "x" * 40 + "\n[... 17 more characters "
                                        "truncated]\n[stderr]\nboom")
    r = sandbox.Result(exit_code=-9, stdout=b"", stderr=b"", wall_s=5, cpu_s=0, timed_out=True)
    assert tool_result(r, limit=40) == "exit code -9 (timed out)"


@needs_bwrap
async def test_the_checkers_accept_a_solution_run_in_the_sandbox_and_reject_others():
    """For each kind and level: the task's own helpful command, run in a real sandbox, gives
    the answer the checker accepts; a wrong answer fails; for ``fix`` exactly one menu
    command makes the check pass, and editing check.py does not."""
    seen, faults = set(), set()
    for seed in range(120):
        t = make_task(seed, levels=LEVELS)
        if (t.kind, t.level) in seen and (t.kind != "fix" or repr(t.files) in faults):
            continue  # one of each kind and level, and every fault (there are 8)
        seen.add((t.kind, t.level))
        faults.add(repr(t.files))
        if t.kind != "fix":
            with sandbox.start() as sb:
                await setup(t, sb)
                r = await sb.arun(t.commands[0])
                assert r.exit_code == 0, r
                got = r.text().strip()
                assert await score(t, sb, f"<answer>{got}</answer>"), (t, got)
                assert await score(t, sb, f"./{got} \n") if t.kind == "find" else True
                wrong = next(a for a in t.answers if a != t.answer)
                assert not await score(t, sb, f"<answer>{wrong}</answer>")
                assert not await score(t, sb, "")
            continue
        passing = []
        with sandbox.start() as sb:  # one sandbox per task: its files written afresh per command
            for cmd in t.commands:
                await setup(t, sb)
                before = await sb.arun("python3 check.py")
                assert before.exit_code != 0 and not await score(t, sb, "done")
                await sb.arun(cmd)
                if await score(t, sb, "done"):
                    passing.append(cmd)
                    assert (await sb.arun("python3 check.py")).exit_code == 0
            assert len(passing) == 1 and passing[0].startswith("sed"), (t, passing)
            await setup(t, sb)
            await sb.awrite("check.py", "print('ok')\n")
            assert (await sb.arun("python3 check.py")).exit_code == 0
            assert not await score(t, sb, "done"), "the checker is the task's, not the workspace's"
    assert len(seen) == len(KINDS) * len(LEVELS)
    assert len({f for f in faults if "check.py" in f}) == 8


def test_the_menu_is_tool_calls_then_answers_only():
    t = make_task(3, kinds=["count"])
    first, last = menu(t, 1, 4), menu(t, 4, 4)
    assert len(first) == len(t.commands) + len(t.answers)
    assert all(c.startswith("<tool_call>") for c in first[:len(t.commands)])
    assert last == [f"<answer>{a}</answer>" for a in t.answers]


@needs_bwrap
async def test_the_agent_runs_bash_in_one_sandbox_across_turns(memory_bus_only, tiny_model):
    """The scripted policy (tests/code/terminal_agents.py) through the EnvManager's endpoint
    and the ``openai`` client: a file written in turn 1 is read in turn 4; malformed calls and
    a timed-out command come back as tool results; grep's output leads to the right answer."""
    from tests.agents.test_agent_endpoint import make_cfg
    from tests.code import terminal_agents as ta
    from tests.e2e.test_rollout import run_groups

    cfg = make_cfg(tiny_model, {"type": "agent:tests.code.terminal_agents:scripted",
                                "max_turns": 6, "sampling": {"max_new_tokens": 96}})
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    assert len(sched.results) == 2
    for d in sched.results:
        tools = [m["content"] for m in ta.SEEN[d.traj_id] if m["role"] == "tool"]
        assert len(tools) == 5 and len(d.turns) == 6, tools
        assert tools[0] == "exit code 0"
        assert "unknown tool 'rm'" in tools[1] and "must be" in tools[2]
        assert tools[3].startswith("exit code") and "(timed out)" in tools[3]
        assert "persisted" in tools[3], "the file of turn 1 is there in turn 4"
        assert tools[4].startswith("exit code 0\nnotes/")
        assert d.reward == 1.0 and d.success and d.attempt == 1


@needs_bwrap
async def test_the_packaged_agent_with_free_replies_and_with_its_menu(memory_bus_only, tiny_model):
    """``agent:rollart.code.terminal:terminal`` as configured: free replies (the random model
    writes no command: a wrong answer, reward 0) and the menu (every reply one of the task's
    commands or answers: a tool call runs, each trajectory ends with an answer)."""
    from tests.agents.test_agent_endpoint import make_cfg
    from tests.e2e.test_rollout import run_groups

    free = make_cfg(tiny_model, {"type": "agent:rollart.code.terminal:terminal",
                                 "args": {"max_turns": 2, "max_tokens": 16}, "max_turns": 2})
    sched, _ = await run_groups(memory_bus_only, free, groups=1)
    assert len(sched.results) == 2
    assert all(d.reward == 0.0 and d.stop_reason == "terminated" for d in sched.results)
    menu_cfg = make_cfg(tiny_model, {"type": "agent:rollart.code.terminal:terminal",
                                     "args": {"menu": True, "max_turns": 4, "max_tokens": 96,
                                              "kinds": ["fix"]},
                                     "max_turns": 4, "max_context_tokens": 1900,
                                     "sampling": {"max_new_tokens": 96}}, group_size=8)
    sched, _ = await run_groups(memory_bus_only, menu_cfg, groups=1)
    results = sched.results
    assert len(results) == 8 and all(d.stop_reason == "terminated" for d in results)
    assert any(len(d.turns) > 1 for d in results), "some reply was a tool call"
    assert all(d.turns[-1].action.startswith("<answer>done") for d in results)


@needs_bwrap
async def test_a_dead_sandbox_is_the_host_s_failure_and_retried(memory_bus_only, tiny_model):
    from tests.agents.test_agent_endpoint import make_cfg
    from tests.code import terminal_agents as ta
    from tests.e2e.test_rollout import run_groups

    cfg = make_cfg(tiny_model, {"type": "agent:tests.code.terminal_agents:scripted",
                                "args": {"kill_sandbox": True}, "max_turns": 6,
                                "sampling": {"max_new_tokens": 96}})
    ta.TRIES.clear()  # traj ids repeat from run to run
    sched, _ = await run_groups(memory_bus_only, cfg, groups=1)
    assert len(sched.results) == 2
    for d in sched.results:
        assert ta.TRIES[d.traj_id] == 2 and d.attempt == 2, "retried, not scored"
        assert d.reward == 1.0 and len(d.turns) == 6, "the failed attempt's turns are not kept"
