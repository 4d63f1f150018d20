"""``trainer.backend: megatron``: the Qwen3 policy as megatron-core's GPTModel on CPU.

HF <-> megatron conversion round trip (exact), logits of the converted model against the HF
model, one train step against the torch backend on the same batch, the HF-format weights it
publishes, checkpoints, config checks, and (slow) a few quickstart steps through the real
``rollart run``. Skipped without megatron-core (``pip install 'rollart[megatron]'``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollart.engines.megatron_trainer import megatron_available  # noqa: E402

if not megatron_available():
    pytest.skip("megatron-core is not installed (pip install 'rollart[megatron]')", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from rollart.algos.losses import LossConfig  # noqa: E402
from rollart.engines.megatron_convert import (  # noqa: E402
    build_gpt_model,
    hf_to_megatron,
    megatron_to_hf,
    qwen3_layout,
)
from rollart.engines.megatron_trainer import (  # noqa: E402
    GPTCausalLM,
    MegatronTrainBackend,
    load_gpt_from_hf,
    setup_megatron,
)
from rollart.engines.torch_trainer import TorchTrainBackend, tensors_digest  # noqa: E402
from rollart.engines.train_samples import TrainSample  # noqa: E402

# megatron-core's own deprecation notices (tp_group, ffn_hidden_size) on every forward
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron",
                                        "ignore::UserWarning:megatron")

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


def _hf_model(path, *, tie, vocab=96, heads=4, kv=2, layers=2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=16,
                      max_position_embeddings=128, tie_word_embeddings=tie,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3_dir(request, tmp_path_factory):
    """A 4-head, 2-query-group Qwen3 (head_dim 16, rope theta 50000), tied and untied."""
    return _hf_model(tmp_path_factory.mktemp("mg_qwen3"), tie=request.param)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def test_layout_reads_the_hf_config(qwen3_dir):
    lay = qwen3_layout(qwen3_dir)
    assert (lay.num_layers, lay.num_heads, lay.num_kv_heads, lay.head_dim) == (2, 4, 2, 16)
    assert lay.rope_theta == 50000.0 and lay.intermediate_size == 96
    cfg = json.loads((Path(qwen3_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias"):
        qwen3_layout({**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="model_type"):
        qwen3_layout({**cfg, "model_type": "llama"})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        qwen3_layout({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})


def test_conversion_round_trip_is_exact(qwen3_dir):
    hf = _hf(qwen3_dir).state_dict()
    lay = qwen3_layout(qwen3_dir)
    mg = hf_to_megatron(hf, lay)
    back = megatron_to_hf(mg, lay)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    again = hf_to_megatron(back, lay)
    assert sorted(again) == sorted(mg) and all(torch.equal(again[k], mg[k]) for k in mg)
    assert ("output_layer.weight" in mg) == (not lay.tie_word_embeddings)
    # the fused layouts: group g of linear_qkv is [q heads 2g, 2g+1; k head g; v head g]
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"].reshape(2, 4, 16, 64)
    q = hf["model.layers.0.self_attn.q_proj.weight"].reshape(4, 16, 64)
    k = hf["model.layers.0.self_attn.k_proj.weight"].reshape(2, 16, 64)
    v = hf["model.layers.0.self_attn.v_proj.weight"].reshape(2, 16, 64)
    assert torch.equal(qkv[1, :2], q[2:4]) and torch.equal(qkv[1, 2], k[1]) and torch.equal(qkv[1, 3], v[1])
    fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(KeyError, match="does not know"):
        hf_to_megatron({**hf, "model.layers.0.extra.weight": torch.zeros(1)}, lay)


def test_megatron_model_state_dict_converts_back(qwen3_dir):
    """The GPTModel's own state dict (with its _extra_state entries) converts to HF names."""
    setup_megatron()
    lay = qwen3_layout(qwen3_dir)
    gpt = build_gpt_model(lay, initialize=True)
    hf = megatron_to_hf(gpt.state_dict(), lay)
    assert sorted(hf) == sorted(_hf(qwen3_dir).state_dict())
    model = GPTCausalLM(gpt, lay)
    model.load_hf_state_dict(hf)
    assert all(torch.equal(a, b) for a, b in zip(megatron_to_hf(gpt.state_dict(), lay).values(), hf.values()))


def _tokens(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    att = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        att[b, :n] = 1
    return ids, att


def _max_logit_diff(model_dir, vocab):
    hf, mg = _hf(model_dir), load_gpt_from_hf(model_dir)
    ids, att = _tokens(vocab, [23, 17, 9, 23])
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=att).logits
        b = mg(input_ids=ids, attention_mask=att).logits
    valid = att.bool()
    return (a - b)[valid].abs().max().item(), a[valid].abs().max().item()


def test_logits_match_hf(qwen3_dir):
    diff, scale = _max_logit_diff(qwen3_dir, 96)
    assert scale > 0.05 and diff < 1e-4, (diff, scale)


