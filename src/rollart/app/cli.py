"""``rollart``: the command and its subcommands (run, rollout, top, tap, nodes, report,
config, secure, cluster, demos, sft; ``rollart node`` is ``python -m rollart.node``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from rich.console import Console

from rollart import messages as m
from rollart.app import node as node_cmd
from rollart.app.args import add_nats_args, event_loop_runner, nats_overrides, quiet_libraries
from rollart.app.cluster import register as register_cluster
from rollart.app.configs import config_main, packaged_configs, resolve_config
from rollart.app.demos import register as register_demos
from rollart.app.monitor import top
from rollart.app.nodes import register as register_nodes
from rollart.app.queues import snapshot
from rollart.app.report import report
from rollart.app.rollout import rollout_main
from rollart.app.run import run_main
from rollart.app.secure import register as register_secure
from rollart.app.sandbox_cmd import register as register_sandbox
from rollart.app.sft import register as register_sft
from rollart.app.tap import register as register_tap
from rollart.bus.connect import bus_from_config
from rollart.config import ConfigError, RunConfig, load
from rollart.node import own_process_gc

async def top_main(args) -> int:
    cfg = load(resolve_config(args.config), RunConfig) if args.config else None
    once = args.once or args.json
    duration = args.duration if args.duration is not None or not once else TOP_ONCE_WINDOW
    async with bus_from_config(None, name="rollart-top", overrides=nats_overrides(args)) as bus:
        try:
            mon = await top(bus, m.check_token("run", args.run), duration=duration, config=cfg,
                            once=once)
        except asyncio.CancelledError:
            return 0
    if args.json:
        print(json.dumps(snapshot(mon), indent=1, default=str), flush=True)
    elif once:
        Console().print(mon.render())
    return 0


TOP_ONCE_WINDOW = 6.0
"""Seconds ``rollart top --once`` listens before its snapshot: a heartbeat interval
(``node.heartbeat_every``, 5 s by default) and a little more, so every live node is in it."""


async def report_main(args) -> int:
    if not (Path(args.run_dir) / "metrics.jsonl").exists():
        raise ConfigError(f"{args.run_dir}: no metrics.jsonl here; give a run folder (runs/<run>)")
    text, files = await asyncio.to_thread(report, args.run_dir, args.out, every=args.every)
    print(text)
    for path in files.values():
        print(f"wrote {path}")
    if not (Path(args.run_dir) / "traces.jsonl").exists():
        print("(no traces.jsonl: run with `tracing: {exporter: jsonl}` for gantt.png and steps.png)")
    return 0


# -- argument parsing ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollart", description=(
        "Async, event-driven RL training for LLM agents over NATS JetStream. Without --nats "
        "every command starts an embedded nats-server under the run folder."))
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    t = sub.add_parser("run", help="train: every role on this host (the main job)",
                       description="Train the policy of CONFIG on one host: embedded nats-server "
                                   "(or --nats); the trainer and scheduler in this process, "
                                   "generation and envs in child processes (node.local_processes"
                                   "). Writes runs/<run>/.")
    t.add_argument("config", nargs="?",
                   help="run config: a YAML path, or the name of a packaged one (quickstart)")
    add_nats_args(t, url_help="NATS URL to join (default: the config's nats, else an embedded "
                              "server), or 'memory' for the in-process bus")
    t.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a stopped run from its checkpoint (a finished run: says so, "
                        "exits 0 and changes nothing)")
    t.add_argument("--run", default=None,
                   help="override the run name (one that is taken gets a suffix: NAME-2, ...)")
    t.add_argument("--steps", type=int, default=None, metavar="N",
                   help="train up to N steps in all (overrides trainer.steps); with --resume: "
                        "continue up to N total steps, recorded in the run's config.yaml")
    t.add_argument("--single-process", action="store_true",
                   help="host every role in this one process instead of starting child "
                        "processes for generation and envs (node.local_processes; "
                        "--nats memory implies it): simpler to debug, but generation and "
                        "training share one core")
    t.add_argument("--init-from", default=None, metavar="SFT_RUN",
                   help="start from the model of an SFT run (`rollart sft`): sets "
                        "trainer.init_from, the model folder of trainer and generators")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(fn=run_main)

    tp = sub.add_parser("top", help="live subject-level view of a run",
                        description="Message rates per subject, nodes, policy version and "
                                    "replicas, trajectory outcomes and time split; each JetStream "
                                    "consumer's pending, ack pending, redelivered and rates; alpha "
                                    "headroom; dead letters by reason.")
    add_nats_args(tp, required=True, url_help="NATS URL of the run's server")
    tp.add_argument("--run", required=True, help="run name")
    tp.add_argument("--duration", type=float, default=None, help="stop after N seconds")
    tp.add_argument("--config", default=None, help="the run's config: lists the pools its mapping "
                                                   "and route need that have no live node, and "
                                                   "gives what alpha allows (the headroom)")
    tp.add_argument("--once", action="store_true",
                    help=f"print one snapshot and exit: listen --duration seconds (default "
                         f"{TOP_ONCE_WINDOW:g}: a heartbeat interval), poll JetStream at its start "
                         f"and end")
    tp.add_argument("--json", action="store_true",
                    help="with --once (implied): the snapshot as one JSON object, for scripts")
    tp.set_defaults(fn=top_main)

    rp = sub.add_parser("report", help="table, plots and figures of a run folder",
                        description="Summary table (first, best, last and every 10th step, then "
                                    "the final greedy evaluation) and a plot of a finished or "
                                    "running run; writes report.txt, report.png and report.md "
                                    "(never the run's own learning.png), and figures: "
                                    "staleness.png (histogram of how many policy versions behind "
                                    "the trained samples were) and, when the run has a "
                                    "traces.jsonl (config: tracing: {exporter: jsonl}), "
                                    "gantt.png (a trajectory Gantt: env init, env step, "
                                    "generate queued/engine, reward, waiting, over wall time with "
                                    "the policy versions) and steps.png (trainer step bars: "
                                    "get_batch/train/checkpoint/publish seconds, and how "
                                    "trajectory time split).")
    rp.add_argument("run_dir", help="runs/<run>")
    rp.add_argument("--every", type=int, default=None, metavar="N",
                    help="list every N-th step (default 10, more for long runs; 1: all)")
    rp.add_argument("--out", default=None, metavar="DIR",
                    help="folder for the report's files (default: the run folder)")
    rp.set_defaults(fn=report_main)

    r = sub.add_parser("rollout", help="roll out the current policy; write one JSON line per trajectory",
                       description="Run the configured envs with the current policy (also how "
                                   "you evaluate one) and print a summary.")
    r.add_argument("config", help="run config: a YAML path, or the name of a packaged one")
    r.add_argument("--groups", type=int, default=4, help="groups to roll out (default 4)")
    r.add_argument("--out", default="rollouts.jsonl", help="output JSONL (default rollouts.jsonl)")
    add_nats_args(r, url_help="NATS URL to join (default: the config's nats, else an embedded "
                              "server), or 'memory' for the in-process bus")
    r.add_argument("--env", default=None, help="env name of the config (default rollout.env)")
    r.add_argument("--greedy", action="store_true", help="greedy decoding")
    r.add_argument("--weights", default=None, help="safetensors file to load into the policy")
    r.add_argument("--run", default=None,
                   help="base of the run name: the rollout runs as RUN-rollout-<id>, never in a "
                        "training run's folder, and writes only --out")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(fn=rollout_main)

    n = sub.add_parser("node", help="run some roles on this host (python -m rollart.node)",
                       add_help=False)
    n.set_defaults(fn=None)

    c = sub.add_parser("config", help="check a config, or print every key with its meaning")
    c.add_argument("config", nargs="?", help="config to check: a YAML path or a packaged name")
    c.add_argument("--dump", nargs="?", const="", default=None, metavar="FILE",
                   help="write a copy of CONFIG to edit (default ./<name>.yaml; '-': stdout)")
    c.add_argument("--doc", action="store_true", help="print all keys with documentation")
    c.add_argument("--static", action="store_true",
                   help="do not import, construct or reset the envs (only validate the YAML)")
    c.set_defaults(fn=config_main)
    register_secure(sub)
    register_cluster(sub)
    register_nodes(sub)
    register_tap(sub)
    register_demos(sub)
    register_sft(sub)
    register_sandbox(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["node"]:
        return node_cmd.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "run" and not (args.config or args.resume):
        parser.error("rollart run needs CONFIG or --resume RUN_DIR")
    if args.cmd == "config" and args.dump is not None and not args.config:
        parser.error("rollart config --dump needs CONFIG: a path or a packaged name "
                     f"({', '.join(sorted(packaged_configs()))})")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    if args.cmd == "run":
        own_process_gc()  # the collector tuned once the nodes are set up (freeze_setup_objects)
    runner = event_loop_runner()
    try:
        return runner(args.fn(args))
    except (ConfigError, ValueError) as e:
        print(f"rollart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # python -m rollart.app.cli
    raise SystemExit(main())
