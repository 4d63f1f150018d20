"""Fixtures for engine tests: one tiny Qwen3 model per test session, built offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from rollart.engines.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    """A shared engine on the initial weights. Tests that change weights make their own."""
    from rollart.engines.torch_engine import TorchGenerationEngine

    return TorchGenerationEngine(tiny_model_dir, threads=1, seed=0)


# LoRA on (as a run with trainer.lora gets it): the contract suite and test_vllm_server.py
# compare its base outputs with the trainer's and the in-process engine's; the last serves
# adapters
VLLM_SERVER_ARGS = {"dtype": "float32", "max_model_len": 2048, "enable_lora": True,
                    "max_lora_rank": 8}


@pytest.fixture(scope="session")
async def vllm_server(tiny_model_dir):
    """One ``vllm-server`` engine for the session (a start costs 50-100 s of CPU here): the
    engine contract suite's ``vllm-server`` case and ``test_vllm_server.py``'s tests that need no
    server of their own. Each user leaves it serving the model folder's weights (the contract
    suite loads them back from bytes; a refused load keeps them). Needs vLLM."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make test-vllm)")
    from rollart.engines import build_engine

    e = build_engine("vllm-server", str(tiny_model_dir), seed=0, threads=1,
                     engine_args=dict(VLLM_SERVER_ARGS))
    await e.start()
    print(f"\nvllm-server start: {e.start_s:.1f} s")
    try:
        yield e
    finally:
        await e.close()
