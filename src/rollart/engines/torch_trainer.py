"""Training backend for a Hugging Face causal LM in plain PyTorch (CPU or one GPU).

One ``train_step`` = one optimizer step = one policy version. Samples are split into
micro-batches by a padded-token budget and gradients are accumulated so that the result
equals one big batch (the micro-batch loss is weighted by its share of the aggregation
denominator, see ``rollart.algos.reduce.agg_units``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields

import torch
from safetensors.torch import _TYPES, save_file

from rollart.algos.losses import LossConfig, kl_k3, kl_k3_per_token, policy_loss
from rollart.algos.reduce import agg_units, aggregate, masked_mean
from rollart.engines.digest import TensorDigest, file_content_digest
from rollart.engines.train_samples import TrainSample, collate, sequence_logprobs

log = logging.getLogger(__name__)

SCHEDULES = ("constant", "cosine")


def as_loss_config(cfg: object) -> LossConfig:
    """A ``LossConfig`` from None, a LossConfig, a mapping, or any object with those attributes."""
    if cfg is None:
        return LossConfig()
    if isinstance(cfg, LossConfig):
        return cfg
    names = [f.name for f in fields(LossConfig)]
    if isinstance(cfg, Mapping):
        unknown = set(cfg) - set(names)
        if unknown:
            raise ValueError(f"unknown loss config keys {sorted(unknown)}; allowed: {', '.join(names)}")
        return LossConfig(**cfg)
    return LossConfig(**{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})


def _lr_factor(step: int, *, warmup: int, total: int | None, schedule: str, min_ratio: float) -> float:
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TorchTrainBackend:
    """A causal LM from a local HF directory, AdamW, an LR schedule, and the RL losses.

    ``version`` is the number of optimizer steps taken. The model is kept in eval mode
    (no dropout) so that its log-probs match the rollout engine's. ``threads`` sets
    ``torch.set_num_threads`` for the whole process.

    ``lora`` (``{rank, alpha, dropout, targets}``, ``trainer.lora``): the model is wrapped
    once with peft's LoRA (:mod:`rollart.engines.lora`), only the adapters are trained and in
    the optimizer, the checkpoint holds the adapters, and a version is the adapter file
    (``publish="adapter"``, :attr:`weights_kind` ``"lora"``) or the merged weights
    (``publish="merged"``, for engines that load full weights only). The KL reference is the
    same model with its adapters disabled (the base is loaded once).
    """

    def __init__(self, model_dir: str | os.PathLike, *, lr: float = 1e-6, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), grad_clip: float | None = 1.0,
                 warmup_steps: int = 0, total_steps: int | None = None, schedule: str = "constant",
                 min_lr_ratio: float = 0.0, threads: int | None = 1, seed: int = 0,
                 micro_batch_tokens: int = 4096, device: str = "cpu", dtype: str = "float32",
                 lora: Mapping | None = None, publish: str = "adapter") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if schedule == "cosine" and not total_steps:
            raise ValueError("schedule 'cosine' needs total_steps")
        if micro_batch_tokens < 1:
            raise ValueError("micro_batch_tokens must be >= 1")
        if publish not in ("adapter", "merged"):
            raise ValueError(f"publish must be 'adapter' or 'merged', got {publish!r}")
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        random.seed(seed)
        self.model_dir = str(model_dir)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.grad_clip = grad_clip
        self.micro_batch_tokens = micro_batch_tokens
        self.version = 0
        self.lora = dict(lora) if lora is not None else None
        self.publish = publish
        self.model = self._load_model()
        self._dropouts: list[torch.nn.Module] = []
        if self.lora is not None:
            from rollart.engines.lora import wrap_model

            self.model = wrap_model(self.model, **self.lora).eval()
            self._dropouts = [mod for name, mod in self.model.named_modules()
                              if name.rsplit(".", 1)[-1] == "default" and ".lora_dropout" in name
                              and isinstance(mod, torch.nn.Dropout)]
        else:
            self.model.requires_grad_(True)
        self._ref: torch.nn.Module | None = None
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        factor = functools.partial(_lr_factor, warmup=warmup_steps, total=total_steps,
                                   schedule=schedule, min_ratio=min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM  # optional dependency

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype, local_files_only=True)
        return model.to(self.device).eval()

    @property
    def weights_kind(self) -> str:
        """What :meth:`save_weights` writes: ``"lora"`` (an adapter over the base model) or
        ``"full"`` (every weight of the model)."""
        return "lora" if self.lora is not None and self.publish == "adapter" else "full"

    def _reference(self) -> torch.nn.Module:
        """The frozen initial policy (loaded from ``model_dir`` on first use; with LoRA the
        base model itself, used with the adapters disabled)."""
        if self.lora is not None:
            return self.model
        if self._ref is None:
            self._ref = self._load_model().requires_grad_(False)
        return self._ref

    def micro_batches(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        """The micro-batches a pass over `samples` runs in, longest first: each holds at most
        ``micro_batch_tokens`` padded tokens (a single longer sample gets one of its own)."""
        out: list[list[TrainSample]] = []
        cur: list[TrainSample] = []
        for s in sorted(samples, key=lambda s: -len(s.token_ids)):
            longest = len(cur[0].token_ids) if cur else len(s.token_ids)
            if cur and longest * (len(cur) + 1) > self.micro_batch_tokens:
                out.append(cur)
                cur = []
            cur.append(s)
        return out + ([cur] if cur else [])

    @torch.no_grad()
    def token_logprobs(self, batch: Sequence[TrainSample | Sequence[int]]) -> list[torch.Tensor]:
        """Per-token log-probs under the current policy, one float32 CPU tensor per sample,
        aligned with ``token_ids`` (entry 0 is 0). Plain token lists are unconstrained."""
        samples = [s if isinstance(s, TrainSample) else
                   TrainSample(list(s), [0] * len(s), [0.0] * len(s), 0.0) for s in batch]
        result: dict[int, torch.Tensor] = {}
        for mb in self.micro_batches(samples):
            logp, _ = sequence_logprobs(self.model, collate(mb, self.device))
            for row, s in zip(logp, mb):
                result[id(s)] = row[: len(s.token_ids)].float().cpu()
        return [result[id(s)] for s in samples]

    def accumulate_gradients(self, samples: Sequence[TrainSample], *, loss_cfg: object = None) -> dict:
        """Forward/backward over micro-batches, adding into ``.grad`` (no optimizer step).

        ``old_logp`` for ``old_logp='recompute'`` is the current policy's log-prob detached
        from the same forward pass, taken before any backward of this step: with one
        optimizer step per batch it is exactly the pre-step policy (ratio == 1 in value).
        Micro-batch ``k`` is back-propagated with weight ``units_k / units_total``.
        Returned metrics are batch-level: ``loss``/``pg_loss`` with the loss weights, the
        rest as response-token means.
        """
        cfg = as_loss_config(loss_cfg)
        masks = [torch.tensor(s.response_mask) for s in samples]
        units_total = sum(agg_units(m, cfg.agg) for m in masks)
        tokens_total = int(sum(m.sum().item() for m in masks))
        if units_total == 0:
            raise ValueError("no response tokens in the batch")
        sums = dict.fromkeys(("loss", "pg_loss", "entropy", "kl", "clip_frac", "ratio_mean",
                              "is_weight_mean", "is_capped_frac", "approx_kl"), 0.0)
        with self._adapter_dropout():
            self._accumulate(samples, cfg, units_total, tokens_total, sums)
        return {**sums, "tokens": tokens_total, "samples": len(samples)}

    def _base_only(self):
        """A context in which the model is the base (LoRA: adapters disabled)."""
        import contextlib

        return self.model.disable_adapter() if self.lora is not None else contextlib.nullcontext()

    def _adapter_dropout(self):
        """A context with the adapters' dropout on (``lora.dropout`` > 0; the rest of the model
        stays in eval mode)."""
        import contextlib

        @contextlib.contextmanager
        def on():
            for mod in self._dropouts:
                mod.train()
            try:
                yield
            finally:
                for mod in self._dropouts:
                    mod.eval()

        return on() if self._dropouts and self.lora.get("dropout") else contextlib.nullcontext()

    def _accumulate(self, samples: Sequence[TrainSample], cfg: LossConfig, units_total: float,
                    tokens_total: int, sums: dict) -> None:
        for mb in self.micro_batches(samples):
            self._micro_batch(mb, cfg, units_total, tokens_total, sums)

    def _micro_batch(self, mb: Sequence[TrainSample], cfg: LossConfig, units_total: float,
                     tokens_total: int, sums: dict, *, always_backward: bool = False) -> None:
        """Forward and backward of one micro-batch (weight ``units / units_total``), its
        metrics added into ``sums``; ``always_backward``: back-propagate a weight of 0 too
        (sharded ranks: every rank runs the same collectives in its backward)."""
        batch = collate(mb, self.device)
        mask = batch.response_mask
        logp, ent = sequence_logprobs(self.model, batch, with_entropy=True,
                                      entropy_grad=cfg.entropy_coef != 0)
        old = batch.behav if cfg.old_logp == "behav" else logp.detach()
        pg, m = policy_loss(logp, old, batch.adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                            agg=cfg.agg, behav_logp=batch.behav if cfg.uses_behav else None,
                            is_cap=cfg.is_cap, decoupled=cfg.decoupled)
        total = pg
        if cfg.entropy_coef:
            total = total - cfg.entropy_coef * aggregate(ent, mask, cfg.agg)
        if cfg.kl_coef:
            with torch.no_grad(), self._base_only():
                ref, _ = sequence_logprobs(self._reference(), batch)
            total = total + cfg.kl_coef * kl_k3(logp, ref, mask, cfg.agg)
            m["kl"] = masked_mean(kl_k3_per_token(logp.detach(), ref), mask).item()
        weight = agg_units(mask, cfg.agg) / units_total
        if weight > 0 or always_backward:
            (total * weight).backward()
        share = mask.sum().item() / max(1, tokens_total)
        m["entropy"] = masked_mean(ent.detach(), mask).item()
        sums["loss"] += total.item() * weight
        sums["pg_loss"] += pg.item() * weight
        for k, v in m.items():
            sums[k] += v * share

    def train_step(self, samples: Sequence[TrainSample], *, loss_cfg: object = None) -> dict:
        """One optimizer step on ``samples``; returns metrics (loss, pg_loss, grad_norm (before
        clipping), lr (used by this step; the schedule moves after it unless ``loss_cfg``'s
        ``advance_schedule`` is false), entropy, kl, clip_frac, ratio_mean, is_weight_mean,
        is_capped_frac, approx_kl, tokens, samples, seconds, version, skipped). A non-finite
        gradient norm skips the update (``skipped=1``, version unchanged)."""
        t0 = time.perf_counter()
        loss_cfg = as_loss_config(loss_cfg)
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(samples, loss_cfg=loss_cfg)
        max_norm = self.grad_clip if self.grad_clip else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))
        lr = self.scheduler.get_last_lr()[0]
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("non-finite grad norm %s at version %d: update skipped", grad_norm, self.version)
        else:
            self.optimizer.step()
            if loss_cfg.advance_schedule:
                self.scheduler.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(grad_norm=grad_norm, lr=lr, version=self.version, skipped=float(skipped),
                       seconds=time.perf_counter() - t0)
        return metrics

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """What a version is, on CPU, contiguous: the state dict (LoRA: the adapter's tensors
        under peft's names, or the merged weights); tensors sharing storage (tied
        embeddings) appear once per name, as copies."""
        if self.lora is not None:
            from rollart.engines import lora

            if self.publish == "adapter":
                return lora.adapter_tensors(self.model)
            state = lora.merged_tensors(self.model)
        else:
            state = self.model.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in state.items():
            t = t.detach().to("cpu")
            ptr = t.untyped_storage().data_ptr()
            tensors[name] = t.clone().contiguous() if ptr in seen else t.contiguous()
            seen.add(ptr)
        return tensors

    def weights_digest(self) -> str:
        """The content digest (``"tensors-sha256:<hex>"``, see
        :func:`rollart.engines.digest.file_content_digest`) of the current weights, without
        writing them: equal to what :meth:`save_weights` would return now."""
        return tensors_digest(self.weight_tensors())

    def save_weights(self, path: str | os.PathLike) -> str:
        """Write the model's state dict as one safetensors file (atomically: temp file,
        fsync, rename) and return the file's content digest ``"tensors-sha256:<hex>"``
        (tensor names, dtypes, shapes and data; independent of the header's byte order)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        meta = {"format": "pt", "rollart_version": str(self.version)}
        if self.weights_kind == "lora":
            from rollart.engines.lora import adapter_metadata

            meta.update(adapter_metadata(self.lora["rank"], self.lora["alpha"], self.lora["targets"]))
        save_file(self.weight_tensors(), tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return file_content_digest(path)

    def state_dict_for_checkpoint(self) -> dict:
        """Model (LoRA: the adapters only, and ``lora``: their settings), optimizer,
        scheduler, RNG states and version, ready for ``torch.save``. The tensors are live
        views of the training state: save them before the next step."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        state = {"model": self._trained_state(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "rng": rng, "version": self.version}
        if self.lora is not None:
            state["lora"] = {k: (list(v) if k == "targets" else v) for k, v in self.lora.items()}
        return state

    def _trained_state(self) -> dict[str, torch.Tensor]:
        if self.lora is None:
            return self.model.state_dict()
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def _load_trained_state(self, model_state: Mapping, lora: Mapping | None) -> None:
        saved_lora = lora is not None or any(".lora_" in k for k in model_state)
        if saved_lora != (self.lora is not None):
            raise ValueError(
                f"the checkpoint is of a {'LoRA' if saved_lora else 'full fine-tuning'} run and "
                f"this trainer {'trains LoRA adapters' if self.lora else 'fine-tunes every weight'}: "
                f"resume with the trainer.lora setting it was saved with")
        if self.lora is None:
            self.model.load_state_dict(model_state)
            return
        own = self._trained_state()
        if set(model_state) != set(own):
            missing, unknown = sorted(set(own) - set(model_state)), sorted(set(model_state) - set(own))
            raise ValueError(f"the checkpoint's adapters do not match trainer.lora: missing "
                             f"{missing[:3]}, unknown {unknown[:3]}")
        with torch.no_grad():
            for k, v in model_state.items():
                if tuple(v.shape) != tuple(own[k].shape):
                    raise ValueError(f"the checkpoint's adapter {k} is {tuple(v.shape)}, trainer.lora "
                                     f"makes it {tuple(own[k].shape)}")
            for k, v in model_state.items():
                own[k].copy_(v)

    def load_checkpoint_state(self, state: Mapping) -> None:
        """Restore what ``state_dict_for_checkpoint`` returned (also after ``torch.load``)."""
        self._load_trained_state(state["model"], state.get("lora"))
        self.optimizer.load_state_dict(state["optimizer"])
        self._restore_schedule(state["scheduler"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        py = rng["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.version = int(state["version"])

    def _restore_schedule(self, scheduler_state: Mapping) -> None:
        """The scheduler's state, and the next step's LR under this backend's schedule."""
        self.scheduler.load_state_dict(scheduler_state)
        # the next step's LR under this backend's schedule, not the one restored with the
        # optimizer: a resume may extend total_steps (past a finished cosine that one is 0.0)
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                   self.scheduler.lr_lambdas):
            group["lr"] = base * fn(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                       torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The content digest of ``tensors`` as a safetensors file of them would have it
    (:func:`rollart.engines.digest.file_content_digest`), computed from memory."""
    d = TensorDigest()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        dtype = _SAFETENSORS_DTYPES.get(t.dtype)
        if dtype is None:
            dtype = next((k for k, v in _TYPES.items() if v == t.dtype), None)
            if dtype is None:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        d.add(name, dtype, t.shape, t.numel() * t.element_size(), [memoryview(raw).cast("B")])
    return d.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
