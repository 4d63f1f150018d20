"""The first hour of a new user, with real `rollart` processes: runs never trap you (a taken
run name gets a suffix, a rollout never claims a training run's folder), the example configs
ship inside the package, and the Makefile's two commands do what the README says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, tiny_model: Path, run: str = "tiny") -> Path:
    """A quickstart-like config, as small as a run gets: 4 trajectories a step."""
    cfg = {
        "run": run, "run_dir": "runs",  # relative: the run folder lands in the cwd
        "model": {"path": str(tiny_model)},
        "envs": {"main": {"type": "frozenlake", "max_turns": 3}},
        "rollout": {"group_size": 2, "batch_groups": 2, "alpha": 1},
        "trainer": {"steps": 50, "eval_groups": 1},
    }
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def rollart(*args: str, cwd: Path, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollart", *args], cwd=cwd,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r


def test_rollout_then_run_twice_with_the_same_name(tmp_path, tiny_model):
    """`rollout --run x` claims nothing, so `run --run x` gets runs/x; a second `run --run x`
    gets runs/x-2 (said on stderr) and both succeed; the suffixed run resumes by its folder."""
    cfg = _config(tmp_path, tiny_model)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "o.jsonl"
    # the default bus: an embedded nats-server, whose store once landed in runs/<run>/nats
    r = _ok(rollart("rollout", str(cfg), "--run", "x", "--groups", "1", "--out", str(out),
                    "--quiet", cwd=tmp_path, TMPDIR=str(scratch)))
    assert len(out.read_text().splitlines()) == 2
    assert '"run": "x-rollout-' in r.stdout, r.stdout
    assert not (tmp_path / "runs" / "x").exists()
    assert not any(scratch.iterdir()), list(scratch.iterdir())  # its bus store is gone too

    run = ("run", str(cfg), "--run", "x", "--steps", "1", "--nats", "memory", "--quiet")
    first = _ok(rollart(*run, cwd=tmp_path))
    assert "run x (runs/x/)" in first.stderr, first.stderr
    second = _ok(rollart(*run, cwd=tmp_path))
    assert "this run is x-2" in second.stderr and "--resume runs/x`" in second.stderr, second.stderr
    for name in ("x", "x-2"):
        folder = tmp_path / "runs" / name
        assert (folder / "summary.json").exists(), name
        assert yaml.safe_load((folder / "config.yaml").read_text())["run"] == name
    r = _ok(rollart("run", "--resume", "runs/x-2", "--quiet", cwd=tmp_path))
    assert "is finished" in r.stdout, r.stdout


def test_packaged_config_by_name_from_an_empty_folder(tmp_path):
    r = _ok(rollart("run", "quickstart", "--steps", "1", "--nats", "memory", "--quiet", cwd=tmp_path))
    assert (tmp_path / "runs" / "quickstart" / "summary.json").exists(), r.stdout


def test_a_folder_named_like_a_packaged_config_does_not_hide_it(tmp_path, monkeypatch):
    """Found by hand: a folder ``quickstart`` in the working directory made ``rollart run
    quickstart`` fail with IsADirectoryError and a traceback."""
    from rollart.app.configs import packaged_configs, resolve_config
    from rollart.config import ConfigError

    (tmp_path / "quickstart").mkdir()
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_config("quickstart") == packaged_configs()["quickstart"]
    with pytest.raises(ConfigError, match="mine is a folder, not a YAML file"):
        resolve_config("mine")


def test_config_dump_writes_a_copy_to_edit(tmp_path, monkeypatch):
    from rollart.app.configs import dump_config, packaged_configs
    from rollart.config import ConfigError, RunConfig, load

    r = _ok(rollart("config", "quickstart", "--dump", "x.yaml", cwd=tmp_path))
    assert "rollart run x.yaml" in r.stdout, r.stdout
    dumped = tmp_path / "x.yaml"
    assert dumped.read_text() == packaged_configs()["quickstart"].read_text()  # comments kept
    assert load(dumped, RunConfig).run == "quickstart"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="x.yaml exists"):  # never overwrites
        dump_config("quickstart", "x.yaml")
    assert dump_config("frozenlake-random", "") == 0  # default: ./<name>.yaml
    assert load(tmp_path / "frozenlake-random.yaml", RunConfig).run
    r = rollart("run", "quickstrat", cwd=tmp_path)
    assert r.returncode == 2 and "packaged configs (give the name): " in r.stderr, r.stderr
    assert "quickstart" in r.stderr


def test_repo_configs_are_the_packaged_ones():
    from rollart.app.configs import packaged_configs

    packaged = packaged_configs()
    assert {"quickstart", "frozenlake-random", "reasoning-math"} <= set(packaged)
    for name, path in packaged.items():
        assert (ROOT / "configs" / f"{name}.yaml").read_text() == path.read_text(), name


def test_wheel_ships_the_configs(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", str(src), "-w", str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("rollart-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"rollart/configs/quickstart.yaml", "rollart/configs/frozenlake-random.yaml",
            "rollart/configs/reasoning-math.yaml"} <= names


# -- the Makefile: make run / make test, each with its own set-up ------------------------

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _make_n(*args: str) -> str:
    env = {k: v for k, v in os.environ.items()  # not the variables of a `make test` around us
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTHON", "VENV",
                        "TORCH", "TORCH_INDEX", "EXTRAS", "CONFIG", "ARGS")}
    r = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@needs_make
def test_make_sets_up_a_missing_venv_then_runs(tmp_path):
    venv = tmp_path / "venv"
    out = _make_n("test", f"VENV={venv}")
    assert f"python3 -m venv {venv}" in out
    assert '"torch==2.13.0"' in out and "--index-url https://download.pytorch.org/whl/cpu" in out
    extras = re.search(r"^EXTRAS \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert {"dev", "envs", "megatron", "loggers"} <= set(extras.split(","))
    assert out.index("torch==2.13.0") < out.index(f"-m pip install -q -e '.[{extras}]'")
    assert out.rstrip().endswith("python -m pytest -q -n 3"), out  # the README's test command
    out = _make_n("run", f"VENV={venv}")
    assert out.rstrip().endswith(f"{venv}/bin/rollart run quickstart"), out
    out = _make_n("run", f"VENV={venv}", "TORCH_INDEX=https://download.pytorch.org/whl/cu128")
    assert "whl/cu128" in out


@needs_make
def test_make_skips_set_up_when_it_is_current(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    stamp = venv / ".rollart-setup"
    stamp.touch()
    t = (ROOT / "pyproject.toml").stat().st_mtime + 10
    os.utime(stamp, (t, t))
    out = _make_n("test", f"VENV={venv}")
    *before, last = out.strip().splitlines()
    assert last == f". {venv}/bin/activate && python -m pytest -q -n 3", out
    assert "pip install" not in out and "command -v bwrap" in "".join(before)  # only the sandbox check
    assert _make_n("run", f"VENV={venv}", "ARGS=--steps 3").strip() == \
        f"{venv}/bin/rollart run quickstart --steps 3"
    os.utime(stamp, (t - 20, t - 20))  # pyproject.toml changed since: set up again
    assert "pip install" in _make_n("test", f"VENV={venv}")


def test_ci_runs_make_test():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_a_node_takes_a_packaged_config_name():
    """``python -m rollart.node --config quickstart`` resolves the packaged config as
    ``rollart run quickstart`` does (it gets as far as the bus: memory is refused), and a
    name that is neither a file nor a packaged config is named with the packaged ones."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def node(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rollart.node", *flags], capture_output=True,
                              text=True, timeout=120, env=env, cwd=ROOT / "tests")

    r = node("--config", "quickstart", "--roles", "env", "--nats", "memory")
    assert r.returncode == 2 and "a node needs a nats-server" in r.stderr, r.stderr
    r = node("--config", "no-such-config", "--roles", "env")
    assert r.returncode == 2 and "config file no-such-config does not exist" in r.stderr, r.stderr
    assert "quickstart" in r.stderr, r.stderr
