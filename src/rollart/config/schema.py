"""Config Structs. Every field has a docstring; unknown keys are errors."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import msgspec

from rollart.config.placement import PoolConfig, RouteRule, check_placement
from rollart.config.tracing import TracingConfig
from rollart.messages import check_token


class Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


def _in_range(struct: Any, prefix: str, names: str, *, ge: float | None = None,
              gt: float | None = None, le: float | None = None, lt: float | None = None) -> None:
    """Raise ``ValueError("<prefix><name> must be <range> (it is <value>)")`` unless every
    field in ``names`` (space-separated; ``None`` means unset and passes) is a finite number
    in the range. ``prefix`` is the section's key (``trainer.``), or empty in Structs that sit
    under a name chosen by the user (``envs.<name>``): the loader then puts the path in front."""
    lo = f">= {ge:g}" if ge is not None else f"> {gt:g}" if gt is not None else ""
    hi = f"<= {le:g}" if le is not None else f"< {lt:g}" if lt is not None else ""
    if lo and hi:
        allowed = f"in {'[' if ge is not None else '('}{ge if ge is not None else gt:g}, " \
                  f"{le if le is not None else lt:g}{']' if le is not None else ')'}"
    else:
        allowed = lo or hi or "a finite number"
    for name in names.split():
        v = getattr(struct, name)
        if v is None:
            continue
        if not (math.isfinite(v) and (ge is None or v >= ge) and (gt is None or v > gt)
                and (le is None or v <= le) and (lt is None or v < lt)):
            raise ValueError(f"{prefix}{name} must be {allowed} (it is {v!r})")


def _token(prefix: str, name: str, value: str | None) -> None:
    """A name that becomes a subject token (or consumer name): letters, digits, _ or -."""
    if value is not None:
        try:
            check_token(name, value)
        except ValueError as e:
            raise ValueError(f"{prefix}{name}: {e}") from None


class HandlerConfig(Base):
    """Deployment overrides for one actor handler; unset fields keep the decorator's value."""

    durable: str | None = None
    """Durable consumer name (replicas sharing it split the work)."""
    ack_wait: float | None = None
    """Seconds before an un-acked delivery is redelivered."""
    max_deliver: int | None = None
    """Deliveries before a failing message is dead-lettered (-1: no limit)."""
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

    def __post_init__(self) -> None:
        _in_range(self, "", "ack_wait heartbeat", gt=0)
        _in_range(self, "", "max_inflight max_ack_pending", ge=1)
        if self.max_deliver is not None and not (self.max_deliver == -1 or self.max_deliver >= 1):
            raise ValueError(f"max_deliver must be -1 (no limit) or >= 1 (it is {self.max_deliver})")
        if self.heartbeat is not None and self.ack_wait is not None and self.heartbeat >= self.ack_wait:
            raise ValueError(f"heartbeat must be < ack_wait ({self.ack_wait:g}), or a live handler's "
                             f"delivery is redelivered (it is {self.heartbeat:g})")
        for name in ("durable", "queue", "pool"):
            _token("", name, getattr(self, name))

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

    def __post_init__(self) -> None:
        _in_range(self, "", "replicas", ge=1)
        if self.type is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.type):
            raise ValueError(f"type must be an import path 'pkg.module:Class' (it is {self.type!r})")


LOCAL_PROCESS_ROLES = ("env", "generate", "reward")
"""The roles ``node.local_processes`` may put in a child process of ``rollart run``."""


def _check_local_processes(groups: list[list[str]]) -> None:
    """``node.local_processes``: lists of known roles, none empty, no role twice."""
    key = "node.local_processes"
    allowed = ", ".join(repr(r) for r in LOCAL_PROCESS_ROLES)
    seen: set[str] = set()
    for i, group in enumerate(groups):
        if not group:
            raise ValueError(f"{key}[{i}] is empty: give each process at least one role "
                             f"({allowed}), or drop the entry")
        for role in group:
            if role in ("trainer", "scheduler"):
                raise ValueError(f"{key}[{i}]: {role!r} always stays in the `rollart run` process; "
                                 f"a child process may serve {allowed}")
            if role not in LOCAL_PROCESS_ROLES:
                raise ValueError(f"{key}[{i}]: unknown role {role!r}; allowed: {allowed}")
            if role in seen:
                raise ValueError(f"{key}: role {role!r} is given twice; each role runs in one "
                                 f"process")
            seen.add(role)


