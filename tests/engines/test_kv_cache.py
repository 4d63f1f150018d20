"""Per-session KV reuse: the cache never changes a token or a log-prob, only the work done.

Every engine test compares an engine with the cache against one without it (kv_cache_mb=0),
same seed, same calls: tokens identical, log-probs within 1e-5.
"""

from __future__ import annotations

import random

import pytest
import torch

from rollart.engines.base import GenInput
from rollart.engines.kv_cache import SessionKVCache

from .test_torch_engine import actions, new_engine, prompts  # noqa: F401 (fixtures)

TOL = 1e-5


def assert_same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=TOL)


def both(tiny_model_dir, seed=0, **kw):
    return (new_engine(tiny_model_dir, seed=seed, **kw),
            new_engine(tiny_model_dir, seed=seed, kv_cache_mb=0))


def step_both(cached, plain, inputs, **kw):
    a = cached.generate(inputs, **kw)
    b = plain.generate(inputs, **kw)
    assert_same(a, b)
    return a


# ---------------------------------------------------------------------------- the LRU alone
def kv(n, heads=2, dim=4, fill=0.0):
    t = torch.full((1, heads, n, dim), fill)
    return [(t, t.clone()), (t.clone(), t.clone())]


def test_lru_get_put_and_prefix_rules():
    c = SessionKVCache(max_bytes=10**6)
    assert c.get("a", [1, 2, 3]) == (None, 0)
    assert c.put("a", [1, 2, 3, 4], kv(4))
    entry, reuse = c.get("a", [1, 2, 3, 4, 5, 6])
    assert entry.tokens == (1, 2, 3, 4) and reuse == 4
    assert c.get("a", [1, 2, 9, 9])[1] == 2  # common prefix only
    assert c.get("a", [1, 2, 3, 4])[1] == 3  # one token is always left to feed
    assert c.get("a", [1])[1] == 0  # nothing can be reused for a 1-token prompt
    assert c.get("a", [7, 2, 3])[1] == 0
    assert (c.hits, c.misses) == (3, 3)
    assert c.reused_tokens == 4 + 2 + 3
    assert c.prefilled_tokens == 3 + (6 - 4) + (4 - 2) + (4 - 3) + 1 + 3
    assert c.bytes == 4 * (2 * 4 * 4) * 4  # 4 tensors (2 layers, K and V) of 2x4x4 float32
    c.drop(["a", "unknown"])
    assert len(c) == 0 and c.bytes == 0


def test_lru_evicts_least_recently_used_within_the_cap():
    size = sum(t.numel() * t.element_size() for kvs in kv(5) for t in kvs)
    c = SessionKVCache(max_bytes=int(2.5 * size))
    for s in "abc":
        c.put(s, range(5), kv(5))
        assert c.bytes <= c.max_bytes
    assert "a" not in c and "b" in c and "c" in c and c.evictions == 1
    c.get("b", range(9))  # b is now the most recent: d evicts c
    c.put("d", range(5), kv(5))
    assert set("bd") == {s for s in "abcd" if s in c} and c.evictions == 2
    c.put("b", range(5), kv(5))  # replacing an entry does not evict another
    assert c.evictions == 2 and c.bytes == 2 * size
    assert not c.put("big", range(20), kv(20))  # larger than the whole cap: not stored
    assert "big" not in c and c.bytes == 2 * size
    c.clear()
    assert len(c) == 0 and c.bytes == 0


def test_lru_rejects_bad_entries():
    c = SessionKVCache(max_bytes=10**6)
    with pytest.raises(ValueError, match="cached positions"):
        c.put("a", [1, 2, 3], kv(4))
    with pytest.raises(ValueError, match="session"):
        c.put("", [1], kv(1))
    with pytest.raises(ValueError, match="max_bytes"):
        SessionKVCache(-1)


