"""``rollart config --doc``: every config key with its type, default, allowed values and meaning.

Generated from the config classes, never written by hand:

- keys, types and defaults from the msgspec Structs under :class:`rollart.config.schema.RunConfig`,
  walked recursively; a ``dict[str, Struct]`` (``envs``, ``actors``, ``handlers``) is documented once
  under a placeholder key (``envs.<name>.sampling.temperature``);
- meanings from each field's docstring (the string right after the field, read with ``ast``);
- allowed values from ``Literal`` types (choices) and from the ``in_range(...)`` and
  ``subject_token(...)`` checks (:mod:`rollart.config.base`) in each Struct's
  ``__post_init__`` (ranges, subject-token names);
- the arguments of the built-in env types (``envs.<name>.args``) from their constructors'
  signatures and the ``Args:`` section of their class docstrings.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from typing import Any, Iterator, Literal

import msgspec

from rollart.config.loader import field_docs
from rollart.config.schema import RunConfig
from rollart.envs.gym import GymEnv
from rollart.envs.registry import BUILTIN_ENVS

WIDTH = 88
"""Line width the meanings are wrapped to."""

PLACEHOLDERS = {"envs": "<name>", "actors": "<role>", "handlers": "<handler>"}
"""The placeholder written for the user-chosen key of a ``dict[str, Struct]`` field."""

TOKEN_RULE = "letters, digits, '_' or '-' (a subject token)"


class Key(msgspec.Struct, frozen=True):
    """One documented key."""

    path: str
    """Dotted key, e.g. ``envs.<name>.sampling.temperature``."""
    type: str
    """The type as YAML sees it: ``int``, ``float``, ``str | null``, ``section``, ..."""
    default: str | None
    """The default as YAML, or None (a section: its keys have defaults)."""
    allowed: str
    """Allowed values ('' when the type says it all)."""
    doc: str
    """The field's docstring."""


# -- reading the classes -----------------------------------------------------------------


def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


def _members(t: Any) -> tuple[Any, ...]:
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return typing.get_args(t)
    return (t,)


def _struct_in(t: Any) -> Any:
    """The Struct inside ``t`` (``S`` or ``S | None``), else None."""
    return next((m for m in _members(t) if _is_struct(m)), None)


def _dict_struct(t: Any) -> Any:
    """``S`` of a ``dict[str, S]``, else None."""
    for m in _members(t):
        if typing.get_origin(m) is dict:
            args = typing.get_args(m)
            if len(args) == 2 and _is_struct(args[1]):
                return args[1]
    return None


def _type_name(t: Any) -> str:
    if t is type(None):
        return "null"
    if t is Any:
        return "any"
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(m) for m in typing.get_args(t))
    if origin is Literal:
        return "choice"
    if origin is dict:
        k, v = (typing.get_args(t) + (Any, Any))[:2]
        return "mapping" if v is Any else f"mapping of {_type_name(k)} to {_type_name(v)}"
    if origin in (list, tuple, set, frozenset):
        args = typing.get_args(t)
        return f"list of {_type_name(args[0])}" if args else "list"
    if _is_struct(t):
        return "section"
    return getattr(t, "__name__", str(t))


