"""A refusal worded for whoever gave the setting: the message names each setting or fix
as a {placeholder}; `str()` reads it as a Python caller writes it, `named(names)` as the
caller's user does (`linnet plan` names its flags, a config command its YAML fields:
linnet.commands.spellings.CONFIG_FIXES).

    raise SettingError("{tokens} must be positive")                       # tokens must be positive
    raise SettingError("no weights; {random}", python={"random": "pass weights='random'"})
"""

from __future__ import annotations

from collections.abc import Mapping


class SettingError(ValueError):
    """A setting refused. Each {placeholder} reads as its Python wording (`python`, else
    its own name) unless `named(names)` names it otherwise."""

    def __init__(self, template: str, python: Mapping[str, str] | None = None):
        self.template, self.python = template, dict(python or {})
        super().__init__(self.named({}))

    def named(self, names: Mapping[str, str]) -> str:
        try:
            return self.template.format_map(_Names(names, self.python))
        except (KeyError, ValueError, IndexError, AttributeError):  # a brace in a value: leave it as written
            return self.template


class _Names(dict):
    """A setting's name from `names` (which may compute it, as a dict with __missing__),
    else its Python wording, else itself."""

    def __init__(self, names: Mapping[str, str], python: Mapping[str, str]):
        super().__init__()
        self.names, self.python = names, python

    def __missing__(self, key: str) -> str:
        try:
            return self.names[key]
        except KeyError:
            return self.python.get(key, key)
