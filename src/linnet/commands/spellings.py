"""How the commands spell the knobs they hand to the library: the YAML's names (seed 002's,
`training.context_length`) where the library's keywords use seed 000's (`tokens=`), so that
an error tells a YAML or command-line user the name they wrote (docs/config.md maps the two);
and the former flag spellings, refused with the flag that replaced them.

    examples_from_records(records, tok, tokens=t.context_length, names=spellings.RECORDS)
    former_flags(parser, {"--seq": "--context-length"})
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

# The data readers' keywords (linnet.data: examples_from_records, load_examples,
# pairs_from_records, unpaired_from_records, prompts_from_records) as a run config names them.
RECORDS = {
    "tokens": "training.context_length",
    "truncate": "data.truncate: true",
    "messages": "data.messages",
    "prompt": "data.prompt",
    "completion": "data.completion",
    "chosen": "data.chosen",
    "rejected": "data.rejected",
    "label": "data.label",
    "answer": "data.answer",
    "chat_template": "data.chat_template",
    "split": "data.split",
}

# The fixes a library refusal (linnet.errors.SettingError) gives a Python caller, as a run
# config spells them: `linnet` rewords them for a command given --config.
CONFIG_FIXES = {
    "random": "set model.weights: random",
    "weights_dir": "model.weights: DIR",
    "tokenizer": "set data.tokenizer to a tokenizer directory (tokenizer.json) or a card with one",
    "eos": "name one as eos_token in the tokenizer_config.json beside its tokenizer.json",
    "lora_targets": "lora.targets",
    "head_in_full": "it trains in full fine-tuning, lora.enabled: false",
}

# GRPO's prompt check (linnet.rl.rollouts.check_prompts) as a run config names its knobs.
PROMPTS = {"tokens": "training.context_length", "max_new_tokens": "grpo.max_new_tokens"}


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args` for a command that reads `--config FILE`; a YAML file given
    without the flag (`linnet sft run.yaml`, the commonest slip) is refused with the fix."""
    argv = sys.argv[1:] if argv is None else list(argv)
    bare = next((a for a in argv if a.endswith((".yaml", ".yml")) and not a.startswith("-") and "=" not in a), None)
    if bare and not any(a == "--config" or a.startswith("--config=") for a in argv):
        parser.error(f"unrecognized arguments: {bare}; give the config as --config {bare}")
    return parser.parse_args(argv)


def former_flags(parser: argparse.ArgumentParser, renamed: Mapping[str, str]) -> None:
    """Refuse each former flag (old -> new) with one argparse error naming its replacement
    (`--seq was renamed --context-length`). Hidden from --help; registered by name, so that
    argparse's prefix matching cannot take an old flag for a new one (--reward for --rewards)."""
    for old, new in renamed.items():
        parser.add_argument(old, nargs="?", action=_Renamed, new=new, help=argparse.SUPPRESS)


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed {self.new}")
