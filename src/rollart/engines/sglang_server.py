"""The SGLang server process of ``proxy.engine: sglang`` (standard library only).

:class:`~rollart.engines.sglang_engine.SglangEngine` either launches its server or attaches
to one (``engine_args.url``). This module holds the server side of that: whether an
interpreter has sglang (:func:`sglang_unavailable_reason`, :func:`require_sglang`), the
``python -m sglang.launch_server`` command line (:func:`server_command`: the remaining
``proxy.engine_args`` become its flags, see :func:`server_flags`), starting it in its own
process group with its output in a log file (:func:`spawn_server`), waiting until it
generates (:func:`wait_ready`, which says why when it exits or times out) and stopping its
whole process group (:func:`kill_server`).

Who may call it: a launched server gets an API key (``--api-key``, made per launch with
:func:`secrets.token_urlsafe` by the engine, which alone holds it and sends it as
``Authorization: Bearer`` on every request); without it any local process could generate,
abort others' requests or load its own weights (``/update_weights_from_disk``). The key
never appears on a command line (``/proc/<pid>/cmdline`` is world-readable): the server is
started as ``python -c`` :data:`BOOTSTRAP`, which takes it from the environment variable
:data:`API_KEY_ENV` (readable by the same user only), removes it from there and adds
``--api-key`` to ``sglang.launch_server``'s own arguments; the log file is private (0600: SGLang
prints its arguments) and the lines quoted in an error have the key masked. The server never
gets ``--enable-custom-logit-processor``: with it, SGLang unpickles a class from any
request's ``custom_logit_processor`` field, which is code execution for anyone who reaches
the port (constrained turns use ``sampling_params.logit_bias`` instead, see
:mod:`rollart.engines.sglang_protocol`); it is refused in ``engine_args``.

SGLang API facts this relies on (``python/sglang/srt``, SGLang 0.4.x-0.5.x): ``GET
/health_generate`` is 200 once the server generates (``/health*`` and ``/metrics`` need
no API key, every other path does: HTTP 401 without it); ``GET /get_server_info`` carries the
SGLang ``version``. A launched server gets ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (and
``RETURN_ORIGINAL_LOGPROB=1`` for older versions): log-probs of the distribution before the
temperature (see :mod:`rollart.engines.sglang_protocol`).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollart.procs import die_with_parent

from .server_http import free_port, get_status, kill_group, require_package, tail

__all__ = [
    "INSTALL_HINT",
    "API_KEY_ENV",
    "BOOTSTRAP",
    "server_flags",
    "server_command",
    "free_port",
    "sglang_unavailable_reason",
    "require_sglang",
    "spawn_server",
    "exited_error",
    "wait_ready",
    "kill_server",
]

INSTALL_HINT = (
    "install SGLang on the GPU machine per https://docs.sglang.io/get_started/install.html "
    "(`pip install uv && uv pip install sglang`), in this environment or in another one whose "
    "interpreter you give as proxy.engine_args.python (or $ROLLART_SGLANG_PYTHON); or attach "
    "to a running server with proxy.engine_args.url"
)
FIXED_FLAGS = ("model_path", "port", "skip_tokenizer_init", "api_key")
"""Server flags the engine sets itself (refused in ``engine_args``)."""
REFUSED_FLAGS = {
    "enable_custom_logit_processor": "it makes the server unpickle code from any request "
                                     "(constrained turns use logit_bias instead)",
    "admin_api_key": "the engine holds the server's only key",
}
"""Server flags refused in ``engine_args``, with why."""
API_KEY_ENV = "ROLLART_SGLANG_API_KEY"
"""Environment variable that hands a launched server its API key (:data:`BOOTSTRAP`); an
attached server's key may be given in it too (``engine_args.api_key`` otherwise)."""
BOOTSTRAP = (
    "import os, runpy, sys\n"
    f"key = os.environ.pop({API_KEY_ENV!r}, '')\n"
    "if not key: sys.exit('rollart: no API key for the SGLang server in $" + API_KEY_ENV + "')\n"
    "sys.argv[1:] = [*sys.argv[1:], '--api-key', key]\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n")
"""``python -c`` code that runs ``python -m sglang.launch_server ARGS --api-key KEY`` with
the key from :data:`API_KEY_ENV`: the same module run as ``-m`` runs it (its spawned
workers find it by name), without the key on the command line."""
FLASHINFER_HEAD_DIMS = (64, 128, 256)
LOGPROB_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "RETURN_ORIGINAL_LOGPROB": "1"}
"""Set on a launched server: log-probs of the distribution before the temperature."""


# ======================================================================================
# Launching a server
# ======================================================================================
def server_flags(args: Mapping[str, Any]) -> list[str]:
    """``{"mem_fraction_static": 0.5, "disable_cuda_graph": True}`` ->
    ``["--mem-fraction-static", "0.5", "--disable-cuda-graph"]``."""
    out: list[str] = []
    for key, val in args.items():
        flag = "--" + str(key).replace("_", "-")
        if val is None or val is False:
            continue
        if val is True:
            out.append(flag)
        elif isinstance(val, (list, tuple)):
            out += [flag, *(str(v) for v in val)]
        elif isinstance(val, Mapping):
            out += [flag, json.dumps(val)]
        else:
            out += [flag, str(val)]
    return out


