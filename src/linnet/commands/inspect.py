"""`linnet inspect`: what `linnet sft` would train on, before it does: formatted examples
with their learned tokens marked, and the batch table (rows, padding, steps).

    linnet inspect --config run.yaml --examples 5
"""

from __future__ import annotations

import sys

from linnet.commands.runs import parse_command
from linnet.commands.sft import batch_table, read_inputs
from linnet.config import SFTConfig
from linnet.report.tables import print_table


def highlight(tokenizer, example, color: bool) -> str:
    """Decoded example with learned spans marked: green on a terminal, [[…]] elsewhere."""
    pieces, start = [], 0
    learned = list(example.learned)
    for i in range(1, len(learned) + 1):
        if i == len(learned) or learned[i] != learned[start]:
            text = tokenizer.decode(example.tokens[start:i].tolist())
            if learned[start] and start > 0:
                text = f"\033[32m{text}\033[0m" if color else f"[[{text}]]"
            pieces.append(text)
            start = i
    return "".join(pieces)


def main(argv: list[str] | None = None) -> int:
    """Print formatted examples with their learned tokens marked, and the batch table."""
    args, config = parse_command(argv, "linnet inspect", main.__doc__, SFTConfig, training=False)
    if config is None:
        return 0
    inputs = read_inputs(config)
    color = sys.stdout.isatty()
    for i, example in enumerate(inputs.train_examples[: args.examples]):
        learned = int(example.learned[1:].sum())
        print(f"--- example {i}: {len(example)} tokens, {learned} learned " +
              ("(green)" if color else "(inside [[ ]])"))
        print(highlight(inputs.tokenizer, example, color))
    print()
    print_table(batch_table(inputs))
    return 0
