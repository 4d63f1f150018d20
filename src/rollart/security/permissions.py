"""Each role's NATS permissions, derived from the subject table, and the server config.

:data:`USES` says what each role does with each subject of :data:`rollart.messages.SUBJECTS`
(a subject added there must be assigned here too: a test fails otherwise):

- ``publish``: sends it (a core or a JetStream publish);
- ``request``: sends requests and reads the replies on its inbox;
- ``serve``: answers requests (queue subscription; it may reply once to each request it
  received: ``allow_responses``, so no role may publish into another client's inbox);
- ``subscribe``: a core subscription;
- ``consume``: a durable pull consumer on the subject's stream (create/bind it with the
  subject as filter, fetch, ack).

On top of the subjects each role gets the JetStream API subjects its operations use,
scoped to the run's streams (nats-py 2.16, measured against nats-server 2.15):

- every node: ``STREAM.INFO``/``STREAM.CREATE`` of the two run streams and the KV bucket
  (every node ensures them at start; creating an existing stream with the same config is
  a no-op, a different config needs ``STREAM.UPDATE``, which only the trainer has);
- every role: KV reads: ``DIRECT.GET.KV_<bucket>.>`` (get) and watches, which are
  ephemeral ordered push consumers: ``CONSUMER.CREATE.KV_<bucket>`` (the exact subject,
  which creates ephemerals only, never a durable), ``CONSUMER.INFO.KV_<bucket>.*`` (nats-py
  reads the watch's pending count) and ``$JS.FC.KV_<bucket>.>`` (flow control replies). The
  monitor's only write-like permission is that ephemeral consumer; it may also list the run
  streams' consumers and read their info (``CONSUMER.LIST``/``INFO``, for ``rollart top``);
- consumers: ``CONSUMER.CREATE.<stream>.*.<filter>`` (only with the role's filter subject),
  ``CONSUMER.INFO.<stream>.*``, ``CONSUMER.MSG.NEXT.<stream>.*`` and ``$JS.ACK.<stream>.>``;
- KV writes: ``$KV.<bucket>.<key>`` for the keys the role owns (:data:`KV_WRITES`);
- object store: the trainer writes (``$O.<bucket>.>``, create, and with a pinned run the
  filtered ``STREAM.PURGE`` that deleting an object is), generate replicas read
  (``STREAM.MSG.GET`` of the metadata, an ordered consumer for the chunks, and
  ``STREAM.NAMES``: nats-py looks up the chunks' stream by subject; it lists stream names
  of the account, nothing else).
- trajectory object store (``<run>_TRAJ``, completions too large for one message): env
  writes (create, ``$O.<bucket>.>``, no purge), the trainer and the scheduler read
  (:data:`TRAJ_OBJECTS`). With the run token ``*`` the bucket would be ``*``, every object
  store of the account with the weights': such an env credential gets no object write, so
  completions above the server's max payload need a credential pinned to the run.

No role may delete or purge a stream or delete a consumer (an admin's job). With the run
token ``*`` (a credential reused across runs) the stream names in these subjects become
``*`` as well: the JetStream permissions then cover every stream of the account (a server
or account dedicated to rollart), and the trainer gets no purge (old weights stay in the
object store; deleting them logs a warning). Pin the run (``--run NAME``) to scope them.

Replies: each user reads only its own inbox, ``_INBOX_<user>.>``
(:func:`rollart.bus.auth.inbox_prefix`; a client connecting with a user name uses it), not
nats-py's shared ``_INBOX.>``. Known gap: nats-server does not check a push consumer's deliver subject against its creator's publish
permissions (nats-io/nats-server#8274): a role that may create a consumer on a stream can
have that stream's messages delivered to any subject.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from rollart import messages as m
from rollart.bus.auth import inbox_prefix

ROLES = ("trainer", "scheduler", "env", "generate", "reward", "monitor")
"""Roles with a credential; ``admin`` (everything) exists too, for operators only."""
ADMIN = "admin"
NODE = "node"
"""In :data:`USES`: every role that runs a Node (all but the monitor)."""
VERBS = ("publish", "request", "serve", "subscribe", "consume")

USES: dict[str, dict[str, str]] = {
    "rollout.requested": {"scheduler": "publish", "trainer": "publish", "env": "consume"},
    "rollout.completed": {"env": "publish", "trainer": "consume", "scheduler": "consume"},
    "rollout.cancelled": {"env": "publish", "trainer": "consume", "scheduler": "consume"},
    "rollout.cancel": {"scheduler": "publish", "env": "subscribe", "generate": "subscribe"},
    "generate.request": {"env": "request", "generate": "serve"},
    "generate.direct": {"env": "request", "generate": "serve"},  # one replica, by its token
    "reward.request": {"env": "request", "reward": "serve"},
    "service.progress": {"generate": "publish", "reward": "publish", "env": "subscribe"},
    # holders follow the KV record and cross-check it against the announcements (PolicyGate 3c)
    "policy.published": {"trainer": "publish consume", "generate": "subscribe", "env": "subscribe",
                         "scheduler": "subscribe"},
    "policy.loaded": {"generate": "publish", "trainer": "consume"},
    "node.heartbeat": {NODE: "publish", "trainer": "subscribe", "scheduler": "subscribe"},
    "dead": {NODE: "publish", "trainer": "consume", "scheduler": "consume"},
}
"""subject name -> role -> space-separated verbs (the monitor reads every subject)."""

INCLUDES: dict[str, tuple[str, ...]] = {"trainer": ("scheduler",)}
"""The trainer's node also runs a scheduler: the final evaluation (``periodic_eval.evaluate``);
the head node of a multi-host run is ``--roles trainer,scheduler`` on one credential."""

KV_WRITES: dict[str, tuple[str, ...]] = {
    "trainer": (m.POLICY_KEY, m.LEDGER_KEY, m.RUN_END_KEY),
    "scheduler": ("scheduler.>",),  # scheduler.<prefix>.issued and .admitted
    "generate": ("relay.>",),  # a site's weight relay (a generate credential): relay.<site>
}
"""KV keys each role writes in the run's bucket (every role reads them all)."""

