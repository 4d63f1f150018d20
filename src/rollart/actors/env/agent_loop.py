"""One trajectory driven by a user's agent instead of the EnvManager's turn loop.

An env of type ``agent:pkg.module:function`` names an agent::

    async def run_agent(base_url: str, task: dict) -> float | dict | None

``base_url`` is the trajectory's OpenAI-compatible endpoint (:mod:`rollart.agents.endpoint`;
give it to ``openai.AsyncOpenAI(base_url=..., api_key="-")`` or any OpenAI client);
``task`` is the env's ``args`` plus ``seed``, ``traj_id`` and ``env`` (the env's name). The
agent returns its reward (a number), or ``{"reward": r, "success": bool}``, or None when the
env's ``scorer`` scores the last reply. A plain (not async) function runs on a thread of the
EnvManager's :class:`AgentThreads` (``rollout.agent_threads``), never on asyncio's default
executor: blocking agents there once held every thread that the policy loader, payload
hashing and reward scoring wait for (issue 43).

The trajectory is everything the agent asked its endpoint for (one turn per request, see
:class:`~rollart.agents.conversation.Conversation`), trained like any other. Limits of the
env config apply: ``max_turns`` requests, ``max_context_tokens``, and a deadline of
``max_trajectory_s`` (else ``rollout.max_trajectory_s``, else ``max_turns * step_timeout``):
the agent is stopped (its task cancelled) and the trajectory completes with its turns so far,
reward 0 (or the scorer's), stop reason ``max_turns``, ``max_context`` or ``max_time``.

Failures, as for env trajectories:

- the agent raises ``ConnectionError``/``TimeoutError`` (its tools' network): *transient*,
  the request is redelivered;
- a sandbox fails under it (a :class:`~rollart.sandbox.SandboxError`, even wrapped in
  another exception): the host's failure, counted and retried, ``sandbox_unavailable:``
  at last (:mod:`rollart.actors.kernel.sandboxes`); an agent must let it propagate, not tell
  the model about it;
- it raises anything else: *permanent*, dead-lettered at once as ``agent_error:``;
- it sends a request that breaks the endpoint's contract, returns something that is not a
  reward, or asks nothing: ``agent_contract:``;
- a generation fails (no replica, ``service_unavailable:``...): the agent gets HTTP 503 and
  the trajectory is dead-lettered with the service's reason.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rollart import messages as m
from rollart.actors.kernel.base import Reject
from rollart.actors.env.host import TrajectoryHost
from rollart.actors.kernel.sandboxes import sandbox_failure
from rollart.actors.env.trajectory import Cancelled, Trace, unless_cancelled
from rollart.agents.conversation import CHARS_PER_TOKEN, ContractError, Conversation, text_size
from rollart.agents.endpoint import MODEL_NAME
from rollart.agents.chat_request import EndpointError
from rollart.agents.threads import AgentThreads
from rollart.aio import first_of
from rollart.envs.agent_type import resolve_agent

log = logging.getLogger(__name__)

INLINE_PROMPT_CHARS = 16384
"""A request with more text than this is tokenised on the EnvManager's ``prompt_threads``,
not on its event loop (~20 ms of a fast tokenizer at this size)."""


class AgentTrajectory:
    """One agent trajectory: the endpoint's session (:meth:`complete`) and its record."""

    def __init__(self, mgr: TrajectoryHost, req: m.RolloutRequested, cfg: Any, cancel: asyncio.Event) -> None:
        self.mgr, self.req, self.cfg, self.cancel = mgr, req, cfg, cancel
        self.tr = Trace()
        self.conv = Conversation(mgr.chat)
        self.over = asyncio.Event()
        """Set when the trajectory ended inside the endpoint (``stop`` or ``failure``)."""
        self.stop: str | None = None
        self.failure: str | None = None
        self.last_text = ""
        self._lock = asyncio.Lock()

    def _end(self, *, stop: str | None = None, failure: str | None = None) -> None:
        if not self.over.is_set():
            self.stop, self.failure = stop, failure
            self.over.set()

    def refuse(self, reason: str) -> None:
        self._end(failure=f"agent_contract: request {self.conv.turns + 1}: {reason}")

    async def complete(self, body: dict) -> dict:
        if self.over.is_set():
            raise EndpointError(400, f"this trajectory is over ({self.stop or self.failure})")
        async with self._lock:
            try:
                return await self._complete(body)
            except ContractError as e:
                self._end(failure=f"agent_contract: request {self.conv.turns + 1}: {e}")
                raise EndpointError(400, str(e)) from None

    async def _complete(self, body: dict) -> dict:
        cfg, tr = self.cfg, self.tr
        if body.get("n") not in (None, 1):
            raise ContractError("n must be 1 (one reply per request)")
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ContractError(f"max_tokens must be a positive integer, got {cap!r}")
        choice = body.get("guided_choice")
        if choice is None and isinstance(body.get("structured_outputs"), dict):
            choice = body["structured_outputs"].get("choice")
        if choice is not None and not (isinstance(choice, list) and choice
                                       and all(isinstance(c, str) and c for c in choice)):
            raise ContractError("guided_choice must be a non-empty list of non-empty strings")
        messages, tools = body.get("messages"), body.get("tools")
        turn = self.conv.turns + 1
        if turn > cfg.max_turns:
            self._end(stop="max_turns")
            raise EndpointError(400, f"max_turns ({cfg.max_turns}) reached: this trajectory is over")
        size, most = text_size(messages, tools), cfg.max_context_tokens * CHARS_PER_TOKEN
        if size > most:  # it cannot fit: refused by its size, never tokenised
            self._end(stop="max_context")
            raise EndpointError(400, f"the request's text ({size} characters) is more than "
                                     f"max_context_tokens ({cfg.max_context_tokens}) can hold "
                                     f"(at most {CHARS_PER_TOKEN} characters a token): this "
                                     f"trajectory is over", "context_length_exceeded")
        if size > INLINE_PROMPT_CHARS:
            ids = await self.mgr.prompt_threads.run(self.conv.prompt, messages, tools)
        else:
            ids = self.conv.prompt(messages, tools)
        if len(tr.token_ids) + len(ids) >= cfg.max_context_tokens:
            self._end(stop="max_context")
            raise EndpointError(400, f"the conversation reached max_context_tokens "
                                     f"({cfg.max_context_tokens}): this trajectory is over",
                                "context_length_exceeded")
        tr.add_prompt(ids)
        try:
            res, choices, pool, route = await unless_cancelled(
                self.mgr.generate(self.req, cfg, tr, choice, turn, max_new_tokens=cap), self.cancel)
        except Cancelled:
            self._end(stop="cancelled")
            raise EndpointError(503, "the trajectory was cancelled (its group no longer needs it)",
                                "service_unavailable") from None
        except Reject as e:
            self._end(failure=e.reason)
            raise EndpointError(503, f"generation failed: {e.reason}", "service_unavailable") from None
        start = len(tr.token_ids)
        tr.add_response(res.token_ids, res.logprobs, res.version)
        if len(res.token_versions) == len(res.token_ids) > 0:
            tr.versions[start:] = res.token_versions
        text = self.mgr.chat.decode(res.token_ids)
        self.last_text = text
        reply = self.conv.replied(messages, res.token_ids, text, tools=bool(tools))
        tr.turns.append(m.TurnRecord(start=start, response_len=len(res.token_ids),
                                     version=res.version, action=text[:64], reward=0.0,
                                     format_ok=True, choices=choices, pool=pool, route=route))
        finish = ("tool_calls" if reply.get("tool_calls") else
                  "length" if res.finish_reason == "length" else "stop")
        out: dict[str, Any] = {"index": 0, "message": reply, "finish_reason": finish,
                               "logprobs": None}
        if body.get("logprobs"):
            chat = self.mgr.chat
            out["logprobs"] = {"content": [
                {"token": (t := chat.decode([i], skip_special=False)), "logprob": lp,
                 "bytes": list(t.encode()), "top_logprobs": []}
                for i, lp in zip(res.token_ids, res.logprobs)]}
        resp: dict[str, Any] = {
            "id": f"chatcmpl-{self.req.traj_id}-{turn}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or MODEL_NAME,
            "choices": [out],
            "usage": {"prompt_tokens": start, "completion_tokens": len(res.token_ids),
                      "total_tokens": start + len(res.token_ids)}}
        if body.get("return_token_ids"):
            out["token_ids"] = list(res.token_ids)
            resp["prompt_token_ids"] = tr.token_ids[:start]
        return resp


