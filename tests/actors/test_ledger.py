"""The group ledger: progress whatever fails, the α bound for every trained group, no group
trained twice, across trainer restarts (a model of admission, envs and the trainer)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given as hypothesis_given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rollart import messages as m
from rollart.actors.groups.ledger import GroupLedger, IndexSet, admissible, reason_kind

LOOP = asyncio.new_event_loop()


def completed(g: int, i: int, min_version: int, reward: float = 0.0) -> m.RolloutCompleted:
    return m.RolloutCompleted(traj_id=f"g{g}-{i}", group_id=f"g{g}", env="main", seed=g,
                              token_ids=[], response_mask=[], logprobs=[], group_index=g,
                              min_version=min_version, max_version=min_version, reward=reward,
                              success=reward >= 1.0)


def ledger(**kw) -> GroupLedger:
    args = dict(group_size=2, redundancy=0, batch_groups=3, alpha=0, stale="wait", breaker=0)
    args.update(kw)
    return GroupLedger(**args)


def test_a_failed_group_does_not_block_later_ones():
    """The reported stall: group 0 fails with groups 1-3 ready → the batch is 1-3, and the
    call after that is not stuck on the closed index 0."""
    led = ledger()
    for i in range(2):
        led.add_dead(f"g0-{i}", 0, "env_setup: boom", LOOP.create_future())
    for g in (1, 2, 3):
        for i in range(2):
            assert led.add_completed(completed(g, i, 0), LOOP.create_future()) is None
    sel = led.select(0)
    assert [g.index for g in sel.failed] == [0]
    assert [g.index for g in sel.batch] == [1, 2, 3]
    for g in sel.failed:
        led.close(g, "failed")
    for g in sel.batch:
        led.close(g, "trained")
    assert led.lost == 1 and led.next_index == 4
    for g in (4, 5, 6):
        for i in range(2):
            led.add_completed(completed(g, i, 1), LOOP.create_future())
    assert [g.index for g in led.select(1).batch] == [4, 5, 6]


def test_cancelled_members_settle_a_group():
    """A CancelGroup for an in-flight group: its members' cancellations close it as failed."""
    led = ledger(batch_groups=1)
    led.add_completed(completed(0, 0, 0), LOOP.create_future())
    led.add_cancelled("g0-1", 0, LOOP.create_future())
    sel = led.select(0)
    assert [g.index for g in sel.failed] == [0] and not sel.batch


def test_breaker_trips_on_consecutive_failures_and_names_the_reason():
    led = ledger(batch_groups=1, breaker=3)
    for g in range(3):
        assert led.tripped() is None
        for i in range(2):
            led.add_dead(f"g{g}-{i}", g, "env_contract: step() returned 3 values", LOOP.create_future())
        for grp in led.select(0).failed:
            led.close(grp, "failed")
    reason = led.tripped()
    assert reason and "env_contract x6" in reason
    led.add_completed(completed(3, 0, 0), LOOP.create_future())
    led.add_completed(completed(3, 1, 0), LOOP.create_future())
    assert led.tripped() is None, "a group that can be trained resets the streak"


def test_index_set_stays_small():
    s = IndexSet()
    for i in [3, 1, 0, 2, 10]:
        s.add(i)
    assert s.low == 4 and s.above == {10} and 10 in s and 5 not in s and len(s) == 5
    assert IndexSet.from_state(s.state()).state() == s.state()


def test_reason_kind():
    assert reason_kind("env_setup: cannot import x") == "env_setup"
    assert reason_kind("failed 5 times; last error NoResponders") == "failed 5 times; last"