def test_logits_match_hf_on_the_tiny_model(tiny_model_dir):
    """The project's tiny Qwen3 (hidden 128, 4 layers, vocab 512), right-padded batch."""
    diff, scale = _max_logit_diff(tiny_model_dir, 512)
    assert diff < 1e-4, (diff, scale)


def _samples(vocab, n=6, seed=1, constrained=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen, rlen = 3 + i % 3, 2 + (i * 2) % 5
        ids = torch.randint(0, vocab, (plen + rlen,), generator=g).tolist()
        allowed = None
        if constrained and i % 2:
            allowed = [None] * len(ids)
            for t in range(plen, len(ids), 2):
                allowed[t] = sorted({ids[t], (ids[t] + 5) % vocab, (ids[t] + 11) % vocab, 7})
        behav = (-3.5 - 0.3 * torch.rand(len(ids), generator=g)).tolist()
        out.append(TrainSample(ids, [0] * plen + [1] * rlen, behav, 1.0 if i % 2 == 0 else -0.5, allowed))
    return out


KW = dict(lr=3e-3, grad_clip=1.0, micro_batch_tokens=24, threads=1, seed=0)


@pytest.mark.parametrize("cfg", [
    LossConfig(old_logp="behav", entropy_coef=0.01),
    LossConfig(agg="seq-mean-token-sum", kl_coef=0.05, clip_low=0.1, clip_high=0.3),
], ids=["token-mean+entropy", "seq-sum+kl"])
def test_one_step_matches_the_torch_backend(qwen3_dir, cfg):
    torch_be = TorchTrainBackend(qwen3_dir, **KW)
    mg_be = MegatronTrainBackend(qwen3_dir, **KW)
    assert mg_be.weights_digest() == torch_be.weights_digest()  # the same HF tensors
    samples = _samples(96)
    assert len(mg_be.micro_batches(samples)) > 1
    for a, b in zip(torch_be.token_logprobs(samples), mg_be.token_logprobs(samples)):
        assert torch.allclose(a, b, atol=1e-5)
    mt, mm = torch_be.train_step(samples, loss_cfg=cfg), mg_be.train_step(samples, loss_cfg=cfg)
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "kl", "clip_frac", "ratio_mean"):
        assert mm[key] == pytest.approx(mt[key], rel=1e-4, abs=1e-6), key
    assert mm["version"] == mt["version"] == 1 and mm["tokens"] == mt["tokens"]
    # Adam's first step is ~lr * sign(grad): an element whose gradient is ~1e-8 (float noise
    # between the two models' matmul orders) may move either way, so the parameters are
    # compared where the update is determined; gradients are compared on every element
    # (test_gradients_match_the_torch_backend)
    after_t, after_m = torch_be.weight_tensors(), mg_be.weight_tensors()
    before = _hf(qwen3_dir).state_dict()
    assert sorted(after_t) == sorted(after_m) == sorted(before)
    close = total = 0
    for name, t in after_t.items():
        d = (after_m[name] - t).abs()
        assert d.max().item() <= 2 * KW["lr"] + 1e-6, name
        close += int((d <= 1e-5).sum())
        total += d.numel()
        assert (t - before[name]).abs().max().item() > 1e-4, name  # the step moved every tensor
    assert close / total > 0.999, (close, total)


def test_gradients_match_the_torch_backend(qwen3_dir):
    cfg = LossConfig(old_logp="behav", entropy_coef=0.01, kl_coef=0.02)
    torch_be, mg_be = TorchTrainBackend(qwen3_dir, **KW), MegatronTrainBackend(qwen3_dir, **KW)
    samples = _samples(96)
    ma, mb = (be.accumulate_gradients(samples, loss_cfg=cfg) for be in (torch_be, mg_be))
    assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-5)
    ga = {n: p.grad for n, p in torch_be.model.named_parameters()}
    gb = megatron_to_hf({n: p.grad for n, p in mg_be.model.gpt.named_parameters()}, mg_be.layout)
    if "lm_head.weight" not in ga:  # tied: the embedding's gradient holds both uses
        gb.pop("lm_head.weight")
    assert sorted(ga) == sorted(gb)
    for name, g in ga.items():
        assert torch.allclose(gb[name], g, rtol=1e-4, atol=1e-6), (name, (gb[name] - g).abs().max())


def test_saved_weights_are_hf_tensors_with_the_digest(tmp_path, qwen3_dir):
    be = MegatronTrainBackend(qwen3_dir, **KW)
    be.train_step(_samples(96, constrained=False), loss_cfg=LossConfig(old_logp="behav"))
    path = tmp_path / "v1.safetensors"
    digest = be.save_weights(path)
    assert digest == be.weights_digest() == tensors_digest(load_file(path))
    # a generator's HF model loads the file unchanged and computes the megatron model's logits
    hf = _hf(qwen3_dir)
    hf.load_state_dict(load_file(path), strict=True)
    ids, att = _tokens(96, [12, 7])
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=att).logits[att.bool()]
        b = be.model(input_ids=ids, attention_mask=att).logits[att.bool()]
    assert (a - b).abs().max().item() < 1e-4


