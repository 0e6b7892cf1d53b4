"""`linnet generate`: sample one completion of a prompt and stream it to stdout.

    linnet generate qwen2.5-0.5b-instruct --prompt "Why is the sky blue?" --chat
    linnet generate path/to/hf-model-dir --prompt "Once upon a time" --max-new-tokens 64 \
        --temperature 0.8 --top-p 0.95 --seed 1

The text goes to stdout as the tokens are sampled; a summary line (tokens, time, why it
stopped) goes to stderr. The card's tokenizer (a run's: its data.tokenizer) encodes the
prompt as `linnet eval` does: with --chat one user message rendered by the chat template
with the generation prompt added, else the raw text; either way the tokenizer's BOS first
(the card's where the tokenizer has none) unless the template wrote it. Generation stops at
any of the tokenizer's stop tokens (not printed) or after --max-new-tokens.
"""

from __future__ import annotations

import argparse
import sys
import time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linnet generate", description=__doc__.split("\n\n")[0])
    p.add_argument("card", help="a registered card name, a local Hugging Face model directory or a linnet run")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt with the chat template (one user message)")
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="most tokens to sample (default 256, or what the model's positions leave after the prompt)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the tokens holding this much mass")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cpu)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the card's on CUDA, float32 on CPU)")
    p.add_argument("--weights", default=None, help="a safetensors directory or file instead of the card's own")
    return p


def _encode(tok, card, args) -> list[int]:
    """The prompt's ids as `linnet eval` and `linnet serve` encode it (linnet.data.encode_prompt)."""
    from linnet.data.prompts import Framing, encode_prompt

    if args.system and not args.chat:
        raise ValueError("--system needs --chat")
    if args.chat and tok.chat_template is None:
        raise ValueError(f"--chat: {tok.source} has no chat template; drop --chat to send the prompt as raw text")
    return encode_prompt(tok, args.prompt, args.chat, Framing(system=args.system), card=card)


def main(argv: list[str] | None = None) -> int:
    """Stream one completion of --prompt from CARD (see the module docstring)."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    from linnet import nest
    from linnet.commands.eval import room
    from linnet.data.tokenizer import load_tokenizer
    from linnet.export import run_card
    from linnet.torch.engine import Engine
    from linnet.torch.loading import usable_device

    card = run_card(args.card)  # a run's: the ids of the tokenizer it trained with
    for flag, value, bad, want in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens is not None and args.max_new_tokens < 1,
             "at least 1"),
            ("--temperature", args.temperature, args.temperature < 0, "at least 0 (0: greedy)"),
            ("--top-k", args.top_k, args.top_k is not None and args.top_k < 1, "at least 1"),
            ("--top-p", args.top_p, args.top_p is not None and not 0 < args.top_p <= 1, "in (0, 1]")):
        if bad:
            raise ValueError(f"{flag} {value}: give a number {want}")
    tok = load_tokenizer(card)
    prompt = _encode(tok, card, args)
    new = room(card, len(prompt), args.max_new_tokens)
    device = usable_device(args.device or "cpu", "--device")
    engine = Engine(nest.load(card, device=device, dtype=args.dtype, weights=args.weights))

    start = time.perf_counter()
    ids: list[int] = []
    shown = ""
    stopped = False
    for t in engine.stream(
        prompt,
        max_new_tokens=new,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop=tok.eos_ids,
        seed=args.seed,
    ):
        if t in tok.eos_ids:
            stopped = True
            break
        ids.append(t)
        text = tok.decode(ids)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            continue
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    text = tok.decode(ids)
    sys.stdout.write(text[len(shown):] + "\n")
    sys.stdout.flush()
    seconds = time.perf_counter() - start
    n = len(ids) + stopped
    why = "stop token" if stopped else f"max_new_tokens={new}"
    print(
        f"[{n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tokens/s; "
        f"prompt {len(prompt)} tokens; ended by {why}]",
        file=sys.stderr,
    )
    return 0