class LedgerModel(RuleBasedStateMachine):
    """Admission + envs + trainer over one ledger; trainer restarts replay un-acked events."""

    @initialize(alpha=st.sampled_from([0, 1, 2, 4]), group_size=st.integers(2, 3),
                redundancy=st.integers(0, 1), batch_groups=st.integers(1, 3),
                stale=st.sampled_from(["wait", "drop"]))
    def setup(self, alpha, group_size, redundancy, batch_groups, stale):
        self.kw = dict(group_size=group_size, redundancy=redundancy, batch_groups=batch_groups,
                       alpha=alpha, stale=stale, breaker=0)
        self.alpha, self.stale, self.B = alpha, stale, batch_groups
        self.n = group_size + redundancy
        self.led = GroupLedger(**self.kw)
        self.checkpoint = self.led.state()
        self.version = 0
        self.admitted = 0
        self.sched_lost = 0
        self.pending: list[tuple[int, int, int]] = []  # (group, member, admission version)
        self.events: list[list] = []  # [kind, args, future]
        self.unacked: list[asyncio.Future] = []
        self.trained_groups: set[int] = set()
        self.successes = 0

    def _sync(self):
        self.sched_lost = max(self.sched_lost, self.led.lost)

    def _feed(self, ev) -> None:
        kind, args, fut = ev
        if kind == "completed":
            held = self.led.add_completed(args, fut) is None
        elif kind == "dead":
            held = self.led.add_dead(*args, fut)
        else:
            held = self.led.add_cancelled(*args, fut)
        if not held:
            fut.set_result(None)  # acked at once

    # -- admission ---------------------------------------------------------------
    def _may_admit(self) -> bool:
        return admissible(self.admitted, self.sched_lost, self.version, self.alpha, self.B)

    @precondition(lambda self: self._may_admit())
    @rule()
    def admit(self):
        g = self.admitted
        self.admitted += 1
        self.pending += [(g, i, self.version) for i in range(self.n)]

    # -- envs --------------------------------------------------------------------
    def _outcome(self, kind: str, k: int, spread: int) -> None:
        g, i, a = self.pending.pop(k % len(self.pending))
        if kind == "completed":
            low = a if self.stale == "wait" else max(0, a - self.alpha)
            mv = min(self.version, low + spread)
            ev = ["completed", completed(g, i, mv), LOOP.create_future()]
        elif kind == "dead":
            ev = ["dead", (f"g{g}-{i}", g, "env_contract: bad tuple"), LOOP.create_future()]
        else:
            ev = ["cancelled", (f"g{g}-{i}", g), LOOP.create_future()]
        self.events.append(ev)
        self._feed(ev)

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 1000), spread=st.integers(0, 3))
    def complete(self, k, spread):
        self._outcome("completed", k, spread)

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 1000))
    def fail(self, k):
        self._outcome("dead", k, 0)

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 1000))
    def cancel(self, k):
        self._outcome("cancelled", k, 0)

    # -- trainer -----------------------------------------------------------------
    @rule()
    def train(self):
        sel = self.led.select(self.version)
        for g in sel.failed:
            self.unacked += self.led.close(g, "failed")
        for g in sel.stale:
            assert g.min_version < self.version - self.alpha
            self.unacked += self.led.close(g, "dropped")
        self._sync()
        if not sel.batch:
            return
        for g in sel.batch:
            assert g.index not in self.trained_groups, f"group {g.index} trained twice"
            assert g.min_version >= self.version - self.alpha, \
                f"group {g.index} min_version {g.min_version} at v{self.version} (α={self.alpha})"
            self.trained_groups.add(g.index)
            self.unacked += self.led.close(g, "trained")
        self.version += 1
        self.checkpoint = self.led.state()  # checkpoint_every = 1, then acks
        for f in self.unacked:
            f.done() or f.set_result(None)
        self.unacked = []
        self._sync()

    @rule()
    def restart_trainer(self):
        """kill -9: what no checkpoint acked is redelivered to a trainer resumed from it."""
        self.led = GroupLedger(**self.kw)
        self.led.load(self.checkpoint)
        self.unacked = []
        replay = []
        for ev in self.events:
            if not ev[2].done():
                ev[2].cancel()
                replay.append([ev[0], ev[1], LOOP.create_future()])
        self.events = [e for e in self.events if e[2].done() and not e[2].cancelled()] + replay
        for ev in replay:
            self._feed(ev)

    # -- progress ----------------------------------------------------------------
    @invariant()
    def never_stuck(self):
        """Something can always move: an env outcome, an admission, or a training step
        (after the trainer closes failed and stale groups)."""
        if not hasattr(self, "led") or self.pending or self._may_admit():
            return
        probe = GroupLedger(**self.kw)
        probe.load(self.led.state())
        probe.open = dict(self.led.open)
        sel = probe.select(self.version)
        lost_now = self.led.lost + len(sel.failed) + len(sel.stale)
        assert sel.batch or admissible(self.admitted, max(self.sched_lost, lost_now),
                                       self.version, self.alpha, self.B), (
            f"stuck at v{self.version}: admitted {self.admitted}, lost {self.sched_lost}, "
            f"open {sorted(self.led.open)}, next {self.led.next_index}")


