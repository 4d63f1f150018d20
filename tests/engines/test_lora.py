"""LoRA (``trainer.lora``, on peft): only the adapters train (the base stays bit-identical); a
version is the adapter file (peft's names, small), digested over its tensors; the torch
engine applies it over its base and produces the trainer's merged model's logits, a new
version replacing the previous adapter; merged publishing for engines without adapters;
checkpoints of adapters; world size 2 takes the LoRA step of world size 1."""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from rollart.algos.losses import LossConfig
from rollart.engines.batched import BatchedEngine
from rollart.engines.digest import file_content_digest
from rollart.engines.torch_engine import TorchGenerationEngine
from rollart.engines.torch_trainer import TorchTrainBackend
from rollart.engines.weight_files import read_header, read_metadata, weights_kind
from tests.engines.test_torch_trainer import VOCAB, _build, make_samples

torch.set_num_threads(1)
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
KW = {"lr": 1e-2, "grad_clip": 1.0, "threads": 1, "seed": 0, "micro_batch_tokens": 24}
CFG = LossConfig(entropy_coef=0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("lora_model"), tie=True)


def _steps(tr, n, seed=3):
    for i in range(n):
        tr.train_step(make_samples(8, seed=seed + i), loss_cfg=CFG)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


IDS = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(5))


def test_only_the_adapters_train_and_the_base_stays_bit_identical(model_dir):
    tr = TorchTrainBackend(model_dir, lora=LORA, **KW)
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained), sorted(trained)[:4]
    assert len(trained) == 2 * 7 * 2, "A and B on 7 projections of 2 layers"
    in_opt = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in tr.model.parameters() if p.requires_grad}
    _steps(tr, 3)
    assert tr.version == 3
    for n, p in tr.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"base parameter {n} changed"
        else:
            assert not torch.equal(p, trained[n]), f"adapter {n} did not train"
    # the KL reference is the base: the same model with its adapters off
    kl = tr.train_step(make_samples(8, seed=9), loss_cfg=LossConfig(kl_coef=0.1))
    assert kl["kl"] > 0
    base = TorchTrainBackend(model_dir, **KW)
    with tr._base_only():
        torch.testing.assert_close(_logits(tr.model, IDS), _logits(base.model, IDS), rtol=0, atol=0)


def test_a_version_is_the_small_adapter_file_in_peft_names(model_dir, tmp_path):
    tr = TorchTrainBackend(model_dir, lora=LORA, **KW)
    _steps(tr, 2)
    path = tmp_path / "v000002.safetensors"
    digest = tr.save_weights(path)
    assert digest == tr.weights_digest() == file_content_digest(path)
    assert weights_kind(path) == "lora" and tr.weights_kind == "lora"
    meta = read_metadata(path)
    assert meta["lora_rank"] == "4" and float(meta["lora_alpha"]) == 8.0
    names = set(read_header(path))
    tr.model.save_pretrained(tmp_path / "peft")  # peft's own adapter file: the same tensors
    assert names == set(read_header(tmp_path / "peft" / "adapter_model.safetensors"))
    full = TorchTrainBackend(model_dir, **KW)
    full.save_weights(tmp_path / "full.safetensors")
    full_bytes = os.path.getsize(tmp_path / "full.safetensors")
    lora_bytes = os.path.getsize(path)
    print(f"bytes per version: LoRA rank 4 {lora_bytes}, full {full_bytes} "
          f"({full_bytes / lora_bytes:.1f}x)")
    assert lora_bytes * 4 < full_bytes
    assert weights_kind(tmp_path / "full.safetensors") == "full" and full.weights_kind == "full"


def test_the_torch_engine_applies_the_adapter_as_the_merged_model(model_dir, tmp_path):
    tr = TorchTrainBackend(model_dir, lora=LORA, **KW)
    eng = TorchGenerationEngine(model_dir, threads=1)
    for v in (1, 2, 3):  # each version replaces the previous adapter, never stacks
        _steps(tr, 1, seed=10 + v)
        path = tmp_path / f"v{v}.safetensors"
        tr.save_weights(path)
        if v == 2:  # the bytes path (what a replica fetched)
            BatchedEngine(eng)._load_bytes(path.read_bytes(), v)
        else:
            eng.load_weights(path, v)
        assert eng.version == v
        merged = copy.deepcopy(tr.model).merge_and_unload()
        got = _logits(eng.model, IDS)
        torch.testing.assert_close(got, _logits(merged, IDS), rtol=0, atol=1e-5)
        torch.testing.assert_close(got, _logits(tr.model, IDS), rtol=0, atol=1e-5)
        for name, t in merged.state_dict().items():  # peft's merge, bit for bit
            assert torch.equal(eng.model.state_dict()[name], t), name
    # a bad adapter changes nothing
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "v3.safetensors"))
    k = next(iter(sd))
    sd[k] = sd[k][:, :-1].contiguous() if ".lora_A." in k else sd[k][:-1].contiguous()
    save_file(sd, str(tmp_path / "bad.safetensors"), metadata=read_metadata(tmp_path / "v3.safetensors"))
    before = {n: t.clone() for n, t in eng.model.state_dict().items()}
    with pytest.raises(ValueError, match="does not match the model"):
        eng.load_weights(tmp_path / "bad.safetensors", 4)
    assert eng.version == 3 and all(torch.equal(before[n], t) for n, t in eng.model.state_dict().items())


