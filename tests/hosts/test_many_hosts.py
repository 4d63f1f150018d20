"""Real runs across "hosts": every node and every nats-server in its own network namespace.

Three nats-servers form a JetStream cluster (h1-h3); the run's streams and KV buckets have
three replicas (``node.stream_replicas: 3``) and every client is given the three URLs. The
nodes are ``python -m rollart.node`` processes in further namespaces: the trainer with its
scheduler, the env manager with the reward service, and the generation replicas. The run
is the tiny FrozenLake quickstart with a few steps.

- routed: pools big/small/cpu; turns whose prompt is longer than ``ROUTE_N`` tokens go to
  big, the others to small; the recorded turns say so.
- kill -9 of one nats-server (the leader of the run's events stream) after the first
  step: the run completes, every admitted trajectory is accounted for, none is trained
  twice.
- the only node of pool big stops (SIGTERM): ``rollart nodes`` shows big without a live
  node and its turns wait; a new big node joins and the run completes, nothing lost.
- a generate node joining after v1 reports a current policy before it serves, and never
  serves one older than the version current when it joined minus alpha.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollart import messages as m
from rollart.actors.groups.admission import group_id
from rollart.bus.codec import decode
from tests.actors.sample_actors import new_run
from tests.waiting import until

# in `make test-scale`, on the worker beside the learning runs (runs of a minute each in network
# namespaces; tests/faults/test_multi_node_run.py runs several nodes as processes in `make test`)
pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.scale]

ROOT = Path(__file__).resolve().parents[2]
SERVERS = 3
STEPS = 3
GROUP_SIZE = 4
BATCH_GROUPS = 2
ALPHA = 1
ACK_WAIT = 5.0
ROUTE_N = 60
"""Turns whose prompt (the context so far) is longer than this many tokens go to pool big.
The first turn's prompt of the quickstart FrozenLake is shorter, later turns longer."""


# -- the run -----------------------------------------------------------------------------


def write_config(tmp_path: Path, tiny_model, urls: list[str], *, routed: bool = False,
                 steps: int = STEPS, **extra) -> tuple[Path, str]:
    """The quickstart config, small, on the cluster; ``routed``: pools big/small/cpu."""
    qs = yaml.safe_load((ROOT / "src/rollart/configs/quickstart.yaml").read_text())
    run = new_run()
    cfg = {
        "run": run,
        "run_dir": str(tmp_path / "runs"),
        "nats": {"urls": list(urls)},
        "node": {"grace": 3, "heartbeat_every": 0.5, "stream_replicas": SERVERS},
        "model": {"path": str(tiny_model), "threads": 1},
        "envs": {"main": {**qs["envs"]["main"], "max_turns": 8,
                          "args": {**qs["envs"]["main"]["args"], "max_steps": 8}}},
        # a killed process's deliveries come back after 5 s, not the default 30 (live ones
        # are held by their in-progress heartbeats)
        "rollout": {"group_size": GROUP_SIZE, "batch_groups": BATCH_GROUPS, "alpha": ALPHA,
                    "ack_wait": ACK_WAIT},
        "actors": {role: {"handlers": {"on_completed": {"ack_wait": ACK_WAIT}}}
                   for role in ("trainer", "scheduler")},
        # every group trains (no dynamic sampling): the tiny random policy fails nearly every
        # episode, so skipping uniform groups would generate ~9x the trajectories a step
        "trainer": {**qs["trainer"], "steps": steps, "eval_groups": 1, "eval_timeout": 90,
                    "skip_uniform": 0},
    }
    if routed:
        cfg.update(
            pools={"big": {"description": "long prompts", "tags": ["gpu"]},
                   "small": {"description": "short prompts", "tags": ["gpu"]},
                   "cpu": {"description": "envs and rewards", "tags": ["cpu"]}},
            mapping={"generate": ["big", "small"], "env": "cpu", "reward": "cpu"},
            route=[{"when": {"prompt_tokens_gt": ROUTE_N}, "pool": "big"}, {"pool": "small"}])
    for k, v in extra.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    path = tmp_path / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, run


