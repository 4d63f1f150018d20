"""A run's curves where researchers look: TensorBoard, Weights & Biases, MLflow
(``telemetry.loggers``), each through its own package, with the numeric fields of every
``metrics.jsonl`` row (the same names, ``step`` as the x axis), the final evaluation, and the
run's config as hyperparameters.

The trainer opens them (:func:`open_loggers`) and calls :meth:`MetricLoggers.log` off the
event loop after each row is written. A logger is never a reason for a run to stop: a
package that is not installed, or a logger that raises, is one warning, and that logger is
off for the rest of the run (``metrics.jsonl`` is the record either way).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml

log = logging.getLogger(__name__)

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
"""Logger -> the package that provides it (``pip install 'rollart[loggers]'``: all three)."""


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite fields of a metrics row (lists, strings and ``step`` left out)."""
    out = {}
    for k, v in row.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


class _TensorBoard:
    def __init__(self, run_path: Path, run: str, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.path = run_path / "tensorboard"
        self.w = SummaryWriter(log_dir=str(self.path))
        self.w.add_text("config", "```\n" + _yaml(config) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, run_path: Path, run: str, config: dict, project: str) -> None:
        import wandb  # optional dependency: telemetry.loggers wandb only

        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.path = run_path / "wandb"
        self.path.mkdir(parents=True, exist_ok=True)
        self.r = wandb.init(project=project, name=run, id=run, dir=str(run_path), mode=mode,
                            config=config, resume="allow", reinit="create_new")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.r.log(values, step=step)

    def close(self) -> None:
        self.r.finish()


class _Mlflow:
    def __init__(self, run_path: Path, run: str, config: dict, uri: str, experiment: str) -> None:
        if not uri:
            uri = (run_path / "mlruns").resolve().as_uri()
            # a folder store needs this opt-in since MLflow 3 (it is kept, not developed)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # optional dependency: telemetry.loggers mlflow only
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        found = self.client.search_runs([exp_id], f"tags.rollart_run = '{run}'", max_results=1)
        if found:  # a resumed run goes on in the same MLflow run
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run,
                                                 tags={"rollart_run": run}).info.run_id
            params = [Param(k[:250], str(v)[:6000]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        metrics = [self._metric(k, v, ts, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _yaml(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False)


class MetricLoggers:
    """The open loggers of a run; :meth:`log` and :meth:`close` never raise."""

    def __init__(self, loggers: dict[str, Any]) -> None:
        self.loggers = loggers

    @property
    def names(self) -> list[str]:
        return list(self.loggers)

    def log(self, row: dict[str, Any], *, prefix: str = "") -> None:
        """Log the numeric fields of ``row`` at its ``step`` (blocking: call off the loop)."""
        step = int(row.get("step", 0))
        values = {f"{prefix}{k}": v for k, v in scalars(row).items()}
        if not values:
            return
        for name in list(self.loggers):
            try:
                self.loggers[name].log(step, values)
            except Exception as e:  # noqa: BLE001 - a logger never stops the run
                log.warning("telemetry.loggers: %s failed (%s: %s); it is off for the rest of "
                            "the run (metrics.jsonl has every row)", name, type(e).__name__, e)
                self._drop(name)

    def close(self) -> None:
        for name in list(self.loggers):
            self._drop(name)

    def _drop(self, name: str) -> None:
        lg = self.loggers.pop(name, None)
        if lg is not None:
            try:
                lg.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("closing logger %s failed", name, exc_info=True)


def open_loggers(cfg: Any, run_path: str | Path, config: dict | None = None) -> MetricLoggers:
    """Open the loggers of a RunConfig's ``telemetry.loggers`` for the run folder ``run_path``
    (blocking). ``config``: the hyperparameters to record (default: ``cfg`` as plain data)."""
    t = cfg.telemetry
    run_path = Path(run_path)
    run_path.mkdir(parents=True, exist_ok=True)
    config = msgspec.to_builtins(cfg) if config is None else config
    out: dict[str, Any] = {}
    for name in t.loggers:
        try:
            if name == "tensorboard":
                out[name] = _TensorBoard(run_path, cfg.run, config)
            elif name == "wandb":
                out[name] = _Wandb(run_path, cfg.run, config, t.wandb_project)
            elif name == "mlflow":
                out[name] = _Mlflow(run_path, cfg.run, config, t.mlflow_uri, t.mlflow_experiment)
        except ImportError as e:
            log.warning("telemetry.loggers: %s needs %s, which is not installed here (%s); pip "
                        "install 'rollart[loggers]'. Going on without it", name, PACKAGES[name], e)
        except Exception as e:  # noqa: BLE001 - a logger never stops the run
            log.warning("telemetry.loggers: %s did not start (%s: %s); going on without it",
                        name, type(e).__name__, e)
    if out:
        log.info("metrics also go to %s", ", ".join(out))
    return MetricLoggers(out)
