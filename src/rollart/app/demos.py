"""``rollart demos``: play an env with a built-in demonstrator and write the episodes as
JSON-lines conversations, in the chat layout the EnvManager gives an RL trajectory.

One line per episode::

    {"messages": [{"role": "system", "content": INSTRUCTION},
                  {"role": "user", "content": TURN_1}, {"role": "assistant", "content": "R"},
                  ...],
     "seed": 0, "reward": 1.0, "success": true, "turns": 6, "stop": "terminated",
     "env": "main", "type": "frozenlake", "policy": "bfs", "constrained": true}

As in :meth:`rollart.actors.env.manager.EnvManager._trajectory`: the system message is the
env config's ``instruction`` (else the env's own, else empty), each user message is
``turn_template`` filled with the observation and the turn (from 1), each assistant message
is the text the policy would have generated (under constrained decoding one of the legal
actions, exactly), and the conversation ends with the last assistant turn (the observation
after the last step is never shown). ``constrained`` says whether RL decodes this env under
constraint (``constrain`` and the env has legal actions): then the end-of-turn token is part
of the next prompt, not generated (:mod:`rollart.app.sft` reads it).

On a free-text turn (``constrain: false``, or an env without legal actions) the
demonstrator's move is written as the model should write it: ``--format`` (default
``<answer>{action}</answer>`` when ``action_pattern`` is the built-in instructions' answer
format, else ``{action}``), and the text must parse back to the move with the env's
``action_pattern``, or the command fails naming both.

:class:`Episode` steps an env the way the EnvManager does (action parsing, format penalty,
success from the info); :mod:`rollart.app.sft`'s greedy evaluation plays through it too.
"""

from __future__ import annotations

import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollart.app.configs import resolve_config
from rollart.config import ConfigError, EnvConfig, RunConfig, load
from rollart.envs import BUILTIN_ENVS, make_env, parse_action
from rollart.envs.actions import ANSWER_PATTERN
from rollart.envs.base import legal_actions_of
from rollart.envs.demonstrators import make_demonstrator


async def _call(fn, *args):
    """A plain or ``async def`` env method's result."""
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


def env_config(target: str, env: str | None = None, args: dict | None = None,
               ) -> tuple[EnvConfig, RunConfig | None, str]:
    """``ENV_OR_CONFIG`` -> (env config, run config or None, env name). A built-in env type
    (``frozenlake``) or an import path / ``gym:`` id that is not a file is an env of that type
    with ``args``; anything else is a run config (a path or a packaged name) and ``env`` one of
    its ``envs:`` (default ``rollout.env``)."""
    if target in BUILTIN_ENVS or (":" in target and not Path(target).is_file()):
        try:
            return EnvConfig(type=target, args=dict(args or {})), None, target
        except (TypeError, ValueError) as e:
            raise ConfigError(f"env {target!r}: {e}") from None
    if args:
        raise ConfigError("--args is for an env type (frozenlake, ...); a config's env has its "
                          "args in the config")
    cfg = load(resolve_config(target), RunConfig)
    name = env or cfg.rollout.env
    if name not in cfg.envs:
        raise ConfigError(f"--env {name!r}: the config has no such env; it has "
                          f"{', '.join(sorted(cfg.envs))}")
    return cfg.envs[name], cfg, name


