"""Long runs keep bounded bookkeeping (issue 8 item 4): the EnvManager's cancelled groups
and the lock-step barrier's finished waves keep the newest entries up to a cap."""

from __future__ import annotations

import asyncio

from rollart import messages as m
from rollart.actors import env_manager as em_mod
from rollart.actors import lockstep as ls_mod
from rollart.actors.env_manager import EnvManager
from rollart.bus.base import Request
from rollart.bus.codec import encode


async def test_finished_waves_are_capped_newest_kept(monkeypatch):
    monkeypatch.setattr(ls_mod, "CLOSED_WAVES_KEPT", 50)
    ls = ls_mod.LockStep()
    for i in range(500):
        assert ls.join(f"w{i}", 1)
        ls.leave(f"w{i}")
    assert len(ls._closed) == 50 and not ls._waves
    assert ls.join("w499", 1) is False  # a late member of a recent wave still runs alone
    assert ls.join("w0", 1) is True  # long forgotten: a fresh wave


async def test_cancelled_groups_are_capped_newest_kept(monkeypatch):
    monkeypatch.setattr(em_mod, "CANCELLED_GROUPS_KEPT", 40)
    em = EnvManager(run="bounded", envs={}, rollout=None, model_dir="")
    em._cancel_groups, em._live, em._group_of = {}, {}, {}
    live = asyncio.Event()
    em._live["g0-t1"], em._group_of["g0-t1"] = live, "g0"
    for i in range(400):
        cmd = m.CancelGroup(group_id=f"g{i}", keep=[f"g{i}-t0"])
        await em._on_cancel(Request(subject="x", data=encode(cmd)))
    assert live.is_set()  # a running trajectory of a cancelled group was told at once
    assert len(em._cancel_groups) == 40
    assert list(em._cancel_groups)[-1] == "g399" and "g0" not in em._cancel_groups
    assert em._cancel_groups["g399"] == {"g399-t0"}
