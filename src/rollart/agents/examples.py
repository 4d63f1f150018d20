"""Agents written as a user would write them: against the ``openai`` client, knowing nothing
of rollart but the base URL they are given. ``configs/agent-frozenlake.yaml`` trains
:func:`frozenlake`; the README's "Train your own agent" shows it."""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

from rollart.envs.frozenlake import FrozenLakeEnv

_LAKE_ARGS = ("size", "map", "random_map", "p_frozen", "slippery", "max_steps", "instruction")


_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def openai_client(base_url: str):
    """An ``AsyncOpenAI`` client for one trajectory's ``base_url``: one client per event
    loop, shared (building one costs ~50 ms of CPU, mostly its SSL context, several turns'
    worth), pointed at ``base_url`` with ``with_options`` (~0.2 ms). The openai docs
    recommend reusing a client the same way."""
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
    return client.with_options(base_url=base_url)


async def frozenlake(base_url: str, task: dict) -> dict:
    """Play one FrozenLake episode (the map and limits of ``task``, the env's args) with
    the moves the model picks: each turn the grid as the user message, the reply one of
    the legal moves (vLLM's ``guided_choice``)."""
    client = openai_client(base_url)
    env = FrozenLakeEnv(**{k: v for k, v in task.items() if k in _LAKE_ARGS})
    obs, info = env.reset(task["seed"])
    messages = [{"role": "system", "content": env.instruction},
                {"role": "user", "content": obs}]
    total, done = 0.0, False
    while not done:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=1,
            extra_body={"guided_choice": env.legal_actions()})
        move = reply.choices[0].message.content
        obs, reward, terminated, truncated, info = env.step(move)
        total += reward
        done = terminated or truncated
        messages += [{"role": "assistant", "content": move}, {"role": "user", "content": obs}]
    return {"reward": total, "success": info["success"]}


CALCULATOR = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


async def calculator(base_url: str, task: dict) -> dict:
    """A tool-using agent: asks the model for ``a + b`` with an ``add`` tool, runs the calls
    the model makes (as OpenAI ``tool`` messages) for up to ``task["max_calls"]`` rounds;
    reward 1 when the final answer (or the last tool result it repeats) is right."""
    client = openai_client(base_url)
    a, b = task["seed"] % 10, (task["seed"] // 10) % 10
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the add tool, then answer with the number."},
        {"role": "user", "content": f"{a} + {b} = ?"}]
    answer = ""
    for _ in range(task.get("max_calls", 2)):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=CALCULATOR,
            max_tokens=task.get("max_tokens", 24))
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = msg.content or ""
            break
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) + int(args["b"]))
            except (ValueError, KeyError, TypeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    ok = answer.strip() == str(a + b)
    return {"reward": float(ok), "success": ok}