# ---------------------------------------------------------------------------- the engine
def test_defaults(tiny_model_dir):
    assert GenInput([1, 2]).session == ""
    with pytest.raises(ValueError, match="kv_cache_mb"):
        new_engine(tiny_model_dir, kv_cache_mb=-1)
    off = new_engine(tiny_model_dir, kv_cache_mb=0)
    off.generate([GenInput([5, 6, 7], max_new_tokens=2, session="s")])
    assert off.kv_stats()["hits"] == off.kv_stats()["misses"] == 0


def _turn_input(j, prompt, turn, choices):
    """Row j's input: a mix of free sampling, greedy, top-p, and constrained rows; most with
    a session, some without (never reused)."""
    session = "" if j % 5 == 4 else f"traj-{j}"
    kind = (j + turn) % 4
    if kind == 0:
        return GenInput(prompt, choices=choices, session=session)
    if kind == 1:
        return GenInput(prompt, max_new_tokens=3 + j % 5, session=session)
    if kind == 2:
        return GenInput(prompt, max_new_tokens=6, greedy=True, session=session)
    return GenInput(prompt, max_new_tokens=5, top_p=0.8, temperature=1.3, session=session)


def test_multi_turn_rollout_equals_uncached(tiny_model_dir, prompts, actions):  # noqa: F811
    cached, plain = both(tiny_model_dir, seed=3)
    rng = random.Random(0)
    rows = [list(prompts[j % len(prompts)]) + [3 + j] * j for j in range(9)]  # lengths differ
    choices = actions + [[7, 8], [7, 9, 10]]  # multi-token choices too (7 is no action)
    for turn in range(4):
        order = list(range(len(rows)))
        rng.shuffle(order)  # a trajectory is at a different batch row every turn
        if turn == 2:
            order = order[:5]  # some trajectories wait a turn
        inputs = [_turn_input(j, rows[j], turn, choices if j % 2 else actions) for j in order]
        outs = step_both(cached, plain, inputs)
        for j, o in zip(order, outs):
            obs = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 6))]
            rows[j] = rows[j] + o.token_ids + obs
        if turn == 1:  # new trajectories join (misses in a batch with hits)
            rows += [list(prompts[k]) for k in range(3)]
    st = cached.kv_stats()
    assert st["hits"] >= 15 and st["misses"] >= 10
    assert st["reused_tokens"] > 2 * st["prefilled_tokens"]
    assert 0 < st["bytes"] <= st["max_bytes"]
    assert plain.kv_stats()["hits"] == 0


def test_diverging_prompt_reuses_the_common_prefix_only(tiny_model_dir, prompts):  # noqa: F811
    cached, plain = both(tiny_model_dir)
    p = list(prompts[3])
    first = step_both(cached, plain, [GenInput(p, max_new_tokens=5, session="x")])[0]
    seen = p + first.token_ids[:-1]
    for new in (
        p[:10] + [11, 12, 13],  # diverges inside the prompt
        p + [(first.token_ids[0] + 1) % 300, 40],  # diverges at the response
        p,  # the same prompt again: all but its last token reused
        p[:6],  # shorter than what is cached
    ):
        before = cached.kv_stats()
        step_both(cached, plain, [GenInput(new, max_new_tokens=4, session="x"),
                                  GenInput(p[:8], max_new_tokens=4)])
        common = next((k for k, (a, b) in enumerate(zip(seen, new)) if a != b),
                      min(len(seen), len(new)))
        after = cached.kv_stats()
        assert after["reused_tokens"] - before["reused_tokens"] == min(common, len(new) - 1)
        seen = list(cached.kv_sessions()["x"])


def test_loading_weights_clears_the_cache(tiny_model_dir, prompts):  # noqa: F811
    cached, plain = both(tiny_model_dir)
    p = list(prompts[0])
    out = step_both(cached, plain, [GenInput(p, max_new_tokens=4, session="w")])[0]
    assert cached.kv_stats()["sessions"] == 1
    gen = torch.Generator().manual_seed(5)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=gen)
          for k, v in cached.model.state_dict().items()}
    for eng in (cached, plain):
        eng.load_state_dict(sd, version=1)
    st = cached.kv_stats()
    assert st["sessions"] == 0 and st["bytes"] == 0
    nxt = p + out.token_ids + [9, 10]
    step_both(cached, plain, [GenInput(nxt, max_new_tokens=4, session="w")])
    assert cached.kv_stats()["hits"] == 0


