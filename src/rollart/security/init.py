"""``rollart secure init``: a CA, a server certificate, one password per role, the server config.

Everything is written into one folder (keys and passwords 0600)::

    ca.pem ca.key            the CA (ca.key stays with the operator: it signs new certificates)
    server.pem server.key    the server's certificate (SANs: --host names, localhost, 127.0.0.1)
    <role>.password          one random password per role (the server holds only bcrypt hashes)
    server.conf              nats-server config: TLS, users and their permissions
    secure.json              what was generated (users, run, hosts; no secrets): `rollart secure show`
    README.txt               which file goes to which host
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import secrets
from pathlib import Path

from rollart.security.permissions import ROLES, expand, role_permissions, server_config

MANIFEST = "secure.json"
BCRYPT_COST = 11
_MISSING = "rollart secure needs `cryptography` and `bcrypt`: pip install 'rollart[secure]'"


def _deps():
    try:
        import bcrypt  # optional: the secure extra
        from cryptography import x509  # optional: the secure extra
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec  # optional: the secure extra
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # optional: the secure extra
    except ImportError as e:
        raise RuntimeError(f"{_MISSING} ({e})") from None
    return bcrypt, x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def user_name(role: str) -> str:
    """The NATS user of a role (or of several joined with ','): ``env,generate`` -> ``env+generate``."""
    return "+".join(r.strip() for r in role.replace("+", ",").split(",") if r.strip())


def _write(path: Path, data: bytes, secret: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600 if secret else 0o644)  # an existing file keeps its mode otherwise


def _san(host: str, x509):
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _certs(hosts: list[str]):
    """(ca_pem, ca_key_pem, server_pem, server_key_pem)."""
    _, x509, hashes, serialization, ec, EKU, NameOID = _deps()
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollart CA"),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rollart")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + dt.timedelta(days=3652))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = list(dict.fromkeys([*hosts, "localhost", "127.0.0.1"]))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=730))
            .add_extension(x509.SubjectAlternativeName([_san(h, x509) for h in names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    raw = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8,
               encryption_algorithm=serialization.NoEncryption())
    return (ca.public_bytes(pem), ca_key.private_bytes(**raw),
            cert.public_bytes(pem), key.private_bytes(**raw))


def hash_password(password: str, cost: int = BCRYPT_COST) -> str:
    """A bcrypt hash nats-server accepts as a password (``$2a$`` or ``$2b$``)."""
    bcrypt = _deps()[0]
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost)).decode()


def secure_init(dir: str | os.PathLike, hosts: list[str], roles: list[str] | tuple[str, ...] = ROLES,
                run: str = "*", *, force: bool = False, listen: str = "0.0.0.0:4222",
                store_dir: str | None = None, admin: bool = True) -> dict:
    """Write the folder described in this module's docstring; return its manifest.

    ``roles``: one credential each (a role, or several joined with ','); ``admin``: also an
    ``admin`` user with every permission (deleting streams, operations). ``run``: ``*`` or a
    run name to pin the credentials to. ``store_dir``: JetStream's folder in the config (None:
    none, so that the config also serves an embedded server, which gives ``-sd`` itself;
    nats-server refuses a store in both places). Refuses a non-empty folder unless ``force``."""
    _deps()
    out = Path(dir).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty: it may hold credentials in use; "
                         "choose another folder or pass --force to overwrite")
    hosts = [h.strip() for h in hosts if h and h.strip()]
    if not hosts:
        raise ValueError("give at least one --host: the name (or address) nodes use to reach the server")
    users = list(dict.fromkeys(user_name(r) for r in roles))
    for u in users:
        expand(u)  # unknown roles fail before anything is written
    perms = {u: role_permissions(u.replace("+", ","), run) for u in users}
    if admin and "admin" not in perms:
        perms["admin"] = role_permissions("admin")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    for stale in out.glob("*.password"):  # --force: no credential of the old set survives
        stale.unlink()
    ca_pem, ca_key, srv_pem, srv_key = _certs(hosts)
    _write(out / "ca.pem", ca_pem, secret=False)
    _write(out / "ca.key", ca_key, secret=True)
    _write(out / "server.pem", srv_pem, secret=False)
    _write(out / "server.key", srv_key, secret=True)
    entries = []
    for u, p in perms.items():
        password = secrets.token_urlsafe(32)
        _write(out / f"{u}.password", (password + "\n").encode(), secret=True)
        entries.append({"user": u, "password": hash_password(password), "permissions": p})
    conf = server_config(entries, cert_file=str(out / "server.pem"), key_file=str(out / "server.key"),
                         ca_file=str(out / "ca.pem"), listen=listen,
                         store_dir=store_dir)
    _write(out / "server.conf", conf.encode(), secret=True)  # hashes: not for every eye either
    manifest = {"run": run, "hosts": hosts, "listen": listen,
                "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "users": {u: {"password_file": f"{u}.password", "permissions": p} for u, p in perms.items()}}
    _write(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode(), secret=False)
    _write(out / "README.txt", _readme(out, hosts, list(perms), run, listen).encode(), secret=False)
    return manifest


def _readme(out: Path, hosts: list[str], users: list[str], run: str, listen: str) -> str:
    port = listen.rsplit(":", 1)[-1]
    scope = "any run" if run == "*" else f"run {run!r} only"
    return f"""rollart credentials, written by `rollart secure init` ({scope}).

The nats-server host ({', '.join(hosts)}):
  server.conf, server.pem, server.key, ca.pem
  start it with:  nats-server -c {out / 'server.conf'} -sd /path/to/jetstream-store
  or let the node that hosts the run's embedded server use it:
    python -m rollart.node ... --listen {listen} --server-config {out / 'server.conf'}
  (server.conf names these files by absolute path: copy them to the same folder there,
  or edit the paths.)

Every node host:
  ca.pem (to check the server's certificate), and the password file of the role it runs:
{chr(10).join(f'    {u}.password  -> user "{u}"' for u in users if u != "admin")}
  The URL is nats://{hosts[0]}:{port} (TLS is required by the server). In the run config:
    nats: {{url: "nats://{hosts[0]}:{port}", user: env, password_file: /path/to/env.password,
           tls: {{ca: /path/to/ca.pem}}}}
  A host running several roles with one connection needs a credential for all of them:
  `rollart secure init --role env,generate,reward ...` makes user "env+generate+reward".

Keep off every host but the operator's: ca.key (it signs certificates), admin.password
(deletes streams). Keep password files 0600. `rollart secure show {out}` lists the users
and what each may do, without secrets.
"""