def node(host, cfg: Path, roles: str, pool: str | None = None, name: str | None = None):
    """``python -m rollart.node`` in ``host``'s namespace (the config's nats.urls)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "rollart.node", "--config", cfg, "--roles", roles]
    if pool:
        argv += ["--pool", pool]
    return host.run(argv, name or roles.replace(",", "+") + (f"-{pool}" if pool else ""),
                    env=env, cwd=cfg.parent)


def metrics_rows(tmp_path: Path, run: str) -> list[dict]:
    p = tmp_path / "runs" / run / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def logs(procs) -> str:
    return "\n".join(f"--- {p.log.name} (rc {p.poll()}) ---\n{p.tail(25)}" for p in procs)


async def wait_step(tmp_path, run, step: int, head, procs, deadline: float = 120.0) -> None:
    def reached():
        if head.poll() is not None:
            raise AssertionError(f"the head node exited before step {step}\n{logs(procs)}")
        rows = metrics_rows(tmp_path, run)
        return bool(rows) and rows[-1]["step"] >= step

    await until(reached, deadline=deadline, what=f"training step {step}", step=0.2,
                state=lambda: logs(procs))


async def wait_exit(procs, deadline: float) -> None:
    await until(lambda: all(p.poll() is not None for p in procs), deadline=deadline, step=0.2,
                what="every node to exit by itself", state=lambda: logs(procs))
    bad = [p for p in procs if p.poll() != 0]
    assert not bad, f"nodes exited non-zero: {bad}\n{logs(procs)}"


# -- what the run left on the bus --------------------------------------------------------


async def connect(urls):
    import nats

    async def _quiet(e):
        pass

    return await nats.connect(servers=urls, connect_timeout=2, reconnect_time_wait=0.2,
                              max_reconnect_attempts=20, error_cb=_quiet)


async def stream_messages(urls, stream: str) -> list[tuple[str, bytes]]:
    """Every message left in ``stream``: ``(subject, data)``, by sequence (direct gets)."""
    from nats.js.errors import NotFoundError

    nc = await connect(urls)
    try:
        js = nc.jetstream(timeout=5)
        info = await js.stream_info(stream)
        out = []
        if info.state.messages:
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    msg = await js.get_msg(stream, seq)
                except NotFoundError:
                    continue
                out.append((msg.subject, msg.data))
        return out
    finally:
        await nc.close()


async def run_record(urls, run: str) -> dict:
    """The run's outcomes as the bus holds them after the run."""
    pre = f"{m.PREFIX}.{run}."
    by: dict[str, list] = {}
    for subj, data in await stream_messages(urls, m.stream_name(run, "events")):
        name = subj[len(pre):]
        d = m.SUBJECTS.get(name)
        if d is not None:
            by.setdefault(name, []).append(decode(d.type, data))
    pending = [decode(m.RolloutRequested, data)
               for _, data in await stream_messages(urls, m.stream_name(run, "work"))]
    nc = await connect(urls)
    try:
        kv = await nc.jetstream(timeout=5).key_value(m.kv_bucket(run))
        admitted = int((await kv.get("scheduler.g.admitted")).value)
    finally:
        await nc.close()
    return {"completed": by.get("rollout.completed", []), "cancelled": by.get("rollout.cancelled", []),
            "dead": by.get("dead", []), "loaded": by.get("policy.loaded", []),
            "pending": pending, "admitted": admitted}


def dead_traj_id(d: m.DeadLetter) -> str | None:
    for typ in (m.RolloutRequested, m.RolloutCompleted):
        try:
            return decode(typ, d.payload).traj_id
        except Exception:  # noqa: BLE001, S112 - another message type
            continue
    return None


def check_accounting(rec: dict, rows: list[dict], size: int = GROUP_SIZE) -> dict:
    """Every admitted trajectory is completed, cancelled, dead-lettered or still queued
    (an env node drained at the end of the run); none trained twice; all trained ones were
    completed. Returns the counts."""
    admitted = {f"{group_id(g)}-{i}" for g in range(rec["admitted"]) for i in range(size)}
    completed = {c.traj_id for c in rec["completed"] if not c.eval and c.group_index >= 0}
    cancelled = {c.traj_id for c in rec["cancelled"]}
    dead = {t for d in rec["dead"] if (t := dead_traj_id(d)) in admitted}
    pending = {r.traj_id for r in rec["pending"] if not r.eval}
    outcomes = completed | cancelled | dead | pending
    trained = [t for r in rows for t in r["traj_ids"]]
    counts = {"admitted": len(admitted), "completed": len(completed), "cancelled": len(cancelled),
              "dead": len(dead), "pending": len(pending), "trained": len(trained)}
    assert len(trained) == len(set(trained)), f"a trajectory trained twice: {counts}"
    assert set(trained) <= completed, f"trained but never completed: {set(trained) - completed}"
    assert admitted - outcomes == set(), f"admitted and lost: {sorted(admitted - outcomes)} {counts}"
    assert outcomes - admitted == set(), f"outcomes never admitted: {sorted(outcomes - admitted)}"
    assert not completed & (cancelled | dead), f"completed and also cancelled or dead: {counts}"
    return counts


