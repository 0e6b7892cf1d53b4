"""Typed YAML configs: grouped dataclasses, `--set a.b=c` overrides, strict checking.

A config class is a dataclass whose fields are plain values or other config dataclasses
(a group). Every field carries its help text in `metadata["help"]`; the same text is
the CLI help and the commented YAML template. Unknown keys are refused with the list of
valid ones, and a value of the wrong type names its field and what was expected.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


def group(cls: type, help: str) -> Any:
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def _is_group(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


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


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "config") -> T:
    """Build config `cls` from nested dicts, refusing unknown keys and wrong types."""
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; valid fields: {', '.join(fields)}")
    values = {}
    for name, value in data.items():
        tp = hints[name]
        inner = [t for t in typing.get_args(tp) if _is_group(t)] or ([tp] if _is_group(tp) else [])
        if inner and value is not None:
            values[name] = from_dict(inner[0], value, f"{where}.{name}")
        else:
            values[name] = _check_value(value, tp, f"{where}.{name}")
    return cls(**values)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


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
        node[leaf] = yaml.safe_load(raw) if raw else None
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


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Read a YAML file (or start from defaults when path is None) and apply overrides."""
    data, where = read_yaml(path)
    return from_dict(cls, apply_overrides(data, list(overrides)), where)


def template(cls: type, indent: int = 0) -> str:
    """A commented YAML rendering of the defaults: every field with its help text."""
    import yaml

    lines = []
    pad = "  " * indent
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help", "")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            lines.append(f"{pad}# {help_text}")
            lines.append(f"{pad}{f.name}:")
            lines.append(template(type(default), indent + 1))
        else:
            rendered = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {rendered}  # {help_text}")
    return "\n".join(lines)
