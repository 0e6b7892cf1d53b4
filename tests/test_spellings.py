"""One spelling per knob on each surface, kept: docs/config.md's table names every YAML
field and every flag; the Python API uses none of the retired spellings; an error names a
knob the way its reader wrote it (the YAML's names from a command, the keywords from
Python). tests/test_seed_examples.py runs the seeds' own code with their spellings."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import re
import typing
from pathlib import Path

import pytest

from linnet import cli, config
from linnet.commands import spellings

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "config.md"
SOURCE = ROOT / "src" / "linnet"


def table() -> dict[str, list[str]]:
    """docs/config.md's table by column: each cell's text, row by row."""
    lines = [line for line in TABLE.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["knob", "YAML", "Python", "CLI"], header
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[2:]]
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    return {name: [row[i] for row in rows] for i, name in enumerate(header)}


def yaml_fields() -> set[str]:
    """Every field of every command's config, dotted (decentralized.adaptive_consensus.p)."""
    found = set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = f"{prefix}.{f.name}" if prefix else f.name
            groups = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
            if prefix:
                found.add(name)
            for group in groups:
                walk(group, name)

    for cls in config.COMMANDS.values():
        walk(cls, "")
    return found


def test_the_table_has_one_row_per_yaml_field():
    cells = table()["YAML"]
    named = {name for cell in cells for name in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", cell)}
    missing = sorted(yaml_fields() - named)
    assert not missing, f"docs/config.md's table lacks the YAML fields {missing}"
    stale = sorted(named - yaml_fields())
    assert not stale, f"docs/config.md's table names YAML fields no config has: {stale}"
    rows = [name for cell in cells for name in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", cell)]
    assert len(rows) == len(set(rows)), "a YAML field has two rows"


# --- the flags -----------------------------------------------------------------------------

def _parser(name: str) -> argparse.ArgumentParser | None:
    """A command module's parser where it builds one without running (`parser()`)."""
    module = importlib.import_module(f"linnet.commands.{cli.COMMANDS[name]}")
    return module.parser() if callable(getattr(module, "parser", None)) else None


def _help_flags(name: str) -> set[str]:
    """The flags `linnet NAME --help` lists (its options' lines), for commands whose parser
    is built inside main()."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([name, "--help"])
    flags = set()
    for line in out.getvalue().splitlines():
        head = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)  # an option's line: its spellings, then its help
        if head:  # "-h, --help", "--pipeline-schedule {1f1b,interleaved}", "--chunked-loss, --no-chunked-loss"
            flags |= {part.split()[0] for part in head.group(1).split(", ") if part.startswith("-")}
    return flags


def command_flags() -> dict[str, set[str]]:
    """Every flag of every `linnet` command (the hidden former spellings left out)."""
    flags = {}
    for name in cli.COMMANDS:
        parser = _parser(name)
        if parser is None:
            flags[name] = _help_flags(name)
        else:
            flags[name] = {option for action in parser._actions if action.help != argparse.SUPPRESS
                           for option in action.option_strings}
    return flags


def test_the_parsers_are_read_whole():
    """The two ways of reading the flags agree where both work."""
    for name in ("plan", "eval", "pretrain", "generate"):
        assert _help_flags(name) == {f for f in command_flags()[name]}, name


def test_the_table_names_every_flag():
    cli_column = " ".join(table()["CLI"])
    named = set(re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", cli_column))
    missing = {name: sorted(flags - named) for name, flags in command_flags().items() if flags - named}
    assert not missing, f"docs/config.md's table lacks these flags: {missing}"


def test_former_flags_are_hidden_and_refused():
    """A former spelling is no flag in --help; it is refused naming the new one (test_cli)."""
    from linnet.commands import eval as eval_command
    from linnet.commands import plan as plan_command

    for module in (eval_command, plan_command):
        shown = {o for a in module.parser()._actions if a.help != argparse.SUPPRESS for o in a.option_strings}
        assert not shown & set(module.FORMER_FLAGS)
        assert set(module.FORMER_FLAGS.values()) <= shown | {"--no-activation-checkpointing"}


# --- Python --------------------------------------------------------------------------------

# Retired spellings of a knob in Python: the gradient clip is clip= (Run.clip), a row's
# length tokens=, the evaluation cadence evaluate_every=.
BANNED = {"max_grad_norm", "max_tokens", "max_seq", "max_len", "seq", "eval_every"}


def public_names(path: Path) -> list[tuple[str, int, str]]:
    """(where, line, name) of every parameter of a public function or method (and
    __init__) and every field of a class, in one module."""
    found = []
    tree = ast.parse(path.read_text())

    def parameters(node, where):
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                found.append((where, node.lineno, arg.arg))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            parameters(node, node.name)
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        (not item.name.startswith("_") or item.name == "__init__"):
                    parameters(item, f"{node.name}.{item.name}")
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.append((node.name, item.lineno, item.target.id))
    return found


MODULES = sorted(str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py"))


@pytest.mark.parametrize("module", MODULES)
def test_no_signature_uses_a_retired_spelling(module):
    used = [f"{module}:{line} {where}({name}=)" for where, line, name in public_names(SOURCE / module)
            if name in BANNED]
    assert not used, f"retired spellings (docs/config.md names the knob): {used}"


def _keywords(function) -> set[str]:
    return {p.name for p in inspect.signature(function).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.jax  # it imports the JAX trainers: last in a worker, after the tests that fork
def test_the_table_names_every_objective_keyword():
    """The trainers' own keywords and the Run's fields all have a row (the objectives'
    settings are their YAML groups' fields, which have theirs)."""
    from linnet import run as run_module

    code = " ".join(re.findall(r"`([^`]*)`", " ".join(table()["Python"])))
    named = set(re.findall(r"\b([a-z_]+)\b", code))
    objectives = [("linnet.train.loop", "train"), ("linnet.train.dpo", "dpo"), ("linnet.train.online_dpo", "online_dpo"), ("linnet.train.kto", "kto"),
                  ("linnet.train.reward", "reward"), ("linnet.train.distill", "distill"),
                  ("linnet.train.distill", "on_policy_distill"), ("linnet.train.grpo", "grpo"), ("linnet.train.ppo", "ppo"),
                  ("linnet.jax.train", "train"), ("linnet.jax.dpo", "dpo"), ("linnet.jax.grpo", "grpo")]
    wanted = {f.name for f in dataclasses.fields(run_module.Run)}
    for module, name in objectives:  # the defining modules: a package attribute may name a submodule
        wanted |= _keywords(getattr(importlib.import_module(module), name))
    missing = sorted(wanted - named)
    assert not missing, f"docs/config.md's Python column lacks {missing}"


# --- errors name the knob as their reader wrote it -----------------------------------------

def _records(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "1 + 1 =", "completion": " 2"},
        {"prompt": "a long prompt " * 40, "completion": " and its answer"},
    ]))
    return path


