"""Long runs keep bounded bookkeeping (issue 8 item 4): the cancelled groups (of the
EnvManager and the LLMProxy) and the lock-step barrier's finished waves keep the newest
entries up to a cap."""

from __future__ import annotations

from rollart import messages as m
from rollart.actors.kernel import cancelled as cancelled_mod
from rollart.actors.env import lockstep as ls_mod
from rollart.actors.env.manager import EnvManager
from rollart.bus.base import Request
from rollart.bus.codec import encode


async def test_finished_waves_are_capped_newest_kept(monkeypatch):
    monkeypatch.setattr(ls_mod, "CLOSED_WAVES_KEPT", 50)
    ls = ls_mod.LockStep()
    for i in range(500):
        assert ls.join(f"w{i}", 1)
        ls.leave(f"w{i}")
    assert len(ls.finished) == 50 and not ls.waves
    assert ls.join("w499", 1) is False  # a late member of a recent wave still runs alone
    assert ls.join("w0", 1) is True  # long forgotten: a fresh wave


async def test_cancelled_groups_are_capped_newest_kept(monkeypatch):
    monkeypatch.setattr(cancelled_mod, "CANCELLED_GROUPS_KEPT", 40)
    em = EnvManager(run="bounded", envs={}, rollout=None, model_dir="")
    live = em.running.start("g0-t1", "g0")
    for i in range(400):
        cmd = m.CancelGroup(group_id=f"g{i}", keep=[f"g{i}-t0"])
        await em._on_cancel(Request(subject="x", data=encode(cmd)))
    assert live.is_set()  # a running trajectory of a cancelled group was told at once
    assert len(em.cancelled) == 40
    assert list(em.cancelled)[-1] == "g399" and "g0" not in em.cancelled
    assert em.cancelled.keeps("g399") == {"g399-t0"}
    assert em.cancelled.cancels("g399", "g399-t1") and not em.cancelled.cancels("g399", "g399-t0")


def test_cancelled_groups_reinsert_a_group_as_the_newest():
    groups = cancelled_mod.CancelledGroups(kept=2)
    groups.add("a", ["a-0"])
    groups.add("b", [])
    groups.add("a", ["a-1"])  # cancelled again: now the newest, with the new keep set
    groups.add("c", [])
    assert list(groups) == ["a", "c"] and groups.keeps("a") == {"a-1"}
    assert not groups.cancels("x", "x-0")  # a group never cancelled cancels nothing
