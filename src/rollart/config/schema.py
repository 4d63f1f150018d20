"""Config Structs. Every field has a docstring; unknown keys are errors."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class HandlerConfig(Base):
    """Deployment overrides for one actor handler; unset fields keep the decorator's value."""

    durable: str | None = None
    """Durable consumer name (replicas sharing it split the work)."""
    ack_wait: float | None = None
    """Seconds before an un-acked delivery is redelivered."""
    max_deliver: int | None = None
    """Deliveries before a failing message is dead-lettered."""
    max_inflight: int | None = None
    """Messages handled concurrently by one replica."""
    max_ack_pending: int | None = None
    """Un-acked deliveries across all replicas (backpressure)."""
    heartbeat: float | None = None
    """Seconds between automatic in_progress signals (default ack_wait / 3)."""
    queue: str | None = None
    """Queue group of a request/reply service."""
    pool: str | None = None
    """Pool token for pooled subjects (default: the node's pool)."""

    def overrides(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}


class ActorConfig(Base):
    """One role as deployed."""

    type: str | None = None
    """Import path ``pkg.module:Class``; default: the built-in class of the role."""
    args: dict[str, Any] = {}
    """Keyword arguments for the actor's constructor."""
    handlers: dict[str, HandlerConfig] = {}
    """Per-handler overrides, keyed by handler method name."""
    replicas: int = 1
    """Instances of this actor per node."""


class NodeConfig(Base):
    grace: float = 10.0
    """Seconds in-flight handlers may take to finish when the node drains."""
    heartbeat_every: float = 5.0
    """Seconds between node heartbeats (0 disables)."""


# -- the RL pipeline -------------------------------------------------------------


class TinyModelConfig(Base):
    """A tiny Qwen3-style model built locally from a config (no download)."""

    vocab_size: int = 512
    """Tokenizer vocabulary size."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads."""
    intermediate_size: int = 256
    """MLP width."""
    seed: int = 0
    """Seed of the random initialisation."""


class ModelConfig(Base):
    path: str | None = None
    """Local Hugging Face model folder; empty builds ``tiny`` under the run folder."""
    tiny: TinyModelConfig = TinyModelConfig()
    """The tiny model to build when ``path`` is empty."""
    threads: int = 1
    """Torch threads per process."""


class SamplingConfig(Base):
    max_new_tokens: int = 32
    """Tokens per turn at most (free-text turns)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are always reported at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""


class EnvConfig(Base):
    """One environment kind that trajectories run in."""

    type: str = "frozenlake"
    """Built-in name (frozenlake, sokoban, reasoning_gym) or ``pkg.module:Class``."""
    args: dict[str, Any] = {}
    """Keyword arguments of the env class."""
    executor: Literal["thread", "process"] = "thread"
    """Where a sync env runs: ``thread`` or ``process``."""
    max_turns: int = 8
    """Turns at most; then the trajectory stops with ``max_turns``."""
    max_context_tokens: int = 1024
    """Context length at most; then the trajectory stops with ``max_context``."""
    reset_timeout: float = 30.0
    """Seconds a reset may take."""
    reset_retries: int = 3
    """Fresh envs tried after a failed reset before the trajectory is dead-lettered."""
    step_timeout: float = 30.0
    """Seconds a step may take; then the trajectory stops with ``env_timeout``."""
    instruction: str | None = None
    """System prompt; default: the env's own instruction."""
    turn_template: str = "{observation}"
    """User message of each turn; ``{observation}`` and ``{turn}`` are filled in."""
    action_pattern: str | None = None
    """Regex with one group to extract the action (e.g. ``<answer>(.*?)</answer>``)."""
    format_penalty: float = -0.1
    """Reward added per turn whose action cannot be parsed."""
    constrain: bool = True
    """Constrain decoding to the env's legal actions when it has them."""
    scorer: str | None = None
    """Score the trajectory with this RewardService scorer instead of the env's rewards."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling of free-text turns."""


