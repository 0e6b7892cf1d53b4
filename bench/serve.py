"""Many adapters on one base: what a batch mixing 8 adapters costs against a batch of one,
and `linnet serve` under a fixed load.

    python bench/serve.py                 # bench/serve.md, ~3 min on 2 CPU cores
    python bench/serve.py --quick --out - # a smoke run: seconds, prints only

A random ~7M-parameter Llama (4 layers, hidden 256, vocabulary 8,192) and 8 LoRA adapters
(rank 16, every linear layer, B drawn so each changes the output) are written to a
temporary directory. Cases, each `--repeats` times in turn (the order reversed each round),
16 prompts of 32 tokens, 64 new tokens each, greedy, no stop token:

  merged       `Engine` over the base with adapter 0 merged in (what serving one adapter
               costs without a bank)
  bank, one    `AdapterEngine` holding the 8 adapters, every row through adapter 0
  bank, mixed  the same engine, row i through adapter i mod 8

Then the server: `linnet serve`'s app over the bank, on localhost; 4 client threads each
send 8 requests one after another (prompt 32 tokens' worth of text, max_tokens from 8 to 64
in turn, temperature 0, the base or one of the 8 adapters in turn), with requests joining a
running batch (the default) and without (a batch runs to its end before the next starts),
alternating, `--repeats` rounds, medians. Latency is from sending a request to its whole
answer; tokens/s is the completion tokens of all requests over the wall time of the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
from _common import KEEP, command, machine, random_llama, table, write_report

ADAPTERS = 8


def build(root: Path, quick: bool) -> None:
    """The base and its adapters, as files."""
    from linnet import nest
    from linnet.torch.lora import save_peft

    random_llama(root / "base", quick)
    for k in range(ADAPTERS):
        model = nest.load(root / "base", weights=root / "base")
        torch.manual_seed(k)
        model.add_lora("all-linear", rank=16, alpha=32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_b"):
                    p.normal_(0, 0.02)
        save_peft(model, root / f"a{k}", base_model=str(root / "base"))


def engines(root: Path):
    from linnet import nest
    from linnet.export import attach_adapter
    from linnet.serve import Engine
    from linnet.torch.adapter_bank import AdapterEngine

    merged = nest.load(root / "base", weights=root / "base")
    attach_adapter(merged, root / "a0")
    bank = AdapterEngine(nest.load(root / "base", weights=root / "base"),
                         {f"a{k}": root / f"a{k}" for k in range(ADAPTERS)})
    return Engine(merged), bank


def engine_cases(root: Path, args) -> list[list]:
    merged, bank = engines(root)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 8192, (32,), generator=g).tolist() for _ in range(16)]
    one, mixed = ["a0"] * 16, [f"a{i % ADAPTERS}" for i in range(16)]
    cases = {"merged": lambda: merged.sample(prompts, max_new_tokens=args.new, temperature=0.0, stop=()),
             "bank, one": lambda: bank.sample(prompts, adapters=one, max_new_tokens=args.new, temperature=0.0, stop=()),
             "bank, mixed": lambda: bank.sample(prompts, adapters=mixed, max_new_tokens=args.new, temperature=0.0,
                                                stop=())}
    for run in cases.values():  # warm up
        run()
    seconds: dict[str, list[float]] = {c: [] for c in cases}
    order = list(cases)
    for _ in range(args.repeats):
        for case in order:
            t0 = time.perf_counter()
            cases[case]()
            seconds[case].append(time.perf_counter() - t0)
        order.reverse()
    tokens = 16 * args.new
    rate = {c: tokens / statistics.median(s) for c, s in seconds.items()}
    return [[c, f"{rate[c]:,.0f}", f"{rate[c] / rate['bank, one']:.2f}x", f"{rate[c] / rate['merged']:.2f}x"]
            for c in cases]


def load_test(root: Path, args, join: bool) -> dict:
    import uvicorn

    from linnet.commands.serve import load_served
    from linnet.serve.server import make_app

    served = load_served(str(root / "base"), "base", {f"a{k}": str(root / f"a{k}") for k in range(ADAPTERS)})
    app, batcher = make_app(served, max_batch=16, queue=64, join=join)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/completions"
    models = ["base"] + [f"a{k}" for k in range(ADAPTERS)]
    latencies: list[float] = []
    completion_tokens = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(args.requests):
            start = 100 + 32 * (c * args.requests + i)
            prompt = " ".join(f"t{t}" for t in range(start, start + 32))
            body = json.dumps({"model": models[(c + i) % len(models)], "prompt": prompt,
                               "max_tokens": 8 * (1 + (3 * c + i) % 8), "temperature": 0}).encode()
            t0 = time.perf_counter()
            with urllib.request.urlopen(urllib.request.Request(url, body, {"content-type": "application/json"})) as r:
                answer = json.loads(r.read())
            with lock:
                latencies.append(time.perf_counter() - t0)
                completion_tokens[0] += answer["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    clients = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    wall = time.perf_counter() - t0
    server.should_exit = True
    thread.join()
    ordered = sorted(latencies)
    return {"requests": len(ordered), "p50": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "tokens_per_s": completion_tokens[0] / wall,
            "wall": wall, "batches": statistics.mean(batcher.batches) if batcher.batches else 0.0,
            "joined": batcher.joined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new", type=int, default=64, help="new tokens a prompt in the engine cases")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="requests a client sends")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/serve.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, args.quick)
        rows = engine_cases(root, args)
        loads = {True: [], False: []}
        for r in range(args.repeats):
            for join in (True, False) if r % 2 == 0 else (False, True):
                loads[join].append(load_test(root, args, join))
    lines = [
        "# Many adapters on one base",
        "",
        f"`{command(__file__)}` on {machine()}, {time.strftime('%Y-%m-%d')}, {args.threads} threads; "
        f"{'a 2-layer' if args.quick else 'a 4-layer ~7M-parameter'} Llama with {ADAPTERS} LoRA adapters (rank 16, every "
        f"linear layer), float32.",
        "",
        f"## One engine call: 16 prompts of 32 tokens, {args.new} new tokens each, greedy "
        f"(median of {args.repeats}, alternating)",
        "",
        *table(["case", "tokens/s", "vs bank, one", "vs merged"], rows, "lrrr"),
        "",
        f"## linnet serve: {args.clients} clients x {args.requests} requests, 8 to 64 new tokens each, "
        f"base and adapters in turn (median of {args.repeats}, alternating)",
        "",
        *table(["requests join a running batch", "requests", "latency p50", "latency p99", "completion tokens/s",
                "requests a batch", "joined"],
               [["yes" if join else "no", runs[0]["requests"], *(f"{statistics.median(r[k] for r in runs):.2f} s"
                                                                  for k in ("p50", "p99")),
                 f"{statistics.median(r['tokens_per_s'] for r in runs):,.0f}",
                 f"{statistics.median(r['batches'] for r in runs):.1f}",
                 f"{statistics.median(r['joined'] for r in runs):.0f}"] for join, runs in loads.items()], "lrrrrrr"),
    ]
    write_report("\n".join(lines) + "\n", args.out, keep=KEEP)


if __name__ == "__main__":
    main()
