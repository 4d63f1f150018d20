"""Check a run's environments before anything starts, so a broken env fails the run at once.

A systematic env error (a type that cannot be imported, a misspelt argument, a constructor
that raises, a ``reset``/``step`` with the wrong shape) otherwise surfaces only as every
trajectory being retried and dead-lettered while the run waits at step 0. ``rollart config``,
``rollart run``, ``rollart rollout`` and ``python -m rollart.node --roles env`` call
:func:`check_envs` / :func:`check_envs_async` first.

For every env of ``cfg.envs`` (or the ones named):

1. static, always: ``action_pattern`` compiles, ``turn_template`` has only ``{observation}``
   and ``{turn}``, the ``type`` imports, and ``args`` fit the class's constructor (unknown
   and missing keyword arguments are named);
2. unless the env says ``check: false``: one env is constructed with its configured
   ``executor`` (thread or process, exactly as an EnvManager builds it), then ``reset`` with
   each of ``check_seeds`` task seeds from ``rollout.seed`` on, under ``reset_timeout``,
   and its result's shape checked; when the env then offers ``legal_actions()``, one step with
   the first legal action is taken under ``step_timeout`` and its 5-tuple checked.

A ``reset`` that *raises* (or a constructor failing with ``ConnectionError``/``TimeoutError``)
is retried on fresh envs up to ``reset_retries`` times (transient, as in a run); a wrong shape,
any other construction error or a timeout fails at once. A seed whose reset (or step) still
raises is a broken *task* (a dataset entry, a sandbox image missing for it): the run would
replace its groups, so the check fails only when every seed checked fails, and otherwise
logs one warning with the count. All of it runs on an event loop of
its own in a daemon thread, under an overall deadline, so neither a sync env nor an async env
that blocks its loop can hang the caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import inspect
import logging
import string
import threading
from typing import Any, Iterable

from rollart.aio import retry
from rollart.envs.actions import compile_pattern
from rollart.envs.registry import BUILTIN_ENVS, resolve_env_class
from rollart.envs.agent_type import is_agent, resolve_agent
from rollart.envs.errors import describe
from rollart.envs.runner import EnvError, EnvRunner, EnvTimeout
from rollart.errors import ConfigError

try:  # the runner's permanent kinds of EnvError
    from rollart.envs.runner import EnvContractError, EnvSetupError
except ImportError:  # an older runner: tell them apart by what they wrap
    EnvContractError = EnvSetupError = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0
"""Seconds one env may take to construct (what an EnvManager's runner allows too)."""


class EnvCheckError(ConfigError):
    """One or more envs failed their check; ``problems`` holds one line per problem, each
    starting with the config key (``envs.<name>`` ...)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = f"{len(self.problems)} env problems:\n  " + "\n  ".join(self.problems)
        super().__init__(msg)


class _Fail(Exception):
    """One env's problem (internal)."""


class _Again(Exception):
    """A construction or reset that failed in a way a fresh env may not (internal)."""


# -- static part -------------------------------------------------------------------------


def import_env_class(type: str) -> Any:
    """The class behind a built-in name, ``gym:<id>`` or ``pkg.module:Class``; raises ``_Fail``.

    :func:`rollart.envs.registry.resolve_env_class` resolves it; any error is a check failure:
    one line naming the path (a missing dependency, an error raised at import time)."""
    try:
        return resolve_env_class(type)
    except ValueError as e:
        raise _Fail(str(e)) from e
    except Exception as e:  # a missing dependency of the module, an error at import time
        msg = str(e) if isinstance(e, ImportError) else describe(e)
        raise _Fail(f"cannot import {BUILTIN_ENVS.get(type, type)!r}: {msg}") from e


def _render_signature(cls: Any, sig: inspect.Signature, limit: int = 4) -> str:
    parts = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r:.20}")
    if len(parts) > limit:
        parts = parts[:limit] + ["..."]
    return f"{getattr(cls, '__name__', cls)}({', '.join(parts)})"


