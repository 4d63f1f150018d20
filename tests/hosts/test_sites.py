"""A run across a hub and two leaf-node sites, each in its own network namespace.

The hub (h1) runs the JetStream nats-server of ``rollart cluster sites`` and the head node
(trainer, scheduler). Site ``gen`` (h2) has a leaf nats-server without JetStream and a
generate node; site ``env`` (h3) a leaf server and an env+reward node. Site nodes join their
own site's server with ``--js-domain``: every JetStream call crosses the link, core traffic
between two clients of one site (reward requests) stays there.

- the quickstart-sized run finishes over the leaf links; the hub's trace says which subjects
  crossed each link and how many bytes a step cost (printed); reward requests never crossed;
- kill -9 of site env's leaf server after step 1, restarted: the site's node reconnects by
  itself, the run finishes, every admitted trajectory is accounted for and none trained twice;
- site ``gen`` with a weight relay (``--roles relay --site gen``) and two generate replicas
  (``--site gen``): every version they load comes from the relay (``policy.loaded``'s route),
  and the relay fetched each version once over the link;
- that site's link shaped to 1 MB/s (``tc tbf``) and cut for 10 s (a black hole) while its
  relay fetches v1, then mended: lag, not a loss; the generators wait for the relay and
  load every version from it, each crossed the link once;
- the packaged quickstart (configs/quickstart.yaml as it is: its model, env, rollout, trainer,
  steps and seeds) across the hub and both sites, site gen reading weights through its relay,
  learns: tests/e2e/test_learning.py's assertions on the head's ``summary.json`` (its final
  greedy evaluation) and ``metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.actors.sample_actors import new_run
from tests.e2e.test_learning import check_learned
from tests.hosts.sites import Sites
from tests.hosts.test_many_hosts import (
    check_accounting, check_steps, logs, metrics_rows, run_record, wait_exit, wait_step,
    write_config,
)
from tests.waiting import until

# in `make test-scale` (five runs of ~40-60 s and the packaged quickstart's 2-6 min, on the
# worker beside the learning runs);
# tests/deploy/test_sites.py checks the configs, the domain and the permissions in `make test`
pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.scale]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def site_node(host, cfg, roles: str, url: str, domain: str, name: str | None = None,
              extra: tuple[str, ...] = ()):
    """``python -m rollart.node`` joining ``url`` (a site's server, or the hub) in ``host``'s
    namespace, naming the hub's JetStream domain as a site's node does."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "rollart.node", "--config", cfg, "--roles", roles,
            "--nats", url, "--js-domain", domain, *extra]
    return host.run(argv, name or roles.replace(",", "+"), env=env, cwd=cfg.parent)


async def start_sites(hosts, tmp_path, *, trace: bool = False, secure: bool = False):
    h = hosts(3)
    hub_h, gen_h, env_h = list(h)
    creds = None
    if secure:
        from rollart.security.init import secure_init

        creds = tmp_path / "creds"
        secure_init(creds, [x.addr for x in h], ["trainer", "generate", "env,reward"])
    sites = Sites(hub_h, {"gen": gen_h, "env": env_h}, tmp_path / "sites", trace=trace,
                  secure=creds)
    sites.start()
    link_s = await sites.wait_linked()
    return sites, hub_h, gen_h, env_h, link_s


def quickstart_config(tmp_path, urls: list[str], **infra) -> tuple[Path, str]:
    """configs/quickstart.yaml as packaged (model, envs, rollout, trainer: its steps and
    seeds), with only where it runs changed: the run's name and folder, ``infra``'s sections
    (``nats``, ``node``)."""
    cfg = yaml.safe_load((Path(ROOT) / "configs" / "quickstart.yaml").read_text())
    run = new_run()
    cfg.update(run=run, run_dir=str(tmp_path / "runs"), **infra)
    cfg["nats"] = {"urls": list(urls), **cfg.get("nats", {})}
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, run


