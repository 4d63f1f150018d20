"""``telemetry.loggers``: every metrics row also goes to TensorBoard, wandb (offline here) and
MLflow (a folder store), read back with each package's own reader; a failing logger turns
itself off without stopping the run; a ``rollart run`` with loggers on writes its curves and
the final evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.config import ConfigError, RunConfig, convert
from rollart.telemetry.loggers import MetricLoggers, open_loggers, scalars
from tests.actors.sample_actors import new_run
from tests.waiting import until_sync

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"step": s, "version": s, "success": 0.25 * s, "reward": -1.0 + s, "train_s": 0.5,
         "traj_ids": ["g000000-0"], "note": "text"} for s in (1, 2, 3)]


def cfg_with(*loggers: str, **telemetry) -> RunConfig:
    return convert({"run": new_run(), "telemetry": {"loggers": list(loggers), **telemetry}},
                   RunConfig)


def test_scalars_keep_finite_numbers_only():
    assert scalars({"step": 3, "a": 1, "b": 0.5, "c": float("nan"), "d": [1], "e": "x",
                    "f": True}) == {"a": 1.0, "b": 0.5}


def test_a_logger_named_twice_is_a_config_error():
    with pytest.raises((ConfigError, ValueError), match="telemetry.loggers names a logger twice"):
        cfg_with("tensorboard", "tensorboard")
    with pytest.raises((ConfigError, ValueError), match="telemetry.loggers"):
        cfg_with("neptune")


def test_tensorboard_gets_every_row(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = cfg_with("tensorboard")
    lg = open_loggers(cfg, tmp_path)
    assert lg.names == ["tensorboard"]
    for row in ROWS:
        lg.log(row)
    lg.log({"step": 3, "greedy_success": 1.0}, prefix="eval/")
    lg.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"success", "reward", "train_s", "version", "eval/greedy_success"} <= tags, tags
    assert "traj_ids" not in tags and "note" not in tags and "step" not in tags
    assert [(e.step, e.value) for e in acc.Scalars("success")] == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_mlflow_gets_every_row_and_the_config(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    cfg = cfg_with("mlflow")
    lg = open_loggers(cfg, tmp_path)
    assert lg.names == ["mlflow"]
    for row in ROWS:
        lg.log(row)
    run_id, uri = lg.loggers["mlflow"].run_id, lg.loggers["mlflow"].uri
    lg.close()
    client = MlflowClient(tracking_uri=uri)
    hist = client.get_metric_history(run_id, "success")
    assert sorted((h.step, h.value) for h in hist) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    run = client.get_run(run_id)
    assert run.data.params["rollout.group_size"] == str(cfg.rollout.group_size)
    assert run.data.tags["rollart_run"] == cfg.run
    # the same run again (a resume) logs into the same MLflow run
    again = open_loggers(cfg, tmp_path)
    assert again.loggers["mlflow"].run_id == run_id
    again.close()


def test_wandb_offline_gets_every_row(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = cfg_with("wandb")
    lg = open_loggers(cfg, tmp_path)
    assert lg.names == ["wandb"]
    for row in ROWS:
        lg.log(row)
    lg.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{cfg.run}"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    log_file = runs[0] / f"run-{cfg.run}.wandb"
    keys = (b"success", b"reward", b"train_s")
    # wandb's service process writes the run's records; finish() can return before the last
    # of them reach the file
    until_sync(lambda: all(k in log_file.read_bytes() for k in keys), deadline=60,
               what="the offline run's records", state=lambda: log_file.read_bytes()[:200])


def test_a_failing_logger_turns_itself_off_and_the_others_go_on(tmp_path, caplog):
    pytest.importorskip("tensorboard")

    class Broken:
        closed = False

        def log(self, step, values):
            raise OSError("disk full")

        def close(self):
            Broken.closed = True

    lg = open_loggers(cfg_with("tensorboard"), tmp_path)
    lg = MetricLoggers({"broken": Broken(), **lg.loggers})
    lg.log(ROWS[0])
    assert lg.names == ["tensorboard"] and Broken.closed
    assert "broken failed (OSError: disk full); it is off for the rest of the run" in caplog.text
    lg.log(ROWS[1])
    lg.close()


@pytest.mark.slow
def test_a_run_with_loggers_writes_its_curves_and_final_evaluation(tmp_path, tiny_model):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = new_run()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"run_dir: {tmp_path / 'runs'}\n"
        f"model: {{path: '{tiny_model}'}}\n"
        "envs: {main: {type: frozenlake, max_turns: 4}}\n"
        "rollout: {group_size: 4, batch_groups: 2, alpha: 1}\n"
        "trainer: {steps: 2, eval_groups: 1}\n"
        "telemetry: {loggers: [tensorboard, mlflow]}\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "rollart", "run", str(cfg), "--nats", "memory"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    folder = tmp_path / "runs" / run
    summary = json.loads((folder / "summary.json").read_text())
    acc = EventAccumulator(str(folder / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("success")] == [1, 2]
    assert [(e.step, e.value) for e in acc.Scalars("eval/greedy_success")] == \
        [(2, pytest.approx(summary["greedy_success"]))]
    assert (folder / "mlruns").is_dir()
