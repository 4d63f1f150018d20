"""`rollart cluster sites` on loopback (real nats-servers): the hub and a site's leaf server
start from the configs it writes; a client of the site reaches the hub's JetStream through
``nats.domain`` (streams, KV writes and reads, object store), a client without it gets an
error that names the fix; the hub's ``/leafz`` lists the site (``rollart nodes
--hub-monitor``). Bad input is refused with the flag named."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from rollart.app.cli import main as rollart_main
from rollart.app.nodes import leaf_links
from rollart.bus import BusError, StreamSpec
from rollart.bus.nats import NatsBus
from rollart.bus.server import find_binary
from rollart.config import ConfigError
from rollart.config.nats import NatsConfig
from rollart.deploy.sites import sites_init
from tests.deploy.test_cluster import _free_run
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("sites, kw, needle", [
    ([], {}, "at least one --site"),
    (["Gpu"], {}, "--site 'Gpu'"),
    (["hubx"], {}, "'hub'"),
    (["a", "a"], {}, "must differ"),
    (["a@h1", "b"], {"hub_host": "h"}, "every --site a host"),
    (["a@h1"], {}, "--hub HOST"),
    (["a"], {"domain": "x.y"}, "--domain"),
    (["a", "b"], {"client_port": 7421}, "overlap"),
])
def test_bad_sites_are_refused_naming_the_flag(tmp_path, sites, kw, needle):
    with pytest.raises(ValueError, match=None) as e:
        sites_init(tmp_path / "s", sites, **kw)
    assert needle in str(e.value), e.value


def test_cli_writes_hub_and_site_configs(tmp_path, capsys):
    assert rollart_main(["cluster", "sites", str(tmp_path / "s"), "--hub", "head", "--site",
                         "gpu@g1", "--site", "cpu@c1"]) == 0
    hub = (tmp_path / "s" / "hub.conf").read_text()
    gpu = (tmp_path / "s" / "site-gpu.conf").read_text()
    assert 'domain: "hub"' in hub and "leafnodes" in hub and "authorization" in hub
    assert "jetstream" not in gpu and "nats-leaf://leaf:" in gpu and "@head:7422" in gpu
    assert "--js-domain hub" in (tmp_path / "s" / "README.txt").read_text()
    assert rollart_main(["cluster", "sites", str(tmp_path / "s"), "--site", "x"]) == 2
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nats.domain"):
        NatsConfig(url="nats://h:4222", domain="a.b")


async def test_a_site_client_reaches_the_hubs_jetstream_by_domain(tmp_path):
    base = _free_run(3)  # clients base, base+1; leaf base+1000; monitoring base+1001, +1002
    made = sites_init(tmp_path / "s", ["gpu"], client_port=base, leaf_port=base + 1000,
                      monitor_port=base + 1001)
    binary = find_binary()
    procs = [subprocess.Popen([binary, "-c", conf], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for conf in (made["hub"]["conf"], made["sites"][0]["conf"])]
    try:
        mon = made["hub"]["monitor_url"]
        await until(lambda: asyncio.to_thread(_linked, mon), deadline=30, step=0.05, what="the site linked")
        url = made["sites"][0]["url"]
        plain = NatsBus(url)
        await plain.connect()
        try:
            with pytest.raises(BusError, match="nats.domain"):
                await plain.ensure_stream(StreamSpec(name="SITE_T", subjects=["site.t.>"]))
        finally:
            await plain.close()
        bus = NatsBus(url, domain=made["domain"])
        await bus.connect()
        try:
            assert bus.server_name == "gpu"
            await bus.ensure_stream(StreamSpec(name="SITE_T", subjects=["site.t.>"]))

            async def published():
                try:
                    return await bus.publish("site.t.a", b"x", msg_id="1")
                except BusError:  # the stream's interest reaches the site a moment later
                    return None

            assert await until(published, deadline=10, step=0.05, what="a publish stored") == 1
            kv = await bus.key_value("SITE_KV")
            assert await kv.put("k", b"v") >= 1
            assert (await kv.get("k")).value == b"v"
            await kv.delete("k")
            assert await kv.get("k") is None
            obs = await bus.object_store("SITE_OBJ")
            await obs.put("blob", b"y" * 2_500_000)  # chunked: several messages over the link
            assert await obs.get("blob") == b"y" * 2_500_000
        finally:
            await bus.close()
        links = await asyncio.to_thread(leaf_links, mon)
        assert set(links) == {"gpu"} and links["gpu"]["in_bytes"] > 2_500_000, links
        with pytest.raises(ConfigError, match="--hub-monitor"):
            leaf_links("hub:8222")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def _linked(mon: str) -> bool:
    try:
        return bool(leaf_links(mon, timeout=1))
    except ConfigError:
        return False


async def test_secure_sites_take_the_users_with_permissions_for_the_domain(tmp_path):
    """`--secure`: the site's server requires TLS and the users of `rollart secure init`; the
    trainer's credential writes its KV key through the domain at the site, the env's may not
    (least privilege holds across the link), and the leaf link itself is TLS."""
    pytest.importorskip("bcrypt")
    pytest.importorskip("cryptography")
    from rollart import messages as m
    from rollart.bus.connect import bus_from_config
    from rollart.security.init import secure_init

    run = "sitesec"
    creds = tmp_path / "creds"
    secure_init(creds, ["127.0.0.1"], ["trainer", "env"], run=run)
    base = _free_run(3)
    made = sites_init(tmp_path / "s", ["gpu"], client_port=base, leaf_port=base + 1000,
                      monitor_port=base + 1001, secure=creds)
    hub_text = open(made["hub"]["conf"]).read()
    assert f"$JS.{made['domain']}.API.$KV.{m.kv_bucket(run)}.{m.POLICY_KEY}" in hub_text
    binary = find_binary()
    procs = [subprocess.Popen([binary, "-c", conf], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for conf in (made["hub"]["conf"], made["sites"][0]["conf"])]
    try:
        mon = made["hub"]["monitor_url"]
        await until(lambda: asyncio.to_thread(_linked, mon), deadline=30, step=0.05,
                    what="the site linked over TLS")

        def bus(user: str):
            return bus_from_config({"url": made["sites"][0]["url"], "user": user,
                                    "password_file": str(creds / f"{user}.password"),
                                    "tls": {"ca": str(creds / "ca.pem")},
                                    "domain": made["domain"]}, connect_timeout=3)

        trainer = bus("trainer")
        await trainer.connect()
        try:
            kv = await trainer.key_value(m.kv_bucket(run))
            assert await kv.put(m.POLICY_KEY, b"v1") >= 1
            assert (await kv.get(m.POLICY_KEY)).value == b"v1"
        finally:
            await trainer.close()
        env = bus("env")
        await env.connect()
        try:
            kv = await env.key_value(m.kv_bucket(run))
            assert (await kv.get(m.POLICY_KEY)).value == b"v1"  # reads: yes
            with pytest.raises(BusError):
                await kv.put(m.POLICY_KEY, b"forged")  # writes: the trainer's key, denied
            assert (await kv.get(m.POLICY_KEY)).value == b"v1"
        finally:
            await env.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