def check_args(cls: Any, args: dict[str, Any]) -> None:
    """Raise ``_Fail`` naming an argument of ``args`` the constructor does not take, or a
    required one that ``args`` lacks. Classes without an introspectable signature pass."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    shown = _render_signature(cls, sig)
    if not takes_any:
        for key in args:
            if key not in named:
                near = difflib.get_close_matches(str(key), named, 1)
                raise _Fail(f"unknown argument {key!r} for {shown}"
                            + (f"; did you mean {near[0]!r}?" if near else "")
                            + f" (allowed: {', '.join(named) or 'none'})")
    for n in named:
        if params[n].default is params[n].empty and n not in args:
            raise _Fail(f"missing required argument {n!r} of {shown}")
    for n, p in params.items():
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise _Fail(f"{shown} needs positional argument {n!r}: config args are keyword arguments")


def _check_template(template: str) -> None:
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        if field.split(".")[0].split("[")[0] not in ("observation", "turn"):
            raise _Fail(f"unknown placeholder {{{field}}}; allowed: {{observation}}, {{turn}}")
    try:
        template.format(observation="", turn=1)
    except Exception as e:
        raise _Fail(describe(e)) from e


def static_problems(name: str, ec: Any) -> list[str]:
    """Problems of env ``name`` (an EnvConfig) found without constructing it."""
    where = f"envs.{name}"
    out = []
    if ec.action_pattern is not None:
        try:
            compile_pattern(ec.action_pattern)
        except ValueError as e:
            out.append(f"{where}.action_pattern: {e}")
    try:
        _check_template(ec.turn_template)
    except _Fail as e:
        out.append(f"{where}.turn_template: {e}")
    if is_agent(ec.type):  # a user's agent: it needs the run's endpoint to play
        try:
            resolve_agent(ec.type)
        except ValueError as e:
            out.append(f"{where}.type: {e}")
        return out
    try:
        cls = import_env_class(ec.type)
    except _Fail as e:
        out.append(f"{where}.type: {e}")
        return out
    try:
        check_args(cls, dict(ec.args))
    except _Fail as e:
        out.append(f"{where}.args: {e}")
    return out


# -- dynamic part ------------------------------------------------------------------------


def _cause(e: BaseException) -> str:
    """What the env itself raised (the runner wraps it), else the runner's message (e.g. that
    its worker process died)."""
    c = e.__cause__
    return describe(c) if c is not None and not isinstance(c, (EOFError, OSError)) else str(e)


def _is_contract(e: EnvError) -> bool:
    """reset/step returned the wrong shape (the runner's verdict, wrapping nothing)."""
    return isinstance(e, EnvContractError) if EnvContractError is not None else e.__cause__ is None


def _is_setup(e: EnvError) -> bool:
    """The env cannot be built, and building it again would fail the same way."""
    if EnvSetupError is not None:
        return isinstance(e, EnvSetupError)
    return not isinstance(e.__cause__, (ConnectionError, TimeoutError))


class _SeedFailed(Exception):
    """One task seed's reset or step raised, after its retries (internal): a broken task,
    not a broken env, unless every seed checked fails."""


async def _exercise(name: str, ec: Any, seeds: list[int]) -> list[str]:
    """Construct one env of ``ec``, then reset it with each of ``seeds`` and (with legal
    actions) take one step; raise ``_Fail`` when no seed works or on a permanent failure
    (construction, a wrong shape, a timeout); returns the problems of the seeds that failed."""
    where = f"envs.{name}"
    attempts = ec.reset_retries + 1
    runner: EnvRunner | None = None

    async def drop() -> None:
        nonlocal runner
        if runner is not None:
            await runner.close()
        runner = None

    async def fresh(seed: int) -> None:
        """Reset an env with ``seed`` (constructing one when there is none); ``_Again`` when
        a fresh env may do."""
        nonlocal runner
        if runner is None:
            runner = EnvRunner(ec.type, dict(ec.args), executor=ec.executor,
                               timeout=ec.step_timeout, start_timeout=START_TIMEOUT)
            try:
                await runner.start()
            except EnvTimeout as e:
                raise _Fail(f"{where}: constructing {ec.type!r} ({ec.executor}) did not finish "
                            f"within {START_TIMEOUT:g}s") from e
            except EnvError as e:
                if _is_setup(e):  # a bad type, bad args, a constructor that raised
                    raise _Fail(f"{where}: cannot construct {ec.type!r} with args "
                                f"{dict(ec.args)!r:.200}: {_cause(e)}") from e
                await drop()
                raise _Again(f"construction failed: {_cause(e)}") from e
        try:
            await runner.reset(seed, timeout=ec.reset_timeout)
            return
        except EnvTimeout as e:
            raise _Fail(f"{where}: reset({seed}) did not return within {ec.reset_timeout:g}s "
                        f"(envs.{name}.reset_timeout; or set envs.{name}.check: false)") from e
        except EnvError as e:
            if _is_contract(e):  # a wrong shape: the same every time
                raise _Fail(f"{where}: {e}") from e
            why = _cause(e)  # the env raised: maybe flaky, try a fresh one
        except Exception as e:  # normalising the result failed (e.g. info not a dict)
            raise _Fail(f"{where}: reset() must return (observation: str, info: dict): "
                        f"{describe(e)}") from e
        await drop()
        raise _Again(why)

    async def one(seed: int) -> None:
        try:
            await retry(lambda: fresh(seed), retry_on=_Again, what=f"{where}: reset({seed})",
                        attempts=attempts, base=0.05, cap=2.0, quiet=True)
        except _Again as e:
            raise _SeedFailed(f"{where}: reset({seed}) failed {attempts} times "
                              f"(1 + envs.{name}.reset_retries): {e}") from None
        assert runner is not None
        legal = runner.legal_actions()
        if not legal:
            return
        action = legal[0]
        try:
            await runner.step(action, timeout=ec.step_timeout)
        except EnvTimeout as e:
            raise _Fail(f"{where}: step({action!r}) did not return within {ec.step_timeout:g}s "
                        f"(envs.{name}.step_timeout; or set envs.{name}.check: false)") from e
        except EnvError as e:
            if _is_contract(e):
                raise _Fail(f"{where}: {e}") from e
            await drop()  # the env raised: the next seed gets a fresh one
            raise _SeedFailed(f"{where}: step({action!r}) after reset({seed}) failed: "
                              f"{_cause(e)}") from e
        except Exception as e:
            raise _Fail(f"{where}: step() must return (observation: str, reward: float, "
                        f"terminated, truncated, info: dict): {describe(e)}") from e

    failed: list[str] = []
    try:
        for seed in seeds:
            try:
                await one(seed)
            except _SeedFailed as e:
                failed.append(str(e))
    finally:
        await drop()
    if len(failed) == len(seeds):
        more = (f"; every one of the {len(seeds)} task seeds checked failed "
                f"(envs.{name}.check_seeds)" if len(seeds) > 1 else "")
        raise _Fail(failed[0] + more)
    return failed


def check_seeds(cfg: Any, name: str) -> list[int]:
    """The task seeds the check of env ``name`` resets: ``envs.<name>.check_seeds`` of them
    from ``rollout.seed`` on (the first tasks a run draws)."""
    return [cfg.rollout.seed + k for k in range(cfg.envs[name].check_seeds)]


def _deadline(ec: Any) -> float:
    """A generous bound on one env's check (a safety net, never reached by a healthy check)."""
    per_attempt = START_TIMEOUT + ec.reset_timeout + 2.0 + 5.0  # + backoff + close
    per_seed = per_attempt * (ec.reset_retries + 1) + ec.step_timeout + 5.0
    return per_seed * ec.check_seeds + 30.0


def _selected(cfg: Any, names: Iterable[str] | None) -> list[str]:
    """The env names to check; problems with the selection itself raise EnvCheckError."""
    if not cfg.envs:
        raise EnvCheckError(["envs: no environment is configured; define at least one under envs:"])
    wanted = list(cfg.envs) if names is None else list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in cfg.envs]
    if cfg.rollout.env not in cfg.envs:
        missing.insert(0, cfg.rollout.env)
    if missing:
        raise EnvCheckError([f"envs.{n}: no such env; configured envs: {', '.join(cfg.envs)}"
                             + (" (rollout.env names it)" if n == cfg.rollout.env else "")
                             for n in dict.fromkeys(missing)])
    return wanted


