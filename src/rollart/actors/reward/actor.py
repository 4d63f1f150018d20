"""RewardService: stateless scoring as a request/reply service in a queue group.

Any number of replicas may join or leave at any time (reward as a service). Rule
scorers answer at once; the ``model_logprob`` scorer gathers concurrent requests from
many trajectories into one forward pass of a local causal LM.

A scorer that runs the candidate's code (execution-based: it declares ``uses_sandbox =
True``, see :mod:`rollart.actors.kernel.sandboxes`) takes sandboxes from the process's pool,
which the service holds from ``setup`` to ``teardown``, warm when one of the run's envs
names such a scorer. A sandbox failing under a scorer is this replica's failure, never the
candidate's score: it answers ``unavailable`` (counted in ``sandbox_failures``) and the
requester asks another replica.
"""

from __future__ import annotations

import asyncio
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from rollart import messages as m
from rollart import sandbox
from rollart.actors.kernel.base import Actor, serve
from rollart.actors.kernel.batching import Batcher
from rollart.actors.kernel.sandboxes import declares_sandbox, heartbeat_stats, sandbox_failure
from rollart.actors.kernel.service import ServiceUnavailable
from rollart.actors.kernel.progress import ProgressReporter
from rollart.code.scorer import code_tests
from rollart.config import ActorConfig, RunConfig, SandboxConfig
from rollart.envs.reasoning import ReasoningGymEnv
from rollart.telemetry import otel_metrics

_NUM = re.compile(r"^[-+]?\d+(\.\d+)?([eE][-+]?\d+)?$")


def answer_match(response: str, answer: str, metadata: dict[str, str]) -> float:
    """1.0 if the response equals the answer (numbers compared numerically), else 0.0."""
    a, b = response.strip(), answer.strip()
    if _NUM.match(a) and _NUM.match(b):
        return float(math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9))
    return float(" ".join(a.lower().split()) == " ".join(b.lower().split()))


def reasoning_gym_score(response: str, answer: str, metadata: dict[str, str]) -> float:
    """The reasoning-gym dataset's own scorer, for the task the env served.

    The EnvManager sends ``env_args`` (JSON) and ``seed``: the env is rebuilt with the
    same arguments and reset with the same seed, so the same question is scored.
    """
    if "env_args" not in metadata or "seed" not in metadata:
        raise ValueError("reasoning_gym scorer needs metadata 'env_args' and 'seed'")
    key = metadata["env_args"]
    env = _rg_envs.get(key)
    if env is None:
        args = _rg_args(key)
        if len(_rg_envs) >= 64:  # bounded: the keys come from requests
            _rg_envs.pop(next(iter(_rg_envs)))
        env = _rg_envs[key] = ReasoningGymEnv(**msgspec.structs.asdict(args))
    seed = metadata["seed"]
    if len(seed) > 20 or not seed.lstrip("-").isdigit():
        raise ValueError("reasoning_gym scorer: metadata 'seed' is not an integer")
    env.reset(int(seed))
    _, reward, *_ = env.step(response)
    return float(reward)


_Scalar = (bool | Annotated[int, msgspec.Meta(ge=-10**6, le=10**6)] | float
           | Annotated[str, msgspec.Meta(max_length=256)] | None)
_Knob = _Scalar | Annotated[list[_Scalar], msgspec.Meta(max_length=64)]