class Episode:
    """One episode of ``env`` as the EnvManager plays it, driven turn by turn by the caller
    (a demonstrator's text or a model's): :meth:`start`, then :meth:`user` / :meth:`legal`
    / :meth:`step` while not :attr:`done`."""

    def __init__(self, env: Any, cfg: EnvConfig, seed: int) -> None:
        self.env, self.cfg, self.seed = env, cfg, seed
        self.turn = 0
        self.reward, self.success, self.stop = 0.0, False, "max_turns"
        self.done = False
        self.obs = ""
        self.info: dict[str, Any] = {}
        self.instruction = ""

    async def start(self) -> str:
        obs, info = await _call(self.env.reset, self.seed)
        self.obs, self.info = str(obs), dict(info or {})
        own = getattr(self.env, "instruction", None)
        self.instruction = self.cfg.instruction if self.cfg.instruction is not None else (own or "")
        self.turn = 1
        return self.obs

    def user(self) -> str:
        """This turn's user message."""
        return self.cfg.turn_template.format(observation=self.obs, turn=self.turn)

    def legal(self) -> list[str] | None:
        """This turn's legal actions when decoding is constrained to them, else None."""
        return legal_actions_of(self.env) if self.cfg.constrain else None

    async def step(self, text: str, legal: list[str] | None) -> None:
        """Play the assistant's ``text`` (the EnvManager's action parsing and format penalty)."""
        action = text.strip() if legal else parse_action(text, self.cfg.action_pattern)
        if action is None:
            self.reward += self.cfg.format_penalty
        obs, r, term, trunc, info = await _call(self.env.step, action if action is not None else text)
        self.obs, self.info = str(obs), dict(info or {})
        self.reward += float(r)
        self.success = bool(self.info.get("success", self.success))
        if term or trunc:
            self.stop, self.done = ("terminated" if term else "truncated"), True
        elif self.turn >= self.cfg.max_turns:
            self.done = True  # stop stays max_turns
        else:
            self.turn += 1


def text_format(cfg: EnvConfig, fmt: str | None = None) -> str:
    """The template of a free-text turn's text (see the module docstring); ``ValueError``
    when ``fmt`` has no ``{action}`` field."""
    if fmt is None:
        return "<answer>{action}</answer>" if cfg.action_pattern == ANSWER_PATTERN else "{action}"
    try:
        fmt.format(action="R")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"--format {fmt!r} is not a template with only {{action}}: {e}") from None
    if "{action}" not in fmt:
        raise ValueError(f"--format {fmt!r} has no {{action}} field")
    return fmt


async def play_demo(env: Any, cfg: EnvConfig, demo: Any, seed: int, *, fmt: str | None = None) -> dict:
    """One episode of ``demo`` on ``env`` with task seed ``seed``: its conversation line.
    ``fmt``: the text of a free-text turn (:func:`text_format`)."""
    fmt = text_format(cfg, fmt)
    ep = Episode(env, cfg, seed)
    await ep.start()
    demo.reset(ep.obs, ep.info)
    messages = [{"role": "system", "content": ep.instruction}]
    constrained = False
    while not ep.done:
        messages.append({"role": "user", "content": ep.user()})
        legal = ep.legal()
        constrained = constrained or bool(legal)
        text = demo.act(ep.obs, legal)
        if legal and text not in legal:
            raise ValueError(f"demonstrator answered {text!r}, not one of the legal actions {legal}")
        if not legal:
            move, text = text, fmt.format(action=text)
            if parse_action(text, cfg.action_pattern) != move.strip():
                raise ValueError(f"the free-text turn {text!r} (--format {fmt!r}) does not parse back "
                                 f"to the demonstrator's move {move!r} with action_pattern "
                                 f"{cfg.action_pattern!r}; give a --format that does")
        messages.append({"role": "assistant", "content": text})
        await ep.step(text, legal)
    return {"messages": messages, "seed": seed, "reward": ep.reward, "success": ep.success,
            "turns": ep.turn, "stop": ep.stop, "constrained": constrained}


