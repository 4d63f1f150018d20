"""One settings merge for every role (rollart.actors.kernel.settings): a user who sets one
constructor argument or one handler setting keeps every other default of the role (those it
reads of the config, e.g. the EnvManager's ``max_inflight`` from ``rollout.concurrency``),
per-run settings of the builder merge over the config's, and an unknown key is an error that
names it. The actors are the real role classes built by the real builder."""

from __future__ import annotations

import dataclasses

import pytest

from rollart.actors.kernel.settings import merged, merged_handlers
from rollart.config import RunConfig, convert
from rollart.config.schema import trainer_buffer
from rollart.node.build import build_actors
from tests.actors.sample_actors import new_run

LAKE = {"type": "frozenlake", "args": {"map": ["SFFF", "FHFH", "FFFH", "HFFG"], "max_steps": 8},
        "max_turns": 4}

ROLES = {  # role: (a handler of it, a constructor argument to set, a value for it)
    "scheduler": ("on_completed", "total_groups", 3),
    "env": ("on_request", "wave_fill_timeout", 5.0),
    "generate": ("generate", "gather_ms", 7.0),
    "reward": ("score", "gather_ms", 9.0),
    "trainer": ("on_completed", "resume", True),
}


def cfg_of(tiny_model, actors: dict | None = None, run: str | None = None) -> RunConfig:
    return convert({"run": run or new_run(), "model": {"path": str(tiny_model)},
                    "envs": {"main": LAKE},
                    "rollout": {"concurrency": 5, "ack_wait": 44.0},
                    "actors": actors or {}}, RunConfig)


def init_values(actor) -> dict:
    """The constructor arguments an actor holds, but its name (a replica suffix), its handler
    settings and the whole RunConfig (which holds the ``actors`` section that differs)."""
    return {f.name: getattr(actor, f.name) for f in dataclasses.fields(actor)
            if f.init and f.name not in ("name", "settings")
            and not isinstance(getattr(actor, f.name), RunConfig)}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_one_handler_setting_keeps_every_other_default_of_the_role(role, tiny_model):
    handler = ROLES[role][0]
    (plain,) = build_actors(cfg_of(tiny_model), [role])
    (one,) = build_actors(cfg_of(tiny_model, {role: {"handlers": {handler: {"max_deliver": 2}}}}),
                          [role])
    before, after = plain.settings_of(handler), one.settings_of(handler)
    assert before.max_deliver != 2
    assert after == dataclasses.replace(before, max_deliver=2)


def test_role_defaults_of_handlers_survive_a_user_setting(tiny_model):
    """The EnvManager's and the trainer's own handler defaults (from ``rollout``) are kept
    beside the one key a user sets."""
    cfg = cfg_of(tiny_model, {"env": {"handlers": {"on_request": {"max_deliver": 2}}},
                              "trainer": {"handlers": {"on_dead": {"ack_wait": 9.0}}}})
    env, trainer = build_actors(cfg, ["env", "trainer"])
    s = env.settings_of("on_request")
    assert (s.max_inflight, s.ack_wait, s.max_deliver) == (5, 44.0, 2)
    plain_trainer = build_actors(cfg_of(tiny_model), ["trainer"])[0].settings_of("on_dead")
    buf = trainer_buffer(cfg.rollout, cfg.trainer.skip_uniform)  # the trainer's own default
    assert (plain_trainer.max_inflight, plain_trainer.max_ack_pending) == (buf, 2 * buf)
    t = trainer.settings_of("on_dead")
    assert t == dataclasses.replace(plain_trainer, ack_wait=9.0)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_one_argument_keeps_every_other_default_of_the_role(role, tiny_model):
    _, key, value = ROLES[role]
    run = new_run()
    (plain,) = build_actors(cfg_of(tiny_model, run=run), [role])
    (one,) = build_actors(cfg_of(tiny_model, {role: {"args": {key: value}}}, run=run), [role])
    before, after = init_values(plain), init_values(one)
    assert before[key] != value and after[key] == value
    del before[key], after[key]
    assert after == before


@pytest.mark.parametrize("role", sorted(ROLES))
def test_an_unknown_argument_is_named(role, tiny_model):
    with pytest.raises(ValueError, match=r"unknown argument\(s\) of \w+ \(actors\.\w+\.args\) "
                                         r"'no_such_knob'"):
        build_actors(cfg_of(tiny_model, {role: {"args": {"no_such_knob": 1}}}), [role])


@pytest.mark.parametrize("role", sorted(ROLES))
def test_an_unknown_handler_or_handler_setting_is_named(role, tiny_model):
    handler = ROLES[role][0]
    with pytest.raises(ValueError, match=r"unknown handler\(s\) \['on_nothing'\]"):
        build_actors(cfg_of(tiny_model, {role: {"handlers": {"on_nothing": {"max_deliver": 2}}}}),
                     [role])
    with pytest.raises(ValueError, match=rf"\.{handler}: unknown handler setting\(s\) \['bogus'\]"):
        build_actors(cfg_of(tiny_model), [role], args={role: {"settings": {handler: {"bogus": 1}}}})


def test_per_run_settings_merge_over_the_configs(tiny_model):
    """A builder's per-run handler settings (an evaluation's one-off durables) keep what the
    user set for the same handler."""
    cfg = cfg_of(tiny_model, {"scheduler": {"handlers": {"on_completed": {"max_inflight": 3}}}})
    (sched,) = build_actors(cfg, ["scheduler"],
                            args={"scheduler": {"settings": {"on_completed": {"durable": "x"}}}})
    s = sched.settings_of("on_completed")
    assert (s.durable, s.max_inflight) == ("x", 3)


def test_merged_is_key_by_key_and_names_an_unknown_key():
    assert merged({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}
    with pytest.raises(ValueError, match=r"unknown knob 'c'; allowed: a, b"):
        merged({"a": 1}, {"c": 3}, allowed={"a", "b"}, what="knob")
    assert merged_handlers({"h": {"x": 1, "y": 2}}, {"h": {"y": 3}}, {"h": {"z": 4}, "g": {}}) \
        == {"h": {"x": 1, "y": 3, "z": 4}, "g": {}}
