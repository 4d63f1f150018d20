"""ReplicaPins: the bookkeeping behind replica-affine turns (placement, caps, counts)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rollart.actors.kernel.replica_pins import AFFINITY_RATIO, AFFINITY_SLACK, ReplicaPins

G = "generate.request"


@dataclass
class R:
    name: str
    others: int = 0


def test_a_key_stays_with_its_replica_and_new_keys_spread_by_pins():
    pins = ReplicaPins()
    a, b = R("a"), R("b")
    first = {pins.place(G, f"t{i}", [a, b]).name for i in range(4)}
    assert first == {"a", "b"}, "new keys go to the replica with the fewest pins"
    for i in range(4):
        owner = pins.get(G, f"t{i}")
        assert all(pins.place(G, f"t{i}", [a, b]).name == owner for _ in range(3))
    assert len(pins) == 4


def test_a_gone_or_saturated_replica_moves_the_key_and_counts_it():
    counted: list[str] = []
    pins = ReplicaPins(count=counted.append)
    a, b = R("a"), R("b")
    pins.pin(G, "t", "a")
    assert pins.place(G, "t", [b]).name == "b" and counted == ["affinity_moves"]
    a.others = 100  # far over AFFINITY_RATIO x the mean + AFFINITY_SLACK
    assert 100 > AFFINITY_RATIO * 50 + AFFINITY_SLACK
    pins.pin(G, "u", "a")
    assert pins.place(G, "u", [a, b]).name == "b" and counted == ["affinity_moves"] * 2
    assert pins.place(G, "v", []) is None


async def test_requests_on_a_replica_count_in_its_load_until_they_end():
    pins = ReplicaPins()
    a = R("a", others=3)
    fut = asyncio.get_running_loop().create_future()
    pins.sent(G, "a", fut)
    pins.sent(G, "a", asyncio.get_running_loop().create_future())
    assert pins.load(G, a) == 5
    fut.set_result(None)
    await asyncio.sleep(0)  # done callbacks run on the next loop iteration
    assert pins.load(G, a) == 4


def test_at_most_max_keys_are_kept_least_recent_first():
    pins = ReplicaPins(max_keys=3)
    for i in range(3):
        pins.pin(G, f"t{i}", "a")
    pins.pin(G, "t0", "a")  # used again: now the most recent
    pins.pin(G, "t3", "b")
    assert len(pins) == 3 and pins.get(G, "t1") is None and pins.get(G, "t0") == "a"
    pins.unpin(G, "t0")
    pins.unpin(G, "t0")  # twice: no error, counts stay right
    pins.unpin(G, "t2")  # now a holds no key, b holds t3
    assert pins.place(G, "new", [R("a"), R("b")]).name == "a"
