"""EnvManager: owns one environment for one trajectory, from reset to ``rollout.completed``.

A request from the work queue is acked only after its outcome (completed or cancelled)
is stored; the runtime's ``in_progress`` heartbeats hold it while it runs, and a crash
leaves it un-acked for redelivery. Context is kept at token level: prompt and response
ids are appended turn by turn and history is never re-tokenised.

Failure kinds. Permanent failures are dead-lettered at the first delivery with a reason
that starts with a stable kind token: ``env_setup:`` (the env cannot be built),
``env_contract:`` (reset/step returned the wrong shape), ``env_reset_failed:`` (every
reset attempt raised), ``service_error:`` / ``decode:`` (generate or reward answered errors
or garbage), ``config:``. Missing or lost generate/reward replicas are waited for (see
:mod:`rollart.actors.kernel.service_client`) up to ``rollout.service_wait``, then
``service_unavailable:``. A sandbox that fails under an env's reset or step or an agent
(:class:`~rollart.sandbox.SandboxError`: it could not start, it died, it stopped answering)
is the host's failure, never the policy's nor the env's: counted (``sandbox_failures``),
never scored, the trajectory delivered again after a backoff (a fresh sandbox, maybe on
another host), and ``sandbox_unavailable:`` once the handler's ``max_deliver`` deliveries
all failed so (:mod:`rollart.actors.kernel.sandboxes`).

Sandboxes: the EnvManager holds its process's sandbox pool (``sandbox:``) from ``setup`` to
``teardown`` and keeps it warm when one of its envs declares ``uses_sandbox = True``.

The turn loop is here; what it works on (the token-level :class:`Trace`, the running
trajectories, the reset with retries) is in :mod:`rollart.actors.env.trajectory`. An agent
env's loop (:mod:`rollart.actors.env.agent_loop`) uses only the public methods of
:class:`~rollart.actors.env.host.TrajectoryHost`, which the EnvManager implements
(``generate``, ``score``, ``count``, ``agent_endpoint``).

Kept whole (~560 lines): the turn loop, its request handler and the two service calls of a
turn share the actor's state; what needs none of it is already in :mod:`.trajectory`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollart import messages as m
from rollart import sandbox
from rollart.actors.kernel.base import Actor, Reject, Retry, consume, replica_suffix
from rollart.actors.kernel.cancelled import CancelledGroups
from rollart.actors.env.chat import ChatFormat
from rollart.actors.env.lockstep import LockStep, WaveIncomplete
from rollart.actors.kernel.payloads import TRAJ_STORE_MAX_BYTES, inline_limit
from rollart.actors.kernel.policy import current_policy
from rollart.actors.kernel.policy_gate import PolicyGate, follow_policy
from rollart.actors.kernel.runtime import decode_core
from rollart.actors.kernel.service_client import ServiceClient
from rollart.actors.env.trajectory import (Cancelled, Deliveries, RunningTrajectories, Trace,
                                       reset_runner, reward_request, unless_cancelled)
from rollart.actors.env.agent_loop import run_agent_trajectory
from rollart.actors.kernel.sandboxes import (after_sandbox_failure, env_types_use_sandbox,
                                             heartbeat_stats, sandbox_failure)
from rollart.agents.threads import AgentThreads
from rollart.bus import BusError, DuplicateConflict, Subscription
from rollart.bus.codec import DecodeError
from rollart.config import ActorConfig, RolloutConfig, RunConfig, SandboxConfig
from rollart.config.placement import Router, mapped_pools
from rollart.envs import EnvTimeout, parse_action
from rollart.envs.agent_type import is_agent
from rollart.engines.capacity import check_context
from rollart.engines.provision import model_dir
from rollart.envs.runner import EnvContractError, EnvSetupError
from rollart.telemetry import otel_metrics, tracing

log = logging.getLogger(__name__)

OUTCOME_PUBLISH_S = 120.0
"""Seconds a trajectory's outcome is published again after bus errors (the delivery is kept
in progress meanwhile) before the handler fails and the request is redelivered."""


@dataclass(kw_only=True, eq=False)
class EnvManager(Actor):
    role = "env"
    envs: dict[str, Any]
    """Env name -> :class:`rollart.config.EnvConfig`."""
    rollout: RolloutConfig
    model_dir: str
    """Folder of the tokenizer (chat template)."""
    stats: dict[str, int] = field(default_factory=dict)
    wave_fill_timeout: float = 30.0
    """Batch mode: seconds a wave may take to gather all its trajectories here (while there
    is room for them) before its members are dead-lettered as split between EnvManagers."""
    router: Router | None = None
    """Picks the generation pool of each turn (the config's ``route``, see
    :mod:`rollart.config.placement`); None: every turn goes to this actor's own pool."""
    reward_pool: str | None = None
    """Pool of the reward service (``mapping.reward``); None: this actor's own pool."""
    store_ttl: float = 0.0
    """Seconds the run's trajectory object store keeps a completion too large for one
    message (``node.events_max_age``: as long as the events stream keeps its reference)."""
    store_max_bytes: int = TRAJ_STORE_MAX_BYTES
    """Bytes that store may hold (``node.traj_store_max_bytes``)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The sandboxes of this host's envs and agents (the run's ``sandbox:``)."""

    # -- state made by setup() (and by the handlers) ---------------------------------
    chat: ChatFormat = field(default=None, init=False, repr=False)
    """The model's chat template and tokenizer."""
    version: int = field(default=0, init=False)
    """The newest policy version this EnvManager believes."""
    gate: PolicyGate | None = field(default=None, init=False, repr=False)
    """Which policy records this EnvManager believes (its version bounds the
    ``min_version`` of its generate requests); None before :meth:`setup`."""
    cancelled: CancelledGroups = field(default_factory=CancelledGroups, init=False, repr=False)
    """Cancelled groups (``rollout.cancel``), for their requests still to come."""
    _running: RunningTrajectories = field(default_factory=RunningTrajectories, init=False,
                                          repr=False)
    """The trajectories running here, each with its group and cancel event."""
    _deliveries: Deliveries = field(default_factory=Deliveries, init=False, repr=False)
    """Trajectories running here or recently ended: another delivery is not run again."""
    _in_wave: set[str] = field(default_factory=set, init=False, repr=False)
    """Batch mode: the running trajectories that joined a lock-step wave."""
    _max_inflight: int = field(default=0, init=False, repr=False)
    lockstep: LockStep = field(default=None, init=False, repr=False)
    services: ServiceClient = field(default=None, init=False, repr=False)
    """Calls of the generate and reward services."""
    _trace_heads: dict[str, dict[str, str]] = field(default_factory=dict, init=False, repr=False)
    """Tracing on: traj_id -> the ``traceparent`` of its finished ``trajectory`` span."""
    _action_ids: dict[tuple[str, ...], list[list[int]]] = field(
        default_factory=dict, init=False, repr=False)
    """Token ids of each set of legal actions seen (:meth:`_encode_actions`)."""
    _cancel_sub: Subscription | None = field(default=None, init=False, repr=False)
    _holds_sandboxes: bool = field(default=False, init=False, repr=False)
    _agents: Any = field(default=None, init=False, repr=False)
    """The OpenAI-compatible endpoint of agent envs (:mod:`rollart.agents`), started when
    the first agent trajectory runs here."""
    _agents_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    agent_threads: AgentThreads = field(default=None, init=False, repr=False)
    """The threads plain ``def`` agents run on (``rollout.agent_threads``), this actor's own:
    none of them ever waits behind asyncio's default executor or holds it."""
    prompt_threads: AgentThreads = field(default=None, init=False, repr=False)
    """One thread that tokenises an agent's long request off the event loop."""

    @property
    def running(self) -> RunningTrajectories:
        """The trajectories running here now (``len``, ``in`` and iteration over traj ids)."""
        return self._running

    @classmethod
    def from_config(cls, run_cfg: RunConfig, actor_cfg: ActorConfig, *, pool: str,
                    index: int = 0) -> "EnvManager":
        r = run_cfg.rollout
        placed: dict[str, Any] = {}
        if run_cfg.pools:  # the config maps roles to pools: route turns, send rewards there
            placed = {"router": Router(run_cfg.route,
                                       default_pool=mapped_pools(run_cfg.mapping, "generate")[0]),
                      # its own pool when that one serves rewards too (an env pool with its
                      # reward service on the same hosts), else the first reward pool
                      "reward_pool": pool if pool in (rp := mapped_pools(run_cfg.mapping, "reward"))
                      else rp[0]}
        folder = model_dir(run_cfg)
        check_context(run_cfg, folder)  # a trajectory must fit what the engine holds
        return cls.configured(
            actor_cfg, {"run": run_cfg.run, "pool": pool,
                        "name": f"env-{pool}-{replica_suffix()}-{index}",
                        "envs": dict(run_cfg.envs), "rollout": r, "model_dir": str(folder),
                        "store_ttl": run_cfg.node.events_max_age,
                        "store_max_bytes": run_cfg.node.traj_store_max_bytes,
                        "sandbox": run_cfg.sandbox, **placed},
            handlers={"on_request": {"max_inflight": r.concurrency, "ack_wait": r.ack_wait}})

    async def setup(self) -> None:
        self.chat = await asyncio.to_thread(ChatFormat.load, self.model_dir)
        self.gate = PolicyGate()
        self._max_inflight = self.settings_of("on_request").max_inflight
        self.agent_threads = AgentThreads(self.rollout.agent_threads or self._max_inflight,
                                          name=f"{self.name}-agent")
        self.prompt_threads = AgentThreads(1, name=f"{self.name}-prompts")
        self.lockstep = LockStep(fill_timeout=self.wave_fill_timeout,
                                 room=lambda: self._max_inflight - len(self._running))
        r = self.rollout
        self.services = ServiceClient(self, timeout=r.generate_timeout, wait=r.service_wait,
                                      retries=r.generate_retries,
                                      replica_timeout=r.replica_timeout, count=self.count,
                                      local=r.local_calls)
        await self.services.start()
        self._cancel_sub = await self.bus.subscribe(self.subject("rollout.cancel"), self._on_cancel)
        # the process's sandbox pool, warm when an env declares sandboxes (importing the env
        # types to ask them, and a pool of another config closed, block: off the loop)
        await asyncio.to_thread(self._hold_sandboxes)

    def _hold_sandboxes(self) -> None:
        declared = env_types_use_sandbox(sorted({c.type for c in self.envs.values()}))
        sandbox.hold(self.sandbox, warm=bool(declared))
        self._holds_sandboxes = True
        if declared:
            log.info("%s: keeping %d sandboxes warm (%s backend) for %s", self.name,
                     self.sandbox.warm, self.sandbox.backend, ", ".join(declared))

    async def teardown(self) -> None:
        await self._cancel_sub.unsubscribe()
        if self._agents is not None:
            await self._agents.stop()
        self.agent_threads.close()  # agents stuck in user code are daemons: not waited for
        self.prompt_threads.close()
        await self.services.stop()
        if self._holds_sandboxes:  # the consumers drained: the last holder kills them all
            self._holds_sandboxes = False
            await asyncio.to_thread(sandbox.let_go)

    def node_stats(self) -> dict[str, float]:
        """For the node's heartbeat: the sandbox pool and this EnvManager's failures."""
        return heartbeat_stats(self.name, self.stats.get("sandbox_failures", 0))

    async def agent_endpoint(self) -> Any:
        """The agents' endpoint (:class:`rollart.agents.endpoint.AgentEndpoint`), started on
        first use; ``rollout.agent_host`` is where it listens."""
        async with self._agents_lock:
            if self._agents is None:
                # deferred: only agent envs need the endpoint and its web server (starlette,
                # uvicorn), imported by the first agent trajectory here
                from rollart.agents.endpoint import AgentEndpoint

                r = self.rollout
                endpoint = AgentEndpoint(
                    host=r.agent_host, max_connections=r.agent_max_connections
                    or 4 * self._max_inflight + 64, request_timeout=r.agent_request_timeout,
                    max_request_bytes=r.agent_max_request_bytes)
                await endpoint.start()
                self._agents = endpoint
        return self._agents

    async def main(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.services.run())
            tg.create_task(self._watch_policy())

    async def _watch_policy(self) -> None:
        async def accepted(pub: m.PolicyPublished) -> None:
            self.version = max(self.version, pub.version)

        await follow_policy(self, self.gate, accepted, announcements=True)

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to one of the counters in ``stats`` (:class:`~.host.TrajectoryHost`)."""
        self.stats[key] = self.stats.get(key, 0) + n

    async def _on_cancel(self, req) -> None:
        cmd = decode_core(m.CancelGroup, req)
        if cmd is None:  # junk on a core subject: counted and dropped
            return
        self._running.cancel_group(cmd.group_id, self.cancelled.add(cmd.group_id, cmd.keep))

    async def _check_min_version(self, req: m.RolloutRequested) -> None:
        """Reject a request no policy of this run can serve: its ``min_version`` is beyond
        the published version (read again from KV, the watch may lag) + alpha + 1. Served,
        the generator would wait for a version that never comes, on every delivery."""
        try:
            pub = await current_policy(self.bus, self.run)
        except (BusError, DecodeError) as e:  # cannot tell now: the generator's wait bounds it
            log.debug("%s: policy version unknown (%s)", self.name, e)
            return
        latest = self.version
        if pub is not None:
            latest = max(latest, pub.version)
            if self.gate is None:
                self.version = latest  # else the policy gate decides what is believed
        bound = latest + self.rollout.alpha + 1
        if req.min_version > bound:
            self.count("invalid_requests")
            raise Reject(f"invalid: min_version {req.min_version} is beyond any policy this run "
                         f"can serve (published v{latest}; at most version + alpha + 1 = "
                         f"{bound})")

    # -- the handler -------------------------------------------------------------
    @consume("rollout.requested", ack_wait=30.0, max_deliver=5, max_inflight=64)
    async def on_request(self, req: m.RolloutRequested, delivery) -> None:
        earlier = self._deliveries.earlier(req.traj_id)
        if earlier is not None:  # delivered again while it runs here or once it ended here
            # (ack_wait ran out on a stalled host, or a copy under another msg id)
            self.count("delivered_again")
            if await asyncio.shield(earlier):
                return  # its outcome is stored: this delivery is acked with it
            raise Retry(1.0, f"trajectory {req.traj_id}: its earlier delivery here ended "
                             f"with no outcome stored")
        self._deliveries.begin(req.traj_id)
        stored = False
        try:
            await self._run_request(req, delivery)
            stored = True
        finally:
            self._deliveries.end(req.traj_id, stored)

    async def _run_request(self, req: m.RolloutRequested, delivery) -> None:
        """One delivery of ``req``: the trajectory run and its outcome published (or the
        error that dead-letters it, or has it delivered again)."""
        cfg = self.envs.get(req.env)
        if cfg is None:
            raise Reject(f"env_setup: unknown env {req.env!r}; configured: {sorted(self.envs)}")
        if req.min_version > self.version + self.rollout.alpha + 1:
            await self._check_min_version(req)
        cancel = self._running.start(req.traj_id, req.group_id,
                                     cancelled=self.cancelled.cancels(req.group_id, req.traj_id))
        outcome = "error"  # rollart.trajectories: an error is retried
        try:
            out = await (self._traced(req, cfg, cancel, delivery) if tracing.enabled()
                         else self._trajectory(req, cfg, cancel, delivery))
            outcome = "completed"
        except EnvSetupError as e:  # permanent: dead-letter at once, never re-run
            outcome = "rejected"
            self.count("env_setup_errors")
            raise Reject(f"env_setup: {e}") from e
        except EnvContractError as e:
            outcome = "rejected"
            self.count("env_contract_errors")
            raise Reject(f"env_contract: {e}") from e
        except Reject:
            outcome = "rejected"
            raise
        except asyncio.CancelledError:  # the node stopped: the request is redelivered
            outcome = "interrupted"
            raise
        except Cancelled:
            outcome = "cancelled"
            self.count("cancelled")
            await self.publish_patiently("rollout.cancelled", m.RolloutCancelled(
                traj_id=req.traj_id, group_id=req.group_id, group_index=req.group_index),
                msg_id=f"out:{req.traj_id}", deadline=OUTCOME_PUBLISH_S)
            return
        except Exception as e:  # a sandbox's failure is the host's: again later
            why = sandbox_failure(e)
            if why is None:
                raise
            raise self._sandbox_failed(req, delivery, why) from e
        finally:
            otel_metrics.trajectory(outcome, req.env)
            heads = self._trace_heads.pop(req.traj_id, None)
            self._running.finish(req.traj_id)
            self.services.forget(req.traj_id)  # its turns' replica (rollout.affinity)
            if req.traj_id in self._in_wave:
                self._in_wave.discard(req.traj_id)
                self.lockstep.leave(req.wave_id)
        self.count("completed")
        # A bus error here (a nats-server cluster electing a new stream leader takes seconds)
        # is retried, not raised: a raised one would spend a delivery of a finished trajectory.
        try:
            await self.publish_patiently("rollout.completed", out, msg_id=f"out:{req.traj_id}",
                                         deadline=OUTCOME_PUBLISH_S, headers=heads, once=True,
                                         **self._large())
        except DuplicateConflict as e:
            # Another client published other data under this trajectory's msg id first (a
            # forgery, or a copy from an earlier run of the trajectory): the server's dedupe
            # dropped ours. Publish it under a fresh id; the trainer judges both copies
            # (admission refuses a forged one; two admissible ones are a conflict).
            self.count("msg_id_conflicts")
            log.warning("%s: another client's message holds msg id out:%s (sequence %d); "
                        "publishing %s under a fresh id", self.name, req.traj_id, e.seq, req.traj_id)
            await self.publish_patiently(
                "rollout.completed", out, msg_id=f"out:{req.traj_id}:{uuid.uuid4().hex[:12]}",
                deadline=OUTCOME_PUBLISH_S, headers=heads, **self._large())

    def _sandbox_failed(self, req: m.RolloutRequested, delivery, why: str) -> Exception:
        """A sandbox failed under ``req``'s env or agent: counted, and what to raise."""
        self.count("sandbox_failures")
        return after_sandbox_failure(why, delivery.num_delivered,
                                     self.settings_of("on_request").max_deliver,
                                     what=f"{self.name}: {req.traj_id}")

    def _large(self) -> dict[str, Any]:
        """How a completion too large for one message is published: through the run's
        trajectory object store (:mod:`rollart.actors.kernel.payloads`)."""
        return {"inline_max": inline_limit(self.bus, self.rollout.inline_max_bytes),
                "store_ttl": self.store_ttl, "store_max_bytes": self.store_max_bytes}

    async def _traced(self, req: m.RolloutRequested, cfg: Any, cancel: asyncio.Event,
                      delivery) -> m.RolloutCompleted:
        """:meth:`_trajectory` in a ``trajectory`` span (tracing on), a child of the
        scheduler's span when the request's headers carry one."""
        parent = delivery.headers if tracing.TRACEPARENT in (delivery.headers or {}) else None
        stored = getattr(delivery, "stored_at", 0.0)
        waited = max(0.0, time.time() - stored) if stored else 0.0
        with tracing.span("trajectory", {"traj_id": req.traj_id, "group_id": req.group_id,
                                         "env": req.env, "queue_wait_s": waited,
                                         "delivery": delivery.num_delivered}, parent=parent) as sp:
            outcome = "error"
            try:
                out = await self._trajectory(req, cfg, cancel, delivery)
                outcome = "completed"
                sp.set_attribute("reward", out.reward)
                sp.set_attribute("stop_reason", out.stop_reason)
                self._trace_heads[req.traj_id] = tracing.headers() or {}
                return out
            except Cancelled:
                outcome = "cancelled"
                raise
            except Reject:
                outcome = "rejected"
                raise
            finally:
                sp.set_attribute("outcome", outcome)

    async def _trajectory(self, req: m.RolloutRequested, cfg: Any, cancel: asyncio.Event,
                          delivery) -> m.RolloutCompleted:
        if is_agent(cfg.type):  # the user's agent drives it, through the endpoint
            return await run_agent_trajectory(self, req, cfg, cancel, delivery)
        tr = Trace()
        if req.wave >= 0 and req.wave_size > 0:
            if req.wave_size > self._max_inflight:
                raise Reject(f"config: batch mode needs rollout.concurrency >= {req.wave_size} "
                             f"(the trajectories of one wave) on one EnvManager")
            if self.lockstep.join(req.wave_id, req.wave_size, redelivered=delivery.num_delivered > 1):
                self._in_wave.add(req.traj_id)
        with tracing.span("env.reset"):
            runner, obs, info = await reset_runner(req, cfg, tr, name=self.name, count=self.count)
        reset_info = dict(info)
        reward, success, stop, text = 0.0, False, "max_turns", ""
        cap = cfg.max_trajectory_s if cfg.max_trajectory_s is not None else self.rollout.max_trajectory_s
        deadline = time.monotonic() + cap if cap is not None else None
        try:
            instruction = cfg.instruction if cfg.instruction is not None else runner.instruction
            tr.add_prompt(self.chat.first_prompt(instruction, self._user(cfg, obs, 1)))
            for turn in range(1, cfg.max_turns + 1):
                if cancel.is_set():
                    raise Cancelled()
                if len(tr.token_ids) >= cfg.max_context_tokens:
                    stop = "max_context"
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    stop = "max_time"
                    break
                await self._sync(req, tr)
                legal = runner.legal_actions() if cfg.constrain else None
                res, choices, pool, route = await unless_cancelled(
                    self.generate(req, cfg, tr, legal, turn), cancel)
                start = len(tr.token_ids)
                tr.add_response(res.token_ids, res.logprobs, res.version)
                if len(res.token_versions) == len(res.token_ids) > 0:  # an interrupted turn:
                    tr.versions[start:] = res.token_versions  # each token's own version
                text = self.chat.decode(res.token_ids)
                action = text.strip() if legal else parse_action(text, cfg.action_pattern)
                format_ok = action is not None
                if not format_ok:
                    reward += cfg.format_penalty
                await self._sync(req, tr)
                t0 = time.perf_counter()
                step_timeout, capped = cfg.step_timeout, False
                if deadline is not None and deadline - time.monotonic() < step_timeout:
                    step_timeout, capped = max(0.001, deadline - time.monotonic()), True
                try:
                    with tracing.span("env.step", {"turn": turn}):
                        obs, r, term, trunc, info = await runner.step(
                            action if format_ok else text, timeout=step_timeout)
                except EnvTimeout:
                    stop = "max_time" if capped else "env_timeout"
                    break
                finally:
                    tr.timings["step"] += time.perf_counter() - t0
                reward += float(r)
                success = bool(info.get("success", success))
                tr.turns.append(m.TurnRecord(start=start, response_len=len(res.token_ids),
                                             version=res.version, action=action or text[:64],
                                             reward=float(r), format_ok=format_ok,
                                             choices=choices, pool=pool, route=route))
                if term or trunc:
                    stop = "terminated" if term else "truncated"
                    break
                if turn < cfg.max_turns:
                    tr.add_prompt(self.chat.next_prompt(res.token_ids, self._user(cfg, obs, turn + 1)))
            if cfg.scorer:
                reward, success = await unless_cancelled(
                    self.score(req, cfg, tr, {**reset_info, **info}, text), cancel)
        finally:
            await runner.close()
        if stop == "max_time":
            self.count("max_time")
        return tr.completed(req, reward=reward, success=success, stop=stop,
                            attempt=delivery.num_delivered, version=self.version)

    def _encode_actions(self, legal: tuple[str, ...]) -> list[list[int]]:
        """Token ids of each legal action, cached (the same few sets recur every turn)."""
        cache = self._action_ids
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
        try:
            await self.lockstep.arrive(req.wave_id)
        except WaveIncomplete as e:  # split between EnvManagers: it would wait for ever
            raise Reject(f"config: batch mode: {e} ({self.name})") from None
        tr.timings["wait"] += time.perf_counter() - t0

    async def generate(self, req: m.RolloutRequested, cfg: Any, tr: Trace,
                       legal: list[str] | None, turn: int = 1, *,
                       max_new_tokens: int | None = None,
                       ) -> tuple[m.GenerateResult, list[list[int]], str, int]:
        """One turn's generation: ``(result, choices, pool it was sent to, route index)``;
        the router (if any) picks the pool from the prompt so far, the turn and the env.
        ``max_new_tokens`` (at most the env's) is an agent's own limit."""
        s = cfg.sampling
        cap = s.max_new_tokens if max_new_tokens is None else min(max_new_tokens, s.max_new_tokens)
        pool, route = self.pool, -1
        if self.router is not None:
            pool, route = self.router.pick(prompt_tokens=len(tr.token_ids), turn=turn, env=req.env)
        choices = self._encode_actions(tuple(legal)) if legal else []
        gen = m.GenerateRequest(
            traj_id=req.traj_id, prompt_ids=tr.token_ids,
            sampling=m.SamplingParams(max_new_tokens=cap, temperature=s.temperature,
                                      top_p=s.top_p),
            choices=choices,
            min_version=max(req.min_version, self.version - self.rollout.alpha),
            greedy=req.greedy)
        t0 = time.perf_counter()
        try:
            with tracing.span("generate", {"turn": turn, "pool": pool, "route": route,
                                           "prompt_tokens": len(tr.token_ids)}) as sp:
                res = await self.services.call(
                    "generate.request", gen, pool=pool, what=f" for {req.traj_id}",
                    affinity=req.traj_id if self.rollout.affinity else None)
                if sp is not None:
                    sp.set_attribute("version", res.version)
            return res, choices, pool, route
        finally:
            tr.timings["generate"] += time.perf_counter() - t0

    async def score(self, req: m.RolloutRequested, cfg: Any, tr: Trace, info: dict,
                    text: str) -> tuple[float, bool]:
        """The env's scorer on the last reply ``text`` (a reward service call):
        ``(reward, success)``."""
        request = reward_request(req, cfg, info, text)
        t0 = time.perf_counter()
        try:
            with tracing.span("reward"):
                res = await self.services.call("reward.request", request, pool=self.reward_pool,
                                               what=f" for {req.traj_id}")
        finally:
            tr.timings["reward"] += time.perf_counter() - t0
        return res.score, res.score >= 0.99
