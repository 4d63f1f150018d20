"""Agents for the endpoint tests: each talks to its base URL with the real ``openai`` client
(or raw ``httpx`` where the point is a malformed request) and notes what it saw in SEEN."""

from __future__ import annotations

import asyncio

SEEN: dict[str, dict] = {}
"""traj_id -> what the agent saw (replies' token ids, log-probs, texts)."""
TRIES: dict[str, int] = {}


def _client(base_url: str):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)


async def echo_logprobs(base_url: str, task: dict) -> dict:
    """Two free-text turns (the second streamed), with log-probs and token ids asked for."""
    # a fresh record: trajectory ids repeat across tests (g000000-0), and an earlier test's
    # agent may have left its own record under this one in this process
    seen = SEEN[task["traj_id"]] = {"ids": [], "logprobs": [], "prompt_ids": []}
    messages = [{"role": "system", "content": "Say something."}, {"role": "user", "content": "1 + 1"}]
    async with _client(base_url) as client:
        models = await client.models.list()
        seen["models"] = [m.id for m in models.data]
        r = await client.chat.completions.create(
            model="x", messages=messages, max_tokens=5, logprobs=True,
            extra_body={"return_token_ids": True})
        ch = r.choices[0]
        seen["ids"].append(ch.model_extra["token_ids"])
        seen["prompt_ids"].append(r.model_extra["prompt_token_ids"])
        seen["logprobs"].append([t.logprob for t in ch.logprobs.content])
        messages += [{"role": "assistant", "content": ch.message.content},
                     {"role": "user", "content": "and 2 + 2"}]
        stream = await client.chat.completions.create(
            model="x", messages=messages, max_tokens=5, stream=True, logprobs=True)
        text, lps = "", []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.choices and chunk.choices[0].logprobs:
                lps += [t.logprob for t in chunk.choices[0].logprobs.content]
        seen["streamed"] = text
        seen["logprobs"].append(lps)
    return 0.5


async def raises(base_url: str, task: dict) -> float:
    async with _client(base_url) as client:
        await client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raise RuntimeError("the agent's own bug")


async def flaky(base_url: str, task: dict) -> float:
    """Its first attempt at each trajectory fails as a network error would (transient)."""
    n = TRIES[task["traj_id"]] = TRIES.get(task["traj_id"], 0) + 1
    async with _client(base_url) as client:
        await client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    if n == 1:
        raise ConnectionError("the agent's tool server is down")
    return 1.0


async def hangs(base_url: str, task: dict) -> float:
    async with _client(base_url) as client:
        await client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        await asyncio.Event().wait()  # never returns
    return 0.0


async def hangs_at_once(base_url: str, task: dict) -> float:
    await asyncio.Event().wait()  # never asks anything
    return 0.0


async def junk(base_url: str, task: dict) -> float:
    import httpx

    async with httpx.AsyncClient() as http:
        r = await http.post(f"{base_url}/chat/completions", content=b"{not json")
        SEEN[task["traj_id"]] = {"status": r.status_code, "body": r.json()}
    return 0.0


async def rewrites_history(base_url: str, task: dict) -> float:
    messages = [{"role": "user", "content": "hi"}]
    async with _client(base_url) as client:
        r = await client.chat.completions.create(model="x", messages=messages, max_tokens=2)
        messages += [{"role": "assistant", "content": r.choices[0].message.content + " (edited)"},
                     {"role": "user", "content": "again"}]
        try:
            await client.chat.completions.create(model="x", messages=messages, max_tokens=2)
        except Exception as e:
            SEEN[task["traj_id"]] = {"error": type(e).__name__, "status": getattr(e, "status_code", 0)}
            raise
    return 0.0


async def silent(base_url: str, task: dict) -> float:
    return 1.0


async def talks_forever(base_url: str, task: dict) -> float:
    messages = [{"role": "user", "content": "hi"}]
    async with _client(base_url) as client:
        while True:
            r = await client.chat.completions.create(model="x", messages=messages, max_tokens=2)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "more"}]


def sync_agent(base_url: str, task: dict) -> dict:
    """A plain function (runs in a thread) with the sync client."""
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60) as client:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    return {"reward": 1.0, "success": True}
