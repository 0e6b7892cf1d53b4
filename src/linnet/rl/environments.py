"""Environments for multi-turn rollouts: what answers the model between its turns.

A conversation starts from a prompt; the model writes a turn (up to a stop token); the
environment reads it and answers with a `Turn`: messages to insert (a tool's result as a
`tool` turn, or a user's reply), a reward, and whether the conversation is done. The
inserted tokens are context, never learned (linnet.rl.conversations masks them).

    class Guess:                                    # a user environment, `module:Guess`
        def reset(self, prompt):                    # a linnet.rl.rollouts.Prompt
            self.answer, self.tries = prompt.answer, 0
        def step(self, text):                       # the model's turn, its stop token left out
            self.tries += 1
            right = text.strip() == str(self.answer)
            return Turn([{"role": "user", "content": "right" if right else "try again"}],
                        reward=float(right), done=right)

`ToolEnvironment` is the built-in one: it runs the tool calls it finds in a turn, written
as the chat template's models write them (Qwen's `<tool_call>{...}</tool_call>`, Llama
3's bare `{"name": ..., "parameters": ...}`), and ends the conversation on a turn that
calls none. Its tools: `calculator` (arithmetic, evaluated from the syntax tree, never
`eval`) and `python` (the code run in linnet.rl.sandbox, its printed output returned).
"""

from __future__ import annotations

import ast
import importlib
import json
import operator
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
RESULT_CHARS = 2000  # the longest tool result inserted; the rest is cut


@dataclass
class Turn:
    """An environment's answer to one model turn.

    messages  inserted before the model's next turn: chat messages ({"role": "tool" or
              "user", "content": ...}) rendered by the chat template, or text inserted as
              it is; never learned
    reward    this turn's reward; a conversation's rewards are summed
    done      the conversation ends here (so does it at max_turns)
    """

    messages: Sequence[Mapping[str, Any]] | str = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    def reset(self, prompt) -> None: ...

    def step(self, text: str) -> Turn: ...


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("give the expression as text of at most 200 characters")
    return _number(_evaluate(ast.parse(expression, mode="eval").body))


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("power too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(round(value, 10)) if isinstance(value, float) else str(value)


def python(code: str) -> str:
    """What the code prints, run in linnet.rl.sandbox (no network, its own temporary folder,
    limits on time and memory), or why it failed."""
    from linnet.rl.sandbox import run_code

    if not isinstance(code, str):
        raise ValueError("give the code as text")
    outcome = run_code(code)
    if outcome.status == "ok":
        return outcome.output
    return f"{outcome.output}{outcome.status}: {outcome.stderr[-500:]}".strip()


TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python}


def parse_tool_calls(text: str) -> list[tuple[str, Any]]:
    """The (name, arguments) of each tool call in a model turn: `<tool_call>` blocks (Qwen,
    Hermes), else the whole turn as one JSON call or a list of them (Llama 3, after an
    optional <|python_tag|>). A call that does not parse comes back as (None, why)."""
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        bare = text.replace(PYTHON_TAG, "").strip()
        if not bare.startswith(("{", "[")):
            return []
        blocks = [bare]
    calls = []
    for block in blocks:
        try:
            found = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append((None, f"the tool call is not JSON ({e.msg})"))
            continue
        for call in found if isinstance(found, list) else [found]:
            calls.append(_call(call))
    return calls


def _call(call) -> tuple[str | None, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, 'a tool call is {"name": ..., "arguments": {...}}'
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's spelling: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, "the tool call's arguments are not JSON"
    return call["name"], arguments


def record_tools(record: Mapping[str, Any] | None) -> list[str] | None:
    """The tool names a record offers in OpenAI's format (`"tools": [{"type": "function",
    "function": {"name": ...}}]`, or bare {"name": ...}), None where it names none."""
    tools = (record or {}).get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        tools = json.loads(tools)
    names = []
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"tools: {json.dumps(tool)[:80]} is not an OpenAI tool ({{\"type\": \"function\", "
                             "\"function\": {\"name\": ...}})")
        names.append(spec["name"])
    return names


class ToolEnvironment:
    """Runs the tool calls of each model turn and inserts their results as tool turns; a
    turn that calls no tool ends the conversation (its reward is the run's rewards', on
    that last turn). `tools`: name -> function(**arguments) -> text, by default the
    built-in ones; a prompt whose record lists OpenAI `tools` may call only those."""

    def __init__(self, tools: Mapping[str, Callable[..., str]] | Sequence[str] | None = None):
        if tools is None:
            tools = TOOLS
        elif not isinstance(tools, Mapping):
            unknown = [t for t in tools if t not in TOOLS]
            if unknown:
                raise ValueError(f"tools: {', '.join(unknown)} unknown; the built-in ones are {', '.join(TOOLS)} "
                                 "(a module:Class environment brings its own)")
            tools = {name: TOOLS[name] for name in tools}
        self.tools = dict(tools)
        self.allowed = self.tools

    def reset(self, prompt) -> None:
        named = record_tools(getattr(prompt, "record", None))
        self.allowed = self.tools if named is None else {n: f for n, f in self.tools.items() if n in named}

    def step(self, text: str) -> Turn:
        calls = parse_tool_calls(text)
        if not calls:
            return Turn(done=True)
        return Turn([{"role": "tool", "name": name or "error", "content": self.run(name, arguments)}
                     for name, arguments in calls])

    def run(self, name: str | None, arguments) -> str:
        """A tool's result, or the error the model reads instead."""
        if name is None:
            return f"error: {arguments}"
        if name not in self.allowed:
            return f"error: no tool {name!r}; the tools are {', '.join(self.allowed) or 'none'}"
        try:
            result = self.allowed[name](**arguments) if isinstance(arguments, dict) else self.allowed[name](arguments)
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong, as from any tool
            return f"error: {type(e).__name__}: {e}"[:RESULT_CHARS]
        return str(result)[:RESULT_CHARS]


def environment_factory(spec, tools: Sequence[str] = ()) -> Callable[[], Environment] | None:
    """What makes one environment a conversation: `spec` a class or function, or its
    "module:Name"; with `tools` (names of built-in ones) and no spec, the ToolEnvironment
    over them; None when neither (single-turn sampling)."""
    if spec is None:
        if not tools:
            return None
        ToolEnvironment(tools)  # unknown names refused now
        return lambda: ToolEnvironment(tools)
    if tools:
        raise ValueError("grpo.tools picks the built-in tool environment; with grpo.environment, the environment "
                         "brings its own tools: give one of them")
    if isinstance(spec, str):
        module, _, name = spec.partition(":")
        if not module or not name:
            raise ValueError(f"grpo.environment={spec!r}; name it as module:Class")
        try:
            spec = imported(spec)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"grpo.environment={spec!r}: {e}; the module must be importable from the current "
                             "directory or on PYTHONPATH") from None
    if not callable(spec):
        raise TypeError(f"grpo.environment: {spec!r} is not a class or a function making an environment")
    return spec


def imported(spec: str):
    """The object a "module:name" string names (a config's grpo.rewards, grpo.environment),
    its module found on sys.path or, as under `python -m`, in the current directory."""
    module, _, name = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)  # after the installed packages: a local file shadows none of them
    return getattr(importlib.import_module(module), name)
