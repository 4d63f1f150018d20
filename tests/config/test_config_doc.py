"""``rollart config --doc`` documents every key of the schema, with defaults and allowed values."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import pytest

from rollart.config.doc import checks, document
from rollart.config.pipeline import RolloutConfig, SamplingConfig
from rollart.config.schema import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def _struct(t):
    """The Struct of ``S`` or ``S | None``."""
    for m in (typing.get_args(t) if typing.get_origin(t) in (typing.Union, type(int | None)) else (t,)):
        if isinstance(m, type) and issubclass(m, msgspec.Struct):
            return m
    return None


def schema_keys(typ: type, prefix: str = "") -> list[str]:
    """Every dotted key of the Structs, walked here independently of the generator; the user's
    key of a ``dict[str, Struct]`` is written ``<...>``."""
    out = []
    hints = typing.get_type_hints(typ)
    for f in msgspec.structs.fields(typ):
        key, ann = prefix + f.name, hints[f.name]
        out.append(key)
        if (sub := _struct(ann)) is not None:
            out += schema_keys(sub, key + ".")
        elif typing.get_origin(ann) is dict and (item := _struct(typing.get_args(ann)[1])) is not None:
            out += schema_keys(item, key + ".<*>.")
    return out


@pytest.fixture(scope="module")
def doc() -> str:
    return document(RunConfig)


def line_of(doc: str, key: str) -> str:
    rx = re.compile("^" + re.escape(key).replace(re.escape("<*>"), r"<\w+>") + r"  ", re.M)
    m = rx.search(doc)
    assert m, f"{key} is not documented"
    return doc[m.start():doc.index("\n", m.start())]


def test_every_key_of_the_schema_is_documented(doc):
    keys = schema_keys(RunConfig)
    assert len(keys) > 90 and "envs.<*>.sampling.temperature" in keys
    for key in keys:
        line_of(doc, key)


def test_env_keys_with_defaults_and_allowed_values(doc):
    assert line_of(doc, "envs.<*>.action_pattern").endswith("(str | null)  default null")
    assert "default -0.1" in line_of(doc, "envs.<*>.format_penalty")
    assert line_of(doc, "envs.<*>.sampling") == "envs.<name>.sampling  (section)"
    assert "default 1.0  allowed: (0, 1]" in line_of(doc, "envs.<*>.sampling.top_p")
    assert line_of(doc, "envs.<*>.executor").endswith('default "thread"')
    assert 'allowed: one of "thread", "process", "inline"' in doc
    assert 'default "wait"  allowed: one of "wait", "drop", "restart"' in line_of(doc, "rollout.stale")
    assert "allowed: >= 267" in line_of(doc, "model.tiny.vocab_size")  # a module constant
    assert "allowed: [0, 1)" in line_of(doc, "trainer.clip_low")
    pool = line_of(doc, "actors.<*>.handlers.<*>.pool")  # a long "allowed" goes on the next line
    assert "a subject token" in doc[doc.index(pool):].splitlines()[1]
    assert "allowed: > 0; or null" in line_of(doc, "trainer.is_cap")
    assert "default {main: {}}" in line_of(doc, "envs")
    # the meaning follows each key
    after = doc[doc.index(line_of(doc, "rollout.alpha")):].splitlines()[1]
    assert after.startswith("    Asynchrony bound")


def test_builtin_env_args_are_documented(doc):
    for key in ("envs.<name>.type: frozenlake", "envs.<name>.type: sokoban", "args.slippery  (bool)  default false",
                "args.num_boxes  (int)  default 1", "args.actions  (list[str] | null)  default null"):
        assert key in doc, key


def test_checks_reads_post_init():
    assert checks(SamplingConfig) == {"max_new_tokens": ">= 1", "temperature": ">= 0", "top_p": "(0, 1]"}
    assert checks(RolloutConfig)["replica_timeout"] == ">= 0"


def test_cli_prints_the_doc():
    out = subprocess.run([sys.executable, "-m", "rollart", "config", "--doc"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == document(RunConfig)
