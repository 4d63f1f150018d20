"""What the engines that drive an inference server over HTTP share (``proxy.engine: sglang``
and ``vllm-server``; standard library only): a server's answer read no further than its cap
(:func:`read_bounded`), a free loopback port (:func:`free_port`), the last lines of a
server's log with its key masked (:func:`tail`), and signalling a server's whole process
group (:func:`kill_group`: the API process and the scheduler or EngineCore it started).
What each server's answers mean stays in its own protocol module
(:mod:`~rollart.engines.sglang_protocol`, :mod:`~rollart.engines.vllm_server_protocol`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Any

__all__ = ["read_bounded", "free_port", "tail", "kill_group"]


async def read_bounded(r: Any, what: str, cap: int, error: type[Exception]) -> bytes:
    """The body of the answer ``r`` (an ``aiohttp.ClientResponse``), read no further than
    ``cap`` bytes; ``error(message)`` (the message starts with ``what``) when it is larger."""
    if r.content_length is not None and r.content_length > cap:
        raise error(f"{what} answer: {r.content_length} bytes, more than {cap} bytes")
    chunks, size = [], 0
    async for chunk in r.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > cap:
            raise error(f"{what} answer: more than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(path: Path | None, lines: int = 30, secret: str | None = None) -> str:
    """The last ``lines`` of the server's log, ``secret`` (its API key) masked."""
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    out = "\n".join(text[-lines:])
    return out.replace(secret, "***") if secret else out


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads (gone already: nothing)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def require_package(python: str, package: str, engine: str, names: str, hint: str) -> None:
    """``RuntimeError`` (saying how to install it) unless the interpreter ``python`` can import
    ``package``: the check a server engine makes before it launches its server there.
    ``engine`` and ``names`` (the settings that chose ``python``) go into the message."""
    if python == sys.executable:
        missing = importlib.util.find_spec(package) is None
    else:
        try:
            proc = await asyncio.create_subprocess_exec(
                python, "-c", "import importlib.util, sys; "
                f"sys.exit(importlib.util.find_spec({package!r}) is None)",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        except OSError as e:
            raise RuntimeError(f"proxy.engine {engine}: cannot run the interpreter {python!r} "
                               f"({names}): {e}") from None
        missing = (await proc.wait()) != 0
    if missing:
        raise RuntimeError(f"proxy.engine {engine}: the {package} package is not available to "
                           f"{python}: {hint}")


async def get_status(session: Any, url: str, timeout_s: float) -> str | None:
    """GET ``url`` once on ``session`` (an ``aiohttp.ClientSession``): None when it answers
    200, else what it answered (``HTTP 503``) or the error: one probe of a server's health
    wait."""
    import aiohttp  # deferred: the server engines' optional dependency

    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return f"{type(e).__name__}: {e}"
