"""SglangEngine (``proxy.engine: sglang``).

Here, on any machine: the pure translation between rollart and SGLang's native HTTP API,
checked with real inputs (the tiny model's logits and the torch engine's outputs, real
safetensors files, the logit bias applied as the server applies it), and the launch against
a stand-in ``sglang`` package whose server checks the API key as SGLang's does. With a CUDA GPU and
sglang installed (``$ROLLART_SGLANG_PYTHON`` may name another interpreter that has it): a
real server launched on a tiny model, checked against a float32 forward pass in torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from rollart.engines import build_engine  # noqa: E402
from rollart.engines import sglang_engine as sg  # noqa: E402
from rollart.engines import sglang_protocol as sgp  # noqa: E402
from rollart.engines import sglang_server as sgs  # noqa: E402
from rollart.engines.base import (  # noqa: E402
    FINISH_CHOICE,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineAborted,
    GenInput,
)

SRC = str(Path(sg.__file__).resolve().parents[2])


# -- helpers: the tiny model's own numbers ------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 local_files_only=True)
    return model.eval()


def next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def triples(logprobs: torch.Tensor, ids: list[int]) -> list[list]:
    """``[logprob, id, None]`` per id: SGLang's ``output_token_ids_logprobs`` entry shape."""
    return [[float(logprobs[i]), int(i), None] for i in ids]


def sglang_body(tokens, logprobs, finish, rid="r-1", prompt_tokens=5) -> dict:
    """A ``/generate`` answer as SGLang's tokenizer manager builds it with
    ``--skip-tokenizer-init`` (``_handle_batch_output``)."""
    return {"output_ids": list(tokens),
            "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                          "weight_version": "default", "total_retractions": 0,
                          "output_token_logprobs": [[lp, t, None]
                                                    for lp, t in zip(logprobs, tokens)],
                          "completion_tokens": len(tokens), "cached_tokens": 0,
                          "e2e_latency": 0.01}}


PROMPT = [1, 40, 41, 42, 43, 44]


# -- import and construction ---------------------------------------------------------------------
def test_module_imports_without_torch_aiohttp_or_sglang():
    code = ("import sys, rollart.engines.sglang_engine as m\n"
            "bad = [k for k in ('torch', 'aiohttp', 'sglang', 'dill') if k in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 0, r.stderr


def test_build_engine_makes_an_unstarted_sglang_engine(tiny_model_dir, engine):
    eng = build_engine("sglang", str(tiny_model_dir), seed=3,
                       engine_args={"mem_fraction_static": 0.3})
    assert isinstance(eng, sg.SglangEngine)
    assert eng.version == 0 and eng.seed == 3 and eng.url is None
    assert eng.vocab_size == engine.vocab_size == 512
    assert eng.eos_token_ids == engine.eos_token_ids  # the set SGLang stops on
    assert eng.server_args == {"mem_fraction_static": 0.3}
    with pytest.raises(ValueError, match="set by the sglang engine"):
        build_engine("sglang", str(tiny_model_dir), engine_args={"port": 30000})
    attached = build_engine("sglang", str(tiny_model_dir),
                            engine_args={"url": "http://gpu-host:30000/"})
    assert attached.url == "http://gpu-host:30000" and attached.startup_timeout_s == 120.0


async def test_start_says_what_is_missing(tiny_model_dir):
    eng = sg.SglangEngine(tiny_model_dir, engine_args={"startup_timeout_s": 5})
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"pip install 'rollart\[sglang\]'"):
            await eng.start()
        return
    if sgs.sglang_unavailable_reason() is None:
        pytest.skip("sglang is installed here: the GPU tests below start it")
    if eng.python == sys.executable and __import__("importlib").util.find_spec("sglang"):
        pytest.skip("sglang is importable; only CUDA is missing")
    with pytest.raises(RuntimeError, match="sglang package is not available"):
        await eng.start()
    assert eng._proc is None and eng._session is None


# -- weight updates (the files: tests/engines/test_weight_files.py) ----------------------------
async def test_load_weights_checks_names_and_shapes_first(tiny_model_dir):
    """The check runs before anything reaches a server (here there is none)."""
    from safetensors.torch import load, save

    eng = sg.SglangEngine(tiny_model_dir)
    good = (tiny_model_dir / "model.safetensors").read_bytes()
    sd = load(good)
    sd["lm_head.weight"] = torch.zeros(512, 64)
    for bad, match in ((save(sd), "shape mismatches"), (b"junk", "safetensors"),
                       (tiny_model_dir / "config.json", "safetensors")):
        with pytest.raises(ValueError, match=match):
            await eng.load_weights(bad, 1)
    with pytest.raises(RuntimeError, match="not started"):
        await eng.load_weights(good, 1)
    assert eng.version == 0