def _yaml(v: Any) -> str:
    """A default value as it is written in YAML."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, msgspec.Struct):
        return "{}"
    if isinstance(v, dict):
        if not v:
            return "{}"
        return "{" + ", ".join(f"{k}: {_yaml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml(x) for x in v) + "]"
    return repr(v)


def _defaults(typ: type) -> dict[str, Any]:
    out = {}
    for f in msgspec.structs.fields(typ):
        if f.default is not msgspec.NODEFAULT:
            out[f.name] = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = f.default_factory()
    return out


def _const(node: ast.AST, module: Any) -> Any:
    """A literal, or a module-level name (``TINY_MIN_VOCAB``), else raise ValueError."""
    if isinstance(node, ast.Name) and hasattr(module, node.id):
        return getattr(module, node.id)
    return ast.literal_eval(node)


def _range_text(ge: Any = None, gt: Any = None, le: Any = None, lt: Any = None) -> str:
    lo = f">= {ge:g}" if ge is not None else f"> {gt:g}" if gt is not None else ""
    hi = f"<= {le:g}" if le is not None else f"< {lt:g}" if lt is not None else ""
    if lo and hi:
        return (f"{'[' if ge is not None else '('}{ge if ge is not None else gt:g}, "
                f"{le if le is not None else lt:g}{']' if le is not None else ')'}")
    return lo or hi or "a finite number"


def checks(typ: type) -> dict[str, str]:
    """Allowed values stated by ``typ.__post_init__`` and those of the Structs it extends:
    ``{field: "in (0, 1]" | ">= 1" | ...}``, read from their ``in_range(self, prefix, "names",
    ge=..)`` and ``subject_token(prefix, name, ..)`` calls (also inside a ``for name in (...)``
    loop)."""
    out: dict[str, str] = {}
    for klass in reversed(typ.__mro__):
        out.update(_own_checks(klass))
    return out


def _own_checks(typ: type) -> dict[str, str]:
    fn = typ.__dict__.get("__post_init__")
    if fn is None:
        return {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return {}
    module = sys.modules.get(typ.__module__)
    out: dict[str, str] = {}
    loops: dict[str, list[str]] = {}  # loop variable -> the names it takes
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            try:
                seq = ast.literal_eval(node.iter)
            except ValueError:
                continue
            if isinstance(seq, (tuple, list)) and all(isinstance(s, str) for s in seq):
                loops[node.target.id] = list(seq)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id == "in_range" and len(node.args) >= 3:
            try:
                names = _const(node.args[2], module)
                bounds = {k.arg: _const(k.value, module) for k in node.keywords if k.arg}
            except ValueError:
                continue
            for name in str(names).split():
                out[name] = _range_text(**bounds)
        elif node.func.id == "subject_token" and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out[arg.value] = TOKEN_RULE
            elif isinstance(arg, ast.Name) and arg.id in loops:
                for name in loops[arg.id]:
                    out[name] = TOKEN_RULE
    return out


def _allowed(ann: Any, check: str) -> str:
    parts = []
    for m in _members(ann):
        if typing.get_origin(m) is Literal:
            parts.append("one of " + ", ".join(json.dumps(c) if isinstance(c, str) else _yaml(c)
                                                for c in typing.get_args(m)))
    if check:
        parts.append(check)
    if type(None) in _members(ann) and parts:
        parts.append("or null")
    return "; ".join(parts)


def iter_keys(typ: type, prefix: str = "") -> Iterator[Key]:
    """Every key of the config Struct ``typ``, depth first, sections before their keys."""
    hints = typing.get_type_hints(typ)
    docs = field_docs(typ)
    defaults = _defaults(typ)
    rules = checks(typ)
    for name in typ.__struct_fields__:
        ann = hints[name]
        path = f"{prefix}{name}"
        sub, item = _struct_in(ann), _dict_struct(ann)
        default = defaults.get(name, msgspec.NODEFAULT)
        if sub is not None:
            # a section that may also be written as a scalar (``nats: URL``) says so
            alone = all(m is sub or m is type(None) for m in _members(ann))
            yield Key(path, "section" if alone else _type_name(ann),
                      None if alone or default is msgspec.NODEFAULT else _yaml(default), "",
                      docs.get(name, "") or _class_doc(sub))
            yield from iter_keys(sub, path + ".")
        elif item is not None:
            ph = PLACEHOLDERS.get(name, "<name>")
            d = _yaml({k: {} for k in default}) if isinstance(default, dict) and default else "{}"
            yield Key(path, f"mapping of {ph} to section", d, "",
                      docs.get(name, "") or _class_doc(item))
            yield Key(f"{path}.{ph}", "section", None, "", _class_doc(item))
            yield from iter_keys(item, f"{path}.{ph}.")
        else:
            yield Key(path, _type_name(ann),
                      None if default is msgspec.NODEFAULT else _yaml(default),
                      _allowed(ann, rules.get(name, "")), docs.get(name, ""))


def _class_doc(typ: type) -> str:
    doc = typ.__doc__ or ""
    if doc.startswith(typ.__name__ + "("):  # msgspec's generated signature, not a docstring
        return ""
    return " ".join(doc.split())


# -- built-in env arguments ----------------------------------------------------------------


def _args_section(doc: str) -> dict[str, str]:
    """``{name: text}`` from a Google-style ``Args:`` section (``a, b: text`` names both)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    out: dict[str, str] = {}
    inside, current, indent = False, [], None
    for line in lines:
        if line.strip() == "Args:":
            inside = True
            continue
        if not inside:
            continue
        if not line.strip():
            break
        ind = len(line) - len(line.lstrip())
        m = re.match(r"\s*(\*{0,2}[\w]+(?:\s*,\s*[\w]+)*)\s*:\s*(.*)", line)
        if m and (indent is None or ind <= indent):
            indent = ind
            current = [n.strip().lstrip("*") for n in m.group(1).split(",")]
            for n in current:
                out[n] = m.group(2).strip()
        elif indent is not None and ind > indent and current:
            for n in current:
                out[n] += " " + line.strip()
        else:
            break
    return out


