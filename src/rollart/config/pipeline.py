"""The RL pipeline: the ``model:``, ``envs:``, ``rollout:``, ``proxy:``, ``reward:`` and
``trainer:`` sections of a run's config. Checks that span sections sit on
:class:`rollart.config.schema.RunConfig`."""

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
    """Built-in name (frozenlake, sokoban, reasoning_gym), ``gym:<id>`` (any registered
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


class MegatronConfig(Base):
    """``trainer.backend: megatron``: megatron-core's model-parallel sizes."""

    tensor_parallel: int = 1
    """Tensor-parallel size; 1 (the trainer runs on CPU, in one process)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size; 1 (as ``tensor_parallel``)."""

    def __post_init__(self) -> None:
        k = "trainer.megatron."
        in_range(self, k, "tensor_parallel pipeline_parallel", ge=1)
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) != 1:
                raise ValueError(f"{k}{name} must be 1 (it is {getattr(self, name)!r}): the trainer "
                                 "runs on CPU in one process, where megatron-core has no model parallelism")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Qwen3 attention and MLP projections: the default ``trainer.lora.targets``."""


class LoraConfig(Base):
    """``trainer.lora``: train low-rank adapters (``peft``) over a frozen base model."""

    rank: int = 8
    """Rank ``r`` of each adapter (``A``: r x in, ``B``: out x r)."""
    alpha: float = 16.0
    """Scale numerator: the update of a target weight is ``alpha / rank * B @ A``."""
    dropout: float = 0.0
    """Dropout on the adapters' input during the training step (0: off)."""
    targets: tuple[str, ...] = LORA_TARGETS
    """Names of the linear modules that get an adapter (peft ``target_modules``: a module
    whose name ends in one of them)."""

    def __post_init__(self) -> None:
        k = "trainer.lora."
        in_range(self, k, "rank", ge=1)
        in_range(self, k, "alpha", gt=0)
        in_range(self, k, "dropout", ge=0, lt=1)
        if not self.targets or not all(isinstance(t, str) and t.strip() for t in self.targets):
            raise ValueError(f"{k}targets must be a non-empty list of module names "
                             f"(it is {self.targets!r})")


class SyncConfig(Base):
    """``trainer.sync``: how a policy version travels to the generators."""

    format: Literal["file", "stream"] = "file"
    """``file``: one safetensors file per version (``trainer.weights`` says where).
    ``stream``: a manifest and buckets of ``bucket_mb``, deltas over the previous version in
    the serving dtype (``proxy.dtype``); generators assemble and check a version into a
    staging file before their engine loads it (README: Weight sync). LoRA versions (small
    adapters) keep the single file either way."""
    bucket_mb: float = 64.0
    """MiB of tensor data per bucket (``stream``): a generator's load holds about two."""
    delta: bool = True
    """``stream``: versions between anchors are XOR deltas over the previous one (false:
    every version is full, and the trainer keeps no base file of the last one)."""
    anchor_every: int = 8
    """``stream``: a full version every this many versions (a replica that lost track
    starts from the newest anchor)."""
    host: str = ""
    """``trainer.weights: tcp``: the address the trainer's weight server listens on ("": the
    address it advertises, ``advertise``; ``0.0.0.0``: every interface, only when asked)."""
    port: int = 0
    """``trainer.weights: tcp``: its port (0: any free port; the version's URI says which)."""
    advertise: str = ""
    """``trainer.weights: tcp``: the address generators reach the server at ("": this host's
    address on the route to the NATS server, 127.0.0.1 when that server is local)."""
    max_connections: int = 64
    """``trainer.weights: tcp``: connections the weight server serves at once; the next are
    answered ``busy`` (a generator asks again), so no peer holds a thread per connection."""
    tls: bool | Literal["auto"] = "auto"
    """``trainer.weights: tcp``: serve weights over TLS 1.3 with a certificate the server
    makes as it starts, pinned by generators through the run's weights store (no CA: the
    run's certificates are the NATS server's). ``auto``: on when the run's NATS connection
    uses TLS (``nats.tls`` or a ``tls://`` URL); ``false``: cleartext even then (faster: no
    ``sendfile`` under TLS; on 2 loopback cores 1.7 GB/s against 0.6). Needs
    ``rollart[secure]``."""
    max_bucket_mb: float | None = None
    """``stream``: the largest bucket (MiB of tensor data) a generator accepts from a
    manifest, checked before it allocates anything (None: twice ``bucket_mb``)."""
    max_version_gb: float = 1024.0
    """``stream``: the largest version (GiB of tensors) a generator accepts from a manifest,
    checked before it stages a byte."""

    def __post_init__(self) -> None:
        in_range(self, "trainer.sync.", "bucket_mb", gt=0)
        in_range(self, "trainer.sync.", "anchor_every", ge=1)
        in_range(self, "trainer.sync.", "port", ge=0, le=65535)
        in_range(self, "trainer.sync.", "max_connections", ge=1)
        in_range(self, "trainer.sync.", "max_version_gb", gt=0)
        if self.max_bucket_mb is not None:
            in_range(self, "trainer.sync.", "max_bucket_mb", ge=self.bucket_mb)


