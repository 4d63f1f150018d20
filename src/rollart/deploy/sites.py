"""``rollart cluster sites``: a hub nats-server and one leaf nats-server per site.

A *site* is a group of hosts near each other (a GPU cluster, a CPU cluster) whose nodes join
their own nats-server; that server is a **leaf node** of the hub's. Writes into one folder::

    hub.conf              the hub: JetStream in domain ``domain`` (every stream, KV bucket and
                          object store of a run lives here), a ``leafnodes`` listener, monitoring
    site-<name>.conf      one per site: a nats-server *without* JetStream whose ``leafnodes
                          remotes`` dial the hub, monitoring
    README.txt            the commands, and the ``nats:`` of a node at each site

What crosses a link and what stays at a site follows from NATS's interest routing: a core
message published at a site goes to the hub only while someone beyond the site subscribes to
it, and a queue-group request goes to a member at the site first. So a reward request of an
env at the site to a reward service at the site never leaves it; JetStream calls (work-queue
fetches, acks, publishes to the run's streams, KV and object reads) always go to the hub.
``docs/design.md`` ("Sites") lists what crosses and the bytes per step measured.

Without hosts everything runs on 127.0.0.1 (ports ``client_port``, ``leaf_port`` and
``monitor_port`` for the hub; site ``i`` (1-based) gets ``client_port + i`` and
``monitor_port + i``): a one-machine try-out. With ``hub_host`` and a host per site every
server listens on every interface at the base ports; the leaf port is then protected by a
generated leaf user and password (anyone reaching it could join as a leaf and read every
message).

``secure``: a ``rollart secure init`` folder. Every server (hub and sites) then requires TLS
with its certificate and authenticates clients as its users, whose permissions are made
again for the domain (:func:`rollart.security.permissions.role_permissions` with
``domain``: a site's clients send ``$JS.<domain>.API`` subjects); the leaf link is TLS too
(the hub's certificate, checked against the folder's CA) with a generated leaf password. The
certificate must name the hub's and every site's host (``rollart secure init --host``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from rollart.bus.server_config import config_text, sections, setting
from rollart.security.init import MANIFEST
from rollart.security.permissions import authorization_lines, role_permissions

DOMAIN = "hub"
"""The hub's JetStream domain unless told otherwise (``nats.domain`` of every site's node)."""
LEAF_USER = "leaf"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def _q(s: str) -> str:
    return json.dumps(str(s))


def parse_site(text: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME@HOST`` -> (name, host or None); a ValueError naming what is wrong."""
    name, _, host = text.partition("@")
    if not _NAME.fullmatch(name):
        raise ValueError(f"--site {text!r}: a site name is 1-32 of a-z, 0-9, '_' and '-', "
                         "starting with a letter or digit (it becomes the site server's name)")
    if name == DOMAIN or name.startswith("hub"):
        raise ValueError(f"--site {text!r}: names starting with 'hub' are the hub's")
    if "@" in text and not host.strip():
        raise ValueError(f"--site {text!r}: no host after '@'")
    return name, (host.strip() or None)


