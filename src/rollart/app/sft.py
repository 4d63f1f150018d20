"""``rollart sft``: supervised fine-tuning on conversations (``rollart demos``), a warm start
for RL (``trainer.init_from: runs/<sft-run>``).

**Data.** Conversations and their token layout: :mod:`rollart.app.sft_data`.

**Training.** The config's model folder (:func:`rollart.engines.provision.model_dir`: the
tiny model, ``model.path`` or ``trainer.init_from``) is loaded into the RL trainer's
:class:`~rollart.engines.torch_trainer.TorchTrainBackend`, which gives the same model loading,
AdamW, LR schedule (linear warm-up, cosine), gradient clipping, thread setting, seeding and
micro-batching (``trainer.micro_batch_tokens``) as RL. Only the loss is SFT's own
(:func:`sft_step`): the mean negative log-likelihood of the trained tokens over the whole
vocabulary, gradients accumulated over micro-batches so that a step equals one big batch.

**Output.** ``runs/<name>/``: ``config.yaml``, ``metrics.jsonl`` (one row per step: loss,
token accuracy, lr, grad norm, tokens, wall time), ``learning.png``, ``summary.json`` and
``model/`` (``save_pretrained`` plus the base folder's tokenizer files: a complete HF model
folder, which ``trainer.init_from`` or ``model.path`` loads). ``--eval N`` plays N held-out
episodes greedily (task seeds ``1000000 + rollout.seed + i``, those of ``rollart run``'s final
evaluation) through the torch generation engine, as the RL generators decode;
``--eval-sampled K`` also samples the first K of them ``rollout.group_size`` times each at the
env's temperature, as the sampled half of ``rollart run``'s periodic evaluations does.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from rollart.app.configs import resolve_config
from rollart.app.demos import Episode
from rollart.app.sft_data import read_conversations, train_samples
from rollart.app.trace_report import save_png
from rollart.config import ConfigError, EnvConfig, RunConfig, load
from rollart.engines.provision import SFT_MODEL, model_dir
from rollart.envs import make_env
from rollart.envs.base import HELDOUT_SEED_OFFSET

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
"""Files of a base model folder that ``save_pretrained`` replaces (the rest is copied)."""
WRITTEN = {"config.json", "generation_config.json", "model.safetensors.index.json",
           "pytorch_model.bin.index.json", "rollart_tiny.json"}
"""Files not copied from the base folder: written by ``save_pretrained``, or the tiny model's
build record (the folder is no longer that build)."""


# -- data ------------------------------------------------------------------------------


# -- training ----------------------------------------------------------------------------


def sft_step(backend: Any, samples: list[Any]) -> dict:
    """One optimizer step of ``backend`` (a TorchTrainBackend) on the mean negative
    log-likelihood of the samples' trained tokens; returns loss, token_acc (argmax over the
    vocabulary equals the token), grad_norm (before clipping), lr, tokens, skipped."""
    import torch

    from rollart.engines.train_samples import collate

    model, opt = backend.model, backend.optimizer
    total = sum(sum(s.response_mask) for s in samples)
    if total == 0:
        raise ValueError("no assistant tokens in the batch")
    opt.zero_grad(set_to_none=True)
    loss_sum = correct = 0.0
    for mb in backend.micro_batches(samples):
        b = collate(mb, backend.device)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
        target, mask = b.input_ids[:, 1:], b.response_mask[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        loss = (nll * mask).sum() / total
        loss.backward()
        loss_sum += loss.item()
        correct += ((logits.argmax(-1) == target).float() * mask).sum().item()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, backend.grad_clip or math.inf))
    lr = backend.scheduler.get_last_lr()[0]
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        opt.step()
        backend.scheduler.step()
        backend.version += 1
    opt.zero_grad(set_to_none=True)
    return {"loss": loss_sum, "token_acc": correct / total, "grad_norm": grad_norm, "lr": lr,
            "tokens": int(total), "skipped": float(skipped)}


def save_model(backend: Any, base: Path, out: Path) -> str:
    """Write the trained model as a complete HF folder at ``out`` (``save_pretrained``, then
    the base folder's tokenizer and other files, atomically: a temporary sibling renamed);
    returns its weights' content digest (what the RL trainer's ``weights_digest`` gives)."""
    from rollart.engines.torch_trainer import tensors_digest

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    backend.model.save_pretrained(tmp)
    for f in sorted(base.iterdir()):
        if f.is_file() and f.name not in WRITTEN and not f.name.endswith(WEIGHT_SUFFIXES) \
                and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return tensors_digest(backend.weight_tensors())


def plot(rows: list[dict], out: Path, *, title: str) -> Path:
    """Loss and token accuracy against steps, as one PNG (replaced atomically)."""
    import matplotlib  # optional: the train extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(steps, [r["loss"] for r in rows], color="tab:blue", label="loss (NLL per token)")
    axes[0].set_yscale("log")
    axes[1].plot(steps, [r["token_acc"] for r in rows], color="tab:orange", label="token accuracy")
    axes[1].set_ylim(0, 1.02)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, out, dpi=90)


# -- evaluation ---------------------------------------------------------------------------


async def play_eval(folder: str | Path, cfg: EnvConfig, seeds: list[int], *, threads: int = 1,
                      batch: int = 64, greedy: bool = True, seed: int = 0) -> dict:
    """Success of the model in ``folder`` on one episode per task seed (greedy by default),
    played as the RL generators and EnvManager do: torch generation engine, prompts by ChatFormat, decoding
    constrained to the legal actions (else free text up to ``sampling.max_new_tokens``), the
    episodes of a batch advancing turn by turn together. ``greedy=False``: sampled at the
    env's ``sampling.temperature`` and ``top_p`` (engine seed ``seed``), as the RL run's
    periodic evaluation's sampled half; keys ``sampled_*``. A seed may repeat (a group)."""
    from rollart.actors.env.chat import ChatFormat
    from rollart.engines.base import GenInput
    from rollart.engines.torch_engine import TorchGenerationEngine

    engine = TorchGenerationEngine(folder, threads=threads, seed=seed)
    chat = ChatFormat.load(folder)
    ok = reward = turns = 0.0
    t0 = time.perf_counter()
    samp = cfg.sampling
    for i in range(0, len(seeds), batch):
        eps = [Episode(make_env(cfg.type, cfg.args), cfg, s) for s in seeds[i:i + batch]]
        ids: list[list[int]] = []
        for ep in eps:
            await ep.start()
            ids.append(chat.first_prompt(ep.instruction, ep.user()))
        live = list(range(len(eps)))
        while live:
            legal = [eps[k].legal() for k in live]
            inputs = [GenInput(prompt_ids=ids[k], choices=[chat.encode(a) for a in lg] if lg else None,
                               max_new_tokens=samp.max_new_tokens, greedy=greedy,
                               temperature=samp.temperature, top_p=samp.top_p)
                      for k, lg in zip(live, legal)]
            outs = engine.generate(inputs)
            still = []
            for k, lg, out in zip(live, legal, outs):
                ep = eps[k]
                ids[k] += out.token_ids
                await ep.step(chat.decode(out.token_ids), lg)
                if not ep.done:
                    ids[k] += chat.next_prompt(out.token_ids, ep.user())
                    still.append(k)
            live = still
        for ep in eps:
            ok, reward, turns = ok + ep.success, reward + ep.reward, turns + ep.turn
            close = getattr(ep.env, "close", None)
            if callable(close):
                close()
    n = max(1, len(seeds))
    kind = "greedy" if greedy else "sampled"
    return {"episodes": len(seeds), "seeds": [seeds[0], seeds[-1]] if seeds else [],
            f"{kind}_success": ok / n, f"{kind}_reward": reward / n, "mean_turns": turns / n,
            "wall_s": round(time.perf_counter() - t0, 3)}


