"""How a training run ends, the same in ``rollart run`` and on the node that hosts the
trainer: final evaluation, ``summary.json``, the plot, the end published to its nodes.
(The actors a run hosts are built by :mod:`rollart.node.build`.)"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import msgspec
import yaml

from rollart import messages as m
from rollart.actors.kernel.base import Retry
from rollart.actors.kernel.run_end import put_run_end
from rollart.actors.kernel.runtime import decode_core
from rollart.aio import first_of
from rollart.app.periodic_eval import evaluate, periodic_evals, stop_evals
from rollart.app.report import plot
from rollart.config import RunConfig
from rollart.config.schema import nats_settings

log = logging.getLogger(__name__)


def with_overrides(cfg: RunConfig, **sections) -> RunConfig:
    """``cfg`` with some sections' fields replaced: ``with_overrides(cfg, rollout={...})``."""
    out = cfg
    for name, values in sections.items():
        if name == "nats" and isinstance(values, dict):  # a section given as a mapping
            values = nats_settings(values)
        if name in ("run", "nats", "run_dir"):
            out = msgspec.structs.replace(out, **{name: values})
        else:
            out = msgspec.structs.replace(out, **{name: msgspec.structs.replace(getattr(out, name), **values)})
    return out


# -- the end of a training run: the same in one process (`rollart run`) and on the node
#    that hosts the trainer (`python -m rollart.node --roles trainer,...`) ------------


def checkpoint_version(run_path: Path) -> int | None:
    """The policy version a resume of a run folder continues from (its durable state's, which
    may be ahead of the full checkpoint: :mod:`rollart.actors.trainer.checkpoint`); None: no
    checkpoint yet."""
    # deferred: a node that hosts no trainer imports nothing of the trainer role
    from rollart.actors.trainer.files import RunFiles

    return RunFiles(run_path).durable_version()


def write_config(cfg: RunConfig, *, overwrite: bool = True) -> Path:
    """The run's resolved config as ``<run_dir>/<run>/config.yaml``."""
    path = Path(cfg.run_dir) / cfg.run / "config.yaml"
    if overwrite or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    return path


class _QuietHandBacks(logging.Filter):
    """Deliveries a finished (or stopping) trainer hands back for a later run are expected,
    not news: their ``retry`` lines are logged only at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if (record.levelno == logging.INFO and str(record.msg).startswith("retry ")
                and args and isinstance(args[-1], Retry) and str(args[-1]).startswith("trainer ")):
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_hand_backs() -> None:
    """Install :class:`_QuietHandBacks` on the consumer runtime's logger (idempotent)."""
    lg = logging.getLogger("rollart.actors.kernel.runtime")
    if not any(isinstance(f, _QuietHandBacks) for f in lg.filters):
        lg.addFilter(_QuietHandBacks())


def _stop_consuming(node, actor) -> None:
    """Stop ``actor``'s consumers: what they would fetch now stays queued for a later run."""
    for loop in node.loops:
        if loop.actor is actor:
            loop.stop()


async def drive_training(bus, cfg: RunConfig, node, trainer, sched=None, *, proxies=(),
                         pool: str = "default", t0: float | None = None) -> dict:
    """Drive a training run hosted by ``node`` to its end and return its summary.

    Waits for the trainer's last step (or the node's stop: SIGINT/SIGTERM), stops admitting,
    runs the final greedy evaluation, writes ``summary.json`` and the plot into the run
    folder, and publishes the end of the run (:mod:`rollart.actors.kernel.run_end`), on which the
    other nodes of the run drain and exit. ``proxies``: generate replicas in this process.
    """
    quiet_hand_backs()
    t0 = time.perf_counter() if t0 is None else t0
    done = asyncio.ensure_future(trainer.finished.wait())
    evals, no_more = None, asyncio.Event()
    if cfg.trainer.eval_every:  # trainer.eval_every: beside training, ended with it
        evals = asyncio.ensure_future(periodic_evals(
            bus, cfg, trainer, Path(cfg.run_dir) / cfg.run, no_more, proxies=proxies, pool=pool))
    won: set = set()
    try:
        won, _ = await first_of(done, node.wait())
    finally:
        if evals is not None:
            await _end_evals(cfg, trainer, evals, no_more, finish=done in won)
    interrupted = done not in won
    _stop_consuming(node, trainer)
    final: dict = {}
    if not interrupted and trainer.failure is None:
        if sched is not None:
            sched.total_groups = sched.admitted  # no more training rollouts
        log.info("run %s: trained %d steps; final greedy evaluation on %d groups", cfg.run,
                 trainer.version, cfg.trainer.eval_groups)
        ev = asyncio.ensure_future(
            evaluate(bus, cfg, trainer.version, cfg.trainer.eval_groups, proxies, pool=pool))
        stop = asyncio.ensure_future(node.wait())  # SIGINT/SIGTERM stop it too
        won, _ = await first_of(ev, stop, timeout=cfg.trainer.eval_timeout)
        if ev in won:
            try:
                final = ev.result()
            except Exception as e:  # noqa: BLE001 - training is done: the run ends, saying why
                log.error("run %s: the final evaluation failed: %s; the run ends without its "
                          "result", cfg.run, e)
                final = {"eval_error": str(e)[:500]}
        elif stop in won:  # stopped: the evaluation is cancelled and has ended
            interrupted = True
        else:
            log.error("run %s: the final evaluation did not finish within %.0fs "
                      "(trainer.eval_timeout); the run ends without its result", cfg.run,
                      cfg.trainer.eval_timeout)
            final = {"eval_error": f"timed out after {cfg.trainer.eval_timeout:.0f}s"}
    summary = await write_summary(cfg, trainer, wall=time.perf_counter() - t0,
                                  interrupted=interrupted, final=final)
    if not interrupted:
        await put_run_end(bus, cfg.run, m.RunEnd(
            stage="ended", version=trainer.version, steps=cfg.trainer.steps,
            stopped=trainer.failure or "", summary=str(Path(cfg.run_dir) / cfg.run / "summary.json"),
            result={k: float(v) for k, v in final.items() if isinstance(v, (int, float))},
            ts=time.time()))
    return summary