async def _check_all(cfg: Any, names: list[str]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the envs ``names``."""
    problems: list[str] = []
    warnings: list[str] = []
    dynamic = []
    for n in names:
        found = static_problems(n, cfg.envs[n])
        problems += found
        if not found and cfg.envs[n].check and not is_agent(cfg.envs[n].type):
            dynamic.append(n)

    async def one(n: str) -> str | None:
        seeds = check_seeds(cfg, n)
        try:
            failed = await _exercise(n, cfg.envs[n], seeds)
        except _Fail as e:
            return str(e)
        except Exception as e:  # a bug here must still name the env
            return f"envs.{n}: check failed: {describe(e)}"
        if failed:
            warnings.append(
                f"envs.{n}: {len(failed)} of the {len(seeds)} task seeds checked failed "
                f"(first: {failed[0].removeprefix(f'envs.{n}: ')}); the run starts anyway: a "
                f"trajectory whose task fails is dead-lettered with its reason and its group "
                f"replaced")
        return None

    problems += [p for p in await asyncio.gather(*(one(n) for n in dynamic)) if p]
    return problems, warnings


def _start(cfg: Any, names: Iterable[str] | None) -> tuple[concurrent.futures.Future, float]:
    selected = _selected(cfg, names)
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def body() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(asyncio.run(_check_all(cfg, selected)))
        except BaseException as e:  # handed to the waiting caller
            fut.set_exception(e)

    threading.Thread(target=body, name="rollart-env-check", daemon=True).start()
    return fut, max([_deadline(cfg.envs[n]) for n in selected] or [0.0])


def _finish(fut: concurrent.futures.Future, deadline: float) -> list[str]:
    if not fut.done():
        raise EnvCheckError([f"envs: the env check did not finish within {deadline:g}s (an async env "
                             f"blocking its event loop?); set check: false on the env to skip it"])
    problems, warnings = fut.result()
    if problems:
        raise EnvCheckError(problems)
    for w in warnings:
        log.warning("%s", w)
    return warnings


def check_envs(cfg: Any, names: Iterable[str] | None = None) -> list[str]:
    """Check the envs of a RunConfig (all of ``cfg.envs``, or ``names``); blocking.

    Raises :class:`EnvCheckError` (a ``ConfigError``, so a ``ValueError``) whose message
    names every failing env key and its problem, e.g.
    ``envs.main.args: unknown argument 'sizee' for FrozenLakeEnv(size=4, ...)``. Returns
    (and logs) one warning per env some of whose task seeds failed while others worked.
    """
    fut, deadline = _start(cfg, names)
    try:
        fut.result(timeout=deadline)
    except concurrent.futures.TimeoutError:
        pass
    return _finish(fut, deadline)


async def check_envs_async(cfg: Any, names: Iterable[str] | None = None) -> list[str]:
    """:func:`check_envs` for a coroutine: the event loop stays free while envs are checked."""
    fut, deadline = _start(cfg, names)
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), deadline)
    except TimeoutError:
        pass
    return _finish(fut, deadline)
