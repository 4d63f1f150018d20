"""What ``rollart run`` starts as child node processes, worked out before any starts: the
role groups and bus flags (:func:`plan`), the config file the children read, their log
file names; and the tail of a child's log (:func:`tail`; its exit in words: :func:`rollart.procs.describe_exit`).
:mod:`rollart.app.local_nodes` starts and supervises them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import yaml

from rollart.app.launch import write_config
from rollart.bus.auth import resolve
from rollart.config import ConfigError, RunConfig, load
from rollart.config.placement import mapped_pools
from rollart.node.build import role_config

log = logging.getLogger(__name__)

TAIL_LINES = 15
"""Lines of a child's log quoted when it exits before the end of the run."""

_CRED_FLAGS = (("user", "--user"), ("password_file", "--password-file"),
               ("token_file", "--token-file"), ("creds_file", "--creds"), ("tls_ca", "--tls-ca"),
               ("domain", "--js-domain"))
"""Credential overrides (:func:`rollart.app.cli.nats_overrides`) a child gets, as flags: names
and file paths only; the secrets stay in the files (or in environment variables, inherited)."""


def log_name(roles: list[str]) -> str:
    """The log file of a child: ``generate.log``, ``env-reward.log``."""
    return "-".join(roles) + ".log"


def plan(cfg: RunConfig, *, bus_url: str, nats: str | None = None,
         overrides: dict | None = None, single_process: bool = False) -> tuple[list[list[str]], list[str]]:
    """The role lists of the child processes to start and the bus flags each gets;
    ``([], [])`` for a single process (``single_process``, the in-process bus, an empty
    ``node.local_processes``, or a placement a child node cannot reproduce, said in one line)."""
    if single_process or bus_url.startswith("memory"):
        return [], []
    groups = [list(g) for g in cfg.node.local_processes]
    if role_config(cfg, "reward").replicas == 0:  # no reward service (only scorers need one)
        groups = [[r for r in g if r != "reward"] for g in groups]
    groups = [g for g in groups if g]
    if not groups:
        return [], []
    if cfg.pools and any("generate" in g for g in groups):
        pools = mapped_pools(cfg.mapping, "generate") if "generate" in cfg.mapping else []
        if len(pools) > 1:
            log.warning("node.local_processes: mapping.generate names %d pools (%s) and a child "
                        "node joins one, so rollart run keeps every role in this process; start "
                        "a node per pool (python -m rollart.node --pool NAME) to use more "
                        "processes", len(pools), ", ".join(pools))
            return [], []
    over = {k: v for k, v in (overrides or {}).items() if v is not None}
    ns = resolve(cfg, {**over, **({"url": nats} if nats else {})})
    url = nats or over.get("url")
    flags: list[str] = []
    if url:
        flags += ["--nats", url]
    elif not ns.joins:  # this process's embedded server
        flags += ["--nats", bus_url]
    # else the config's nats.url / nats.urls, which the child reads too
    for key, flag in _CRED_FLAGS:
        if over.get(key):
            v = str(over[key])
            flags += [flag, v if key == "user" else os.path.abspath(os.path.expanduser(v))]
    return groups, flags


def config_file(cfg: RunConfig) -> Path:
    """The config file the children read: the run's ``config.yaml`` (written if missing) when
    it says what ``cfg`` says, else ``logs/local-nodes.yaml`` (e.g. a resumed run that moved).
    A child node hosts ``actors.<role>.replicas`` of its roles, as this process would."""
    want = cfg
    path = write_config(cfg, overwrite=False)
    try:
        if load(path, RunConfig) == want:
            return path
    except ConfigError:
        pass
    alt = Path(cfg.run_dir) / cfg.run / "logs" / "local-nodes.yaml"
    alt.parent.mkdir(parents=True, exist_ok=True)
    alt.write_text(yaml.safe_dump(msgspec.to_builtins(want), sort_keys=False))
    return alt


def tail(path: Path, n: int = TAIL_LINES) -> str:
    """The last ``n`` lines of a text file (blocking: call it in a thread)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(lines[-n:])