# -- requests --------------------------------------------------------------------------------------
def test_free_row_payload():
    inp = GenInput(prompt_ids=PROMPT, max_new_tokens=12, temperature=0.7, top_p=0.9,
                   stop_token_ids=(7,))
    body = sgp.generate_payload(inp, "t1#0.abc", eos_token_ids=(2, 0))
    assert body == {
        "rid": "t1#0.abc", "input_ids": PROMPT, "return_logprob": True, "stream": False,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9,
                            "stop_token_ids": [7, 2, 0]}}
    json.dumps(body)
    for greedy in (GenInput(prompt_ids=PROMPT, greedy=True, temperature=0.7),
                   GenInput(prompt_ids=PROMPT, temperature=0.0)):
        assert sgp.generate_payload(greedy, "r")["sampling_params"]["temperature"] == 0.0


def test_choice_step_payload():
    inp = GenInput(prompt_ids=PROMPT, temperature=1.0, choices=[[5, 6], [5, 7, 8], [9]])
    body = sgp.choice_step_payload(inp, "r.1", [5], [6, 7])
    assert body["input_ids"] == [*PROMPT, 5]
    assert body["sampling_params"] == {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                                       "logit_bias": {"6": sgp.ALLOWED_BIAS,
                                                      "7": sgp.ALLOWED_BIAS}}
    assert body["token_ids_logprob"] == [6, 7] and body["return_logprob"] is True
    assert "custom_logit_processor" not in body  # no pickle crosses the wire
    json.dumps(body)


def test_allowed_next_and_complete_choices():
    choices = [[5, 6], [5, 7, 8], [9]]
    assert sgp.allowed_next(choices, []) == [5, 9]
    assert sgp.allowed_next(choices, [5]) == [6, 7]
    assert sgp.allowed_next(choices, [5, 7]) == [8]
    assert sgp.allowed_next(choices, [4]) == []
    assert not sgp.is_complete_choice(choices, [5, 7])
    assert sgp.is_complete_choice(choices, [5, 7, 8]) and sgp.is_complete_choice(choices, [9])


# -- the logit bias and the renormalisation, on the tiny model's logits -------------------------
ACTIONS = [[10], [11], [12], [13]]


