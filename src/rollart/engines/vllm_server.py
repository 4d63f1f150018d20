"""The vLLM server process of ``proxy.engine: vllm-server`` (standard library only).

:class:`~rollart.engines.vllm_server_engine.VllmServerEngine` either launches its server or
attaches to one (``engine_args.url``). This module holds the launch side: the command line
(:func:`server_command`: ``python -c`` :data:`BOOTSTRAP`, which runs
``vllm.entrypoints.openai.api_server``; the remaining ``proxy.engine_args`` become its flags
through :func:`~rollart.engines.sglang_server.server_flags`) and starting it
(:func:`spawn_server`). Waiting for it, reading its log and stopping its process group are
shared with the SGLang server (:mod:`~rollart.engines.sglang_server`: ``free_port``,
``tail``, ``kill_server``).

Who may call it. vLLM 0.32's ``--api-key`` middleware guards only paths under ``/v1``,
``/v2``, ``/inference`` and ``/cohere``; the dev-mode endpoints the engine needs
(``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``,
``/update_weight_version``, ``VLLM_SERVER_DEV_MODE=1``) would be open to every local
process, and ``/collective_rpc`` calls worker methods by name. :data:`BOOTSTRAP` therefore
sets that middleware's guarded prefix to ``/`` before the server starts: every path, ``/health``
included, needs the key. The key is made per launch by the engine and handed over in
``VLLM_API_KEY`` (vLLM's own variable; readable by the same user only), never on the command
line (``/proc/<pid>/cmdline`` is world-readable). The log file is private (0600); the lines
quoted in an error have the key masked. The server binds 127.0.0.1.

Never left running: the server gets its own session (``close`` signals the whole group:
API server, EngineCore, worker) and ``PR_SET_PDEATHSIG`` = SIGTERM
(:func:`rollart.procs.die_with_parent`), so it is told to stop when the node's process dies, kill -9 included; vLLM's API server
stops its EngineCore on SIGTERM, and the EngineCore exits when its parent does.
:func:`wait_healthy` waits for ``GET /health`` with a deadline, and says why (the exit code
and the last lines of the log) when the server exits first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import rollart
from rollart.procs import die_with_parent

from .server_http import get_status, require_package, tail
from .sglang_server import server_flags

__all__ = ["BOOTSTRAP", "API_KEY_ENV", "CHOICES_PROCESSOR", "server_command", "spawn_server",
           "require_vllm", "wait_healthy", "INSTALL_HINT"]

API_KEY_ENV = "VLLM_API_KEY"
"""vLLM's own environment variable for its API key (``--api-key`` without the command line)."""
CHOICES_PROCESSOR = "rollart.engines.vllm_choices:ChoiceLogitsProcessor"
INSTALL_HINT = ("proxy.engine 'vllm-server' needs vLLM in the interpreter that runs the server "
                "(proxy.engine_args.python, default this one): pip install 'rollart[vllm]' "
                "(GPU) or, on CPU, make setup-vllm; or attach to a running server with "
                "proxy.engine_args.url")
BOOTSTRAP = (
    "import os, runpy, sys\n"
    f"if not os.environ.get({API_KEY_ENV!r}): sys.exit('rollart: no API key in ${API_KEY_ENV}')\n"
    "import vllm.entrypoints.serve.middleware.authenticate as auth\n"
    "auth.GUARDED_PREFIX = ('/',)\n"
    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)\n")
"""``python -c`` code that runs ``python -m vllm.entrypoints.openai.api_server ARGS`` with
every path behind the API key (see the module docstring)."""
FIXED_FLAGS = ("model", "port", "api_key", "logprobs_mode", "enable_scale_out",
               "logits_processors")
"""Server flags the engine sets itself (refused in ``engine_args``)."""
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
              "VLLM_LOGGING_LEVEL": "WARNING"}
"""Set on a launched server (``engine_args.env`` may override the last two)."""