async def start_run(sites, tmp_path, tiny_model, hub_h, gen_h, env_h, creds=None,
                    relay: bool = False, recipe: bool = False, **extra):
    """The run's nodes: the head at the hub, generate (and with ``relay`` site gen's weight
    relay) at site gen, env+reward at site env. The config is write_config's small one, or
    with ``recipe`` the packaged quickstart as it is (:func:`quickstart_config`)."""
    nats = {"domain": sites.domain, **({"tls": {"ca": str(creds / "ca.pem")}} if creds else {})}
    if recipe:
        cfg, run = quickstart_config(tmp_path, [sites.hub_url], node={"stream_replicas": 1},
                                     nats=nats, **extra)
    else:
        cfg, run = write_config(tmp_path, tiny_model, [sites.hub_url],
                                node={"stream_replicas": 1}, nats=nats, **extra)

    def login(user):
        return ("--user", user, "--password-file", str(creds / f"{user}.password")) if creds else ()

    head = site_node(hub_h, cfg, "trainer,scheduler", sites.hub_url, sites.domain,
                     extra=login("trainer"))
    await head.line_with("serving trainer", 90)
    at_gen = ("--site", "gen") if relay else ()
    procs = [head, site_node(gen_h, cfg, "generate", sites.url("gen"), sites.domain,
                             extra=(*login("generate"), *at_gen)),
             site_node(env_h, cfg, "env,reward", sites.url("env"), sites.domain,
                       extra=login("env+reward"))]
    if relay:  # site gen's weight relay, on its own node (a generate credential)
        procs.append(site_node(gen_h, cfg, "relay", sites.url("gen"), sites.domain,
                               extra=(*login("generate"), *at_gen)))
    return cfg, run, head, procs


def link_bytes(sites: Sites) -> dict[str, int]:
    return {name: leaf["in_bytes"] + leaf["out_bytes"] for name, leaf in sites.leafz().items()}


