"""`linnet serve`: a model and its adapters behind an OpenAI-compatible HTTP API
(linnet.serve.server; needs `pip install 'linnet[serve]'`).

    linnet serve runs/sft                                  # the run's model, as "sft"
    linnet serve base/ --adapter tenant-a=runs/a --adapter tenant-b=runs/b --port 8000
    curl localhost:8000/v1/completions -d '{"model": "base", "prompt": "12+34=", "max_tokens": 4}'

The base and its adapters share one engine (linnet.torch.adapter_bank.AdapterEngine): the
adapters stay unmerged, a few megabytes each, and requests for any of them are sampled in
the same batches, each row through its own adapter.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linnet serve", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a model directory, a run directory or a registered card's name")
    p.add_argument("--name", help="the model's name in requests (default: the source's folder or card name)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="also serve a PEFT adapter or a LoRA run as NAME (repeatable)")
    p.add_argument("--load-adapters", action="store_true",
                   help="let POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and drop adapters while "
                        "serving (paths on this machine: enable it only where you trust who can reach the server)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=16, help="requests sampled together at most (default 16)")
    p.add_argument("--queue", type=int, default=64, help="requests that may wait; more get a 503 (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="the longest completion of a request that names no max_tokens (default 256)")
    p.add_argument("--quantize", choices=["nf4"], help="hold the base in 4-bit NormalFloat (bitsandbytes: the "
                                                       "qlora extra); the adapters stay in float32 beside it")
    return p


def load_served(source: str, name: str, adapters: dict[str, str] | None = None, *, bank: bool = False,
                quantize: str | None = None) -> dict:
    """{name: Served} for the model `source` (a run's own adapters merged into it) and each
    of `adapters` over it, all on one engine: an AdapterEngine when there are adapters (or
    `bank`, to load some later). `quantize="nf4"`: the base (a model directory or a
    registered card) held in 4-bit."""
    from linnet.commands.eval import load_model
    from linnet.data.prompts import start_id
    from linnet.serve import Engine
    from linnet.serve.server import Served
    from linnet.torch.adapter_bank import AdapterEngine

    model, tokenizer = load_model(source) if quantize is None else _quantized(source, quantize)
    if getattr(model, "lora", None):
        model.merge_lora()  # a LoRA run as the base: its adapters folded in, the bank's go on top
    engine = AdapterEngine(model, adapters or {}) if adapters or bank else Engine(model)
    bos = start_id(tokenizer, model.card)  # as eval and generate start a prompt (encode_prompt)
    return {name: Served(engine, tokenizer, bos),
            **{adapter: Served(engine, tokenizer, bos, adapter) for adapter in adapters or {}}}


def _quantized(source: str, quantize: str):
    """(model, tokenizer): a model directory or registered card with its weights in 4-bit."""
    from linnet import nest
    from linnet.cards import REGISTRY
    from linnet.data import load_tokenizer

    path = Path(source)
    if (path / "config.json").is_file():
        model = nest.load(path, weights=path, quantize=quantize)
    elif source in REGISTRY and not path.exists():
        model = nest.load(source, quantize=quantize)
    else:
        raise ValueError(f"--quantize {quantize}: {source} is not a model directory or a registered card; export a "
                         "run with `linnet export RUN --merge --out DIR` and serve DIR")
    model.eval()
    return model, load_tokenizer(model.card)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import uvicorn

        from linnet.serve.server import make_app
    except ImportError:
        raise ValueError("linnet serve needs FastAPI and uvicorn: pip install 'linnet[serve]'") from None
    names = {}
    for spec in args.adapter:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--adapter {spec}: give NAME=DIR")
        if not Path(path).exists():
            raise ValueError(f"--adapter {spec}: {path} does not exist")
        names[name] = path
    base = args.name or (Path(args.source).name if Path(args.source).exists() else args.source)
    if base in names:
        raise ValueError(f"--adapter {base}=...: the base model is served as {base!r}; name the adapter otherwise")
    if args.max_batch < 1 or args.queue < 1 or args.max_new_tokens < 1:
        raise ValueError("--max-batch, --queue and --max-new-tokens must be positive")
    served = load_served(args.source, base, names, bank=args.load_adapters, quantize=args.quantize)
    app, _ = make_app(served, max_batch=args.max_batch, queue=args.queue, max_new_tokens=args.max_new_tokens,
                      load_adapters=args.load_adapters)
    print(f"linnet serve: {', '.join(served)} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
