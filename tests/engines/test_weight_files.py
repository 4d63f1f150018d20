"""rollart.engines.weight_files (safetensors headers, model folders, the check before a weight
update, shared by the vLLM and SGLang engines) and rollart.engines.choice_trie (the
renormalised log-probs of a constrained row). No engine needed."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from rollart.engines import weight_files as wf  # noqa: E402
from rollart.engines.choice_trie import (  # noqa: E402
    accepted_prefix,
    branch_ids,
    choice_trie,
    logsumexp,
    renormalised_logprobs,
)

save, save_file, load = safetensors_torch.save, safetensors_torch.save_file, safetensors_torch.load


# -- safetensors headers ---------------------------------------------------------------------------
def test_header_of_bytes_and_file(tmp_path):
    sd = {"a.weight": torch.zeros(3, 4), "b.bias": torch.ones(5, dtype=torch.bfloat16)}
    blob = save(sd)
    got = wf.read_header(blob)
    assert got == {"a.weight": ("F32", (3, 4)), "b.bias": ("BF16", (5,))}
    assert got["a.weight"].shape == (3, 4) and got["b.bias"].dtype == "BF16"
    save_file(sd, tmp_path / "w.safetensors")
    assert wf.read_header(tmp_path / "w.safetensors") == got
    assert wf.read_header(memoryview(blob)) == wf.read_header(bytearray(blob)) == got


def _with_header(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("bad, match", [
    (b"", "too short"),
    (b"\x00" * 7, "too short"),
    (b"\xff" * 64, "header size beyond"),
    (b"\x10\0\0\0\0\0\0\0{not json}      ", "bad header"),
    (b"\x08\0\0\0\0\0\0\0\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8", "bad header"),  # not UTF-8
    (_with_header([1, 2], b""), "not an object"),
    (_with_header({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "bad entry 'a'"),
    (_with_header({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "unknown dtype F33"),
    (_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 8),
     "truncated safetensors file"),
    (_with_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
     r"a: 8 data bytes for F32 \[3\]"),
    (_with_header({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8),
     "not a safetensors file"),
])
def test_header_refuses_what_is_not_a_whole_file(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        wf.read_header(bad)
    assert str(e.value).startswith("weights")  # bytes are named "weights"


def test_header_refusals_name_the_file(tmp_path, tiny_model_dir):
    data = (tiny_model_dir / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="truncated safetensors file"):
        wf.read_header(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated safetensors file"):
        wf.read_header(save({"a": torch.zeros(4)})[:-3])
    (tmp_path / "half.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"half\.safetensors: truncated safetensors"):
        wf.read_header(tmp_path / "half.safetensors")
    with pytest.raises(ValueError, match="config.json: not a safetensors file"):
        wf.read_header(tiny_model_dir / "config.json")
    with pytest.raises(ValueError, match="cannot read weights from .*missing.safetensors"):
        wf.read_header(tmp_path / "missing.safetensors")


def test_rename_tensor_keeps_the_data():
    g = torch.Generator().manual_seed(0)
    tensors = {"lm_head.weight": torch.randn(7, 3, generator=g),
               "model.norm.weight": torch.randn(3, generator=g)}
    renamed = wf.rename_tensor(save(tensors), "lm_head.weight", "model.embed_tokens.weight")
    out = load(renamed)
    assert set(out) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert torch.equal(out["model.embed_tokens.weight"], tensors["lm_head.weight"])
    assert torch.equal(out["model.norm.weight"], tensors["model.norm.weight"])
    assert set(wf.read_header(renamed)) == set(out)
    with pytest.raises(ValueError, match="cannot rename"):
        wf.rename_tensor(renamed, "lm_head.weight", "x")


# -- model folders ---------------------------------------------------------------------------------
def test_model_info_reads_the_folder(tiny_model_dir):
    from safetensors import safe_open

    info = wf.read_model_info(tiny_model_dir)
    assert info.vocab_size == 512 and info.eos_token_ids == (2, 0) and not info.tied
    assert info.head_dim == 32
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        want = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert info.shapes == want and "lm_head.weight" in want
    assert wf.model_weight_shapes(tiny_model_dir) == want


def test_model_info_of_a_sharded_tied_folder(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "text_config": {"vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2,
                        "tie_word_embeddings": True, "eos_token_id": 3},
        "eos_token_id": [4, 3]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, d / "part-1.safetensors")
    save_file({"model.norm.weight": torch.zeros(8)}, d / "part-2.safetensors")
    save_file({"stray.weight": torch.zeros(1)}, d / "stray.safetensors")  # not in the index
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "part-1.safetensors",
        "model.norm.weight": "part-2.safetensors"}}))
    info = wf.read_model_info(d)
    assert info.eos_token_ids == (5, 3, 4) and info.tied and info.head_dim == 4
    assert info.vocab_size == 10
    assert info.shapes == {"model.embed_tokens.weight": (10, 8), "model.norm.weight": (8,)}
    (d / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="not a safetensors index"):
        wf.read_model_info(d)


def test_model_info_without_weights_or_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    info = wf.read_model_info(tmp_path)
    assert info.shapes == {} and info.eos_token_ids == () and info.vocab_size is None
    with pytest.raises(ValueError, match="is not a model folder"):
        wf.read_model_info(tmp_path / "nowhere")


# -- the check before an update --------------------------------------------------------------------
def _header(shapes, dtype="F32"):
    return {k: wf.Tensor(dtype, tuple(v)) for k, v in shapes.items()}


def test_check_weights_names_shapes_and_dtypes(tiny_model_dir):
    shapes = wf.read_model_info(tiny_model_dir).shapes
    wf.check_weights(wf.read_header(tiny_model_dir / "model.safetensors"), shapes)
    wf.check_weights(_header(shapes, "BF16"), shapes)
    missing = {k: v for k, v in shapes.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing=\['model.norm.weight'\]"):
        wf.check_weights(_header(missing), shapes)
    with pytest.raises(ValueError, match=r"unexpected=\['extra.weight'\]"):
        wf.check_weights(_header({**shapes, "extra.weight": (1,)}), shapes)
    with pytest.raises(ValueError, match=r"lm_head.weight: \(512, 129\) != \(512, 128\)"):
        wf.check_weights(_header({**shapes, "lm_head.weight": (512, 129)}), shapes)
    with pytest.raises(ValueError, match="shape mismatches=.*dtype I32"):
        wf.check_weights({**_header(shapes), "model.norm.weight":
                          wf.Tensor("I32", shapes["model.norm.weight"])}, shapes)
    with pytest.raises(ValueError, match="^weights in x do not match the model"):
        wf.check_weights({}, shapes, what="weights in x")


def test_check_weights_tied_and_optional(tiny_model_dir):
    shapes = wf.read_model_info(tiny_model_dir).shapes
    head, embed = wf.TIED
    tied = {k: v for k, v in shapes.items() if k != head}  # a tied model's folder
    only_head = {k: v for k, v in shapes.items() if k != embed}
    neither = {k: v for k, v in tied.items() if k != embed}
    # tied (SGLang): either name stands for both, none is missing
    for given in (shapes, tied, only_head):
        wf.check_weights(_header(given), tied, tied=True)
    with pytest.raises(ValueError, match="missing"):
        wf.check_weights(_header(neither), tied, tied=True)
    with pytest.raises(ValueError, match=r"lm_head.weight: \(512, 129\)"):
        wf.check_weights(_header({**tied, head: (512, 129)}), tied, tied=True)
    with pytest.raises(ValueError, match="unexpected"):
        wf.check_weights(_header(shapes), tied)
    # optional (vLLM, which ignores a tied lm_head): the embedding is still needed
    for given in (shapes, tied):
        wf.check_weights(_header(given), tied, optional={head})
    with pytest.raises(ValueError, match=r"missing=\['model.embed_tokens.weight'\]"):
        wf.check_weights(_header(only_head), tied, optional={head})


def test_place_weights(tmp_path):
    src = tmp_path / "src.safetensors"
    src.write_bytes(b"one")
    dest = tmp_path / "out" / "model.safetensors"
    dest.parent.mkdir()
    wf.place_weights(b"bytes", dest)
    assert dest.read_bytes() == b"bytes" and not dest.is_symlink()
    wf.place_weights(src, dest, hard_link=True)
    assert dest.read_bytes() == b"one" and dest.stat().st_ino == src.stat().st_ino
    src.unlink()
    src.write_bytes(b"two")  # a new file at the path: the hard link keeps the checked one
    assert dest.read_bytes() == b"one"
    wf.place_weights(src, dest)
    assert dest.is_symlink() and dest.read_bytes() == b"two"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.safetensors"]


# -- choice tries ----------------------------------------------------------------------------------
def test_choice_trie_helpers():
    trie = choice_trie([[1, 2], [1, 3, 4], [5]])
    assert trie == {1: {2: {}, 3: {4: {}}}, 5: {}}
    assert branch_ids(trie) == [1, 2, 3, 5]
    assert branch_ids(choice_trie([[7, 8]])) == []
    assert accepted_prefix(trie, [1, 3, 4, 9]) == ([1, 3, 4], True)
    assert accepted_prefix(trie, [1, 3, 9]) == ([1, 3], False)
    assert accepted_prefix(trie, []) == ([], False)
    assert logsumexp([math.log(1), math.log(3)]) == pytest.approx(math.log(4))
    assert logsumexp([-math.inf, -math.inf]) == -math.inf


async def test_renormalised_logprobs_direct_and_scored():
    trie = choice_trie([[1, 2], [1, 3, 4], [5]])
    resp = [1, 3, 4]
    lp = {1: math.log(0.2), 5: math.log(0.3), 2: math.log(0.1), 3: math.log(0.4)}
    raw = [{1: lp[1], 5: lp[5]}, {2: lp[2], 3: lp[3]}, {}]
    want = [math.log(0.2 / 0.5), math.log(0.4 / 0.5), 0.0]

    async def never(k, allowed):
        raise AssertionError("scored although the raw log-probs were given")

    assert await renormalised_logprobs(trie, resp, raw, never) == pytest.approx(want)
    asked = []

    async def score(k, allowed):
        asked.append((k, allowed))
        return {t: lp[t] for t in allowed}

    assert await renormalised_logprobs(trie, resp, None, score) == pytest.approx(want)
    assert sorted(asked) == [(0, [1, 5]), (1, [2, 3])]
    assert await renormalised_logprobs(choice_trie([[6, 7]]), [6, 7], None, never) == [0.0, 0.0]