async def test_run_across_two_leaf_sites(tmp_path, tiny_model, hosts):
    t0 = time.monotonic()
    sites, hub_h, gen_h, env_h, link_s = await start_sites(hosts, tmp_path, trace=True)
    cfg, run, head, procs = await start_run(sites, tmp_path, tiny_model, hub_h, gen_h, env_h)
    # rollart nodes, from the hub's host: each node's site, and the sites' links. It listens
    # from the start of the run for long enough to hear every node come up: a short listen
    # after a step raced the run's end on a loaded CI host (ci51, ci52: no heartbeat heard)
    lister = asyncio.create_task(asyncio.to_thread(
        hub_h.exec, sys.executable, "-m", "rollart", "nodes", "--nats", sites.hub_url, "--run",
        run, "--wait", "40", "--json", "--hub-monitor", sites.made["hub"]["monitor_url"],
        timeout=120))
    try:
        await wait_step(tmp_path, run, 1, head, procs)
        r = await lister
    finally:
        if not lister.done():
            lister.cancel()
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert {n["server"]: sorted(n["roles"]) for n in listed["nodes"]} == {
        "hub": ["scheduler", "trainer"], "gen": ["generate"], "env": ["env", "reward"]}, listed
    assert set(listed["sites"]) == {"gen", "env"}, listed["sites"]
    assert all(link["in_bytes"] > 0 and link["out_bytes"] > 0 for link in listed["sites"].values())
    await wait_exit(procs, 150)
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    rec = await run_record([sites.hub_url], run)
    counts = check_accounting(rec, rows)
    assert rec["completed"] and {lo.pool for lo in rec["loaded"]}, rec["loaded"]

    leafz = sites.leafz()
    crossed = sites.crossings()
    steps = rows[-1]["step"]
    # the env site's reward requests were answered at the site: none crossed either link
    for key, kinds in crossed.items():
        assert "reward.request" not in kinds, (key, kinds)
    # ...while its generate requests had to cross (the generators are at the other site)
    assert crossed["env up #"]["generate.request"] + crossed["env up #"]["generate.direct"] > 0
    assert crossed["gen down #"]["generate.request"] + crossed["gen down #"]["generate.direct"] > 0
    # every JetStream call of a site crossed: the env site fetched its work from the hub
    assert crossed["env up #"]["js-api:CONSUMER.MSG.NEXT"] > 0, crossed["env up #"]
    per_step = {n: (leaf["in_bytes"] + leaf["out_bytes"]) // steps for n, leaf in leafz.items()}
    print(f"[sites] run over two leaf sites: {time.monotonic() - t0:.1f}s; sites linked in "
          f"{link_s:.2f}s; {counts}")
    print(f"[sites] link bytes per step (both ways, /leafz): {per_step}; "
          f"rtt {[(n, leaf['rtt']) for n, leaf in leafz.items()]}")
    for key in sorted(k for k in crossed if not k.endswith("#")):
        kinds = crossed[key]
        msgs = crossed[key + " #"]
        top = ", ".join(f"{k} {msgs[k]}/{v}B" for k, v in kinds.most_common())
        print(f"[sites] {key}: {top}")


async def test_site_server_kill9_mid_run_loses_nothing(tmp_path, tiny_model, hosts):
    t0 = time.monotonic()
    sites, hub_h, gen_h, env_h, _ = await start_sites(hosts, tmp_path)
    cfg, run, head, procs = await start_run(sites, tmp_path, tiny_model, hub_h, gen_h, env_h)
    env_node = procs[2]
    await wait_step(tmp_path, run, 1, head, procs)
    step_at_kill = metrics_rows(tmp_path, run)[-1]["step"]
    before = {"env": sites.leafz()["env"]["id"]}
    sites.kill("env")
    t_kill = time.monotonic()
    sites.start("env")
    relink_s = await sites.wait_linked(["env"], not_ids=before)
    await env_node.line_with("reconnected", 60)
    node_back_s = time.monotonic() - t_kill
    await wait_exit(procs, 150)
    assert step_at_kill < 3, "the kill came after the last step: it proves nothing"
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    rec = await run_record([sites.hub_url], run)
    counts = check_accounting(rec, rows)
    print(f"[sites] env site's server kill -9 at step {step_at_kill}: run {time.monotonic() - t0:.1f}s; "
          f"leaf relinked {relink_s:.2f}s after the restart; the node reconnected "
          f"{node_back_s:.2f}s after the kill; {counts}; {logs([])}")


async def test_secure_sites_run_with_each_role_its_own_user(tmp_path, tiny_model, hosts):
    """``cluster sites --secure``: TLS and ``rollart secure``'s users on the hub and both
    sites, leaf links under TLS; each node logs in as its role at its site and the run
    finishes (the permissions, made for the domain, allow each role what it does there),
    site gen's weight relay included (a generate user: its KV record, TLS pinned by it)."""
    pytest.importorskip("bcrypt")
    t0 = time.monotonic()
    sites, hub_h, gen_h, env_h, link_s = await start_sites(hosts, tmp_path, secure=True)
    creds = tmp_path / "creds"
    cfg, run, head, procs = await start_run(sites, tmp_path, tiny_model, hub_h, gen_h, env_h,
                                            creds=creds, relay=True)
    await wait_exit(procs, 150)
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    # site gen's relay, logged in as generate, wrote its KV record and served TLS (pinned)
    assert "relay gen: v" in procs[-1].output() and " mirrored (" in procs[-1].output(), \
        logs(procs)
    assert "not site gen's relay" not in procs[1].output(), procs[1].output()[-3000:]
    assert "cleartext" not in procs[-1].output() and "TLS, certificate" in procs[-1].output()
    trained = [t for r in rows for t in r["traj_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory trained twice"
    bad = [p.log.name for p in procs if "permissions violation" in p.output().lower()]
    assert not bad, f"a role was refused something it does: {bad}\n{logs(procs)}"
    print(f"[sites] secure run over two leaf sites: {time.monotonic() - t0:.1f}s; linked over "
          f"TLS in {link_s:.2f}s; trained {len(trained)}")


async def test_gen_site_reads_each_version_from_its_relay(tmp_path, tiny_model, hosts):
    t0 = time.monotonic()
    sites, hub_h, gen_h, env_h, _ = await start_sites(hosts, tmp_path)
    cfg, run, head, procs = await start_run(sites, tmp_path, tiny_model, hub_h, gen_h, env_h,
                                            relay=True, actors={"generate": {"replicas": 2}})
    await wait_exit(procs, 150)
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    rec = await run_record([sites.hub_url], run)
    counts = check_accounting(rec, rows)
    loads = [lo for lo in rec["loaded"] if not lo.error]
    assert loads and {lo.route for lo in loads} == {"relay"}, [(lo.replica, lo.version, lo.route)
                                                            for lo in rec["loaded"]]
    relay_log = procs[-1].output()
    mirrored = [ln for ln in relay_log.splitlines() if " mirrored (" in ln]
    versions = sorted({lo.version for lo in loads})
    assert len(mirrored) <= len(versions) + 1, mirrored  # each version once (v0 maybe unloaded)
    print(f"[sites] gen site with a relay: {time.monotonic() - t0:.1f}s; {counts}; "
          f"{len(loads)} loads by {len({lo.replica for lo in loads})} replicas of versions "
          f"{versions}, all from the relay; link bytes {link_bytes(sites)}; relay: "
          + "; ".join(ln.split("relay gen: ")[-1] for ln in mirrored))


LINK_RATE = "8mbit"
"""Site gen's link to the hub, both ways (``tc tbf``): 1 MB/s, so a version of the tiny
model (~1.9 MiB, ~2.8 MiB with its anchor) takes seconds to cross."""
OUTAGE_S = 10.0
"""Seconds site gen's link is cut. A black hole this long stalls the relay's TCP fetch of
v1 in the sender's retransmission backoff (0.2 s doubling: ~0.2, 0.6, 1.4, 3, 6.2, 12.6 s
after the first lost segment), so the transfer resumes ~2.5 s after the mend; 12 s would
fall next to the 12.6 s retransmission and resume either then or at ~25 s (v1 whole 3.4 or
13.4 s after the mend, measured), near the generators' ``relay_wait`` of 30 s."""


async def test_gen_site_link_cut_mid_transfer_costs_lag_not_correctness(tmp_path, tiny_model,
                                                                        hosts):
    """Site gen (weight relay, two generate replicas) behind a 1 MB/s link, cut for
    ``OUTAGE_S`` while its relay fetches v1 (a black hole: packets dropped both ways, no
    error), then mended: the run finishes every step, nothing lost, nothing trained twice;
    the leaf link carries site gen's messages again; versions after the cut are loaded from
    the relay, which mirrored each version once, and nothing else of the weights crossed."""
    t0 = time.monotonic()
    sites, hub_h, gen_h, env_h, _ = await start_sites(hosts, tmp_path)
    gen_h.shape(LINK_RATE)
    cfg, run, head, procs = await start_run(sites, tmp_path, tiny_model, hub_h, gen_h, env_h,
                                            relay=True, actors={"generate": {"replicas": 2}})
    relay = procs[-1]
    await wait_step(tmp_path, run, 1, head, procs)
    # v1 is published after step 1's row: cut once its transfer to the site is under way
    # (256 KiB more than the turns' trickle went down the link) and before it is whole
    sent = gen_h.tx_to()
    await until(lambda: gen_h.tx_to() - sent > 256 * 1024, deadline=60, step=0.02,
                what="v1's transfer to site gen under way", state=lambda: logs(procs))
    gen_h.cut()
    step_at_cut = metrics_rows(tmp_path, run)[-1]["step"]
    leaf = sites.leafz()["gen"]
    try:
        await asyncio.sleep(OUTAGE_S)  # the outage itself: its length is what is tested
        # nothing of v1's rest came through: the cut was mid-transfer
        assert "v1 mirrored" not in relay.output(), relay.tail()
    finally:
        gen_h.mend()
    t_mend = time.monotonic()
    in_msgs = sites.leafz().get("gen", {}).get("in_msgs", -1)

    def relinked():  # the hub hears site gen again (on the old connection, or a new one)
        now = sites.leafz().get("gen")
        return now is not None and (now["id"] != leaf["id"] or now["in_msgs"] > in_msgs)

    await until(lambda: asyncio.to_thread(relinked), deadline=60, step=0.05,
                what="site gen's link carrying its messages again", state=sites.logs)
    relink_s = time.monotonic() - t_mend
    same_conn = sites.leafz()["gen"]["id"] == leaf["id"]
    await relay.line_with("v1 mirrored", 90)
    v1_s = time.monotonic() - t_mend
    await wait_exit(procs, 150)
    assert step_at_cut < 3, "the cut came after the last step: it proves nothing"

    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    rec = await run_record([sites.hub_url], run)
    counts = check_accounting(rec, rows)
    loads = [lo for lo in rec["loaded"] if not lo.error]
    after = [lo for lo in loads if lo.version >= 1]
    assert after and {lo.route for lo in after} == {"relay"}, \
        [(lo.replica, lo.version, lo.route) for lo in rec["loaded"]]
    newest = {r: max(lo.version for lo in loads if lo.replica == r)
              for r in {lo.replica for lo in loads}}
    assert len(newest) == 2 and min(newest.values()) >= rows[-1]["version"] - 1, newest
    # cut off, the generators waited for the relay: none turned to the trainer's store, which
    # is across the same link (they did, 5 s into the cut, when a timed-out read of the
    # relay's record counted as an unusable one)
    assert "read from the trainer's store" not in procs[1].output(), procs[1].tail()
    mirrored = [ln.split("relay gen: ")[-1] for ln in relay.output().splitlines()
                if " mirrored (" in ln]
    versions = [int(ln.split()[0][1:]) for ln in mirrored]
    assert len(versions) == len(set(versions)), mirrored  # each version mirrored once
    # and crossed once: what went down site gen's link beyond the leaf connection's bytes is
    # the relay's fetches (plus TCP/IP overhead), not a generator's fallback to the trainer
    mib = sum(float(ln.split("(")[1].split()[0]) for ln in mirrored)
    v1_fetch_s = float(mirrored[versions.index(1)].split(", ")[-1].rstrip("s)"))
    weights_down = (gen_h.tx_to() - sites.leafz()["gen"]["out_bytes"]) / 2**20
    assert weights_down < 1.15 * mib + 0.5, (weights_down, mirrored)
    print(f"[sites] gen site's link ({LINK_RATE}) cut {OUTAGE_S:.0f}s mid v1 (after step "
          f"{step_at_cut}): run {time.monotonic() - t0:.1f}s; site gen heard again "
          f"{relink_s:.2f}s after the mend ({'same' if same_conn else 'new'} leaf connection); "
          f"v1 whole at the relay {v1_s:.1f}s after the mend (its fetch {v1_fetch_s:.1f}s); "
          f"{counts}; loads "
          f"{sorted((lo.version, lo.route) for lo in loads)}; relay: {'; '.join(mirrored)}; "
          f"{weights_down:.2f} MiB down beyond the leaf connection")


# the packaged recipe's 100 steps over the leaf links, as nodes: minutes (several on a loaded host)
@pytest.mark.timeout(1200)
async def test_the_quickstart_learns_across_two_leaf_sites(tmp_path, hosts):
    """Issue 48's "done when": the quickstart, as packaged, run by a hub (trainer, scheduler)
    and two leaf sites (generate reading weights through site gen's relay; env+reward),
    learns. The head node writes ``summary.json`` with the final greedy evaluation exactly
    as ``rollart run`` does (:func:`rollart.app.launch.drive_training`)."""
    from rollart.config import RunConfig, load

    t0 = time.monotonic()
    sites, hub_h, gen_h, env_h, _ = await start_sites(hosts, tmp_path)
    cfg, run, head, procs = await start_run(sites, tmp_path, None, hub_h, gen_h, env_h,
                                            relay=True, recipe=True)
    qs = load(cfg, RunConfig)
    await wait_exit(procs, 1050)
    wall = time.monotonic() - t0
    rows = metrics_rows(tmp_path, run)
    summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
    check_learned(summary, rows, steps=qs.trainer.steps, alpha=qs.rollout.alpha,
                  label="[sites] the quickstart across two leaf sites")
    check_steps(rows, qs.trainer.steps)
    rec = await run_record([sites.hub_url], run)
    counts = check_accounting(rec, rows, size=qs.rollout.group_size)
    loads = [lo for lo in rec["loaded"] if not lo.error]
    versions = sorted({lo.version for lo in loads})
    # site gen read every version through its relay, the last ones included
    assert {lo.route for lo in loads} == {"relay"}, [(lo.version, lo.route) for lo in loads]
    assert versions[-1] >= qs.trainer.steps - 1, versions
    print(f"[sites] quickstart across two leaf sites: run {wall:.0f}s; {counts}; "
          f"{len(loads)} loads of v{versions[0]}..v{versions[-1]}, all from site gen's relay")