def test_checkpoint_round_trip_gives_identical_next_step(qwen3_dir):
    samples, cfg = _samples(96), LossConfig(old_logp="behav")
    a = MegatronTrainBackend(qwen3_dir, **KW)
    a.train_step(samples, loss_cfg=cfg)
    buf = io.BytesIO()
    torch.save(a.state_dict_for_checkpoint(), buf)
    buf.seek(0)
    b = MegatronTrainBackend(qwen3_dir, **KW)
    b.load_checkpoint_state(torch.load(buf, weights_only=True))
    assert b.version == 1 and b.weights_digest() == a.weights_digest()
    ma, mb = a.train_step(samples, loss_cfg=cfg), b.train_step(samples, loss_cfg=cfg)
    assert ma["loss"] == mb["loss"] and a.weights_digest() == b.weights_digest()


def test_parallel_sizes_are_checked(qwen3_dir):
    with pytest.raises(ValueError, match=r"trainer\.megatron\.tensor_parallel must be 1 \(it is 2\)"):
        MegatronTrainBackend(qwen3_dir, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"trainer\.megatron\.pipeline_parallel must be 1"):
        MegatronTrainBackend(qwen3_dir, pipeline_parallel=4)


def test_config_keys_and_make_backend(tiny_model_dir):
    import msgspec

    from rollart.config.trainer import MegatronConfig, TrainerConfig
    from rollart.engines.train_backends import make_backend

    assert TrainerConfig().backend == "torch"
    with pytest.raises(ValueError, match=r"trainer\.megatron\.tensor_parallel must be 1 \(it is 2\)"):
        MegatronConfig(tensor_parallel=2)
    with pytest.raises(ValueError, match=r"trainer\.megatron\.pipeline_parallel must be >= 1"):
        MegatronConfig(pipeline_parallel=0)
    with pytest.raises(msgspec.ValidationError, match="backend"):
        msgspec.convert({"backend": "deepspeed"}, TrainerConfig)
    with pytest.raises(ValueError, match=r"trainer\.world_size > 1 needs trainer\.backend: torch"):
        msgspec.convert({"backend": "megatron", "world_size": 2}, TrainerConfig)
    t = msgspec.convert({"backend": "megatron", "megatron": {"tensor_parallel": 1}, "steps": 3}, TrainerConfig)
    cfg = type("Cfg", (), {"trainer": t, "model": type("M", (), {"threads": 1})()})()
    be = make_backend(cfg, tiny_model_dir)
    assert isinstance(be, MegatronTrainBackend) and be.version == 0
    assert be.weights_digest() == TorchTrainBackend(tiny_model_dir).weights_digest()


@pytest.mark.slow
def test_quickstart_steps_through_rollart_run(tmp_path):
    """Three quickstart steps with ``trainer.backend: megatron`` through the real ``rollart
    run`` (embedded nats-server, generation in a child process loading the HF-format
    versions the megatron trainer publishes)."""
    import yaml

    from tests.actors.sample_actors import new_run

    cfg = yaml.safe_load((ROOT / "src/rollart/configs/quickstart.yaml").read_text())
    run = new_run()
    cfg.update(run=run, run_dir=str(tmp_path / "runs"))
    cfg["trainer"].update(backend="megatron", steps=3, eval_groups=1, expect_success=None)
    cfg["rollout"].update(batch_groups=4)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "rollart", "run", str(tmp_path / "run.yaml"), "--quiet"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    folder = tmp_path / "runs" / run
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 3, summary
    weights = sorted(folder.rglob("*.safetensors"))
    assert weights, list(folder.rglob("*"))
    names = set(load_file(weights[-1]))
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("decoder." in n for n in names)
    # the trainer that made them was the megatron GPTModel (its checkpoint says so)
    from rollart.actors.trainer.files import RunFiles

    state = RunFiles(folder).load_checkpoint()
    assert any(k.startswith("gpt.decoder.layers.0.") for k in state["backend"]["model"])
    assert "Apex is not installed" not in r.stderr, r.stderr[-2000:]  # megatron's import noise is kept quiet


async def test_a_run_without_megatron_core_stops_before_it_starts(monkeypatch):
    import msgspec

    from rollart.app import configs
    from rollart.config import ConfigError, RunConfig

    cfg = msgspec.convert({"trainer": {"backend": "megatron"}}, RunConfig)
    monkeypatch.setattr(configs, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"trainer\.backend 'megatron' needs megatron-core.*rollart\[megatron\]"):
        await configs.check_run_config(cfg)