def biased(logits: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    """What SGLang does with ``logit_bias`` (``apply_logits_bias``): float32 ``add_``."""
    bias = torch.zeros_like(logits)
    for k, v in sgp.allowed_bias(allowed).items():
        bias[int(k)] = v
    return logits.float().clone().add_(bias)


def test_logit_bias_and_renormalisation_match_the_torch_engine(hf_model, engine):
    """A constrained greedy step: the torch engine's token and log-prob (the contract:
    ``logits[t] - logsumexp(logits[allowed])``) equal what the SGLang path computes from the
    same logits biased as the server biases them, whether the server's log-probs are of the
    biased logits or not; the other tokens keep no probability worth a float32."""
    out = engine.generate([GenInput(prompt_ids=PROMPT, choices=ACTIONS, greedy=True)])[0]
    assert out.finish_reason == FINISH_CHOICE and len(out.token_ids) == 1
    tok, want = out.token_ids[0], out.logprobs[0]
    allowed = sgp.allowed_next(ACTIONS, [])
    logits = next_logits(hf_model, PROMPT)
    lp_biased = torch.log_softmax(biased(logits, allowed), -1)
    assert int(lp_biased.argmax()) == tok
    assert torch.exp(lp_biased[[i for i in range(512) if i not in allowed]]).sum() == 0.0
    by_torch = torch.log_softmax(logits[allowed], -1)[allowed.index(tok)].item()
    assert want == pytest.approx(by_torch, abs=1e-5)
    assert lp_biased[tok].item() == pytest.approx(want, abs=1e-4)  # float32 rounding of +1000
    assert sgp.renormalized_logprob(tok, triples(lp_biased, allowed)) == pytest.approx(want,
                                                                                       abs=1e-4)
    lp_full = torch.log_softmax(logits, -1)  # renormalising the unbiased ones gives the same
    assert lp_full[tok].item() < want - 1.0  # over 512 tokens, not 4
    assert sgp.renormalized_logprob(tok, triples(lp_full, allowed)) == pytest.approx(want,
                                                                                    abs=1e-5)


def test_the_protocol_holds_no_pickle():
    """Nothing in the client builds or reads a pickle (the custom logit processor path is
    gone); the server flag that enables it is refused."""
    src = Path(sgp.__file__).read_text() + Path(sg.__file__).read_text()
    assert "import pickle" not in src and "dill" not in src.replace("``dill.loads``", "")
    with pytest.raises(ValueError, match="unpickle"):
        sgs.server_command("m", port=1, args={"enable_custom_logit_processor": True})


# -- responses ------------------------------------------------------------------------------------
def test_parse_free_rows_shaped_as_sglang_answers_them(engine):
    outs = engine.generate([GenInput(prompt_ids=PROMPT, max_new_tokens=6),
                            GenInput(prompt_ids=PROMPT[:4], max_new_tokens=6, greedy=True)])
    for out in outs:
        if out.finish_reason == FINISH_STOP:
            finish = {"type": "stop", "matched": out.token_ids[-1]}
        else:
            finish = {"type": "length", "length": len(out.token_ids)}
        ids, lps, kind = sgp.parse_generate_response(
            sglang_body(out.token_ids, out.logprobs, finish))
        assert ids == out.token_ids and lps == out.logprobs
        assert {"stop": FINISH_STOP, "length": FINISH_LENGTH}[kind] == out.finish_reason
    out = outs[0]
    # aborted while running: the tokens so far (one may lack its log-prob yet)
    body = sglang_body(out.token_ids[:3], out.logprobs[:3], {"type": "abort", "message": "x"})
    body["output_ids"] = out.token_ids[:4]
    assert sgp.parse_generate_response(body) == (out.token_ids[:3], out.logprobs[:3], "abort")
    # aborted before prefill: the tokenizer manager's answer has no output_ids at all
    before = {"text": "", "meta_info": {"id": "r", "prompt_tokens": 0, "completion_tokens": 0,
                                        "finish_reason": {"type": "abort",
                                                          "message": "Abort before prefill"}}}
    assert sgp.parse_generate_response(before) == ([], [], "abort")
    bad = sglang_body(out.token_ids, out.logprobs, {"type": "length", "length": 6})
    bad["meta_info"]["output_token_logprobs"][1][1] += 1
    with pytest.raises(sgp.SglangAnswerError, match="log-prob 1 is of token"):
        sgp.parse_generate_response(bad)
    short = sglang_body(out.token_ids, out.logprobs, {"type": "length", "length": 6})
    short["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(sgp.SglangAnswerError, match="log-probs"):
        sgp.parse_generate_response(short)
    with pytest.raises(sgp.SglangAnswerError, match="unfinished"):
        sgp.parse_generate_response({"output_ids": [], "meta_info": {"finish_reason": None}})


def test_parse_choice_step(hf_model):
    logits = next_logits(hf_model, PROMPT)
    lp = torch.log_softmax(logits, -1)
    allowed = [10, 11, 12]
    tok = max(allowed, key=lambda t: float(logits[t]))
    body = sglang_body([tok], [float(lp[tok])], {"type": "length", "length": 1})
    body["meta_info"]["output_token_ids_logprobs"] = [triples(lp, allowed)]
    got_tok, got_lp, finish = sgp.parse_choice_step(body, allowed)
    want = torch.log_softmax(logits[allowed], -1)[allowed.index(tok)].item()
    assert (got_tok, finish) == (tok, "length") and got_lp == pytest.approx(want, abs=1e-6)
    with pytest.raises(sgp.SglangAnswerError, match="logit bias was not applied"):
        sgp.parse_choice_step(body, [20, 21])
    gone = {"meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"}}}
    assert sgp.parse_choice_step(gone, allowed) == (None, None, "abort")


def test_renormalisation_edge_cases():
    assert sgp.renormalized_logprob(4, [[-0.1, 4, None]]) == 0.0
    two = [[math.log(0.2), 1, None], [math.log(0.6), 2, None]]
    assert sgp.renormalized_logprob(1, two) == pytest.approx(math.log(0.25))
    with pytest.raises(sgp.SglangAnswerError, match="no log-prob of token 3"):
        sgp.renormalized_logprob(3, two)