def test_byte_cap_evicts_lru(tiny_model_dir, prompts):  # noqa: F811
    # One entry of the 4-layer test model is 4 layers x 2 x 2 kv heads x 32 x 4 bytes = 2 KiB
    # per token; the cap fits about two 30-token sessions.
    cached, plain = both(tiny_model_dir, kv_cache_mb=130 / 1024)
    p = [5 + k for k in range(30)]
    inputs = [GenInput([s] + p, max_new_tokens=1, greedy=True, session=f"s{s}")
              for s in range(5)]
    step_both(cached, plain, inputs)
    st = cached.kv_stats()
    assert st["evictions"] >= 2 and st["sessions"] <= 2 and st["bytes"] <= st["max_bytes"]
    # the most recently stored sessions survive (rows are stored in input order)
    assert "s4" in cached.kv_sessions() and "s0" not in cached.kv_sessions()
    step_both(cached, plain, [GenInput(i.prompt_ids + [60], max_new_tokens=2, session=i.session)
                              for i in inputs])
    assert cached.kv_stats()["bytes"] <= cached.kv_stats()["max_bytes"]


def test_interrupted_and_failed_rows_are_not_stored(tiny_model_dir, prompts, monkeypatch):  # noqa: F811
    cached, plain = both(tiny_model_dir)
    inputs = [GenInput(list(prompts[k]), max_new_tokens=6, session=f"i{k}") for k in range(3)]
    outs = step_both(cached, plain, inputs, stop_rows={1})
    assert outs[1].finish_reason == "interrupted" and outs[0].finish_reason != "interrupted"
    assert set(cached.kv_sessions()) == {"i0", "i2"}
    cached.forget(["i0", "nobody"])
    assert set(cached.kv_sessions()) == {"i2"} and cached.kv_stats()["sessions"] == 1

    # A batch that raises stores nothing, not even the rows that had finished.
    calls = {"n": 0}
    forward = cached.model.forward

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return forward(*a, **kw)

    monkeypatch.setattr(cached.model, "forward", failing)
    batch = [GenInput([3, 4, 5], max_new_tokens=1, session="f0"),
             GenInput([3, 4, 6], choices=[[10, 11, 12, 13, 14]], session="f1")]
    with pytest.raises(RuntimeError, match="boom"):
        cached.generate(batch)
    assert not {"f0", "f1"} & set(cached.kv_sessions())


def test_clear_kv_drops_every_session(tiny_model_dir, prompts):  # noqa: F811
    cached, plain = both(tiny_model_dir)
    inputs = [GenInput(list(prompts[k]), max_new_tokens=4, session=f"c{k}") for k in range(2)]
    outs = step_both(cached, plain, inputs)
    assert cached.kv_stats()["sessions"] == 2
    assert cached.clear_kv() == 2 and plain.clear_kv() == 0
    st = cached.kv_stats()
    assert st["sessions"] == 0 and st["bytes"] == 0 and st["misses"] == 2  # counters kept
    nxt = [GenInput(i.prompt_ids + o.token_ids + [9, 10], max_new_tokens=4, session=i.session)
           for i, o in zip(inputs, outs)]
    step_both(cached, plain, nxt)  # same tokens and log-probs as without a cache
    after = cached.kv_stats()
    assert after["hits"] == st["hits"] and after["reused_tokens"] == st["reused_tokens"]
    assert after["misses"] - st["misses"] == 2  # every row prefilled from scratch
    assert after["prefilled_tokens"] - st["prefilled_tokens"] == sum(len(i.prompt_ids)
                                                                     for i in nxt)
