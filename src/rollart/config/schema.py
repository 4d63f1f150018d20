"""The whole run's config: :class:`RunConfig`, its sections and the checks that span them.

Each section lives with its concern: :mod:`~rollart.config.deploy` (``actors:``, ``node:``),
:mod:`~rollart.config.pipeline` (``model:``, ``envs:``, ``rollout:``, ``proxy:``, ``reward:``),
:mod:`~rollart.config.trainer` (``trainer:``), :mod:`~rollart.config.nats` (``nats:``), :mod:`~rollart.config.placement`
(``pools:``, ``mapping:``, ``route:``) and :mod:`~rollart.config.tracing` (``tracing:``).
The section types it uses stay importable from here too (``from rollart.config.schema import
NodeConfig``, ``NatsTlsConfig``...), as they were when this module held them all; new code
imports them from :mod:`rollart.config` or from their own module.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rollart.config.base import Base, subject_token
from rollart.config.deploy import ActorConfig, HandlerConfig, NodeConfig
from rollart.config.nats import NatsConfig, NatsTlsConfig
from rollart.config.pipeline import (
    EnvConfig,
    ModelConfig,
    ProxyConfig,
    RewardConfig,
    RolloutConfig,
)
from rollart.config.placement import PoolConfig, RouteRule, check_placement
from rollart.config.sandbox import SandboxConfig
from rollart.config.tracing import TelemetryConfig, TracingConfig
from rollart.config.trainer import TrainerConfig
from rollart.config.urls import check_nats_url

__all__ = [
    "ActorConfig", "EnvConfig", "HandlerConfig", "ModelConfig", "NatsConfig", "NatsTlsConfig",
    "NodeConfig", "PoolConfig", "ProxyConfig", "RewardConfig", "RolloutConfig", "RouteRule",
    "RunConfig", "SandboxConfig", "TelemetryConfig", "TracingConfig", "TrainerConfig", "check_nats_url", "nats_settings",
    "trainer_buffer",
]


def nats_settings(value: Any) -> NatsConfig:
    """The NATS settings of a :class:`RunConfig` (or of its ``nats`` value: a URL string, a
    section, a mapping or None) as a :class:`NatsConfig`, whichever form was written."""
    if isinstance(value, RunConfig):
        value = value.nats
    if value is None:
        return NatsConfig()
    if isinstance(value, NatsConfig):
        return value
    if isinstance(value, str):
        return NatsConfig(url=value)
    if isinstance(value, dict):
        return msgspec.convert(value, NatsConfig, strict=False)
    raise TypeError(f"nats: a URL string or a section, not {type(value).__name__}")


class RunConfig(Base):
    """A whole run: what ``rollart run`` and ``python -m rollart.node`` read."""

    run: str = "default"
    """Run name; one subject token (letters, digits, '_' or '-')."""
    nats: str | NatsConfig | None = None
    """NATS URL to join (``nats://host:4222``, or ``memory``: the in-process bus), or a section
    with the URL, credentials and TLS; empty starts an embedded server (on 127.0.0.1)."""
    run_dir: str = "runs"
    """Folder under which ``<run>/`` holds the store, logs, metrics and checkpoints."""
    node: NodeConfig = NodeConfig()
    """Node settings."""
    actors: dict[str, ActorConfig] = {}
    """Roles by name (``env``, ``generate``, ``reward``, ``trainer``, ``scheduler`` or custom)."""
    model: ModelConfig = ModelConfig()
    """The policy model."""
    envs: dict[str, EnvConfig] = msgspec.field(default_factory=lambda: {"main": EnvConfig()})
    """Environments by name; ``rollout.env`` picks the training one."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout and admission settings."""
    proxy: ProxyConfig = ProxyConfig()
    """Generation replicas."""
    reward: RewardConfig = RewardConfig()
    """Reward service."""
    sandbox: SandboxConfig = SandboxConfig()
    """Sandboxes for model-written code on env hosts (and execution-based scorers)."""
    trainer: TrainerConfig = TrainerConfig()
    """Training."""
    pools: dict[str, PoolConfig] = {}
    """Pools of hosts by name, each with a description and hardware tags (empty: one pool per
    node, its ``--pool``)."""
    mapping: dict[str, str | list[str]] = {}
    """The pool(s) serving each role (``generate: [big, small]``, ``env: cpu``); needs ``pools``."""
    route: list[RouteRule] = []
    """Rules choosing the generation pool of each turn, first match wins: ``{when:
    {prompt_tokens_gt: 2048}, pool: big}``; a rule without ``when`` is the default."""
    tracing: TracingConfig = TracingConfig()
    """OpenTelemetry tracing (off by default)."""
    telemetry: TelemetryConfig = TelemetryConfig()
    """Metric loggers (TensorBoard, wandb, MLflow; off by default)."""

    def __post_init__(self) -> None:
        if not self.envs:
            raise ValueError("envs: no environment is configured; define at least one under envs:")
        if self.rollout.env not in self.envs:
            raise ValueError(f"rollout.env: {self.rollout.env!r} is not a key of envs; "
                             f"allowed: {', '.join(repr(k) for k in self.envs)}")
        subject_token("", "run", self.run)
        if isinstance(self.nats, str):
            check_nats_url("nats", self.nats)
        r, t = self.rollout, self.trainer
        if r.group_size < 2:  # every estimator here subtracts a baseline taken from the group
            why = {"grpo": "the advantage is the reward minus the group mean, over the group std",
                   "drgrpo": "the advantage is the reward minus the group mean",
                   "rloo": "the baseline is the mean reward of the other members of the group",
                   "reinforce_pp": "the group mean is subtracted before whitening over the batch"}
            raise ValueError(
                f"rollout.group_size must be >= 2 with trainer.advantage {t.advantage!r}: "
                f"{why.get(t.advantage, 'it needs a group baseline')}, so in a group of "
                f"{r.group_size} every advantage is 0 and nothing is learned (it is {r.group_size})")
        env_replicas = self.actors.get("env", ActorConfig()).replicas
        if r.mode == "batch" and env_replicas > 1:
            raise ValueError(
                f"actors.env.replicas: rollout.mode 'batch' runs each wave in lock step on one "
                f"EnvManager; {env_replicas} replicas would split a wave between them, each waiting "
                f"for members another one holds. Set actors.env.replicas to 1 (and run one env "
                f"node), or use rollout.mode 'trajectory' (it is {env_replicas})")
        self._check_trainer_holds()
        check_placement(self.pools, self.mapping, self.route, self.envs,
                        {"env", "generate", "reward", "trainer", "scheduler", *self.actors})

    def _check_trainer_holds(self) -> None:
        """The trainer acks a trajectory only once a checkpoint covers it, so it holds the
        deliveries of every step since the last checkpoint plus those of the groups admitted
        ahead; if its input handler cannot hold that many, it waits forever for a batch."""
        r, t = self.rollout, self.trainer
        per_step = (r.batch_groups + t.skip_uniform) * (r.group_size + r.redundancy)
        need = (t.checkpoint_every + r.alpha) * per_step
        buf = trainer_buffer(r, t.skip_uniform)
        hc = self.actors.get("trainer", ActorConfig()).handlers.get("on_completed", HandlerConfig())
        room = min(hc.max_inflight or buf, hc.max_ack_pending or 2 * buf)
        if need <= room:
            return
        most = room // per_step - r.alpha
        fix = f"Set trainer.checkpoint_every <= {most}, or raise" if most >= 1 else "Raise"
        raise ValueError(
            f"trainer.checkpoint_every: the trainer acks trajectories only once a checkpoint covers "
            f"them, so it holds up to (trainer.checkpoint_every + rollout.alpha) * "
            f"(rollout.batch_groups + trainer.skip_uniform) * (rollout.group_size + "
            f"rollout.redundancy) = {need} deliveries, "
            f"but its on_completed handler takes {room} at once (max_inflight / max_ack_pending): "
            f"training would stop waiting for a batch. {fix} "
            f"actors.trainer.handlers.on_completed.max_inflight and max_ack_pending to >= {need}")


def trainer_buffer(rollout: RolloutConfig, skip_uniform: int = 0) -> int:
    """The trainer's default ``max_inflight`` on its input handlers (``max_ack_pending`` is
    twice this): deliveries held at once, un-acked until a checkpoint covers them (the groups
    of the steps since it, the groups a step skipped as uniform, and those admitted ahead)."""
    r = rollout
    groups = (r.alpha + 2) * r.batch_groups + 2 * skip_uniform
    return max(256, 4 * groups * (r.group_size + r.redundancy))
