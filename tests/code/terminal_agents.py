"""Terminal agents for the tests: the packaged agent's episode (:func:`run_episode`) with a
scripted policy, each turn's ``guided_choice`` a single reply, so the real tiny model, the
real endpoint and the real sandbox play a known conversation. SEEN keeps each trajectory's
messages."""

from __future__ import annotations

from rollart import sandbox
from rollart.agents.examples import openai_client
from rollart.code.terminal import run_episode, tool_call_text
from rollart.code.terminal_tasks import make_task, setup

SEEN: dict[str, list[dict]] = {}
TRIES: dict[str, int] = {}

SCRIPT = (
    tool_call_text("echo persisted > state.txt"),              # turn 1 writes a file
    '<tool_call>{"name": "rm", "arguments": {"command": "ls"}}</tool_call>',    # no such tool
    '<tool_call>{"name": "bash", "arguments": {"cmd": 7}}</tool_call>',        # bad arguments
    tool_call_text("cat state.txt; sleep 5"),                  # turn 4 reads it, times out
    None,                                                      # turn 5: grep's command
    None,                                                      # turn 6: the right answer
)


def _script(task, turn: int, max_turns: int) -> list[str]:
    step = SCRIPT[turn - 1]
    if step is not None:
        return [step]
    return [tool_call_text(task.commands[0])] if turn == 5 else [f"<answer>{task.answer}</answer>"]


async def scripted(base_url: str, task: dict) -> dict:
    """A ``find`` task played by :data:`SCRIPT`; the second attempt of a trajectory whose
    first one met a dead sandbox (``task["kill_sandbox"]``) plays it too."""
    t = make_task(task["seed"], kinds=["find"], levels=[1])
    tries = TRIES[task["traj_id"]] = TRIES.get(task["traj_id"], 0) + 1
    async with sandbox.pool().session() as sb:
        await setup(t, sb)
        if task.get("kill_sandbox") and tries == 1:
            sb.close()  # the host's failure, not the policy's: SandboxError must propagate
        out = await run_episode(openai_client(base_url), sb, t,
                                {"max_turns": len(SCRIPT), "command_timeout": 1.0,
                                 "max_tokens": 96},
                                choices=_script)
    SEEN[task["traj_id"]] = out["messages"]
    return {"reward": out["reward"], "success": out["success"]}
