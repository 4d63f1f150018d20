"""A JetStream cluster of nats-servers, one per test host (network namespace).

Each server has a ``server_name``, its own JetStream store, listens for clients and for
routes on its host's address only, and routes to every peer. No authentication: the
namespaces are private to the test (the bridge is not forwarded anywhere), and running
the ``nats-server`` binary directly sidesteps the embedded server's refusal to listen on a
non-loopback address without auth (:func:`rollart.bus.server.check_listen`).

Readiness is polled, never slept for: a stream with as many replicas as servers can be
created only once the meta group has a leader and every server is a JetStream peer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from rollart.bus.server import find_binary
from tests.hosts.netns import Host, Proc

CLIENT_PORT = 4222
ROUTE_PORT = 6222


def server_config(name: str, addr: str, store: Path, peers: list[str], cluster: str) -> str:
    routes = ", ".join(f'"nats-route://{p}:{ROUTE_PORT}"' for p in peers)
    return (
        f'server_name: "{name}"\n'
        f'listen: "{addr}:{CLIENT_PORT}"\n'
        f'jetstream {{\n  store_dir: "{store}"\n  max_memory_store: 64MB\n  max_file_store: 2GB\n}}\n'
        f'cluster {{\n  name: "{cluster}"\n  listen: "{addr}:{ROUTE_PORT}"\n'
        f'  routes: [{routes}]\n}}\n'
    )


class NatsCluster:
    def __init__(self, hosts: list[Host], root: Path):
        self.hosts = list(hosts)
        self.root = Path(root)
        self.name = f"rat{uuid.uuid4().hex[:6]}"
        self.binary = find_binary()
        self.procs: list[Proc | None] = [None] * len(self.hosts)
        self.configs: list[Path] = []
        for i, h in enumerate(self.hosts):
            d = self.root / f"n{i + 1}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "server.conf"
            conf.write_text(server_config(f"{self.name}-n{i + 1}", h.addr, d / "store",
                                          [p.addr for p in self.hosts if p is not h], self.name))
            self.configs.append(conf)

    @property
    def urls(self) -> list[str]:
        return [f"nats://{h.addr}:{CLIENT_PORT}" for h in self.hosts]

    def start(self, i: int | None = None) -> None:
        for k in range(len(self.hosts)) if i is None else [i]:
            self.procs[k] = self.hosts[k].run([self.binary, "-c", str(self.configs[k])],
                                              f"nats-n{k + 1}")

    def kill(self, i: int) -> None:
        """kill -9 server ``i``."""
        p = self.procs[i]
        if p is not None:
            p.kill()

    def alive(self) -> list[bool]:
        return [p is not None and p.alive for p in self.procs]

    def logs(self) -> str:
        return "\n".join(f"--- nats-n{k + 1} ---\n{p.tail(15)}"
                         for k, p in enumerate(self.procs) if p is not None)

    async def wait_ready(self, deadline: float = 30.0, replicas: int | None = None) -> float:
        """Wait until a stream with ``replicas`` (default: all servers) copies can be created
        (then delete it); returns the seconds it took."""
        import nats
        from nats.js.api import StorageType, StreamConfig

        replicas = replicas or len(self.hosts)
        t0 = time.monotonic()
        end = t0 + deadline
        last: BaseException | None = None
        live = [u for u, a in zip(self.urls, self.alive()) if a]

        async def _err(e):  # nats-py prints a traceback per reconnect attempt without it
            pass

        while time.monotonic() < end:
            dead = [k for k, p in enumerate(self.procs) if p is not None and not p.alive]
            if dead and len(dead) == len(self.procs):
                raise AssertionError(f"every nats-server exited:\n{self.logs()}")
            nc = None
            try:
                nc = await nats.connect(servers=live, connect_timeout=1, allow_reconnect=False,
                                        error_cb=_err)
                js = nc.jetstream(timeout=2)
                name = f"RATPROBE{uuid.uuid4().hex[:6]}"
                await js.add_stream(StreamConfig(name=name, subjects=[f"ratprobe.{name}"],
                                                 num_replicas=replicas,
                                                 storage=StorageType.MEMORY))
                await js.publish(f"ratprobe.{name}", b"x", timeout=2)
                await js.delete_stream(name)
                return time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - not ready yet
                last = e
            finally:
                if nc is not None:
                    try:
                        await nc.close()
                    except Exception:  # noqa: BLE001, S110 - closing a probe
                        pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"the {len(self.hosts)}-server cluster was not ready for an "
                             f"R{replicas} stream within {deadline}s (last error: {last!r}):\n"
                             f"{self.logs()}")
