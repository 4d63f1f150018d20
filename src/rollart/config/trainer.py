"""The ``trainer:`` section: its keys stay flat in YAML (``trainer.lr``, ``trainer.eval_every``),
and the Python groups them by concern, one class per concern, each with its own checks.

msgspec Structs take fields from a single line of bases (two bases with fields conflict), so
the concerns are a chain, each class adding its keys to the one before: optimisation, the
loss, which groups a step skips, what computes the step, how weights travel, checkpoints,
evaluation, and :class:`TrainerConfig` itself (the run's length and start). Nested sections
(``trainer.sync``, ``trainer.lora``, ``trainer.megatron``) have their own Structs here too.
A check that spans two concerns sits on the later class, where both are visible.
"""

from __future__ import annotations

from typing import Literal

from rollart.config.base import Base, in_range


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

    format: Literal["file", "stream"] = "stream"
    """``stream`` (the default): a manifest and buckets of ``bucket_mb``, deltas over the
    previous version in the serving dtype (``proxy.dtype``); generators assemble and check a
    version into a staging file before their engine loads it (docs: Weight sync).
    ``file``: one safetensors file per version in the run folder (``trainer.weights`` says
    where), for those who want a plain file per version. LoRA versions (small adapters) keep
    the single file either way."""
    bucket_mb: float = 64.0
    """MiB of tensor data per bucket (``stream``): a generator's load holds about two."""
    delta: bool = True
    """``stream``: versions between anchors are XOR deltas over the previous one (false:
    every version is full, and the trainer keeps no base file of the last one)."""
    anchor_every: int = 8
    """``stream``: a full version every this many versions (a replica that lost track
    starts from the newest anchor)."""
    host: str = ""
    """``trainer.weights: tcp`` or ``auto``: the address the trainer's weight server listens on ("": the
    address it advertises, ``advertise``; ``0.0.0.0``: every interface, only when asked)."""
    port: int = 0
    """``trainer.weights: tcp`` or ``auto``: its port (0: any free port; the version's URI says which)."""
    advertise: str = ""
    """``trainer.weights: tcp`` or ``auto``: the address generators reach the server at ("": this host's
    address on the route to the NATS server, 127.0.0.1 when that server is local)."""
    max_connections: int = 64
    """``trainer.weights: tcp`` or ``auto``: connections the weight server serves at once; the next are
    answered ``busy`` (a generator asks again), so no peer holds a thread per connection."""
    tls: bool | Literal["auto"] = "auto"
    """``trainer.weights: tcp`` or ``auto``: serve weights over TLS 1.3 with a certificate the server
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



class OptimizerKeys(Base):
    """``trainer:`` keys of the optimizer and its learning-rate schedule."""

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
    micro_batch_tokens: int = 8192
    """Padded tokens per micro-batch (gradient accumulation above it)."""
    seed: int = 0
    """Seed of the trainer."""

    def __post_init__(self) -> None:
        k = "trainer."
        in_range(self, k, "micro_batch_tokens", ge=1)
        in_range(self, k, "lr grad_clip", gt=0)
        in_range(self, k, "weight_decay warmup_steps seed", ge=0)
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"{k}adam_betas must be two numbers in [0, 1) (it is {list(self.adam_betas)})")


class LossKeys(OptimizerKeys):
    """``trainer:`` keys of the policy loss: advantages, PPO clipping, importance weights,
    entropy and KL terms."""

    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp"] = "grpo"
    """Advantage estimator (drgrpo: group mean baseline without std normalisation)."""
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
    kl_coef: float = 0.0
    """k3 KL penalty to the initial policy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        k = "trainer."
        in_range(self, k, "is_cap", gt=0)
        in_range(self, k, "clip_high entropy_coef kl_coef entropy_coef_step entropy_coef_max", ge=0)
        in_range(self, k, "entropy_target", gt=0)
        if self.entropy_target is not None and self.entropy_coef > self.entropy_coef_max:
            raise ValueError(f"{k}entropy_coef ({self.entropy_coef}) is above {k}entropy_coef_max "
                             f"({self.entropy_coef_max}): the adaptive coefficient starts at the "
                             f"first and stays at or below the second")
        in_range(self, k, "clip_low", ge=0, lt=1)  # the ratio is clipped below at 1 - clip_low


