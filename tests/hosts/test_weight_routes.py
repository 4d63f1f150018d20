"""The default weight path picks its route per generator (``trainer.weights: auto``).

A run whose config has no ``trainer.sync`` and no ``trainer.weights`` streams its versions:
the trainer writes them to its shared-memory folder and serves that folder on its weight
server. Three generate nodes load every version:

- one on the trainer's host (its network namespace): it reads the shared-memory folder
  (``policy.loaded`` route ``shm``);
- one on another host (namespace): TCP from the weight server;
- one on the trainer's host but with a /dev/shm of its own (a private mount namespace, as a
  container has): the same host identity, but no folder there, so it falls back to TCP and
  says why.

When the run ends the trainer removes its shared-memory folder."""

from __future__ import annotations

import os
import sys
import time

import pytest

from rollart.engines.weight_blobs import SHM
from tests.hosts.test_many_hosts import (
    ROOT,
    check_accounting,
    check_steps,
    cluster_and_hosts,
    logs,
    metrics_rows,
    node,
    print_timing,
    run_record,
    start_head,
    wait_exit,
    write_config,
)

# in `make test-scale`, on the worker beside the learning runs (runs of a minute each in network
# namespaces; tests/faults/test_multi_node_run.py runs several nodes as processes in `make test`)
pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.scale]


async def test_each_generator_reads_weights_the_nearest_way(tmp_path, tiny_model, hosts,
                                                             nats_cluster):
    t0 = time.monotonic()
    _, cluster, (head_h, env_h, gen_h) = await cluster_and_hosts(hosts, nats_cluster, 3)
    cfg, run = write_config(tmp_path, tiny_model, cluster.urls)
    assert "sync" not in cfg.read_text().split("trainer:", 1)[1], "the config must not choose"
    head = await start_head(head_h, cfg)
    local = node(head_h, cfg, "generate", name="generate-local")
    away = node(gen_h, cfg, "generate", name="generate-away")
    # the trainer's host again, in a mount namespace with a /dev/shm of its own
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    own_shm = head_h.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh", sys.executable,
                          "-m", "rollart.node", "--config", cfg, "--roles", "generate"],
                         "generate-own-shm", env=env, cwd=cfg.parent)
    procs = [head, node(env_h, cfg, "env,reward"), local, away, own_shm]
    await wait_exit(procs, 240)
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    rec = await run_record(cluster.urls, run)
    check_accounting(rec, rows)

    routes = {p.log.name: {r for r in ("shm", "tcp", "file", "object")
                           if f"fetched from {r}" in p.output()} for p in (local, away, own_shm)}
    assert routes == {local.log.name: {"shm"}, away.log.name: {"tcp"},
                      own_shm.log.name: {"tcp"}}, (routes, logs(procs))
    assert "another /dev/shm" in own_shm.output(), own_shm.output()[-3000:]
    assert "on another host" in away.output(), away.output()[-3000:]
    loaded = [lo for lo in rec["loaded"] if not lo.error and lo.version > 0]
    assert {lo.route for lo in loaded} == {"shm", "tcp"}, loaded
    for p in (local, away, own_shm):  # every node loaded versions past the first
        assert "loaded policy v2" in p.output(), p.output()[-3000:]
    # the shared-memory folder (which the shm route read) is gone
    assert not list(SHM.glob(f"rollart-{run}-*")), "the trainer left its shared-memory folder"
    print_timing("weight routes", t0, routes={lo.replica: lo.route for lo in loaded})
