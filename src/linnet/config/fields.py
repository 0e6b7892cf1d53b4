"""Typed YAML configs: grouped dataclasses, `--set a.b=c` overrides, strict checking.

A config class is a dataclass whose fields are plain values or other config dataclasses
(a group). Every field carries its help text in `metadata["help"]`; the same text is the
CLI help and the commented YAML template. A field may say which commands read it
(`only=`): a command's config refuses, and its template leaves out, the fields it does
not read, so one group class serves every command.

Every key a config gives that is not read is refused at once, each where it came from
(the file and its line, or the `--set` item): an unknown key with the nearest valid one,
a former key with the name that replaced it, another trainer's name with linnet's. A
value of the wrong type names its field and what was expected; a float must be finite
unless its field says otherwise (`option(finite=False)`); a key given twice in one file
is refused with both lines.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import numbers
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str, *, only: tuple[str, ...] | None = None, finite: bool = True) -> Any:
    """A config field with its help text; `only`: the commands that read it (None: all);
    `finite`: a float (or each float of a list) must be finite (False: inf and nan pass)."""
    metadata = {"help": help, "only": only, "finite": finite}
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


@dataclass
class Origins:
    """Where a config's fields came from: `file` (its name, or "config" for data given in
    Python), the line of each dotted key in it, and the `--set` item of each override."""

    file: str = "config"
    lines: dict[str, int] = field(default_factory=dict)
    sets: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.file

    def of(self, dotted: str) -> str:
        """Where the field `dotted` (or the group holding it) was given."""
        parts = dotted.split(".")
        keys = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
        for key in keys:  # a --set replaces what the file gave, a whole group included
            if key in self.sets:
                return f"--set {self.sets[key]}"
        for key in keys:
            if key in self.lines:
                return f"{self.file} line {self.lines[key]}"
        within = [item for key, item in self.sets.items() if key.startswith(f"{dotted}.")]  # a --set made the group
        return f"--set {within[0]}" if within else self.file

    def placed(self, message: str) -> str:
        """A config check's refusal (`config: FIELD...`) placed where FIELD was given: its
        line in the file, or its --set item; the file's name when neither gave it."""
        if not message.startswith("config: "):
            return message
        found = re.match(r"config: ([a-z_]+(?:\.[a-z_]+)+)", message)
        return f"{self.of(found.group(1)) if found else self}: {message.removeprefix('config: ')}"


class _NotFinite(ValueError):
    """A float that is nan or infinite where its field wants a finite one."""


def _check_value(value: Any, tp: Any, where: str, finite: bool = True) -> Any:
    """`value` as type `tp` (int → float and a lone item → list are allowed); a float
    must be finite when `finite`."""
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
                return _check_value(value, option_type, where, finite)
            except ValueError as e:
                errors.append(e)
        raise next((e for e in errors if isinstance(e, _NotFinite)), errors[0])
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(repr, typing.get_args(tp)))}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        items = value if isinstance(value, list) else [value]
        return [_check_value(v, item, f"{where}[{i}]", finite) for i, v in enumerate(items)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is float and isinstance(value, str):
        try:
            value = float(value)  # YAML reads 2e-4 as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    if tp is float and finite and not math.isfinite(value):
        raise _NotFinite(f"{where}={value}; use a finite number")
    return value


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str | Origins = "config", *,
              command: str | None = None, base: Any = None, former: Mapping[str, str] | None = None,
              foreign: Mapping[str, str] | None = None, groups: Mapping[str, str] | None = None) -> T:
    """Build config `cls` from nested dicts, refusing unknown keys, keys `command` does
    not read, and wrong types; what `data` leaves out keeps its default (`base`'s value,
    when given: a group's defaults for this command). A top-level config names its
    command (its `command` ClassVar). `where`: the file the data came from, or its
    `Origins` (each key's line, the `--set` items). Every key that is not read is refused
    in one error (`name_problems`, with `former`, `foreign` and other commands' `groups`);
    then each value is checked, named with where it came from."""
    origins = where if isinstance(where, Origins) else Origins(where)
    command = command or getattr(cls, "command", None)
    if not isinstance(data or {}, dict):
        raise ValueError(f"{origins}: expected a mapping of fields, got {data!r}")
    problems = name_problems(cls, data or {}, command=command, former=former or {}, foreign=foreign or {},
                             groups=groups or {}, origins=origins)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} fields are not read by `linnet {command or 'config'}`:\n  "
                         + "\n  ".join(problems))
    return _build(cls, data or {}, "", command, base, origins)