# -- malformed answers (issue 43: every surface fails closed) -------------------------------------
MALFORMED = [
    ["not", "an", "object"],
    {"output_ids": 5, "meta_info": {"finish_reason": {"type": "length"}}},
    {"output_ids": ["x"], "meta_info": {"finish_reason": {"type": "length"},
                                        "output_token_logprobs": [[-0.1, 1, None]]}},
    {"output_ids": [1], "meta_info": ["finish_reason"]},
    {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"},
                                      "output_token_logprobs": [7]}},
    {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"},
                                      "output_token_logprobs": [["a", 1, None]]}},
    {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"},
                                      "output_token_logprobs": {"0": [-0.1, 1, None]}}},
    {"output_ids": [10 ** 40], "meta_info": {"finish_reason": {"type": "length"},
                                             "output_token_logprobs": [[-0.1, 1, None]]}},
    {"output_ids": [-3], "meta_info": {"finish_reason": {"type": "length"},
                                       "output_token_logprobs": [[-0.1, -3, None]]}},
    {"output_ids": [1], "meta_info": {"finish_reason": {"type": ["stop"]},
                                      "output_token_logprobs": [[-0.1, 1, None]]}},
    {"output_ids": [1], "meta_info": {"finish_reason": 3}},
    {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"},
                                      "output_token_logprobs": [[-0.1, 1, None]],
                                      "output_token_ids_logprobs": [[[None, "x", None]]]}},
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_answer_is_a_named_refusal(body):
    """An answer that is not SGLang's shape (a list, a string token id, a meta_info that
    is a list, a triple that is a number, a token id past int64...) raised TypeError,
    AttributeError or an unnamed ValueError deep in the parsing: now each one is a
    :class:`SglangAnswerError` (a ``ValueError``) that says which field is wrong."""
    with pytest.raises(sgp.SglangAnswerError, match=r"^sglang /generate answer"):
        sgp.parse_choice_step(body, [1, 2])
    with pytest.raises(sgp.SglangAnswerError, match=r"^sglang /generate answer"):
        sgp.parse_generate_response(body)


def test_an_answer_longer_than_the_request_allowed_is_refused():
    """More tokens than ``max_new_tokens`` (or than any answer may hold) is not an answer
    to the request that was sent."""
    body = sglang_body([1, 2, 3], [-0.1] * 3, {"type": "length", "length": 3})
    assert sgp.parse_generate_response(body, max_tokens=3)[0] == [1, 2, 3]
    with pytest.raises(sgp.SglangAnswerError, match=r"3 tokens, the request allowed 2"):
        sgp.parse_generate_response(body, max_tokens=2)
    huge = {"output_ids": [1] * (sgp.MAX_ANSWER_TOKENS + 1),
            "meta_info": {"finish_reason": {"type": "length"}}}
    with pytest.raises(sgp.SglangAnswerError, match="length"):
        sgp.parse_generate_response(huge)


_json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
              | st.text(max_size=6))
_json = st.recursive(_json_leaf, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=24)
_FIELDS = {"output_ids": None, "token_ids": None, "meta_info": None}
_META = ["finish_reason", "output_token_logprobs", "output_token_ids_logprobs"]


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    _json,
    st.fixed_dictionaries({}, optional={k: _json for k in _FIELDS}),
    st.fixed_dictionaries({"output_ids": st.lists(_json_leaf, max_size=4) | _json,
                           "meta_info": st.fixed_dictionaries(
                               {}, optional={k: _json | st.lists(st.lists(_json_leaf, max_size=4),
                                                                 max_size=4) for k in _META})}),
    st.builds(lambda ids, lps, kind: sglang_body(ids, lps, {"type": kind}),
              st.lists(st.integers(-5, 2**63), max_size=4),
              st.lists(st.floats() | st.none(), max_size=5),
              st.sampled_from(["stop", "length", "abort", "x", ""])),
), st.lists(st.integers(0, 600), min_size=1, max_size=3))
def test_fuzz_generate_answers_end_in_a_result_or_a_named_refusal(body, allowed):
    """Random JSON, random field shapes and near-valid answers: each parses to token ids,
    float log-probs and a finish kind, or is a :class:`SglangAnswerError`; nothing else
    (no TypeError, AttributeError, IndexError, OverflowError) ever escapes."""
    for parse in (sgp.parse_generate_response, lambda b: sgp.parse_choice_step(b, allowed)):
        try:
            out = parse(body)
        except sgp.SglangAnswerError as e:
            assert str(e).startswith("sglang /generate answer"), e
            continue
        if len(out) == 3 and isinstance(out[0], list):
            ids, lps, kind = out
            assert all(isinstance(t, int) and 0 <= t < 2**31 for t in ids)
            assert len(lps) == len(ids) and all(isinstance(x, float) for x in lps)
        else:
            tok, lp, kind = out
            assert tok is None or tok in allowed
        assert kind in ("stop", "length", "abort")