def check_steps(rows: list[dict], steps: int = STEPS) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step missing or repeated"
    assert rows[-1]["groups_lost"] == 0 and rows[-1]["count_groups_failed"] == 0, rows[-1]


# -- setup shared by the tests -------------------------------------------------------------


async def cluster_and_hosts(hosts, nats_cluster, n_node_hosts: int):
    h = hosts(SERVERS + n_node_hosts)
    cluster = await nats_cluster(list(h)[:SERVERS])
    return h, cluster, list(h)[SERVERS:]


async def start_head(host, cfg):
    """The trainer's node first: it creates the run's streams and KV buckets (3 replicas).
    Nodes started at the same moment work too in principle; see the report on KV gets
    answered "no responders" right after a bucket's creation."""
    head = node(host, cfg, "trainer,scheduler")
    await head.line_with("serving trainer", 90)
    return head


def print_timing(label: str, t0: float, **more) -> None:
    print(f"[hosts] {label}: {time.monotonic() - t0:.1f}s {more}")


# -- the tests ----------------------------------------------------------------------------


async def test_routed_run_sends_long_prompts_to_big(tmp_path, tiny_model, hosts, nats_cluster):
    t0 = time.monotonic()
    _, cluster, (head_h, env_h, big_h, small_h) = await cluster_and_hosts(hosts, nats_cluster, 4)
    cfg, run = write_config(tmp_path, tiny_model, cluster.urls, routed=True)
    head = await start_head(head_h, cfg)
    procs = [head, node(env_h, cfg, "env,reward", "cpu"), node(big_h, cfg, "generate", "big"),
             node(small_h, cfg, "generate", "small")]
    await wait_exit(procs, 150)
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
    assert summary["steps"] == STEPS and not summary["interrupted"], summary

    rec = await run_record(cluster.urls, run)
    turns = [t for c in rec["completed"] for t in c.turns]
    assert turns, "no turn recorded"
    wrong = [(t.start, t.pool, t.route) for t in turns
             if (t.pool, t.route) != (("big", 0) if t.start > ROUTE_N else ("small", 1))]
    assert not wrong, f"turns on the wrong pool (prompt tokens, pool, route): {wrong[:10]}"
    by_pool = {p: sum(t.pool == p for t in turns) for p in ("big", "small")}
    assert by_pool["big"] and by_pool["small"], f"both pools must serve some turns: {by_pool}"
    # each generate node loaded policies in its own pool only
    assert {lo.pool for lo in rec["loaded"]} == {"big", "small"}, {lo.pool for lo in rec["loaded"]}
    counts = check_accounting(rec, rows)
    print_timing("routed run", t0, turns=by_pool, **counts,
                 prompt_tokens=sorted({t.start for t in turns})[:12])


async def test_nats_server_kill9_mid_run(tmp_path, tiny_model, hosts, nats_cluster):
    t0 = time.monotonic()
    _, cluster, (head_h, env_h, gen_h) = await cluster_and_hosts(hosts, nats_cluster, 3)
    cfg, run = write_config(tmp_path, tiny_model, cluster.urls)
    head = await start_head(head_h, cfg)
    procs = [head, node(env_h, cfg, "env,reward"), node(gen_h, cfg, "generate")]
    await wait_step(tmp_path, run, 1, head, procs)
    # the leader of the run's events stream: the most disruptive server to lose
    nc = await connect(cluster.urls)
    try:
        info = await nc.jetstream(timeout=5).stream_info(m.stream_name(run, "events"))
    finally:
        await nc.close()
    assert info.config.num_replicas == SERVERS, "node.stream_replicas did not reach the stream"
    victim = next(k for k in range(SERVERS) if info.cluster.leader.endswith(f"-n{k + 1}"))
    step_at_kill = metrics_rows(tmp_path, run)[-1]["step"]
    cluster.kill(victim)
    t_kill = time.monotonic()
    await wait_exit(procs, 150)
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    assert step_at_kill < STEPS, "the kill came after the last step: it proves nothing"
    survivors = [u for k, u in enumerate(cluster.urls) if k != victim]
    rec = await run_record(survivors, run)
    counts = check_accounting(rec, rows)
    print_timing("kill -9 run", t0, after_kill=f"{time.monotonic() - t_kill:.1f}s",
                 victim=f"n{victim + 1}", step_at_kill=step_at_kill, **counts)


