"""Several "hosts" on one machine: Linux network namespaces on a private bridge.

Each :class:`Host` is a network namespace with its own address ``10.X.0.k/24`` on a veth
whose other end is a port of a bridge in the root namespace (the bridge holds
``10.X.0.254``, so the test process itself reaches every host). ``X`` is picked at random
among the ``10.X.0.0/24`` networks no interface of this machine uses. Processes run inside
a namespace with ``ip netns exec`` (which execs the command: the Popen's pid is the
process itself, so ``kill -9`` hits it and not a wrapper), their output goes to a log file.

Every name starts with :data:`PREFIX` and is at most 15 characters (the kernel's limit on
interface names). :meth:`Hosts.close` always removes what :meth:`Hosts.up` created, and
:func:`remove_stale` removes what a killed test session left behind (namespaces with no
process in them, bridges with no port).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

PREFIX = "rat-"
"""Prefix of every namespace, bridge and veth the harness creates."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a skip reason), or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` as uid 0); run the tests as root"
    probe = f"{PREFIX}probe{uuid.uuid4().hex[:6]}"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed here: {r.stderr.strip() or r.stdout.strip()}"
    ip("netns", "del", probe, check=False)
    r = ip("link", "add", probe[:15], "type", "bridge", check=False)
    if r.returncode != 0:
        return f"`ip link add ... type bridge` failed here: {r.stderr.strip()}"
    ip("link", "del", probe[:15], check=False)
    return None


def _netns_names() -> list[str]:
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    r = ip("-o", "link", "show", check=False)
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@", 1)[0])
    return out


def _kill_pids_in(ns: str) -> None:
    r = ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale() -> list[str]:
    """Remove leftovers of killed sessions: ``rat-`` namespaces with no process in them,
    ``rat-`` bridges with no port. Namespaces in use (another session) are left alone."""
    removed = []
    for ns in _netns_names():
        if ns.startswith(PREFIX) and not ip("netns", "pids", ns, check=False).stdout.split():
            ip("netns", "del", ns, check=False)
            removed.append(ns)
    for link in _link_names():
        if not link.startswith(PREFIX):
            continue
        kind = ip("-d", "-o", "link", "show", link, check=False).stdout
        if " bridge " in kind and not ip("-o", "link", "show", "master", link, check=False).stdout.strip():
            ip("link", "del", link, check=False)
            removed.append(link)
    return removed


def _free_net() -> int:
    """A random ``X`` such that no address of this machine is in ``10.X.0.0/16``."""
    used = {int(x) for x in re.findall(r"\b10\.(\d+)\.", ip("-o", "addr", check=False).stdout
                                           + ip("-o", "route", check=False).stdout)}
    choices = [x for x in range(64, 251) if x not in used]
    if not choices:
        raise RuntimeError("no free 10.X.0.0/24 network for the test hosts")
    return random.choice(choices)


class Proc:
    """A process inside a host's namespace; its stdout and stderr go to ``log``."""

    def __init__(self, host: Host, argv: list[str], log: Path, *, env: dict | None = None,
                 cwd: str | os.PathLike | None = None):
        self.host = host
        self.argv = argv
        self.log = log
        self._fh = open(log, "ab")  # noqa: SIM115 - closed in kill()
        self.popen = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], cwd=cwd, env=env,
                                      stdin=subprocess.DEVNULL, stdout=self._fh,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid
        self.started = time.monotonic()

    def __repr__(self) -> str:
        return f"<Proc {self.log.name} pid {self.pid} on {self.host.name} rc {self.poll()}>"

    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-n:])

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """kill -9, and reap it."""
        self.signal(signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._fh.close()

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    async def wait(self, deadline: float) -> int | None:
        end = time.monotonic() + deadline
        while self.popen.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.1)
        return self.popen.poll()

    async def line_with(self, needle: str, deadline: float = 60.0) -> str:
        end = time.monotonic() + deadline
        while True:
            for line in self.output().splitlines():
                if needle in line:
                    return line
            if self.popen.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"{self.log.name} never printed {needle!r} "
                                     f"(rc {self.popen.poll()}):\n{self.tail()}")
            await asyncio.sleep(0.1)


@dataclass
class Host:
    name: str
    """Short name (``h1``...); log files are named after it."""
    ns: str
    """Network namespace."""
    addr: str
    """Its address (``10.X.0.k``)."""
    logs: Path
    dev: str = ""
    """Its veth inside the namespace."""
    outer: str = ""
    """The other end of that veth: a port of the bridge, in the root namespace."""
    procs: list[Proc] = field(default_factory=list)

    def unplug(self) -> None:
        """Take the host off the network (its veth down): connections fail at once, with
        "network unreachable"; processes inside keep running."""
        ip("-n", self.ns, "link", "set", self.dev, "down")

    def plug(self) -> None:
        """Put the host back on the network (address and route come back with the link)."""
        ip("-n", self.ns, "link", "set", self.dev, "up")
        if f"{self.addr}/24" not in ip("-n", self.ns, "-o", "addr", "show", "dev", self.dev).stdout:
            ip("-n", self.ns, "addr", "add", f"{self.addr}/24", "dev", self.dev, check=False)

    def shape(self, rate: str, burst: str = "64kb", latency: str = "400ms") -> None:
        """Rate-limit the host's link both ways with ``tc ... tbf`` (``rate`` as tc spells it:
        ``8mbit`` is 1 MB/s): its veth's egress (host to bridge) and the bridge port's (bridge
        to host). ``netem`` is not available here, ``tbf`` is (tests/hosts only: the product
        never shapes)."""
        for ns, dev in ((self.ns, self.dev), (None, self.outer)):
            args = ("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", latency)
            r = subprocess.run(["tc", *(("-n", ns) if ns else ()), *args], capture_output=True,
                               text=True, timeout=30, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"tc {' '.join(args)} failed: {r.stderr.strip()}")

    def tx_to(self) -> int:
        """Bytes sent to this host over its link so far (the bridge port's tx counter)."""
        return int(Path(f"/sys/class/net/{self.outer}/statistics/tx_bytes").read_text())

    def cut(self) -> None:
        """Cut the host's link as a cable cut would: the bridge port goes down, so whatever
        the host sends or is sent is dropped without an error (a black hole: established TCP
        connections only stop hearing back); inside the host, its address, routes and the
        connections between its own processes are untouched (unlike :meth:`unplug`)."""
        ip("link", "set", self.outer, "down")

    def mend(self) -> None:
        """Undo :meth:`cut` (a shaping stays as it was)."""
        ip("link", "set", self.outer, "up")

    def run(self, argv: list[str], log_name: str, *, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> Proc:
        """Start ``argv`` in this host's namespace; output to ``logs/<host>-<log_name>.log``."""
        p = Proc(self, [str(a) for a in argv], self.logs / f"{self.name}-{log_name}.log",
                 env=env, cwd=cwd)
        self.procs.append(p)
        return p

    def exec(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a short command in the namespace and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True,
                              text=True, timeout=timeout, check=False)


class Hosts:
    """``n`` namespaces on one bridge. ``with Hosts(n, logs) as hosts: hosts[0].run(...)``."""

    def __init__(self, n: int, logs: Path):
        if not 1 <= n <= 60:
            raise ValueError("1 to 60 hosts")
        self.n = n
        self.logs = Path(logs)
        self.tag = uuid.uuid4().hex[:4]
        self.net = 0
        self.bridge = f"{PREFIX}{self.tag}-br"
        self.hosts: list[Host] = []
        self._veths: list[str] = []
        self._namespaces: list[str] = []

    def __enter__(self) -> Self:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def gateway(self) -> str:
        """The bridge's address in the root namespace (where the test process is)."""
        return f"10.{self.net}.0.254"

    def up(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.net = _free_net()
        ip("link", "add", self.bridge, "type", "bridge")
        self._veths.append(self.bridge)  # deleted with the veths
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for k in range(1, self.n + 1):
            ns = f"{PREFIX}{self.tag}-{k}"
            outer, inner = f"{ns}h", f"{ns}n"
            assert len(outer) <= 15, outer
            ip("netns", "add", ns)
            self._namespaces.append(ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._veths.append(outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "master", self.bridge)
            ip("link", "set", outer, "up")
            addr = f"10.{self.net}.0.{k}"
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            self.hosts.append(Host(name=f"h{k}", ns=ns, addr=addr, logs=self.logs, dev=inner,
                                   outer=outer))

    def all_procs(self) -> list[Proc]:
        return [p for h in self.hosts for p in h.procs]

    def close(self) -> None:
        """Kill every process started in the namespaces, then remove namespaces, veths and
        the bridge. Never raises; safe to call twice."""
        for p in self.all_procs():
            try:
                p.kill()
            except Exception:  # noqa: BLE001, S110 - cleanup goes on
                pass
        for ns in self._namespaces:
            _kill_pids_in(ns)  # anything a process left behind
        for ns in self._namespaces:
            ip("netns", "del", ns, check=False)
        for link in self._veths:  # the peer of a deleted namespace's veth goes by itself, later
            if link in _link_names():
                ip("link", "del", link, check=False)
        self._namespaces, self._veths = [], []

    def leftovers(self) -> list[str]:
        """Names of this instance's namespaces and links that still exist (for tests)."""
        mine = f"{PREFIX}{self.tag}"
        return [x for x in _netns_names() + _link_names() if x.startswith(mine)]
