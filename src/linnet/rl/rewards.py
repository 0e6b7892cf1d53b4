"""Built-in GRPO rewards over decoded completions, and `module:function` lookup.

Each built-in is made by a factory taking the tokenizer (to decode the completion), and
returns `reward(prompt, completion_ids) -> float` with `prompt.answer` the reference:

  exact      1 when the completion's final answer equals the reference answer
  numeric    1 when the completion's last number equals the reference number
  format     1 when the completion matches a regular expression (no answer needed)
  code       the share of the reference tests that the completion's program passes, run in
             a sandboxed process (linnet.rl.sandbox); the program is the completion's last
             ```python block, else the whole completion, and `prompt.answer` the tests

A final answer is the text after the last "####" (GSM8K's convention), else after the
last "answer:"/"answer is", else the whole completion, stripped.

`Concurrent(reward, workers)` scores a slow per-completion reward (`code`, or one that runs
a subprocess or asks a service) several completions at a time (`grpo.reward_workers`).

A `module:function` reward may also follow TRL's contract, recognised by its parameters
`prompts` and `completions`: `f(prompts, completions, **columns) -> list[float]` over a
batch, the prompts as the records give them (text, or chat messages), the completions as
text (or one assistant message each when the prompts are chats), every other field of the
records as a keyword argument holding a list, and `completion_ids`. A None in the list is
TRL's "no opinion": 0 in the sum. `trl_reward(f, tokenizer)` wraps one for Python.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from linnet.rl import sandbox
from linnet.rl.environments import imported

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")
FENCED = re.compile(r"```py(?:thon)?[ \t]*\n(.*?)```", flags=re.DOTALL)


def final_answer(text: str) -> str:
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    match = list(re.finditer(r"answer(?: is|:)\s*", text, flags=re.IGNORECASE))
    return (text[match[-1].end():] if match else text).strip()


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def text_of(tokenizer, completion: list[int]) -> str:
    """A completion's text without its stop tokens (which a tokenizer may spell out)."""
    return tokenizer.decode([t for t in completion if t not in tokenizer.eos_ids])


def exact(tokenizer) -> Callable:
    def exact_answer(prompt, completion: list[int]) -> float:
        return float(final_answer(text_of(tokenizer, completion)) == final_answer(str(prompt.answer)))

    return exact_answer


def numeric(tokenizer) -> Callable:
    def numeric_answer(prompt, completion: list[int]) -> float:
        got, want = last_number(text_of(tokenizer, completion)), last_number(str(prompt.answer))
        return float(got is not None and want is not None and abs(got - want) < 1e-6)

    return numeric_answer


def format_match(tokenizer, pattern: str) -> Callable:
    try:
        compiled = re.compile(pattern, flags=re.DOTALL)
    except re.error as e:
        raise ValueError(f"grpo.format_pattern={pattern!r} is not a regular expression ({e})") from None

    def format_reward(prompt, completion: list[int]) -> float:
        return float(compiled.search(text_of(tokenizer, completion)) is not None)

    return format_reward


def code_of(text: str) -> str:
    """A completion's program: its last ```python fenced block, else the whole text."""
    blocks = FENCED.findall(text)
    return blocks[-1] if blocks else text


def code(tokenizer, **limits) -> Callable:
    """The share of the prompt's tests a completion's program passes in the sandbox;
    `limits`: run_tests's (timeout, cpu_seconds, memory_mb, ...)."""
    sandbox.check_platform()

    def code_tests(prompt, completion: list[int]) -> float:
        try:
            tests = sandbox.as_tests(prompt.answer)
        except ValueError as e:
            raise ValueError(f"the code reward runs the prompt's answer as its tests (from a data file, the field "
                             f"data.answer names, e.g. data.answer: tests): {e}") from None
        return sandbox.run_tests(code_of(text_of(tokenizer, completion)), tests, **limits).share

    return code_tests


