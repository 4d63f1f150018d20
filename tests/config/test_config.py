"""Config errors name the key path and what is allowed; nothing is silently ignored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollart.config import ConfigError, RunConfig, convert, describe, load

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("data,needle", [
    ({"bogus": 1}, "unknown key 'bogus'; allowed keys here: actors, envs"),
    ({"rollout": {"grup_size": 4}}, "unknown key 'rollout.grup_size'; allowed keys here:"),
    ({"envs": {"lake": {"max_turns": "many"}}}, "envs.lake.max_turns: Expected `int`, got `str`"),
    ({"actors": {"env": {"handlers": {"on_request": {"ack_wiat": 3}}}}},
     "unknown key 'actors.env.handlers.on_request.ack_wiat'; allowed keys here: ack_wait"),
    ({"rollout": {"stale": "later"}}, "rollout.stale: Invalid enum value 'later'; allowed: 'wait', 'drop', 'restart'"),
    ({"trainer": {"agg": "mean"}}, "allowed: 'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum'"),
    ({"rollout": {"mode": "batch", "concurrency": 4}}, "set rollout.concurrency >= 64"),
    ({"node": {"grace": "soon"}}, "node.grace: Expected `float`, got `str`"),
])
def test_bad_config_names_the_key(data, needle):
    with pytest.raises(ConfigError) as e:
        convert(data, RunConfig, source="run.yaml")
    assert str(e.value).startswith("run.yaml: ") and needle in str(e.value), str(e.value)


def test_shipped_configs_load_and_every_field_is_documented():
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        load(p, RunConfig)
    doc = describe(RunConfig)
    undocumented = [line for line in doc.splitlines() if line.rstrip().endswith("#")]
    assert not undocumented, undocumented


def test_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.yaml", RunConfig)
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad, RunConfig)


def test_cli_config_check(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {alpha: one}\n")
    r = subprocess.run([sys.executable, "-m", "rollart", "config", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "rollout.alpha: Expected `int`, got `str`" in r.stderr
    ok = subprocess.run([sys.executable, "-m", "rollart", "config", str(ROOT / "configs" / "quickstart.yaml")],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "ok" in ok.stdout


def test_the_config_package_imports_no_bus_connection_code():
    """rollart.config sits below the bus: loading a config never imports the NATS client code,
    and the bus shows URLs with the config's own :func:`~rollart.config.urls.redact`."""
    code = ("import sys, rollart.config, rollart.config.doc\n"
            "leaves = {'rollart.bus.base', 'rollart.bus.codec'}  # no rollart imports: the wire format\n"
            "bus = sorted(m for m in sys.modules if m.startswith('rollart.bus.') and m not in leaves)\n"
            "assert not bus, bus\n"
            "from rollart.bus.auth import redact\n"
            "from rollart.config.urls import redact as leaf\n"
            "assert redact is leaf and redact('nats://u:pw@h:4222') == 'nats://u:***@h:4222'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