def test_merged_publishing_gives_full_weights_of_the_same_model(model_dir, tmp_path):
    """For engines that load full weights only (vLLM, SGLang): the trainer publishes the merged
    weights under HF names."""
    tr = TorchTrainBackend(model_dir, lora=LORA, publish="merged", **KW)
    _steps(tr, 2)
    assert tr.weights_kind == "full"
    path = tmp_path / "merged.safetensors"
    assert tr.save_weights(path) == tr.weights_digest()
    eng = TorchGenerationEngine(model_dir, threads=1)
    assert set(read_header(path)) == set(eng.model.state_dict())
    eng.load_weights(path, 2)
    merged = copy.deepcopy(tr.model).merge_and_unload()
    torch.testing.assert_close(_logits(eng.model, IDS), _logits(merged, IDS), rtol=0, atol=0)


def test_checkpoints_hold_the_adapters_and_resume_exactly(model_dir, tmp_path):
    tr = TorchTrainBackend(model_dir, lora=LORA, **KW)
    _steps(tr, 2)
    state = tr.state_dict_for_checkpoint()
    assert state["lora"]["rank"] == 4
    assert set(state["model"]) == {n for n, p in tr.model.named_parameters() if p.requires_grad}
    torch.save(state, tmp_path / "lora.pt")
    full = TorchTrainBackend(model_dir, **KW)
    _steps(full, 2)  # with its optimizer state
    torch.save(full.state_dict_for_checkpoint(), tmp_path / "full.pt")
    print(f"checkpoint bytes: LoRA {os.path.getsize(tmp_path / 'lora.pt')}, "
          f"full {os.path.getsize(tmp_path / 'full.pt')}")
    assert os.path.getsize(tmp_path / "lora.pt") * 3 < os.path.getsize(tmp_path / "full.pt")
    again = TorchTrainBackend(model_dir, lora=LORA, **{**KW, "seed": 1})
    again.load_checkpoint_state(torch.load(tmp_path / "lora.pt", weights_only=True))
    assert again.version == 2 and again.weights_digest() == tr.weights_digest()
    s = make_samples(8, seed=30)
    m1, m2 = tr.train_step(s, loss_cfg=CFG), again.train_step(s, loss_cfg=CFG)
    assert m1["loss"] == m2["loss"] and again.weights_digest() == tr.weights_digest()
    with pytest.raises(ValueError, match="full fine-tuning run"):
        again.load_checkpoint_state(torch.load(tmp_path / "full.pt", weights_only=True))
    with pytest.raises(ValueError, match="LoRA run"):
        full.load_checkpoint_state(torch.load(tmp_path / "lora.pt", weights_only=True))


def test_the_config_and_the_backend_factory(model_dir):
    from rollart.config.loader import convert
    from rollart.config.schema import RunConfig
    from rollart.engines.train_backends import make_backend
    from rollart.errors import ConfigError

    for bad, key in [({"rank": 0}, "trainer.lora.rank must be >= 1"),
                     ({"alpha": -1}, "trainer.lora.alpha must be > 0"),
                     ({"dropout": 1.0}, "trainer.lora.dropout must be in [0, 1)"),
                     ({"targets": []}, "trainer.lora.targets must be a non-empty")]:
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace(")", r"\)")):
            convert({"trainer": {"lora": bad}}, RunConfig)
    with pytest.raises(ConfigError, match="trainer.lora needs trainer.backend: torch"):
        convert({"trainer": {"lora": {}, "backend": "megatron"}}, RunConfig)
    cfg = convert({"trainer": {"lora": {"rank": 2, "targets": ["q_proj"]}}}, RunConfig)
    b = make_backend(cfg, model_dir)
    assert b.lora["rank"] == 2 and b.weights_kind == "lora"
    assert sum(p.requires_grad for p in b.model.parameters()) == 2 * 2
    vcfg = convert({"trainer": {"lora": {"rank": 2}}, "proxy": {"engine": "vllm"}}, RunConfig)
    assert make_backend(vcfg, model_dir).weights_kind == "full", "vLLM gets merged weights"
    # vllm-server serves adapters (enable_lora, unless turned off): it gets the adapter
    scfg = convert({"trainer": {"lora": {"rank": 4}}, "proxy": {"engine": "vllm-server"}}, RunConfig)
    assert make_backend(scfg, model_dir).weights_kind == "lora"
    off = convert({"trainer": {"lora": {"rank": 4}}, "proxy": {
        "engine": "vllm-server", "engine_args": {"enable_lora": False}}}, RunConfig)
    assert make_backend(off, model_dir).weights_kind == "full"
    with pytest.raises(ValueError, match="not found"):  # peft: no module of that name
        TorchTrainBackend(model_dir, lora={**LORA, "targets": ["nope_proj"]}, **KW)


