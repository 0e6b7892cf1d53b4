"""The course module's arithmetic (seed 004, "Why LoRA fits on one GPU"), exactly as it
counts, for `linnet plan --textbook`: beside linnet's own plan, it shows where a reader's
back-of-the-envelope numbers come from and why linnet's differ.

    rows = textbook("llama-3.1-8b-instruct")        # full FT, LoRA, QLoRA
    rows[1].states / 1e9, rows[1].total / 1e9      # 16.7, 20.5 (GB)

The module's rules:
- states: 16 B a trained parameter (bf16 weight and gradient, f32 master and two Adam
  moments); a frozen base at 2 B a parameter (bf16), or QLoRA's 4.127 bits (NF4 with
  double-quantized constants: 4 + 8/64 + 32/(64 * 256) bits);
- activations, with activation checkpointing: each layer's input, 2·s·b·d bytes, for
  every layer, plus one layer recomputed at 34·s·b·d bytes (Korthikanti et al.), plus
  the f32 logits, s·b·V·4 bytes;
- the total is the sum of both, and the fewest H100-80GB GPUs the sharded states and
  one GPU's activations fit (90% of each GPU usable).
"""

from __future__ import annotations

from dataclasses import dataclass

from linnet import cards
from linnet.plan.memory import Method, trainable_params

GB = 1e9
STATE_BYTES = 16  # bf16 weight + bf16 gradient + f32 master + two f32 Adam moments
FROZEN_BYTES = {"full": 0.0, "lora": 2.0, "qlora": (4 + 8 / 64 + 32 / (64 * 256)) / 8}  # a frozen parameter
METHODS = {"full": "full FT (16 B/param)", "lora": "LoRA (2 B/param base)", "qlora": "QLoRA (0.516 B/param)"}


@dataclass(frozen=True)
class TextbookRow:
    """One row of the module's table, in bytes."""

    card: str
    method: str
    trainable: int
    states: float
    activations: float
    gpus: int | None

    @property
    def total(self) -> float:
        return self.states + self.activations


def activation_bytes(card: cards.Card, tokens: int, micro_batch: int) -> float:
    """The module's activations with checkpointing: every layer's input, one layer
    recomputed, and the f32 logits."""
    s, b, d = tokens, micro_batch, card.hidden
    return 2 * s * b * d * card.layers + 34 * s * b * d + s * b * card.vocab * 4


def textbook(card: cards.Card | str, *, rank: int = 16, tokens: int = 4096, micro_batch: int = 1,
             gpu_memory: float = 80 * GB, usable: float = 0.9) -> list[TextbookRow]:
    """Full fine-tuning, LoRA and QLoRA of `card` (rank `rank` on every linear layer) as
    the module counts them (see the module docstring)."""
    card = cards.resolve(card)
    params = card.params()
    activations = activation_bytes(card, tokens, micro_batch)
    rows = []
    for name in METHODS:
        trainable = params if name == "full" else trainable_params(card, Method(name, rank=rank))
        states = STATE_BYTES * trainable + FROZEN_BYTES[name] * params
        room = usable * gpu_memory - activations
        rows.append(TextbookRow(card.name, name, trainable, states, activations,
                                max(1, -(-int(states) // int(room))) if room > 0 else None))
    return rows


REASONS = {  # why linnet's plan of a method differs from the module's, beyond the figures
    "full": "linnet's total is the step's fullest phase, not states + activations; full fine-tuning peaks in the "
            "optimizer step, where torch's foreach AdamW holds a 4 B temporary a parameter (the square roots of the "
            "second moments) beside gradients, master and moments",
    "lora": "the module adds every state to every activation, linnet takes the fullest phase (the end of the "
            "forward); its activations are a Llama block's (a SwiGLU MLP keeps four 3.5·d-wide tensors, RMSNorm its "
            "input in f32), not 34·s·b·d",
    "qlora": "as LoRA, and QLoRA keeps the embeddings and the head in bf16 (as bitsandbytes and PEFT do), not in "
             "4 bits: more states than 0.516 B a parameter",
}


def render(rows: list[TextbookRow], plans: list) -> str:
    """The module's table for each row beside linnet's plan of the same run (`plans`, one a
    row, from linnet.plan.estimate), and a line a row on why they differ."""
    lines = ["the course module's arithmetic (seed 004, 'Why LoRA fits on one GPU') beside linnet's plan",
             f"{'model':<24} {'method':<22} {'trainable':>11} {'states':>10} {'+ activations':>14} {'min H100':>8}"
             f"   {'linnet states':>13} {'peak':>10} {'min H100':>8}"]
    for row, plan in zip(rows, plans):
        share = f" ({row.trainable / plan.params:.1%})" if row.method != "full" else ""
        lines.append(f"{row.card:<24} {METHODS[row.method]:<22} {_count(row.trainable) + share:>11} "
                     f"{_gb(row.states):>10} {_gb(row.total):>14} {row.gpus or '-':>8}   {_gb(plan.states.total):>13} "
                     f"{_gb(plan.total):>10} {plan.min_gpus or '-':>8}")
    lines.append("(figures from the card's exact parameter count; the module prints 70B full fine-tuning's total "
                 "as 1,138 GB, 70.6B x 16 B + 8.6 GB)")
    lines.append("")
    for row, plan in zip(rows, plans):
        lines.append(f"{row.card} {row.method}: states {_signed(plan.states.total - row.states)}, total "
                     f"{_signed(plan.total - row.total)} (linnet's peak: {plan.peak_phase}); {REASONS[row.method]}")
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


def _signed(n: float) -> str:
    return f"{n / GB:+,.1f} GB"
