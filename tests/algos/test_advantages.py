import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart.algos.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

torch.set_num_threads(1)


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=0), (a, b)


def test_grpo_group_rows():
    # group [1,2,3]: mean 2, unbiased std sqrt((1+0+1)/2) = 1          -> [-1, 0, 1]
    # group [0,0,1,1]: mean .5, unbiased var (4 * .25)/3 = 1/3, std .57735 -> +-0.5/0.57735 = +-0.866025
    adv = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0]]))
    close(adv, [[-1.0, 0.0, 1.0]])
    adv = grpo_advantages(torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    close(adv, [[-0.866025, -0.866025, 0.866025, 0.866025]])


def test_grpo_group_ids_interleaved_and_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 2.0, 1.0, 3.0, 0.0, 1.0])
    groups = ["a", "b", "a", "b", "a", "b", "b"]  # a = [1, 2, 3], b = [0, 1, 0, 1]
    close(grpo_advantages(rewards, groups), [-1.0, -0.866025, 0.0, 0.866025, 1.0, -0.866025, 0.866025])
    # Dr. GRPO: no std division: a -> [-1, 0, 1], b -> [-.5, .5, -.5, .5]
    close(grpo_advantages(rewards, groups, std_normalize=False), [-1.0, -0.5, 0.0, 0.5, 1.0, -0.5, 0.5])
    assert grpo_advantages(rewards, groups).dtype == torch.float32


def test_zero_variance_groups_are_exactly_zero():
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    for fn in (grpo_advantages, rloo_advantages, reinforce_pp_advantages):
        adv = fn(r)
        assert torch.equal(adv, torch.zeros_like(r)), fn.__name__
    # a group of size 1 has no baseline: advantage 0, no NaN
    adv = grpo_advantages(torch.tensor([5.0, 1.0, 2.0]), [0, 1, 1])
    assert not torch.isnan(adv).any()
    assert adv[0].item() == 0.0


def test_rloo_group_size_two():
    # n=2: A1 = r1 - r2, A2 = r2 - r1
    adv = rloo_advantages(torch.tensor([[1.0, 0.0], [0.5, 0.5], [3.0, 1.0]]))
    close(adv, [[1.0, -1.0], [0.0, 0.0], [2.0, -2.0]])


def test_rloo_group_size_three():
    # [1,2,6]: 1 - (2+6)/2 = -3 ; 2 - (1+6)/2 = -1.5 ; 6 - (1+2)/2 = 4.5
    close(rloo_advantages(torch.tensor([1.0, 2.0, 6.0]), [7, 7, 7]), [-3.0, -1.5, 4.5])


def test_reinforce_pp():
    # a = r - group mean = [.5, -.5, 0, 0]; batch mean 0; unbiased std sqrt(.5/3) = .408248
    # -> [.5/.408248, -.5/.408248, 0, 0] = [1.224745, -1.224745, 0, 0]
    adv = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    close(adv, [[1.224745, -1.224745], [0.0, 0.0]])


def test_broadcast_to_tokens():
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 2.0], [0.0, 0.0, -1.0]]))


def test_bad_shapes():
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0]))  # 1-D needs group ids
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0]), [0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=2, max_size=6), min_size=1, max_size=5))
def test_properties(rows):
    size = min(len(r) for r in rows)
    r = torch.tensor([row[:size] for row in rows], dtype=torch.float64)
    dr = grpo_advantages(r, std_normalize=False)
    close(dr.sum(dim=1), torch.zeros(r.shape[0]), tol=1e-9)  # centred per group
    # RLOO = n/(n-1) * (r - mean)
    close(rloo_advantages(r), dr * size / (size - 1), tol=1e-9)
    for fn in (grpo_advantages, rloo_advantages, reinforce_pp_advantages):
        assert torch.isfinite(fn(r)).all()
    assert math.isclose(float(reinforce_pp_advantages(r).sum()), 0.0, abs_tol=1e-6)