class RolloutConfig(Base):
    mode: Literal["trajectory", "batch"] = "trajectory"
    """``trajectory`` (each trajectory advances on its own) or ``batch`` (lock-step turns)."""
    env: str = "main"
    """Key of ``envs`` to roll out in (training)."""
    group_size: int = 8
    """Trajectories per group (same seed); advantages are normalised within a group."""
    redundancy: int = 0
    """Extra trajectories per group; the first ``group_size`` finished are kept."""
    batch_groups: int = 8
    """Groups per training step."""
    alpha: int = 1
    """Asynchrony bound: a step producing version v+1 uses trajectories of version >= v - alpha."""
    stale: Literal["wait", "drop", "restart"] = "wait"
    """A trajectory beyond the bound: ``wait`` (the trainer waits for groups in admission
    order and turns use at least the admission version, so none is ever stale), ``drop``
    (discard it) or ``restart`` (discard and roll the task out again)."""
    concurrency: int = 64
    """Trajectories one EnvManager runs at once."""
    generate_timeout: float = 60.0
    """Seconds per generate request."""
    generate_retries: int = 3
    """Retries of a failed generate request."""
    ack_wait: float = 30.0
    """Seconds before an abandoned trajectory is redelivered (heartbeats hold live ones)."""
    seed: int = 0
    """Base seed of the task seeds."""
    same_seed_per_group: bool = True
    """All trajectories of a group share the task seed."""

    def __post_init__(self) -> None:
        wave = (self.group_size + self.redundancy) * self.batch_groups
        if self.mode == "batch" and self.concurrency < wave:
            raise ValueError(
                f"rollout.mode 'batch' runs a wave of (group_size + redundancy) * batch_groups"
                f" = {wave} trajectories in lock step on one EnvManager: set rollout.concurrency"
                f" >= {wave} (it is {self.concurrency})")
        for name in ("group_size", "batch_groups", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1")
        if self.alpha < 0 or self.redundancy < 0:
            raise ValueError("rollout.alpha and rollout.redundancy must be >= 0")


class ProxyConfig(Base):
    engine: str = "torch"
    """Generation engine: ``torch`` (sglang needs a GPU and is not built in yet)."""
    gather_ms: float = 2.0
    """Milliseconds to gather concurrent requests into one engine batch."""
    max_batch: int = 128
    """Requests per engine batch at most."""
    replicas: int = 1
    """LLMProxy replicas started by ``rollart run``."""


class RewardConfig(Base):
    replicas: int = 1
    """RewardService replicas started by ``rollart run``."""
    model_path: str | None = None
    """Local causal LM folder for the ``model_logprob`` scorer."""
    gather_ms: float = 2.0
    """Milliseconds to gather requests into one model forward pass."""


class TrainerConfig(Base):
    """Training: algorithm, optimizer, weight sync and checkpoints."""

    steps: int = 20
    """Optimizer steps (policy versions) to train."""
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator (drgrpo: group mean baseline without std normalisation)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    warmup_steps: int = 0
    """Linear LR warm-up steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up."""
    clip_low: float = 0.2
    """PPO lower clip."""
    clip_high: float = 0.2
    """PPO upper clip."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """Loss aggregation."""
    is_cap: float | None = 2.0
    """Cap of the truncated importance weight between trainer and rollout log-probs (none: off)."""
    decoupled: bool = False
    """Decoupled PPO objective (tokens whose IS weight exceeds the cap get weight 0)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    kl_coef: float = 0.0
    """k3 KL penalty to the initial policy."""
    micro_batch_tokens: int = 8192
    """Padded tokens per micro-batch (gradient accumulation above it)."""
    weights: Literal["file", "object"] = "file"
    """Where weights travel: the run folder (shared filesystem) or the bus object store."""
    checkpoint_every: int = 1
    """Steps between checkpoints; trajectories are acked only once checkpointed."""
    keep_weights: int = 3
    """Weight files kept on disk (older versions are deleted)."""
    seed: int = 0
    """Seed of the trainer."""
    eval_groups: int = 4
    """Groups of the greedy evaluation at the end of ``rollart run`` (held-out seeds)."""


class RunConfig(Base):
    """A whole run: what ``rollart run`` and ``python -m rollart.node`` read."""

    run: str = "default"
    """Run name; one subject token (letters, digits, '_' or '-')."""
    nats: str | None = None
    """NATS URL to join; empty starts an embedded server."""
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
    trainer: TrainerConfig = TrainerConfig()
    """Training."""