class NodeConfig(Base):
    grace: float = 10.0
    """Seconds in-flight handlers may take to finish when the node drains."""
    heartbeat_every: float = 5.0
    """Seconds between node heartbeats (0 disables)."""
    events_max_age: float = 7 * 24 * 3600.0
    """Seconds the run's events stream (``ROLLART_<run>``: completed trajectories with their
    token lists, status and dead letters) keeps a message; older ones are discarded (0: kept
    forever; else at least 60). Must outlast what the trainer has not yet covered by a
    checkpoint: a ``rollout.completed`` it has read but not checkpointed is read again from
    the stream on ``--resume``, so a run stopped for longer than this loses those
    trajectories. The default (7 days) cannot drop them in a running job."""
    events_max_bytes: int = 0
    """Bytes the events stream may hold; past it the oldest messages are discarded
    (0: no byte limit, the default; else at least 1 MiB). nats-server reserves this much of
    its store (``max_file_store``: by default 75% of the free disk) for the stream up front,
    whatever it holds: with a default of several GiB every run would claim that much, and a
    small disk or a server shared by a few runs would refuse the next run's stream
    ("insufficient storage resources"). So by default ``events_max_age`` bounds the stream.
    A value must hold every trajectory not yet covered by a trainer checkpoint: about
    ``checkpoint_every x batch_groups x group_size x`` the size of one ``rollout.completed``
    (~15 bytes per token: a 1,000-token trajectory is ~15 KB, a 64-trajectory step ~1 MB)."""
    bus_outage_max: float = 600.0
    """Seconds a node keeps trying to reconnect to a nats-server it lost; past that it drains
    and stops with one message naming the server (``python -m rollart.node`` and ``rollart run``
    exit with status 4). Shorter outages are ridden out: the client reconnects by itself and
    unacknowledged work is redelivered. 0: wait for the server forever."""
    stream_replicas: int = 1
    """Copies of the run's streams, KV buckets and object stores, each on another server of a
    nats-server cluster (1 to 5; `rollart cluster init` writes the configs of one). 3 lets
    the run go on through the loss of one server; more than 1 needs a cluster of at least
    that many servers (a single server refuses it). Streams and buckets that exist keep
    theirs, except a stream that the trainer's host updates."""
    local_processes: list[list[str]] = msgspec.field(
        default_factory=lambda: [["generate"], ["env", "reward"]])
    """How ``rollart run`` spreads the roles over processes of this host when its bus is a
    nats-server (the embedded one, or ``--nats URL``): one child process
    (``python -m rollart.node``; its output in ``runs/<run>/logs/<roles>.log``, such as
    ``env-reward.log``) per list, with
    those roles; the trainer, the scheduler and any role not listed stay in the ``rollart
    run`` process. The default puts generation and env stepping in processes of their own, so
    generation, environments and training overlap instead of sharing one Python
    interpreter. Roles: ``env``, ``generate``, ``reward``, each at most once. ``[]``: one
    process, as ``rollart run --single-process`` (and ``--nats memory``, which cannot cross
    processes). A child that dies, or is stuck (``node.stuck_after``), is restarted (up to 3
    times within 10 minutes) and the work it held is redelivered."""
    stuck_after: float = 60.0
    """Seconds a child node process of ``rollart run`` (``node.local_processes``) may go
    without a heartbeat, once it has sent one, before ``rollart run`` takes it for stuck (its
    event loop blocked, or the process stopped), kills it and restarts it like a child that
    died. 0: never (also when ``heartbeat_every`` is 0); else at least 3 x ``heartbeat_every``,
    so a late heartbeat on a busy host is not taken for a stuck process."""

    def __post_init__(self) -> None:
        _in_range(self, "node.", "grace heartbeat_every bus_outage_max stuck_after", ge=0)
        if self.stuck_after and self.heartbeat_every and self.stuck_after < 3 * self.heartbeat_every:
            raise ValueError(f"node.stuck_after must be 0 (never) or >= 3 x node.heartbeat_every "
                             f"({3 * self.heartbeat_every:g}) (it is {self.stuck_after:g})")
        _in_range(self, "node.", "stream_replicas", ge=1, le=5)
        _check_local_processes(self.local_processes)
        for name, low, unit in (("events_max_age", 60, "seconds"),
                                ("events_max_bytes", 1024**2, "bytes (1048576: 1 MiB, one message)")):
            v = getattr(self, name)
            if not (math.isfinite(v) and (v == 0 or v >= low)):
                raise ValueError(f"node.{name} must be 0 (no limit) or >= {low} {unit} "
                                 f"(it is {v!r})")


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

    def __post_init__(self) -> None:
        k = "model.tiny."
        _in_range(self, k, "vocab_size", ge=TINY_MIN_VOCAB)
        _in_range(self, k, "hidden_size num_layers num_heads num_kv_heads intermediate_size", ge=1)
        _in_range(self, k, "seed", ge=0)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{k}hidden_size ({self.hidden_size}) must be divisible by "
                             f"{k}num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{k}num_heads ({self.num_heads}) must be divisible by "
                             f"{k}num_kv_heads ({self.num_kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"{k}hidden_size / {k}num_heads (the head size, "
                             f"{self.hidden_size // self.num_heads}) must be even (rotary embeddings)")