class Concurrent:
    """`reward(prompt, completion_ids)` scored `workers` completions at a time in threads,
    through the `batch(items)` GRPO calls (values in the items' order). Threads overlap
    rewards that wait (a subprocess running tests, a request to a service); pure-Python
    arithmetic holds the interpreter's lock and gains nothing."""

    def __init__(self, reward: Callable, workers: int):
        if workers < 1:
            raise ValueError(f"Concurrent: workers={workers}; use 1 or more")
        self.reward, self.workers = reward, workers
        self.__name__ = getattr(reward, "__name__", "reward")

    def __call__(self, prompt, completion: list[int]) -> float:
        return self.reward(prompt, completion)

    def batch(self, items: Sequence[tuple[object, list[int]]]) -> list[float]:
        def one(i: int) -> float:
            try:
                return self.reward(*items[i])
            except Exception as e:
                raise ValueError(f"completion {i} of the batch: {type(e).__name__}: {e}") from e

        with ThreadPoolExecutor(min(self.workers, max(len(items), 1))) as pool:
            return list(pool.map(one, range(len(items))))


def follows_trl(function: Callable) -> bool:
    """Whether a reward takes TRL's (prompts, completions, **columns) rather than linnet's
    (prompt, completion_ids)."""
    try:
        names = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return "prompts" in names and "completions" in names


class trl_reward:  # noqa: N801  (used as a function: trl_reward(f, tokenizer))
    """A reward written for TRL (`f(prompts, completions, **columns) -> list[float]`) as a
    linnet batch reward: GRPO calls `batch(items)` with (Prompt, completion ids) items and
    gets a number each."""

    def __init__(self, function: Callable, tokenizer):
        self.function, self.tokenizer = function, tokenizer
        self.__name__ = getattr(function, "__name__", "reward")

    def __call__(self, prompt, completion: list[int]) -> float:
        return self.batch([(prompt, completion)])[0]

    def batch(self, items: Sequence[tuple[object, list[int]]]) -> list[float]:
        prompts = [p.text if p.text is not None else self.tokenizer.decode(list(p.ids)) for p, _ in items]
        completions = [text_of(self.tokenizer, c) for _, c in items]
        if prompts and isinstance(prompts[0], list):  # chats: each completion an assistant message
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        if all(p.record is None for p, _ in items):  # Prompts made in Python: their answers are the column
            columns = {"answer": [p.answer for p, _ in items]}
        else:  # the records' other fields, as TRL passes a dataset's columns
            fields = sorted({k for p, _ in items for k in (p.record or {})} - {"prompts", "completions"})
            columns = {k: [(p.record or {}).get(k) for p, _ in items] for k in fields}
        columns["completion_ids"] = [list(c) for _, c in items]
        accepted = inspect.signature(self.function).parameters
        if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
            columns = {k: v for k, v in columns.items() if k in accepted}
        values = self.function(prompts=prompts, completions=completions, **columns)
        if not isinstance(values, (list, tuple)) or len(values) != len(items):
            raise ValueError(f"it returned {type(values).__name__} "
                             f"{'of ' + str(len(values)) + ' values ' if isinstance(values, (list, tuple)) else ''}"
                             f"for {len(items)} completions; return a list of one number a completion")
        return [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values]


def resolve(spec: str, tokenizer, pattern: str | None = None, limits: dict | None = None, *,
            named: str = "reward") -> Callable:
    """A reward from its config spelling: "exact", "numeric", "format" (with `pattern`),
    "code" (sandboxed within `limits`, run_tests's keywords), "model:DIR" (a reward model
    saved by `linnet reward`, scored in packed batches), or
    "package.module:function" (a function taking (prompt, completion_ids), or TRL's
    (prompts, completions, **columns) for a batch: see the module docstring). `named`:
    the setting that gave `spec`, in refusals (grpo.rewards, --rewards)."""
    if spec == "exact":
        return exact(tokenizer)
    if spec == "numeric":
        return numeric(tokenizer)
    if spec == "format":
        if not pattern:
            raise ValueError("reward 'format' needs grpo.format_pattern, a regular expression")
        return format_match(tokenizer, pattern)
    if spec == "code":
        return code(tokenizer, **(limits or {}))
    if spec.startswith("model:"):  # a reward model trained by `linnet reward`
        from linnet.train.reward import RewardScorer

        return RewardScorer(spec.removeprefix("model:"))
    if ":" not in spec:
        raise ValueError(f"{named} {spec!r}: use exact, numeric, format, code, or 'module:function'")
    try:
        function = imported(spec)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{named} {spec!r}: cannot import it ({e}); the module must be importable from the current "
                         "directory or on PYTHONPATH") from None
    if not callable(function):
        raise ValueError(f"{named} {spec!r} is not callable")
    return trl_reward(function, tokenizer) if follows_trl(function) else function