def _build(cls: type[T], data: dict[str, Any], prefix: str, command: str | None, base: Any, origins: Origins) -> T:
    """Config `cls` from `data` (its names already checked), at dotted `prefix`."""
    if not isinstance(data, dict):
        raise ValueError(f"{origins.of(prefix[:-1])}: {prefix[:-1]}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for name, value in data.items():
        tp, dotted = hints[name], f"{prefix}{name}"
        inner = _group_of(tp)
        if inner is not None and value is not None:
            start = getattr(base, name) if base is not None else field_default(fields[name])
            values[name] = _build(inner, value, f"{dotted}.", command, start, origins)
        else:
            try:
                values[name] = _check_value(value, tp, dotted, fields[name].metadata.get("finite", True))
            except ValueError as e:
                raise ValueError(f"{origins.of(dotted)}: {e}") from None
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def _group_of(tp: Any) -> type | None:
    """The config dataclass a field's type holds (`Group` or `Group | None`), if any."""
    inner = [t for t in typing.get_args(tp) if _is_group(t)] or ([tp] if _is_group(tp) else [])
    return inner[0] if inner else None


def _read_names(cls: type, command: str | None, prefix: str = "") -> list[str]:
    """Every dotted field `command` reads in `cls`, groups' fields included."""
    names = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _reads(f, command):
            names.append(f"{prefix}{f.name}")
            inner = _group_of(hints[f.name])
            if inner is not None:
                names += _read_names(inner, command, f"{prefix}{f.name}.")
    return names


def _nearest(dotted: str, group: str, read: list[str]) -> str | None:
    """The read field an unknown `dotted` most likely meant: the same name in another
    group, a near spelling in its own group (epoch: training.epochs), a name with it as
    one of its words (warmup: lr_schedule.warmup_steps; its own group's first), or a
    looser spelling (difflib) in its own group or anywhere."""
    leaf = dotted.rsplit(".", 1)[-1]
    moved = [name for name in read if name.rsplit(".", 1)[-1] == leaf]
    if moved:
        return moved[0]
    siblings = {name.rsplit(".", 1)[-1]: name for name in read if name.rpartition(".")[0] == group}
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.8)
    if close:
        return siblings[close[0]]
    worded = [name for name in read if leaf in name.rsplit(".", 1)[-1].split("_")]
    if worded:
        return next((name for name in worded if name.rpartition(".")[0] == group), worded[0])
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    others = [name for name in read if not dotted.startswith(f"{name}.")]  # not the group it is in
    close = difflib.get_close_matches(dotted, others, n=1, cutoff=0.75)
    return close[0] if close else None


def _within(value: Any, dotted: str, former: Mapping[str, str]) -> list[str]:
    """The `former` fields given inside `value`, the group at `dotted`."""
    found = []
    for name in former:
        if not name.startswith(f"{dotted}."):
            continue
        node = value
        for part in name[len(dotted) + 1:].split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            found.append(name)
    return found


