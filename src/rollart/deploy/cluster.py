"""``rollart cluster init``: the configs of an N-server nats-server (JetStream) cluster.

Writes into one folder::

    server-1.conf ... server-N.conf   one nats-server config per server: server_name, client
                                      listen, JetStream store, cluster {name, listen, routes}
    README.txt                        the commands to start each server and the clients' config

Without ``hosts`` every server runs on this machine (127.0.0.1, client ports
``client_port + i``, cluster ports ``cluster_port + i``, i = 0..N-1): a one-machine cluster for
trying replicas out. With one host name per server each listens on every interface at
``client_port`` and ``cluster_port``, and the routes name the hosts; the route port is then
protected by a generated route user and password (a server listening beyond loopback without
route authorization is refused by :func:`rollart.bus.server.check_cluster`). Clients on
non-loopback servers must authenticate too: pass ``secure`` (a folder written by
``rollart secure init``) to merge its TLS and users into every config.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from rollart.bus.server_config import config_text, sections, setting

CLUSTER_NAME = "rollart"
ROUTE_USER = "route"


def _q(s: str) -> str:
    return json.dumps(str(s))


def server_urls(servers: int, hosts: Sequence[str] | None = None, client_port: int = 4222,
                scheme: str = "nats") -> list[str]:
    """The client URLs of the cluster's servers, in order."""
    if hosts:
        return [f"{scheme}://{h}:{client_port}" for h in hosts]
    return [f"{scheme}://127.0.0.1:{client_port + i}" for i in range(servers)]


def _secure_blocks(secure: Path) -> tuple[str, bool]:
    """The ``tls``, ``authorization`` (and ``max_payload``) of a ``rollart secure init`` folder's
    server.conf, as config text; and whether it has TLS."""
    conf = secure / "server.conf"
    if not conf.is_file():
        raise ValueError(f"--secure {secure}: no server.conf here; give a folder written by "
                         "`rollart secure init`")
    top, blocks = sections(config_text(conf))
    if "authorization" not in blocks:
        raise ValueError(f"--secure {secure}: its server.conf has no authorization block")
    out = [f"# users and TLS from {conf} (`rollart secure init`)"]
    payload = setting(top, "max_payload")
    if payload:
        out.append(f"max_payload: {payload}")
    for name in ("tls", "authorization"):
        if name in blocks:
            out.append(f"{name} {{{blocks[name].rstrip()}\n}}")
    return "\n".join(out), "tls" in blocks


def cluster_init(dir: str | os.PathLike, servers: int = 3, hosts: Sequence[str] | None = None, *,
                 client_port: int = 4222, cluster_port: int = 6222, store_dir: str | None = None,
                 secure: str | os.PathLike | None = None, force: bool = False,
                 name: str = CLUSTER_NAME) -> dict:
    """Write ``server-1.conf`` .. ``server-N.conf`` and ``README.txt`` into ``dir``; return
    ``{"servers": [{name, conf, client, cluster}], "urls": [...]}``.

    ``hosts``: one name per server (routes and client URLs use them; each server listens on
    0.0.0.0); None: all on 127.0.0.1 with distinct ports. ``store_dir``: the JetStream store of
    each server is ``store_dir/server-i`` (default: ``dir/store/server-i``). ``secure``: a
    ``rollart secure init`` folder whose TLS and users every server gets."""
    hosts = [h.strip() for h in hosts or [] if h and h.strip()]
    if hosts and servers and len(hosts) != servers:
        raise ValueError(f"--servers {servers} with {len(hosts)} --host: give one --host per server "
                         "(or no --host for a one-machine cluster on 127.0.0.1)")
    servers = len(hosts) or servers
    if not 3 <= servers <= 9:
        raise ValueError(f"--servers must be between 3 and 9 (it is {servers}); 3 or 5 are usual: "
                         "JetStream stays available while a majority of the servers is up, so "
                         "fewer than 3 cannot lose one")
    for flag, port in (("--client-port", client_port), ("--cluster-port", cluster_port)):
        top = port + (0 if hosts else servers - 1)
        if not (1 <= port and top <= 65535):
            raise ValueError(f"{flag} {port}: ports {port}..{top} must lie in 1..65535")
    if not hosts and abs(client_port - cluster_port) < servers:
        raise ValueError(f"--client-port {client_port} and --cluster-port {cluster_port} overlap "
                         f"for {servers} servers on one machine")
    out = Path(dir).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty; choose another folder or pass --force to overwrite")
    auth_text, tls = ("", False)
    if secure is not None:
        auth_text, tls = _secure_blocks(Path(secure).resolve())
    store = Path(store_dir).resolve() if store_dir else out / "store"
    route_pw = secrets.token_urlsafe(24) if hosts else None
    cred = f"{ROUTE_USER}:{route_pw}@" if route_pw else ""
    route_hosts = hosts or ["127.0.0.1"] * servers
    routes = [f"nats-route://{cred}{h}:{cluster_port if hosts else cluster_port + i}"
              for i, h in enumerate(route_hosts)]
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for i in range(servers):
        sname = f"{name}-{i + 1}"
        bind = "0.0.0.0" if hosts else "127.0.0.1"
        client = f"{bind}:{client_port if hosts else client_port + i}"
        clus = f"{bind}:{cluster_port if hosts else cluster_port + i}"
        lines = [f"# nats-server {i + 1} of {servers} of cluster {name!r} (written by "
                 "`rollart cluster init`)",
                 f"server_name: {_q(sname)}",
                 f"listen: {_q(client)}",
                 "jetstream {",
                 f"  store_dir: {_q(store / f'server-{i + 1}')}",
                 "}",
                 "cluster {",
                 f"  name: {_q(name)}",
                 f"  listen: {_q(clus)}"]
        if route_pw:
            lines += [f"  authorization {{ user: {_q(ROUTE_USER)}, password: {_q(route_pw)} }}"]
        lines += ["  routes: [", *(f"    {_q(r)}" for r in routes), "  ]", "}"]
        if auth_text:
            lines += ["", auth_text]
        conf = out / f"server-{i + 1}.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(conf, 0o600)  # route password / user hashes: not for every eye
        made.append({"name": sname, "conf": str(conf), "client": client, "cluster": clus})
    urls = server_urls(servers, hosts, client_port, "tls" if tls else "nats")
    (out / "README.txt").write_text(readme(out, made, urls, hosts, secure=secure is not None))
    return {"servers": made, "urls": urls}


