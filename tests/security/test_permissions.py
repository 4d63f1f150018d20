"""`rollart secure`: role credentials and least-privilege permissions, on a real nats-server.

The server runs the generated config (TLS on, one bcrypt-hashed password per role, the
permissions of :mod:`rollart.security.permissions`); every violation the server logs is
read back from its log (``"$G/user:<role>" - Publish Violation - Subject "..."``).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from rollart import messages as m
from rollart.bus import BusError, BusTimeout, ConsumerSpec
from rollart.bus.auth import inbox_prefix
from rollart.bus.codec import encode
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer, find_binary
from rollart.node import ensure_run_streams
from rollart.security import permissions as P
from rollart.app.secure import main as secure_main
from rollart.security.init import secure_init
from tests.waiting import until

RUN = f"s{uuid.uuid4().hex[:6]}"
OTHER = f"o{uuid.uuid4().hex[:6]}"


# -- fixtures and helpers --------------------------------------------------------------


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Path:
    """Credentials pinned to RUN; the server runs the config exactly as written."""
    d = tmp_path_factory.mktemp("secure") / "creds"
    secure_init(d, ["rollart.test"], run=RUN)
    return d


@pytest.fixture(scope="module")
def server(creds, tmp_path_factory):
    srv = EmbeddedServer(tmp_path_factory.mktemp("secure-nats"), config_file=creds / "server.conf")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def any_run(tmp_path_factory):
    """(credentials for any run, the server that uses them): the default of `secure init`."""
    d = tmp_path_factory.mktemp("secure-any") / "creds"
    secure_init(d, ["rollart.test"])
    srv = EmbeddedServer(tmp_path_factory.mktemp("secure-any-nats"), config_file=d / "server.conf")
    srv.start()
    try:
        yield d, srv
    finally:
        srv.stop()


@pytest.fixture
async def fresh(server, creds):
    """After the test, an admin deletes RUN's streams, KV and object store (the next test of
    the pinned credentials starts from nothing, whatever the order)."""
    yield
    await wipe(server, creds, RUN)


async def wipe(server, creds: Path, run: str) -> None:
    admin = await connect(server, creds, "admin")
    try:
        for name in (m.stream_name(run, "events"), m.stream_name(run, "work"),
                     f"KV_{m.kv_bucket(run)}", f"OBJ_{m.object_bucket(run)}",
                     f"OBJ_{m.traj_bucket(run)}"):
            deadline = time.monotonic() + 60
            while True:  # a loaded server may answer a delete after the client's 5 s
                try:
                    await admin.delete_stream(name)  # (gone already: a no-op)
                    break
                except BusTimeout:
                    if time.monotonic() > deadline:
                        raise
    finally:
        await admin.close()


def auth(creds: Path, user: str) -> dict:
    return {"user": user, "password": (creds / f"{user}.password").read_text().strip(),
            "tls": ssl.create_default_context(cafile=str(creds / "ca.pem")),
            "inbox_prefix": inbox_prefix(user)}


class RecordingBus(NatsBus):
    """A NatsBus that keeps every error nats-py reports (permission violations included)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.errors: list[str] = []

    async def _on_error(self, err: Exception) -> None:
        self.errors.append(str(err))
        await super()._on_error(err)


async def connect(server, creds: Path, user: str) -> RecordingBus:
    bus = RecordingBus(server.url, name=f"rollart-{user}", auth=auth(creds, user), connect_timeout=3)
    await bus.connect()
    return bus


class ServerLog:
    """Violations the server logged since this object was made."""

    def __init__(self, server) -> None:
        self.path = server.log_path
        self.start = self.path.stat().st_size

    def violations(self) -> list[str]:
        with open(self.path, errors="replace") as f:
            f.seek(self.start)
            return [ln.strip() for ln in f if "Violation" in ln]

    async def wait_for(self, *needles: str, deadline: float = 30.0) -> list[str]:
        """The violations logged so far, once each of ``needles`` is in one of them."""
        def found() -> list[str] | None:
            lines = self.violations()
            return lines if all(any(n in ln for ln in lines) for n in needles) else None

        return await until(found, deadline=deadline, what=f"the server to log {needles}",
                           state=lambda: "\n".join(self.violations()))