def name_problems(cls: type, data: dict[str, Any], *, command: str | None = None,
                  former: Mapping[str, str] | None = None, foreign: Mapping[str, str] | None = None,
                  groups: Mapping[str, str] | None = None, origins: Origins | None = None) -> list[str]:
    """One line for each key of `data` that config `cls` does not read, where it came
    from first: a `former` field (dotted -> what replaced it), a `foreign` name (another
    trainer's field name, at any depth -> linnet's answer), another command's top-level
    group (`groups`: its name -> which command reads it), an unknown field with the
    nearest valid one, a field `command` does not read."""
    origins = origins or Origins()
    former, foreign, groups = former or {}, foreign or {}, groups or {}
    command = command or getattr(cls, "command", None)
    read = _read_names(cls, command)
    problems: list[str] = []

    def walk(cls: type, data: dict[str, Any], prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        valid = [name for name, f in fields.items() if _reads(f, command)]
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            at = origins.of(dotted)
            if dotted in former:
                problems.append(f"{at}: {dotted} is a former field and is no longer read; {former[dotted]}")
            elif key not in fields and _within(value, dotted, former):  # a former field of a group this config lacks
                problems.extend(f"{origins.of(name)}: {name} is a former field and is no longer read; {former[name]}"
                                for name in _within(value, dotted, former))
            elif key not in fields:
                where = f" in {prefix[:-1]}" if prefix else ""
                if key in foreign:
                    problems.append(f"{at}: unknown field {key!r}{where} (a TRL, PEFT or Axolotl name); {foreign[key]}")
                    continue
                if not prefix and key in groups:
                    problems.append(f"{at}: {groups[key]}")
                    continue
                near = _nearest(dotted, prefix[:-1], read)
                hint = f"did you mean {near}?" if near else f"valid fields: {', '.join(valid)}"
                problems.append(f"{at}: unknown field {key!r}{where}; {hint}")
            elif not _reads(fields[key], command):
                users = ", ".join(f"linnet {c}" for c in fields[key].metadata["only"])
                problems.append(f"{at}: {dotted} is not read by `linnet {command}` (only by {users}); remove it")
            elif isinstance(value, dict) and _group_of(hints[key]) is not None:
                walk(_group_of(hints[key]), value, f"{dotted}.")

    walk(cls, data, "")
    return problems


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one from its default_factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def to_dict(config: Any) -> dict[str, Any]:
    """The fields `config`'s command reads, as nested plain data (what config.json holds)."""
    return _read_fields(config, getattr(type(config), "command", None))


def _read_fields(config: Any, command: str | None) -> dict[str, Any]:
    return {f.name: _read_fields(value, command) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
            for f in dataclasses.fields(config) if _reads(f, command) for value in [getattr(config, f.name)]}


def apply_overrides(data: dict[str, Any], overrides: list[str], origins: Origins | None = None) -> dict[str, Any]:
    """Apply `a.b=c` overrides (values parsed as YAML) to a nested dict; `origins`, when
    given, records each override's item."""
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
        if origins is not None:
            origins.sets[key] = item
    return data


def read_yaml(path: str | Path | None) -> tuple[dict[str, Any], Origins]:
    """(the mapping in a YAML file, where it came from: the file and each key's line);
    ({}, Origins("config")) for no file. A key given twice in one mapping is refused with
    both lines (YAML would keep the second silently)."""
    import yaml

    if path is None:
        return {}, Origins()
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; --config takes a YAML file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such config file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file; --config takes a YAML file") from None
    origins = Origins(str(path))
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _key_lines(node, "", origins)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = f"{path} line {mark.line + 1} column {mark.column + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: not valid YAML ({problem or ' '.join(str(e).split())}); fix the file there") \
            from None
    finally:
        loader.dispose()
    return data or {}, origins


def _key_lines(node: Any, prefix: str, origins: Origins) -> None:
    """Record the line of each key under a YAML mapping node, dotted; refuse a key given
    twice in one mapping."""
    import yaml

    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        dotted, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key_node.value in seen:
            raise ValueError(f"{origins.file} line {line}: {dotted} is given twice (lines {seen[key_node.value]} and "
                             f"{line}); YAML would keep the second silently: keep one")
        seen[key_node.value] = origins.lines[dotted] = line
        _key_lines(value_node, f"{dotted}.", origins)


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
        default = getattr(defaults, f.name) if defaults is not None else field_default(f)
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


def check_finite(settings, group: str) -> None:
    """Every float of a group (and each float of a list field) is finite, unless its field
    says `finite=False`: a YAML config is checked as it loads; this checks groups made in
    Python too."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        if f.metadata.get("finite", True) and any(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                                  and not math.isfinite(v) for v in items):
            shown = list(value) if isinstance(value, (list, tuple)) else value
            raise ValueError(f"config: {group}.{f.name}={shown}; use a finite number")


def check_ranges(group: str, **rules: tuple[Any, bool, str]) -> None:
    """Each rule is (value, whether it is allowed, the allowed range), keyed by its field
    in `group`; the first value outside its range is refused, naming that one field rather
    than every field of the check."""
    for name, (value, allowed, wanted) in rules.items():
        if not allowed:
            raise ValueError(f"config: {group}.{name}={value!r}; it must be {wanted}")


def check_one_of(settings, name: str) -> None:
    """A Literal field holds one of its values (a YAML config is checked as it loads; this
    checks settings made in Python too)."""
    allowed = typing.get_args(typing.get_type_hints(type(settings))[name])
    value = getattr(settings, name)
    if value not in allowed:
        raise ValueError(f"config: {settings.YAML}.{name}={value!r}; use one of {', '.join(map(str, allowed))}")