@pytest.mark.timeout(180)
def test_two_ranks_take_the_lora_step_of_one(model_dir, tmp_path):
    """For each aggregation: the adapters after one step at world size 2 equal world size 1's.
    B starts random (peft starts it at 0, where A's gradient is 0), so A and B both move."""
    from rollart.engines.rank_launch import start_ranks

    kw = {**KW, "lr": 1e-3, "lora": LORA}
    ranked = start_ranks(model_dir, world_size=2, dist_timeout=60, log_dir=tmp_path, **kw)
    try:
        single = TorchTrainBackend(model_dir, **kw)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, p in single.model.named_parameters():
                if ".lora_B." in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        init = copy.deepcopy(single.state_dict_for_checkpoint())
        for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            single.load_checkpoint_state(copy.deepcopy(init))
            ranked.load_checkpoint_state(copy.deepcopy(init))  # rank 1 gets it too
            samples = make_samples(9, seed=3)  # odd: the ranks' shares differ
            cfg = LossConfig(agg=agg, entropy_coef=0.01)
            m1 = single.train_step(samples, loss_cfg=cfg)
            m2 = ranked.train_step(samples, loss_cfg=cfg)
            assert m2["world_size"] == 2 and m2["version"] == m1["version"] == 1
            for k in ("loss", "grad_norm", "tokens"):
                assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), (agg, k)
            p1 = dict(single.model.named_parameters())
            for name, p in ranked.model.named_parameters():
                if p.requires_grad:
                    assert not torch.equal(p, init["model"][name]), (agg, name, "did not move")
                torch.testing.assert_close(p, p1[name], rtol=1e-5, atol=1e-6, msg=f"{agg} {name}")
            assert ranked.weights_digest() == ranked.weights_digest()
        assert ranked.weights_kind == "lora"
    finally:
        ranked.shutdown()
    assert all(p.returncode == 0 for p in ranked.procs.values()), "rank 1 stops cleanly on 'stop'"


def test_the_head_of_a_tied_model_is_refused_as_a_target():
    """Merging an adapter into a head tied to the embeddings would change the embeddings too."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rollart.engines.lora import wrap_model

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="trainer.lora.targets: 'lm_head' is tied"):
        wrap_model(Qwen3ForCausalLM(cfg), rank=4, alpha=8.0, targets=("q_proj", "lm_head"))


def test_an_adapter_file_becomes_a_checked_peft_folder(model_dir, tmp_path):
    """What the vllm-server engine hands its server: the adapter file checked against the
    model (names, shapes, rank), in a private folder with peft's adapter_config.json."""
    import json

    from rollart.engines import applies_adapters, lora_engine_args
    from rollart.engines.lora_files import adapter_config, write_adapter_folder
    from rollart.engines.weight_files import model_weight_shapes

    tr = TorchTrainBackend(model_dir, lora=LORA, **KW)
    path = tmp_path / "v.safetensors"
    tr.save_weights(path)
    shapes = model_weight_shapes(model_dir)
    cfg = adapter_config(read_header(path), read_metadata(path), shapes, max_rank=8)
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    assert sorted(cfg["target_modules"]) == sorted(LORA["targets"])
    folder = write_adapter_folder(path.read_bytes(), cfg, tmp_path / "lora-1")
    assert (folder.stat().st_mode & 0o777) == 0o700
    assert json.loads((folder / "adapter_config.json").read_text()) == cfg
    assert file_content_digest(folder / "adapter_model.safetensors") == file_content_digest(path)
    with pytest.raises(ValueError, match="above the server's max_lora_rank"):
        adapter_config(read_header(path), read_metadata(path), shapes, max_rank=1)
    with pytest.raises(ValueError, match="no LoRA metadata"):
        adapter_config(read_header(path), {}, shapes)
    wrong = {k: (v if ".lora_A." not in k else v._replace(shape=(4, 3)))
             for k, v in read_header(path).items()}
    with pytest.raises(ValueError, match="does not match the model"):
        adapter_config(wrong, read_metadata(path), shapes)
    # which engines get adapters, and the server flags a LoRA run gives vllm-server
    args = lora_engine_args("vllm-server", {"max_model_len": 64}, 4)
    assert args == {"max_model_len": 64, "enable_lora": True, "max_lora_rank": 8}
    assert applies_adapters("vllm-server", args) and applies_adapters("torch", {})
    assert not applies_adapters("vllm", lora_engine_args("vllm", {}, 4))
    assert not applies_adapters("sglang", {}) and lora_engine_args("vllm-server", {}, None) == {}
