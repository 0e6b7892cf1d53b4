"""Typed YAML configs: grouped dataclasses, `--set a.b=c` overrides, strict checking.

A config class is a dataclass whose fields are plain values or other config dataclasses
(a group). Every field carries its help text in `metadata["help"]`; the same text is the
CLI help and the commented YAML template. A field may say which commands read it
(`only=`): a command's config refuses, and its template leaves out, the fields it does
not read, so one group class serves every command. Unknown keys are refused with the
list of valid ones, a former key with the name that replaced it, and a value of the
wrong type names its field and what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str, *, only: tuple[str, ...] | None = None) -> Any:
    """A config field with its help text; `only`: the commands that read it (None: all)."""
    metadata = {"help": help, "only": only}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def group(cls: type, help: str, **defaults: Any) -> Any:
    """A group of fields; `defaults` are this command's defaults where they differ from
    the group class's."""
    return dataclasses.field(default_factory=lambda: cls(**defaults), metadata={"help": help, "only": None})


def _is_group(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _reads(f: dataclasses.Field, command: str | None) -> bool:
    only = f.metadata.get("only")
    return only is None or command is None or command in only


def _check_value(value: Any, tp: Any, where: str) -> Any:
    """`value` as type `tp` (int → float and a lone item → list are allowed)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option_type in options:
            if option_type is type(None):
                continue
            try:
                return _check_value(value, option_type, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0])
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(repr, typing.get_args(tp)))}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        items = value if isinstance(value, list) else [value]
        return [_check_value(v, item, f"{where}[{i}]") for i, v in enumerate(items)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 2e-4 as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "config", *, command: str | None = None,
              base: Any = None) -> T:
    """Build config `cls` from nested dicts, refusing unknown keys, keys `command` does
    not read, and wrong types; what `data` leaves out keeps its default (`base`'s value,
    when given: a group's defaults for this command). A top-level config names its
    command (its `command` ClassVar)."""
    data = data or {}
    command = command or getattr(cls, "command", None)
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    read = [name for name, f in fields.items() if _reads(f, command)]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; valid fields: {', '.join(read)}")
    unread = sorted(name for name in data if not _reads(fields[name], command))
    if unread:
        users = ", ".join(f"linnet {c}" for c in fields[unread[0]].metadata["only"])
        raise ValueError(f"{where}.{unread[0]} is not read by `linnet {command}` (only by {users}); remove it")
    values = {}
    for name, value in data.items():
        tp = hints[name]
        inner = [t for t in typing.get_args(tp) if _is_group(t)] or ([tp] if _is_group(tp) else [])
        if inner and value is not None:
            start = getattr(base, name) if base is not None else _default(fields[name])
            values[name] = from_dict(inner[0], value, f"{where}.{name}", command=command, base=start)
        else:
            values[name] = _check_value(value, tp, f"{where}.{name}")
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def to_dict(config: Any) -> dict[str, Any]:
    """The fields `config`'s command reads, as nested plain data (what config.json holds)."""
    return _read_fields(config, getattr(type(config), "command", None))


def _read_fields(config: Any, command: str | None) -> dict[str, Any]:
    return {f.name: _read_fields(value, command) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
            for f in dataclasses.fields(config) if _reads(f, command) for value in [getattr(config, f.name)]}


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides (values parsed as YAML) to a nested dict."""
    import yaml

    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. training.steps=100")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part} is not a group of fields")
        try:
            node[leaf] = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item!r}: {raw!r} is not a YAML value ({str(e).splitlines()[0]}); quote text "
                             "that holds YAML syntax, e.g. --set 'data.path=\"a: b.jsonl\"'") from None
    return data


def read_yaml(path: str | Path | None) -> tuple[dict[str, Any], str]:
    """(the mapping in a YAML file, where it came from); ({}, "config") for no file."""
    import yaml

    if path is None:
        return {}, "config"
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such config file")
    try:
        return yaml.safe_load(path.read_text()) or {}, str(path)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None


def refuse_former(data: dict[str, Any], former: Mapping[str, str], where: str) -> None:
    """Refuse any key of `former` (dotted) found in `data`, saying what replaced it."""
    for dotted, fix in former.items():
        node: Any = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            raise ValueError(f"{where}: {dotted} is a former field and is no longer read; {fix}")


def template(cls: type, indent: int = 0, command: str | None = None, defaults: Any = None) -> str:
    """A commented YAML rendering of the defaults: every field the command reads, with
    its help text."""
    import yaml

    command = command or getattr(cls, "command", None)
    lines = []
    pad = "  " * indent
    for f in dataclasses.fields(cls):
        if not _reads(f, command):
            continue
        help_text = f.metadata.get("help", "")
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        if dataclasses.is_dataclass(default):
            lines.append(f"{pad}# {help_text}")
            lines.append(f"{pad}{f.name}:")
            lines.append(template(type(default), indent + 1, command, default))
        else:
            rendered = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {rendered}  # {help_text}")
    return "\n".join(lines)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested fields as one flat dict of dotted names ({"optimizer.lr": 0.001, ...})."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def identity(fields: dict[str, Any]) -> str:
    """16 hex digits naming a set of flat fields (a run's recipe)."""
    import hashlib
    import json

    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(saved: dict[str, Any], current: dict[str, Any], labels: tuple[str, str] = ("saved", "now")) -> list[str]:
    """'field: A (saved) vs B (now)' for each field that differs."""
    missing = object()
    out = []
    for name in sorted(set(saved) | set(current)):
        a, b = saved.get(name, missing), current.get(name, missing)
        if a != b:
            show = lambda v: "(absent)" if v is missing else repr(v)
            out.append(f"{name}: {show(a)} ({labels[0]}) vs {show(b)} ({labels[1]})")
    return out