async def _end_evals(cfg: RunConfig, trainer, evals: asyncio.Future, no_more: asyncio.Event, *,
                     finish: bool) -> None:
    """The end of ``trainer.eval_every``'s task: one evaluation under way is finished when
    training ended (within ``trainer.eval_timeout``), cut short when it was interrupted."""
    if finish:
        await stop_evals(trainer, no_more)
        await asyncio.wait([evals], timeout=cfg.trainer.eval_timeout)
    evals.cancel()
    (err,) = await asyncio.gather(evals, return_exceptions=True)
    if isinstance(err, Exception):
        log.error("run %s: the evaluations of trainer.eval_every stopped: %r", cfg.run, err)


async def write_summary(cfg: RunConfig, trainer, *, wall: float, interrupted: bool,
                        final: dict) -> dict:
    """``summary.json`` (and the plot) of a training run; returns the summary."""
    run_path = Path(cfg.run_dir) / cfg.run
    summary = {"run": cfg.run, "steps": trainer.version, "wall_s": wall,
               "interrupted": interrupted, **final}
    if trainer.failure is not None:  # the circuit breaker: say why, with the counts by kind
        led = trainer.ledger
        summary.update(failed=trainer.failure, groups_failed=led.counts["groups_failed"],
                       groups_trained=led.trained,
                       dead_letters_by_kind=dict(led.failure_kinds.most_common()))
    below = below_expected(cfg, summary, [h["success"] for h in trainer.history if "success" in h])
    if below is not None:
        summary["below_expected"] = below
    if trainer.history:  # this run's summary marks the greedy result (not an old file's)
        summary["plot"] = str(await asyncio.to_thread(plot, run_path, summary=summary))
    if getattr(trainer, "loggers", None) is not None and "greedy_success" in final:
        await asyncio.to_thread(trainer.loggers.log, {**final, "step": trainer.version},
                                prefix="eval/")
    await asyncio.to_thread((run_path / "summary.json").write_text, json.dumps(summary, indent=2))
    return summary


LAST_SUCCESS_SHOWN = 10
"""Sampled success values of the last steps a run that did not learn shows."""


def below_expected(cfg: RunConfig, summary: dict, sampled: list[float]) -> dict | None:
    """What ``summary.json`` records of a run whose final greedy success is below
    ``trainer.expect_success``: the two numbers, the sampled success of the last steps and the
    command that trains it further; None when the config expects nothing or the run met it
    (or ended without an evaluation: interrupted, stopped, timed out)."""
    want, got = cfg.trainer.expect_success, summary.get("greedy_success")
    if want is None or got is None or got >= want or summary.get("failed"):
        return None
    steps = int(summary.get("steps", cfg.trainer.steps))
    return {"expected": want, "greedy_success": got,
            "last_sampled_success": [round(x, 3) for x in sampled[-LAST_SUCCESS_SHOWN:]],
            "continue": (f"rollart run --resume {Path(cfg.run_dir) / cfg.run} "
                         f"--steps {steps + cfg.trainer.steps}")}


def below_expected_line(below: dict) -> str:
    """The one line a run that did not learn prints (``summary["below_expected"]``)."""
    last = " ".join(f"{x:.2f}" for x in below["last_sampled_success"]) or "none"
    return (f"this run did not learn: greedy success {below['greedy_success']:.2f} is below the "
            f"{below['expected']:.2f} its config expects (trainer.expect_success); sampled "
            f"success of the last steps: {last}; train it further with: {below['continue']}")


async def wait_for_peers(bus, run: str, node_id: str, *, heartbeat_every: float,
                         deadline: float, known: dict | None = None) -> int:
    """After the end of a run: wait (up to ``deadline`` seconds) until every other node of
    the run has stopped heartbeating, i.e. has drained, so that an embedded server is not
    stopped under them. ``known``: node id -> last :class:`NodeHeartbeat` seen so far.
    Returns how many were still heartbeating at the deadline."""
    if heartbeat_every <= 0:
        return 0
    now, wall = time.monotonic(), time.time()
    last: dict[str, float] = {}
    for nid, hb in (known or {}).items():
        age = min(max(0.0, wall - hb.ts), 3 * heartbeat_every)
        if nid != node_id and age < 3 * heartbeat_every:
            last[nid] = now - age

    async def on_hb(req) -> None:
        hb = decode_core(m.NodeHeartbeat, req)
        if hb is None:  # junk on a core subject: counted and dropped
            return
        if hb.node_id != node_id:
            last[hb.node_id] = time.monotonic()

    sub = await bus.subscribe(m.subject(run, "node.heartbeat"), on_hb)
    try:
        end = now + deadline
        while time.monotonic() < end:
            t = time.monotonic()
            if all(t - seen > 1.5 * heartbeat_every for seen in last.values()):
                return 0
            await asyncio.sleep(0.1)
        t = time.monotonic()
        return sum(t - seen <= 1.5 * heartbeat_every for seen in last.values())
    finally:
        await sub.unsubscribe()