async def write_demos(cfg: EnvConfig, policy: str, seeds: list[int], out: Path, *,
                      env_name: str = "main", quiet: bool = False, fmt: str | None = None) -> dict:
    """Play one episode per seed with demonstrator ``policy`` and write them to ``out``
    (JSON lines); returns the summary (success rate, mean reward and turns, wall time)."""
    try:
        env = make_env(cfg.type, cfg.args)
    except ValueError as e:
        raise ConfigError(f"env {env_name!r}: {e}") from None
    make_demonstrator(cfg.type, policy, env, random.Random(0))  # a bad name fails before any file
    try:
        fmt = text_format(cfg, fmt)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = ok = 0
    reward = turns = 0.0
    live = not quiet and sys.stdout.isatty()
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with tmp.open("w") as f, Progress(TextColumn("[bold]demos"), BarColumn(), MofNCompleteColumn(),
                                          TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                          disable=not live) as bar:
            task = bar.add_task("episodes", total=len(seeds), info="")
            for seed in seeds:
                demo = make_demonstrator(cfg.type, policy, env, random.Random(f"{policy}:{seed}"))
                line = await play_demo(env, cfg, demo, seed, fmt=fmt)
                line.update(env=env_name, type=cfg.type, policy=policy)
                f.write(json.dumps(line) + "\n")
                n, ok = n + 1, ok + bool(line["success"])
                reward, turns = reward + line["reward"], turns + line["turns"]
                if n % 50 == 0 or n == len(seeds):
                    bar.update(task, completed=n, info=f"success {ok / n:.3f}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
        close = getattr(env, "close", None)
        if callable(close):
            await _call(close)
    n = max(1, n)
    return {"episodes": len(seeds), "policy": policy, "env": env_name, "type": cfg.type,
            "seeds": [seeds[0], seeds[-1]] if seeds else [], "success_rate": ok / n,
            "mean_reward": reward / n, "mean_turns": turns / n,
            "wall_s": round(time.perf_counter() - t0, 3), "out": str(out)}


async def demos_main(args) -> int:
    extra = json.loads(args.args) if args.args else None
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError("--args must be a JSON object of env arguments")
    cfg, run_cfg, name = env_config(args.target, args.env, extra)
    start = args.seed if args.seed is not None else (run_cfg.rollout.seed if run_cfg else 0)
    if args.episodes < 1:
        raise ConfigError("--episodes must be >= 1")
    summary = await write_demos(cfg, args.policy, list(range(start, start + args.episodes)),
                                Path(args.out), env_name=name, quiet=args.quiet, fmt=args.format)
    print(json.dumps(summary, indent=2))
    return 0


def register(sub) -> None:
    """The ``demos`` subcommand."""
    d = sub.add_parser("demos", help="play an env with a demonstrator; write SFT conversations",
                       description="Play episodes of an env with a built-in demonstrator "
                                   "(frozenlake: bfs, the shortest safe path; heuristic, one "
                                   "step of look-ahead; sokoban: bfs, a shortest solution; "
                                   "reasoning_gym: answer, the reference answer) and write one "
                                   "JSON line per episode: "
                                   "{messages, seed, reward, success, ...}, the chat layout of "
                                   "an RL trajectory (system = instruction, user = "
                                   "turn_template, assistant = the move), for `rollart sft`.")
    d.add_argument("target", metavar="ENV_OR_CONFIG",
                   help="a run config (path or packaged name: its --env), or an env type "
                        "(frozenlake, pkg.module:Class) with --args")
    d.add_argument("--policy", required=True,
                   help="demonstrator: bfs or heuristic (frozenlake), bfs (sokoban), answer "
                        "(reasoning_gym), or pkg.module:factory")
    d.add_argument("--episodes", type=int, default=100, metavar="N", help="episodes (default 100)")
    d.add_argument("--out", default="demos.jsonl", metavar="FILE",
                   help="output JSONL (default demos.jsonl)")
    d.add_argument("--env", default=None, help="env name of the config (default rollout.env)")
    d.add_argument("--seed", type=int, default=None, metavar="S",
                   help="first task seed; episode i uses S + i (default rollout.seed, else 0: the "
                        "training seeds; evaluations use 1000000 + i: seeds 1000000-1999999 are "
                        "held out, and demonstrations played on them train on the evaluation's "
                        "tasks)")
    d.add_argument("--args", default=None, metavar="JSON",
                   help="env arguments when ENV_OR_CONFIG is an env type, e.g. "
                        "'{\"random_map\": true}'")
    d.add_argument("--format", default=None, metavar="TEMPLATE",
                   help="the text of a free-text turn (constrain: false), {action} being the "
                        "move, e.g. 'I go {action}. <answer>{action}</answer>' (default "
                        "<answer>{action}</answer> when action_pattern is <answer>(.*?)</answer>, "
                        "else {action}); it must parse back with action_pattern")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(fn=demos_main)

