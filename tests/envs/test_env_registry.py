import pytest

from rollart.envs import BUILTIN_ENVS, Env, make_env
from rollart.envs.frozenlake import FrozenLakeEnv
from rollart.envs.sokoban import SokobanEnv


def test_builtins():
    assert set(BUILTIN_ENVS) == {"frozenlake", "sokoban", "reasoning_gym", "humaneval", "pyexpr"}
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


# -- openenv:<url> ---------------------------------------------------------------------------


@pytest.mark.parametrize("url, says", [
    ("", "needs the server's URL"),
    ("127.0.0.1:8000", "must start with http://"),
    ("ftp://host", "must start with http://"),
    ("http://", "names no host"),
    ("http://host:port", "not a URL"),
    ("http://host:8000/?a=1", "without ?query"),
    ("http://user:secret@host", "no credentials"),
])
def test_openenv_bad_url_is_a_value_error_naming_it(url, says):
    from rollart.envs.registry import resolve_env_class

    with pytest.raises(ValueError, match=r"^env type 'openenv:") as ei:
        resolve_env_class(f"openenv:{url}")
    assert says in str(ei.value)


def test_openenv_type_resolves_without_contacting_the_server():
    """Resolving (what the static check does) only parses the URL; the args are the
    adapter's keyword arguments."""
    import inspect

    from rollart.envs.openenv import base_url
    from rollart.envs.registry import resolve_env_class

    make = resolve_env_class("openenv:http://127.0.0.1:9/")  # port 9: nothing listens
    assert make.__name__ == "openenv:http://127.0.0.1:9/"
    params = inspect.signature(make).parameters
    assert {"transport", "action_field", "observation_field", "timeout"} <= set(params)
    assert base_url("ws://h:1/a/") == "http://h:1/a" and base_url("wss://h") == "https://h"
    assert base_url("http://[::1]:80") == "http://[::1]:80"


def test_openenv_bad_arg_is_named():
    with pytest.raises(ValueError, match="'transport' must be 'ws' or 'http'"):
        make_env("openenv:http://127.0.0.1:9", {"transport": "grpc"})
    with pytest.raises(ValueError, match="unknown arg 'action'"):
        make_env("openenv:http://127.0.0.1:9", {"action": "move"})