def allows(perms: dict, kind: str, subject: str) -> bool:
    """Does a literal subject match an allow (and no deny) of ``perms[kind]``?"""
    def match(pat: str, s: str) -> bool:
        pp, ss = pat.split("."), s.split(".")
        for i, p in enumerate(pp):
            if p == ">":
                return len(ss) > i
            if i >= len(ss) or (p != "*" and p != ss[i]):
                return False
        return len(pp) == len(ss)
    p = perms.get(kind, {})
    return any(match(a, subject) for a in p.get("allow", [])) and \
        not any(match(d, subject) for d in p.get("deny", []))


# -- the table (pure) ---------------------------------------------------------------


def test_every_subject_is_assigned_and_the_table_is_consistent(monkeypatch):
    assert P.check_table() == []
    monkeypatch.setitem(m.SUBJECTS, "weights.sneaky", m.SubjectDef("weights.sneaky", m.PolicyPublished))
    assert any("weights.sneaky" in p and "no role uses it" in p for p in P.check_table())


def test_the_table_matches_what_the_actors_declare():
    """Every @consume/@serve handler of a built-in role is in USES with that verb."""
    import inspect

    from rollart.node import BUILTIN_ROLES, resolve

    for role, path in BUILTIN_ROLES.items():
        cls = resolve(path)
        for _, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
            spec = getattr(fn, "__rollart_handler__", None)
            if spec is not None:
                assert spec.kind in P.verbs(spec.subject, P.expand(role)), (role, spec.subject, spec.kind)


def test_a_clear_error_without_the_secure_extra(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "bcrypt", None)  # import bcrypt -> ImportError
    assert secure_main(["init", str(tmp_path / "c"), "--host", "h"]) == 2
    assert "pip install 'rollart[secure]'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("run", ["*", RUN], ids=["any", "pinned"])  # ids: the same on every xdist worker
def test_least_privilege_by_construction(run):
    r = run if run != "*" else "anyrun"
    bucket, obj = m.kv_bucket(r), m.object_bucket(r)
    perms = {role: P.role_permissions(role, run) for role in P.ROLES}
    for role, p in perms.items():
        pub = lambda s, p=p: allows(p, "publish", s)  # noqa: E731
        assert pub(f"rollart.{r}.policy.published") == (role == "trainer"), role
        assert pub(f"rollart.{r}.policy.loaded") == (role == "generate"), role
        assert pub(f"$O.{obj}.C.abc") == (role == "trainer"), role
        traj = m.traj_bucket(r)  # long trajectories: env writes, trainer and scheduler read
        # (with `*` the bucket would be every bucket: no env write, the weights' stay safe)
        assert pub(f"$O.{traj}.C.abc") == ((role == "env" and run != "*") or (run == "*" and role == "trainer")), role
        assert pub(f"$JS.API.STREAM.MSG.GET.OBJ_{traj}") == (
            role in ("env", "trainer", "scheduler") or (run == "*" and role == "generate")), role
        assert not pub(f"$JS.API.STREAM.PURGE.OBJ_{traj}") or (run == "*" and role == "trainer"), role
        assert pub(f"$KV.{bucket}.{m.POLICY_KEY}") == (role == "trainer"), role
        assert pub(f"$KV.{bucket}.{m.RUN_END_KEY}") == (role == "trainer"), role
        assert pub(f"$KV.{bucket}.scheduler.g.admitted") == (role in ("trainer", "scheduler")), role
        assert pub(f"rollart.{r}.rollout.requested.default") == (role in ("trainer", "scheduler")), role
        for admin in (f"$JS.API.STREAM.DELETE.{m.stream_name(r, 'events')}",
                      f"$JS.API.STREAM.PURGE.{m.stream_name(r, 'events')}",
                      f"$JS.API.STREAM.PURGE.KV_{bucket}",
                      f"$JS.API.CONSUMER.DELETE.{m.stream_name(r, 'work')}.env-on-request",
                      f"$JS.API.STREAM.MSG.DELETE.KV_{bucket}"):
            assert not pub(admin), (role, admin)
        assert pub(f"$JS.API.STREAM.PURGE.OBJ_{obj}") == (role == "trainer" and run != "*"), role
        assert pub("_INBOX.abc.def") is False, role  # replies only through allow_responses
        assert allows(p, "subscribe", f"{inbox_prefix(role)}.abc.def"), role  # its own replies
        assert not allows(p, "subscribe", "_INBOX.abc.def"), role  # not the shared inbox
        others = [u for u in P.ROLES if u != role]
        assert not any(allows(p, "subscribe", f"{inbox_prefix(u)}.abc") for u in others), role
        # every subject the role sends, per the table, is allowed; nothing else of the run is
        for name, d in m.SUBJECTS.items():
            s = (f"rollart.{r}.{name}" + (".default" if d.pooled else "")
                 + (".gen-0-ab12cd" if d.per_replica else ""))
            assert pub(s) == bool(P.verbs(name, P.expand(role)) & {"publish", "request"}), (role, s)
    mon = perms["monitor"]
    assert all(a.startswith("$JS.") for a in mon["publish"]["allow"]), mon["publish"]["allow"]
    assert allows(mon, "subscribe", f"rollart.{r}.rollout.completed")
    assert not any(allows(mon, "publish", s) for s in (
        f"rollart.{r}.node.heartbeat", f"$KV.{bucket}.x", f"$JS.API.STREAM.CREATE.KV_{bucket}",
        f"$JS.API.CONSUMER.CREATE.KV_{bucket}.durable.$KV.{bucket}.>"))
    assert "allow_responses" in perms["generate"] and "allow_responses" in perms["reward"]
    assert "allow_responses" not in perms["env"] and "allow_responses" not in perms["trainer"]
    both = P.role_permissions("env,generate", run)
    assert set(both["publish"]["allow"]) == set(perms["env"]["publish"]["allow"]) | set(
        perms["generate"]["publish"]["allow"])
    with pytest.raises(ValueError, match="unknown role"):
        P.role_permissions("root", run)