def _reward_of(result: Any) -> tuple[float | None, bool | None]:
    """``(reward, success)`` of what an agent returned (None: not given)."""
    if result is None:
        return None, None
    if isinstance(result, bool):
        raise Reject(f"agent_contract: the agent returned {result!r}; return a number, "
                     f"{{'reward': ..., 'success': ...}} or None")
    if isinstance(result, (int, float)):
        return float(result), None
    if isinstance(result, dict) and "reward" in result:
        try:
            r = float(result["reward"])
        except (TypeError, ValueError):
            raise Reject(f"agent_contract: the agent's reward {result['reward']!r} is not a "
                         f"number") from None
        s = result.get("success")
        return r, None if s is None else bool(s)
    raise Reject(f"agent_contract: the agent returned {result!r:.100}; return a number, "
                 f"{{'reward': ..., 'success': ...}} or None (the env's scorer scores it)")


async def run_agent_trajectory(mgr: TrajectoryHost, req: m.RolloutRequested, cfg: Any,
                               cancel: asyncio.Event, delivery: Any) -> m.RolloutCompleted:
    """Run ``cfg``'s agent for ``req`` against a fresh base URL of ``mgr``'s endpoint."""
    if req.wave >= 0 and req.wave_size > 0:
        raise Reject("config: batch mode (lock-step waves) cannot drive an agent env")
    try:
        fn = resolve_agent(cfg.type)
    except ValueError as e:
        raise Reject(f"env_setup: {e}") from None
    endpoint = await mgr.agent_endpoint()
    traj = AgentTrajectory(mgr, req, cfg, cancel)
    base_url = endpoint.open(req.traj_id, traj)
    task = {**cfg.args, "seed": req.seed, "traj_id": req.traj_id, "env": req.env}
    cap = cfg.max_trajectory_s if cfg.max_trajectory_s is not None else mgr.rollout.max_trajectory_s
    if cap is None:
        cap = cfg.max_turns * cfg.step_timeout
    t0 = time.perf_counter()
    if inspect.iscoroutinefunction(fn):
        agent = asyncio.ensure_future(fn(base_url, task))
    else:
        agent = asyncio.ensure_future(mgr.agent_threads.run(fn, base_url, task))
    timed_out = False
    try:
        done, _ = await first_of(agent, traj.over.wait(), cancel.wait(), timeout=cap)
        timed_out = not done
    finally:
        endpoint.close(req.traj_id)
    if agent.done() and not agent.cancelled():
        agent.exception()  # retrieved: what it means is decided below
    tr = traj.tr
    tr.timings["step"] = max(0.0, time.perf_counter() - t0 - tr.timings["generate"])
    if cancel.is_set() and not agent.done() or traj.stop == "cancelled":
        raise Cancelled()
    if traj.failure:
        raise Reject(traj.failure)
    reward: float | None = None
    success: bool | None = None
    stop = traj.stop or ("max_time" if timed_out else "terminated")
    if stop == "terminated":
        if agent.cancelled():
            raise Cancelled()
        exc = agent.exception()
        if sandbox_failure(exc) is not None:  # the host's: the EnvManager counts it, retries
            raise exc
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.warning("%s: agent of %s failed (transient, retried): %r", mgr.name, req.traj_id, exc)
            raise exc
        if exc is not None:
            raise Reject(f"agent_error: {type(exc).__name__}: {exc}"[:1000]) from exc
        reward, success = _reward_of(agent.result())
    if not tr.turns and timed_out:
        raise Reject(f"agent_error: TimeoutError: no request to its endpoint within the "
                     f"trajectory's deadline ({cap:g} s: max_trajectory_s)")
    if not tr.turns and stop == "max_context":
        raise Reject(f"agent_contract: the agent's first request is longer than the env's "
                     f"max_context_tokens ({cfg.max_context_tokens})")
    if not tr.turns:
        raise Reject("agent_contract: the agent made no request to its endpoint")
    if cfg.scorer:
        reward, success = await unless_cancelled(mgr.score(req, cfg, tr, {}, traj.last_text), cancel)
    elif reward is None and stop == "terminated":
        raise Reject("agent_contract: the agent returned None and the env has no scorer")
    if stop != "terminated":
        mgr.count(stop)
    reward = reward or 0.0
    if not cfg.scorer:  # the trainer checks a reward against its turns': the last one holds it
        tr.turns[-1] = msgspec.structs.replace(tr.turns[-1], reward=reward)
    return tr.completed(req, reward=reward, success=bool(success if success is not None else reward >= 0.99),
                        stop=stop, attempt=delivery.num_delivered, version=mgr.version)
