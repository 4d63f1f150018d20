"""What a receiver pays to decode and check the hot wire messages, and what it says about junk.

::

    python benchmarks/message_decode.py                      # this tree only
    python benchmarks/message_decode.py --baseline b3e300a   # and the messages.py of a commit

Prints JSON. For each hot message (a turn's ``generate.request`` and its reply, a
trajectory's ``rollout.requested`` and ``rollout.completed``, a reward request) it times
what the runtime runs on receipt: ``decode`` (msgpack into the type, with the constraints
and ``__post_init__`` the type carries) then ``validate`` (the checks that stay outside the
type); microseconds per message, best of several rounds. ``reasons`` is the dead-letter
reason the runtime writes for a few malformed payloads (``malformed payload: ...`` for a
``DecodeError``, ``invalid: ...`` for ``Invalid``).

``--baseline REF`` loads ``src/rollart/messages.py`` as it was at ``REF`` (a commit where
the contract was still one module, with its parallel validator) beside the current one, so
both are measured in one process on the same machine.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from types import ModuleType

import msgspec

from rollart import messages as current
from rollart.bus.codec import DecodeError, decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_baseline(ref: str) -> ModuleType:
    """``rollart/messages.py`` at commit ``ref``, imported under another name."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:src/rollart/messages.py"],
                         check=True, capture_output=True, text=True).stdout
    name = "rollart_messages_baseline"
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # msgspec resolves the string annotations through sys.modules
    exec(compile(src, f"{ref}:src/rollart/messages.py", "exec"), mod.__dict__)
    return mod


def samples(m: ModuleType) -> dict[str, tuple[type, dict]]:
    """Name -> (type, fields) of the hot messages, sized like a quickstart run's and a long one."""
    def trajectory(n_tokens: int, turns: int) -> dict:
        per = n_tokens // turns
        mask = ([0] * (per - 8) + [1] * 8) * turns
        return dict(
            traj_id="g000012-3", group_id="g000012", env="main", seed=1234, index_in_group=3,
            token_ids=[(i * 7919) % 50000 for i in range(len(mask))], response_mask=mask,
            logprobs=[-0.25 if k else 0.0 for k in mask],
            token_versions=[4 if k else -1 for k in mask],
            turns=[m.TurnRecord(start=t * per + per - 8, response_len=8, version=4, action="1",
                                reward=0.0, pool="default") for t in range(turns)],
            min_version=4, max_version=4, reward=1.0, success=True,
            timings={"reset": 0.01, "generate": 0.4, "step": 0.02, "reward": 0.0, "wait": 0.1},
            attempt=1, finished_at=1.7e9, group_index=12, admitted_version=3)

    return {
        "GenerateRequest": (m.GenerateRequest, dict(
            traj_id="g000012-3", prompt_ids=list(range(100, 400)),
            sampling=m.SamplingParams(max_new_tokens=8, stop_token_ids=(2,)),
            choices=[[11], [12], [13], [14]], min_version=3, request_id="g000012-3:t2:a1")),
        "GenerateResult": (m.GenerateResult, dict(
            token_ids=[11, 2], logprobs=[-0.3, -0.01], version=4, replica="gen-0")),
        "RolloutRequested": (m.RolloutRequested, dict(
            traj_id="g000012-3", group_id="g000012", env="main", seed=1234, index_in_group=3,
            admitted_version=3, min_version=2, created_at=1.7e9, group_index=12)),
        "RolloutCompleted_300": (m.RolloutCompleted, trajectory(300, 4)),
        "RolloutCompleted_4096": (m.RolloutCompleted, trajectory(4096, 16)),
        "RewardRequest": (m.RewardRequest, dict(
            traj_id="g000012-3", scorer="answer_match", response="42", answer="42",
            request_id="g000012-3:r:a1")),
    }


def encode_fields(typ: type, fields: dict) -> bytes:
    return msgspec.msgpack.encode(typ(**fields))


def per_call_us(fns: dict[str, object], payload: bytes, budget_s: float = 0.04,
                rounds: int = 15) -> dict[str, float]:
    """Label -> best of ``rounds`` mean microseconds per ``fn(payload)``. The rounds of the
    functions alternate, so that a busy moment of a shared machine hits them alike."""
    n = {}
    for label, fn in fns.items():
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < budget_s / 4:
            fn(payload)
            k += 1
        n[label] = max(1, k * 4)
    best = dict.fromkeys(fns, math.inf)
    gc.collect()
    gc.disable()  # a collection lands in whichever round allocated last: noise, not cost
    try:
        _rounds(fns, payload, n, best, rounds)
    finally:
        gc.enable()
    return {label: round(t * 1e6, 3) for label, t in best.items()}


