"""A hub nats-server and leaf-node sites, one per test host (network namespace), from the
configs ``rollart cluster sites`` writes (:func:`rollart.deploy.sites.sites_init`).

The hub runs JetStream (domain :data:`rollart.deploy.sites.DOMAIN`) and a leaf listener;
each site's server has no JetStream and dials the hub. Readiness is polled on the hub's
monitoring endpoint ``/leafz`` (one entry per connected site), never slept for.

``secure``: a ``rollart secure init`` folder (``cluster sites --secure``): TLS and users
everywhere, the leaf links under TLS.

``trace=True`` makes the hub log every protocol line (payloads cut to one byte): the leaf
connections' ``LMSG`` lines say which subjects crossed each link, in which direction and
with how many payload bytes (:meth:`Sites.crossings`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path

from rollart.bus.server import find_binary
from rollart.deploy.sites import DOMAIN, sites_init
from tests.hosts.netns import Host, Proc
from tests.waiting import until

_LMSG = re.compile(r" - lid:(\d+) - (<<-|->>) \[[LH]MSG (\S+) (?:.* )?(\d+)\]$")
"""A message on a leaf connection in the hub's trace: LMSG (no headers) or HMSG (headers;
the last number is the whole size either way)."""


def subject_kind(subject: str) -> str:
    """What a subject is, for counting: ``generate.request``, ``inbox``, ``js:CONSUMER.MSG.NEXT``,
    ``js-ack``, ``kv``, ..."""
    t = subject.split(".")
    if t[0] == "rollart" and len(t) >= 4:
        return ".".join(t[2:4])
    if t[0].startswith("_INBOX"):
        return "inbox (replies)"
    if t[0] == "$JS" and len(t) > 3 and t[2] == "API":
        verb = []
        for x in t[3:6]:
            if not (x.isalpha() and x.isupper()) and not x.startswith("$"):
                break
            verb.append(x)
        return "js-api:" + ".".join(verb)
    if t[0] == "$JS" and len(t) > 1:
        return f"js-{t[1].lower()}"
    return t[0]


class Sites:
    def __init__(self, hub: Host, sites: dict[str, Host], root: Path, *, trace: bool = False,
                 secure: Path | None = None):
        self.hub = hub
        self.site_hosts = dict(sites)
        self.root = Path(root)
        self.binary = find_binary()
        self.made = sites_init(self.root, [f"{n}@{h.addr}" for n, h in sites.items()],
                               hub_host=hub.addr, secure=secure)
        if trace:
            with open(self.made["hub"]["conf"], "a") as f:
                f.write("trace: true\nmax_traced_msg_len: 1\n")
        self.procs: dict[str, Proc] = {}

    @property
    def domain(self) -> str:
        return self.made["domain"]

    @property
    def hub_url(self) -> str:
        return self.made["hub"]["url"]

    def url(self, site: str) -> str:
        return next(s["url"] for s in self.made["sites"] if s["name"] == site)

    def _conf(self, name: str) -> str:
        if name == "hub":
            return self.made["hub"]["conf"]
        return next(s["conf"] for s in self.made["sites"] if s["name"] == name)

    def start(self, name: str | None = None) -> None:
        """Start the hub and every site's server (or only ``name``)."""
        for n in ["hub", *self.site_hosts] if name is None else [name]:
            host = self.hub if n == "hub" else self.site_hosts[n]
            self.procs[n] = host.run([self.binary, "-c", self._conf(n)], f"nats-{n}")

    def kill(self, name: str) -> None:
        """kill -9 the server of site ``name`` (or of the hub)."""
        self.procs[name].kill()

    def leafz(self) -> dict[str, dict]:
        """The hub's ``/leafz``: site name -> its leaf connection (rtt, in/out msgs and bytes)."""
        url = self.made["hub"]["monitor_url"] + "/leafz"
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - a test's own server
            data = json.load(r)
        return {leaf["name"]: leaf for leaf in data.get("leafs") or []}

    async def wait_linked(self, names=None, deadline: float = 30.0,
                          not_ids: dict[str, int] | None = None) -> float:
        """Wait until every site of ``names`` (default: all) is connected to the hub (by a
        connection other than ``not_ids[site]``, the one it had before a cut); returns the
        seconds it took."""
        want = set(names or self.site_hosts)
        old = dict(not_ids or {})
        t0 = time.monotonic()

        def linked():
            try:
                now = self.leafz()
            except OSError:
                return False
            return all(n in now and now[n]["id"] != old.get(n) for n in want)

        await until(lambda: asyncio.to_thread(linked), deadline=deadline, step=0.05,
                    what=f"sites {sorted(want)} linked to the hub", state=self.logs)
        return time.monotonic() - t0

    def logs(self) -> str:
        return "\n".join(f"--- nats-{n} ---\n{p.tail(10)}" for n, p in self.procs.items())

    def crossings(self) -> dict[str, Counter]:
        """From the hub's trace: ``{"<site> up"|"<site> down": Counter(kind -> payload
        bytes)}`` and the same with ``#`` for message counts (up: site to hub)."""
        lids = {}
        for site, leaf in self.leafz().items():
            lids[str(leaf["id"])] = site
        out: dict[str, Counter] = {}
        text = self.procs["hub"].output()
        for line in text.splitlines():
            found = _LMSG.search(line)
            if not found:
                continue
            lid, way, subject, size = found.groups()
            site = lids.get(lid, f"lid{lid}")
            key = f"{site} {'up' if way == '<<-' else 'down'}"
            kind = subject_kind(subject)
            out.setdefault(key, Counter())[kind] += int(size)
            out.setdefault(key + " #", Counter())[kind] += 1
        return out


__all__ = ["DOMAIN", "Sites", "subject_kind"]