def env_args(name: str, cls: Any, skip: tuple[str, ...] = ()) -> list[Key]:
    """The constructor arguments of env class ``cls`` as keys ``args.<arg>`` of env type ``name``."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return []
    docs = _args_section(cls.__doc__ or "")
    out = []
    for p in sig.parameters.values():
        if p.name in skip or p.kind is p.VAR_POSITIONAL:
            continue
        if p.kind is p.VAR_KEYWORD:
            out.append(Key("<other>", "", None, "", docs.get(p.name, "")))
            continue
        ann = p.annotation if isinstance(p.annotation, str) else _type_name(p.annotation)
        out.append(Key(p.name, "" if ann is p.empty else str(ann).replace("None", "null"),
                       None if p.default is p.empty else _yaml(p.default),
                       "required" if p.default is p.empty else "", docs.get(p.name, "")))
    return out


def builtin_envs() -> list[tuple[str, list[Key]]]:
    """The ``args`` keys of each built-in env type, by title: the grouping ``rollart config
    --doc`` prints, and the docs site's config reference renders (``docs/hooks.py``)."""
    out = []
    for short, path in sorted(BUILTIN_ENVS.items()):
        mod, _, attr = path.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except Exception:  # an optional dependency missing at import time: leave it out
            continue
        out.append((f"type: {short}", env_args(short, cls)))
    out.append(('type: "gym:<id>" (any registered gymnasium id)', env_args("gym", GymEnv, ("env_id",))))
    return out


# -- rendering -----------------------------------------------------------------------------


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent) if text else []


def _line(k: Key, indent: str = "") -> list[str]:
    parts = [indent + k.path]
    if k.type:
        parts.append(f"({k.type})")
    if k.default is not None:
        parts.append(f"default {k.default}")
    allowed = "required" if k.allowed == "required" else f"allowed: {k.allowed}" if k.allowed else ""
    line = "  ".join(parts)
    if not allowed:
        return [line]
    if len(line) + 2 + len(allowed) <= WIDTH:
        return [f"{line}  {allowed}"]
    return [line] + _wrap(allowed, indent + "  ")


def document(typ: type | None = None, *, env_types: bool = True) -> str:
    """The text of ``rollart config --doc``: every key of ``typ`` (default: RunConfig)."""
    if typ is None:
        typ = RunConfig
    lines = [
        f"# Every key of a rollart config ({typ.__name__}), generated from rollart.config.schema.",
        "# A dotted key is a nested YAML mapping: rollout.alpha: 2 is written",
        "#   rollout:",
        "#     alpha: 2",
        "# <name>, <role> and <handler> stand for keys you choose (envs.main, actors.trainer,",
        "# actors.trainer.handlers.on_completed). Unknown keys are errors.",
    ]
    for k in iter_keys(typ):
        if "." not in k.path and (k.type == "section" or k.type.startswith("mapping of <")):
            lines.append("")  # a blank line before each top-level section
        lines += _line(k)
        lines += _wrap(k.doc, "    ")
    if env_types:
        lines += ["", "# envs.<name>.args: keyword arguments of the env type (of a class of your",
                  "# own: its constructor's). The built-in types take:"]
        for title, keys in builtin_envs():
            lines += ["", f"envs.<name>.{title}"]
            for k in keys:
                lines += _line(Key(f"args.{k.path}", k.type, k.default, k.allowed, ""), "  ")
                lines += _wrap(k.doc, "      ")
    return "\n".join(lines) + "\n"
