"""Configs as commands see them: a path or a packaged name, checked before a run starts;
``rollart config``."""

from __future__ import annotations

import logging
import sys
from importlib.resources import files
from importlib.util import find_spec
from pathlib import Path

from rollart.config import ConfigError, RunConfig, load
from rollart.config.doc import document
from rollart.engines import TORCH_ENGINE_ARGS, missing_for
from rollart.engines.capacity import check_context
from rollart.engines.provision import model_dir
from rollart.envs.check import check_envs_async

log = logging.getLogger(__name__)


def packaged_configs() -> dict[str, Path]:
    """The example configs shipped inside the package (``rollart/configs/*.yaml``) by name."""
    folder = files("rollart") / "configs"
    if not folder.is_dir():
        return {}
    return {p.name[:-5]: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def resolve_config(name: str) -> Path:
    """The config file ``name`` means: a file that exists wins; else the packaged config of
    that name (``quickstart``, ``quickstart.yaml`` or ``configs/quickstart.yaml``), even when
    a folder of that name is in the way (``runs/quickstart``'s parent, a report folder)."""
    p = Path(name)
    if p.is_file():
        return p
    known = packaged_configs()
    stem = p.name.removesuffix(".yaml")
    if str(p.parent) in (".", "configs") and stem in known:
        log.info("config %s: the packaged %s", name, known[stem])
        return known[stem]
    if p.is_dir():
        raise ConfigError(f"config {name} is a folder, not a YAML file; packaged configs (give "
                          f"the name): {', '.join(sorted(known)) or 'none'}")
    raise ConfigError(f"config file {name} does not exist; packaged configs (give the name): "
                      f"{', '.join(sorted(known)) or 'none'}")


async def check_run_config(cfg: RunConfig, names: list[str] | None = None, *,
                           trainer: bool = True) -> None:
    """Import, construct and reset every env of ``cfg`` (or ``names``; see rollart.envs.check);
    raises a ConfigError naming the env when one is broken, or saying what ``proxy.engine``
    (or, with ``trainer``, ``trainer.backend``) needs that is not installed."""
    if (why := missing_for(cfg.proxy.engine)) is not None:
        raise ConfigError(why)
    if trainer and cfg.trainer.backend == "megatron" and find_spec("megatron") is None:
        raise ConfigError("trainer.backend 'megatron' needs megatron-core, which is not installed "
                          "here: pip install 'rollart[megatron]' (see README: Trainer)")
    if trainer:
        for name in cfg.telemetry.loggers:
            mod = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[name]
            if find_spec(mod) is None:
                raise ConfigError(f"telemetry.loggers: {name!r} needs the {mod} package, which "
                                  f"is not installed here: pip install 'rollart[loggers]'")
    check_engine_args(cfg)
    if cfg.model.path or cfg.trainer.init_from:  # a tiny model is built later: EnvManager.from_config checks it then
        try:
            check_context(cfg, model_dir(cfg))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    await check_envs_async(cfg, names)


def check_engine_args(cfg: RunConfig) -> None:
    """``proxy.engine_args`` of the torch engine: a ConfigError naming an unknown key."""
    if cfg.proxy.engine == "torch":
        bad = sorted(set(cfg.proxy.engine_args) - TORCH_ENGINE_ARGS)
        if bad:
            raise ConfigError(f"proxy.engine_args.{bad[0]}: not an argument of the torch engine "
                              f"(it takes {', '.join(sorted(TORCH_ENGINE_ARGS))})")


def dump_config(name: str, dest: str) -> int:
    """``rollart config NAME --dump [FILE]``: a copy of a config (comments kept) to edit."""
    src = resolve_config(name)
    text = src.read_text()
    if dest == "-":
        sys.stdout.write(text)
        return 0
    out = Path(dest or src.name)
    if out.exists():
        raise ConfigError(f"{out} exists: give another FILE (rollart config {name} --dump FILE)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} (a copy of {src}): edit it, then `rollart run {out}`")
    return 0


async def config_main(args) -> int:
    if args.doc or not args.config:
        print(document(RunConfig), end="")
        return 0
    if args.dump is not None:
        return dump_config(args.config, args.dump)
    cfg = load(resolve_config(args.config), RunConfig)
    check_engine_args(cfg)
    if not args.static:
        await check_run_config(cfg)
    print(f"{args.config}: ok (run={cfg.run}, envs={sorted(cfg.envs)}, "
          f"mode={cfg.rollout.mode}, alpha={cfg.rollout.alpha})")
    return 0
