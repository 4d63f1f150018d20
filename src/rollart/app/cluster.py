"""``rollart cluster init`` and ``rollart cluster sites``: register with ``register(subparsers)`` (see :mod:`rollart.app.cli`)."""

from __future__ import annotations

import argparse

from rollart.deploy.cluster import cluster_init
from rollart.deploy.sites import DOMAIN, sites_init


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``cluster`` (with ``init``) to a ``add_subparsers()`` object."""
    c = subparsers.add_parser(
        "cluster", help="configs of a nats-server cluster (JetStream replicas across servers)",
        description="Write the nats-server configs of an N-server JetStream cluster, so that "
                    "streams, KV buckets and object stores keep node.stream_replicas copies and "
                    "a run survives the loss of a server.")
    sub = c.add_subparsers(dest="cluster_cmd", required=True, metavar="ACTION")
    i = sub.add_parser(
        "init", help="write server-1.conf .. server-N.conf and README.txt into DIR",
        description="Write into DIR one nats-server config per server (server_name, listen, "
                    "JetStream store, cluster routes to every server) and README.txt with the "
                    "commands. Without --host: every server on 127.0.0.1 with ports "
                    "--client-port+i and --cluster-port+i (a one-machine cluster).",
        epilog="examples: rollart cluster init nats-cluster --servers 3;  rollart cluster init "
               "nc --host n1.example.org --host n2.example.org --host n3.example.org "
               "--secure creds")
    i.add_argument("dir", metavar="DIR", help="folder to write (must be empty or absent)")
    i.add_argument("--servers", type=int, default=None, metavar="N",
                   help="number of servers (default: one per --host, else 3)")
    i.add_argument("--host", action="append", default=None, metavar="NAME",
                   help="host name of a server, once per server: routes and client URLs use them "
                        "and each server listens on every interface")
    i.add_argument("--client-port", type=int, default=4222, metavar="PORT",
                   help="client port (default 4222; server i gets PORT+i without --host)")
    i.add_argument("--cluster-port", type=int, default=6222, metavar="PORT",
                   help="route port (default 6222; server i gets PORT+i without --host)")
    i.add_argument("--store-dir", default=None, metavar="DIR",
                   help="JetStream stores go to DIR/server-i (default: DIR/store/server-i)")
    i.add_argument("--secure", default=None, metavar="SECURE_DIR",
                   help="merge the TLS and users of a `rollart secure init` folder into every "
                        "config (needed for servers listening beyond loopback)")
    i.add_argument("--force", action="store_true", help="overwrite a non-empty DIR")
    i.set_defaults(fn=cluster_main)
    s = sub.add_parser(
        "sites", help="write hub.conf, site-NAME.conf per site and README.txt into DIR",
        description="Write the configs of a hub nats-server (JetStream in one domain: every "
                    "stream of a run) and of one leaf nats-server per site (no JetStream; it "
                    "dials the hub). Nodes join their site's server with --js-domain; traffic "
                    "between two clients of a site stays there. Without hosts: every server on "
                    "127.0.0.1 (hub at the base ports, site i at base port + i).",
        epilog="examples: rollart cluster sites s --site gpu --site cpu;  rollart cluster sites "
               "s --hub head.example.org --site gpu@g1.example.org --site cpu@c1.example.org")
    s.add_argument("dir", metavar="DIR", help="folder to write (must be empty or absent)")
    s.add_argument("--site", action="append", required=True, metavar="NAME[@HOST]",
                   help="a site, once per site; @HOST: the host its server runs on")
    s.add_argument("--hub", default=None, metavar="HOST",
                   help="the hub's host name, which sites dial (with NAME@HOST sites)")
    s.add_argument("--domain", default=DOMAIN, help=f"the hub's JetStream domain (default {DOMAIN})")
    s.add_argument("--client-port", type=int, default=4222, metavar="PORT", help="default 4222")
    s.add_argument("--leaf-port", type=int, default=7422, metavar="PORT",
                   help="the hub's leaf node port (default 7422)")
    s.add_argument("--monitor-port", type=int, default=8222, metavar="PORT",
                   help="HTTP monitoring port (/leafz, /varz; default 8222)")
    s.add_argument("--store-dir", default=None, metavar="DIR",
                   help="the hub's JetStream store goes to DIR/hub (default: DIR/store/hub)")
    s.add_argument("--secure", default=None, metavar="SECURE_DIR",
                   help="a `rollart secure init` folder: every server requires TLS and its users "
                        "(permissions made for the domain), the leaf link is TLS; its --host "
                        "names must include the hub's and every site's host")
    s.add_argument("--force", action="store_true", help="overwrite a non-empty DIR")
    s.set_defaults(fn=sites_main)
    return c


async def sites_main(args) -> int:
    """The ``fn`` of ``rollart cluster sites``."""
    made = sites_init(args.dir, args.site, hub_host=args.hub, client_port=args.client_port,
                      leaf_port=args.leaf_port, monitor_port=args.monitor_port,
                      domain=args.domain, store_dir=args.store_dir, secure=args.secure,
                      force=args.force)
    hub = made["hub"]
    print(f"wrote {hub['conf']}: hub, clients {hub['client']}, leaf nodes {hub['leaf']}, "
          f"JetStream domain {made['domain']!r}")
    for s in made["sites"]:
        print(f"wrote {s['conf']}: site {s['name']}, clients {s['client']}")
    print(f"nodes at a site join with --nats <its url> --js-domain {made['domain']}; see "
          f"{args.dir.rstrip('/')}/README.txt")
    return 0


async def cluster_main(args) -> int:
    """The ``fn`` of ``rollart cluster init`` (the rollart CLI awaits it)."""
    servers = args.servers if args.servers is not None else (len(args.host) if args.host else 3)
    made = cluster_init(args.dir, servers, args.host, client_port=args.client_port,
                        cluster_port=args.cluster_port, store_dir=args.store_dir,
                        secure=args.secure, force=args.force)
    for s in made["servers"]:
        print(f"wrote {s['conf']}: {s['name']}, clients {s['client']}, routes {s['cluster']}")
    print(f"clients join with nats: {{urls: [{', '.join(made['urls'])}]}} and "
          f"node: {{stream_replicas: {min(3, len(made['servers']))}}}; see "
          f"{args.dir.rstrip('/')}/README.txt")
    return 0
