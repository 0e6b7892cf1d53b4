"""`linnet info CARD`: a card's architecture, parameter counts and the memory its weights take.

    linnet info llama-3.1-8b-instruct
    linnet info path/to/hf-model-dir
"""

from __future__ import annotations

import argparse

from linnet.report.tables import count, gib, print_table


def main(argv: list[str] | None = None) -> int:
    """Print a card: its architecture, parameter counts and the memory its weights take."""
    parser = argparse.ArgumentParser(prog="linnet info", description=main.__doc__)
    parser.add_argument("card", help="a registered card name or a local Hugging Face model directory")
    args = parser.parse_args(argv)
    from linnet.cards import resolve

    card = resolve(args.card)
    embed = card.vocab * card.hidden
    print_table([
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
        *([("experts (a position / a block)", _experts(card.experts))] if card.experts else []),
        ("weights", card.weights.path or card.weights.repo or "none (random init)"),
        ("tokenizer", card.tokenizer.path or card.tokenizer.repo or "none"),
        ("chat template", "yes" if card.chat_template else "no"),
        ("source", card.source),
        ("", ""),
        ("parameters", f"{card.params():,} ({count(card.params())})"),
        ("  embedding", f"{embed:,}" + (" (shared with the head)" if card.tied_embeddings else "")),
        ("  per block", f"{card.block_params():,}"),
        ("  without embeddings", f"{card.params() - embed * (1 if card.tied_embeddings else 2):,}"),
        *([("  active a token", f"{card.active_params():,} ({count(card.active_params())}: its chosen experts)")]
          if card.experts else []),
        ("bf16 weights", gib(2 * card.params())),
        ("f32 weights", gib(4 * card.params())),
    ])
    return 0


def _experts(e) -> str:
    """How a mixture of experts routes, in one line."""
    return (f"{e.per_token} / {e.count}, each {e.intermediate} wide" + (", renormalized" if e.normalize else "")
            + (f", and a shared expert {e.shared} wide" if e.shared else ""))
