"""``rollart secure init | show``: credentials for a multi-host run.

``register(subparsers)`` adds the ``secure`` command to the ``rollart`` parser; ``main(argv)``
runs it alone (``python -m rollart.app.secure init DIR --host NAME``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from rollart import messages as m
from rollart.security.init import MANIFEST, secure_init
from rollart.security.permissions import ROLES

_ROLES_HELP = ", ".join(ROLES)


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``secure`` (with ``init`` and ``show``) to a ``add_subparsers()`` object."""
    s = subparsers.add_parser(
        "secure", help="credentials and permissions for a multi-host run (TLS, one user per role)",
        description="Make a CA, a server certificate, one password per role and a nats-server "
                    "config whose permissions follow the subject table: only the trainer "
                    "publishes policies and writes weights, env hosts publish outcomes and "
                    "requests, the monitor only reads, nobody but admin deletes streams.")
    sub = s.add_subparsers(dest="secure_cmd", required=True, metavar="ACTION")
    i = sub.add_parser(
        "init", help="write a CA, certificates, passwords and server.conf into DIR",
        description="Write into DIR: ca.pem/ca.key, server.pem/server.key (TLS; the SANs are "
                    "the --host names plus localhost and 127.0.0.1), one <user>.password per "
                    "role (random; server.conf holds only bcrypt hashes), server.conf for "
                    "`nats-server -c`, and README.txt saying which file goes to which host. "
                    "Needs: pip install 'rollart[secure]'.",
        epilog="example: rollart secure init creds --host head.example.org --run exp1")
    i.add_argument("dir", metavar="DIR", help="folder to write (must be empty or absent)")
    i.add_argument("--host", action="append", required=True, metavar="NAME",
                   help="name or IP address nodes use to reach the server (repeat for several)")
    i.add_argument("--run", default="*", metavar="NAME",
                   help="pin the credentials to one run (default '*': any run on this server; "
                        "its JetStream permissions then cover every stream of the server)")
    i.add_argument("--role", action="append", default=None, metavar="ROLE[,ROLE...]",
                   help=f"make a credential for this role (repeat; default: each of {_ROLES_HELP}); "
                        "several joined with ',' give one user for a host running them together "
                        "(env,generate,reward -> user env+generate+reward)")
    i.add_argument("--listen", default="0.0.0.0:4222", metavar="HOST:PORT",
                   help="where the server listens (default 0.0.0.0:4222)")
    i.add_argument("--store-dir", default=None, metavar="DIR",
                   help="JetStream store to write into server.conf (default: none; give -sd to "
                        "nats-server; an embedded server (--server-config) sets its own and "
                        "refuses a config that has one)")
    i.add_argument("--no-admin", action="store_true",
                   help="no admin user (every permission: deleting streams, operations)")
    i.add_argument("--force", action="store_true", help="overwrite a non-empty DIR")
    i.set_defaults(fn=secure_main)
    w = sub.add_parser("show", help="list the users of DIR and what each may do (no secrets)",
                       description="Users of a folder written by `rollart secure init`, with their "
                                   "permissions in short form. Prints no password or hash.")
    w.add_argument("dir", metavar="DIR", help="folder written by `rollart secure init`")
    w.set_defaults(fn=secure_main)
    return s


def init(args) -> int:
    roles = args.role or list(ROLES)
    try:
        made = secure_init(args.dir, args.host, roles, run=args.run, force=args.force,
                           listen=args.listen, store_dir=args.store_dir, admin=not args.no_admin)
    except RuntimeError as e:  # cryptography or bcrypt missing
        raise ValueError(str(e)) from None
    out = Path(args.dir).resolve()
    print(f"wrote {out}: users {', '.join(made['users'])} "
          f"({'any run' if args.run == '*' else f'run {args.run} only'})")
    print(f"server: nats-server -c {out / 'server.conf'} -sd STORE, or a node's embedded server "
          f"with --server-config {out / 'server.conf'}; see {out / 'README.txt'} for which file "
          "goes to which host")
    return 0


def show(args) -> int:
    path = Path(args.dir) / MANIFEST
    if not path.exists():
        raise ValueError(f"{args.dir}: no {MANIFEST} here; give a folder written by `rollart secure init`")
    made = json.loads(path.read_text())
    conf = Path(args.dir) / "server.conf"
    conf_text = conf.read_text() if conf.exists() else ""
    print(f"{Path(args.dir).resolve()}: run {made['run']!r}, hosts {', '.join(made['hosts'])}, "
          f"listen {made.get('listen', '?')}, created {made.get('created', '?')}")
    print(f"(subjects below are under {m.PREFIX}.{made['run']}.; jetstream: API calls, "
          "scoped to the run's streams)")
    if not conf_text:
        print("  (no server.conf here)")
    for user, info in made["users"].items():
        missing = "" if f'user: "{user}"' in conf_text or not conf_text else "  (not in server.conf!)"
        has_pw = (Path(args.dir) / info["password_file"]).exists()
        print(f"\n{user}{missing}: password in {info['password_file']}"
              f"{'' if has_pw else ' (not in this folder)'}")
        for line in short(info["permissions"]):
            print(f"  {line}")
    return 0


def short(perms: dict) -> list[str]:
    """The permissions in short form, grouped (for ``rollart secure show``)."""
    groups: dict[str, list[str]] = {}

    def add(kind: str, what: str) -> None:
        groups.setdefault(kind, []).append(what)

    for a in perms.get("publish", {}).get("allow", []):
        t = a.split(".")
        if t[0] == m.PREFIX and len(t) > 2:
            add("publish", ".".join(t[2:]))
        elif a.startswith("$JS.API.CONSUMER.CREATE.") and len(t) > 7 and t[6] == m.PREFIX:
            add("consume", ".".join(t[8:]))
        elif t[0] == "$KV" and len(t) > 2:
            add("kv put", ".".join(t[2:]))
        elif t[0] == "$O":
            add("object store", "write")
        elif a.startswith("$JS.API.") and len(t) > 3:
            add("jetstream", ".".join(t[2:]))
        elif a.startswith("$JS."):
            add("jetstream", a)
        else:
            add("publish", a)
    for a in perms.get("subscribe", {}).get("allow", []):
        t = a.split(".")
        add("subscribe", ".".join(t[2:]) if t[0] == m.PREFIX and len(t) > 2 else a)
    if "allow_responses" in perms:
        r = perms["allow_responses"]
        add("reply", f"once per request received, within {r.get('expires', '?')}")
    if perms.get("publish", {}).get("deny"):
        add("denied", " ".join(perms["publish"]["deny"]))
    order = ("publish", "subscribe", "consume", "reply", "kv put", "object store", "jetstream", "denied")
    width = max(map(len, groups), default=0)
    out = []
    for k in sorted(groups, key=order.index):
        text = ", ".join(groups[k]) if k != "denied" else groups[k][0]
        out += textwrap.wrap(text, 96, initial_indent=f"{k:<{width}}  ",
                             subsequent_indent=" " * (width + 4), break_on_hyphens=False)
    return out


async def secure_main(args) -> int:
    """The ``fn`` of ``rollart secure ...`` (the rollart CLI awaits it)."""
    return init(args) if args.secure_cmd == "init" else show(args)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollart")
    register(p.add_subparsers(dest="cmd", required=True, metavar="COMMAND"))
    args = p.parse_args(["secure", *(sys.argv[1:] if argv is None else argv)])
    try:
        return asyncio.run(args.fn(args))
    except ValueError as e:
        print(f"rollart: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