# -- secure init and show ---------------------------------------------------------------


def test_secure_init_writes_keys_private_and_refuses_to_overwrite(tmp_path, capsys):
    from cryptography import x509

    d = tmp_path / "creds"
    assert secure_main(["init", str(d), "--host", "head.example", "--host", "10.1.2.3"]) == 0
    for name in ("ca.key", "server.key", "server.conf", *(f"{r}.password" for r in (*P.ROLES, "admin"))):
        assert stat.S_IMODE(os.stat(d / name).st_mode) == 0o600, name
    for name in ("ca.pem", "server.pem", "README.txt", "secure.json"):
        assert (d / name).stat().st_size > 0
    cert = x509.load_pem_x509_certificate((d / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"head.example", "localhost"}
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"10.1.2.3", "127.0.0.1"}
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in eku
    conf = (d / "server.conf").read_text()
    assert str(d.resolve() / "server.pem") in conf and "verify: false" in conf and "$2b$11$" in conf
    assert "head.example" in (d / "README.txt").read_text()
    # the config as written is valid for nats-server, also with a store in it (--store-dir)
    ok = subprocess.run([find_binary(), "-t", "-c", str(d / "server.conf")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "store_dir" not in conf  # an embedded server gives -sd: a second one is refused
    stored = tmp_path / "stored"
    assert secure_main(["init", str(stored), "--host", "h", "--store-dir", str(tmp_path / "js")]) == 0
    assert f'store_dir: "{tmp_path / "js"}"' in (stored / "server.conf").read_text()
    ok = subprocess.run([find_binary(), "-t", "-c", str(stored / "server.conf")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    capsys.readouterr()
    # show: users and permissions, never a secret
    assert secure_main(["show", str(d)]) == 0
    shown = capsys.readouterr().out
    sections = {b.split(":", 1)[0]: b for b in shown.split("\n\n")[1:]}
    assert set(sections) == {*P.ROLES, "admin"} and "under rollart.*." in shown
    publish = {u: next(ln for ln in b.splitlines() if ln.strip().startswith("publish"))
               for u, b in sections.items() if u != "monitor"}
    assert "policy.published" in publish["trainer"] and "policy.published" not in publish["env"]
    assert "publish" not in sections["monitor"].split("denied")[0]
    secrets_ = [(d / f"{r}.password").read_text().strip() for r in P.ROLES] + ["$2b$", "PRIVATE KEY"]
    assert not any(s in shown for s in secrets_)
    # a folder with credentials is never overwritten by accident
    before = (d / "trainer.password").read_text()
    assert secure_main(["init", str(d), "--host", "x"]) == 2
    assert "--force" in capsys.readouterr().err and (d / "trainer.password").read_text() == before
    assert secure_main(["init", str(d), "--host", "x", "--force", "--run", "r1", "--role", "env,reward"]) == 0
    assert (d / "env+reward.password").exists() and not (d / "trainer.password").exists()


# -- on a real server ---------------------------------------------------------------------


async def test_clients_without_the_right_credential_are_refused(server, creds):
    import nats

    async def attempt(**kw):
        nc = await nats.connect(servers=[server.url], allow_reconnect=False, connect_timeout=2,
                                max_reconnect_attempts=0, **kw)
        await nc.close()

    ca = ssl.create_default_context(cafile=str(creds / "ca.pem"))
    with pytest.raises(Exception):  # noqa: B017 - nats-py raises several kinds
        await attempt(tls=ca)  # no credentials
    with pytest.raises(Exception):  # noqa: B017
        await attempt(tls=ca, user="env", password="not-the-password")
    with pytest.raises(Exception):  # noqa: B017
        await attempt(tls=ca, user="monitor", password=(creds / "env.password").read_text().strip())
    with pytest.raises(Exception):  # noqa: B017 - a server certificate the client cannot verify
        await attempt(tls=ssl.create_default_context(), **{k: v for k, v in auth(creds, "env").items()
                                                          if k != "tls"})
    await attempt(**auth(creds, "env"))  # the right one works


async def test_env_cannot_publish_a_policy(server, creds, fresh):
    log = ServerLog(server)
    trainer, env, mon = [await connect(server, creds, u) for u in ("trainer", "env", "monitor")]
    try:
        await ensure_run_streams(trainer, RUN)
        consumer = await trainer.pull_consumer(m.stream_name(RUN, "events"), ConsumerSpec(
            durable=f"t-{uuid.uuid4().hex[:6]}", filter_subject=m.subject(RUN, "policy.published"),
            deliver_all=False))
        seen: list[bytes] = []

        async def on_msg(req) -> None:
            seen.append(req.data)

        await mon.subscribe(f"rollart.{RUN}.policy.>", on_msg)
        fake = encode(m.PolicyPublished(version=99, uri="file:///evil", digest="sha256:00"))
        with pytest.raises(BusError):  # the JetStream publish: no ack ever comes
            await env.publish(m.subject(RUN, "policy.published"), fake, timeout=1.0)
        await env.publish_core(m.subject(RUN, "policy.published"), fake)
        await env._client().flush()  # white-box: the raw client (no flush in the bus API)
        await until(lambda: len(env.errors) >= 2, deadline=30, what="two permission errors",
                    state=lambda: env.errors)
        assert all("permissions violation for publish" in e and "policy.published" in e for e in env.errors)
        found = await log.wait_for('user:env" - Publish Violation - Subject "rollart.')
        assert any(f'"rollart.{RUN}.policy.published"' in v for v in found), found
        # the path works: the trainer's own policy, published after the server refused the
        # env's (it logged both), arrives at both; a forgery let through would come first
        good = encode(m.PolicyPublished(version=1, uri="file:///w", digest="sha256:01"))
        await trainer.publish(m.subject(RUN, "policy.published"), good)
        got = await consumer.fetch(10, timeout=30.0)
        assert [d.data for d in got] == [good]
        await got[0].ack()
        await until(lambda: seen, deadline=30, what="the monitor to see the trainer's policy")
        assert seen == [good] and trainer.errors == [] and mon.errors == []
    finally:
        for b in (trainer, env, mon):
            await b.close()


async def test_long_trajectories_env_writes_the_trajectory_store_only(server, creds, fresh):
    """A completion too large for one message: the env puts it in the run's trajectory
    store (not the weights' store), the trainer and the scheduler read it."""
    trainer, env, sched = [await connect(server, creds, u) for u in ("trainer", "env", "scheduler")]
    try:
        await ensure_run_streams(trainer, RUN)
        blob = os.urandom(300_000)
        store = await env.object_store(m.traj_bucket(RUN), ttl=3600)
        assert not await store.exists("traj-t0-x")
        await store.put("traj-t0-x", blob)
        assert await store.exists("traj-t0-x")
        for reader in (trainer, sched):
            assert await (await reader.object_store(m.traj_bucket(RUN))).get("traj-t0-x") == blob
        weights = await trainer.object_store(m.object_bucket(RUN))
        with pytest.raises(BusError):  # no write on the weights' bucket
            await (await env.object_store(m.object_bucket(RUN))).put("v1", b"forged")
        with pytest.raises(KeyError):
            await weights.get("v1")
        assert trainer.errors == [] and sched.errors == []
    finally:
        for b in (trainer, env, sched):
            await b.close()


async def test_monitor_only_reads(server, creds, fresh):
    log = ServerLog(server)
    trainer, mon = [await connect(server, creds, u) for u in ("trainer", "monitor")]
    try:
        await ensure_run_streams(trainer, RUN)
        kv = await trainer.key_value(m.kv_bucket(RUN))
        await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(trained=3)))
        beats: list[bytes] = []

        async def on_beat(req) -> None:
            beats.append(req.data)

        await trainer.subscribe(m.subject(RUN, "node.heartbeat"), on_beat)
        work = m.stream_name(RUN, "work")
        queued = (await trainer.stream_info(work))["messages"]
        hb = m.NodeHeartbeat(node_id="evil", host="h", pid=1, pool="default", roles=["env"], ts=time.time())
        await mon.publish_core(m.subject(RUN, "node.heartbeat"), encode(hb))
        req = m.RolloutRequested(traj_id="t1", group_id="g1", env="main", seed=1)
        with pytest.raises(BusError):
            await mon.publish(m.subject(RUN, "rollout.requested", "default"), encode(req), timeout=1.0)
        # white-box: raw requests on the nats client, which the bus API does not send
        with pytest.raises(Exception):  # noqa: B017 - a KV put: never acked (no 5 s JetStream wait)
            await mon._client().request(f"$KV.{m.kv_bucket(RUN)}.{m.POLICY_KEY}", b"x", timeout=0.5)
        with pytest.raises(Exception):  # noqa: B017 - no answer: a nats-py timeout
            await mon._client().request(f"$JS.API.STREAM.CREATE.{work}", b"{}", timeout=0.5)
        found = await log.wait_for(f'"$JS.API.STREAM.CREATE.{work}"', f'"$KV.{m.kv_bucket(RUN)}.',
                                   f'"rollart.{RUN}.node.heartbeat"')
        assert any(f'"rollart.{RUN}.node.heartbeat"' in v for v in found), found
        assert any(f'"rollart.{RUN}.rollout.requested.default"' in v for v in found), found
        assert any(f'"$JS.API.STREAM.CREATE.{work}"' in v for v in found), found
        assert any(f'"$KV.{m.kv_bucket(RUN)}.{m.POLICY_KEY}"' in v for v in found), found
        # the server refused the monitor's heartbeat (logged above); the trainer's own one,
        # sent after it on the same subject, arrives alone: the refused one would come first
        mine = encode(m.NodeHeartbeat(node_id="trainer-marker", host="h", pid=1, pool="default",
                                      roles=["env"], ts=time.time()))
        await trainer.publish_core(m.subject(RUN, "node.heartbeat"), mine)
        await until(lambda: beats, deadline=30, what="the trainer's own heartbeat")
        assert beats == [mine], "a monitor's heartbeat arrived"
        assert (await trainer.stream_info(work))["messages"] == queued
        # ...and what `rollart top` does works: stream info, KV get and watch, subscribe all
        events = m.stream_name(RUN, "events")
        assert (await mon.stream_info(events))["messages"] == (
            await trainer.stream_info(events))["messages"]
        mkv = await mon.key_value(m.kv_bucket(RUN))
        assert (await mkv.get(m.LEDGER_KEY)).value == encode(m.LedgerSummary(trained=3))
        watch = mkv.watch(m.LEDGER_KEY)
        first = await asyncio.wait_for(watch.__anext__(), 5)
        await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(trained=4)))
        second = await asyncio.wait_for(watch.__anext__(), 5)
        await watch.aclose()
        assert (first.value, second.value) == (encode(m.LedgerSummary(trained=3)),
                                               encode(m.LedgerSummary(trained=4)))
        seen: list[str] = []

        async def on_any(r) -> None:
            seen.append(r.subject)

        await mon.subscribe(f"rollart.{RUN}.>", on_any)
        await trainer.publish_core(m.subject(RUN, "node.heartbeat"), encode(hb))
        await until(lambda: seen, deadline=30, what="the monitor to see a heartbeat")
        assert not [v for v in log.violations() if "user:monitor" in v and "Subscription" in v]
    finally:
        for b in (trainer, mon):
            await b.close()