def server_command(model_dir: str | os.PathLike, *, port: int, seed: int = 0,
                   args: Mapping[str, Any] | None = None, python: str | None = None,
                   cpu: bool = True) -> list[str]:
    """The command line of a launched server. Always: ``--model``, ``--host`` (127.0.0.1
    unless given), ``--port``, ``--logprobs-mode raw_logprobs`` (rollart's log-prob
    contract), ``--enable-scale-out`` (the token-in/token-out ``/inference/v1/generate``),
    ``--logits-processors`` rollart's choice processor; defaults: ``--dtype float32``,
    ``--seed``, ``--no-enable-chunked-prefill`` (per-request seeds), and on CPU
    ``--enforce-eager`` and ``--gpu-memory-utilization 0.1`` (the share of host RAM it takes)."""
    args = {str(k).replace("-", "_"): v for k, v in dict(args or {}).items()}
    fixed = sorted(k for k in args if k in FIXED_FLAGS)
    if fixed:
        raise ValueError(f"proxy.engine_args: {fixed} are set by the vllm-server engine itself")
    host = args.pop("host", "127.0.0.1")
    flags: dict[str, Any] = {"dtype": "float32", "seed": int(seed),
                             "no_enable_chunked_prefill": True, "disable_log_stats": True}
    if cpu:
        flags.update(enforce_eager=True, gpu_memory_utilization=0.1)
    if args.get("enable_chunked_prefill"):
        flags.pop("no_enable_chunked_prefill")
    flags.update(args)
    return [python or sys.executable, "-c", BOOTSTRAP,
            "--model", str(model_dir), "--host", str(host), "--port", str(int(port)),
            "--logprobs-mode", "raw_logprobs", "--enable-scale-out",
            "--logits-processors", CHOICES_PROCESSOR, *server_flags(flags)]


def shown(command: list[str] | None) -> str:
    """``command`` for a message: :data:`BOOTSTRAP` as ``-m vllm.entrypoints.openai.api_server``."""
    return " ".join("-m vllm.entrypoints.openai.api_server" if a == BOOTSTRAP else a
                    for a in (command or []) if a != "-c")


async def require_vllm(python: str) -> None:
    """``RuntimeError`` (saying how to install it) unless ``python`` can import vllm."""
    await require_package(python, "vllm", "vllm-server", "proxy.engine_args.python", INSTALL_HINT)


async def spawn_server(command: list[str], log_path: Path, env: Mapping[str, str],
                       api_key: str) -> asyncio.subprocess.Process:
    """Start ``command`` with its output in ``log_path`` (created private: 0600), in its own
    session, told to stop (SIGTERM) when this process dies. Its environment: this process's,
    :data:`SERVER_ENV`, ``env`` (``engine_args.env``), rollart's source folder on
    ``PYTHONPATH`` (its worker loads the choice processor by name) and ``api_key`` in
    :data:`API_KEY_ENV`. Call it from the event loop's thread (the death signal follows the
    thread that forked)."""
    if not api_key or not re.fullmatch(r"[-_A-Za-z0-9]+", api_key):
        raise ValueError("the vLLM server's API key must be url-safe characters, not empty")
    src = str(Path(rollart.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, **SERVER_ENV, **env, "PYTHONPATH": path, API_KEY_ENV: api_key}
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a log file that existed keeps no wider mode
    try:
        return await asyncio.create_subprocess_exec(
            *command, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM))
    finally:
        os.close(fd)


async def wait_healthy(session: Any, aiohttp: Any, url: str, *, timeout_s: float,
                       proc: asyncio.subprocess.Process | None, command: list[str] | None,
                       log_path: Path | None, secret: str | None) -> None:
    """Poll ``GET url/health`` on ``session`` (it sends the key) until it answers 200;
    ``RuntimeError`` with the last lines of the log (``secret`` masked) when the launched
    ``proc`` (None: attached) exits first or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s

    def logs() -> str:
        return f"\n--- last lines of {log_path}:\n{tail(log_path, secret=secret)}"

    while True:
        if proc is not None and proc.returncode is not None:
            raise RuntimeError(f"the vLLM server exited with code {proc.returncode} before it "
                               f"was ready: {shown(command)}{logs()}")
        last = await get_status(session, url + "/health", 10)
        if last is None:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"proxy.engine vllm-server: the server at {url} was not ready after "
                f"{timeout_s:.0f} s (GET /health: {last}; raise "
                f"proxy.engine_args.startup_timeout_s if it is only slow)"
                f"{logs() if log_path else ''}")
        if proc is not None:  # wake on its exit, else poll again in 0.5 s
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 0.5)
        else:
            await asyncio.sleep(0.5)