# in make test-scale (a generate pool away, then back: tests/faults/test_outages.py and
# test_multi_node_run.py cover it in fewer processes in make test)
@pytest.mark.scale
async def test_pool_without_node_waits_until_one_joins(tmp_path, tiny_model, hosts, nats_cluster):
    t0 = time.monotonic()
    _, cluster, (head_h, env_h, big_h, small_h, big2_h) = await cluster_and_hosts(
        hosts, nats_cluster, 5)
    cfg, run = write_config(tmp_path, tiny_model, cluster.urls, routed=True)
    head = await start_head(head_h, cfg)
    big = node(big_h, cfg, "generate", "big")
    procs = [head, node(env_h, cfg, "env,reward", "cpu"), big,
             node(small_h, cfg, "generate", "small")]
    await wait_step(tmp_path, run, 1, head, procs)
    env_log_at_stop = len(procs[1].output())
    big.signal(signal.SIGTERM)
    assert await big.wait(30) == 0, logs([big])
    procs.remove(big)

    # rollart nodes (from another host): pool big has no live node, its work waits
    r = await asyncio.to_thread(
        big2_h.exec, sys.executable, "-m", "rollart", "nodes", "--nats", cluster.urls[0],
        "--run", run, "--config", str(cfg), "--wait", "2", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    pools = {p for n in listed for p in (n.get("pools") or [n["pool"]])}
    assert "big" not in pools and "small" in pools and "cpu" in pools, listed
    assert "pool big: no live node" in r.stderr, r.stderr

    # routed requests wait: no step while big is away (a trajectory of more than one turn
    # needs it), and no trajectory fails for it
    step_before = metrics_rows(tmp_path, run)[-1]["step"]
    await asyncio.sleep(6)  # the outage is what this test is about
    rows = metrics_rows(tmp_path, run)
    assert rows[-1]["groups_lost"] == 0 and rows[-1]["count_groups_failed"] == 0, rows[-1]
    away_steps = rows[-1]["step"] - step_before
    await until(lambda: "wait for a generate replica in pool 'big'"
                in procs[1].output()[env_log_at_stop:], deadline=30, step=0.2,
                what="the env node to say that turns wait for pool big", state=lambda: logs(procs))

    procs.append(node(big2_h, cfg, "generate", "big", name="generate-big-2"))
    await wait_exit(procs, 150)
    assert "generate replicas in pool 'big' answer again" in procs[1].output()[env_log_at_stop:]
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)
    rec = await run_record(cluster.urls, run)
    counts = check_accounting(rec, rows)
    assert not any("service_unavailable" in d.reason for d in rec["dead"]), \
        [d.reason for d in rec["dead"]]
    print_timing("pool outage run", t0, steps_while_big_away=away_steps, **counts)