class SkipKeys(LossKeys):
    """``trainer:`` keys of DAPO's dynamic sampling: which uniform groups a step skips."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        in_range(self, "trainer.", "skip_uniform", ge=0)


class ComputeKeys(SkipKeys):
    """``trainer:`` keys of what computes the step: the backend, LoRA, and the ranks."""

    backend: Literal["torch", "megatron"] = "torch"
    """What computes the step: ``torch`` (the HF model in plain PyTorch) or ``megatron``
    (the same Qwen3 model as megatron-core's ``GPTModel``, ``pip install 'rollart[megatron]'``;
    weights are converted from and back to HF names, so generators load them unchanged)."""
    megatron: MegatronConfig = MegatronConfig()
    """Settings of ``backend: megatron``."""
    lora: LoraConfig | None = None
    """LoRA (``peft``): train adapters only, over the frozen base model (``backend: torch``);
    a published version is the adapter file, which ``proxy.engine: torch`` replicas apply
    over the base and ``vllm-server`` replicas load as a vLLM LoRA adapter
    (``proxy.engine_args.enable_lora``, on by default); ``vllm`` and ``sglang`` get the
    merged weights. None: full fine-tuning."""
    world_size: int = 1
    """Trainer ranks (processes) computing each step, over ``torch.distributed`` (gloo on CPU,
    nccl on GPU): rank 0 is the trainer on the bus, each rank computes its share of the
    step's samples and the gradients are all-reduced. Without ``master`` rank 0 starts the
    other ranks on its own host (logs ``logs/trainer-rank<R>.log``)."""
    shard: Literal["none", "fsdp2"] = "none"
    """How ``world_size`` ranks hold the model: ``none``, every rank a replica of the model
    and AdamW state (gradients all-reduced); ``fsdp2``, torch's ``fully_shard`` on each
    decoder layer and the root: parameters, gradients and AdamW moments split over the ranks
    (each holds about ``1 / world_size`` of them, gathered a layer at a time for the forward
    and backward), the same update as one rank within float tolerance, full tensors gathered
    one at a time to publish a version. Needs ``backend: torch``; ``lora`` is refused with it
    (LoRA's trained state is small: the replicated ranks fit it)."""
    dist_timeout: float = 120.0
    """Seconds a collective between trainer ranks may take; a rank that died or hangs fails
    the step within them (the run stops, naming the rank)."""
    master: str | None = None
    """``HOST:PORT`` where rank 0 listens for the other ranks, which are then started by hand
    on any host: ``python -m rollart.node --config C --roles trainer --rank R``. None:
    127.0.0.1 on a free port, every rank on the trainer's host."""

    def __post_init__(self) -> None:
        super().__post_init__()
        k = "trainer."
        in_range(self, k, "world_size", ge=1)
        in_range(self, k, "dist_timeout", gt=0)
        if self.world_size > 1 and self.backend != "torch":
            raise ValueError(f"{k}world_size > 1 needs {k}backend: torch (it is {self.backend!r})")
        if self.shard == "fsdp2":
            if self.backend != "torch":
                raise ValueError(f"{k}shard: fsdp2 needs {k}backend: torch (it is {self.backend!r}: "
                                 f"megatron-core shards its own way)")
            if self.lora is not None:
                raise ValueError(f"{k}shard: fsdp2 does not train {k}lora adapters: the adapters "
                                 f"and their AdamW state are small, so {k}shard: none (replicated "
                                 f"ranks) fits them; or drop {k}lora to shard a full fine-tuning")
        if self.lora is not None and self.backend != "torch":
            raise ValueError(f"{k}lora needs {k}backend: torch (it is {self.backend!r})")
        if self.master is not None:
            host, _, port = self.master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{k}master must be HOST:PORT (it is {self.master!r})")


class WeightKeys(ComputeKeys):
    """``trainer:`` keys of how policy versions reach the generators."""

    weights: Literal["auto", "file", "object", "shm", "tcp"] = "auto"
    """Where weights travel. ``auto`` (the default): with ``sync.format: stream`` the trainer
    writes each version to shared memory (``/dev/shm/rollart-<run>-<key>``; its run folder's
    ``weights/stream`` when shared memory lacks room for a few versions, with the reason
    logged) and serves that folder on its weight server (``sync.host``, ``sync.port``); each
    generator reads the folder directly when it runs on the trainer's host (same boot and
    network namespace, and the folder is there) and over TCP otherwise, and reports which
    (``policy.loaded``'s ``route``); with ``sync.format: file``, the run folder.
    ``file``: the run folder (a shared filesystem). ``object``: the bus object store (a
    generator with no route to the trainer's host; ~0.2 GB/s here:
    ``benchmarks/weight_sync.py``). ``stream`` only: ``shm``, the shared-memory folder alone
    (generators on the trainer's host only), or ``tcp``, the weight server alone."""
    sync: SyncConfig = SyncConfig()
    """How versions travel: one file each, or streamed buckets and deltas."""
    keep_weights: int = 3
    """Weight files kept on disk (older versions are deleted)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights in ("shm", "tcp") and self.sync.format != "stream":
            raise ValueError(f"trainer.weights: {self.weights} needs trainer.sync.format: stream "
                             f"(the single-file layout reads its files from the run folder)")
        in_range(self, "trainer.", "keep_weights", ge=1)


class CheckpointKeys(WeightKeys):
    """``trainer:`` keys of checkpoints: how often, how full, and where they live."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint_store == "object" and self.weights != "object":
            raise ValueError("trainer.checkpoint_store: object needs trainer.weights: object (a "
                             "head on another host serves the weights from the store too)")
        in_range(self, "trainer.", "checkpoint_every full_checkpoint_every", ge=1)
        in_range(self, "trainer.", "full_checkpoint_s", gt=0)


class EvalKeys(CheckpointKeys):
    """``trainer:`` keys of the held-out evaluations, during the run and at its end."""

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
    eval_share: float = 0.25
    """The share of ``rollout.concurrency`` an ``eval_every`` evaluation may hold at once: its
    scheduler keeps at most that many trajectories in flight (whole groups, at least one), so
    training's requests never queue behind hundreds of held-out ones and its steps go on
    while it runs. The final evaluation, alone after training, takes all."""
    expect_success: float | None = None
    """The final greedy success a run of this config should reach (None: no expectation).
    Below it the run says it did not learn: one line with the last sampled success values and
    the command that continues it, and ``below_expected`` in ``summary.json``."""
    eval_timeout: float = 600.0
    """Seconds the final evaluation may take; past them the run ends without its result
    (logged as an error) instead of waiting for ever."""

    def __post_init__(self) -> None:
        super().__post_init__()
        k = "trainer."
        in_range(self, k, "eval_groups eval_sampled_groups", ge=1)
        in_range(self, k, "eval_timeout", gt=0)
        in_range(self, k, "eval_every", ge=0)
        in_range(self, k, "expect_success", ge=0, le=1)
        in_range(self, k, "eval_share", gt=0, le=1)


class TrainerConfig(EvalKeys):
    """Training: algorithm, optimizer, weight sync and checkpoints (the keys of each concern
    are on the classes above; these are the run's length and start)."""

    steps: int = 20
    """Optimizer steps (policy versions) to train."""
    init_from: str | None = None
    """Start from a supervised fine-tuned model: the run folder ``rollart sft`` wrote
    (``runs/<sft-run>``, whose ``model/`` is used) or any local HF model folder. It is the
    model folder of the whole run: the trainer's initial weights (and the KL reference), the
    generators' weights and the tokenizer; ``model.path`` and ``model.tiny`` are then not used
    (``model.threads`` still is). None: the model of ``model:``."""
    stall_after: float = 120.0
    """Seconds the trainer waits for a batch before it says what it waits for (groups,
    queued work, pools without a live node), then again every minute or so."""

    def __post_init__(self) -> None:
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("trainer.init_from must be a folder (runs/<sft-run> or a model "
                             "folder), or null for the model of model:")
        if self.stall_after <= 0:
            raise ValueError("trainer.stall_after must be > 0 seconds")
        super().__post_init__()
        in_range(self, "trainer.", "steps", ge=1)
        in_range(self, "trainer.", "stall_after", gt=0)