async def heldout_eval(folder: str | Path, cfg: RunConfig, env: str, episodes: int,
                       sampled_tasks: int = 0) -> dict:
    """The SFT model on the held-out tasks of ``rollart run``'s evaluations: greedy on
    ``episodes`` tasks (task seeds ``1000000 + rollout.seed + i``), then, with
    ``sampled_tasks``, sampled on the first ``sampled_tasks`` of them, ``rollout.group_size``
    episodes each (the sampled half of a periodic evaluation, ``trainer.eval_sampled_groups``)."""
    seeds = [HELDOUT_SEED_OFFSET + cfg.rollout.seed + i for i in range(episodes)]
    out = await play_eval(folder, cfg.envs[env], seeds, threads=cfg.model.threads) | {"env": env}
    if sampled_tasks:
        group = [s for s in seeds[:sampled_tasks] for _ in range(cfg.rollout.group_size)]
        got = await play_eval(folder, cfg.envs[env], group, threads=cfg.model.threads,
                                greedy=False, seed=cfg.trainer.seed)
        out |= {"sampled_success": got["sampled_success"], "sampled_reward": got["sampled_reward"],
                "sampled_episodes": got["episodes"], "wall_s": out["wall_s"] + got["wall_s"]}
    return out


# -- the command --------------------------------------------------------------------------


