"""``rollart sandbox``: check that this host can run model-written code safely, or run a
command in a fresh sandbox to see what the code would see.

``rollart sandbox check [--config CONFIG]`` starts one sandbox with the config's ``sandbox:`` section
(the defaults without one) and probes it as hostile code would: the host's files, the
network and loopback, processes left behind, the limits. It prints one line per probe and
exits non-zero when one fails, so an env host can be vetted before it joins a run.
``rollart sandbox run [--config CONFIG] -- CMD...`` runs ``CMD`` in a fresh sandbox and prints its
output, exit code and times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from typing import Callable

from rollart import sandbox
from rollart.app.configs import resolve_config
from rollart.config import RunConfig, load
from rollart.config.sandbox import SandboxConfig


def _config(name: str | None) -> SandboxConfig:
    return load(resolve_config(name), RunConfig).sandbox if name else SandboxConfig()


def _probes(sb: sandbox.Sandbox, cfg: SandboxConfig) -> list[tuple[str, Callable[[], str | None]]]:
    """(what, check): a check returns None when contained, else what went wrong."""
    home = os.path.expanduser("~")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def files() -> str | None:
        r = sb.run(f"ls {home} /home /root /var 2>/dev/null; ls {os.getcwd()} 2>/dev/null | head -1")
        return f"sees host folders: {r.text()[:200]!r}" if r.stdout.strip() else None

    def loopback() -> str | None:
        listener.listen()
        r = sb.run(["python3", "-c", "import socket\ntry:\n socket.create_connection(('127.0.0.1', "
                    f"{port}), timeout=2); print('connected')\nexcept OSError as e: print(e)"])
        listener.close()
        if cfg.network:
            return None
        return "reached a port on the host's loopback" if b"connected" in r.stdout else None

    def background() -> str | None:
        sb.run("sleep 4242 >/dev/null 2>&1 &")
        r = sb.run("ps -eo args | grep -c '^sleep 4242' || true")
        return "a background process outlived its command" if r.stdout.strip() not in (b"0", b"") else None

    def fork_bomb() -> str | None:
        r = sb.run(["python3", "-c", "import os\nwhile True: os.fork()"], timeout=5)
        alive = sb.run("true")
        return None if alive.ok and (r.limit or r.exit_code) else f"not contained: {r}"

    def memory() -> str | None:
        r = sb.run(["python3", "-c", "x = bytearray(%d)" % (cfg.memory_bytes * 2)])
        return None if r.limit == "memory" else f"allocated twice sandbox.memory_bytes: {r.exit_code}"

    def deadline() -> str | None:
        r = sb.run("sleep 60", timeout=1)
        return None if r.timed_out else "a 60 s sleep was not stopped at a 1 s deadline"

    def root_fs() -> str | None:
        r = sb.run("touch /usr/rollart-probe 2>/dev/null && echo wrote")
        return "wrote to /usr" if b"wrote" in r.stdout else None

    return [("host folders are invisible", files), ("the host's loopback is out of reach", loopback),
            ("/usr is read-only", root_fs), ("no process outlives its command", background),
            ("a fork bomb stops at sandbox.processes", fork_bomb),
            ("a memory bomb stops at sandbox.memory_bytes", memory),
            ("a command stops at its deadline", deadline)]


def _check(cfg: SandboxConfig) -> int:
    t0 = time.monotonic()
    try:
        sb = sandbox.start(cfg)
    except sandbox.SandboxError as e:
        print(f"FAIL  start a {cfg.backend} sandbox: {e}")
        return 1
    failed = 0
    with sb:
        print(f"ok    start a {cfg.backend} sandbox ({(time.monotonic() - t0) * 1e3:.0f} ms)")
        for what, probe in _probes(sb, cfg):
            try:
                why = probe()
            except sandbox.SandboxError as e:
                why = f"the sandbox failed: {e}"
            failed += why is not None
            print(f"{'FAIL' if why else 'ok':5} {what}" + (f": {why}" if why else ""))
    print(f"{'all probes contained' if not failed else f'{failed} probe(s) NOT contained'}")
    return 1 if failed else 0


def _run(cfg: SandboxConfig, cmd: list[str], as_json: bool) -> int:
    with sandbox.start(cfg) as sb:
        r = sb.run(cmd if len(cmd) > 1 else cmd[0])
    if as_json:
        print(json.dumps({"exit_code": r.exit_code, "stdout": r.text(), "stderr": r.text("stderr"),
                          "wall_s": r.wall_s, "cpu_s": r.cpu_s, "limit": r.limit}, indent=2))
    else:
        print(r.text(), end="")
        print(r.text("stderr"), end="")
        print(f"[exit {r.exit_code}{', ' + r.limit if r.limit else ''}; wall {r.wall_s:.3f} s, "
              f"cpu {r.cpu_s:.3f} s]")
    return 0 if r.ok else 1


async def sandbox_main(args) -> int:
    cfg = _config(args.config)
    if args.action == "check":
        return await asyncio.to_thread(_check, cfg)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("rollart sandbox run: give the command after --, e.g. "
                         "rollart sandbox run -- python3 -c 'print(1)'")
    return await asyncio.to_thread(_run, cfg, command, args.json)


def register(sub) -> None:
    """The ``sandbox`` subcommand (``check`` and ``run``)."""
    s = sub.add_parser("sandbox", help="check this host's sandboxes, or run a command in one",
                       description="Sandboxes run model-written code on env hosts (bubblewrap "
                                   "by default: apt-get install bubblewrap).")
    actions = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    config_help = ("a run config (path or packaged name) whose sandbox: section to use "
                   "(default: the section's defaults)")
    c = actions.add_parser("check", help="probe a sandbox as hostile code would; exit 1 if "
                                         "anything is not contained")
    c.add_argument("--config", default=None, metavar="CONFIG", help=config_help)
    c.set_defaults(fn=sandbox_main, command=[], json=False)
    r = actions.add_parser("run", help="run a command in a fresh sandbox",
                           description="rollart sandbox run [--config CONFIG] [--json] -- CMD..."
                                       " (one word: run by /bin/sh -c)")
    r.add_argument("--config", default=None, metavar="CONFIG", help=config_help)
    r.add_argument("--json", action="store_true", help="print the result as JSON")
    r.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    r.set_defaults(fn=sandbox_main)
