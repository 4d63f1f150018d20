"""Authenticated, TLS connections to NATS: config forms, clear refusals that fail at once,
secure-by-default embedded servers, and secrets that never leak (messages, logs, files)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import yaml

from rollart.bus.auth import AuthError, connect_options, redact, resolve
from rollart.bus.connect import bus_from_config
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from rollart.bus.server_config import InsecureServerError
from rollart.config import ConfigError, RunConfig, convert
from rollart.config.schema import NatsConfig, NatsTlsConfig, nats_settings

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-Zq81-not-in-any-output"
WRONG = "pw-wrong-also-not-shown"
TOKEN = "tok-7781-never-printed"
SECRETS = (PASSWORD, WRONG, TOKEN)
FAST = 3.0
"""Seconds a refusal may take: far below the connect window (connect_timeout=20 here)."""


def no_secret(text: str) -> None:
    for s in SECRETS:
        assert s not in text, f"a secret leaked into: {text!r}"


# -- certificates (a CA and a server certificate for localhost / 127.0.0.1) -------------------


def _ca(d: Path, name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rollart test {name}")])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _server_cert(d: Path, ca) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (d / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "server-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


# -- servers ---------------------------------------------------------------------------------


USERS = f'authorization {{ users = [ {{user: a, password: "{PASSWORD}"}} ] }}\n'


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("secrets")
    (d / "pw").write_text(PASSWORD + "\n")
    (d / "wrong").write_text(WRONG + "\n")
    (d / "users.conf").write_text(USERS)
    ca = _ca(d, "ca")
    _ca(d, "other-ca")
    _server_cert(d, ca)
    (d / "tls.conf").write_text(
        USERS + f'tls {{ cert_file: "{d}/server.pem", key_file: "{d}/server-key.pem", '
                f'ca_file: "{d}/ca.pem" }}\n')
    return d


@pytest.fixture(scope="module")
def auth_server(secrets_dir, tmp_path_factory):
    with EmbeddedServer(tmp_path_factory.mktemp("auth-nats"), config_file=secrets_dir / "users.conf") as srv:
        yield srv


@pytest.fixture(scope="module")
def tls_server(secrets_dir, tmp_path_factory):
    with EmbeddedServer(tmp_path_factory.mktemp("tls-nats"), config_file=secrets_dir / "tls.conf") as srv:
        yield srv


async def _refused(bus: NatsBus) -> str:
    t0 = time.monotonic()
    with pytest.raises(AuthError) as info:
        await bus.connect()
    assert time.monotonic() - t0 < FAST, "a refusal must not be retried for the connect window"
    assert not bus.connected
    text = str(info.value)
    no_secret(text)
    no_secret(repr(info.value.__cause__))
    return text


# -- config ----------------------------------------------------------------------------------


def test_string_form_and_section_form(tmp_path):
    cfg = convert({"nats": "nats://head:4222"}, RunConfig)
    assert cfg.nats == "nats://head:4222"
    assert nats_settings(cfg) == NatsConfig(url="nats://head:4222")
    assert nats_settings(RunConfig()) == NatsConfig() and not NatsConfig().joins
    assert convert({"nats": "memory"}, RunConfig).nats == "memory"

    from rollart.app.launch import with_overrides

    assert with_overrides(cfg, nats="nats://other:4222").nats == "nats://other:4222"
    assert with_overrides(cfg, nats={"url": "nats://o:1", "user": "a", "password_env": "PW"}).nats.user == "a"

    path = tmp_path / "c.yaml"
    path.write_text("nats:\n  url: nats://head:4222\n  user: alice\n  password_file: /etc/pw\n"
                    "  tls: {ca: /etc/ca.pem}\n  listen: 0.0.0.0:4222\n  server_config: /etc/s.conf\n")
    from rollart.config import load

    ns = nats_settings(load(path, RunConfig))
    assert (ns.url, ns.user, ns.password_file, ns.tls.ca, ns.tls.verify) == (
        "nats://head:4222", "alice", "/etc/pw", "/etc/ca.pem", True)
    assert ns.listen_address() == ("0.0.0.0", 4222) and ns.joins
    assert NatsConfig(listen="[::1]:5").listen_address() == ("::1", 5)


@pytest.mark.parametrize("nats,key", [
    ({"user": "a", "password_file": "/pw", "token_env": "T"}, "nats.user/nats.password_file and nats.token_env"),
    ({"creds_file": "/c", "nkey_seed_file": "/s"}, "nats.nkey_seed_file and nats.creds_file"),
    ({"user": "a", "password_file": "/pw", "password_env": "PW"}, "nats.password_file and nats.password_env"),
    ({"password_file": "/pw"}, "nats.password_file needs nats.user"),
    ({"user": "a"}, "nats.user needs its password"),
    ({"url": "nats://a:1", "urls": ["nats://b:1"]}, "nats.url and nats.urls"),
    ({"tls": {"key": "/k"}}, "nats.tls.key needs nats.tls.cert"),
    ({"listen": "0.0.0.0:70000"}, "nats.listen"),
    ({"password_env": PASSWORD, "user": "a"}, "nats.password_env must be the name of an environment variable"),
])
def test_section_errors_name_the_key(nats, key):
    with pytest.raises(ConfigError) as info:
        convert({"nats": nats}, RunConfig)
    assert key in str(info.value)
    no_secret(str(info.value))


@pytest.mark.parametrize("nats", [f"nats://a:{PASSWORD}@head:4222", {"url": f"nats://{TOKEN}@head:4222"},
                                  {"urls": [f"tls://a:{PASSWORD}@h:1"]}])
def test_url_with_credentials_is_refused(nats):
    with pytest.raises(ConfigError) as info:
        convert({"nats": nats}, RunConfig)
    text = str(info.value)
    assert "holds credentials" in text and "password_file" in text and "password_env" in text
    no_secret(text)


def test_secret_sources_fail_clearly(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"nats\.password_file: cannot read .*missing"):
        connect_options(NatsConfig(user="a", password_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match=r"nats\.password_file: .* is empty"):
        connect_options(NatsConfig(user="a", password_file=str(tmp_path / "empty")))
    monkeypatch.delenv("ROLLART_TEST_PW", raising=False)
    with pytest.raises(ConfigError, match=r"nats\.password_env: the environment variable ROLLART_TEST_PW is not set"):
        connect_options(NatsConfig(user="a", password_env="ROLLART_TEST_PW"))
    with pytest.raises(ConfigError, match=r"nats\.creds_file: cannot read"):
        connect_options(NatsConfig(creds_file=str(tmp_path / "nope.creds")))
    with pytest.raises(ConfigError, match=r"nats\.tls\.ca: cannot read"):
        connect_options(NatsConfig(tls=NatsTlsConfig(ca=str(tmp_path / "nope.pem"))))
    # the bus a command builds fails the same way (no URL: also said)
    with pytest.raises(ConfigError, match=r"nats\.password_file"):
        bus_from_config(RunConfig(), url="nats://127.0.0.1:1",
                        overrides={"user": "a", "password_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="no nats-server URL"):
        bus_from_config(RunConfig())

    monkeypatch.setenv("ROLLART_TEST_PW", PASSWORD)
    opts = connect_options(NatsConfig(user="a", password_env="ROLLART_TEST_PW"))
    assert opts["user"] == "a" and opts["password"]() == PASSWORD
    no_secret(repr(opts) + str(opts))


def test_command_line_overrides_the_section(tmp_path):
    cfg = convert({"nats": {"url": "nats://head:4222", "token_env": "TOK", "tls": {"ca": "/ca"}}}, RunConfig)
    ns = resolve(cfg, {"user": "bob", "password_file": "/bob.pw", "tls_ca": "/mine.pem", "creds_file": None})
    assert (ns.user, ns.password_file, ns.token_env, ns.tls.ca, ns.url) == (
        "bob", "/bob.pw", None, "/mine.pem", "nats://head:4222")
    ns = resolve(cfg, {"creds_file": "/me.creds", "url": "nats://other:1"})
    assert (ns.creds_file, ns.token_env, ns.url) == ("/me.creds", None, "nats://other:1")
    with pytest.raises(ConfigError, match="holds credentials"):
        resolve(cfg, {"url": f"nats://a:{PASSWORD}@h:1"})
    with pytest.raises(ConfigError, match="nats.user needs its password"):
        resolve(RunConfig(), {"user": "bob"})


def test_redact():
    assert redact(f"nats://a:{PASSWORD}@h:4222") == "nats://a:***@h:4222"
    assert redact(f"tls://{TOKEN}@h:4222") == "tls://***@h:4222"
    assert redact("nats://h:4222") == "nats://h:4222"
    assert redact([f"nats://a:{PASSWORD}@h:1", "nats://g:2"]) == "nats://a:***@h:1,nats://g:2"
    bus = NatsBus(f"nats://a:{PASSWORD}@127.0.0.1:1")
    no_secret(bus.url)


# -- refusals and the right credentials ------------------------------------------------------


def _bus(server, secrets_dir, **ns) -> NatsBus:
    return bus_from_config(msgspec.convert(ns, NatsConfig), url=server.url, connect_timeout=20,
                           name="auth-test")


async def test_refused_clients_fail_at_once_with_a_clear_error(auth_server, secrets_dir, caplog):
    caplog.set_level(logging.DEBUG)
    text = await _refused(_bus(auth_server, secrets_dir))
    assert text.startswith(f"authentication failed at {auth_server.url}: the server requires credentials")
    assert "--user NAME --password-file FILE" in text

    text = await _refused(_bus(auth_server, secrets_dir, user="a", password_file=str(secrets_dir / "wrong")))
    assert text.startswith(f"authentication failed for user 'a' at {auth_server.url}")
    assert f"check nats.password_file {secrets_dir / 'wrong'}" in text

    text = await _refused(_bus(auth_server, secrets_dir, user="mallory", password_file=str(secrets_dir / "pw")))
    assert text.startswith(f"authentication failed for user 'mallory' at {auth_server.url}")

    os.environ["ROLLART_TEST_TOKEN"] = TOKEN
    try:
        text = await _refused(_bus(auth_server, secrets_dir, token_env="ROLLART_TEST_TOKEN"))
    finally:
        del os.environ["ROLLART_TEST_TOKEN"]
    assert "refused the token" in text and "nats.token_env ROLLART_TEST_TOKEN" in text
    no_secret(caplog.text)


async def test_a_node_does_not_wait_for_a_server_that_refuses_it(auth_server, secrets_dir):
    from rollart.app.node import _connect_patiently

    bus = _bus(auth_server, secrets_dir, user="a", password_file=str(secrets_dir / "wrong"))
    t0 = time.monotonic()
    with pytest.raises(AuthError, match="authentication failed for user 'a'"):
        await _connect_patiently(bus, wait_s=60)
    assert time.monotonic() - t0 < FAST


async def test_right_credentials_connect_and_carry_messages(auth_server, secrets_dir, caplog):
    caplog.set_level(logging.DEBUG)
    bus = _bus(auth_server, secrets_dir, user="a", password_file=str(secrets_dir / "pw"))
    async with bus:
        got: asyncio.Queue = asyncio.Queue()

        async def handler(req):
            await got.put(req.data)

        sub = await bus.subscribe("auth.test", handler)
        await bus.publish_core("auth.test", b"hello")
        assert await asyncio.wait_for(got.get(), 5) == b"hello"
        await sub.unsubscribe()
        from rollart.bus import Retention, StreamSpec

        await bus.ensure_stream(StreamSpec(name="AUTHTEST", subjects=["authjs.>"], retention=Retention.LIMITS))
        assert await bus.publish("authjs.x", b"1") >= 1
        no_secret(repr(bus.auth) + repr(vars(bus)))
    no_secret(caplog.text)


# -- TLS -------------------------------------------------------------------------------------


async def test_tls_with_the_right_ca_connects(tls_server, secrets_dir):
    up = {"user": "a", "password_file": str(secrets_dir / "pw")}
    for local in (False, True):  # by 127.0.0.1 (an IP in the certificate), or as "localhost"
        bus = bus_from_config(NatsConfig(**up, tls=NatsTlsConfig(ca=str(secrets_dir / "ca.pem"))),
                              url=tls_server.url, local=local)
        async with bus:
            # white-box: only the raw client's socket shows that TLS is on
            assert bus._nc._transport._io_writer.get_extra_info("ssl_object") is not None
            await bus.publish_core("tls.test", b"x")


async def test_tls_refusals(tls_server, auth_server, secrets_dir, caplog):
    caplog.set_level(logging.DEBUG)
    up = {"user": "a", "password_file": str(secrets_dir / "pw")}
    # a CA that did not sign the server's certificate
    text = await _refused(_bus(tls_server, secrets_dir, **up, tls={"ca": str(secrets_dir / "other-ca.pem")}))
    assert text.startswith(f"TLS: server certificate not trusted (nats.tls.ca {secrets_dir / 'other-ca.pem'})")
    # a plaintext client (no tls settings): the server requires TLS, the system CAs do not trust it
    text = await _refused(_bus(tls_server, secrets_dir, **up))
    assert text.startswith("TLS: server certificate not trusted (nats.tls.ca)") and "requires TLS" in text
    text = await _refused(bus_from_config(None, url=tls_server.url, connect_timeout=20))
    assert "TLS: server certificate not trusted" in text
    # TLS configured, but the server does not switch to TLS: the password is never sent
    text = await _refused(_bus(auth_server, secrets_dir, **up, tls={"ca": str(secrets_dir / "ca.pem")}))
    assert "does not require TLS, so the credentials were not sent" in text
    no_secret(caplog.text)


# -- secure by default -----------------------------------------------------------------------


def test_embedded_server_refuses_to_listen_beyond_loopback_without_auth(tmp_path, secrets_dir):
    with pytest.raises(InsecureServerError) as info:
        EmbeddedServer(tmp_path / "a", "0.0.0.0").start()
    text = str(info.value)
    assert "rollart secure init DIR --host NAME" in text and "--server-config DIR/server.conf" in text
    plain = tmp_path / "plain.conf"
    plain.write_text("# authorization { users = [] }\nmax_payload: 1MB\n")
    with pytest.raises(InsecureServerError, match="does not make clients authenticate"):
        EmbeddedServer(tmp_path / "b", "0.0.0.0", config_file=plain).start()
    with pytest.raises(ValueError, match="does not exist"):
        EmbeddedServer(tmp_path / "c", config_file=tmp_path / "missing.conf").start()
    assert not (tmp_path / "a").exists(), "refused before anything was started or written"


async def test_embedded_server_on_every_interface_with_users(tmp_path, secrets_dir):
    srv = EmbeddedServer(tmp_path / "n", "0.0.0.0", config_file=secrets_dir / "users.conf")
    await asyncio.to_thread(srv.start)
    try:
        assert srv.url.startswith("nats://127.0.0.1:")  # this host connects by loopback
        bus = _bus(srv, secrets_dir, user="a", password_file=str(secrets_dir / "pw"))
        async with bus:
            assert bus.connected
        await _refused(_bus(srv, secrets_dir))
    finally:
        await asyncio.to_thread(srv.stop)


def _node(tmp_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    cfg = tmp_path / "node.yaml"
    cfg.write_text(f"run: sec\nrun_dir: {tmp_path / 'runs'}\nrollout: {{service_wait: 60}}\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "rollart.node", "--config", str(cfg),
                           "--roles", "scheduler", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_node_refuses_an_open_listen_address(tmp_path):
    out = _node(tmp_path, "--listen", "0.0.0.0:0")
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "refusing to start nats-server listening on 0.0.0.0" in text
    assert "rollart secure init DIR --host NAME" in text
    assert not (tmp_path / "runs").exists()


def test_node_with_a_wrong_password_exits_at_once(tmp_path, auth_server, secrets_dir):
    t0 = time.monotonic()
    out = _node(tmp_path, "--nats", auth_server.url, "--user", "a", "--password-file",
                str(secrets_dir / "wrong"))
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert f"rollart node: error: authentication failed for user 'a' at {auth_server.url}" in text
    assert "waiting for the nats-server" not in text
    assert time.monotonic() - t0 < 20  # not rollout.service_wait (60 s)
    no_secret(text)


def test_top_with_a_wrong_password_exits_2(auth_server, secrets_dir, capsys):
    from rollart.app.cli import main

    rc = main(["top", "--nats", auth_server.url, "--run", "r", "--user", "a",
               "--password-file", str(secrets_dir / "wrong"), "--duration", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "authentication failed for user 'a'" in err
    no_secret(err)


# -- no secret in files or command output ------------------------------------------------------


def test_no_secret_in_run_config_or_config_output(tmp_path, secrets_dir, capsys, monkeypatch):
    from rollart.app.cli import main
    from rollart.app.launch import write_config

    monkeypatch.setenv("ROLLART_TEST_PW", PASSWORD)
    path = tmp_path / "secure.yaml"
    path.write_text(yaml.safe_dump({
        "run": "sec", "run_dir": str(tmp_path / "runs"),
        "nats": {"url": "nats://head:4222", "user": "a", "password_env": "ROLLART_TEST_PW",
                 "tls": {"ca": str(secrets_dir / "ca.pem")}}}))
    assert main(["config", str(path), "--static"]) == 0
    out = capsys.readouterr()
    no_secret(out.out + out.err)

    from rollart.config import load

    cfg = load(path, RunConfig)
    written = write_config(cfg).read_text()
    no_secret(written)
    back = yaml.safe_load(written)["nats"]
    assert back["password_env"] == "ROLLART_TEST_PW" and back["user"] == "a"
    assert nats_settings(load(Path(tmp_path / "runs" / "sec" / "config.yaml"), RunConfig)) == nats_settings(cfg)
    # the live options hold the password only behind a callable that never prints it
    no_secret(repr(connect_options(nats_settings(cfg))))
    no_secret(repr(msgspec.to_builtins(cfg)))