LedgerModel.TestCase.settings = settings(max_examples=150, stateful_step_count=80, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_ledger_model = LedgerModel.TestCase


@pytest.mark.parametrize("alpha", [0, 1, 2, 4])
def test_all_groups_trainable_reach_every_step(alpha):
    """A deterministic run where every third group fails: steps keep coming."""
    led = ledger(alpha=alpha, batch_groups=2)
    v, admitted, lost = 0, 0, 0
    for _ in range(200):
        while admissible(admitted, lost, v, alpha, 2):
            g = admitted
            admitted += 1
            for i in range(2):
                if g % 3 == 0:
                    led.add_dead(f"g{g}-{i}", g, "env_reset_failed: x", LOOP.create_future())
                else:
                    led.add_completed(completed(g, i, v), LOOP.create_future())
        sel = led.select(v)
        for g in sel.failed:
            led.close(g, "failed")
        lost = led.lost
        if sel.batch:
            assert all(g.min_version >= v - alpha for g in sel.batch)
            for g in sel.batch:
                led.close(g, "trained")
            v += 1
    assert v >= 50


def test_the_ledger_owns_the_transitions_the_trainer_asks_for():
    """Counters, verdicts and re-admissions change only through the ledger's methods."""
    led = ledger()
    led.not_admitted()
    assert led.counts["not_admitted"] == 1
    a, b = LOOP.create_future(), LOOP.create_future()
    assert led.add_completed(completed(0, 0, 0), a) is None
    forged = m.RolloutCompleted(**{**{f: getattr(completed(0, 0, 0), f)
                                      for f in completed(0, 0, 0).__struct_fields__}, "reward": 9.0})
    assert led.add_completed(forged, b) is None  # a conflict: both held, both with a verdict
    assert led.take_verdict(a).startswith("conflict:") and led.take_verdict(a) is None
    led.readmitted(10**9 + 7, "g000007-r1", 7)
    assert led.restarted[10**9 + 7] == ("g000007-r1", 7)
    c = LOOP.create_future()
    assert led.add_completed(completed(1, 0, 0), c) is None
    handed = led.hand_back()  # the trainer stops: every held delivery comes back
    assert set(handed) == {a, b, c} and not led.open and not led.verdicts


def _fill(led: GroupLedger, g: int, rewards: list[float], v: int = 0) -> None:
    for i, r in enumerate(rewards):
        assert led.add_completed(completed(g, i, v, reward=r), LOOP.create_future()) is None


@pytest.mark.parametrize("stale", ["wait", "drop"])
def test_uniform_groups_are_skipped_up_to_the_budget(stale):
    """trainer.skip_uniform: the oldest uniform groups are passed over (lost: admission
    replaces them), at most ``skip`` of them; past the budget they are trained."""
    led = ledger(stale=stale, batch_groups=2)
    _fill(led, 0, [0.0, 0.0])  # uniform
    _fill(led, 1, [1.0, 1.0])  # uniform (all succeeded)
    _fill(led, 2, [0.0, 1.0])
    _fill(led, 3, [1.0, 1.0])  # uniform, past a budget of 2
    sel = led.select(0, skip=2)
    assert [g.index for g in sel.skipped] == [0, 1]
    assert [g.index for g in sel.batch] == [2, 3]
    assert [g.index for g in led.select(0).batch] == [0, 1], "skip=0 (off) trains them"
    for g in sel.skipped:
        led.close(g, "skipped")
    assert led.lost == 2 and led.counts["uniform_skipped"] == 2 and led.streak == 0
    assert [g.index for g in led.select(0, skip=0).batch] == [2, 3]


def test_skip_which_failed_keeps_groups_that_all_succeeded():
    led = ledger(batch_groups=2)
    _fill(led, 0, [1.0, 1.0])  # uniform, every member succeeded: trained
    _fill(led, 1, [0.0, 0.0])  # uniform, none did: skipped
    _fill(led, 2, [0.0, 1.0])
    sel = led.select(0, skip=4, which="failed")
    assert [g.index for g in sel.skipped] == [1] and [g.index for g in sel.batch] == [0, 2]


def test_a_uniform_group_is_skipped_before_the_batch_is_ready():
    """A skipped group frees its admission place at once, not when a batch is complete:
    otherwise admission, bounded by α, could wait for the trainer that waits for it."""
    led = ledger(batch_groups=2)
    _fill(led, 0, [0.0, 0.0])
    _fill(led, 1, [0.0])  # still running
    sel = led.select(0, skip=4)
    assert not sel.batch and [g.index for g in sel.skipped] == [0]


@pytest.mark.parametrize("alpha", [0, 1])
def test_skipping_keeps_steps_coming_and_the_bound(alpha):
    """Admission at the α bound, 3 of 4 groups uniform, a budget of 3 a step: every step
    comes, none skips more than its budget, and every trained group keeps the bound."""
    B, skip = 2, 3
    led = ledger(alpha=alpha, batch_groups=B)
    v, admitted, skipped_total = 0, 0, 0
    for _ in range(300):
        while admissible(admitted, led.lost, v, alpha, B):
            g = admitted
            admitted += 1
            _fill(led, g, [0.0, 1.0] if g % 4 == 3 else [0.0, 0.0], v)
        step_skipped = 0
        while True:
            sel = led.select(v, skip=skip - step_skipped)
            for g in sel.skipped:
                led.close(g, "skipped")
            step_skipped += len(sel.skipped)
            if sel.batch or not sel.skipped:
                break
        assert step_skipped <= skip
        skipped_total += step_skipped
        if sel.batch:
            assert all(g.min_version >= v - alpha for g in sel.batch)
            for g in sel.batch:
                led.close(g, "trained")
            v += 1
    assert v >= 50 and skipped_total > v, (v, skipped_total)


def _one_step(kinds: list[str], order: list[int], *, eager: bool, batch: int, skip: int,
              group_size: int = 2) -> tuple[list[int], list[int]]:
    """One step's selection (``stale: wait``) with the members of groups of ``kinds``
    (``uniform``, ``mixed`` or ``failed``) arriving in ``order`` (indices into the members),
    the selection made after every arrival as the trainer does; with ``eager``,
    :meth:`GroupLedger.skim` first. Returns (trained, skipped) group indices."""
    led = ledger(batch_groups=batch, group_size=group_size)
    members = [(g, i) for g in range(len(kinds)) for i in range(group_size)]
    skipped: list[int] = []
    for k in order:
        g, i = members[k]
        if kinds[g] == "failed":
            led.add_dead(f"g{g}-{i}", g, "env_setup: boom", LOOP.create_future())
        else:
            reward = float(kinds[g] == "mixed" and i == 0)
            led.add_completed(completed(g, i, 0, reward=reward), LOOP.create_future())
        if eager:
            for grp in led.skim(0, skip=skip - len(skipped)):
                led.close(grp, "skipped")
                skipped.append(grp.index)
        sel = led.select(0, skip=skip - len(skipped))
        for grp in sel.skipped:
            led.close(grp, "skipped")
            skipped.append(grp.index)
        for grp in sel.failed:
            led.close(grp, "failed")
        if sel.batch:
            return [grp.index for grp in sel.batch], skipped
    return [], skipped


@settings(max_examples=300, deadline=None)
@hypothesis_given(data=st.data())
def test_skim_skips_only_what_selection_in_order_would(data):
    """``stale: wait`` takes groups in index order, so a uniform group that is in before the
    groups ahead of it waited for them to be skipped (and replaced). :meth:`skim` skips it at
    once when selection is sure to: whatever order the members arrive in, the step trains
    and skips exactly the groups it did without skimming."""
    batch = data.draw(st.integers(1, 4), label="batch")
    skip = data.draw(st.integers(1, 5), label="skip")
    kinds = data.draw(st.lists(st.sampled_from(["uniform", "mixed", "mixed", "failed"]),
                               min_size=batch + skip + 2, max_size=batch + skip + 6), label="kinds")
    order = data.draw(st.permutations(range(2 * len(kinds))), label="order")
    lazy = _one_step(kinds, order, eager=False, batch=batch, skip=skip)
    eager = _one_step(kinds, order, eager=True, batch=batch, skip=skip)
    assert eager[0] == lazy[0]
    assert sorted(eager[1]) == sorted(lazy[1])


def test_skim_does_not_wait_for_the_groups_ahead():
    """The measured case: group 1 is uniform and in while group 0 still runs. Selection in
    order skips it only once group 0 is in; skim skips it now, and never past the budget or
    a batch that the groups ahead could fill."""
    led = ledger(batch_groups=2)
    _fill(led, 0, [0.0])  # one member still running
    _fill(led, 1, [0.0, 0.0])
    _fill(led, 2, [0.0, 0.0])
    assert not led.select(0, skip=4).skipped, "in order: waits for group 0"
    assert [g.index for g in led.skim(0, skip=4)] == [1, 2]
    assert [g.index for g in led.skim(0, skip=2)] == [1], "group 0 may take the budget's last place"
    assert led.skim(0, skip=1) == [], "group 0 may be uniform: the one place is its"
    narrow = ledger(batch_groups=1)
    _fill(narrow, 0, [0.0])
    _fill(narrow, 1, [0.0, 0.0])
    assert narrow.skim(0, skip=4) == [], "group 0 may fill the batch: group 1 is then not this step's"


def test_a_rerun_after_a_kill_leaves_the_stored_copy_to_be_trained():
    """An env node killed between publishing an outcome and acking its request: the request
    comes again (attempt 2), the trajectory runs again with other tokens, and that copy comes
    under a fresh msg id. The first copy stands and is trained; the rerun is acked and
    counted. A copy with a *lower* attempt after a later one is still a conflict (a forger
    cannot push a held copy out by claiming an earlier attempt), as is another copy of the
    same attempt."""
    led = ledger()
    first = completed(0, 0, 0)
    rerun = m.RolloutCompleted(**{**{f: getattr(first, f) for f in first.__struct_fields__},
                                  "reward": 1.0, "attempt": 2})
    a, b = LOOP.create_future(), LOOP.create_future()
    assert led.add_completed(first, a) is None
    assert led.add_completed(rerun, b) == "reruns"
    assert led.counts["reruns"] == 1 and led.counts["conflicts"] == 0
    assert [t for t, _ in led.open[0].members] == [first] and not led.verdicts
    # the other way round: the held copy is attempt 2; an "attempt 1" after it conflicts
    led2 = ledger()
    assert led2.add_completed(rerun, LOOP.create_future()) is None
    assert led2.add_completed(first, LOOP.create_future()) is None
    assert led2.counts["conflicts"] == 2 and not led2.open[0].members
    # two different copies of one attempt: a conflict, as before
    led3 = ledger()
    twin = m.RolloutCompleted(**{**{f: getattr(rerun, f) for f in rerun.__struct_fields__},
                                 "reward": 0.5})
    assert led3.add_completed(rerun, LOOP.create_future()) is None
    assert led3.add_completed(twin, LOOP.create_future()) is None
    assert led3.counts["conflicts"] == 2


def test_a_rerun_after_its_group_was_trained_is_acked_not_reported_as_forged():
    """The rerun's copy may come after the first copy's group was trained: acked and
    counted as a rerun; a different copy claiming the same attempt is still a conflict."""
    led = ledger(group_size=1, batch_groups=1)
    first = completed(0, 0, 0)
    assert led.add_completed(first, LOOP.create_future()) is None
    sel = led.select(0)
    assert [g.index for g in sel.batch] == [0]
    led.close(sel.batch[0], "trained")
    rerun = m.RolloutCompleted(**{**{f: getattr(first, f) for f in first.__struct_fields__},
                                  "reward": 1.0, "attempt": 2})
    assert led.add_completed(rerun, LOOP.create_future()) == "reruns"
    forged = m.RolloutCompleted(**{**{f: getattr(first, f) for f in first.__struct_fields__},
                                   "reward": 1.0})
    assert led.add_completed(forged, LOOP.create_future()) == "conflicts"
    assert led.add_completed(first, LOOP.create_future()) == "late"
