"""The RL pipeline: the ``model:``, ``envs:``, ``rollout:``, ``proxy:`` and ``reward:``
sections of a run's config (``trainer:`` is :mod:`rollart.config.trainer`). Checks that span
sections sit on :class:`rollart.config.schema.RunConfig`."""

from __future__ import annotations

from typing import Any, Literal

from rollart.config.base import Base, in_range
from rollart.envs.actions import compile_pattern


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
        in_range(self, k, "vocab_size", ge=TINY_MIN_VOCAB)
        in_range(self, k, "hidden_size num_layers num_heads num_kv_heads intermediate_size", ge=1)
        in_range(self, k, "seed", ge=0)
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
        in_range(self, "model.", "threads", ge=1)


class SamplingConfig(Base):
    max_new_tokens: int = 32
    """Tokens per turn at most (free-text turns)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are always reported at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""

    def __post_init__(self) -> None:
        in_range(self, "", "max_new_tokens", ge=1)
        in_range(self, "", "temperature", ge=0)
        in_range(self, "", "top_p", gt=0, le=1)


class EnvConfig(Base):
    """One environment kind that trajectories run in."""

    type: str = "frozenlake"
    """Built-in name (frozenlake, sokoban, reasoning_gym, humaneval, pyexpr), ``gym:<id>`` (any registered
    gymnasium environment), ``openenv:<url>`` (a running OpenEnv server, e.g.
    ``openenv:http://127.0.0.1:8000``; :mod:`rollart.envs.openenv`), ``pkg.module:Class``, or ``agent:pkg.module:function``: a user's
    agent that plays the trajectory through an OpenAI-compatible endpoint
    (:mod:`rollart.agents`; ``args`` go to it in its ``task``)."""
    args: dict[str, Any] = {}
    """Keyword arguments of the env class."""
    executor: Literal["thread", "process", "inline"] = "thread"
    """Where a sync env runs: ``thread``, ``process`` or ``inline``. A thread cannot be
    killed: a step that times out leaves it running (abandoned); in ``process`` the worker is
    killed. ``inline`` calls it on the EnvManager's event loop, without a thread hand-off per
    call: for envs whose steps take microseconds (the built-in FrozenLake and Sokoban; about
    0.08 ms of CPU less per turn, benchmarks/README.md "CPU per turn"); a call cannot be
    interrupted, and one slower than 5 ms is reported once."""
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
    max_trajectory_s: float | None = None
    """Wall-clock seconds one trajectory may take from its reset (None: ``rollout.
    max_trajectory_s``, else no limit). Past them it stops with ``max_time`` at its next turn,
    or inside a step that runs into the limit, and completes with the turns it has (truncated:
    trained as any trajectory that ran out of turns), so an env whose steps are each just
    under ``step_timeout`` cannot hold its group, and through α admission, for
    ``max_turns * step_timeout``."""
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
    check_seeds: int = 4
    """Task seeds the check resets (``rollout.seed`` on). It refuses the run only when every
    one fails (or on a construction or contract error); some failing is a warning with the
    count, since a run replaces the groups of a task that fails."""

    def __post_init__(self) -> None:
        in_range(self, "", "max_turns max_context_tokens check_seeds", ge=1)
        in_range(self, "", "reset_timeout step_timeout max_trajectory_s", gt=0)
        in_range(self, "", "reset_retries", ge=0)
        in_range(self, "", "max_abandoned_threads", ge=1)
        in_range(self, "", "format_penalty")
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
    affinity: bool = True
    """Send each turn of a trajectory to the generate replica that served its previous turn
    (within the pool ``route`` picked), so that its engine's KV cache of the trajectory is
    hit; a new trajectory goes to the live replica with the fewest this EnvManager pinned.
    A replica that went silent, drains, stops answering or holds more than 1.25 x its
    pool's mean requests + 2 is passed over. Needs ``replica_timeout`` > 0 (the replicas'
    progress reports); false: every turn goes to the pool's queue group."""
    local_calls: bool = True
    """A generate or reward call whose pool has exactly one live replica, and that replica
    runs in the EnvManager's own process (``node.local_processes`` putting ``generate`` and
    ``env`` in one child, ``--single-process``, ``--nats memory``), calls its handler
    directly instead of a round trip through the bus and nats-server: the same request and
    reply bytes, the same errors, retries and progress listing; the quickstart's plumbing per
    turn fell from 0.63 to 0.55 ms of CPU (benchmarks/README.md, "CPU per turn"). Such turns
    cross no subject, so ``rollart top`` and ``rollart tap`` do not see them (their timings
    are in each completion as always). With other live replicas of the pool, or when the
    local one stops or gives no answer within ``generate_timeout``, the bus path is taken.
    false: always the bus."""
    agent_host: str = "127.0.0.1"
    """Address the OpenAI-compatible endpoint of agent envs (``type: agent:pkg.module:fn``)
    listens on, one per EnvManager on a free port (the agents run in the EnvManager's
    process, so loopback serves them)."""
    agent_threads: int | None = None
    """Threads that run plain ``def`` agents (``async def`` ones run on the event loop), a
    pool the EnvManager owns, apart from asyncio's default executor that policy loading,
    payload hashing and reward scoring use; an agent beyond it waits for a free thread, and
    its wait counts against its deadline. None: ``concurrency`` (every running trajectory's
    agent at once)."""
    agent_max_connections: int | None = None
    """Connections the agent endpoint holds at most. Past it, a new connection closes the
    oldest one that has no request in progress (an idle or half-sent one), or is itself
    closed when every one has; None: ``4 * concurrency + 64``."""
    agent_request_timeout: float = 30.0
    """Seconds an agent's connection may take to send a request head, from when it opened or
    its previous response ended (bytes trickling in do not extend it; then it is closed),
    and again its body (then it is answered 408): a slow or idle client holds a connection
    no longer."""
    agent_max_request_bytes: int = 4 << 20
    """Largest request body the agent endpoint reads (4 MiB); a larger one is answered 413
    from its ``Content-Length`` before any of it is read (or once a chunked body passes
    it), and the trajectory is dead-lettered as ``agent_contract``. A conversation's text
    must also fit 16 characters per token of ``max_context_tokens`` before it is tokenised
    (else it ends as ``max_context``)."""
    ack_wait: float = 30.0
    """Seconds before an abandoned trajectory is redelivered (heartbeats hold live ones)."""
    max_trajectory_s: float | None = None
    """Default of ``envs.<name>.max_trajectory_s`` (None: no wall-clock limit)."""
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
    inline_max_bytes: int | None = None
    """Largest encoded ``rollout.completed`` sent inline in its message; a larger one (a long
    trajectory: ~15 bytes per token, so ~65k tokens at nats-server's default 1 MiB) is put in
    the run's trajectory object store and its message carries a reference, which consumers
    resolve (same msg id, dedupe and redelivery; handlers see one message). None: the
    server's ``max_payload`` less 64 KiB for headers; a value is capped at that (0: every
    completion through the object store)."""

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
        in_range(self, "rollout.", "group_size batch_groups concurrency", ge=1)
        in_range(self, "rollout.", "alpha redundancy generate_retries fail_after_groups seed", ge=0)
        in_range(self, "rollout.", "generate_timeout service_wait ack_wait max_trajectory_s", gt=0)
        in_range(self, "rollout.", "replica_timeout", ge=0)
        in_range(self, "rollout.", "inline_max_bytes", ge=0)
        in_range(self, "rollout.", "agent_threads agent_max_connections", ge=1)
        in_range(self, "rollout.", "agent_max_request_bytes", ge=1024)
        in_range(self, "rollout.", "agent_request_timeout", gt=0)