def test_from_python_a_long_record_names_the_keywords(tmp_path):
    from linnet.data import load_examples, load_tokenizer
    from tests.conftest import quickstart_model

    tokenizer = load_tokenizer(quickstart_model(tmp_path / "model"))
    with pytest.raises(ValueError) as refused:
        load_examples(_records(tmp_path), tokenizer, tokens=32, chat=False)
    message = str(refused.value)
    assert "longer than a row of 32 tokens" in message and "(tokens=)" in message and "truncate=True" in message
    assert "training.context_length" not in message and "data." not in message


def test_for_a_config_a_long_record_names_the_yaml_fields(tmp_path):
    """What `linnet sft` hands the reader: the YAML's names (linnet.commands.spellings)."""
    from linnet.data import examples_from_records, load_tokenizer, read_records
    from tests.conftest import quickstart_model

    tokenizer = load_tokenizer(quickstart_model(tmp_path / "model"))
    with pytest.raises(ValueError) as refused:
        examples_from_records(read_records(_records(tmp_path)), tokenizer, tokens=32, chat=False,
                              names=spellings.RECORDS)
    message = str(refused.value)
    assert "training.context_length" in message and "data.truncate" in message
    assert "tokens=" not in message and "truncate=" not in message


def test_linnet_sft_names_the_yaml_fields_of_a_long_record(tmp_path, capsys):
    import yaml

    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"card": str(tmp_path / "model")}, "data": {"path": str(_records(tmp_path)), "chat": False},
        "training": {"steps": 1, "context_length": 32}, "runtime": {"output_dir": str(tmp_path / "run"),
                                                                      "progress": False}}))
    assert cli.main(["sft", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "longer than a row of 32 tokens" in err
    assert "training.context_length" in err and "data.truncate" in err and "tokens=" not in err


def test_linnet_eval_names_its_flags(tmp_path):
    from linnet.commands import eval as eval_command
    from linnet.data import load_examples, load_tokenizer
    from tests.conftest import quickstart_model

    tokenizer = load_tokenizer(quickstart_model(tmp_path / "model"))
    with pytest.raises(ValueError, match=r"Raise the row length \(--context-length\)"):
        load_examples(_records(tmp_path), tokenizer, tokens=32, chat=False, names=eval_command.RECORD_FLAGS)


def test_grpo_s_prompt_check_names_the_caller_s_knobs():
    from linnet.rl.rollouts import Prompt, check_prompts

    long = [(0, Prompt(list(range(30)), "x"))]
    with pytest.raises(ValueError, match=r"\(max_new_tokens=\).*\(tokens=\)"):
        check_prompts(long, 32, 8)
    with pytest.raises(ValueError, match=r"\(grpo.max_new_tokens\).*\(training.context_length\)") as refused:
        check_prompts(long, 32, 8, names=spellings.PROMPTS)
    assert "=" not in str(refused.value)