class _RGArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The env arguments a reward request may name (they come from another process: a
    ``heldout`` of 10**9 would have the scorer scan 5·10**10 items, so each is bounded)."""

    dataset: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_]{1,64}$")]
    dataset_args: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], _Knob],
                            msgspec.Meta(max_length=32)] | None = None
    size: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 100_000
    heldout: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000
    heldout_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.1
    dataset_seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    success_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.99
    binary: bool = False
    instruction: Annotated[str, msgspec.Meta(max_length=8192)] | None = None


def _rg_args(key: str) -> _RGArgs:
    """``env_args`` decoded typed and bounded; a clear ``ValueError`` names what is wrong."""
    if len(key) > 16384:
        raise ValueError(f"reasoning_gym scorer: env_args is {len(key)} characters (max 16384)")
    try:
        return msgspec.json.decode(key, type=_RGArgs)
    except msgspec.DecodeError as e:
        raise ValueError(f"reasoning_gym scorer: bad env_args: {e}") from None


_rg_envs: dict[str, Any] = {}

RULES = {"answer_match": answer_match, "reasoning_gym": reasoning_gym_score, "code_tests": code_tests}
"""Scorer name -> ``fn(response, answer, metadata) -> score`` (``code_tests``: the response
runs against a code task's tests in this host's sandboxes, :mod:`rollart.code.scorer`)."""
SANDBOXED = {"code_tests"}
"""Rule scorers that wait on sandboxes and keep no unguarded state: ``code_threads`` of them
run at once (a sandboxed run is ~20-50 ms of waiting on a subprocess)."""


@dataclass(kw_only=True, eq=False)
class RewardService(Actor):
    role = "reward"
    model_path: str | None = None
    """Local causal LM for ``model_logprob`` (loaded on first use)."""
    gather_ms: float = 2.0
    max_batch: int = 64
    threads: int | None = 1
    code_threads: int = 4
    """Requests of the :data:`SANDBOXED` scorers scored at once (the other rules: one at a time)."""
    progress_every: float = 1.0
    """Seconds between ``service.progress`` reports (the request ids this replica holds)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The sandboxes of execution-based scorers (the run's ``sandbox:``)."""
    scorers: tuple[str, ...] = ()
    """The scorers the run's envs name: the pool is kept warm when one declares sandboxes."""
    _holds_sandboxes: bool = field(default=False, init=False, repr=False)

    @classmethod
    def from_config(cls, run_cfg: RunConfig, actor_cfg: ActorConfig, *, pool: str,
                    index: int = 0) -> "RewardService":
        rc = run_cfg.reward
        return cls.configured(actor_cfg, dict(
            run=run_cfg.run, pool=pool, name=f"reward-{pool}-{index}", model_path=rc.model_path,
            gather_ms=rc.gather_ms, threads=run_cfg.model.threads, sandbox=run_cfg.sandbox,
            scorers=tuple(sorted({e.scorer for e in run_cfg.envs.values() if e.scorer}))))

    async def setup(self) -> None:
        self._model = None
        self.batcher: Batcher = Batcher(self._score_batch, gather_s=self.gather_ms / 1e3,
                                        max_batch=self.max_batch)
        self.served = 0
        self.progress = ProgressReporter(self, "reward.request", every=self.progress_every,
                                         pool=self.settings_of("score").pool or self.pool)
        # rule scorers may build datasets or run user code: off the event loop, one at a
        # time (their caches are not thread-safe)
        self._rules = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-rules")
        self._sandboxed = ThreadPoolExecutor(max_workers=max(1, self.code_threads),
                                             thread_name_prefix=f"{self.name}-code")
        self.busy = otel_metrics.busy(self.name)  # rollart.reward.busy_fraction (metrics on)
        self.sandbox_failures = 0
        warm = any(declares_sandbox(RULES.get(s)) for s in self.scorers)
        await asyncio.to_thread(sandbox.hold, self.sandbox, warm=warm)  # may close another pool
        self._holds_sandboxes = True

    async def teardown(self) -> None:
        self._rules.shutdown(wait=False, cancel_futures=True)
        self._sandboxed.shutdown(wait=False, cancel_futures=True)
        otel_metrics.drop_busy(self.name)
        if self._holds_sandboxes:  # its requests are answered: kill them
            self._holds_sandboxes = False
            await asyncio.to_thread(sandbox.let_go)

    def node_stats(self) -> dict[str, float]:
        """For the node's heartbeat: the process's sandbox pool and ``<name>.sandbox_failures``."""
        return heartbeat_stats(self.name, self.sandbox_failures)

    async def main(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.batcher.run())
            tg.create_task(self.progress.run())

    @serve("reward.request", max_inflight=1024)
    async def score(self, req: m.RewardRequest) -> m.RewardResult:
        self.served += 1
        with self.busy:
            return await self._score(req)

    async def _score(self, req: m.RewardRequest) -> m.RewardResult:
        if req.scorer in RULES:
            fn = RULES[req.scorer]
            try:
                score = await asyncio.get_running_loop().run_in_executor(
                    self._sandboxed if req.scorer in SANDBOXED else self._rules, fn, req.response,
                    req.answer, dict(req.metadata))
            except Exception as e:
                why = sandbox_failure(e)
                if why is None:
                    raise
                self.sandbox_failures += 1  # the host's, not the candidate's: ask another replica
                raise ServiceUnavailable(f"{self.name}: a sandbox failed under scorer "
                                         f"{req.scorer!r}: {why}"[:1000]) from e
            return m.RewardResult(score=score, replica=self.name)
        if req.scorer == "model_logprob":
            score = await self.batcher.submit_or_unavailable(
                req, lambda why: ServiceUnavailable(f"{self.name} {why}"))
            return m.RewardResult(score=score, replica=self.name)
        raise ValueError(f"unknown scorer {req.scorer!r}; built-in: "
                         f"{sorted([*RULES, 'model_logprob'])}")

    async def _score_batch(self, reqs: list[m.RewardRequest]) -> list[float]:
        if self.model_path is None:
            raise ValueError("scorer 'model_logprob' needs reward.model_path")
        return await asyncio.to_thread(self._forward, reqs)

    def _forward(self, reqs: list[m.RewardRequest]) -> list[float]:
        """exp(mean log-prob) of each ``answer`` given ``response`` as context, in one batch."""
        import torch  # optional dependency: only the model_logprob scorer needs it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self._model is None:
            if self.threads:
                torch.set_num_threads(self.threads)
            self._tok = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            self._model = AutoModelForCausalLM.from_pretrained(self.model_path, local_files_only=True)
            self._model.eval()
        tok = self._tok
        rows, spans = [], []
        for r in reqs:
            ctx = tok.encode(r.response, add_special_tokens=False) or [tok.eos_token_id]
            tgt = tok.encode(r.answer, add_special_tokens=False) or [tok.eos_token_id]
            rows.append(ctx + tgt)
            spans.append((len(ctx), len(ctx) + len(tgt)))
        width = max(len(x) for x in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.tensor([x + [pad] * (width - len(x)) for x in rows])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in rows])
        with torch.no_grad():
            logp = torch.log_softmax(self._model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        out = []
        for i, (a, b) in enumerate(spans):
            pos = torch.arange(a - 1, b - 1)
            lp = logp[i, pos, ids[i, a:b]]
            out.append(float(lp.mean().exp()))
        return out
