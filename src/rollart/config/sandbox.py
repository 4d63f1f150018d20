"""``sandbox:``: where model-written code runs (:mod:`rollart.sandbox`)."""

from __future__ import annotations

from typing import Literal

from rollart.config.base import Base, in_range


class SandboxConfig(Base):
    """Isolation and limits of the sandboxes an env host keeps (one per trajectory that asks).

    Every limit is a ceiling a command may lower for itself, never raise."""

    backend: Literal["bwrap", "podman", "docker"] = "bwrap"
    """``bwrap`` (bubblewrap: user, PID, mount, IPC, UTS and network namespaces, the host's
    ``/usr`` read-only, a tmpfs workspace) or a container engine running ``image``."""
    image: str | None = None
    """The container image (``podman``/``docker`` backends); it must have ``python3``."""
    engine_args: list[str] = []
    """Extra arguments of ``podman run`` / ``docker run`` (e.g. ``[--runtime, runc]`` on a
    host whose default runtime cannot run there)."""
    warm: int = 2
    """Sandboxes started ahead of demand on each env host; a used one is replaced, never reused."""
    python: str | None = None
    """The interpreter inside (``bwrap``): default ``/usr/bin/python3`` where it exists, else
    the one running rollart. Its prefix is bound read-only; rollart's virtualenv never is."""
    uid: int = 65534
    """When rollart runs as root, sandboxes start as this unprivileged host user (``nobody``)."""
    network: bool = False
    """Give sandboxes a network. Off: only a loopback of their own (the run's nats-server on the
    host's loopback is out of reach)."""
    binds: list[str] = []
    """Extra host folders bound read-only at the same path (data a task reads)."""
    workspace_bytes: int = 64 << 20
    """Size of the writable ``/workspace`` (tmpfs); ``/tmp`` gets a quarter of it."""
    timeout_s: float = 10.0
    """A command's wall-clock limit when the caller names none."""
    cpu_s: int = 10
    """RLIMIT_CPU of each command (seconds)."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS of each process a command starts."""
    processes: int = 64
    """RLIMIT_NPROC: processes and threads at once (a fork bomb stops here)."""
    file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: the largest file a command may write."""
    open_files: int = 256
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 64 << 10
    """Bytes of stdout and of stderr kept per command; the rest is counted and dropped."""
    start_timeout_s: float = 20.0
    """A sandbox not ready in this long failed to start (an infrastructure failure)."""

    def __post_init__(self) -> None:
        in_range(self, "sandbox.", "warm", ge=0, le=256)
        in_range(self, "sandbox.", "uid", ge=1, le=2**31)
        in_range(self, "sandbox.", "workspace_bytes", ge=1 << 20, le=64 << 30)
        in_range(self, "sandbox.", "timeout_s start_timeout_s", gt=0, le=86400)
        in_range(self, "sandbox.", "cpu_s", ge=1, le=86400)
        in_range(self, "sandbox.", "memory_bytes", ge=16 << 20)
        in_range(self, "sandbox.", "processes", ge=1, le=65536)
        in_range(self, "sandbox.", "file_bytes", ge=0)
        in_range(self, "sandbox.", "open_files", ge=16, le=1 << 20)
        in_range(self, "sandbox.", "max_output_bytes", ge=0, le=16 << 20)
        if self.backend != "bwrap" and not self.image:
            raise ValueError(f"sandbox.image is required with sandbox.backend: {self.backend}")
        for b in self.binds:
            if not b.startswith("/") or ".." in b.split("/"):
                raise ValueError(f"sandbox.binds: {b!r} must be an absolute path without '..'")
