"""The README's secure multi-host recipe, as real processes: every role under its own
credential, over TLS, with the permissions `rollart secure init` generates.

``rollart secure init`` makes the CA, the server certificate and one password per role;
the head node (trainer and its scheduler) starts the embedded nats-server with that
``server.conf`` on a wildcard address; env, generate and reward nodes join with their own
user; ``rollart top`` watches as the monitor. The run trains to its end, the server logs
no permission violation, and no secret appears in any output or file of the run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.actors.sample_actors import new_run
from tests.child_output import ROOT, all_exited, outputs_of
from tests.child_output import NodeProcess as Proc
from tests.waiting import until

pytestmark = pytest.mark.slow


def creds(tmp_path: Path, run: str) -> Path:
    d = tmp_path / "secure"
    out = subprocess.run([sys.executable, "-m", "rollart.app.cli", "secure", "init", str(d),
                          "--host", "localhost", "--run", run],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return d


def as_role(d: Path, user: str) -> tuple[str, ...]:
    return ("--user", user, "--password-file", str(d / f"{user}.password"), "--tls-ca", str(d / "ca.pem"))


async def test_every_role_under_its_own_credential_over_tls(tmp_path, tiny_model):
    run = new_run()
    d = creds(tmp_path, run)
    secrets = [(d / f"{u}.password").read_text().strip()
               for u in ("trainer", "scheduler", "env", "generate", "reward", "monitor", "admin")]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        "node: {grace: 3, heartbeat_every: 0.5}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, max_turns: 3}}\n"
        "rollout: {group_size: 2, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 2, eval_groups: 1}\n")
    head = Proc(cfg, "trainer,scheduler", "--listen", "0.0.0.0:0",
                "--server-config", str(d / "server.conf"), *as_role(d, "trainer"))
    procs = [head]
    top = None
    try:
        line = await head.line_with("embedded nats-server at")
        port = re.search(r":(\d+)\b", line.rsplit(" ", 1)[-1]).group(1)
        url = f"nats://localhost:{port}"
        # the reward node first, serving before the others start: frozenlake never asks it, so
        # a run that two env and generate nodes finish quickly could otherwise end (and stop its
        # embedded server) while the reward node is still starting
        procs.append(Proc(cfg, "reward", "--nats", url, *as_role(d, "reward")))
        await procs[-1].line_with("serving reward")
        for role in ("env", "generate"):
            procs.append(Proc(cfg, role, "--nats", url, *as_role(d, role)))
        top = subprocess.Popen(
            [sys.executable, "-m", "rollart.app.cli", "top", "--nats", url, "--run", run,
             "--duration", "4", *as_role(d, "monitor")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        await until(lambda: all_exited(procs), deadline=200, step=0.2,
                    what="every node to exit by itself", state=lambda: outputs_of(procs))
        for p in procs:

            assert p.proc.poll() == 0, f"{p.roles} node: rc {p.proc.poll()}\n{p.output()}"
        top_out, _ = top.communicate(timeout=60)
        assert top.returncode == 0, top_out
    finally:
        for p in procs:
            p.kill()
        if top is not None and top.poll() is None:
            top.kill()
    for p in procs:
        p.reader.join(5)

    run_path = tmp_path / "runs" / run
    summary = (run_path / "summary.json").read_text()
    assert '"steps": 2' in summary and '"interrupted": false' in summary, summary
    server_log = (run_path / "nats" / "nats-server.log").read_text()
    assert "Permissions Violation" not in server_log, [
        x for x in server_log.splitlines() if "Permissions Violation" in x][:5]
    assert "TLS required" in server_log or "tls" in server_log.lower()
    outputs = "".join(p.output() for p in procs) + top_out
    assert "Permissions Violation" not in outputs
    files = [f for f in run_path.rglob("*") if f.is_file() and f.stat().st_size < 50_000_000]
    for secret in secrets:
        assert secret not in outputs, "a password in a node's output"
        for f in files:
            assert secret.encode() not in f.read_bytes(), f"a password in {f}"