def readme(out: Path, made: list[dict], urls: list[str], hosts: Sequence[str], *,
           secure: bool) -> str:
    """README.txt: how to start each server and how clients join."""
    n = len(made)
    replicas = min(3, n)
    where = ("on this machine (127.0.0.1): a one-machine cluster for trying replicas out"
             if not hosts else f"one per host: {', '.join(hosts)}")
    lines = [f"A nats-server cluster of {n} servers (JetStream), {where}.",
             "Written by `rollart cluster init`.", ""]
    lines += ["Start each server, either as a plain nats-server:", ""]
    for s in made:
        lines.append(f"  nats-server -c {s['conf']}")
    lines += ["", "or as the embedded server of a node on that host (run.yaml without nats.url/urls:",
              "the node starts its server and joins it; it stops the server when it exits):", ""]
    for i, s in enumerate(made):
        on = f"  # on {hosts[i]}" if hosts else ""
        lines.append(f"  python -m rollart.node --config run.yaml --roles env --server-config "
                     f"{s['conf']} --listen {s['client']}{on}")
    lines += ["",
              "Each server keeps its JetStream store in the folder its config names (store_dir);",
              "a server restarted on the same store rejoins the cluster.",
              f"The cluster has a JetStream leader once a majority ({n // 2 + 1} of {n}) is up.", ""]
    if hosts:
        lines += ["Copy this folder to the same path on every server host (the configs name files",
                  "by absolute path), or edit store_dir. The route port is protected by the",
                  "route user and password in the configs (plaintext routes: keep the cluster",
                  "port inside a private network)."]
        if not secure:
            host_flags = " ".join(f"--host {h}" for h in hosts)
            lines += ["The client port listens on every interface, so clients must authenticate:",
                      "without --secure these configs are refused by the embedded server. Make",
                      "credentials naming every server host and rerun with them:", "",
                      f"  rollart secure init creds {host_flags}",
                      f"  rollart cluster init {out} {host_flags} --secure creds --force", "",
                      "or add an authorization block to each config."]
        lines.append("")
    urls_yaml = ", ".join(_q(u) for u in urls)
    lines += ["Every client (the run config of every other node, `rollart top`, ...):", "",
              f"  nats: {{urls: [{urls_yaml}]}}",
              f"  node: {{stream_replicas: {replicas}}}", ""]
    if secure:
        lines += ["  plus the user, password_file and tls.ca of `rollart secure init`'s README.", ""]
    lines += ["or on the command line, for one host (the client tries the others on failure):", "",
              f"  python -m rollart.node --config run.yaml --roles generate --nats {urls[0]}",
              f"  rollart top --nats {urls[0]} --run RUN",
              "",
              f"node.stream_replicas: {replicas} keeps every stream, KV bucket and object store of the run",
              f"on {replicas} servers: the run goes on when one server is lost. Set it before the run's",
              "streams and buckets are first made (a new run name, or delete the old run's streams).",
              ""]
    return "\n".join(lines)