def server_command(model_dir: str | os.PathLike, *, port: int, seed: int = 0,
                   args: Mapping[str, Any] | None = None, python: str | None = None,
                   head_dim: int | None = None) -> list[str]:
    """The command line of a launched server: ``sglang.launch_server`` through
    :data:`BOOTSTRAP` (its API key comes from the environment, see :func:`spawn_server`)."""
    args = {str(k).replace("-", "_"): v for k, v in dict(args or {}).items()}
    fixed = sorted(k for k in args if k in FIXED_FLAGS)
    if fixed:
        raise ValueError(f"proxy.engine_args: {fixed} are set by the sglang engine itself")
    for k in args:
        if k in REFUSED_FLAGS and args[k] not in (None, False):
            raise ValueError(f"proxy.engine_args: {k} is refused: {REFUSED_FLAGS[k]}")
    host = args.pop("host", "127.0.0.1")
    args.setdefault("random_seed", int(seed))
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        args.setdefault("attention_backend", "triton")
    return [python or sys.executable, "-c", BOOTSTRAP,
            "--model-path", str(model_dir), "--host", str(host), "--port", str(int(port)),
            "--skip-tokenizer-init", *server_flags(args)]


@functools.lru_cache(maxsize=8)
def sglang_unavailable_reason(python: str | None = None) -> str | None:
    """None when ``python`` (default ``$ROLLART_SGLANG_PYTHON`` or this interpreter) has
    sglang and sees a CUDA GPU; else why not (a test's skip reason)."""
    python = python or os.environ.get("ROLLART_SGLANG_PYTHON") or sys.executable
    if python == sys.executable:
        if importlib.util.find_spec("sglang") is None:
            return ("sglang is not installed (pip install uv && uv pip install sglang, or "
                    "$ROLLART_SGLANG_PYTHON naming an interpreter that has it)")
        try:  # optional dependency
            import torch
        except ImportError:
            return "torch is not installed"
        if not torch.cuda.is_available():
            return "no CUDA GPU (SGLang serves on CUDA)"
        return None
    code = ("import importlib.util, sys\n"
            "if importlib.util.find_spec('sglang') is None: sys.exit('sglang is not installed')\n"
            "import torch\n"
            "sys.exit(None if torch.cuda.is_available() else 'no CUDA GPU')\n")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {python}: {e}"
    if r.returncode:
        return f"{python}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}"
    return None




# ======================================================================================
# The server process
# ======================================================================================
async def require_sglang(python: str) -> None:
    """``RuntimeError`` (saying how to install it) unless ``python`` can import sglang."""
    await require_package(python, "sglang", "sglang",
                          "proxy.engine_args.python or $ROLLART_SGLANG_PYTHON", INSTALL_HINT)


def spawn_server(command: list[str], log_path: Path, env: Mapping[str, str], api_key: str
                 ) -> subprocess.Popen:
    """Start the server ``command`` with its output in ``log_path`` (created private: 0600);
    its environment is this process's, :data:`LOGPROB_ENV`, ``env`` (``engine_args.env``)
    and ``api_key`` in :data:`API_KEY_ENV`."""
    if not api_key or not re.fullmatch(r"[-_A-Za-z0-9]+", api_key):
        raise ValueError("the SGLang server's API key must be url-safe characters, not empty")
    full_env = {**os.environ, **LOGPROB_ENV, **env, API_KEY_ENV: api_key}
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a log file that existed keeps no wider mode
    with open(fd, "wb") as out:
        # its own session: close() signals the whole group (scheduler, detokenizer);
        # on Linux it also gets SIGTERM if this (main) thread dies without close()
        tie = (sys.platform.startswith("linux")
               and threading.current_thread() is threading.main_thread())
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM) if tie else None)


def shown(command: list[str] | None) -> str:
    """``command`` for a message: :data:`BOOTSTRAP` as ``-m sglang.launch_server``."""
    return " ".join("-m sglang.launch_server" if a == BOOTSTRAP else a
                    for a in (command or []) if a != "-c")


def exited_error(proc: subprocess.Popen | None, command: list[str] | None,
                 log_path: Path | None, secret: str | None = None) -> RuntimeError | None:
    """The error to raise when the launched server ``proc`` has exited (None: it runs, or
    there is none), with the last lines of its log (``secret`` masked)."""
    if proc is None or proc.poll() is None:
        return None
    return RuntimeError(
        f"the SGLang server exited with code {proc.returncode} before it was ready: "
        f"{shown(command)}\n--- last lines of {log_path}:\n"
        f"{tail(log_path, secret=secret)}")


async def wait_ready(session: Any, aiohttp: Any, url: str, *, startup_timeout_s: float,
                     proc: subprocess.Popen | None, command: list[str] | None,
                     log_path: Path | None, secret: str | None = None) -> None:
    """Poll ``/health_generate`` on ``session`` (an ``aiohttp.ClientSession``) until it
    answers 200 (the server generates); ``RuntimeError`` when the launched server ``proc``
    (None: attached) exits first, or after ``startup_timeout_s``."""
    deadline = time.monotonic() + startup_timeout_s
    while True:
        err = exited_error(proc, command, log_path, secret)
        if err is not None:
            raise err
        last = await get_status(session, url + "/health_generate", 60)
        if last is None:
            return
        if time.monotonic() > deadline:
            what = (f"the SGLang server it launched ({shown(command)})"
                    if proc is not None else "the SGLang server")
            log_tail = (f"\n--- last lines of {log_path}:\n{tail(log_path, secret=secret)}"
                        if log_path else "")
            raise RuntimeError(
                f"proxy.engine sglang: {what} at {url} was not ready after "
                f"{startup_timeout_s:.0f} s (GET /health_generate: {last}; raise "
                f"proxy.engine_args.startup_timeout_s if it is only slow){log_tail}")
        await asyncio.sleep(0.5)


def kill_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it has scheduler and detokenizer children),
    then SIGKILL what is left after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        kill_group(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    kill_group(proc.pid, signal.SIGKILL)  # children outliving the leader
