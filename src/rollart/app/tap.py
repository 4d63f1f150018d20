"""``rollart tap``: print the live messages of a run's subjects, decoded.

Subscribes (a core subscription: it creates no JetStream consumer, takes nothing from a
queue and publishes nothing, so the ``monitor`` credential of ``rollart secure init`` is
enough) to a subject pattern and prints each message, decoded by the subject table of
:mod:`rollart.messages` (:func:`rollart.messages.lookup`, as ``rollart top`` does):

- piped, or with ``--json``: one JSON object a line,
  ``{"ts", "subject", "type", "msg", "headers"?, "error"?, "raw"?, "raw_encoding"?, "size"?}``
  (``ts``: arrival, seconds since the epoch; ``msg``: every field of the message). A
  subject the table does not know, or a payload that does not decode, comes raw (text,
  or base64 when it is not text; the first :data:`RAW_MAX` bytes) with ``error`` saying
  why; a message that decodes but fails validation comes decoded, with ``error``;
- on a terminal: one line a message: time, subject relative to the run, type, and the
  fields that differ from their defaults (long lists and strings shortened).

``--traj ID`` keeps the messages about one trajectory: those whose ``traj_id`` is ID
(requested, completed, cancelled, generate and reward requests), a ``rollout.cancel`` of
its group (or listing it in ``keep``), ``service.progress`` reports of replicas holding
one of its requests, and dead letters whose payload is one of these.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import signal
import sys
import time

import msgspec

from rollart import messages as m
from rollart.app.args import add_nats_args, nats_overrides
from rollart.app.configs import resolve_config
from rollart.bus.connect import bus_from_config
from rollart.bus.codec import DecodeError, decode
from rollart.config import ConfigError, RunConfig, load

RAW_MAX = 4096
"""Bytes of an undecodable payload shown (the rest is cut; ``size`` says how many)."""


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``tap`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "tap", help="print the live messages of a run's subjects, decoded",
        description="Subscribe to SUBJECT_PATTERN and print each message decoded by the subject "
                    "table: one JSON line each when stdout is not a terminal (or with --json), "
                    "else a readable line. Read-only (a core subscription; the monitor "
                    "credential suffices). Unknown subjects and undecodable payloads are shown "
                    "raw with an error field.")
    p.add_argument("pattern", metavar="SUBJECT_PATTERN",
                   help="a full NATS subject pattern (rollart.exp1.rollout.>) or one relative to "
                        "--run (rollout.completed, generate.request.*, >); a pooled subject "
                        "without its pool (generate.request) means every pool")
    add_nats_args(p, url_help="NATS URL of the run's server (default: the --config's nats)")
    p.add_argument("--run", default=None, help="run name (default: the --config's run)")
    p.add_argument("--config", default=None, metavar="CONFIG",
                   help="the run's config: its run name and nats settings")
    p.add_argument("--traj", default=None, metavar="ID",
                   help="only the messages about trajectory ID (its requests, outcome, group "
                        "cancel, service progress, dead letters)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="exit 0 after printing N messages")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="stop after S seconds (exit 1 if --limit was not reached by then)")
    p.add_argument("--json", action="store_true", help="JSON lines even on a terminal")
    p.set_defaults(fn=tap_main)
    return p


# -- the subject pattern ------------------------------------------------------------------


def full_pattern(pattern: str, run: str | None) -> tuple[str, str | None]:
    """``(full NATS subject pattern, the run it is in or None)`` for a SUBJECT_PATTERN: full
    (``rollart.<run>.<...>``) or relative to ``run``. A pooled subject named without its pool
    gets ``.*``. Raises ValueError for a pattern NATS would refuse or a missing run."""
    if not pattern or any(c.isspace() for c in pattern):
        raise ValueError(f"subject pattern {pattern!r} is empty or holds white space")
    parts = pattern.split(".")
    if parts[0] == m.PREFIX and len(parts) >= 2:
        if parts[1] not in ("*", ">"):
            m.check_token("run", parts[1])
            if run is not None and run != parts[1]:
                raise ValueError(f"subject pattern {pattern!r} is in run {parts[1]!r}, "
                                 f"but --run says {run!r}")
            run = parts[1]
        else:
            run = None
    else:
        if not run:
            raise ValueError(f"subject pattern {pattern!r} is relative to a run: give --run NAME "
                             f"(or --config), or a full pattern {m.PREFIX}.<run>.{pattern}")
        parts = [m.PREFIX, m.check_token("run", run), *parts]
    if "" in parts or ">" in parts[:-1]:
        raise ValueError(f"subject pattern {pattern!r} is not a NATS subject pattern (empty token, "
                         f"or '>' before the last token)")
    d = m.SUBJECTS.get(".".join(parts[2:]))
    if d is not None and d.pooled:
        parts += ["*", "*"] if d.per_replica else ["*"]
    return ".".join(parts), run


# -- one message ------------------------------------------------------------------------


def decode_message(subject: str, data: bytes) -> tuple[type | None, object | None, str]:
    """``(type, message, error)`` of a payload on ``subject``, by the subject table:
    ``(None, None, why)`` for an unknown subject, ``(type, None, why)`` for a payload that
    does not decode, ``(type, msg, "invalid: why")`` for one that fails validation."""
    d = m.lookup(subject)
    if d is None:
        return None, None, "unknown subject (not in the subject table)"
    try:
        msg = decode(d.type, data)
    except DecodeError as e:
        ref = _reference(data)  # a payload too large for a message: it is in the object store
        if ref is not None:
            return m.PayloadRef, ref, ""
        return d.type, None, f"undecodable {d.type.__name__}: {e}"[:500]
    try:
        m.validate(msg)
    except m.Invalid as e:
        return d.type, msg, f"invalid: {e}"[:500]
    return d.type, msg, ""


def _reference(data: bytes) -> m.PayloadRef | None:
    """The :class:`rollart.messages.PayloadRef` a body holds (header ``Rollart-Payload``), if any."""
    try:
        ref = decode(m.PayloadRef, data)
        m.validate(ref)
        return ref
    except (DecodeError, m.Invalid):
        return None


def raw(data: bytes) -> tuple[str, str]:
    """``(text, "text")`` for a printable UTF-8 payload, else ``(base64, "base64")``; at most
    :data:`RAW_MAX` bytes."""
    cut = data[:RAW_MAX]
    try:
        text = cut.decode()
        if text.isprintable() or all(c.isprintable() or c in "\n\t\r" for c in text):
            return text, "text"
    except UnicodeDecodeError:
        pass
    return base64.b64encode(cut).decode(), "base64"


def record(subject: str, data: bytes, headers: dict[str, str] | None = None,
           ts: float | None = None, decoded: tuple | None = None) -> dict:
    """The JSON-ready record of one message (see the module's doc); ``decoded``: what
    :func:`decode_message` said of it, when already asked."""
    typ, msg, error = decode_message(subject, data) if decoded is None else decoded
    out: dict = {"ts": round(time.time() if ts is None else ts, 6), "subject": subject,
                 "type": typ.__name__ if typ is not None else None,
                 "msg": msgspec.to_builtins(msg) if msg is not None else None}
    if headers:
        out["headers"] = dict(headers)
    if error:
        out["error"] = error
    if msg is None:
        out["raw"], out["raw_encoding"] = raw(data)
        out["size"] = len(data)
    return out


# -- --traj -------------------------------------------------------------------------------


class TrajFilter:
    """Whether a message is about one trajectory; learns its group and request ids from the
    messages that carry its ``traj_id``."""

    def __init__(self, traj_id: str) -> None:
        self.traj_id = traj_id
        self.groups: set[str] = set()
        self.requests: set[str] = set()
        head, _, index = traj_id.rpartition("-")
        if head and index.isdigit():  # the schedulers name trajectories <group_id>-<index>
            self.groups.add(head)

    def matches(self, subject: str, msg: object | None, data: bytes) -> bool:
        if msg is None:  # unknown or undecodable: whether the bytes mention it
            return self.traj_id.encode() in data
        if getattr(msg, "traj_id", None) == self.traj_id:
            if gid := getattr(msg, "group_id", ""):
                self.groups.add(gid)
            if rid := getattr(msg, "request_id", ""):
                self.requests.add(rid)
            return True
        if isinstance(msg, m.CancelGroup):
            return msg.group_id in self.groups or self.traj_id in msg.keep
        if isinstance(msg, m.ServiceProgress):
            return bool(self.requests.intersection(msg.request_ids))
        if isinstance(msg, m.DeadLetter):
            _, inner, _ = decode_message(msg.subject, msg.payload)
            return self.matches(msg.subject, inner, msg.payload)
        return False


# -- the readable form --------------------------------------------------------------------


def _short(v, width: int = 60) -> str:
    if isinstance(v, (list, tuple)):
        items = [_short(x, 20) for x in v[:6]]
        more = f", … +{len(v) - 6}" if len(v) > 6 else ""
        return f"[{', '.join(items)}{more}]"
    if isinstance(v, dict):
        items = [f"{k}: {_short(x, 20)}" for k, x in list(v.items())[:6]]
        more = f", … +{len(v) - 6}" if len(v) > 6 else ""
        return "{" + ", ".join(items) + more + "}"
    if isinstance(v, float):
        s = f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3f}"
    elif isinstance(v, (bytes, bytearray)):
        s = f"<{len(v)} bytes>"
    elif isinstance(v, msgspec.Struct):
        s = "(" + " ".join(f"{k}={_short(x, 20)}" for k, x in _changed(v)) + ")"
    else:
        s = str(v)
    s = s.replace("\n", "\\n")
    return s if len(s) <= width else s[: width - 1] + "…"


def _changed(msg) -> list[tuple[str, object]]:
    """The fields of ``msg`` that differ from their defaults, in declaration order."""
    out = []
    for f in msgspec.structs.fields(msg):
        v = getattr(msg, f.name)
        if f.default is not msgspec.NODEFAULT and v == f.default:
            continue
        if f.default_factory in (list, dict, set, tuple) and v == f.default_factory():
            continue
        out.append((f.name, v))
    return out


def readable(rec: dict, msg: object | None, run: str | None, width: int | None = None) -> str:
    """One line for a terminal: time, subject (relative to ``run``), type, fields."""
    t = time.strftime("%H:%M:%S", time.localtime(rec["ts"])) + f".{int(rec['ts'] % 1 * 1000):03d}"
    subj = rec["subject"]
    if run is not None:
        subj = subj.removeprefix(f"{m.PREFIX}.{run}.")
    else:
        subj = subj.removeprefix(f"{m.PREFIX}.")
    parts = [t, subj, rec["type"] or "?"]
    if msg is not None:  # scalars first: lists of tokens would hide them
        fields = sorted(_changed(msg), key=lambda kv: isinstance(kv[1], (list, tuple, dict)))
        parts += [f"{k}={_short(v)}" for k, v in fields]
    if rec.get("headers"):
        parts.append(f"headers={_short(rec['headers'])}")
    if rec.get("error"):
        parts.append(f"error: {_short(rec['error'], 120)}")
    if "raw" in rec:
        parts.append(f"{rec['raw_encoding']} ({rec['size']} bytes): {_short(rec['raw'], 80)}")
    line = "  ".join(parts[:3]) + "  " + " ".join(parts[3:])
    line = "".join(c if c.isprintable() else "?" for c in line.rstrip())
    if width and len(line) > width:
        line = line[: width - 1] + "…"
    return line


# -- the command ---------------------------------------------------------------------------


async def tap(bus, pattern: str, *, run: str | None = None, traj: str | None = None,
              limit: int | None = None, duration: float | None = None, as_json: bool = True,
              out=None, ready=None) -> tuple[int, bool]:
    """Print the messages on ``pattern`` (a full subject pattern) to ``out`` until ``limit``
    printed, ``duration`` seconds, SIGINT/SIGTERM or a closed ``out``; returns how many were
    printed and whether ``duration`` ended it. ``ready``: called once the server knows the
    subscription."""
    out = sys.stdout if out is None else out
    done = asyncio.Event()
    printed = 0
    keep = TrajFilter(traj) if traj else None
    width = None if as_json else shutil.get_terminal_size().columns

    async def on_msg(req) -> None:
        nonlocal printed
        if done.is_set():
            return
        decoded = decode_message(req.subject, req.data)
        msg = decoded[1]
        if keep is not None and not keep.matches(req.subject, msg, req.data):
            return
        rec = record(req.subject, req.data, req.headers, decoded=decoded)
        if as_json:
            line = msgspec.json.encode(rec).decode()
        else:
            line = readable(rec, msg, run, width)
        try:
            out.write(line + "\n")
            out.flush()
        except BrokenPipeError:  # `rollart tap ... | head`: the reader is gone
            _silence_stdout(out)
            done.set()
            return
        printed += 1
        if limit is not None and printed >= limit:
            done.set()

    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, done.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    timed_out = False
    sub = await bus.subscribe(pattern, on_msg)
    try:
        if ready is not None:
            ready()
        if limit is not None and limit <= 0:
            done.set()
        try:
            await asyncio.wait_for(done.wait(), duration)
        except TimeoutError:
            timed_out = True
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await sub.unsubscribe()
    return printed, timed_out


def _silence_stdout(out) -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail too."""
    try:
        fd = out.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


async def tap_main(args) -> int:
    cfg = load(resolve_config(args.config), RunConfig) if args.config else None
    run = args.run or (cfg.run if cfg is not None and not args.pattern.startswith(f"{m.PREFIX}.")
                       else None)
    try:
        pattern, run = full_pattern(args.pattern, run)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit must be >= 0 (it is {args.limit})")
    if args.duration is not None and args.duration <= 0:
        raise ConfigError(f"--duration must be > 0 seconds (it is {args.duration:g})")
    as_json = args.json or not sys.stdout.isatty()

    def ready() -> None:
        what = f" about trajectory {args.traj}" if args.traj else ""
        print(f"rollart tap: listening on {pattern}{what} (Ctrl-C to stop)", file=sys.stderr,
              flush=True)

    async with bus_from_config(cfg, name="rollart-tap", overrides=nats_overrides(args)) as bus:
        printed, timed_out = await tap(bus, pattern, run=run, traj=args.traj, limit=args.limit,
                                       duration=args.duration, as_json=as_json, ready=ready)
    if args.limit is not None and printed < args.limit and timed_out:
        print(f"rollart tap: {printed} of {args.limit} messages in {args.duration:g}s",
              file=sys.stderr)
        return 1
    return 0