OBJECTS: dict[str, str] = {"trainer": "write", "generate": "read"}
"""Access to the run's object store (weights with ``trainer.weights: object``; with ``tcp``
the weight server's token, which only the roles that read weights may learn)."""

TRAJ_OBJECTS: dict[str, str] = {"env": "write", "trainer": "read", "scheduler": "read"}
"""Access to the run's trajectory object store (completions too large for one message,
:mod:`rollart.actors.kernel.payloads`): a bucket apart from the weights', so an env credential
cannot touch weights. ``write`` creates the bucket and puts objects (no purge: rollart never
deletes one; they expire with the bucket's time to live)."""

STREAM_OWNERS = ("trainer",)
"""May update the run's streams (change limits or subjects); the others only create them."""

ADMIN_ONLY = (
    "$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.MSG.DELETE.>", "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.ACCOUNT.PURGE.>", "$JS.API.STREAM.SNAPSHOT.>", "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.PEER.>", "$JS.API.STREAM.LEADER.>", "$JS.API.CONSUMER.LEADER.>",
    "$JS.API.META.>", "$JS.API.SERVER.>", "$SYS.>",
)
"""Denied to every role, whatever an allow says (deny wins in nats-server)."""



def expand(role: str) -> list[str]:
    """``trainer`` -> [trainer, scheduler]; ``env,generate`` (or ``env+generate``) -> both."""
    out: list[str] = []
    todo = [r.strip() for r in role.replace("+", ",").split(",") if r.strip()]
    if not todo:
        raise ValueError("no role given")
    while todo:
        r = todo.pop(0)
        if r not in (*ROLES, ADMIN):
            raise ValueError(f"unknown role {r!r}: use {', '.join((*ROLES, ADMIN))} "
                             "(several joined with ',')")
        if r not in out:
            out.append(r)
            todo.extend(INCLUDES.get(r, ()))
    return out


def verbs(name: str, roles: Iterable[str]) -> set[str]:
    """What ``roles`` (expanded) do with subject ``name``."""
    uses = USES.get(name, {})
    out: set[str] = set()
    for r in roles:
        out.update(uses.get(r, "").split())
        if r != "monitor":
            out.update(uses.get(NODE, "").split())
    return out


class _Names:
    """The run's subjects and stream names; ``*`` for a credential reused across runs."""

    def __init__(self, run: str) -> None:
        self.run = run if run == "*" else m.check_token("run", run)
        star = run == "*"
        self.events = "*" if star else m.stream_name(run, "events")
        self.work = "*" if star else m.stream_name(run, "work")
        self.bucket = "*" if star else m.kv_bucket(run)
        self.kv = "*" if star else f"KV_{self.bucket}"
        self.obj_bucket = "*" if star else m.object_bucket(run)
        self.obj = "*" if star else f"OBJ_{self.obj_bucket}"
        self.traj_bucket = "*" if star else m.traj_bucket(run)
        self.traj = "*" if star else f"OBJ_{self.traj_bucket}"

    def subject(self, name: str) -> str:
        d = m.SUBJECTS[name]
        return (f"{m.PREFIX}.{self.run}.{name}" + (".*" if d.pooled else "")
                + (".*" if d.per_replica else ""))

    def stream(self, kind: str) -> str:
        return self.events if kind == "events" else self.work


