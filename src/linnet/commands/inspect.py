"""`linnet inspect`: what a training command would train on, before it does: formatted
examples with their learned tokens marked, and the batch table. An sft config shows its
packed examples; a dpo or reward config its pairs (or KTO's labelled answers); a grpo,
ppo or online dpo config its prompts as the engine reads them.

    linnet inspect --config run.yaml --examples 5
"""

from __future__ import annotations

import sys

from linnet.commands.runs import parse_command
from linnet.commands.sft import batch_table, read_inputs
from linnet.config import SFTConfig
from linnet.packing import Example
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
    args, config = parse_command(argv, "linnet inspect", main.__doc__, SFTConfig, training=False, any_command=True)
    if config is None:
        return 0
    online = getattr(getattr(config, "dpo", None), "online", False)
    if config.command == "sft":
        tokenizer, records, table = _examples(config)
    elif config.command in ("dpo", "reward") and not online:
        tokenizer, records, table = _pairs(config)
    elif config.command in ("grpo", "ppo", "dpo"):
        tokenizer, records, table = _prompts(config)
    else:
        raise ValueError(f"linnet inspect shows sft, dpo, reward, grpo and ppo configs; this is a `linnet "
                         f"{config.command}` config")
    color = sys.stdout.isatty()
    for label, shown in (item for record in records[: args.examples] for item in record):
        if isinstance(shown, Example):
            learned = int(shown.learned[1:].sum())
            print(f"--- {label}: {len(shown)} tokens, {learned} learned " + ("(green)" if color else "(inside [[ ]])"))
            print(highlight(tokenizer, shown, color))
        else:  # a prompt: the engine completes it, nothing of it is learned
            print(f"--- {label}: {len(shown)} tokens")
            print(tokenizer.decode(list(shown)))
    print()
    print_table(table)
    return 0


def _examples(config):
    inputs = read_inputs(config)
    return inputs.tokenizer, [[(f"example {i}", e)] for i, e in enumerate(inputs.train_examples)], batch_table(inputs)


def _pairs(config):
    """A dpo or reward config's pairs (KTO: labelled answers), each answer as it is learned."""
    from linnet.commands.dpo import preference_data

    group = getattr(config, config.command)
    kto = getattr(group, "loss_type", None) == "kto"
    _, tokenizer, pairs, held_out, steps = preference_data(config, group.pairs_per_step,
                                                           f"{config.command}.pairs_per_step", kto)
    if kto:
        records = [[(f"example {i}, {'desirable' if p.desirable else 'undesirable'}",
                     Example.prompted(p.prompt, p.completion))] for i, p in enumerate(pairs)]
    else:
        records = [[(f"pair {i}, chosen", chosen), (f"pair {i}, rejected", rejected)]
                   for i, (chosen, rejected) in enumerate(p.examples() for p in pairs)]
    what = "examples" if kto else "pairs"
    table = [(f"training {what}", f"{len(pairs):,}"), (f"held-out {what}", f"{len(held_out):,}"),
             (f"{what} per step", f"{group.pairs_per_step:,}"), ("steps", f"{steps:,}")]
    return tokenizer, records, table


def _prompts(config):
    """A sampling config's prompts (grpo, ppo, online dpo), with their reference answers."""
    from linnet.commands.grpo import prompts_and_rewards

    group = getattr(config, config.command)
    per_step = "pairs_per_step" if config.command == "dpo" else "prompts_per_step"
    r = prompts_and_rewards(config, group, per_step)
    records = [[(f"prompt {i}" + (f", answer {p.answer!r}" if p.answer is not None else ""), p.ids)]
               for i, p in enumerate(r.prompts)]
    table = [("training prompts", f"{len(r.prompts):,}"), ("held-out prompts", f"{len(r.held_out):,}"),
             ("prompts per step", f"{getattr(group, per_step):,}"), ("rewards", ", ".join(r.functions)),
             ("steps", f"{r.steps:,}")]
    return r.tokenizer, records, table
