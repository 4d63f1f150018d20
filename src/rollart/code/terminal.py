"""A terminal agent: written against the ``openai`` client, it gives the model a ``bash``
tool whose calls run in one sandbox for the whole episode, and scores the episode with the
task's checker (:mod:`rollart.code.terminal_tasks`). ``configs/agent-terminal.yaml`` trains it::

    type: agent:rollart.code.terminal:terminal
    args: {kinds: [find, count, fix], levels: [0], menu: true}

One episode: take a sandbox from this process's warm pool (:func:`rollart.sandbox.pool`),
write the task's files, then up to ``max_turns`` requests; each reply's tool calls run as
``/bin/sh -c`` commands in that sandbox (files and the working state persist from turn to
turn; processes do not outlive their command) and come back as ``tool`` messages (exit code,
stdout, stderr, cut at ``max_output_chars`` with a note). A reply without a tool call is the
final answer; the checker decides the reward (1 or 0), in the sandbox where it can.

Whose failure is what:

- the model's: a malformed call (unknown tool, arguments that are not a JSON object with a
  ``command`` string, an empty or oversized command), a command that fails, times out or
  hits a limit. Each is a tool result the model reads on its next turn, never an exception;
- the host's: :class:`~rollart.sandbox.SandboxError` (the sandbox could not start or died).
  It propagates out of the agent: a ``ConnectionError``, so the EnvManager retries the
  trajectory and never scores it.

``menu: true`` (the tiny-model config) constrains every reply to one of the task's candidate
commands, written as the chat template's tool call, or one of its candidate answers
(vLLM's ``guided_choice``; the last allowed turn offers answers only): the same agent then
runs with a random-init policy, which could not write a command by itself.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from rollart import sandbox
from rollart.agents.examples import openai_client
from rollart.code.terminal_tasks import TerminalTask, make_task, score, setup

BASH = [{"type": "function", "function": {
    "name": "bash",
    "description": "Run a shell command in /workspace and see its exit code and output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]

SYSTEM = ("You are in a Linux shell in /workspace. Use the bash tool to look at the files, "
          "then reply with the final answer as <answer>...</answer>.")

MAX_COMMAND = 16384
"""Characters a command may have (a longer one is the model's mistake, not a sandbox's)."""


def tool_call_text(command: str) -> str:
    """A bash call as the model writes it (the chat template's ``<tool_call>`` form)."""
    return "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command}}) + \
        "</tool_call>"


def menu(task: TerminalTask, turn: int, max_turns: int) -> list[str]:
    """The replies allowed in menu mode: the task's commands as tool calls (not on the last
    turn) and its answers."""
    answers = [f"<answer>{a}</answer>" for a in task.answers]
    return answers if turn >= max_turns else [tool_call_text(c) for c in task.commands] + answers


def command_of(call: Any) -> tuple[str | None, str | None]:
    """``(command, None)`` of a well-formed bash call, else ``(None, error for the model)``.
    Everything in ``call`` came from the model: nothing is trusted."""
    fn = getattr(call, "function", None)
    name = getattr(fn, "name", None)
    if name != "bash":
        return None, f"error: unknown tool {str(name)[:40]!r}; the only tool is bash"
    raw = getattr(fn, "arguments", None)
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except (json.JSONDecodeError, RecursionError) as e:
        return None, f"error: the arguments are not JSON ({e})"
    if not isinstance(args, dict) or not isinstance(args.get("command"), str):
        return None, 'error: the arguments must be {"command": "<shell command>"}'
    cmd = args["command"]
    if not cmd.strip():
        return None, "error: the command is empty"
    if len(cmd) > MAX_COMMAND or "\x00" in cmd:
        return None, f"error: the command must be at most {MAX_COMMAND} characters, without NUL"
    return cmd, None


def _cut(raw: bytes, dropped: int, limit: int) -> str:
    """``raw`` decoded and cut at ``limit`` characters, with a note of what is missing (cut
    here, or ``dropped`` bytes already dropped by the sandbox's output cap)."""
    text = raw.decode("utf-8", "replace")
    more = max(0, len(text) - limit) + dropped
    return text[:limit] + (f"\n[... {more} more characters truncated]" if more else "")


def tool_result(r: sandbox.Result, limit: int) -> str:
    """What the model reads of a command: exit code (and the limit that ended it), stdout
    cut at ``limit`` characters and stderr at half that, each with a note of what was cut."""
    head = f"exit code {r.exit_code}" + (" (timed out)" if r.timed_out else
                                         f" ({r.limit} limit)" if r.limit else "")
    out = [head]
    if r.stdout or r.stdout_truncated:
        out.append(_cut(r.stdout, r.stdout_truncated, limit).rstrip("\n"))
    if r.stderr or r.stderr_truncated:
        out.append("[stderr]\n" + _cut(r.stderr, r.stderr_truncated, max(1, limit // 2)).rstrip("\n"))
    return "\n".join(out)


async def run_episode(client: Any, sb: sandbox.Sandbox, task: TerminalTask, opts: dict, *,
                      choices: Callable[[TerminalTask, int, int], list[str]] | None = None) -> dict:
    """The conversation for ``task`` in ``sb`` (already set up): ``{"reward", "success",
    "commands", "messages"}``. ``choices(task, turn, max_turns)``, when given, is each
    turn's ``guided_choice``."""
    max_turns = int(opts.get("max_turns", 6))
    limit = int(opts.get("max_output_chars", 1000))
    timeout = float(opts.get("command_timeout", 5.0))
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": task.prompt}]
    answer, commands = "", 0
    for turn in range(1, max_turns + 1):
        extra = {"guided_choice": choices(task, turn, max_turns)} if choices else None
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=BASH,
            max_tokens=int(opts.get("max_tokens", 256)), extra_body=extra)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = msg.content or ""
            break
        for call in msg.tool_calls:
            cmd, out = command_of(call)
            if cmd is not None:
                commands += 1
                out = tool_result(await sb.arun(cmd, timeout=timeout), limit)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    ok = await score(task, sb, answer)
    return {"reward": float(ok), "success": ok, "commands": commands, "messages": messages}


async def terminal(base_url: str, task: dict) -> dict:
    """One terminal episode for ``task`` (the env's ``args`` plus ``seed``): ``kinds``,
    ``levels`` pick the generated task; ``menu``, ``max_turns``, ``max_tokens`` (per reply),
    ``max_output_chars`` (of a tool result) and ``command_timeout`` (seconds) bound it."""
    t = make_task(int(task["seed"]), kinds=task.get("kinds", ("find", "count", "fix")),
                  levels=task.get("levels", (0,)))
    async with sandbox.pool().session() as sb:
        await setup(t, sb)
        out = await run_episode(openai_client(base_url), sb, t, task,
                                choices=menu if task.get("menu") else None)
    return {"reward": out["reward"], "success": out["success"]}


terminal.uses_sandbox = True  # type: ignore[attr-defined]
"""Asks the env host for warm sandboxes (the EnvManager keeps ``sandbox.warm`` of them started
for a run whose agent declares it)."""