async def test_an_attached_server_answering_junk_is_refused_by_name(tiny_model_dir):
    """The attack end to end, over a real socket: an attached 'server' that answers
    ``/generate`` with a JSON list, JSON nested deeper than the parser's stack, a body
    past the answer cap, or an answer whose field has the wrong type. Each request fails
    with a :class:`SglangAnswerError` naming what is wrong; the engine serves the next."""
    web = pytest.importorskip("aiohttp.web")
    bodies = [b"[1, 2]", b"[" * 200_000, b'{"output_ids": "' + b"x" * (sgp.MAX_ANSWER_BYTES + 10)
              + b'"}', json.dumps({"output_ids": [1], "meta_info": []}).encode(),
              json.dumps(sglang_body([5], [-0.5], {"type": "length"})).encode()]
    sent = []

    async def generate(request):
        sent.append(await request.json())
        return web.Response(body=bodies[len(sent) - 1], content_type="application/json")

    async def health(request):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health_generate", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    eng = sg.SglangEngine(tiny_model_dir, engine_args={"url": f"http://127.0.0.1:{port}",
                                                        "check_logprobs": False})
    await eng.start()
    try:
        for i, why in enumerate([r"not an object|Expected `object`", r"not JSON",
                                 r"more than \d+ bytes", r"meta_info"]):
            with pytest.raises(sgp.SglangAnswerError, match=why):
                await eng.generate(GenInput(prompt_ids=PROMPT, max_new_tokens=4), f"r{i}")
        out = await eng.generate(GenInput(prompt_ids=PROMPT, max_new_tokens=4), "ok")
        assert out.token_ids == [5] and out.logprobs == [-0.5]
    finally:
        await eng.close()
        await runner.cleanup()


def test_error_text_of_sglang_error_bodies():
    assert sgp.error_text(b'{"object": "error", "message": "too long", "code": 400}') == "too long"
    assert sgp.error_text(b'{"error": {"message": "bad mode"}}') == "bad mode"
    assert sgp.error_text(b"Internal Server Error") == "Internal Server Error"


# -- launching ------------------------------------------------------------------------------------
def test_server_command(tiny_model_dir):
    cmd = sgs.server_command(tiny_model_dir, port=31234, seed=7, python="/opt/sgl/bin/python",
                             args={"mem_fraction_static": 0.3, "disable_cuda_graph": True,
                                   "enable_metrics": False, "cuda_graph_bs": [1, 2, 4],
                                   "json_model_override_args": {"a": 1}},
                             head_dim=32)
    assert cmd[:3] == ["/opt/sgl/bin/python", "-c", sgs.BOOTSTRAP]
    flat = " ".join(cmd)
    assert not {"--enable-custom-logit-processor", "--api-key"} & set(cmd[3:])  # key: env
    for part in (f"--model-path {tiny_model_dir}", "--host 127.0.0.1", "--port 31234",
                 "--skip-tokenizer-init",
                 "--mem-fraction-static 0.3", "--disable-cuda-graph", "--cuda-graph-bs 1 2 4",
                 "--random-seed 7", "--attention-backend triton",
                 '--json-model-override-args {"a": 1}'):
        assert part in flat, part
    assert "--enable-metrics" not in flat
    own = sgs.server_command(tiny_model_dir, port=1, args={"random_seed": 1, "host": "0.0.0.0",
                                                           "attention-backend": "fa3"},
                             head_dim=32)
    assert "--random-seed 1" in " ".join(own) and "--host 0.0.0.0" in " ".join(own)
    assert "--attention-backend fa3" in " ".join(own)
    assert "--attention-backend" not in " ".join(sgs.server_command("m", port=1, head_dim=128))
    with pytest.raises(ValueError, match="model_path"):
        sgs.server_command(tiny_model_dir, port=1, args={"model-path": "x"})
    with pytest.raises(ValueError, match="api_key"):
        sgs.server_command(tiny_model_dir, port=1, args={"api-key": "mine"})


