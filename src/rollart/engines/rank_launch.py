"""How trainer ranks find each other (:mod:`rollart.engines.trainer_ranks` is what they do
together): rank 0 opens a ``TCPStore`` and writes the backend's arguments into it, starts
ranks 1..N-1 on its own host (or waits for ranks started by hand at ``trainer.master``) and
builds the process group once all joined; a rank it started exits with it."""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rollart.engines.trainer_ranks import RankedTrainBackend, RankFailed
from rollart.procs import describe_exit

__all__ = ["JOIN_TIMEOUT_S", "backend_class", "parse_master", "serve_rank", "start_ranks"]

log = logging.getLogger(__name__)


JOIN_TIMEOUT_S = 300.0
"""Seconds rank 0 waits for the other ranks to join (ranks it started: until one exits)."""


SPEC_KEY = "rollart/spec"


JOINED_KEY = "rollart/joined"


def parse_master(master: str) -> tuple[str, int]:
    host, _, port = master.rpartition(":")
    return host.strip("[]"), int(port)


def backend_class(shard: str) -> type[RankedTrainBackend]:
    """The rank class of ``trainer.shard``: replicas (``none``) or FSDP2 shards (``fsdp2``)."""
    if shard == "none":
        return RankedTrainBackend
    if shard == "fsdp2":
        from rollart.engines.fsdp2_ranks import Fsdp2TrainBackend

        return Fsdp2TrainBackend
    raise ValueError(f"trainer.shard must be 'none' or 'fsdp2' (it is {shard!r})")


def start_ranks(model_dir: str | os.PathLike, *, world_size: int, dist_timeout: float,
                master: str | None = None, log_dir: str | os.PathLike | None = None,
                join_timeout: float = JOIN_TIMEOUT_S, shard: str = "none",
                **kwargs: Any) -> RankedTrainBackend:
    """Rank 0's backend: open the rendezvous store, start ranks 1..N-1 on this host (unless
    ``master`` is given: then they are started by hand), wait for them to join, build the
    process group. ``kwargs``: :class:`TorchTrainBackend`'s arguments (every rank gets them);
    ``shard``: ``trainer.shard`` (:func:`backend_class`)."""
    cls = backend_class(shard)
    local = master is None
    host, port = ("127.0.0.1", 0) if local else parse_master(master)
    store = dist.TCPStore(host if local else "0.0.0.0", port, world_size, is_master=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=join_timeout))
    addr = f"{host}:{store.port}"
    store.set(SPEC_KEY, json.dumps({"model_dir": str(model_dir), "world_size": world_size,
                                    "dist_timeout": dist_timeout, "shard": shard,
                                    "kwargs": kwargs}))
    backend = cls(model_dir, rank=0, world_size=world_size,
                                 dist_timeout=dist_timeout, **kwargs)
    backend._store = store  # the store must live as long as the group
    try:
        if local:
            logs = Path(log_dir) if log_dir is not None else Path(model_dir)
            logs.mkdir(parents=True, exist_ok=True)
            for r in range(1, world_size):
                backend.logs[r] = logs / f"trainer-rank{r}.log"
                backend.procs[r] = _spawn(r, addr, backend.logs[r], kwargs.get("threads"))
            atexit.register(backend.shutdown, kill=True)
            log.info("trainer ranks 1..%d started on this host (rendezvous %s): pids %s",
                     world_size - 1, addr, [p.pid for p in backend.procs.values()])
        else:
            log.info("trainer rank 0 waits for ranks 1..%d at %s (python -m rollart.node "
                     "--roles trainer --rank R)", world_size - 1, addr)
        deadline = time.monotonic() + join_timeout
        while store.add(JOINED_KEY, 0) < world_size - 1:
            dead = [r for r, p in backend.procs.items() if p.poll() is not None]
            if dead:
                raise RankFailed("; ".join(
                    f"trainer rank {r} exited ({describe_exit(backend.procs[r].returncode)}) before "
                    f"joining; see its log {backend.logs[r]}" for r in dead))
            if time.monotonic() > deadline:
                raise RankFailed(f"trainer ranks: only {store.add(JOINED_KEY, 0)} of "
                                 f"{world_size - 1} ranks joined at {addr} within {join_timeout:g} s")
            time.sleep(0.05)
        backend.join(store, address=host)
    except BaseException:
        backend.shutdown(kill=True)
        raise
    threading.Thread(target=backend._keepalive, name="trainer-ranks-ping", daemon=True).start()
    log.info("trainer ranks: %d processes in the group (%s, shard %s)", world_size,
             "gloo" if backend.device.type != "cuda" else "nccl", shard)
    return backend


def _spawn(rank: int, addr: str, log_path: Path, threads: int | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, "-m", "rollart.app.trainer_rank", "--rank", str(rank), "--master", addr,
           "--parent", str(os.getpid())]
    with open(log_path, "ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} trainer rank 0 (pid {os.getpid()}): "
                  f"start {' '.join(cmd[1:])}\n".encode())
        out.flush()
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env)


def serve_rank(rank: int, master: str, *, model_dir: str | os.PathLike | None = None,
               parent: int | None = None, join_timeout: float = JOIN_TIMEOUT_S) -> int:
    """Ranks 1..N-1: join rank 0 at ``master`` (``HOST:PORT``), then take its commands until
    it stops them; the exit status. ``model_dir``: this host's copy of the model folder
    (default: the one rank 0 named). ``parent``: exit when that process is gone."""
    if parent:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    host, port = parse_master(master)
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=join_timeout))
    spec = json.loads(store.get(SPEC_KEY))
    if rank < 1 or rank >= spec["world_size"]:
        raise ValueError(f"--rank {rank}: the trainer's world_size is {spec['world_size']} "
                         f"(ranks 1..{spec['world_size'] - 1} join rank 0)")
    kwargs = spec["kwargs"]
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    backend = backend_class(str(spec.get("shard", "none")))(model_dir or spec["model_dir"], rank=rank,
                                 world_size=spec["world_size"], dist_timeout=spec["dist_timeout"],
                                 **kwargs)
    store.add(JOINED_KEY, 1)
    backend.join(store, address=_route_to(host))
    log.info("trainer rank %d of %d joined %s (%s, pid %d)", rank, backend.world_size, master,
             socket.gethostname(), os.getpid())
    return backend.serve()


def _route_to(host: str) -> str:
    """This host's address on the route to ``host`` (what rank 0 reaches this rank at)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: only the route is chosen
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _exit_with(pid: int) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass
