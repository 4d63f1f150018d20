"""Fixtures of the many-hosts tests: ``hosts(n)`` gives ``n`` network namespaces (each a
"host" with its own address on a private bridge), ``nats_cluster(hosts)`` a JetStream
cluster with one nats-server per given host. Everything is removed at teardown, whatever
the test did; leftovers of killed sessions are removed when the first test here starts.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2, a
container without CAP_NET_ADMIN / CAP_SYS_ADMIN). CI runs as root, so they run there.
"""

from __future__ import annotations

import pytest

from tests.hosts import netns


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "hosts: tests that run nodes in Linux network namespaces (root only)")


_checked: dict[str, str | None] = {}
_holds: list = []
LOCK = "/tmp/rollart-test-hosts.lock"
"""Every test process that makes hosts holds this file's lock shared for its life; stale
leftovers are removed only under the exclusive lock, so when no other test process (an
xdist worker beside this one) is alive: a namespace another worker has just made, before
its first process starts, looks stale but is not (a race ``-n 2`` hit)."""


def _check_and_clean() -> str | None:
    """Why namespaces cannot be made here (None: they can); leftovers removed when alone."""
    import fcntl

    fd = open(LOCK, "a")  # noqa: SIM115 - held open (its lock) until this process exits
    _holds.append(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        alone = True
    except BlockingIOError:  # another test process is alive: its namespaces are no leftovers
        fcntl.flock(fd, fcntl.LOCK_SH)
        alone = False
    why = netns.unavailable()
    if alone:
        if why is None:
            netns.remove_stale()
        fcntl.flock(fd, fcntl.LOCK_SH)
    return why


@pytest.fixture(scope="session")
def netns_ok():
    """Skip unless namespaces work here; on the first use remove stale ``rat-`` leftovers
    (only when no other test process holds hosts)."""
    if "why" not in _checked:
        _checked["why"] = _check_and_clean()
    if _checked["why"]:
        pytest.skip(f"no network namespaces: {_checked['why']}")


@pytest.fixture
def hosts(netns_ok, tmp_path):
    """``hosts(n)`` -> :class:`tests.hosts.netns.Hosts`, up, with logs under ``tmp_path/logs``;
    closed (processes killed, namespaces, veths and bridge removed) at teardown."""
    made: list[netns.Hosts] = []

    def make(n: int) -> netns.Hosts:
        h = netns.Hosts(n, tmp_path / "logs")
        made.append(h)
        h.up()
        return h

    try:
        yield make
    finally:
        for h in made:
            h.close()


@pytest.fixture
def nats_cluster(tmp_path):
    """``await nats_cluster(host_list)`` -> a started, ready :class:`NatsCluster` (one
    nats-server per host, every stream may have ``len(host_list)`` replicas)."""
    from tests.hosts.cluster import NatsCluster

    made: list[NatsCluster] = []

    async def make(host_list, deadline: float = 30.0) -> NatsCluster:
        c = NatsCluster(host_list, tmp_path / "nats")
        made.append(c)
        c.start()
        c.ready_s = await c.wait_ready(deadline)
        return c

    try:
        yield make
    finally:
        for c in made:
            for i in range(len(c.procs)):
                c.kill(i)
