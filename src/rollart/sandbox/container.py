"""The container backend: the same supervisor as PID 1 of a podman or docker container.

For hosts that have a container engine and an image the user names (``sandbox.image``, with
``python3`` on its PATH). The container gets no network (unless ``sandbox.network``), a
read-only root, tmpfs ``/workspace`` and ``/tmp`` with size caps, every capability dropped,
``no-new-privileges``, an unprivileged user, and the engine's memory and pids limits (cgroup
limits, which the bubblewrap backend leaves to rlimits); the supervisor adds the same
per-command rlimits and deadline. ``--rm`` and the engine's own cleanup remove it when its
supervisor ends, which killing the client process does (``-i``: its stdin closes); the client
gets SIGKILL when rollart dies. Tested with podman 4 (``tests/sandbox/test_container.py``,
on an image made from the host's python by ``tests/sandbox/make_image.sh``).
"""

from __future__ import annotations

import shutil
import signal

from rollart.config.sandbox import SandboxConfig
from rollart.procs import die_with_parent
from rollart.sandbox.core import BOOT
from rollart.sandbox.errors import SandboxUnavailable


def argv(cfg: SandboxConfig) -> tuple[list[str], dict]:
    engine = shutil.which(cfg.backend)
    if engine is None:
        raise SandboxUnavailable(f"sandbox.backend {cfg.backend}: '{cfg.backend}' is not on PATH")
    tmp = max(cfg.workspace_bytes // 4, 1 << 20)
    args = [engine, "run", "--rm", "-i", "--read-only", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--user", "1000:1000",
            "--tmpfs", f"/workspace:rw,exec,size={cfg.workspace_bytes},mode=1777",
            "--tmpfs", f"/tmp:rw,size={tmp},mode=1777",
            "--workdir", "/workspace", "--env", "HOME=/workspace",
            "--pids-limit", str(cfg.processes + 8),
            "--ulimit", f"nproc={cfg.processes + 8}:{cfg.processes + 8}",
            "--ulimit", f"nofile={cfg.open_files}:{cfg.open_files}",
            "--memory", str(max(cfg.memory_bytes, cfg.workspace_bytes + tmp + (64 << 20))),
            *cfg.engine_args]
    if not cfg.network:
        args += ["--network", "none"]
    for b in cfg.binds:
        args += ["--volume", f"{b}:{b}:ro"]
    args += [str(cfg.image), "python3", "-I", "-S", "-u", "-c", BOOT]
    # the engine's client dies with rollart (it has no --die-with-parent of its own): its
    # attached stdin closes, the supervisor reads EOF and exits, --rm removes the container
    return args, {"preexec": die_with_parent(signal.SIGKILL)}