TINY_MIN_VOCAB = 267
"""Smallest ``model.tiny.vocab_size``: 256 bytes, 3 special tokens and a few merges
(:func:`rollart.engines.tiny.build_tiny_model` checks the same)."""


class ModelConfig(Base):
    path: str | None = None
    """Local Hugging Face model folder; empty builds ``tiny`` under the run folder."""
    tiny: TinyModelConfig = TinyModelConfig()
    """The tiny model to build when ``path`` is empty."""
    threads: int = 1
    """Torch threads per process."""

    def __post_init__(self) -> None:
        _in_range(self, "model.", "threads", ge=1)


class SamplingConfig(Base):
    max_new_tokens: int = 32
    """Tokens per turn at most (free-text turns)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are always reported at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""

    def __post_init__(self) -> None:
        _in_range(self, "", "max_new_tokens", ge=1)
        _in_range(self, "", "temperature", ge=0)
        _in_range(self, "", "top_p", gt=0, le=1)


class EnvConfig(Base):
    """One environment kind that trajectories run in."""

    type: str = "frozenlake"
    """Built-in name (frozenlake, sokoban, reasoning_gym), ``gym:<id>`` (any registered
    gymnasium environment) or ``pkg.module:Class``."""
    args: dict[str, Any] = {}
    """Keyword arguments of the env class."""
    executor: Literal["thread", "process"] = "thread"
    """Where a sync env runs: ``thread`` or ``process``. A thread cannot be killed: a step
    that times out leaves it running (abandoned); in ``process`` the worker is killed."""
    max_abandoned_threads: int = 16
    """With ``executor: thread``: once this many threads of timed-out steps (or resets) of
    this env type are still running, its trajectories fail at once as ``env_contract``
    ("steps hang; use executor: process") instead of leaking a thread per hung step. A thread
    whose call returns late stops counting."""
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
    """System prompt; default: the env's own ``instruction`` attribute, else empty."""
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
    check: bool = True
    """Before a run starts (and in ``rollart config``) construct one env, reset it and take
    one legal step, so a broken env fails at once; ``false`` (for envs expensive to build)
    only imports ``type`` and checks ``args`` against its constructor."""

    def __post_init__(self) -> None:
        from rollart.envs.actions import compile_pattern

        _in_range(self, "", "max_turns max_context_tokens", ge=1)
        _in_range(self, "", "reset_timeout step_timeout", gt=0)
        _in_range(self, "", "reset_retries", ge=0)
        _in_range(self, "", "max_abandoned_threads", ge=1)
        _in_range(self, "", "format_penalty")
        try:
            self.turn_template.format(observation="", turn=1)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValueError(f"turn_template {self.turn_template!r} is not a format string with "
                             f"only {{observation}} and {{turn}}: {type(e).__name__}: {e}") from None
        if self.action_pattern is not None:
            try:
                compile_pattern(self.action_pattern)
            except ValueError as e:
                raise ValueError(f"action_pattern: {e}") from None


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
    """Seconds one generate or reward request may take on a live replica; then it is sent
    again (a replica that dies or drains is noticed sooner: ``replica_timeout``)."""
    generate_retries: int = 3
    """Retries of a generate or reward request that a replica answered with an error; then
    the trajectory is dead-lettered (``service_error``). A missing, lost or stopping replica
    is not an error but a wait (``service_wait``)."""
    service_wait: float = 300.0
    """Seconds one generate or reward request keeps trying while no replica answers (no
    responders, timeouts, lost replicas or connection); then the trajectory is
    dead-lettered (``service_unavailable``)."""
    replica_timeout: float = 3.0
    """Seconds without a progress report from the replica holding a request (or with no live
    replica claiming it) before the request is sent again elsewhere; 0 turns this off."""
    ack_wait: float = 30.0
    """Seconds before an abandoned trajectory is redelivered (heartbeats hold live ones)."""
    seed: int = 0
    """Base seed of the task seeds."""
    same_seed_per_group: bool = True
    """All trajectories of a group share the task seed."""
    fail_after_groups: int | None = None
    """Circuit breaker: the run stops (non-zero exit, reason in ``summary.json``) when this
    many groups fail in a row; default ``2 * batch_groups``; 0 never stops."""
    on_failed_group: Literal["replace", "skip"] = "replace"
    """A failed group (fewer than 2 completions) in a rollout of a fixed number of groups
    (``rollart rollout``, evaluation): ``replace`` admits a fresh group (new task seed) so that
    the number asked for complete, ``skip`` reports it as failed. Training always frees a lost
    group's admission headroom, so a fresh group takes its place."""

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
        for name in ("generate_timeout", "service_wait"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be > 0 seconds")
        if self.generate_retries < 0 or self.replica_timeout < 0:
            raise ValueError("rollout.generate_retries and rollout.replica_timeout must be >= 0")
        if self.fail_after_groups is not None and self.fail_after_groups < 0:
            raise ValueError("rollout.fail_after_groups must be >= 0 (0: never stop)")
        # every numeric key, finite (the checks above let NaN through); a concurrency below
        # one group or batch only runs slower in trajectory mode (each trajectory advances
        # on its own), so it is allowed; batch mode's lock step needs the wave (above)
        _in_range(self, "rollout.", "group_size batch_groups concurrency", ge=1)
        _in_range(self, "rollout.", "alpha redundancy generate_retries fail_after_groups seed", ge=0)
        _in_range(self, "rollout.", "generate_timeout service_wait ack_wait", gt=0)
        _in_range(self, "rollout.", "replica_timeout", ge=0)


class ProxyConfig(Base):
    engine: Literal["torch", "vllm", "sglang"] = "torch"
    """Generation engine of each LLMProxy: ``torch`` (built in, CPU or GPU), ``vllm``
    (``pip install 'rollart[vllm]'``; its CPU build runs here) or ``sglang`` (an SGLang
    server on a GPU, launched by the node or attached by URL). See ``engine_args``."""
    engine_args: dict[str, Any] = {}
    """Passed to the engine: for ``vllm`` fields of vLLM's ``AsyncEngineArgs``
    (``max_model_len``, ``gpu_memory_utilization``...); for ``sglang`` ``url`` (attach to a
    running server) or server arguments; unused by ``torch``."""
    on_update: Literal["finish", "interrupt"] = "finish"
    """When a new policy version arrives: ``finish`` lets the requests in flight finish on the
    old weights, then loads; ``interrupt`` stops them, loads, and continues each from the
    tokens it had (a partial rollout: every token keeps the version that produced it)."""
    gather_ms: float = 2.0
    """Milliseconds to gather concurrent requests into one engine batch (``torch``)."""
    max_batch: int = 128
    """Requests per engine batch at most (``torch``)."""
    replicas: int = 1
    """LLMProxy replicas started by ``rollart run``."""

    def __post_init__(self) -> None:
        _in_range(self, "proxy.", "gather_ms", ge=0)
        _in_range(self, "proxy.", "max_batch replicas", ge=1)


class RewardConfig(Base):
    replicas: int = 1
    """RewardService replicas started by ``rollart run`` (0: none; only envs with a
    ``scorer`` need one)."""
    model_path: str | None = None
    """Local causal LM folder for the ``model_logprob`` scorer."""
    gather_ms: float = 2.0
    """Milliseconds to gather requests into one model forward pass."""

    def __post_init__(self) -> None:
        _in_range(self, "reward.", "replicas gather_ms", ge=0)


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
    eval_timeout: float = 600.0
    """Seconds the final evaluation may take; past them the run ends without its result
    (logged as an error) instead of waiting for ever."""
    stall_after: float = 120.0
    """Seconds the trainer waits for a batch before it says what it waits for (groups,
    queued work, pools without a live node), then again every minute or so."""

    def __post_init__(self) -> None:
        if self.stall_after <= 0:
            raise ValueError("trainer.stall_after must be > 0 seconds")
        k = "trainer."
        _in_range(self, k, "steps micro_batch_tokens checkpoint_every keep_weights eval_groups", ge=1)
        _in_range(self, k, "lr grad_clip is_cap stall_after eval_timeout", gt=0)
        _in_range(self, k, "weight_decay warmup_steps clip_high entropy_coef kl_coef seed", ge=0)
        _in_range(self, k, "clip_low", ge=0, lt=1)  # the ratio is clipped below at 1 - clip_low


# -- NATS: where the bus is, credentials and TLS ----------------------------------------

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_nats_url(key: str, url: str, *, memory: bool = True) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``url`` is a NATS URL (``nats://host:port``,
    ``tls://``, ``ws://``, ``wss://``, or ``host:port``; ``memory`` where allowed) without
    credentials in it. The message never repeats a password or token."""
    from urllib.parse import urlsplit

    from rollart.bus.auth import redact

    if memory and url == "memory":
        return
    shown = redact(url)
    if not url.strip():
        raise ValueError(f"{key} must be a NATS URL such as nats://host:4222 (it is empty)")
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise ValueError(f"{key}: {shown} is not a NATS URL ({e})") from None
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError(
            f"{key}: {shown} holds credentials (user:password@ or token@), which would end up in "
            f"configs, logs and process lists; give them from a file or an environment variable "
            f"instead: nats.user with nats.password_file or nats.password_env (or nats.token_file "
            f"/ nats.token_env; on the command line --user and --password-file)")
    if parts.scheme not in ("nats", "tls", "ws", "wss") or not parts.hostname:
        raise ValueError(f"{key}: {shown} is not a NATS URL: write nats://HOST:PORT "
                         f"(or tls://, ws://, wss://)")


def split_listen(listen: str, key: str = "nats.listen") -> tuple[str, int]:
    """``HOST`` or ``HOST:PORT`` (``[::1]:4222`` for IPv6) as ``(host, port)``; port 0 when
    not given (the embedded server picks a free one)."""
    text = listen.strip()
    host, port = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{key}: {listen!r} is not HOST or HOST:PORT (an unclosed '[')")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{key}: {listen!r} is not HOST or HOST:PORT")
        port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host:
        raise ValueError(f"{key}: {listen!r} has no host: write 127.0.0.1, 0.0.0.0:4222, ...")
    if port:
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{key}: the port of {listen!r} must be a number in [0, 65535]")
    return host, int(port or 0)


class NatsTlsConfig(Base):
    """TLS of the connections to nats-server."""

    ca: str | None = None
    """CA certificate file (PEM) that signed the server's certificate; empty: the system's
    CAs are trusted."""
    cert: str | None = None
    """Client certificate file (PEM), for a server that verifies its clients."""
    key: str | None = None
    """Private key file (PEM) of ``cert`` (empty: ``cert`` holds both)."""
    verify: bool = True
    """Check the server's certificate and its host name; ``false`` still encrypts but trusts
    any server (a man in the middle too): for tests only."""
    server_name: str | None = None
    """Host name the server's certificate must hold; default: the host of the URL
    (``localhost`` when a node connects to its own embedded server)."""

    def __post_init__(self) -> None:
        if self.key and not self.cert:
            raise ValueError("nats.tls.key needs nats.tls.cert: the client certificate it belongs to")


class NatsConfig(Base):
    """Where nats-server is, how to authenticate to it, and how the embedded one listens.
    Secrets come only from files or environment variables: no key holds a password or token."""

    url: str | None = None
    """Server URL to join (``nats://host:4222``, ``tls://host:4222``; ``memory``: the
    in-process bus); empty (and no ``urls``): start an embedded server. Never with
    ``user:password@``: see ``password_file``."""
    urls: list[str] = []
    """Several URLs of one nats-server cluster, instead of ``url``."""
    user: str | None = None
    """User name to authenticate as; its password comes from ``password_file`` or
    ``password_env``."""
    password_file: str | None = None
    """File holding the password of ``user`` (its first line; keep it ``chmod 600``)."""
    password_env: str | None = None
    """Name of the environment variable holding the password of ``user``."""
    token_file: str | None = None
    """File holding an auth token (instead of ``user`` and a password)."""
    token_env: str | None = None
    """Name of the environment variable holding an auth token."""
    nkey_seed_file: str | None = None
    """File holding the NKey seed (``SU...``) of a user the server knows by its public key."""
    creds_file: str | None = None
    """NATS credentials file (user JWT and NKey seed) of an operator/account setup."""
    tls: NatsTlsConfig | None = None
    """TLS settings; empty: plaintext, unless the server requires TLS (then the system's CAs
    are trusted)."""
    listen: str = "127.0.0.1"
    """Address the embedded server listens on: ``HOST`` or ``HOST:PORT`` (default port: a free
    one). Only a non-loopback address (``0.0.0.0:4222``) lets other hosts join, and it needs
    ``server_config`` with authorization."""
    server_config: str | None = None
    """nats-server config file the embedded server starts with (``-c``): users, TLS, accounts
    (``rollart secure init`` writes one); its listen address, store and JetStream are rollart's."""

    def __post_init__(self) -> None:
        if self.url is not None and self.urls:
            raise ValueError("nats.url and nats.urls: give one of them")
        if self.url is not None:
            check_nats_url("nats.url", self.url)
        for i, u in enumerate(self.urls):
            check_nats_url(f"nats.urls[{i}]", u, memory=False)
        for a, b in (("password_file", "password_env"), ("token_file", "token_env")):
            if getattr(self, a) and getattr(self, b):
                raise ValueError(f"nats.{a} and nats.{b}: give one of them")
        for name in ("password_env", "token_env"):
            v = getattr(self, name)
            if v is not None and not _ENV_NAME.fullmatch(v):  # never echo it: it may be the secret
                raise ValueError(f"nats.{name} must be the name of an environment variable "
                                 f"(letters, digits and '_'), not the secret itself")
        for name in ("user", "password_file", "token_file", "nkey_seed_file", "creds_file",
                     "server_config"):
            if getattr(self, name) == "":
                raise ValueError(f"nats.{name} is empty: leave it out, or give a value")
        has_password = bool(self.password_file or self.password_env)
        if has_password and not self.user:
            raise ValueError(f"nats.{'password_file' if self.password_file else 'password_env'} "
                             f"needs nats.user: the user the password belongs to")
        if self.user and not has_password:
            raise ValueError("nats.user needs its password: nats.password_file or nats.password_env")
        methods = [keys for keys in (
            [k for k in ("user", "password_file", "password_env") if getattr(self, k)],
            [k for k in ("token_file", "token_env") if getattr(self, k)],
            ["nkey_seed_file"] if self.nkey_seed_file else [],
            ["creds_file"] if self.creds_file else []) if keys]
        if len(methods) > 1:
            found = " and ".join("/".join(f"nats.{k}" for k in keys) for keys in methods)
            raise ValueError(f"{found}: give at most one way to authenticate (user and password, "
                             f"a token, an NKey seed or a credentials file)")
        split_listen(self.listen)

    @property
    def joins(self) -> bool:
        """True when a URL is given: join that server instead of starting an embedded one."""
        return bool(self.url or self.urls)

    def listen_address(self) -> tuple[str, int]:
        """``listen`` as ``(host, port)`` (port 0: a free one)."""
        return split_listen(self.listen)


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

    def __post_init__(self) -> None:
        if not self.envs:
            raise ValueError("envs: no environment is configured; define at least one under envs:")
        if self.rollout.env not in self.envs:
            raise ValueError(f"rollout.env: {self.rollout.env!r} is not a key of envs; "
                             f"allowed: {', '.join(repr(k) for k in self.envs)}")
        _token("", "run", self.run)
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
        per_step = r.batch_groups * (r.group_size + r.redundancy)
        need = (t.checkpoint_every + r.alpha) * per_step
        buf = trainer_buffer(r)
        hc = self.actors.get("trainer", ActorConfig()).handlers.get("on_completed", HandlerConfig())
        room = min(hc.max_inflight or buf, hc.max_ack_pending or 2 * buf)
        if need <= room:
            return
        most = room // per_step - r.alpha
        fix = f"Set trainer.checkpoint_every <= {most}, or raise" if most >= 1 else "Raise"
        raise ValueError(
            f"trainer.checkpoint_every: the trainer acks trajectories only once a checkpoint covers "
            f"them, so it holds up to (trainer.checkpoint_every + rollout.alpha) * "
            f"rollout.batch_groups * (rollout.group_size + rollout.redundancy) = {need} deliveries, "
            f"but its on_completed handler takes {room} at once (max_inflight / max_ack_pending): "
            f"training would stop waiting for a batch. {fix} "
            f"actors.trainer.handlers.on_completed.max_inflight and max_ack_pending to >= {need}")


def trainer_buffer(rollout: RolloutConfig) -> int:
    """The trainer's default ``max_inflight`` on its input handlers (``max_ack_pending`` is
    twice this): deliveries held at once, un-acked until a checkpoint covers them."""
    r = rollout
    return max(256, 4 * (r.alpha + 2) * r.batch_groups * (r.group_size + r.redundancy))
