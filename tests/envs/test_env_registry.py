import pytest

from rollart.envs import BUILTIN_ENVS, Env, make_env
from rollart.envs.frozenlake import FrozenLakeEnv
from rollart.envs.sokoban import SokobanEnv


def test_builtins():
    assert set(BUILTIN_ENVS) == {"frozenlake", "sokoban", "reasoning_gym"}
    env = make_env("frozenlake", {"size": 4, "slippery": False})
    assert isinstance(env, FrozenLakeEnv) and isinstance(env, Env)
    assert isinstance(make_env("sokoban", None), SokobanEnv)
    assert "<answer>" in env.instruction


def test_import_path():
    env = make_env("tests.envs.fake_envs:EchoEnv", {"prefix": "x"})
    assert env.reset(3)[0] == "x3"
    assert type(make_env("rollart.envs.sokoban:SokobanEnv", {})) is SokobanEnv


@pytest.mark.parametrize("name", ["frozen_lake", "no.such.module:Env", "rollart.envs.frozenlake:Nope", ":X"])
def test_unknown_type_names_it(name):
    with pytest.raises(ValueError) as ei:
        make_env(name, {})
    assert repr(name) in str(ei.value)
    if ":" not in name or name.startswith("no."):
        assert "frozenlake" in str(ei.value) and "reasoning_gym" in str(ei.value)


def test_unknown_arg_names_it_and_lists_allowed():
    with pytest.raises(ValueError, match=r"'slipery'.*allowed: .*slippery"):
        make_env("frozenlake", {"slipery": True})


def test_missing_required_arg_names_it():
    with pytest.raises(ValueError, match="'dataset'"):
        make_env("reasoning_gym", {})


def test_bad_value_names_the_arg():
    with pytest.raises(ValueError, match="'max_steps'"):
        make_env("frozenlake", {"max_steps": 0})


def test_not_an_env():
    with pytest.raises(ValueError, match="reset"):
        make_env("tests.envs.fake_envs:NotAnEnv", {})