def sites_init(dir: str | os.PathLike, sites: Sequence[str], *, hub_host: str | None = None,
               client_port: int = 4222, leaf_port: int = 7422, monitor_port: int = 8222,
               domain: str = DOMAIN, store_dir: str | None = None,
               secure: str | os.PathLike | None = None, force: bool = False) -> dict:
    """Write ``hub.conf``, ``site-<name>.conf`` per site and ``README.txt`` into ``dir``;
    return ``{"hub": {...}, "sites": [{name, conf, client, monitor, url}], "domain": ...}``.

    ``sites``: ``NAME`` or ``NAME@HOST`` each; either every site has a host and ``hub_host``
    is given (servers on every interface, on several machines), or none has (all on
    127.0.0.1 with distinct ports)."""
    parsed = [parse_site(s) for s in sites]
    if not parsed:
        raise ValueError("give at least one --site NAME (or NAME@HOST)")
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"--site names must differ: {', '.join(names)}")
    hosted = [h is not None for _, h in parsed]
    if any(hosted) and not all(hosted):
        raise ValueError("give every --site a host (NAME@HOST) or none (all on 127.0.0.1)")
    if all(hosted) != (hub_host is not None):
        raise ValueError("--hub HOST goes with NAME@HOST sites: give both (servers on several "
                         "machines) or neither (all on 127.0.0.1)")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", domain):
        raise ValueError(f"--domain {domain!r}: one token of letters, digits, '_' and '-'")
    n = len(parsed)
    ports = {"--client-port": client_port, "--leaf-port": leaf_port, "--monitor-port": monitor_port}
    for flag, port in ports.items():
        top = port + (0 if hub_host else n)
        if not (1 <= port and top <= 65535):
            raise ValueError(f"{flag} {port}: ports {port}..{top} must lie in 1..65535")
    if not hub_host:
        spans = sorted((p, p + (n if f != "--leaf-port" else 0), f) for f, p in ports.items())
        for (a0, a1, fa), (b0, _, fb) in zip(spans, spans[1:]):
            if b0 <= a1:
                raise ValueError(f"{fa} and {fb} overlap for {n} sites on one machine")
    out = Path(dir).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty; choose another folder or pass --force to overwrite")
    auth, ca = (_secure_lines(Path(secure).resolve(), domain) if secure is not None
                else ([], None))
    out.mkdir(parents=True, exist_ok=True)
    store = Path(store_dir).resolve() if store_dir else out / "store"
    bind = "0.0.0.0" if hub_host else "127.0.0.1"
    leaf_pw = secrets.token_urlsafe(24) if hub_host or secure is not None else None
    hub_addr = hub_host or "127.0.0.1"
    hub = {"name": "hub", "conf": str(out / "hub.conf"), "client": f"{bind}:{client_port}",
           "leaf": f"{bind}:{leaf_port}", "monitor": f"{bind}:{monitor_port}",
           "url": f"nats://{hub_addr}:{client_port}",
           "monitor_url": f"http://{hub_addr}:{monitor_port}"}
    lines = ["# the hub of a run's sites (written by `rollart cluster sites`)",
             'server_name: "hub"', f"listen: {_q(hub['client'])}", f"http: {_q(hub['monitor'])}",
             "jetstream {", f"  store_dir: {_q(store / 'hub')}", f"  domain: {_q(domain)}", "}",
             "leafnodes {", f"  listen: {_q(hub['leaf'])}"]
    if leaf_pw:
        lines.append(f"  authorization {{ user: {_q(LEAF_USER)}, password: {_q(leaf_pw)} }}")
    if auth:  # the leaf link under TLS with the hub's certificate
        lines += ["  tls {", *("  " + x for x in auth[auth.index("tls {") + 1:auth.index("}")]),
                  "  }"]
    lines += ["}", *auth]
    _write(Path(hub["conf"]), lines, secret=leaf_pw is not None or bool(auth))
    cred = f"{LEAF_USER}:{leaf_pw}@" if leaf_pw else ""
    made = []
    for i, (name, host) in enumerate(parsed, start=1):
        client = f"{bind}:{client_port if host else client_port + i}"
        monitor = f"{bind}:{monitor_port if host else monitor_port + i}"
        site = {"name": name, "conf": str(out / f"site-{name}.conf"), "client": client,
                "monitor": monitor, "url": f"nats://{host or '127.0.0.1'}:{client.rsplit(':', 1)[1]}"}
        remote = f"url: {_q(f'nats-leaf://{cred}{hub_addr}:{leaf_port}')}"
        if ca:
            remote += f", tls: {{ ca_file: {_q(ca)} }}"
        lines = [f"# site {name!r}: a leaf node of the hub, without JetStream (written by "
                 "`rollart cluster sites`)",
                 f"server_name: {_q(name)}", f"listen: {_q(client)}", f"http: {_q(monitor)}",
                 "leafnodes {", f"  remotes: [ {{ {remote} }} ]", "}", *auth]
        _write(Path(site["conf"]), lines, secret=leaf_pw is not None or bool(auth))
        made.append(site)
    (out / "README.txt").write_text(readme(hub, made, domain, hosted=hub_host is not None,
                                           secure=secure is not None))
    return {"hub": hub, "sites": made, "domain": domain}


