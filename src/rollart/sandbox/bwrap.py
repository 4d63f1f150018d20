"""The bubblewrap backend: the argv that starts a supervisor in fresh namespaces.

What the sandboxed code sees and may do:

- new user, PID, mount, IPC, UTS, cgroup and (unless ``sandbox.network``) network
  namespaces; ``--die-with-parent`` and ``--new-session``; every capability dropped;
- the host's ``/usr`` read-only (with the usual ``/bin``, ``/lib``... links), the
  interpreter's prefix read-only when it lives elsewhere, the ``sandbox.binds`` read-only,
  its own ``/proc``, a minimal ``/dev`` and ``/etc/ld.so.cache``; nothing else of the host
  (not the rest of ``/etc``, not
  ``/home``, not the run folder, not rollart's virtualenv);
- a writable ``/workspace`` and ``/tmp`` on tmpfs, with size caps;
- when rollart runs as root, bubblewrap itself is started as the unprivileged host user
  ``sandbox.uid`` (``nobody``), so that even what is bound stays subject to that user's
  permissions; otherwise as rollart's own user.

Per command, the supervisor adds rlimits (CPU seconds, address space, processes, file
size, open files) and a wall-clock deadline. Where the host offers cgroups
(:mod:`rollart.sandbox.cgroups`), the whole sandbox is also bounded in memory (its processes
and its tmpfs together) and in processes, whatever its processes do.
"""

from __future__ import annotations

import os
import shutil
import sys

from rollart.config.sandbox import SandboxConfig
from rollart.sandbox.errors import SandboxUnavailable

from rollart.sandbox.core import BOOT
_ETC = ("ld.so.cache", "alternatives")
"""What of the host's ``/etc`` a sandbox sees (read-only): the dynamic linker's cache and
Debian's alternatives links (``awk``, ``editor``), nothing with a secret in it."""


def find_bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "sandbox.backend bwrap: the bubblewrap program 'bwrap' is not on PATH; install it "
            "('apt-get install bubblewrap' on Debian/Ubuntu, 'dnf install bubblewrap' on Fedora)")
    return path


def interpreter(cfg: SandboxConfig) -> str:
    """The python the sandbox runs (its supervisor and the model's ``python``)."""
    if cfg.python:
        return cfg.python
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def argv(cfg: SandboxConfig) -> tuple[list[str], dict]:
    """The command that starts one sandbox, and the :class:`~rollart.sandbox.core.Sandbox`
    fields it needs: the user to drop to (rollart as root) and its cgroup limits, the memory
    of its processes and tmpfs folders together (``memory_bytes`` + the tmpfs sizes + 64 MiB
    for the supervisor) and ``processes`` + 8."""
    bwrap = find_bwrap()
    python = interpreter(cfg)
    real = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(real))
    if not os.path.isabs(python) or not os.path.isfile(real):
        raise SandboxUnavailable(f"sandbox.python {python!r}: no such interpreter (give an absolute "
                                 f"path to a python3 readable by the sandbox's user)")
    if prefix in ("/", "") or os.path.dirname(prefix) == "/" and os.path.basename(prefix) in {
            "etc", "home", "root", "var", "proc", "sys", "run", "tmp", "srv"}:
        raise SandboxUnavailable(f"sandbox.python {python!r}: its prefix {prefix or '/'} would bind "
                                 f"too much of the host into the sandbox; install it under its own "
                                 f"folder (/usr, /opt/python3.11, ~/.pyenv/versions/3.11.7)")
    args = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--uid", "1000", "--gid", "1000", "--hostname", "sandbox",
            "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--disable-userns"]
    if not cfg.network:
        args.append("--unshare-net")
    args += ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        target = os.path.join("/", name)
        if os.path.islink(target):
            args += ["--symlink", os.readlink(target), target]
        elif os.path.isdir(target):
            args += ["--ro-bind", target, target]
    if not prefix.startswith("/usr/") and prefix != "/usr":
        args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(cfg.workspace_bytes), "--tmpfs", "/workspace",
             "--size", str(max(cfg.workspace_bytes // 4, 1 << 20)), "--tmpfs", "/tmp",
             "--dir", "/etc"]
    for b in cfg.binds:  # after the tmpfs mounts, which would hide a folder under /tmp
        args += ["--ro-bind", b, b]
    for name in _ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    args += ["--chdir", "/workspace", "--clearenv", "--setenv", "HOME", "/workspace",
             "--setenv", "PATH", f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin",
             "--setenv", "LANG", "C.UTF-8",
             "--", python, "-I", "-S", "-u", "-c", BOOT]
    tmpfs = cfg.workspace_bytes + max(cfg.workspace_bytes // 4, 1 << 20)
    extra: dict = {"cgroup_limits": (cfg.memory_bytes + tmpfs + (64 << 20), cfg.processes + 8)}
    if os.geteuid() == 0:
        extra["run_as"] = cfg.uid
    return args, extra
