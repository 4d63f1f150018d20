"""Any registered gymnasium environment as a text environment: ``type: "gym:<id>"``.

::

    envs:
      main:
        type: "gym:FrozenLake-v1"           # any id gymnasium.make() knows ("module:Id" too)
        args: {is_slippery: false, actions: [L, D, R, U]}

``args`` are keyword arguments of :func:`gymnasium.make` (``is_slippery``, ``map_name``,
``max_episode_steps``, ...) plus these of the adapter (:class:`GymEnv`):

- ``actions``: names of the actions of a ``Discrete(n)`` space, in index order (e.g.
  ``[L, D, R, U]`` for FrozenLake); without it an action is its index as text (``"0"`` ...).
  ``legal_actions()`` returns them, so decoding is constrained to them.
- ``instruction``: the system prompt (default: a generic one naming the env and its actions).
- ``render``: show the observation as the env's ``render_mode="ansi"`` text when the env
  supports it (default); else, or with ``render: false``, a readable ``str`` of the observation.
- ``highlight``: how text the ansi rendering highlights (FrozenLake's player) is written;
  ``"[{}]"`` (default) wraps it in brackets, ``"P"`` replaces it; other colours are dropped.
- ``success_key``: the ``info`` key that says the episode was won (default ``success``;
  ``is_success`` is read too); without it in the final ``info``, success is a final reward > 0.
- ``invalid_reward``: reward of a turn whose action is not in the action space (default 0);
  such a turn leaves the env as it was (``info["valid_action"] = False``).

Action spaces: ``Discrete`` (names or indices), ``MultiDiscrete``, ``MultiBinary`` and ``Box``
(the numbers in the text, in order, e.g. ``"0.5 -1"``), ``Text`` (the text itself).
gymnasium is imported only when such an env is made (``pip install gymnasium`` or the ``envs``
extra).
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Callable

PREFIX = "gym:"
"""``type: "gym:<id>"`` selects this adapter."""

_ANSI = re.compile(r"\x1b\[([0-9;]*)m(.*?)(?=\x1b\[|$)", re.DOTALL)
_ANY_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _gymnasium() -> Any:
    try:
        import gymnasium  # optional: the envs extra
    except ImportError as e:
        raise ImportError(f"env type '{PREFIX}...' needs gymnasium: pip install gymnasium "
                          f"(or pip install 'rollart[envs]'): {e}") from e
    return gymnasium


def find_spec(env_id: str) -> Any:
    """The gymnasium ``EnvSpec`` of ``env_id`` (``"Id-v1"``, ``"module:Id-v1"``, or an id
    without version for its latest one). Raises ``ValueError`` with gymnasium's explanation
    (e.g. "Environment `FrozenLak` doesn't exist. Did you mean: `FrozenLake`?") and
    ``ImportError`` when gymnasium or the named module is missing."""
    gym = _gymnasium()
    from gymnasium.envs.registration import find_highest_version, parse_env_id

    if not env_id:
        raise ValueError(f"env type {PREFIX!r} needs an environment id, e.g. 'gym:FrozenLake-v1'")
    module, sep, name = env_id.rpartition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"env type {PREFIX + env_id!r}: cannot import {module!r}, "
                              f"the module that registers {name!r}: {e}") from e
    try:
        ns, base, version = parse_env_id(name)
        if version is None and name not in gym.registry:
            latest = find_highest_version(ns, base)
            if latest is not None:
                name = f"{name}-v{latest}"
        return gym.spec(name)
    except gym.error.Error as e:
        raise ValueError(f"env type {PREFIX + env_id!r}: {e}") from e


def _supports_ansi(spec: Any) -> bool:
    from gymnasium.envs.registration import load_env_creator  # optional: the envs extra

    creator = spec.entry_point
    try:
        if isinstance(creator, str):
            creator = load_env_creator(creator)
    except Exception:  # gymnasium.make will say what is wrong
        return False
    return "ansi" in (getattr(creator, "metadata", None) or {}).get("render_modes", ())


def factory(env_id: str) -> Callable[..., "GymEnv"]:
    """The constructor behind ``type: "gym:<env_id>"`` (checks that the id is registered)."""
    spec = find_spec(env_id)
    make = functools.partial(GymEnv, env_id)
    make.__name__ = f"{PREFIX}{spec.id}"  # type: ignore[attr-defined]  # shown in messages
    return make


def _plain(v: Any) -> Any:
    """numpy scalars and arrays as Python values (for info dicts that travel)."""
    if hasattr(v, "tolist") and callable(v.tolist):
        return v.tolist()
    return v


def _obs_text(obs: Any) -> str:
    """A readable text of an observation that has no ansi rendering."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, dict):
        return "\n".join(f"{k}: {_obs_text(v)}" for k, v in obs.items())
    if isinstance(obs, tuple):
        return " ".join(_obs_text(v) for v in obs)
    if hasattr(obs, "shape") and hasattr(obs, "tolist"):  # numpy arrays and scalars
        import numpy as np  # optional: comes with torch or gymnasium

        if getattr(obs, "ndim", 0) == 0:
            return _obs_text(obs.item())
        if np.issubdtype(obs.dtype, np.floating):
            return np.array2string(obs, precision=3, suppress_small=True, separator=" ",
                                   max_line_width=200, threshold=10_000)
        return np.array2string(obs, separator=" ", max_line_width=200, threshold=10_000)
    if isinstance(obs, float):
        return f"{obs:.4g}"
    return str(obs)


