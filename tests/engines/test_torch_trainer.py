import io
import math

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from rollart.actors.kernel.policy import file_content_digest  # noqa: E402
from rollart.algos.losses import LossConfig  # noqa: E402
from rollart.engines.torch_trainer import TorchTrainBackend, _lr_factor  # noqa: E402
from rollart.engines.train_samples import TrainSample  # noqa: E402

torch.set_num_threads(1)
VOCAB = 64


def _build(path, tie):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=128, tie_word_embeddings=tie)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def trainer_model_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("tiny_trainer"), tie=False)


def make_samples(n=6, seed=1, constrained=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen, rlen = 3 + i % 3, 2 + (i * 2) % 5
        ids = torch.randint(0, VOCAB, (plen + rlen,), generator=g).tolist()
        mask = [0] * plen + [1] * rlen
        allowed = None
        if constrained:
            allowed = [None] * len(ids)
            for t in range(plen, len(ids), 2):  # every other response token constrained to 4 ids
                allowed[t] = sorted({ids[t], (ids[t] + 5) % VOCAB, (ids[t] + 11) % VOCAB, 7})
        behav = (-3.5 - 0.3 * torch.rand(len(ids), generator=g)).tolist()
        out.append(TrainSample(ids, mask, behav, advantage=1.0 if i % 2 == 0 else -0.5, allowed=allowed))
    return out


def response_logp(tr, samples):
    return [float((lp * torch.tensor(s.response_mask)).sum()) for lp, s in zip(tr.token_logprobs(samples), samples)]


def test_train_step_moves_logprobs_with_advantage_sign(trainer_model_dir):
    tr = TorchTrainBackend(trainer_model_dir, lr=3e-3, grad_clip=1.0)
    samples = make_samples()
    before = response_logp(tr, samples)
    # old_logp="behav" with behav = the initial policy: the loss -mean(r*A) is not constant
    behav = [TrainSample(s.token_ids, s.response_mask, lp.tolist(), s.advantage)
             for s, lp in zip(samples, tr.token_logprobs(samples))]
    cfg = LossConfig(old_logp="behav", clip_low=10.0, clip_high=10.0)
    m1 = tr.train_step(behav, loss_cfg=cfg)
    m2 = tr.train_step(behav, loss_cfg=cfg)
    assert m2["loss"] < m1["loss"]
    assert m1["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    after = response_logp(tr, samples)
    for s, b, a in zip(samples, before, after):
        assert (a > b) if s.advantage > 0 else (a < b)
    assert tr.version == 2 and m2["version"] == 2
    assert m1["tokens"] == sum(sum(s.response_mask) for s in samples)
    for key in ("loss", "grad_norm", "lr", "entropy", "kl", "clip_frac", "is_weight_mean", "tokens", "seconds"):
        assert math.isfinite(m1[key]), key


def test_constrained_logprobs_match_manual(trainer_model_dir):
    tr = TorchTrainBackend(trainer_model_dir)
    samples = make_samples(4, constrained=True)
    got = tr.token_logprobs(samples)
    for s, lp in zip(samples, got):
        assert lp.shape == (len(s.token_ids),) and lp[0].item() == 0.0
        with torch.no_grad():
            z = tr.model(input_ids=torch.tensor([s.token_ids])).logits[0].float()
        for t in range(1, len(s.token_ids)):
            row = z[t - 1]
            allowed = s.allowed[t]
            if allowed is None:
                want = torch.log_softmax(row, -1)[s.token_ids[t]]
            else:  # renormalised over the allowed ids only
                want = row[s.token_ids[t]] - torch.logsumexp(row[allowed], -1)
                assert want > torch.log_softmax(row, -1)[s.token_ids[t]]
            assert lp[t].item() == pytest.approx(want.item(), abs=1e-5)
    # plain token lists are accepted (unconstrained)
    plain = tr.token_logprobs([samples[0].token_ids])[0]
    assert plain.shape == got[0].shape


@pytest.mark.parametrize("cfg", [
    LossConfig(agg="token-mean", is_cap=1.3, entropy_coef=0.01),
    LossConfig(agg="seq-mean-token-mean", decoupled=True, is_cap=1.2, kl_coef=0.1),
    LossConfig(agg="seq-mean-token-sum", old_logp="behav"),
])
def test_micro_batching_matches_one_batch(trainer_model_dir, cfg):
    tr = TorchTrainBackend(trainer_model_dir, micro_batch_tokens=100_000)
    samples = make_samples(7, constrained=True)
    # make behaviour log-probs close to the policy's, so some IS weights fall on each side of the cap
    samples = [TrainSample(s.token_ids, s.response_mask, (lp + 0.3 * (i % 3 - 1)).tolist(), s.advantage, s.allowed)
               for i, (s, lp) in enumerate(zip(samples, tr.token_logprobs(samples)))]
    assert len(tr.micro_batches(samples)) == 1
    m_big = tr.accumulate_gradients(samples, loss_cfg=cfg)
    g_big = [p.grad.clone() for p in tr.model.parameters()]
    tr.model.zero_grad(set_to_none=True)
    tr.micro_batch_tokens = 12
    assert len(tr.micro_batches(samples)) >= 5
    m_small = tr.accumulate_gradients(samples, loss_cfg=cfg)
    for a, p in zip(g_big, tr.model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-4, atol=1e-7)
    for key in ("loss", "pg_loss", "entropy", "clip_frac", "is_weight_mean", "is_capped_frac"):
        assert m_small[key] == pytest.approx(m_big[key], rel=1e-4, abs=1e-6), key
    assert m_big["pg_loss"] != 0.0
    if cfg.is_cap is not None:
        assert 0.0 < m_big["is_capped_frac"] < 1.0
    assert any(g.abs().sum() > 0 for g in g_big)


def test_checkpoint_round_trip_gives_identical_next_step(trainer_model_dir):
    kw = dict(lr=1e-3, weight_decay=0.1, betas=(0.8, 0.95), warmup_steps=1, total_steps=5,
              schedule="cosine", micro_batch_tokens=40)
    cfg = LossConfig(is_cap=2.0, entropy_coef=0.01, kl_coef=0.05)
    samples = make_samples(5, constrained=True)
    a = TorchTrainBackend(trainer_model_dir, **kw)
    a.train_step(samples, loss_cfg=cfg)
    buf = io.BytesIO()
    torch.save(a.state_dict_for_checkpoint(), buf)
    m_a = a.train_step(samples, loss_cfg=cfg)

    b = TorchTrainBackend(trainer_model_dir, seed=123, **kw)
    buf.seek(0)
    b.load_checkpoint_state(torch.load(buf, weights_only=True))
    assert b.version == 1
    m_b = b.train_step(samples, loss_cfg=cfg)
    for key in ("loss", "grad_norm", "lr", "entropy", "kl"):
        assert m_a[key] == m_b[key], key
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    assert a.version == b.version == 2


def test_a_resume_with_more_steps_trains_its_next_step_on_the_longer_schedule(trainer_model_dir):
    """``rollart run --resume RUN --steps N`` past a finished cosine: the first step after
    the resume uses the new schedule's LR (it trained at the old schedule's last one, 0.0:
    a wasted step, seen when a stuck run of the quickstart was resumed)."""
    kw = dict(lr=1e-3, schedule="cosine", micro_batch_tokens=40)
    samples, cfg = make_samples(4), LossConfig()
    a = TorchTrainBackend(trainer_model_dir, total_steps=3, **kw)
    for _ in range(3):
        a.train_step(samples, loss_cfg=cfg)
    buf = io.BytesIO()
    torch.save(a.state_dict_for_checkpoint(), buf)
    buf.seek(0)
    b = TorchTrainBackend(trainer_model_dir, total_steps=6, **kw)
    b.load_checkpoint_state(torch.load(buf, weights_only=True))
    lrs = [b.train_step(samples, loss_cfg=cfg)["lr"] for _ in range(3)]
    want = [1e-3 * _lr_factor(s, warmup=0, total=6, schedule="cosine", min_ratio=0.0)
            for s in (3, 4, 5)]
    assert lrs == pytest.approx(want), (lrs, want)


@pytest.mark.parametrize("tie", [False, True])
def test_save_weights_digest(tmp_path, tie):
    model_dir = _build(tmp_path / "m", tie=tie)
    tr = TorchTrainBackend(model_dir)
    path = tmp_path / "w.safetensors"
    digest = tr.save_weights(path)
    assert digest.startswith("tensors-sha256:")
    assert digest == file_content_digest(path) == tr.weights_digest()  # the tensors, not the bytes
    loaded = load_file(str(path))
    state = tr.model.state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert not list(tmp_path.glob("w.safetensors.tmp*"))


def test_lr_schedule_and_validation(trainer_model_dir):
    f = dict(warmup=2, total=6, schedule="cosine", min_ratio=0.0)
    assert [round(_lr_factor(s, **f), 6) for s in range(7)] == [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0]
    assert _lr_factor(10, warmup=0, total=None, schedule="constant", min_ratio=0.0) == 1.0
    with pytest.raises(ValueError, match="cosine"):
        TorchTrainBackend(trainer_model_dir, schedule="linear")
    with pytest.raises(ValueError, match="response_mask"):
        TrainSample([1, 2], [1, 1], [0.0, 0.0], 1.0)
    with pytest.raises(ValueError, match="allowed"):
        TrainSample([1, 2], [0, 1], [0.0, 0.0], 1.0, allowed=[None, [3, 4]])
    tr = TorchTrainBackend(trainer_model_dir)
    with pytest.raises(ValueError, match="unknown loss config"):
        tr.train_step(make_samples(2), loss_cfg={"clip": 0.2})
    with pytest.raises(ValueError, match="no response tokens"):
        tr.train_step([TrainSample([1, 2, 3], [0, 0, 0], [0.0] * 3, 1.0)])


def test_a_step_that_does_not_advance_the_schedule_keeps_its_lr(trainer_model_dir):
    """``advance_schedule=False`` (``trainer.schedule_clock: signal`` on a step with no
    signal): the step is taken, the warm-up and cosine stand still."""
    tr = TorchTrainBackend(trainer_model_dir, lr=0.01, warmup_steps=2, total_steps=6,
                           schedule="cosine", threads=1)
    held = LossConfig(advance_schedule=False)
    lrs = [tr.train_step(make_samples(2, seed=s), loss_cfg=cfg)["lr"]
           for s, cfg in enumerate([None, held, held, None, None, held, None])]
    assert [round(x / 0.01, 6) for x in lrs] == [0.5, 1.0, 1.0, 1.0, 1.0, 0.853553, 0.853553]
    assert tr.version == 7  # every step was taken
