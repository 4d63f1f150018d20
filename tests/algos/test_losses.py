import math

import pytest
import torch

from rollart.algos.losses import LossConfig, entropy_from_logits, kl_k3, policy_loss
from rollart.algos.reduce import agg_units, aggregate, masked_mean, masked_sum

torch.set_num_threads(1)
LN2 = math.log(2.0)


def one_token(ratio, adv, **kw):
    """Loss and d loss / d logp for a single token with old_logp = 0, logp = log(ratio)."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                          torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), m


# per token: l = -min(r*A, clip(r)*A); unclipped branch -> dl/dlogp = -A*r, clipped -> 0
@pytest.mark.parametrize("ratio,adv,kw,loss,grad,clipped", [
    (1.5, 1.0, {}, -1.2, 0.0, 1.0),           # A>0 above 1+0.2: clipped at 1.2
    (0.5, 1.0, {}, -0.5, -0.5, 0.0),          # A>0 below 1-0.2: min(0.5, 0.8) = 0.5 -> unclipped
    (1.5, -1.0, {}, 1.5, 1.5, 0.0),           # A<0 above: min(-1.5, -1.2) = -1.5 -> unclipped
    (0.5, -1.0, {}, 0.8, 0.0, 1.0),           # A<0 below: min(-0.5, -0.8) = -0.8 -> clipped
    (1.25, 1.0, {"clip_high": 0.28}, -1.25, -1.25, 0.0),  # clip-higher: 1.25 < 1.28
    (1.25, 1.0, {"clip_high": 0.2}, -1.2, 0.0, 1.0),
    (0.75, -1.0, {"clip_low": 0.2}, 0.8, 0.0, 1.0),       # 0.75 < 0.8: clipped
    (0.75, -1.0, {"clip_low": 0.3}, 0.75, 0.75, 0.0),     # 0.75 > 0.7: unclipped
    (1.1, 2.0, {}, -2.2, -2.2, 0.0),          # inside the range
])
def test_clip_edges(ratio, adv, kw, loss, grad, clipped):
    got_loss, got_grad, m = one_token(ratio, adv, **kw)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)
    assert m["clip_frac"] == clipped
    assert m["ratio_mean"] == pytest.approx(ratio)
    # k3 of KL(old || new): r - 1 - log r
    assert m["approx_kl"] == pytest.approx(ratio - 1 - math.log(ratio))


def is_case(**kw):
    # three tokens, r = 1 (logp = old), A = 1 -> l_t = -w_t; rho = exp(old - behav) = [1, 2, 0.5]
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    behav = torch.tensor([[0.0, -LN2, LN2]], dtype=torch.float64)
    loss, m = policy_loss(logp, torch.zeros(1, 3, dtype=torch.float64), torch.ones(1), torch.ones(1, 3),
                          behav_logp=behav, **kw)
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), m


def test_truncated_is_at_and_above_cap():
    # cap 1: rho=1 is exactly at the cap (kept, not counted as capped), rho=2 -> 1, rho=.5 -> .5
    # loss = -(1 + 1 + .5)/3 = -0.833333 ; grad_t = -w_t / 3
    loss, grad, m = is_case(is_cap=1.0)
    assert loss == pytest.approx(-2.5 / 3)
    assert grad == pytest.approx([-1 / 3, -1 / 3, -0.5 / 3])
    assert m["is_weight_mean"] == pytest.approx(2.5 / 3)
    assert m["is_capped_frac"] == pytest.approx(1 / 3)


def test_is_without_cap():
    # w = rho = [1, 2, .5] -> loss = -3.5/3
    loss, _, m = is_case()
    assert loss == pytest.approx(-3.5 / 3)
    assert m["is_capped_frac"] == 0.0


def test_decoupled_drops_tokens_above_cap():
    # AReaL: w = rho if rho <= cap else 0 -> [1, 0, .5]; loss = -1.5/3 = -0.5
    loss, grad, m = is_case(is_cap=1.0, decoupled=True)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx([-1 / 3, 0.0, -0.5 / 3])
    assert m["is_weight_mean"] == pytest.approx(0.5)
    assert m["is_capped_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), decoupled=True)


def test_is_weight_is_detached_and_ratio_uses_old():
    # ratio 2 against old, rho = exp(old - behav) = 0.5, cap 4; A = -1: min(-2, -1.2) = -2 (unclipped)
    # l = -0.5 * -2 = 1.0 ; dl/dlogp = -w*A*r = 0.5*1*2 = 1.0
    logp = torch.tensor([[LN2]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, old, -torch.ones(1), torch.ones(1, 1), behav_logp=torch.tensor([[LN2]]),
                          is_cap=4.0)
    loss.backward()
    assert loss.item() == pytest.approx(1.0)
    assert logp.grad.item() == pytest.approx(1.0)
    assert old.grad is None


def agg_case(agg):
    # r = 1 so l_t = -A_b: seq 0 has 3 tokens with A=1 (l=-1), seq 1 has 1 token with A=-2 (l=+2),
    # seq 2 has no response tokens (ignored)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    logp = torch.zeros(3, 4)
    loss, _ = policy_loss(logp, logp, torch.tensor([1.0, -2.0, 5.0]), mask, agg=agg)
    return loss.item()


def test_aggregation_modes():
    assert agg_case("token-mean") == pytest.approx((-3 + 2) / 4)          # -0.25
    assert agg_case("seq-mean-token-mean") == pytest.approx((-1 + 2) / 2)  # 0.5
    assert agg_case("seq-mean-token-sum") == pytest.approx((-3 + 2) / 2)   # -0.5
    with pytest.raises(ValueError, match="token-mean"):
        agg_case("sum")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_agg_units_make_split_batches_exact(agg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g)
    mask = (torch.rand(5, 6, generator=g) > 0.4).int()
    mask[2] = 0
    full = aggregate(x, mask, agg)
    total = agg_units(mask, agg)
    parts = [(x[:2], mask[:2]), (x[2:3], mask[2:3]), (x[3:], mask[3:])]
    split = sum(aggregate(xi, mi, agg) * agg_units(mi, agg) / total for xi, mi in parts)
    assert split.item() == pytest.approx(full.item(), abs=1e-6)


def test_zero_advantages_give_zero_loss_no_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(logp, logp.detach(), torch.zeros(2), torch.ones(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in m.values())
    # an empty mask gives 0, not NaN, in every mode
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), agg).item() == 0.0


def test_masked_helpers():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_sum(x, m).item() == 4.0
    assert masked_mean(x, m).item() == 2.0
    assert masked_mean(x, m, dim=-1).tolist() == [2.0, 0.0]


def test_kl_k3():
    # d = ref - logp. token 0: d = log(.25) - log(.5) = -ln2 -> .5 + ln2 - 1 = 0.193147
    # token 1: d = 0 -> 0 ; token 2: d = +ln2 -> 2 - ln2 - 1 = 0.306853 (masked out)
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))
    assert kl_k3(logp, ref, torch.tensor([[1, 1, 0]])).item() == pytest.approx(0.193147 / 2, abs=1e-6)
    assert kl_k3(logp, ref, torch.tensor([[0, 0, 1]])).item() == pytest.approx(0.306853, abs=1e-6)


def test_entropy_from_logits():
    # uniform over 4 -> ln 4 = 1.386294 ; two finite logits equal, rest -inf -> ln 2 = 0.693147
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [3.0, -math.inf, -math.inf, 3.0]]])
    assert entropy_from_logits(logits, torch.tensor([[1, 0]])).item() == pytest.approx(1.386294, abs=1e-6)
    assert entropy_from_logits(logits, torch.tensor([[0, 1]])).item() == pytest.approx(0.693147, abs=1e-6)
    assert entropy_from_logits(logits, torch.ones(1, 2)).item() == pytest.approx((1.386294 + 0.693147) / 2)


def test_loss_config_validation():
    assert not LossConfig().uses_behav
    assert LossConfig(is_cap=2.0).uses_behav
    assert not LossConfig(old_logp="behav", is_cap=2.0).uses_behav
    with pytest.raises(ValueError, match="seq-mean-token-sum"):
        LossConfig(agg="mean")
    with pytest.raises(ValueError, match="recompute"):
        LossConfig(old_logp="engine")
    with pytest.raises(ValueError):
        LossConfig(old_logp="behav", decoupled=True)