def _secure_lines(secure: Path, domain: str) -> tuple[list[str], str | None]:
    """The ``max_payload``, ``tls`` and ``authorization`` of a ``rollart secure init`` folder
    as config lines, the users' permissions made for ``domain``; and its CA file."""
    conf, manifest = secure / "server.conf", secure / MANIFEST
    if not (conf.is_file() and manifest.is_file()):
        raise ValueError(f"--secure {secure}: no server.conf and {MANIFEST} here; give a folder "
                         "written by `rollart secure init`")
    text = config_text(conf)
    top, blocks = sections(text)
    if "tls" not in blocks:
        raise ValueError(f"--secure {secure}: its server.conf has no tls block")
    hashes = dict(re.findall(r'user:\s*"([^"]+)"\s*\n\s*password:\s*"([^"]+)"', text))
    made = json.loads(manifest.read_text())
    users = []
    for user in made.get("users", {}):
        if user not in hashes:
            raise ValueError(f"--secure {secure}: user {user!r} of {MANIFEST} is not in server.conf")
        perms = role_permissions(user.replace("+", ","), made.get("run", "*"), domain=domain)
        users.append({"user": user, "password": hashes[user], "permissions": perms})
    lines = [f"# users and TLS from {secure} (`rollart secure init`), permissions for domain "
             f"{domain!r}"]
    payload = setting(top, "max_payload")
    if payload:
        lines.append(f"max_payload: {payload}")
    lines += ["tls {", *(x.strip() for x in blocks["tls"].strip().splitlines() if x.strip()), "}"]
    return lines + authorization_lines(users), str(secure / "ca.pem")


def _write(path: Path, lines: list[str], *, secret: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o600 if secret else 0o644)  # the leaf password: not for every eye


def readme(hub: dict, sites: list[dict], domain: str, *, hosted: bool, secure: bool = False) -> str:
    """README.txt: how to start the servers and how nodes at each site join."""
    names = ", ".join(s["name"] for s in sites)
    out = [f"A hub nats-server (JetStream, domain {domain!r}) and {len(sites)} site(s) ({names}),",
           "each site a leaf nats-server without JetStream. Written by `rollart cluster sites`.", "",
           "Start the hub, then each site's server (a site keeps redialling the hub by itself):", "",
           f"  nats-server -c {hub['conf']}"]
    out += [f"  nats-server -c {s['conf']}" + (f"   # at site {s['name']}" if hosted else "")
            for s in sites]
    out += ["",
            "Nodes at the hub join it as usual; nodes at a site join the site's server and name",
            f"the hub's JetStream domain (nats.domain: {domain} in the run config serves both):", "",
            f"  python -m rollart.node --config run.yaml --roles trainer,scheduler --nats {hub['url']}"]
    out += [f"  python -m rollart.node --config run.yaml --roles generate --nats {s['url']} "
            f"--js-domain {domain}   # site {s['name']}" for s in sites]
    out += ["",
            "Every stream, KV bucket and object store of a run lives at the hub (node.stream_replicas",
            "stays 1: a hub of one server). Messages between two clients of one site stay at the",
            "site when nobody beyond it listens (request/reply to a queue group prefers the",
            "site's members); JetStream calls cross the link. A site whose link is down keeps",
            "its local traffic; its JetStream calls fail (and are retried) until the link is back.",
            "",
            f"Link state: rollart nodes --nats {hub['url']} --run RUN --hub-monitor {hub['monitor_url']}",
            f"(or the hub's {hub['monitor_url']}/leafz: one entry per connected site, with its RTT",
            "and the messages and bytes each way).", ""]
    if secure:
        out += ["Every server requires TLS and the users of `rollart secure init` (their permissions",
                f"made for domain {domain!r}); a node passes its user, password file and the CA as",
                "with a single secured server (--user, --password-file, --tls-ca). The leaf link is",
                "TLS, with a generated leaf password.", ""]
    elif hosted:
        out += ["The leaf port is protected by the leaf user and password in the configs (plaintext:",
                "keep it inside a private network or tunnel). Client ports are open: the embedded",
                "server refuses such configs; add an authorization block to each, or run the",
                "servers on private addresses only. Monitoring ports serve counts, never messages.", ""]
    return "\n".join(out)