class TrainerConfig(Base):
    """Training: algorithm, optimizer, weight sync and checkpoints."""

    steps: int = 20
    """Optimizer steps (policy versions) to train."""
    init_from: str | None = None
    """Start from a supervised fine-tuned model: the run folder ``rollart sft`` wrote
    (``runs/<sft-run>``, whose ``model/`` is used) or any local HF model folder. It is the
    model folder of the whole run: the trainer's initial weights (and the KL reference), the
    generators' weights and the tokenizer; ``model.path`` and ``model.tiny`` are then not used
    (``model.threads`` still is). None: the model of ``model:``."""
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator (drgrpo: group mean baseline without std normalisation)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's ``(beta1, beta2)``. A lower beta2 (0.95, as LLM pre-training uses) forgets old
    gradient scales within tens of steps: a sudden large gradient moves each weight by about
    ``lr * (1 - beta1) / sqrt(1 - beta2)`` (0.45 lr at 0.95, 3.2 lr at 0.999), and after a
    spell of small gradients the steps are not damped by the large ones of long ago."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    warmup_steps: int = 0
    """Linear LR warm-up steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up."""
    schedule_clock: Literal["signal", "steps"] = "signal"
    """What moves the LR schedule (warm-up and cosine): ``signal``, every step but one in
    which every trained trajectory failed and no group carries a signal (all advantages 0):
    such a step teaches nothing but the entropy bonus, and a decay that runs on while a
    policy is stuck leaves it no learning rate to climb out with (a CI run of the quickstart
    sat at success 0 for 70 steps while its cosine ran out; from the same weights a fresh
    schedule climbed back within 10 steps). ``steps``: every optimizer step. Held steps are
    counted (``schedule_held`` per step, ``count_schedule_held`` in all)."""
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
    """Entropy bonus coefficient (with ``entropy_target``: the starting one)."""
    entropy_target: float | None = None
    """Adaptive entropy control (as in Skywork-OR1): keep the policy's entropy (nats per
    generated token, the step's mean) at or above this. After a step whose entropy was below
    it the coefficient rises by ``entropy_coef_step``, after one above it falls by as much,
    within 0 .. ``entropy_coef_max``; each step's coefficient is in the metrics
    (``entropy_coef``) and in the journal, so a resume trains with the same ones. What it
    is for: a near-deterministic policy that fails everywhere gets no policy gradient (every
    group fails alike), and a fixed small bonus barely moves it, so a coefficient that grows
    while the entropy is low is meant to bring exploration back. Measured on the quickstart
    (``benchmarks/README.md``, "adam-beta2" and ``collapse_recovery.py``): a target of 0.2
    made converged runs overshoot and dip, and at 0.05 it recovered from a flipped move no
    faster than the fixed bonus; off in the packaged configs. The entropy's gradient itself
    vanishes at an exactly one-hot policy, which no coefficient fixes. None: the coefficient
    is fixed."""
    entropy_coef_step: float = 0.005
    """``entropy_target``: how much the coefficient moves per step."""
    entropy_coef_max: float = 0.1
    """``entropy_target``: the largest coefficient."""
    skip_uniform: int = 0
    """DAPO's dynamic sampling: per step, skip up to this many ready groups whose rewards are
    all equal (every advantage is 0: no policy gradient, only a smaller step for the rest under
    token-mean). A skipped group frees its admission place, so a fresh group replaces it; once
    the step's budget is spent, uniform groups are trained as before (a step never waits for
    more than ``batch_groups + skip_uniform`` groups). Sampled ``success`` and ``reward`` in the
    metrics count the skipped groups too; ``groups_skipped`` (per step) and
    ``count_uniform_skipped`` (in all) count them, ``groups_lost`` does not. 0: off."""
    skip_which: Literal["all", "failed"] = "all"
    """Which uniform groups ``skip_uniform`` skips: ``all`` (DAPO), or ``failed``: only groups
    in which no member succeeded, so a policy that already succeeds everywhere does not pay
    for up to ``skip_uniform`` extra groups a step that it would skip."""
    skip_while_training: bool = False
    """``skip_uniform`` with ``rollout.alpha >= 1``: while a step trains, skip the next step's
    uniform groups as they come in, so admission replaces them during the step, under the
    policy the step started from, instead of after it under the new one. Faster steps, staler
    data: on the quickstart (2 cores) 0.86x the plain loop's s/step against 0.96x, mean
    staleness 0.94-0.98 against 0.86-0.89, and the first step with sampled success 0.5
    came at 48 and never (100 steps) on two runs against 29 and 46 without it
    (``benchmarks/README.md``). Off: the groups are judged when the step needs them. The
    metrics count them in ``count_skipped_while_training`` (also in ``groups_skipped``)."""
    kl_coef: float = 0.0
    """k3 KL penalty to the initial policy."""
    micro_batch_tokens: int = 8192
    """Padded tokens per micro-batch (gradient accumulation above it)."""
    backend: Literal["torch", "megatron"] = "torch"
    """What computes the step: ``torch`` (the HF model in plain PyTorch) or ``megatron``
    (the same Qwen3 model as megatron-core's ``GPTModel``, ``pip install 'rollart[megatron]'``;
    weights are converted from and back to HF names, so generators load them unchanged)."""
    megatron: MegatronConfig = MegatronConfig()
    """Settings of ``backend: megatron``."""
    lora: LoraConfig | None = None
    """LoRA (``peft``): train adapters only, over the frozen base model (``backend: torch``);
    a published version is the adapter file, which ``proxy.engine: torch`` replicas apply
    over the base (other engines get the merged weights). None: full fine-tuning."""
    weights: Literal["file", "object", "shm", "tcp"] = "file"
    """Where weights travel: the run folder (shared filesystem), the bus object store, or
    (``sync.format: stream`` only) ``shm``: ``/dev/shm/rollart-<run>``, for generators on
    the trainer's host, or ``tcp``: the trainer's own weight server (``sync.host``,
    ``sync.port``), which generators on any host read at socket speed (the object store
    moves ~0.2 GB/s here: ``benchmarks/weight_sync.py``)."""
    sync: SyncConfig = SyncConfig()
    """How versions travel: one file each, or streamed buckets and deltas."""
    checkpoint_store: Literal["file", "object"] = "file"
    """Where the checkpoint lives: the run folder only (``file``), or also the run's object
    store (``object``: each checkpoint and the metrics record are put there before the
    trajectories it covers are acked, and a head node whose run folder has no checkpoint takes
    them from the store, so the head can move to a host without the old run folder; needs
    ``weights: object``)."""
    checkpoint_every: int = 1
    """Steps between checkpoints; trajectories are acked only once checkpointed. A checkpoint
    is the small durable state (ledger, counters, version) plus a journal of the steps since
    the last full checkpoint (the trajectories each trained on, in order): a resume loads the
    last full checkpoint and trains the journaled steps again, losing nothing and training
    nothing twice (:mod:`rollart.actors.trainer.checkpoint`)."""
    full_checkpoint_every: int = 10
    """Steps between full checkpoints (model, optimizer, scheduler, RNG: 16 bytes a
    parameter in fp32 with AdamW), taken at the first checkpoint this many versions after
    the previous one, and at the last step. Each is copied to CPU memory (the step waits for
    that copy only) and written by a thread while the next steps train, one write at a time.
    A resume trains the steps since the last one again, so this bounds the work a crash
    costs, never what it loses."""
    full_checkpoint_s: float | None = None
    """Seconds after which a checkpoint is a full one even before ``full_checkpoint_every``
    steps (a bound on the replay after a crash when steps are slow); None: steps only."""
    keep_weights: int = 3
    """Weight files kept on disk (older versions are deleted)."""
    seed: int = 0
    """Seed of the trainer."""
    eval_groups: int = 4
    """Groups of the greedy evaluation at the end of ``rollart run`` (held-out seeds), and of
    each evaluation ``eval_every`` asks for."""
    eval_every: int = 0
    """Every this many steps, the version just trained is evaluated on ``eval_groups``
    held-out groups, greedy and sampled, beside training (the trainer does not wait for it,
    and its time is in no step's): a row of ``eval.jsonl``, the plot, ``rollart report`` and
    the loggers (``eval/``). 0: only the final evaluation."""
    eval_sampled_groups: int | None = None
    """Held-out tasks of the sampled half of each ``eval_every`` evaluation (a group of
    ``rollout.group_size`` trajectories each, the first of the greedy half's tasks); None:
    ``eval_groups``. The sampled half is most of an evaluation's cost (256 tasks: 256 greedy
    and 2048 sampled trajectories), so a smaller one makes frequent evaluations cheap."""
    expect_success: float | None = None
    """The final greedy success a run of this config should reach (None: no expectation).
    Below it the run says it did not learn: one line with the last sampled success values and
    the command that continues it, and ``below_expected`` in ``summary.json``."""
    eval_timeout: float = 600.0
    """Seconds the final evaluation may take; past them the run ends without its result
    (logged as an error) instead of waiting for ever."""
    stall_after: float = 120.0
    """Seconds the trainer waits for a batch before it says what it waits for (groups,
    queued work, pools without a live node), then again every minute or so."""
    world_size: int = 1
    """Trainer ranks (processes) computing each step, over ``torch.distributed`` (gloo on CPU,
    nccl on GPU): rank 0 is the trainer on the bus, each rank computes its share of the
    step's samples and the gradients are all-reduced. Without ``master`` rank 0 starts the
    other ranks on its own host (logs ``logs/trainer-rank<R>.log``)."""
    dist_timeout: float = 120.0
    """Seconds a collective between trainer ranks may take; a rank that died or hangs fails
    the step within them (the run stops, naming the rank)."""
    master: str | None = None
    """``HOST:PORT`` where rank 0 listens for the other ranks, which are then started by hand
    on any host: ``python -m rollart.node --config C --roles trainer --rank R``. None:
    127.0.0.1 on a free port, every rank on the trainer's host."""

    def __post_init__(self) -> None:
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("trainer.init_from must be a folder (runs/<sft-run> or a model "
                             "folder), or null for the model of model:")
        if self.stall_after <= 0:
            raise ValueError("trainer.stall_after must be > 0 seconds")
        if self.weights in ("shm", "tcp") and self.sync.format != "stream":
            raise ValueError(f"trainer.weights: {self.weights} needs trainer.sync.format: stream "
                             f"(the single-file layout reads its files from the run folder)")
        if self.checkpoint_store == "object" and self.weights != "object":
            raise ValueError("trainer.checkpoint_store: object needs trainer.weights: object (a "
                             "head on another host serves the weights from the store too)")
        k = "trainer."
        in_range(self, k, "steps micro_batch_tokens checkpoint_every full_checkpoint_every "
                          "keep_weights eval_groups eval_sampled_groups", ge=1)
        in_range(self, k, "full_checkpoint_s", gt=0)
        in_range(self, k, "lr grad_clip is_cap stall_after eval_timeout", gt=0)
        in_range(self, k, "weight_decay warmup_steps clip_high entropy_coef kl_coef seed skip_uniform "
                          "eval_every entropy_coef_step entropy_coef_max", ge=0)
        in_range(self, k, "entropy_target", gt=0)
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"{k}adam_betas must be two numbers in [0, 1) (it is {list(self.adam_betas)})")
        if self.entropy_target is not None and self.entropy_coef > self.entropy_coef_max:
            raise ValueError(f"{k}entropy_coef ({self.entropy_coef}) is above {k}entropy_coef_max "
                             f"({self.entropy_coef_max}): the adaptive coefficient starts at the "
                             f"first and stays at or below the second")
        in_range(self, k, "clip_low", ge=0, lt=1)  # the ratio is clipped below at 1 - clip_low
        in_range(self, k, "expect_success", ge=0, le=1)
        in_range(self, k, "world_size", ge=1)
        in_range(self, k, "dist_timeout", gt=0)
        if self.world_size > 1 and getattr(self, "backend", "torch") != "torch":
            raise ValueError(f"{k}world_size > 1 needs {k}backend: torch (it is {self.backend!r})")
        if self.lora is not None and self.backend != "torch":
            raise ValueError(f"{k}lora needs {k}backend: torch (it is {self.backend!r})")
        if self.master is not None:
            host, _, port = self.master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{k}master must be HOST:PORT (it is {self.master!r})")