class ProxyConfig(Base):
    engine: Literal["torch", "vllm", "vllm-server", "sglang"] = "torch"
    """Generation engine of each LLMProxy: ``torch`` (built in, CPU or GPU), ``vllm``
    (``pip install 'rollart[vllm]'``; its CPU build runs here, in rollart's interpreter),
    ``vllm-server`` (a vLLM server driven over HTTP: launched and supervised by the node,
    from the interpreter ``engine_args.python`` names, or attached by ``engine_args.url``)
    or ``sglang`` (an SGLang server on a GPU, launched by the node or attached by URL). See
    ``engine_args``."""
    engine_args: dict[str, Any] = {}
    """Passed to the engine: for ``vllm`` fields of vLLM's ``AsyncEngineArgs``
    (``max_model_len``, ``gpu_memory_utilization``...); for ``vllm-server`` ``python``
    (the interpreter that runs the server), ``url`` and ``api_key_env`` (attach to a
    running server; the name of the variable holding its key), ``startup_timeout_s``,
    ``max_restarts``, ``env``, ``log_file``, ``weights_dir``, ``enable_lora`` and
    ``max_lora_rank`` (with ``trainer.lora``: versions served as vLLM LoRA adapters; on by
    default, ``max_lora_rank`` the smallest vLLM allows above ``trainer.lora.rank``;
    ``enable_lora: false`` sends merged full weights instead), and server flags
    (``max_model_len: 512`` -> ``--max-model-len 512``; see
    :class:`rollart.engines.vllm_server_engine.VllmServerEngine`);
    for ``sglang`` ``url`` (attach to a running server) or server arguments; for ``torch``
    ``kv_cache_mb``, ``dtype``, ``attn_implementation``, ``gather_max_ms``."""
    on_update: Literal["finish", "interrupt"] = "finish"
    """When a new policy version arrives: ``finish`` lets the requests in flight finish on the
    old weights, then loads; ``interrupt`` stops them, loads, and continues each from the
    tokens it had (a partial rollout: every token keeps the version that produced it)."""
    gather_ms: float = 2.0
    """Milliseconds to gather concurrent requests into one engine batch (``torch``)."""
    max_batch: int = 128
    """Requests per engine batch at most (``torch``)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The serving dtype: the torch engine's weights, and the dtype streamed versions
    (``trainer.sync.format: stream``) are cast to by the trainer. ``auto``: the model
    folder's ``torch_dtype`` when it is bfloat16 or float16, else float32."""

    def __post_init__(self) -> None:
        in_range(self, "proxy.", "gather_ms", ge=0)
        in_range(self, "proxy.", "max_batch", ge=1)
        given = self.engine_args.get("dtype") if isinstance(self.engine_args, dict) else None
        if self.dtype != "auto" and given is not None and given != self.dtype:
            raise ValueError(f"proxy.engine_args.dtype ({given!r}) and proxy.dtype ({self.dtype!r}) "
                             f"disagree: set proxy.dtype only")


class RewardConfig(Base):
    model_path: str | None = None
    """Local causal LM folder for the ``model_logprob`` scorer."""
    gather_ms: float = 2.0
    """Milliseconds to gather requests into one model forward pass."""

    def __post_init__(self) -> None:
        in_range(self, "reward.", "gather_ms", ge=0)