async def test_late_generate_node_serves_current_policy(tmp_path, tiny_model, hosts, nats_cluster):
    """The first generate node stops after v1 (SIGTERM, it drains); a generate node joins
    then, alone: before it serves it holds the current policy, and no turn it generates is
    older than the version current when it joined minus alpha."""
    t0 = time.monotonic()
    _, cluster, (head_h, env_h, gen_h, late_h) = await cluster_and_hosts(hosts, nats_cluster, 4)
    cfg, run = write_config(tmp_path, tiny_model, cluster.urls)
    # the late node's process starts now, off the network: it loads what it loads, then
    # waits for a server; it joins when its host is plugged in (a Python start takes longer
    # than this whole tiny run, so starting the process late would join an ended run)
    late_h.unplug()
    late = node(late_h, cfg, "generate", name="generate-late")
    head = await start_head(head_h, cfg)
    early = node(gen_h, cfg, "generate")
    procs = [head, node(env_h, cfg, "env,reward"), early]

    # every heartbeat of the run, as the test process hears them
    beats: list[tuple[float, m.NodeHeartbeat]] = []
    nc = await connect(cluster.urls)

    async def on_hb(msg):
        try:
            beats.append((time.monotonic(), decode(m.NodeHeartbeat, msg.data)))
        except Exception:  # noqa: BLE001, S110 - junk on a core subject
            pass

    await nc.subscribe(m.subject(run, "node.heartbeat"), cb=on_hb)
    try:
        await wait_step(tmp_path, run, 1, head, procs)
        early.signal(signal.SIGTERM)
        assert await early.wait(30) == 0, logs([early])
        v_join = metrics_rows(tmp_path, run)[-1]["version"]
        assert v_join < STEPS, "the run ended before the late node joined: it proves nothing"
        assert late.alive and "serving" not in late.output(), late.output()
        late_h.plug()
        t_plug = time.monotonic()
        procs.append(late)
        await late.line_with("serving generate", 60)
        join_s = time.monotonic() - t_plug
        await wait_exit(procs, 150)
    finally:
        await nc.close()
    rows = metrics_rows(tmp_path, run)
    check_steps(rows)

    # its heartbeats: once it has answered a request, the versions its generators hold are
    # never older than v_join - alpha (before that it may report the initial weights, v0)
    late_beats = [hb for _, hb in beats if hb.pid != early.pid and "generate" in hb.roles
                  and hb.node_id in late.output()]
    assert late_beats, "no heartbeat of the late node"

    def acked(hb) -> float:
        return sum(v for k, v in hb.stats.items() if k.endswith(".acked"))

    trace = [(min(hb.versions.values(), default=None), acked(hb)) for hb in late_beats]
    assert all(v is not None for v, _ in trace), \
        f"the late node's heartbeats name no policy version: {late_beats[:2]}"
    serving = [v for v, n in trace if n > 0]
    assert serving and min(serving) >= v_join - ALPHA, (v_join, trace)
    # its policy.loaded reports: the first one is the current policy, none is older
    rec = await run_record(cluster.urls, run)
    names = {name for hb in late_beats for name in hb.versions}
    late_loaded = [lo for lo in rec["loaded"] if lo.replica in names]
    assert late_loaded, f"no policy.loaded of the late node: {rec['loaded']}"
    assert late_loaded[0].version >= v_join, (v_join, late_loaded)
    assert min(lo.version for lo in late_loaded) >= v_join - ALPHA, (v_join, late_loaded)
    # it served: its generate handler answered requests (node stats in its heartbeats)
    served = max(n for _, n in trace)
    assert served > 0, f"the late node answered no request: {late_beats[-1].stats}"
    # groups admitted at or after the join's version were generated (after the early node
    # left) by it alone: their turns respect the bound. ">=": near the end of a run, every
    # group still needed may have been admitted at v_join already (within the α headroom)
    late_trajs = [c for c in rec["completed"] if c.admitted_version >= v_join and not c.eval]
    assert late_trajs, "no trajectory admitted after the join"
    assert min(t.version for c in late_trajs for t in c.turns) >= v_join - ALPHA
    counts = check_accounting(rec, rows)
    print_timing("late join run", t0, v_join=v_join, join_s=f"{join_s:.1f}s",
                 first_beats=trace[:4], served=served, **counts)