class GymEnv:
    """A gymnasium environment as a text environment (see the module doc).

    Args:
        env_id: the gymnasium id (``type: "gym:<id>"`` sets it).
        actions: names of a ``Discrete(n)`` space's actions in index order (n of them).
        instruction: the system prompt (default: generic, naming the env and its actions).
        render: use the env's ansi rendering as the observation when it has one.
        highlight: format of highlighted ansi text (``"[{}]"``; without ``{}`` it replaces it).
        success_key: the info key that says the episode was won.
        invalid_reward: reward of a turn whose action is not in the action space.
        **make_kwargs: keyword arguments of ``gymnasium.make`` (e.g. ``is_slippery``).
    """

    def __init__(self, env_id: str, *, actions: list[str] | None = None,
                 instruction: str | None = None, render: bool = True, highlight: str = "[{}]",
                 success_key: str = "success", invalid_reward: float = 0.0,
                 **make_kwargs: Any) -> None:
        gym = _gymnasium()
        spec = find_spec(env_id)
        self.id = spec.id
        self.success_key = success_key
        self.invalid_reward = float(invalid_reward)
        self.highlight = highlight
        self._ansi = bool(render) and "render_mode" not in make_kwargs and _supports_ansi(spec)
        if self._ansi:
            make_kwargs["render_mode"] = "ansi"
        self.env = gym.make(spec, **make_kwargs)
        space = self.env.action_space
        self.space = space
        self._names: list[str] | None = None
        self._index: dict[str, int] = {}
        kind = type(space).__name__
        if isinstance(space, gym.spaces.Discrete):
            n, start = int(space.n), int(space.start)
            if actions is not None:
                names = [str(a).strip() for a in actions]
                if len(names) != n or len(set(names)) != n or not all(names):
                    raise ValueError(f"env {PREFIX}{self.id}: arg 'actions' must name each of the {n} "
                                     f"actions of {space} once, in index order (got {list(actions)!r})")
            else:
                names = [str(start + i) for i in range(n)]
            self._names = names
            for i, a in enumerate(names):
                self._index[a] = start + i
                self._index.setdefault(a.lower(), start + i)
            for i in range(n):  # the index also works when the actions have names
                self._index.setdefault(str(start + i), start + i)
            shown = ", ".join(names)
            how = f"Reply with exactly one action: one of {shown}."
        elif actions is not None:
            raise ValueError(f"env {PREFIX}{self.id}: arg 'actions' names Discrete actions, "
                             f"but the action space is {space}")
        elif isinstance(space, (gym.spaces.Box, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
            size = 1
            for d in space.shape:
                size *= int(d)
            how = (f"Reply with the action as {size} numbers separated by spaces" if size > 1
                   else "Reply with the action as a number") + f" (action space {space})."
        elif isinstance(space, gym.spaces.Text):
            how = "Reply with the action as text."
        else:
            self.env.close()
            raise ValueError(f"env {PREFIX}{self.id}: action space {kind} is not supported "
                             f"(Discrete, MultiDiscrete, MultiBinary, Box and Text are); write an "
                             f"env class for it instead")
        self.instruction = instruction if instruction is not None else (
            f"You act in the environment {self.id}. Each turn shows the current observation. {how}")
        self._legal = list(self._names) if self._names is not None else None
        self._last = ""
        self.done = True

    # -- text in and out -----------------------------------------------------------------

    def _text(self, obs: Any) -> str:
        if self._ansi:
            out = self.env.render()
            if isinstance(out, (list, tuple)):  # "ansi_list"-like renderings
                out = "\n".join(map(str, out))
            if isinstance(out, str) and out.strip():
                return self._strip_ansi(out).strip("\n")
        return _obs_text(obs)

    def _strip_ansi(self, text: str) -> str:
        def one(m: re.Match) -> str:
            codes = [c for c in m.group(1).split(";") if c]
            body = m.group(2)
            if body and any(c.isdigit() and (40 <= int(c) <= 47 or 100 <= int(c) <= 107) for c in codes):
                return self.highlight.format(body) if "{}" in self.highlight else self.highlight * len(body)
            return body

        return _ANY_ANSI.sub("", _ANSI.sub(one, text))

    def _action(self, text: str) -> Any:
        """The action-space value of ``text``, or None when it is not one."""
        gym = _gymnasium()
        a = text.strip()
        space = self.space
        if isinstance(space, gym.spaces.Discrete):
            i = self._index.get(a, self._index.get(a.lower()))
            if i is None or (self._legal is not None and self._names is not None
                             and self._names[i - int(space.start)] not in self._legal):
                return None  # not an action, or one the env's action_mask rules out
            return i
        if isinstance(space, gym.spaces.Text):
            return a if space.contains(a) else None
        import numpy as np  # optional: comes with torch or gymnasium

        nums = _NUMBER.findall(a)
        want = int(np.prod(space.shape))
        if len(nums) != want:
            return None
        try:
            value = np.array([float(x) for x in nums]).reshape(space.shape).astype(space.dtype)
        except (ValueError, OverflowError):
            return None
        return value if space.contains(value) else None

    def _set_legal(self, info: dict) -> None:
        """Discrete names, narrowed by an ``action_mask`` in info when the env gives one."""
        if self._names is None:
            self._legal = None
            return
        mask = info.get("action_mask")
        if mask is not None and len(mask) == len(self._names) and any(mask):
            self._legal = [a for a, ok in zip(self._names, mask) if ok]
        else:
            self._legal = list(self._names)

    def _success(self, reward: float, info: dict, ended: bool) -> bool:
        for key in (self.success_key, "is_success"):
            if key in info:
                return bool(info[key])
        return ended and reward > 0

    # -- the Env protocol ----------------------------------------------------------------

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        obs, info = self.env.reset(seed=int(seed))
        info = {k: _plain(v) for k, v in dict(info or {}).items()}
        self._set_legal(info)
        self.done = False
        self._last = self._text(obs)
        return self._last, {**info, "valid_action": True, "success": False}

    def legal_actions(self) -> list[str] | None:
        return None if self._legal is None else list(self._legal)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError(f"env {PREFIX}{self.id}: step() before reset() or after the episode ended")
        a = self._action(action)
        if a is None:
            return self._last, self.invalid_reward, False, False, {"valid_action": False, "success": False}
        obs, reward, terminated, truncated, info = self.env.step(a)
        info = {k: _plain(v) for k, v in dict(info or {}).items()}
        reward = float(reward)
        ended = bool(terminated or truncated)
        self.done = ended
        self._set_legal(info)
        self._last = self._text(obs)
        return self._last, reward, bool(terminated), bool(truncated), {
            **info, "valid_action": True, "success": self._success(reward, info, ended)}

    def close(self) -> None:
        self.env.close()
