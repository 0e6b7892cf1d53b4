"""The `linnet` command: a dispatch table over library functions.

    linnet quickstart          fine-tune a small model on an embedded task, no files needed
    linnet sft --config F      supervised fine-tuning (LoRA or full) from a YAML config
    linnet dpo --config F      preference optimization (DPO) from a YAML config
    linnet grpo --config F     GRPO with the KV-cache engine and built-in or custom rewards
    linnet generate CARD --prompt T   stream a completion (KV-cache engine)
    linnet jax --config F      the sft run trained by the JAX backend (--fully-shard, --remat)
    linnet inspect --config F  formatted examples with learned tokens marked; the batch table
    linnet prepare --config F  tokenize a corpus into a checksummed shard cache (--verify)
    linnet pretrain --config F pretrain from a token cache: budgets, epochs, exact resume
    linnet plot RUN_DIR        curves.png from a run's metrics.jsonl
    linnet info CARD           the card, parameter counts, memory of a bf16 copy
    linnet plan CARD ...       memory, FLOPs, GPU-hours and cost before a run
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def info(argv: list[str]) -> int:
    """Print a card: its architecture, parameter counts and the memory its weights take."""
    parser = argparse.ArgumentParser(prog="linnet info", description=info.__doc__)
    parser.add_argument("card", help="a registered card name or a local Hugging Face model directory")
    args = parser.parse_args(argv)
    from linnet import nest

    card = nest.resolve(args.card)
    embed = card.vocab * card.hidden
    rows = [
        ("name", card.name),
        ("family", card.family),
        ("vocab", card.vocab),
        ("hidden", card.hidden),
        ("intermediate", card.intermediate),
        ("layers", card.layers),
        ("heads / kv heads / head dim", f"{card.heads} / {card.kv_heads} / {card.head_dim}"),
        ("rope base", f"{card.rope_base:g}"),
        ("rope scaling", card.rope_scaling or "none"),
        ("rms norm eps", f"{card.norm_eps:g}"),
        ("tied embeddings", card.tied_embeddings),
        ("biases (qkv / o / mlp)", f"{card.qkv_bias} / {card.o_bias} / {card.mlp_bias}"),
        ("qk norm", card.qk_norm),
        ("max positions", card.max_positions),
        ("weights", card.weights.path or card.weights.repo or "none (random init)"),
        ("tokenizer", card.tokenizer.path or card.tokenizer.repo or "none"),
        ("chat template", "yes" if card.chat_template else "no"),
        ("source", card.source),
        ("", ""),
        ("parameters", f"{card.params():,} ({_count(card.params())})"),
        ("  embedding", f"{embed:,}" + (" (shared with the head)" if card.tied_embeddings else "")),
        ("  per block", f"{card.block_params():,}"),
        ("  without embeddings", f"{card.params() - embed * (1 if card.tied_embeddings else 2):,}"),
        ("bf16 weights", _gib(2 * card.params())),
        ("f32 weights", _gib(4 * card.params())),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}" if key else "")
    return 0


# name -> "module:function"; each takes argv and returns an exit code.
COMMANDS = {
    "quickstart": "linnet.quickstart:cli",
    "sft": "linnet.sft:cli",
    "dpo": "linnet.preference:cli",
    "grpo": "linnet.reinforce:cli",
    "generate": "linnet.serve.generate:cli",
    "inspect": "linnet.sft:inspect_cli",
    "prepare": "linnet.pretrain.prepare:cli",
    "pretrain": "linnet.pretrain.runner:cli",
    "jax": "linnet.jax.sft:cli",
    "plot": "linnet.plots:cli",
    "info": "linnet.cli:info",
    "plan": "linnet.plan:cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nRun `linnet COMMAND --help` for a command's options.")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"linnet: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, function = COMMANDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), function)(rest)
    except (ValueError, FileNotFoundError) as e:
        print(f"linnet {name}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