async def test_each_user_reads_only_its_own_replies(server, creds, fresh):
    """Replies go to ``_INBOX_<user>``: an env credential cannot subscribe to the shared
    ``_INBOX.>`` nor to the trainer's inbox, so it cannot read the trainer's JetStream
    replies (acks, KV reads); its own request/reply works."""
    log = ServerLog(server)
    trainer, env = [await connect(server, creds, u) for u in ("trainer", "env")]
    try:
        got: list[str] = []

        async def spy(req) -> None:
            got.append(req.subject)

        for pattern in ("_INBOX.>", f"{inbox_prefix('trainer')}.>"):
            try:
                await env.subscribe(pattern, spy)
            except BusError:
                pass  # refused at once, or reported through the error callback: both fine
        found = await log.wait_for('"_INBOX.>"', f'"{inbox_prefix("trainer")}.>"')
        assert any("Subscription" in v and '"_INBOX.>"' in v for v in found), found
        assert any("Subscription" in v and f'"{inbox_prefix("trainer")}.>"' in v for v in found), found
        await ensure_run_streams(trainer, RUN)  # JetStream API replies to the trainer's inbox
        kv = await trainer.key_value(m.kv_bucket(RUN))
        await kv.put(m.LEDGER_KEY, encode(m.LedgerSummary(trained=1)))
        assert (await kv.get(m.LEDGER_KEY)).value == encode(m.LedgerSummary(trained=1))
        # its own request/reply works; its reply comes on the env's connection after any copy
        # of the trainer's replies (the server routed those first), so none can still be due
        events = m.stream_name(RUN, "events")
        assert (await env.stream_info(events))["messages"] == (
            await trainer.stream_info(events))["messages"]
        assert got == [], f"env read the trainer's replies: {got}"
    finally:
        for b in (trainer, env):
            await b.close()