def _rounds(fns: dict, payload: bytes, n: dict, best: dict, rounds: int) -> None:
    for _ in range(rounds):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(n[label]):
                fn(payload)
            best[label] = min(best[label], (time.perf_counter() - t0) / n[label])


def receive(m: ModuleType, typ: type):
    """What the runtime runs on a delivery of ``typ``: decode, then the checks outside it."""
    def run(payload: bytes):
        msg = decode(typ, payload)
        m.validate(msg)
        return msg
    return run


def reason(m: ModuleType, typ: type, payload: bytes) -> str:
    """The dead-letter reason the runtime gives ``payload`` (empty: accepted)."""
    try:
        receive(m, typ)(payload)
    except DecodeError as e:
        return f"malformed payload: {e}"
    except m.Invalid as e:
        return f"invalid: {e}"
    return ""


def malformed(m: ModuleType) -> dict[str, tuple[type, bytes]]:
    """A few payloads no correct sender produces, one per kind of check."""
    hot = samples(m)

    def changed(name: str, **change) -> tuple[type, bytes]:
        typ, fields = hot[name]
        doc = msgspec.to_builtins(typ(**fields))
        doc.update(change)
        return typ, msgspec.msgpack.encode(doc)

    return {
        "negative seed": changed("RolloutRequested", seed=-1),
        "traj_id with a space": changed("RolloutRequested", traj_id="no spaces"),
        "token id out of range": changed("GenerateRequest", prompt_ids=[1, 2**40]),
        "top_p = 0": changed("GenerateRequest", sampling={"top_p": 0.0}),
        "logprobs shorter than tokens": changed("GenerateResult", logprobs=[-0.3]),
        "NaN logprob": changed("RolloutCompleted_300", logprobs=[0.0] * 299 + [float("nan")]),
        "response_mask value 2": changed("RolloutCompleted_300", response_mask=[2] * 300),
        "env not printable": changed("RolloutRequested", env="ma\x00in"),
    }


def measure(mods: dict[str, ModuleType]) -> dict:
    """Label -> timings and reasons of each contract in ``mods``."""
    out = {label: {"receive_us": {}, "decode_only_us": {}, "bytes": {}, "reasons": {}}
           for label in mods}
    hot = {label: samples(m) for label, m in mods.items()}
    for name in hot[next(iter(mods))]:
        payloads = {}
        for label, m in mods.items():
            typ, fields = hot[label][name]
            payloads[label] = encode_fields(typ, fields)
            assert reason(m, typ, payloads[label]) == "", f"{name}: the sample must be valid"
            out[label]["bytes"][name] = len(payloads[label])
        assert len(set(payloads.values())) == 1, f"{name}: the contracts encode it alike"
        payload = next(iter(payloads.values()))
        typs = {label: hot[label][name][0] for label in mods}
        fns = {f"receive {label}": receive(m, typs[label]) for label, m in mods.items()}
        fns |= {f"decode {label}": (lambda p, t=typs[label]: decode(t, p)) for label in mods}
        took = per_call_us(fns, payload)
        for label in mods:
            out[label]["receive_us"][name] = took[f"receive {label}"]
            out[label]["decode_only_us"][name] = took[f"decode {label}"]
    for label, m in mods.items():
        for what, (typ, payload) in malformed(m).items():
            out[label]["reasons"][what] = reason(m, typ, payload)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REF", help="also measure messages.py at this commit")
    args = ap.parse_args()
    result = {"python": platform.python_version(), "msgspec": msgspec.__version__,
              "machine": f"{platform.machine()} x{os.cpu_count()}"}
    mods = {"current": current}
    if args.baseline:
        mods = {"baseline": load_baseline(args.baseline), **mods}
    result |= measure(mods)
    if args.baseline:
        result["baseline"] = {"ref": args.baseline, **result["baseline"]}
    if args.baseline:
        b, c = result["baseline"]["receive_us"], result["current"]["receive_us"]
        result["speedup"] = {k: round(b[k] / c[k], 2) for k in c if k in b and c[k] > 0}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
