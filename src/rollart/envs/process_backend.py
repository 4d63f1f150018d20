"""The process backend of :class:`~rollart.envs.runner.EnvRunner` (``executor: process``).

The env is constructed *inside* a dedicated worker process from its type and args (so they
must be picklable) and lives there; calls travel over a pipe as ``(seq, method, arg)``.
:func:`worker_main` is the child's side: the worker process imports this module by name
(forkserver or spawn), so it stays a module-level function. :class:`ProcessBackend` is the
parent's side: it starts the worker, awaits its replies on the event loop, and kills it on
a timeout. A dead worker is detected as EOF on its pipe.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import signal
import sys
import traceback
from typing import Any

from rollart.envs.base import legal_actions_of
from rollart.envs.errors import EnvError, WorkerError, describe, transient_setup
from rollart.envs.registry import make_env

log = logging.getLogger(__name__)


def worker_main(conn: Any, env_type: str, env_args: dict, sys_path: list[str]) -> None:
    """Body of a process-mode worker: build the env, then serve (seq, method, arg) requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    sys.path[:] = sys_path + [p for p in sys.path if p not in sys_path]
    loop: asyncio.AbstractEventLoop | None = None

    def run(x: Any) -> Any:
        nonlocal loop
        if inspect.isawaitable(x):
            loop = loop or asyncio.new_event_loop()
            return loop.run_until_complete(x)
        return x

    def reply(seq: int, ok: bool, payload: Any) -> None:
        try:
            conn.send((seq, ok, payload))
        except (BrokenPipeError, EOFError, OSError):
            raise SystemExit(0)
        except Exception as e:  # e.g. an unpicklable info value
            conn.send((seq, False, f"could not send result: {describe(e)}"))

    try:
        env = make_env(env_type, env_args)
    except BaseException as e:
        reply(0, False, (describe(e), transient_setup(e)))
        return
    reply(0, True, getattr(env, "instruction", None) or "")  # optional attribute
    while True:
        try:
            seq, method, arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if method == "close":
                fn = getattr(env, "close", None)
                reply(seq, True, run(fn()) if fn is not None else None)
                return
            res = run(getattr(env, method)(arg))
            reply(seq, True, (res, legal_actions_of(env)))
        except Exception as e:
            log.debug("env %s failed:\n%s", method, traceback.format_exc())
            reply(seq, False, describe(e))


class ProcessBackend:
    """One env in a worker process of its own, started with ``mp_context``."""

    def __init__(self, env_type: str, env_args: dict, mp_context: str) -> None:
        self._type, self._args = env_type, env_args
        self._ctx = multiprocessing.get_context(mp_context)
        self._proc: Any = None
        self._conn: Any = None
        self._seq = 0
        self.dead = False
        """True once the worker is gone (died, failed to build the env, or was killed)."""

    def _spawn(self) -> None:
        parent, child = self._ctx.Pipe()
        self._conn = parent
        self._proc = self._ctx.Process(target=worker_main, name=f"env-{self._type}", daemon=True,
                                       args=(child, self._type, self._args, list(sys.path)))
        self._proc.start()
        child.close()

    async def _recv(self, seq: int) -> Any:
        loop = asyncio.get_running_loop()
        fd = self._conn.fileno()
        while True:
            fut = loop.create_future()

            def ready() -> None:
                if not fut.done():
                    try:
                        fut.set_result(self._conn.recv())
                    except BaseException as e:
                        fut.set_exception(e)

            loop.add_reader(fd, ready)
            try:
                msg = await fut
            except (EOFError, OSError) as e:
                self.dead = True
                code = self._proc.exitcode if self._proc is not None else None
                raise EnvError(f"env worker process died (exit code {code})") from e
            finally:
                loop.remove_reader(fd)
            if msg[0] == seq:  # older seqs are replies to cancelled calls: drop them
                _, ok, payload = msg
                if not ok:
                    if isinstance(payload, tuple):  # (text, transient): a construction error
                        raise WorkerError(*payload)
                    raise WorkerError(payload)
                return payload

    async def start(self) -> str:
        await asyncio.to_thread(self._spawn)
        try:
            return await self._recv(0)
        except WorkerError:
            self.dead = True  # the worker exits after reporting a construction error
            raise

    async def call(self, method: str, arg: Any) -> tuple[Any, list[str] | None]:
        self._seq += 1
        try:
            self._conn.send((self._seq, method, arg))
        except (BrokenPipeError, OSError) as e:
            self.dead = True
            raise EnvError(f"env worker process is gone: {describe(e)}") from e
        return await self._recv(self._seq)

    async def close(self, healthy: bool) -> None:
        try:
            if healthy and self._proc is not None and self._proc.is_alive():
                await self.call("close", None)
                await asyncio.to_thread(self._proc.join, 5.0)
        finally:
            self.kill()

    def kill(self) -> None:
        self.dead = True
        if self._proc is not None and self._proc.pid is not None and self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(1.0)  # SIGKILL is immediate: this reaps the zombie
        if self._conn is not None:
            self._conn.close()
            self._conn = None