def _run_folder(cfg: RunConfig, out: str | None) -> Path:
    """``--out`` (which must be new or empty), else ``<run_dir>/<run>-sft`` or the first free
    ``-2``, ``-3``, ... suffix."""
    if out:
        p = Path(out)
        if p.exists() and (not p.is_dir() or any(p.iterdir())):
            raise ConfigError(f"--out {p} exists and is not empty: give a new folder")
        p.mkdir(parents=True, exist_ok=True)
        return p
    root = Path(cfg.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        p = root / (f"{cfg.run}-sft" if n == 1 else f"{cfg.run}-sft-{n}")
        try:
            p.mkdir()
            return p
        except FileExistsError:
            if p.is_dir() and not any(p.iterdir()):
                return p
            n += 1


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


async def sft(cfg: RunConfig, rows: list[dict], run_path: Path, *, steps: int, batch: int,
              lr: float | None = None, eot: str = "auto", eval_episodes: int = 0,
              eval_sampled: int = 0, env: str | None = None, quiet: bool = False,
              data: str = "") -> dict:
    """Fine-tune ``cfg``'s model on the conversations ``rows`` for ``steps`` steps of
    ``batch`` conversations (shuffled epochs); write the run folder; return the summary."""
    import asyncio

    from rollart.actors.env.chat import ChatFormat
    from rollart.engines.torch_trainer import TorchTrainBackend

    t = cfg.trainer
    base = model_dir(cfg)
    t0 = time.perf_counter()
    chat = ChatFormat.load(base)
    samples = train_samples(chat, rows, eot=eot)
    warmup = min(10, steps // 10)
    backend = TorchTrainBackend(base, lr=lr if lr is not None else t.lr, weight_decay=t.weight_decay,
                                betas=tuple(t.adam_betas),
                                grad_clip=t.grad_clip, warmup_steps=warmup, total_steps=steps,
                                schedule="cosine", threads=cfg.model.threads, seed=t.seed,
                                micro_batch_tokens=t.micro_batch_tokens)
    rng = random.Random(t.seed)
    order: list[int] = []
    metrics = run_path / "metrics.jsonl"
    rows_out: list[dict] = []
    live = not quiet and sys.stdout.isatty()
    every = max(1, steps // 20)
    with metrics.open("w") as mf, Progress(
            TextColumn("[bold]sft"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), disable=not live) as bar:
        task = bar.add_task("steps", total=steps, info="")
        for step in range(1, steps + 1):
            if len(order) < batch:  # a fresh shuffled epoch after what is left of this one
                nxt = list(range(len(samples)))
                rng.shuffle(nxt)
                order += nxt
            pick, order = order[:batch], order[batch:]
            m = await asyncio.to_thread(sft_step, backend, [samples[i] for i in pick])
            row = {"step": step, **m, "epoch": round(step * batch / len(samples), 3),
                   "wall_s": round(time.perf_counter() - t0, 3)}
            rows_out.append(row)
            mf.write(json.dumps(row) + "\n")
            mf.flush()
            info = f"loss {m['loss']:.4f}  token acc {m['token_acc']:.3f}"
            bar.update(task, completed=step, info=info)
            if not live and not quiet and (step % every == 0 or step == steps):
                print(f"sft step {step}/{steps}: {info}  lr {m['lr']:.2e}  "
                      f"{row['wall_s']:.1f}s", flush=True)
    train_s = time.perf_counter() - t0
    digest = await asyncio.to_thread(save_model, backend, Path(base), run_path / SFT_MODEL)
    summary = {"model": str(run_path / SFT_MODEL), "base_model": str(base), "weights_digest": digest,
               "data": data, "conversations": len(samples), "steps": steps, "batch": batch,
               "lr": lr if lr is not None else t.lr, "eot": eot,
               "trained_tokens_per_conversation": sum(sum(s.response_mask) for s in samples) / len(samples),
               "first_loss": rows_out[0]["loss"], "final_loss": rows_out[-1]["loss"],
               "final_token_acc": rows_out[-1]["token_acc"], "train_s": round(train_s, 3)}
    if eval_episodes:
        summary["eval"] = await heldout_eval(run_path / SFT_MODEL, cfg, env or cfg.rollout.env,
                                             eval_episodes, min(eval_sampled, eval_episodes))
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    _write_json(run_path / "summary.json", summary)
    title = f"{run_path.name}: SFT on {len(samples)} conversations"
    if "eval" in summary:
        title += f"   greedy success {summary['eval']['greedy_success']:.3f} " \
                 f"on {summary['eval']['episodes']} held-out episodes"
        if "sampled_success" in summary["eval"]:
            title += f", sampled {summary['eval']['sampled_success']:.3f}"
    await asyncio.to_thread(plot, rows_out, run_path / "learning.png", title=title)
    return summary


async def sft_main(args) -> int:
    cfg = load(resolve_config(args.config), RunConfig)
    if args.steps < 1 or args.batch < 1:
        raise ConfigError("--steps and --batch must be >= 1")
    if args.eval_sampled < 0:
        raise ConfigError(f"--eval-sampled must be >= 0, got {args.eval_sampled}")
    if args.eval_sampled and not args.eval:
        raise ConfigError("--eval-sampled needs --eval N: it samples on the first of those tasks")
    name = args.env or cfg.rollout.env
    if args.eval and name not in cfg.envs:
        raise ConfigError(f"--env {name!r}: the config has no such env; it has {', '.join(sorted(cfg.envs))}")
    rows = read_conversations(args.data)
    if args.success_only:
        rows = [r for r in rows if r.get("success")]
        if not rows:
            raise ConfigError(f"--success-only: no successful conversation in {args.data}")
    model_dir(cfg)  # a missing model folder (model.path, trainer.init_from) fails before the run folder
    run_path = _run_folder(cfg, args.out)
    print(f"rollart sft: run folder {run_path}/ ({len(rows)} conversations from {args.data})",
          file=sys.stderr, flush=True)
    (run_path / "config.yaml").write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    summary = await sft(cfg, rows, run_path, steps=args.steps, batch=args.batch, lr=args.lr,
                        eot=args.eot, eval_episodes=args.eval, eval_sampled=args.eval_sampled,
                        env=args.env, quiet=args.quiet,
                        data=str(args.data))
    print(json.dumps(summary, indent=2))
    print(f"rollart sft: start RL from it with `trainer.init_from: {run_path}` in a config, or "
          f"`rollart run CONFIG --init-from {run_path}`", file=sys.stderr)
    return 0


def register(sub) -> None:
    """The ``sft`` subcommand."""
    s = sub.add_parser("sft", help="supervised fine-tuning on conversations (a warm start for RL)",
                       description="Fine-tune CONFIG's model on JSONL conversations (`rollart "
                                   "demos`), tokenized exactly as RL trajectories of the same "
                                   "turns, the loss on the assistant's tokens only. Writes "
                                   "runs/<run>-sft/ (metrics.jsonl, learning.png, summary.json, "
                                   "model/); an RL config starts from it with trainer.init_from.")
    s.add_argument("config", help="run config: a YAML path, or the name of a packaged one")
    s.add_argument("--data", required=True, metavar="FILE.jsonl",
                   help="conversations, one JSON line each with \"messages\"")
    s.add_argument("--steps", type=int, default=200, metavar="N", help="optimizer steps (default 200)")
    s.add_argument("--batch", type=int, default=32, metavar="N",
                   help="conversations per step (default 32)")
    s.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default trainer.lr); linear warm-up, cosine decay")
    s.add_argument("--eot", choices=("auto", "always"), default="auto",
                   help="train the end-of-turn token where the RL policy generates it (auto: "
                        "free-text envs; under constrained decoding it is prompt) or always")
    s.add_argument("--success-only", action="store_true",
                   help="train only on conversations whose \"success\" is true")
    s.add_argument("--eval", type=int, default=0, metavar="N",
                   help="then play N held-out episodes greedily (task seeds 1000000 + i) and "
                        "report the success (default 0: none)")
    s.add_argument("--eval-sampled", type=int, default=0, metavar="K",
                   help="with --eval: also play the first K of those tasks rollout.group_size "
                        "times each, sampled at the env's temperature, as a periodic evaluation "
                        "of `rollart run` does (trainer.eval_sampled_groups), and report the "
                        "sampled success (default 0: none)")
    s.add_argument("--env", default=None, help="env of the config for --eval (default rollout.env)")
    s.add_argument("--out", default=None, metavar="DIR",
                   help="run folder (default runs/<run>-sft, suffixed when taken)")
    s.add_argument("--quiet", action="store_true", help="no progress bar or step lines")
    s.set_defaults(fn=sft_main)
