"""The reasoning-gym scorer rebuilds an env from arguments a reward request names: they are
decoded typed and bounded, so a request cannot make the scorer build a huge dataset or pass
arbitrary keywords (issue 43, audit)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart.actors.reward.actor import _rg_args, reasoning_gym_score


def meta(args, seed="3"):
    return {"env_args": args if isinstance(args, str) else json.dumps(args), "seed": seed}


@pytest.mark.parametrize("args, why", [
    ({"dataset": "basic_arithmetic", "heldout": 10**9}, "heldout"),
    ({"dataset": "basic_arithmetic", "size": 10**12}, "size"),
    ({"dataset": "../../etc"}, "dataset"),
    ({"dataset": "basic_arithmetic", "__class__": 1}, "unknown field"),
    ({"dataset": "basic_arithmetic", "dataset_args": {"k": {"nested": 1}}}, "dataset_args"),
    ("x" * 20000, "characters"),
])
def test_hostile_env_args_are_refused_by_name(args, why):
    with pytest.raises(ValueError, match=why):
        reasoning_gym_score("1", "1", meta(args))


def test_a_non_integer_seed_is_refused():
    args = {"dataset": "basic_arithmetic", "size": 10, "heldout": 1}
    with pytest.raises(ValueError, match="seed"):
        reasoning_gym_score("1", "1", meta(args, seed="1" * 5000))


def test_the_configs_arguments_still_decode():
    a = _rg_args(json.dumps({"dataset": "basic_arithmetic", "binary": True,
                             "dataset_args": {"min_terms": 3, "operators": ["+"]}}))
    assert a.dataset == "basic_arithmetic" and a.dataset_args["operators"] == ["+"]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                              max_leaves=20).map(json.dumps)))
def test_fuzzed_env_args_decode_or_are_refused_by_name(raw):
    try:
        _rg_args(raw)
    except ValueError as e:
        assert "reasoning_gym scorer" in str(e)
