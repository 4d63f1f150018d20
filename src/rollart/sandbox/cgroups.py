"""cgroup limits for one bubblewrap sandbox, where the host offers them.

RLIMIT_AS bounds each process of a sandbox, not their sum: 64 processes of 1 GiB each are
64 GiB, and the tmpfs workspace is memory too. A memory cgroup bounds the whole sandbox
(processes and tmpfs pages together) and a pids cgroup its process count, whatever the
processes do to their rlimits.

A sandbox's cgroups are made *under rollart's own* (``/proc/self/cgroup``), so that what
bounds rollart also bounds its sandboxes:

- cgroup v1 (the ``memory`` and ``pids`` hierarchies, as on this project's hosts): a
  folder per sandbox with ``memory.limit_in_bytes`` and ``pids.max``;
- cgroup v2: a folder per sandbox with ``memory.max`` and ``pids.max``, when the
  controllers are enabled for rollart's cgroup's children (a delegated subtree); v2 forbids
  enabling them in a cgroup that holds processes, and rollart does not move itself.

Making cgroups needs write access to rollart's cgroup (root, or a delegated subtree); where
there is none, :func:`make` returns None once, logs why, and the sandbox relies on its
rlimits. The process enters the cgroups between fork and exec (``enter``: before it drops
to the sandbox's user, so nothing it starts is ever outside them).

A folder's name says which process made it (``rollart-sandbox-<pid>-<start time>-<hex>``):
a process killed with SIGKILL cannot remove its sandboxes' folders, so the first
:func:`make` of every process removes the empty ones whose maker is gone
(:func:`sweep`). A folder of a live process, or one that still holds a process, is never
touched.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
_warned = False
_swept = False
PREFIX = "rollart-sandbox-"
_NAME = re.compile(r"rollart-sandbox-(?:(\d+)-(\d+)-)?[0-9a-f]{12}")
LEGACY_STALE_S = 600.0
"""A folder named before names said their maker (``rollart-sandbox-<hex>``) is stale once
empty for this long (no sandbox's cgroup stays empty that long: its process enters it
right after the folder is made)."""


def _start_time(pid: int) -> str | None:
    """``pid``'s start time in clock ticks since boot (``/proc/<pid>/stat``), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _own_tag() -> str:
    pid = os.getpid()
    return f"{pid}-{_start_time(pid) or 0}"


def sweep(folders: list[Path]) -> int:
    """Remove the empty sandbox cgroups under ``folders`` whose maker is gone; returns how
    many were removed. rmdir refuses a cgroup that holds a process, so a sandbox still
    running (its maker killed, itself not yet) is left alone."""
    removed = 0
    for own in folders:
        try:
            children = [d for d in own.iterdir() if d.name.startswith(PREFIX)]
        except OSError:
            continue
        for d in children:
            m = _NAME.fullmatch(d.name)
            if m is None:
                continue
            if m.group(1) is not None:
                if _start_time(int(m.group(1))) == m.group(2):
                    continue  # its maker lives
            else:
                try:
                    if time.time() - d.stat().st_mtime < LEGACY_STALE_S:
                        continue
                except OSError:
                    continue
            try:
                d.rmdir()
                removed += 1
            except OSError:
                continue  # busy (a process is still in it), or gone already
    if removed:
        log.info("removed %d empty sandbox cgroup folder(s) left by processes that are gone",
                 removed)
    return removed


@dataclass
class Cgroups:
    """The folders of one sandbox's cgroups, and how to read its OOM kills."""

    procs: list[Path] = field(default_factory=list)
    """``cgroup.procs`` files the sandbox's first process writes itself into."""
    folders: list[Path] = field(default_factory=list)
    events: Path | None = None
    """Where the OOM-kill count is (v1 ``memory.oom_control``, v2 ``memory.events``)."""

    def enter(self) -> None:
        """In the child, between fork and exec: move this process into every cgroup."""
        me = str(os.getpid()).encode()
        for p in self.procs:
            fd = os.open(p, os.O_WRONLY)
            try:
                os.write(fd, me)
            finally:
                os.close(fd)

    def oom_kills(self) -> int:
        """Processes of the sandbox the kernel killed for its memory limit so far."""
        if self.events is None:
            return 0
        try:
            for line in self.events.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def busy(self) -> bool:
        """Whether a process is still in one of the cgroups."""
        for p in self.procs:
            try:
                if p.read_text().strip():
                    return True
            except OSError:
                continue
        return False

    def remove(self) -> None:
        """Remove the folders (once the sandbox's processes are gone; a busy one is left
        and logged)."""
        for d in self.folders:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("sandbox cgroup %s not removed: %s", d, e)


def _own(controller: str | None) -> Path | None:
    """rollart's own cgroup folder in the v1 hierarchy of ``controller`` (None: v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller and controller in names.split(",")):
            base = ROOT / controller if controller else ROOT
            if controller and not base.is_dir():
                base = ROOT / names  # a co-mounted hierarchy (cpu,cpuacct)
            return base / path.lstrip("/")
    return None


def make(memory_bytes: int, pids: int) -> Cgroups | None:
    """cgroups for one sandbox with these limits, or None where the host offers none."""
    global _warned, _swept
    name = f"{PREFIX}{_own_tag()}-{uuid.uuid4().hex[:12]}"
    cg = Cgroups()
    try:
        if (ROOT / "cgroup.controllers").exists():  # v2 (unified)
            own = _own(None)
            if own is None or not (own / "cgroup.subtree_control").exists():
                raise OSError("no cgroup v2 folder of rollart's own")
            enabled = (own / "cgroup.subtree_control").read_text().split()
            if not {"memory", "pids"} <= set(enabled):
                raise OSError(f"the memory and pids controllers are not enabled for the children "
                              f"of {own} (cgroup.subtree_control: {' '.join(enabled) or 'empty'})")
            d = own / name
            d.mkdir()
            cg.folders.append(d)
            (d / "memory.max").write_text(str(memory_bytes))
            (d / "pids.max").write_text(str(pids))
            cg.procs.append(d / "cgroup.procs")
            cg.events = d / "memory.events"
        else:  # v1: one folder in each hierarchy
            for ctrl, files in (("memory", {"memory.limit_in_bytes": memory_bytes}),
                                ("pids", {"pids.max": pids})):
                own = _own(ctrl)
                if own is None or not own.is_dir():
                    raise OSError(f"no cgroup v1 {ctrl} hierarchy")
                d = own / name
                d.mkdir()
                cg.folders.append(d)
                for f, v in files.items():
                    (d / f).write_text(str(v))
                cg.procs.append(d / "cgroup.procs")
            cg.events = cg.folders[0] / "memory.oom_control"
        if not _swept:
            _swept = True
            sweep([d.parent for d in cg.folders])
        return cg
    except OSError as e:
        cg.remove()
        if not _warned:
            _warned = True
            log.info("sandboxes get no cgroup limits on this host (%s): each process is bounded "
                     "by its rlimits, the sandbox's sum is not", e)
        return None