async def test_credentials_pinned_to_a_run_cannot_touch_another(server, creds, fresh):
    log = ServerLog(server)
    admin, env, mon = [await connect(server, creds, u) for u in ("admin", "env", "monitor")]
    try:
        await ensure_run_streams(admin, OTHER)  # the other run exists (made by an admin)
        okv = await admin.key_value(m.kv_bucket(OTHER))
        await okv.put(m.POLICY_KEY, b"other")
        await ensure_run_streams(env, RUN)  # its own run: fine
        with pytest.raises(BusError, match="may not create"):  # at once: a refusal, not a busy server
            await ensure_run_streams(env, OTHER)
        nc = env._client()  # raw API requests: a denied one is never answered (no 5 s wait)
        owork, okvs = m.stream_name(OTHER, "work"), f"KV_{m.kv_bucket(OTHER)}"
        denied = [f"$JS.API.CONSUMER.CREATE.{owork}.env-on-request."
                  f"{m.subject(OTHER, 'rollout.requested', 'default')}",
                  f"$JS.API.STREAM.INFO.{okvs}",
                  f"$JS.API.DIRECT.GET.{okvs}.$KV.{m.kv_bucket(OTHER)}.{m.POLICY_KEY}"]
        for subj in denied:
            with pytest.raises(Exception):  # noqa: B017 - a nats-py timeout
                await nc.request(subj, b"", timeout=0.3)
        await env.publish_core(m.subject(OTHER, "rollout.completed"), b"x")
        await env._client().flush()
        seen: list[str] = []

        async def on_any(r) -> None:
            seen.append(r.subject)

        await mon.subscribe(f"rollart.{OTHER}.>", on_any)
        found = await log.wait_for(f'"rollart.{OTHER}.rollout.completed"',
                                   f'"$JS.API.STREAM.CREATE.{m.stream_name(OTHER, "events")}"',
                                   f'Subscription Violation - Subject "rollart.{OTHER}.>"', *denied)
        for subj in denied:
            assert any(f'user:env" - Publish Violation - Subject "{subj}"' in v for v in found), subj
        await admin.delete_stream(m.stream_name(OTHER, "events"))  # only the admin may
        await admin.delete_stream(m.stream_name(OTHER, "work"))
        await admin.delete_stream(f"KV_{m.kv_bucket(OTHER)}")
    finally:
        for b in (admin, env, mon):
            await b.close()


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["pinned", "any"])
async def test_a_training_run_with_one_credential_per_role(scope, request, tiny_model, tmp_path):
    """Trainer (+ its scheduler and final evaluation), env, generate and reward nodes, each on
    its own connection and credential, train 2 steps with weights in the object store while
    a monitor watches: no permission is missing (no violation in the server log). Pinned
    credentials also delete old weights (a filtered purge of the object store); credentials
    for any run may purge nothing, so that run keeps its weights (``keep_weights`` 3)."""
    import msgspec

    import rollart
    from rollart.actors.kernel.run_end import wait_run_end
    from rollart.config import RunConfig, load
    from rollart.config.trainer import SyncConfig
    from rollart.app.launch import drive_training, with_overrides
    from rollart.node import Node, build_actors
    from rollart.app.monitor import top

    if scope == "pinned":
        creds, server, run = request.getfixturevalue("creds"), request.getfixturevalue("server"), RUN
        await wipe(server, creds, run)  # whatever the tests before left of RUN
    else:
        (creds, server), run = request.getfixturevalue("any_run"), f"a{uuid.uuid4().hex[:6]}"
    log = ServerLog(server)
    keep = 1 if scope == "pinned" else 3
    cfg = load(Path(rollart.__file__).parent / "configs" / "quickstart.yaml", RunConfig)
    cfg = with_overrides(
        cfg, run=run, run_dir=str(tmp_path / "runs"), model={"path": str(tiny_model)},
        node={"grace": 3, "heartbeat_every": 0.5},
        rollout={"group_size": 2, "batch_groups": 2, "alpha": 1, "concurrency": 16},
        trainer={"steps": 2, "eval_groups": 1, "weights": "object", "keep_weights": keep,
                 "sync": SyncConfig(format="file")})  # the store holds files by version
    cfg = msgspec.structs.replace(cfg, envs={"main": msgspec.structs.replace(
        cfg.envs["main"], max_turns=4, args={**cfg.envs["main"].args, "max_steps": 4})})
    buses = {u: await connect(server, creds, u) for u in ("trainer", "env", "generate", "reward", "monitor")}
    t0 = time.monotonic()
    try:
        head_actors = build_actors(cfg, ["trainer", "scheduler"], "default")
        trainer = next(a for a in head_actors if a.role == "trainer")
        sched = next(a for a in head_actors if a.role == "scheduler")
        kw = dict(grace=cfg.node.grace, heartbeat_every=cfg.node.heartbeat_every,
                  events_max_age=cfg.node.events_max_age, events_max_bytes=cfg.node.events_max_bytes)
        async with Node(buses["trainer"], head_actors, **kw) as head:
            nodes = [Node(buses[role], build_actors(cfg, [role], "default"), **kw)
                     for role in ("reward", "generate", "env")]
            for n in nodes:
                await n.start()
            ended = asyncio.ensure_future(wait_run_end(buses["env"], run))  # a node's KV watch
            watching = asyncio.ensure_future(top(buses["monitor"], run, refresh=0.5, duration=600))
            try:
                summary = await asyncio.wait_for(
                    drive_training(buses["trainer"], cfg, head, trainer, sched, pool="default"), 150)
                rec = await asyncio.wait_for(ended, 10)
            finally:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
                for n in reversed(nodes):
                    await n.stop_and_drain()
        assert summary["steps"] == 2 and not summary["interrupted"] and "failed" not in summary, summary
        assert summary["trajectories"] >= 1 and rec.stage == "ended" and rec.version == 2
        gen = next(a for a in nodes[1].actors if a.role == "generate")
        assert gen.version == 2, "the generate replica loaded the last version from the object store"
        store = await buses["trainer"].object_store(m.object_bucket(run))
        assert await store.get("v000002")
        if keep == 1:
            with pytest.raises(KeyError):  # keep_weights 1: older versions deleted (a filtered purge)
                await store.get("v000001")
        mon = await top(buses["monitor"], run, refresh=0.2, duration=0.5)  # after the end: KV state
        assert mon.run_end is not None and mon.run_end.stage == "ended" and mon.ledger.trained >= 2
        assert mon.streams.get("events", {}).get("messages", 0) > 0
    finally:
        for b in buses.values():
            await b.close()
    took = time.monotonic() - t0
    found = log.violations()
    assert not found, "permissions missing:\n" + "\n".join(found)
    assert not [e for b in buses.values() for e in b.errors if "permission" in e.lower()]
    print(f"run of 2 steps with 5 credentials ({scope}): {took:.1f}s", end=" ")