def role_permissions(role: str, run: str = "*", *, response_ttl: str = "1h",
                     domain: str | None = None) -> dict:
    """The nats-server ``permissions`` of ``role`` (or of several: ``"env,generate"``).

    ``{"publish": {"allow": [...], "deny": [...]}, "subscribe": {"allow": [...]}}`` plus
    ``allow_responses`` for roles that serve requests (a reply within ``response_ttl``).
    ``domain``: the run's JetStream domain (sites, :mod:`rollart.deploy.sites`): every
    ``$JS.API.X`` and ``$KV.X`` subject is also allowed (or denied) as ``$JS.<domain>.API.X``
    and ``$JS.<domain>.API.$KV.X``, which a site's clients send (acks and flow control keep
    their plain form)."""
    out = _role_permissions(role, run, response_ttl)
    if domain:
        out["publish"]["allow"] = _unique(out["publish"]["allow"] + _twins(out["publish"]["allow"], domain))
        if "deny" in out["publish"]:
            out["publish"]["deny"] = _unique(out["publish"]["deny"] + _twins(out["publish"]["deny"], domain))
    return out


def _twins(subjects: list[str], domain: str) -> list[str]:
    """The domain forms of the JetStream API and KV subjects among ``subjects``."""
    out = []
    for x in subjects:
        if x.startswith("$JS.API."):
            out.append(f"$JS.{domain}.API." + x[len("$JS.API."):])
        elif x.startswith("$KV."):
            out.append(f"$JS.{domain}.API." + x)
    return out


def _role_permissions(role: str, run: str, response_ttl: str) -> dict:
    roles_given = [r.strip() for r in role.replace("+", ",").split(",") if r.strip()]
    roles = expand(role)
    if ADMIN in roles:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    n = _Names(run)
    pub: list[str] = []
    sub: list[str] = []
    serves = False
    for name, d in m.SUBJECTS.items():
        v, s = verbs(name, roles), n.subject(name)
        if v & {"publish", "request"}:
            pub.append(s)
        if v & {"subscribe", "serve"}:
            sub.append(s)
        serves = serves or "serve" in v
        if "consume" in v:
            st = n.stream(d.stream)
            pub += [f"$JS.API.CONSUMER.CREATE.{st}.*.{s}", f"$JS.API.CONSUMER.INFO.{st}.*",
                    f"$JS.API.CONSUMER.MSG.NEXT.{st}.*", f"$JS.ACK.{st}.>"]
    node = any(r != "monitor" for r in roles)
    if "monitor" in roles:
        sub.append(f"{m.PREFIX}.{n.run}.>")
        # `rollart top`: each consumer's pending, ack pending, redelivered (read-only calls)
        pub += [f"$JS.API.CONSUMER.{op}.{x}{tail}" for x in (n.events, n.work)
                for op, tail in (("LIST", ""), ("INFO", ".*"))]
    own = [n.events, n.work, n.kv]
    pub += [f"$JS.API.STREAM.INFO.{x}" for x in own]
    if node:
        pub += [f"$JS.API.STREAM.CREATE.{x}" for x in own]
    if set(roles) & set(STREAM_OWNERS):
        pub += [f"$JS.API.STREAM.UPDATE.{x}" for x in (n.events, n.work)]
    pub += [f"$JS.API.DIRECT.GET.{n.kv}.>", f"$JS.API.CONSUMER.CREATE.{n.kv}",
            f"$JS.API.CONSUMER.INFO.{n.kv}.*", f"$JS.FC.{n.kv}.>"]
    for r in roles:
        pub += [f"$KV.{n.bucket}.{key}" for key in KV_WRITES.get(r, ())]
    access = {OBJECTS[r] for r in roles if r in OBJECTS}
    purge = "write" in access and run != "*"
    pub += _object_access(access, n.obj, n.obj_bucket, purge=purge)
    traj = {TRAJ_OBJECTS[r] for r in roles if r in TRAJ_OBJECTS}
    if run == "*":  # `$O.*.>` would be every bucket, the weights' too: no write at all
        traj.discard("write")
        traj = traj or ({"read"} if any(r in TRAJ_OBJECTS for r in roles) else set())
    pub += _object_access(traj, n.traj, n.traj_bucket, purge=False)
    sub.append(f"{inbox_prefix('+'.join(roles_given))}.>")  # its own replies only
    deny = list(ADMIN_ONLY) + ([] if purge else ["$JS.API.STREAM.PURGE.>"])
    if not node:  # the monitor: nothing of the run, no KV or object writes, whatever else says
        deny += [f"{m.PREFIX}.>", "$KV.>", "$O.>"]
    out: dict = {"publish": {"allow": _unique(pub), "deny": deny},
                 "subscribe": {"allow": _unique(sub)}}
    if serves:
        out["allow_responses"] = {"max": 1, "expires": response_ttl}
    return out


