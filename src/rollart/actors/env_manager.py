"""EnvManager: owns one environment for one trajectory, from reset to ``rollout.completed``.

A request from the work queue is acked only after its outcome (completed or cancelled)
is stored; the runtime's ``in_progress`` heartbeats hold it while it runs, and a crash
leaves it un-acked for redelivery. Context is kept at token level: prompt and response
ids are appended turn by turn and history is never re-tokenised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rollart import messages as m
from rollart.actors.base import Actor, Reject, RemoteError, consume, serve  # noqa: F401
from rollart.actors.chat import ChatFormat
from rollart.actors.lockstep import LockStep
from rollart.actors.policy import watch_policy
from rollart.actors.runtime import backoff
from rollart.bus import BusError
from rollart.envs import EnvError, EnvRunner, EnvTimeout, parse_action

log = logging.getLogger(__name__)


class Cancelled(Exception):
    """The trajectory's group no longer needs it."""


@dataclass
class Trace:
    """The token-level record of one trajectory as it grows."""

    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[m.TurnRecord] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("reset", "generate", "step", "reward", "wait"), 0.0))

    def add_prompt(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_response(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.token_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs)
        self.versions += [version] * len(ids)


@dataclass(kw_only=True, eq=False)
class EnvManager(Actor):
    role = "env"
    envs: dict[str, Any]
    """Env name -> :class:`rollart.config.EnvConfig`."""
    rollout: Any
    """:class:`rollart.config.RolloutConfig`."""
    model_dir: str
    """Folder of the tokenizer (chat template)."""
    stats: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, run_cfg: Any, actor_cfg: Any, *, pool: str, index: int = 0) -> "EnvManager":
        from rollart.engines.provision import model_dir

        r = run_cfg.rollout
        settings = {"on_request": {"max_inflight": r.concurrency, "ack_wait": r.ack_wait}}
        for h, hc in actor_cfg.handlers.items():
            settings.setdefault(h, {}).update(hc.overrides())
        return cls(run=run_cfg.run, pool=pool, name=f"env-{pool}-{index}", settings=settings,
                   envs=dict(run_cfg.envs), rollout=r, model_dir=str(model_dir(run_cfg)),
                   **actor_cfg.args)

    async def setup(self) -> None:
        self.chat = await asyncio.to_thread(ChatFormat.load, self.model_dir)
        self.version = 0
        self._cancel_groups: dict[str, set[str]] = {}
        self._live: dict[str, asyncio.Event] = {}
        self._group_of: dict[str, str] = {}
        self.lockstep = LockStep()
        self._in_wave: set[str] = set()
        self._max_inflight = self.settings_of("on_request").max_inflight
        self._cancel_sub = await self.bus.subscribe(self.subject("rollout.cancel"), self._on_cancel)

    async def teardown(self) -> None:
        await self._cancel_sub.unsubscribe()

    async def main(self) -> None:
        async for pub in watch_policy(self.bus, self.run):
            self.version = max(self.version, pub.version)

    def _count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    async def _on_cancel(self, req) -> None:
        from rollart.bus.codec import decode

        cmd = decode(m.CancelGroup, req.data)
        keep = set(cmd.keep)
        self._cancel_groups[cmd.group_id] = keep
        for tid, ev in self._live.items():
            if self._group_of.get(tid) == cmd.group_id and tid not in keep:
                ev.set()

    # -- the handler -------------------------------------------------------------
    @consume("rollout.requested", ack_wait=30.0, max_deliver=5, max_inflight=64)
    async def on_request(self, req: m.RolloutRequested, delivery) -> None:
        cfg = self.envs.get(req.env)
        if cfg is None:
            raise Reject(f"unknown env {req.env!r}; configured: {sorted(self.envs)}")
        cancel = asyncio.Event()
        keep = self._cancel_groups.get(req.group_id)
        if keep is not None and req.traj_id not in keep:
            cancel.set()
        self._live[req.traj_id] = cancel
        self._group_of[req.traj_id] = req.group_id
        try:
            out = await self._trajectory(req, cfg, cancel, delivery)
        except Cancelled:
            self._count("cancelled")
            await self.publish("rollout.cancelled", m.RolloutCancelled(
                traj_id=req.traj_id, group_id=req.group_id), msg_id=f"out:{req.traj_id}")
            return
        finally:
            self._live.pop(req.traj_id, None)
            self._group_of.pop(req.traj_id, None)
            if req.traj_id in self._in_wave:
                self._in_wave.discard(req.traj_id)
                self.lockstep.leave(req.wave_id)
        self._count("completed")
        await self.publish("rollout.completed", out, msg_id=f"out:{req.traj_id}")

    async def _trajectory(self, req: m.RolloutRequested, cfg: Any, cancel: asyncio.Event,
                          delivery) -> m.RolloutCompleted:
        tr = Trace()
        if req.wave >= 0 and req.wave_size > 0:
            if req.wave_size > self._max_inflight:
                raise Reject(f"batch mode needs rollout.concurrency >= {req.wave_size} "
                             f"(the trajectories of one wave) on one EnvManager")
            if self.lockstep.join(req.wave_id, req.wave_size):
                self._in_wave.add(req.traj_id)
        runner, obs, info = await self._reset(req, cfg, tr)
        reset_info = dict(info)
        reward, success, stop, text = 0.0, False, "max_turns", ""
        try:
            instruction = cfg.instruction if cfg.instruction is not None else runner.instruction
            tr.add_prompt(self.chat.first_prompt(instruction, self._user(cfg, obs, 1)))
            for turn in range(1, cfg.max_turns + 1):
                if cancel.is_set():
                    raise Cancelled()
                if len(tr.token_ids) >= cfg.max_context_tokens:
                    stop = "max_context"
                    break
                await self._sync(req, tr)
                legal = runner.legal_actions() if cfg.constrain else None
                res, choices = await self._generate(req, cfg, tr, legal)
                start = len(tr.token_ids)
                tr.add_response(res.token_ids, res.logprobs, res.version)
                text = self.chat.decode(res.token_ids)
                action = text.strip() if legal else parse_action(text, cfg.action_pattern)
                format_ok = action is not None
                if not format_ok:
                    reward += cfg.format_penalty
                await self._sync(req, tr)
                t0 = time.perf_counter()
                try:
                    obs, r, term, trunc, info = await runner.step(
                        action if format_ok else text, timeout=cfg.step_timeout)
                except EnvTimeout:
                    stop = "env_timeout"
                    break
                finally:
                    tr.timings["step"] += time.perf_counter() - t0
                reward += float(r)
                success = bool(info.get("success", success))
                tr.turns.append(m.TurnRecord(start=start, response_len=len(res.token_ids),
                                             version=res.version, action=action or text[:64],
                                             reward=float(r), format_ok=format_ok,
                                             choices=choices))
                if term or trunc:
                    stop = "terminated" if term else "truncated"
                    break
                if turn < cfg.max_turns:
                    tr.add_prompt(self.chat.next_prompt(res.token_ids, self._user(cfg, obs, turn + 1)))
            if cfg.scorer:
                reward, success = await self._score(req, cfg, tr, {**reset_info, **info}, text)
        finally:
            await runner.close()
        versions = [v for v in tr.versions if v >= 0] or [self.version]
        return m.RolloutCompleted(
            traj_id=req.traj_id, group_id=req.group_id, env=req.env, seed=req.seed,
            index_in_group=req.index_in_group, token_ids=tr.token_ids, response_mask=tr.mask,
            logprobs=tr.logprobs, token_versions=tr.versions, turns=tr.turns,
            min_version=min(versions), max_version=max(versions), reward=reward, success=success,
            stop_reason=stop, timings=tr.timings, eval=req.eval,
            attempt=delivery.num_delivered, finished_at=time.time(),
            group_index=req.group_index, admitted_version=req.admitted_version)

    def _encode_actions(self, legal: tuple[str, ...]) -> list[list[int]]:
        """Token ids of each legal action, cached (the same few sets recur every turn)."""
        cache = self.__dict__.setdefault("_action_ids", {})
        if legal not in cache:
            if len(cache) > 4096:
                cache.clear()
            cache[legal] = [self.chat.encode(a) for a in legal]
        return [list(x) for x in cache[legal]]

    def _user(self, cfg: Any, obs: str, turn: int) -> str:
        return cfg.turn_template.format(observation=obs, turn=turn)

    async def _sync(self, req: m.RolloutRequested, tr: Trace) -> None:
        """Batch mode: wait for every trajectory of the wave to reach this phase."""
        if req.traj_id not in self._in_wave:
            return
        t0 = time.perf_counter()
        await self.lockstep.arrive(req.wave_id)
        tr.timings["wait"] += time.perf_counter() - t0

    async def _reset(self, req: m.RolloutRequested, cfg: Any, tr: Trace):
        last = ""
        for attempt in range(1, cfg.reset_retries + 2):
            runner = EnvRunner(cfg.type, cfg.args, executor=cfg.executor, timeout=cfg.step_timeout)
            t0 = time.perf_counter()
            try:
                obs, info = await runner.reset(req.seed, timeout=cfg.reset_timeout)
                tr.timings["reset"] += time.perf_counter() - t0
                return runner, obs, info
            except EnvError as e:
                tr.timings["reset"] += time.perf_counter() - t0
                last = str(e)
                self._count("reset_failures")
                await runner.close()
                log.warning("%s reset attempt %d of %s failed: %s", self.name, attempt,
                            req.traj_id, e)
                if attempt <= cfg.reset_retries:
                    await asyncio.sleep(backoff(attempt, base=0.05, cap=2.0))
        raise Reject(f"env_reset_failed after {cfg.reset_retries + 1} attempts: {last}")

    async def _generate(self, req: m.RolloutRequested, cfg: Any, tr: Trace,
                        legal: list[str] | None) -> tuple[m.GenerateResult, list[list[int]]]:
        s = cfg.sampling
        choices = self._encode_actions(tuple(legal)) if legal else []
        gen = m.GenerateRequest(
            traj_id=req.traj_id, prompt_ids=tr.token_ids,
            sampling=m.SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                      top_p=s.top_p),
            choices=choices,
            min_version=max(req.min_version, self.version - self.rollout.alpha),
            greedy=req.greedy)
        t0 = time.perf_counter()
        try:
            for attempt in range(1, self.rollout.generate_retries + 2):
                try:
                    res = await self.request("generate.request", gen,
                                             timeout=self.rollout.generate_timeout)
                    return res, choices
                except (BusError, RemoteError) as e:
                    if attempt > self.rollout.generate_retries:
                        raise
                    log.warning("generate for %s failed (%s); retry %d", req.traj_id, e, attempt)
                    await asyncio.sleep(backoff(attempt))
            raise AssertionError("unreachable")
        finally:
            tr.timings["generate"] += time.perf_counter() - t0

    async def _score(self, req: m.RolloutRequested, cfg: Any, tr: Trace, info: dict, text: str):
        answer = parse_action(text, cfg.action_pattern) or text
        t0 = time.perf_counter()
        try:
            res = await self.request("reward.request", m.RewardRequest(
                traj_id=req.traj_id, scorer=cfg.scorer, response=answer,
                answer=str(info.get("answer", "")),
                metadata={**{k: str(v) for k, v in info.items() if isinstance(v, (str, int, float))},
                          "seed": str(req.seed), "env_type": cfg.type,
                          "env_args": json.dumps(cfg.args, sort_keys=True)}),
                timeout=self.rollout.generate_timeout)
        finally:
            tr.timings["reward"] += time.perf_counter() - t0
        return res.score, res.score >= 0.99
