"""Load YAML into config Structs; every error names the key path and what is allowed."""

from __future__ import annotations

import ast
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from rollart.errors import ConfigError

__all__ = ["ConfigError", "convert", "describe", "field_docs", "load", "load_yaml"]

T = TypeVar("T")


def load_yaml(path: str | Path) -> Any:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e


def convert(data: Any, typ: type[T], *, source: str = "config") -> T:
    """Validate plain data (a dict from YAML) as ``typ``; raise :class:`ConfigError`."""
    try:
        return msgspec.convert(data, typ, strict=False)
    except msgspec.ValidationError as outer:
        message, prefix, sub, subtyp = str(outer), *_locate(data, typ, "")
        try:
            msgspec.convert(sub, subtyp, strict=False)
        except msgspec.ValidationError as inner:  # the innermost failing entry names its key
            message = str(inner)
        else:
            prefix, subtyp = "", typ
        raise ConfigError(f"{source}: {_explain(message, subtyp, prefix)}") from None


def _locate(data: Any, typ: Any, prefix: str) -> tuple[str, Any, Any]:
    """Descend into ``dict[str, Struct]`` entries to find the innermost failing one.

    msgspec writes dict keys as ``[...]``; descending lets the error name the key.
    """
    typ = _unwrap(typ)
    if not (_is_struct(typ) and isinstance(data, dict)):
        return prefix, data, typ
    hints = typing.get_type_hints(typ)
    for name, value in data.items():
        ann = _unwrap(hints.get(name, Any))
        if typing.get_origin(ann) is dict and isinstance(value, dict):
            vt = _unwrap(typing.get_args(ann)[1])
            if _is_struct(vt):
                for k, v in value.items():
                    try:
                        msgspec.convert(v, vt, strict=False)
                    except msgspec.ValidationError:
                        return _locate(v, vt, f"{prefix}{name}.{k}.")
        elif _is_struct(ann) and isinstance(value, dict):
            try:
                msgspec.convert(value, ann, strict=False)
            except msgspec.ValidationError:
                return _locate(value, ann, f"{prefix}{name}.")
    return prefix, data, typ


def load(path: str | Path, typ: type[T]) -> T:
    return convert(load_yaml(path), typ, source=str(path))


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")


MOVED = {"proxy.replicas": "actors.generate.replicas", "reward.replicas": "actors.reward.replicas"}
"""Keys an earlier release had, and the key that took their place (one replica setting per
role): a config that still uses one is told where it went."""


def _explain(msg: str, root: type, prefix: str = "") -> str:
    """Turn msgspec's ``... - at `$.a.b``` into ``a.b: ...`` plus the allowed keys or values."""
    m = _AT.search(msg)
    path = m.group("path") if m else ""
    text = msg[: m.start()] if m else msg
    key = prefix + path.lstrip(".") if (prefix or path) else "<top level>"
    key = key.rstrip(".")
    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    if unknown:
        where = _resolve(root, path)
        allowed = sorted(where.__struct_fields__) if _is_struct(where) else []
        full = f"{key}.{unknown.group(1)}" if (path or prefix) else unknown.group(1)
        if full in MOVED:
            return f"'{full}' is now '{MOVED[full]}'"
        return f"unknown key '{full}'; allowed keys here: {', '.join(allowed)}"
    missing = re.match(r"Object missing required field `(.+)`", text)
    if missing:
        full = f"{key}.{missing.group(1)}" if (path or prefix) else missing.group(1)
        return f"missing required key '{full}'"
    if text.startswith("Invalid enum value"):
        allowed = _literal_values(root, path)
        if allowed:
            text += f"; allowed: {', '.join(map(repr, allowed))}"
    # a Struct's own check (__post_init__) names its key: either in full ("rollout.alpha must
    # be ...") or, in a Struct that sits under a user-chosen name (envs.<name>), relative to it
    # ("max_turns must be ..."), which gets the path in front here
    head = re.match(r"[a-z_][a-z0-9_]*", text)
    where = _resolve(root, path)
    if head and _is_struct(where) and head.group(0) in where.__struct_fields__:
        return f"{key}.{text}" if (path or prefix) else text
    if text.startswith(key + "."):
        return text
    return f"{key}: {text}"


def _literal_values(root: type, path: str) -> tuple:
    *parent, last = path.rsplit(".", 1) if "." in path else ("", path)
    owner = _resolve(root, parent[0] if parent else "")
    if not _is_struct(owner):
        return ()
    ann = typing.get_type_hints(owner).get(last.strip("."))
    for t in (ann, *typing.get_args(ann)):
        if typing.get_origin(t) is typing.Literal:
            return typing.get_args(t)
    return ()


def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


def _resolve(root: Any, path: str) -> Any:
    """The type found at ``$<path>`` (``.field`` and ``[i]`` steps) below ``root``."""
    t = root
    for step in re.findall(r"\.([^.\[]+)|\[([^\]]+)\]", path):
        field, index = step
        t = _unwrap(t)
        if field and _is_struct(t):
            t = typing.get_type_hints(t).get(field, Any)
        else:
            args = typing.get_args(_unwrap(t))
            t = args[-1] if args else Any
    return _unwrap(t)


def _unwrap(t: Any) -> Any:
    """Strip Optional/Union to the first Struct member, if any."""
    args = typing.get_args(t)
    if args and typing.get_origin(t) in (typing.Union, types.UnionType):
        for a in args:
            if _is_struct(a):
                return a
    return t


def describe(typ: type, indent: str = "") -> str:
    """Human-readable documentation of a config Struct (used by ``rollart config --doc``)."""
    lines = []
    hints = typing.get_type_hints(typ)
    docs = field_docs(typ)
    for name in typ.__struct_fields__:
        ann = hints[name]
        lines.append(f"{indent}{name}: {getattr(ann, '__name__', str(ann))}  # {docs.get(name, '')}")
        sub = _unwrap(ann)
        if _is_struct(sub):
            lines.append(describe(sub, indent + "  "))
    return "\n".join(lines)


def field_docs(typ: type) -> dict[str, str]:
    """Field docstrings: the string literal right after each field in the class body, of
    ``typ`` and of the Structs it extends (``TrainerConfig``'s keys live on its bases)."""
    out: dict[str, str] = {}
    for klass in reversed(typ.__mro__):
        if klass is not msgspec.Struct and issubclass(klass, msgspec.Struct):
            out.update(_own_field_docs(klass))
    return out


def _own_field_docs(typ: type) -> dict[str, str]:
    try:
        tree = ast.parse(inspect.getsource(typ))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body else []
    out: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant)
                and isinstance(b.value.value, str)):
            out[a.target.id] = " ".join(b.value.value.split())
    return out