FAKE_SERVER = r'''
"""A stand-in for ``python -m sglang.launch_server``: SGLang's HTTP API as rollart uses it,
with SGLang's API-key rule (``add_api_key_middleware``: every path but /health* and /metrics
needs ``Authorization: Bearer <key>``, else 401). Each request is a line in $FAKE_SGLANG_LOG."""
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--port", "--api-key", "--random-seed"):
    ap.add_argument(flag)
args, rest = ap.parse_known_args()
LOG = os.environ["FAKE_SGLANG_LOG"]
print(f"server_args=ServerArgs(api_key={args.api_key!r}, rest={rest!r})", flush=True)


def record(**kw):
    with open(LOG, "a") as f:
        f.write(json.dumps(kw) + "\n")


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_any(self, body):
        auth = self.headers.get("Authorization")
        record(path=self.path, auth=auth, body=body, argv=sys.argv[1:],
               env_key=os.environ.get("ROLLART_SGLANG_API_KEY"))
        if not self.path.startswith(("/health", "/metrics")) and (
                not args.api_key or auth != "Bearer " + args.api_key):
            return self.answer(401, {"error": "Unauthorized"})
        if self.path == "/get_server_info":
            return self.answer(200, {"version": "stand-in"})
        if self.path == "/generate":
            sp = body.get("sampling_params") or {}
            ids = body.get("token_ids_logprob") or [3]
            bias = sp.get("logit_bias") or {}
            tok = int(max(bias, key=bias.get)) if bias else 3
            lps = [[-1.0 - 0.1 * i, int(t), None] for i, t in enumerate(ids)]
            return self.answer(200, {"output_ids": [tok], "meta_info": {
                "finish_reason": {"type": "length", "length": 1},
                "output_token_logprobs": [[-0.5, tok, None]],
                "output_token_ids_logprobs": [lps]}})
        return self.answer(200, {"success": True})

    def do_GET(self):
        self.handle_any(None)

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.handle_any(json.loads(self.rfile.read(n) or b"null"))


ThreadingHTTPServer((args.host, int(args.port)), H).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path):
    """(engine_args that launch the stand-in server, the file its requests are logged in):
    a ``sglang`` package with a ``launch_server`` module, found through an interpreter
    wrapper (``engine_args.python``) that puts it on the path."""
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SERVER)
    log = tmp_path / "requests.jsonl"
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexport PYTHONPATH={pkg.parent}\nexport "
                       f"FAKE_SGLANG_LOG={log}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return {"python": str(wrapper), "startup_timeout_s": 60, "weights_dir": str(tmp_path / "w"),
            "check_logprobs": True}, log


async def test_a_launched_server_takes_requests_only_with_its_key(tiny_model_dir, stand_in):
    """Issue 43 finding 5: the launched server gets an API key no other process knows (not
    on its command line), every request of the engine carries it, a request without it is
    refused, constrained turns go through logit_bias, and no pickle is ever sent."""
    aiohttp = pytest.importorskip("aiohttp")
    args, log = stand_in
    eng = sg.SglangEngine(tiny_model_dir, engine_args=args)
    await eng.start()
    try:
        key = eng._api_key
        assert key and len(key) >= 32
        cmdline = Path(f"/proc/{eng._proc.pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline and b"--enable-custom-logit-processor" not in cmdline
        assert oct(eng.log_path.stat().st_mode & 0o777) == "0o600"
        assert eng.logit_bias_ok is True
        out = await eng.generate(GenInput(prompt_ids=PROMPT, choices=ACTIONS, greedy=True), "c")
        assert out.token_ids in ACTIONS and out.finish_reason == FINISH_CHOICE
        async with aiohttp.ClientSession() as anyone:  # another local process
            for path in ("/generate", "/update_weights_from_disk"):
                async with anyone.post(eng.url + path, json={"model_path": "/tmp/evil"}) as r:
                    assert r.status == 401
        reqs = [json.loads(line) for line in log.read_text().splitlines()]
        ours = reqs[:-2]
        assert ours and all(r["auth"] == f"Bearer {key}" for r in ours), ours
        assert reqs[0]["argv"][-2:] == ["--api-key", key] and reqs[0]["env_key"] is None
        assert not any("custom_logit_processor" in json.dumps(r["body"]) for r in reqs)
        assert sgs.tail(eng.log_path, secret=key).count("***") >= 1
        assert key not in sgs.tail(eng.log_path, secret=key)
    finally:
        await eng.close()


def test_api_key_args(tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="attached server"):
        sg.SglangEngine(tiny_model_dir, engine_args={"api_key": "k"})
    monkeypatch.setenv(sgs.API_KEY_ENV, "from-env")
    assert sg.SglangEngine(tiny_model_dir, engine_args={"url": "http://h:1"})._api_key == "from-env"
    assert sg.SglangEngine(tiny_model_dir, engine_args={"url": "http://h:1",
                                                        "api_key": "k"})._api_key == "k"
    assert sg.SglangEngine(tiny_model_dir)._api_key is None  # made at launch


def test_gpu_check_cpu_side():
    """benchmarks/gpu_check.sh parses, its helper's pure parts work, and without a GPU it
    stops at once with exit 2 and a JSON line saying why."""
    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    r = subprocess.run(["bash", str(script), "--self-test"], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["self_test"] == "ok", r.stderr
    if shutil.which("nvidia-smi"):
        return
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 2 and "no NVIDIA GPU" in r.stderr
    assert json.loads(r.stdout)["ok"] is False


# ======================================================================================
# With a CUDA GPU and sglang: a real server
# ======================================================================================
GPU_REASON = sgs.sglang_unavailable_reason()
gpu = pytest.mark.skipif(GPU_REASON is not None,
                         reason=f"needs a CUDA GPU and sglang: {GPU_REASON}")
GPU_ARGS = {"dtype": "float32", "mem_fraction_static": 0.25, "disable_cuda_graph": True,
            "startup_timeout_s": 600}
TOL = 2e-2  # float32 server kernels vs a float32 torch forward


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its output layer scaled up: log-probs spread over tens of nats,
    so that temperature-scaled ones could not pass for raw ones."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("sglang") / "peaked"
    shutil.copytree(tiny_model_dir, out)
    sd = load_file(str(out / "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 6.0
    save_file(sd, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def peaked_hf(peaked_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(peaked_model_dir, dtype=torch.float32,
                                                local_files_only=True).eval()


def forced_logprobs(model, prompt, tokens, allowed_steps=None) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *tokens]])).logits[0].float()
    out = []
    for i, t in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        if allowed_steps is not None:
            allowed = allowed_steps[i]
            out.append(torch.log_softmax(row[allowed], -1)[allowed.index(t)].item())
        else:
            out.append(torch.log_softmax(row, -1)[t].item())
    return out


@pytest.fixture(scope="module")
async def server(peaked_model_dir):
    eng = sg.SglangEngine(peaked_model_dir, seed=0, engine_args=GPU_ARGS)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


@gpu
async def test_gpu_free_rows_report_raw_logprobs(server, peaked_hf):
    assert server.raw_logprobs is True, "the launched server must return pre-temperature ones"
    for kw in ({"temperature": 1.0}, {"temperature": 0.5}, {"greedy": True},
               {"temperature": 1.3, "top_p": 0.8}):
        out = await server.generate(GenInput(prompt_ids=PROMPT, max_new_tokens=10, **kw), "free")
        assert out.version == 0 and out.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        assert len(out.token_ids) == len(out.logprobs) >= 1
        want = forced_logprobs(peaked_hf, PROMPT, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < TOL, (kw, out, want)


@gpu
async def test_gpu_stop_tokens_end_the_row(server):
    first = await server.generate(GenInput(prompt_ids=PROMPT, max_new_tokens=8, greedy=True), "a")
    stop = first.token_ids[2]
    cut = first.token_ids.index(stop) + 1
    out = await server.generate(GenInput(prompt_ids=PROMPT, max_new_tokens=8, greedy=True,
                                         stop_token_ids=(stop,)), "b")
    assert out.token_ids == first.token_ids[:cut] and out.finish_reason == FINISH_STOP


@gpu
@pytest.mark.parametrize("kw", [{"greedy": True}, {"temperature": 1.0}, {"temperature": 0.6}])
async def test_gpu_choices(server, peaked_hf, kw):
    choices = [[5, 6], [5, 7, 8], [9], [30, 31]]
    for i in range(4):
        out = await server.generate(GenInput(prompt_ids=PROMPT[i:], choices=choices, **kw),
                                    f"c{i}")
        assert out.token_ids in choices and out.finish_reason == FINISH_CHOICE
        steps = [sgp.allowed_next(choices, out.token_ids[:j]) for j in range(len(out.token_ids))]
        want = forced_logprobs(peaked_hf, PROMPT[i:], out.token_ids, steps)
        assert max(abs(a - b) for a, b in zip(out.logprobs, want)) < TOL
        assert [lp for s, lp in zip(steps, out.logprobs) if len(s) == 1] == \
            [0.0] * sum(len(s) == 1 for s in steps)


@pytest.fixture(scope="module")
async def long_input(server):
    """A greedy row that runs its full 1000 tokens (no eos on the way): seconds."""
    import random

    rng = random.Random(5)
    for i in range(12):
        inp = GenInput(prompt_ids=[1] + [rng.randrange(3, 500) for _ in range(8)],
                       max_new_tokens=1000, greedy=True)
        if (await server.generate(inp, f"find-long-{i}")).finish_reason == FINISH_LENGTH:
            return inp
    pytest.fail("no prompt found whose greedy continuation avoids eos for 1000 tokens")


@gpu
async def test_gpu_abort_returns_what_was_generated(server, long_input):
    inp = long_input
    task = asyncio.ensure_future(server.generate(inp, "long"))
    await asyncio.sleep(0.3)
    await server.abort(["long", "not-in-flight"])
    with pytest.raises(EngineAborted) as ei:
        await asyncio.wait_for(task, 30)
    e = ei.value
    assert e.request_id == "long" and e.partial_version == 0
    assert e.partial.finish_reason == FINISH_INTERRUPTED
    assert len(e.partial.token_ids) == len(e.partial.logprobs) < 1000
    full = await server.generate(inp, "long-again")  # greedy: the partial is its prefix
    assert full.token_ids[:len(e.partial.token_ids)] == e.partial.token_ids


@gpu
async def test_gpu_pause_modes(server, long_input):
    long = long_input
    short = GenInput(prompt_ids=PROMPT, max_new_tokens=4, greedy=True)
    running = asyncio.ensure_future(server.generate(long, "run-1"))
    await asyncio.sleep(0.2)
    await server.pause("abort")
    with pytest.raises(EngineAborted):
        await running
    queued = asyncio.ensure_future(server.generate(short, "q-1"))
    await asyncio.sleep(0.3)
    assert not queued.done(), "a paused engine starts no request"
    await server.resume()
    assert (await asyncio.wait_for(queued, 30)).finish_reason in (FINISH_STOP, FINISH_LENGTH)
    # wait: returns once the request in flight has finished, which it does normally
    running = asyncio.ensure_future(server.generate(GenInput(prompt_ids=PROMPT,
                                                             max_new_tokens=64), "run-2"))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(server.pause("wait"), 60)
    assert running.done() and running.result().finish_reason in (FINISH_STOP, FINISH_LENGTH)
    queued = asyncio.ensure_future(server.generate(short, "q-2"))
    await asyncio.sleep(0.1)
    await server.abort(["q-2"])  # a queued request aborted: nothing generated
    with pytest.raises(EngineAborted) as ei:
        await queued
    assert ei.value.partial.token_ids == []
    await server.resume()


@gpu
async def test_gpu_load_weights(server, peaked_model_dir, tmp_path):
    from safetensors.torch import load_file, save

    inp = GenInput(prompt_ids=PROMPT, max_new_tokens=8, greedy=True)
    before = await server.generate(inp, "w0")
    sd = load_file(str(peaked_model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    await server.pause("wait")
    await server.load_weights(save(new), 1)
    await server.resume()
    after = await server.generate(inp, "w1")
    assert server.version == 1 and after.version == 1 and after.token_ids != before.token_ids
    # a mismatch is refused before the server sees it: v1 keeps serving
    bad = dict(new)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        await server.load_weights(save(bad), 2)
    assert server.version == 1
    assert (await server.generate(inp, "w1b")).token_ids == after.token_ids
    # from a file, back to the original weights
    await server.pause("wait")
    await server.load_weights(peaked_model_dir / "model.safetensors", 2)
    await server.resume()
    again = await server.generate(inp, "w2")
    assert again.version == 2 and again.token_ids == before.token_ids
