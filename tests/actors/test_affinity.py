"""Replica-affine turns (``rollout.affinity``): the turns of a trajectory go to the generate
replica that served its previous turn (on ``generate.direct.<pool>.<token>``), so that its
engine's per-trajectory KV cache is hit; a replica that dies hands its trajectories to the
pool's queue group (DESIGN.md §2, stateless services).

Real replicas: LLMProxy actors with a tiny torch engine each, on the in-memory bus and on a
real nats-server; the fault test kills a replica's ``python -m rollart.node`` process.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from rollart import messages as m
from rollart.actors.kernel.service_client import ServiceClient
from rollart.bus.codec import encode
from rollart.config import RunConfig, convert
from rollart.node import Node, build_actors
from tests.actors.sample_actors import all_stored, collect, new_run
from tests.waiting import until

pytest.importorskip("torch")

LAKE = {"type": "frozenlake", "args": {"map": ["SFFF", "FHFH", "FFFH", "HFFG"], "max_steps": 16},
        "instruction": "FrozenLake", "max_turns": 4}
"""The quickstart env. Both neighbours of the start are frozen, so no trajectory ends at its
first turn: every one has at least two."""


def cfg_of(tiny_model, *, affinity: bool = True, replicas: int = 2, max_turns: int = 4,
           **rollout) -> RunConfig:
    return convert({"run": new_run(), "model": {"path": str(tiny_model)},
                    "envs": {"main": {**LAKE, "max_turns": max_turns}},
                    # a replica is silent after 30 s only: a loaded host never loses one here
                    "rollout": {"affinity": affinity, "replica_timeout": 30, **rollout},
                    "actors": {"generate": {"replicas": replicas}}}, RunConfig)


def record(env) -> list[tuple[str, int, str]]:
    """``(traj_id, turn, replica)`` of every turn the EnvManager ``env`` generates, in order
    (``GenerateResult.replica``: the LLMProxy's actor name)."""
    served: list[tuple[str, int, str]] = []
    generate = env.generate

    async def recorded(req, cfg, tr, legal, turn=1):
        out = await generate(req, cfg, tr, legal, turn)
        served.append((req.traj_id, turn, out[0].replica))
        return out

    env.generate = recorded
    return served


def known(client: ServiceClient) -> int:
    """Generate replicas with their own subject that ``client`` has heard from."""
    return sum(1 for r in client._replicas.values() if r.direct and not r.silent)


def by_trajectory(served) -> dict[str, list[str]]:
    out: dict[str, list[str]] = collections.defaultdict(list)
    for tid, _, replica in served:
        out[tid].append(replica)
    return dict(out)


async def submit(bus, run: str, n: int, greedy: bool = False) -> set[str]:
    ids = set()
    for i in range(n):
        tid = f"t{i}"
        msg = m.RolloutRequested(traj_id=tid, group_id=f"g{i // 2}", env="main", seed=i,
                                 index_in_group=i % 2, greedy=greedy)
        await bus.publish(m.subject(run, "rollout.requested", "default"), encode(msg), msg_id=tid)
        ids.add(tid)
    return ids


def cache_share(proxies) -> float:
    """Share of prompt tokens the replicas' KV caches served, over all of them."""
    reused = prefilled = 0.0
    for p in proxies:
        st = p.batcher.stats()
        reused += st["kv_reused_tokens"]
        prefilled += st["kv_prefilled_tokens"]
    return reused / (reused + prefilled)


async def rollout(bus, tiny_model, n: int, greedy: bool = False, **kw):
    """``n`` trajectories at once through one EnvManager and its generate replicas:
    ``(completions, turns served, proxies, env, cache share)``."""
    cfg = cfg_of(tiny_model, **kw)
    env, *proxies = build_actors(cfg, ["env", "generate"], "default")
    assert [p.role for p in proxies] == ["generate"] * len(proxies)
    served = record(env)
    async with Node(bus, [env, *proxies], heartbeat_every=0):
        # the replicas' first progress reports: from then on first turns are placed too
        await until(lambda: known(env.services) == len(proxies), deadline=60,
                    what="the EnvManager to hear from every replica")
        ids = await submit(bus, cfg.run, n, greedy=greedy)
        done = await collect(bus, cfg.run, "rollout.completed", n, deadline=180)
        assert {d.traj_id for d in done} == ids, sorted(d.traj_id for d in done)
        share = cache_share(proxies)
    return done, served, proxies, env, share


async def test_turns_stay_on_one_replica_and_trajectories_spread(bus, tiny_model):
    """7 trajectories at once on 2 replicas: every turn of a trajectory goes to one
    replica, the trajectories split 4/3 (placement by this EnvManager's pins: not by luck),
    and the pins are dropped as the trajectories end."""
    done, served, proxies, env, share = await rollout(bus, tiny_model, 7)
    per = by_trajectory(served)
    assert len(per) == 7 and all(len(v) >= 2 for v in per.values()), per
    names = {p.name for p in proxies}
    for tid, replicas in per.items():
        assert len(set(replicas)) == 1 and replicas[0] in names, (tid, replicas)
    spread = collections.Counter(v[0] for v in per.values())
    assert sorted(spread.values()) == [3, 4], spread
    # each replica served exactly the turns of its trajectories, through its engine
    for p in proxies:
        assert p.batcher.items == sum(len(v) for v in per.values() if v[0] == p.name)
    assert env.services.pins() == 0, "a finished trajectory's pin is forgotten"
    assert env.stats.get("affinity_fallbacks", 0) == 0 and env.stats.get("affinity_moves", 0) == 0
    assert all(len(d.turns) == len(per[d.traj_id]) for d in done)
    assert share > 0.5, share


async def test_kv_cache_share_with_affinity_on_beats_off(bus, tiny_model):
    """The same 7 greedy trajectories (the same tokens) with ``rollout.affinity`` off: turns
    land on either replica (round robin on the memory bus, random on nats), and a turn on
    another replica than its previous turn's prefills what that one had cached."""
    kw = dict(greedy=True, max_turns=6)
    done_on, served_on, _, _, on = await rollout(bus, tiny_model, 7, **kw)
    done_off, served_off, _, env_off, off = await rollout(bus, tiny_model, 7, affinity=False, **kw)
    assert sum(len(d.turns) for d in done_on) == sum(len(d.turns) for d in done_off) >= 14
    assert all(len(set(v)) == 1 for v in by_trajectory(served_on).values())
    assert any(len(set(v)) > 1 for v in by_trajectory(served_off).values()), served_off
    assert env_off.services.pins() == 0  # off: nothing is remembered
    assert on > off, (on, off)


async def test_a_pin_moves_off_a_saturated_or_stopped_replica(bus, tiny_model):
    """The ServiceClient of an EnvManager, with two real replicas each on its own node: a
    key stays on its replica; it moves when that replica reports more held requests than
    1.25 x the pool's mean + 2, and again when its node stops (no responders on its own
    subject, so the pool's queue group answers, or its reports gone quiet); pins are forgotten, and at most
    ``affinity_max`` are kept (least recently used go first)."""
    cfg = cfg_of(tiny_model)
    env, a, b = build_actors(cfg, ["env", "generate"], "default")
    nodes = {p.name: Node(bus, [p], heartbeat_every=0) for p in (a, b)}
    proxies = {a.name: a, b.name: b}
    client = Node(bus, [env], heartbeat_every=0)
    for node in (*nodes.values(), client):
        await node.start()
    try:
        sc = env.services
        await until(lambda: known(sc) == 2, deadline=60,
                    what="the EnvManager to hear from both replicas")

        async def turn(key: str = "x-0") -> str:
            gen = m.GenerateRequest(traj_id=key, prompt_ids=[5, 6, 7],
                                    sampling=m.SamplingParams(max_new_tokens=2))
            res = await sc.call("generate.request", gen, affinity=key)
            assert sc.pinned(key) == proxies[res.replica].progress.replica
            return res.replica

        def held(proxy) -> int:
            return next((r.held for r in sc._replicas.values()
                         if r.name == proxy.progress.replica), -1)

        first = await turn()
        assert [await turn() for _ in range(3)] == [first] * 3
        crowded, other = proxies[first], next(p for n, p in proxies.items() if n != first)
        crowded.progress.held.update({f"fake-{i}": 1 for i in range(20)})  # reported as held
        await until(lambda: held(crowded) == 20, deadline=30, what="a report of 20 held")
        assert await turn() == other.name and env.stats["affinity_moves"] == 1
        for i in range(20):
            crowded.progress.held.pop(f"fake-{i}")
        await until(lambda: held(crowded) == 0, deadline=30, what="a report of 0 held")
        assert await turn() == other.name, "the pin stays where it moved"
        await nodes.pop(other.name).stop_and_drain()  # its subject has no responders now
        # the next turn finds one of two things first, by how long the stop took: the
        # replica's subject without responders (a fallback to the pool's queue group), or
        # its reports gone quiet for long enough that it is no longer live (placed again, a
        # move); either way the key moves once, to the replica that is left
        assert await turn() == first
        moved = env.stats.get("affinity_fallbacks", 0) + env.stats["affinity_moves"] - 1
        assert moved == 1, env.stats
        assert await turn() == first
        sc.forget("x-0")
        assert sc.pinned("x-0") is None and sc.pins() == 0
        sc.affinity_max = 2
        for key in ("y-1", "y-2", "y-3"):
            await turn(key)
        assert sc.pins() == 2 and sc.pinned("y-1") is None and sc.pinned("y-3") is not None
    finally:
        await client.stop_and_drain()
        for node in nodes.values():
            await node.stop_and_drain()


# -- a replica killed mid-run -------------------------------------------------------------------


def write_cfg(path: Path, run: str, tiny_model, delay: float) -> Path:
    path.write_text(
        f"run: {run}\n"
        f"run_dir: {path.parent / 'runs'}\n"
        "node: {grace: 5, heartbeat_every: 1}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, args: {map: [SFFF, FHFH, FFFH, HFFG], max_steps: 16},"
        " instruction: FrozenLake, max_turns: 6}}\n"
        "rollout: {generate_timeout: 600, service_wait: 120, replica_timeout: 3}\n"
        "actors:\n"
        f"  generate: {{type: 'tests.faults.slow_proxy:SlowProxy', args: {{delay: {delay}}}}}\n")
    return path


@pytest.mark.slow
async def test_trajectories_of_a_killed_replica_finish_on_the_other(tmp_path, tiny_model):
    """Two generate node processes; one is killed (SIGKILL) once every trajectory has had a
    turn: the trajectories pinned to it go on, on the survivor, and stay there; every
    trajectory completes, none is dead-lettered or run again."""
    from rollart.bus.nats import NatsBus
    from rollart.bus.server import EmbeddedServer
    from rollart.config.loader import load
    from tests.child_output import NodeProcess

    run = new_run()
    cfg_path = write_cfg(tmp_path / "run.yaml", run, tiny_model, delay=0.3)
    with EmbeddedServer(tmp_path / "nats") as server:
        gens = [NodeProcess(cfg_path, "generate", "--nats", server.url, name=f"generate {i}")
                for i in range(2)]
        try:
            for g in gens:
                await g.line_with("serving")
            bus = NatsBus(server.url)
            await bus.connect()
            try:
                (env,) = build_actors(load(cfg_path, RunConfig), ["env"], "default")
                served = record(env)
                async with Node(bus, [env], heartbeat_every=0):
                    await until(lambda: known(env.services) == 2, deadline=60,
                                what="the EnvManager to hear from both replicas")
                    ids = await submit(bus, run, 6)
                    await until(lambda: len(by_trajectory(served)) == len(ids), deadline=120,
                                what="a first turn of every trajectory", state=lambda: served)
                    first = dict(by_trajectory(served))
                    spread = collections.Counter(v[-1] for v in first.values())
                    assert sorted(spread.values()) == [3, 3], spread
                    victim_name = next(iter(spread))
                    # a replica's actor name ends in <host>-<pid>-<index>
                    victim = next(g for g in gens if f"-{g.proc.pid}-" in victim_name)
                    victim.kill()
                    done = await collect(bus, run, "rollout.completed", len(ids), deadline=180)
                    dead = await all_stored(bus, run, "dead")
            finally:
                await bus.close()
            assert not dead, [d.reason for d in dead]
            assert {d.traj_id for d in done} == ids
            assert all(d.attempt == 1 for d in done), "no trajectory was run again"
        finally:
            for g in gens:
                g.stop()
    per = by_trajectory(served)
    survivor = {r for v in per.values() for r in v} - {victim_name}
    assert len(survivor) == 1, per
    pinned_to_victim = [tid for tid, v in first.items() if v[-1] == victim_name]
    for tid, replicas in per.items():
        # at most one switch, from the victim to the survivor (a reply of the victim's that
        # was on its way when it was killed may still count)
        k = next((i for i, r in enumerate(replicas) if r != replicas[0]), len(replicas))
        assert set(replicas[k:]) <= survivor, (tid, replicas)
        if tid not in pinned_to_victim:
            assert set(replicas) <= survivor, (tid, replicas)
    # turn 1 never ends a trajectory here: those pinned to the victim needed more turns
    assert any(set(per[tid]) > {victim_name} for tid in pinned_to_victim), per
    assert env.stats.get("affinity_fallbacks", 0) + env.stats.get("affinity_moves", 0) >= 1