# in make test-scale (an env pool's node lost: tests/actors/test_env_pools.py covers it in
# one process in make test)
@pytest.mark.scale
async def test_two_env_pools_share_work_and_one_killed_leaves_it_to_the_other(
        tmp_path, tiny_model, hosts, nats_cluster):
    """``mapping.env: [a, b]`` with an env node of each pool in its own namespace: both get
    work; ``kill -9`` of pool b's node mid-run: the scheduler moves b's open trajectories to a
    (as ``<id>+1`` copies) and the run finishes on a, every step trained, no group lost,
    every admitted member accounted for (by itself or its copy), nothing trained twice."""
    from rollart.actors.groups.admission import member_slot

    t0 = time.monotonic()
    _, cluster, (head_h, gen_h, a_h, b_h) = await cluster_and_hosts(hosts, nats_cluster, 4)
    cfg, run = write_config(tmp_path, tiny_model, cluster.urls, steps=4,
                            pools={"gen": {"tags": ["gpu"]}, "a": {"tags": ["cpu"]},
                                   "b": {"tags": ["cpu"]}},
                            mapping={"generate": "gen", "env": ["a", "b"], "reward": ["a", "b"]})
    beats: dict[str, m.NodeHeartbeat] = {}
    nc = await connect(cluster.urls)

    async def on_hb(msg):
        try:
            hb = decode(m.NodeHeartbeat, msg.data)
        except Exception:  # noqa: BLE001 - junk on a core subject
            return
        beats[hb.node_id] = hb

    await nc.subscribe(m.subject(run, "node.heartbeat"), cb=on_hb)

    def acked(pool: str) -> float:
        return sum(v for hb in beats.values() if pool in (hb.pools or [hb.pool])
                   and "env" in hb.roles for k, v in hb.stats.items()
                   if ".on_request." in k and k.endswith(".acked"))

    try:
        head = await start_head(head_h, cfg)
        env_b = node(b_h, cfg, "env,reward", "b")
        procs = [head, node(gen_h, cfg, "generate", "gen"), node(a_h, cfg, "env,reward", "a"),
                 env_b]
        await until(lambda: acked("a") > 0 and acked("b") > 0, deadline=120, step=0.2,
                    what="both env pools to finish work", state=lambda: logs(procs))
        await wait_step(tmp_path, run, 1, head, procs)
        step_at_kill = metrics_rows(tmp_path, run)[-1]["step"]
        done_by = {p: acked(p) for p in ("a", "b")}
        env_b.signal(signal.SIGKILL)
        procs.remove(env_b)
        await wait_exit(procs, 180)
    finally:
        await nc.close()
    assert step_at_kill < 4, "the kill came after the last step: it proves nothing"
    rows = metrics_rows(tmp_path, run)
    check_steps(rows, steps=4)
    assert "env pool b has no live node: moved" in head.output(), head.tail(40)

    rec = await run_record(cluster.urls, run)
    admitted = {f"{group_id(g)}-{i}" for g in range(rec["admitted"]) for i in range(GROUP_SIZE)}
    completed = {c.traj_id for c in rec["completed"] if not c.eval and c.group_index >= 0}
    outcomes = (completed | {c.traj_id for c in rec["cancelled"]}
                | {t for d in rec["dead"] if (t := dead_traj_id(d))}
                | {r.traj_id for r in rec["pending"] if not r.eval})
    slots = {member_slot(t) for t in outcomes}
    assert admitted - slots == set(), f"admitted and lost: {sorted(admitted - slots)}"
    assert slots - admitted == set(), f"outcomes never admitted: {sorted(slots - admitted)}"
    trained = [t for r in rows for t in r["traj_ids"]]
    assert len(trained) == len(set(trained)) and set(trained) <= completed
    copies = sorted(t for t in outcomes if "+" in t)
    assert copies, "no trajectory was moved to pool a"
    print_timing("two env pools, b killed", t0, step_at_kill=step_at_kill, acked_before=done_by,
                 moved=len(copies), trained=len(trained))


async def test_head_moves_to_another_host_with_its_checkpoint_in_the_object_store(
        tmp_path, tiny_model, hosts, nats_cluster):
    """``trainer.checkpoint_store: object``: the head is killed (-9) after step 2 and started on
    another host whose run folder is empty (another ``run_dir``, as on a host without the
    old disk): it takes the checkpoint and the metrics record from the object store and the
    run finishes there: every step once, nothing trained twice, the env and generate nodes
    serving throughout (they exit 0 at the end, never restarted)."""
    t0 = time.monotonic()
    _, cluster, (head_h, env_h, gen_h, new_h) = await cluster_and_hosts(hosts, nats_cluster, 4)
    cfg, run = write_config(tmp_path, tiny_model, cluster.urls, steps=4,
                            trainer={"weights": "object", "checkpoint_store": "object"})
    moved_cfg = tmp_path / "moved.yaml"
    data = yaml.safe_load(cfg.read_text())
    data["run_dir"] = str(tmp_path / "runs-new-host")
    moved_cfg.write_text(yaml.safe_dump(data, sort_keys=False))

    head = await start_head(head_h, cfg)
    procs = [head, node(env_h, cfg, "env,reward"), node(gen_h, cfg, "generate")]
    await wait_step(tmp_path, run, 2, head, procs)
    head.signal(signal.SIGKILL)
    await head.wait(30)
    step_at_kill = metrics_rows(tmp_path, run)[-1]["step"]
    assert step_at_kill < 4, "the kill came after the last step: it proves nothing"
    new_head = node(new_h, moved_cfg, "trainer,scheduler", name="head-new-host")
    procs = [new_head] + procs[1:]
    await new_head.line_with("from the object store", 90)
    await wait_exit(procs, 180)
    assert "continues from its checkpoint at version" in new_head.output(), new_head.tail(30)
    new_path = tmp_path / "runs-new-host"
    rows = [json.loads(x) for x in (new_path / run / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    check_steps(rows, steps=4)
    rec = await run_record(cluster.urls, run)
    counts = check_accounting(rec, rows)
    print_timing("head moved", t0, step_at_kill=step_at_kill, **counts)