def _object_access(access: set[str], stream: str, bucket: str, *, purge: bool) -> list[str]:
    """JetStream subjects of ``read`` / ``write`` access to one object store."""
    if not access:
        return []
    out = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
           f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.FC.{stream}.>",
           "$JS.API.STREAM.NAMES"]  # nats-py finds the chunks' stream by subject
    if "write" in access:
        out += [f"$JS.API.STREAM.CREATE.{stream}", f"$O.{bucket}.>"]
        if purge:
            out.append(f"$JS.API.STREAM.PURGE.{stream}")
    return out


def _unique(xs: list[str]) -> list[str]:
    return list(dict.fromkeys(xs))


def check_table() -> list[str]:
    """Problems of :data:`USES` against the subject table (empty: consistent)."""
    bad = []
    for name in m.SUBJECTS.keys() - USES.keys():
        bad.append(f"subject {name!r} is in messages.SUBJECTS but no role uses it in USES")
    for name in USES.keys() - m.SUBJECTS.keys():
        bad.append(f"USES names {name!r}, which messages.SUBJECTS does not have")
    for name, uses in USES.items():
        d = m.SUBJECTS.get(name)
        if d is None:
            continue
        all_verbs = set()
        for role, vs in uses.items():
            if role not in (*ROLES, NODE):
                bad.append(f"{name}: unknown role {role!r}")
            for v in vs.split():
                all_verbs.add(v)
                if v not in VERBS:
                    bad.append(f"{name}: {role}: unknown verb {v!r}")
                elif v == "consume" and d.stream is None:
                    bad.append(f"{name}: {role} consumes it, but it is on no stream")
                elif v in ("serve", "request") and name not in m.REPLY_TYPES:
                    bad.append(f"{name}: {role} {v}s it, but it has no reply type")
        if not all_verbs & {"publish", "request"}:
            bad.append(f"{name}: no role sends it")
        if not all_verbs & {"subscribe", "serve", "consume"}:
            bad.append(f"{name}: no role receives it")
    return bad


def _q(s: str) -> str:
    return json.dumps(str(s))


def server_config(users: Iterable[dict], *, cert_file: str | None = None, key_file: str | None = None,
                  ca_file: str | None = None, listen: str | None = "0.0.0.0:4222",
                  store_dir: str | None = None, max_payload: int | None = None,
                  verify_clients: bool = False) -> str:
    """A nats-server config: ``users`` (``{"user", "password" (a bcrypt hash), "permissions"}``),
    TLS when ``cert_file`` and ``key_file`` are given (client certificates optional unless
    ``verify_clients``), JetStream with ``store_dir``."""
    out = ["# nats-server configuration (written by `rollart secure init`)", ""]
    if listen:
        out.append(f"listen: {_q(listen)}")
    if max_payload:
        out.append(f"max_payload: {int(max_payload)}")
    out += ["jetstream {", *([f"  store_dir: {_q(store_dir)}"] if store_dir else []), "}"]
    if cert_file or key_file:
        if not (cert_file and key_file):
            raise ValueError("TLS needs both cert_file and key_file")
        out += ["tls {", f"  cert_file: {_q(cert_file)}", f"  key_file: {_q(key_file)}"]
        if ca_file:
            out.append(f"  ca_file: {_q(ca_file)}")
        out += [f"  verify: {'true' if verify_clients else 'false'}", "  timeout: 5", "}"]
    out += [*authorization_lines(users), ""]
    return "\n".join(out)


def authorization_lines(users: Iterable[dict]) -> list[str]:
    """A nats-server ``authorization`` block of ``users`` (``{"user", "password" (a bcrypt
    hash), "permissions"}``)."""
    out = ["authorization {", "  users: ["]
    for u in users:
        perms = json.dumps(u["permissions"], indent=2).replace("\n", "\n      ")
        out += ["    {", f"      user: {_q(u['user'])}", f"      password: {_q(u['password'])}",
                f"      permissions: {perms}", "    }"]
    out += ["  ]", "}"]
    return out
