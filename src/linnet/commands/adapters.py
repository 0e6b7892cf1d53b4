"""`linnet adapters`: several LoRA adapters trained in one process over one frozen base,
each from its own `linnet sft` or `linnet dpo` config (its data, rank, targets, learning
rate, schedule, steps and run directory), each the run it would have been alone.

    linnet adapters --config tenants.yaml

    # tenants.yaml
    adapters:
      - configs/legal.yaml                    # a linnet sft config (lora.enabled)
      - config: configs/support.yaml          # a linnet dpo config
        set: [optimizer.lr=5e-5]              # overrides, as --set gives them
        name: support                         # default: its run directory's name

The base loads once. Each adapter's run is the ordinary command (`linnet.commands.sft.run`,
`linnet.commands.dpo.run`) on a thread of its own; `Turns` lets one of them compute at a
time, a step each in turn, and the base carries only that run's adapters while it does
(`linnet.torch.lora.take_adapters` / `put_adapters`) and draws from that run's generators.
So every row runs the base once, with its own adapter's product alone, and each run keeps
its own optimizer state, checkpoints, metrics.jsonl, summary and PEFT export in final/,
equal to the run it would have been alone (tests/test_adapters.py). Every run reads and
checks its data and run directory before any of them writes anything.
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from linnet.commands import runs
from linnet.config import load_any
from linnet.config.fields import read_yaml
from linnet.report.tables import print_table

# one base: what every adapter's config must give alike
SHARED = ("model", "runtime.device", "runtime.threads", "runtime.deterministic", "training.activation_checkpointing",
          "training.mlp_tile", "training.shard")
ALONE = {"training.split": 1, "training.pipeline": 1, "training.context": 1}  # one process holds the whole base


class Stopped(Exception):
    """Another adapter's run failed before any run wrote anything, or the command was
    interrupted: this run stops where it waits."""


@dataclass
class Tenant:
    """One adapter's run over the shared base: what the command's run takes as `tenant=`
    (linnet.commands.runs.Job loads its model and reports its steps through it)."""

    name: str
    config: Any
    turns: Turns
    slot: dict | None = None  # its adapters while another run computes (take_adapters)
    rng: dict | None = None  # its generators' state while another run computes
    summary: dict | None = None
    error: BaseException | None = None
    started: bool = False  # past its checks: its run directory may hold its files

    def load(self, card, config):
        """The shared base with this run's adapters: the base loads with the first run's (as
        `linnet sft` loads it); later runs add theirs to it, drawn from their own seed."""
        from linnet.torch.lora import add_lora
        from linnet.train.loop import start_runtime

        self.turns.pass_on(self)  # everything read and checked: the others check theirs before anything is written
        self.started = True
        if self.turns.base is None:
            self.turns.base = runs.load_model(card, config)
            return self.turns.base
        rt, lora = config.runtime, config.lora
        start_runtime(rt.seed, threads=rt.threads, deterministic=rt.deterministic)
        model = self.turns.base
        add_lora(model, lora.targets, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, rslora=lora.rslora,
                 dora=lora.dora)
        print(f"{self.name}: {sum(p.numel() for p in model.parameters() if p.requires_grad):,} adapter parameters "
              "over the shared base", file=sys.stderr)
        return model

    def stepped(self, on_step):
        """`on_step` (the run's metrics log), then the next run's turn."""

        def after(step):
            on_step(step)
            self.turns.pass_on(self)

        return after

    def leave(self) -> None:
        from linnet.torch.lora import take_adapters
        from linnet.train.checkpoint import rng_state

        self.rng = rng_state()
        if self.turns.base is not None and self.turns.base.lora:
            self.slot = take_adapters(self.turns.base)

    def enter(self) -> None:
        from linnet.torch.lora import put_adapters
        from linnet.train.checkpoint import set_rng_state

        if self.rng is not None:
            set_rng_state(self.rng)
        if self.slot is not None:
            put_adapters(self.turns.base, self.slot)
            self.slot = None


@dataclass
class Turns:
    """One run computes at a time: each waits for its turn, takes one step (the first turn:
    reads and checks its inputs; the second: loads and opens its run), and passes the turn
    to the next unfinished run. The base, its model, goes with the turn."""

    tenants: list[Tenant] = field(default_factory=list)
    base: Any = None
    current: int = 0
    stopped: bool = False
    finished: set = field(default_factory=set)
    ready: threading.Condition = field(default_factory=threading.Condition)

    def wait(self, tenant: Tenant) -> None:
        """Until `tenant`'s turn; then the base carries its adapters. Raises Stopped once
        the runs are stopped."""
        with self.ready:
            self.ready.wait_for(lambda: self.stopped or self.tenants[self.current] is tenant)
            if self.stopped:
                raise Stopped("stopped before its turn")
        tenant.enter()

    def pass_on(self, tenant: Tenant, *, finished: bool = False) -> None:
        """Hand the turn to the next unfinished run (its adapters off the base, its generators'
        state kept) and, unless `finished`, wait for it back. A run stopped while waiting
        holds no turn and passes none."""
        with self.ready:
            mine = self.tenants[self.current] is tenant and not self.stopped
            if mine:
                tenant.leave()
            if finished:
                self.finished.add(tenant.name)
            if mine:
                n = len(self.tenants)
                following = [self.tenants[(self.current + k) % n] for k in range(1, n + 1)]
                self.current = next((self.tenants.index(t) for t in following if t.name not in self.finished),
                                    self.current)
                self.ready.notify_all()
        if not finished:
            self.wait(tenant)

    def stop(self) -> None:
        """Every run stops where it next waits for its turn (the one computing ends its step first)."""
        with self.ready:
            self.stopped = True
            self.ready.notify_all()


def read_list(path: str) -> list[tuple[str | None, Any]]:
    """(name or None, config) of each adapter a list file names (see the module docstring)."""
    data, _ = read_yaml(path)
    entries = data.get("adapters") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: adapters: give a list of the adapters' config files (each an entry, or "
                         "{config: FILE, set: [KEY=VALUE, ...], name: NAME})")
    out = []
    for i, entry in enumerate(entries):
        entry = {"config": entry} if isinstance(entry, str) else entry
        unknown = set(entry) - {"config", "set", "name"} if isinstance(entry, dict) else {"?"}
        if unknown or not isinstance(entry.get("config"), str):
            raise ValueError(f"{path}: adapters[{i}]: an entry is a config file, or {{config: FILE, set: [...], "
                             f"name: NAME}}" + (f"; unknown keys {sorted(unknown)}" if unknown - {"?"} else ""))
        out.append((entry.get("name"), load_any(entry["config"], [str(s) for s in entry.get("set") or []])))
    return out


def check(adapters: list[tuple[str | None, Any]]) -> list[tuple[str, Any]]:
    """(name, config) of each adapter, refusing what one shared base cannot train: a command
    other than sft or dpo, full fine-tuning, configs whose shared fields differ, a repeated
    name or run directory, more than one process."""
    from linnet.config import to_dict
    from linnet.torch.distributed import world

    if world()[1] > 1:
        raise ValueError("linnet adapters trains in one process; run it without torchrun")
    named, first = [], None
    for name, config in adapters:
        name = name or Path(config.runtime.output_dir).name
        where = f"adapter {name!r}"
        if config.command not in ("sft", "dpo"):
            raise ValueError(f"{where}: a {config.command} config; linnet adapters trains sft and dpo runs")
        if not config.lora.enabled:
            raise ValueError(f"{where}: lora.enabled is false; adapters share a frozen base, so each run trains "
                             "LoRA (or DoRA) adapters: set lora.enabled=true")
        if config.command == "dpo" and config.dpo.online:
            raise ValueError(f"{where}: dpo.online samples with an engine of its own; train it with linnet dpo")
        flat = _flat(to_dict(config))
        for key, value in ALONE.items():
            if flat.get(key, value) != value:
                raise ValueError(f"{where}: {key}={flat[key]}; one process holds the shared base: set {key}={value}")
        if first is None:
            first = (name, flat)
        for key in SHARED:
            mine = {k: v for k, v in flat.items() if k == key or k.startswith(key + ".")}
            theirs = {k: v for k, v in first[1].items() if k == key or k.startswith(key + ".")}
            if mine != theirs:
                differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
                raise ValueError(f"{where}: {differ[0]}={mine.get(differ[0])!r}, but {first[0]!r} has "
                                 f"{theirs.get(differ[0])!r}; the adapters share one base, so {key} must be alike")
        if flat.get("model.weights") == "random" and flat["runtime.seed"] != first[1]["runtime.seed"]:
            raise ValueError(f"{where}: model.weights is random, drawn from runtime.seed: give every adapter "
                             f"{first[0]!r}'s runtime.seed={first[1]['runtime.seed']}")
        named.append((name, config))
    for what, values in (("name", [n for n, _ in named]),
                         ("runtime.output_dir", [str(Path(c.runtime.output_dir).resolve()) for _, c in named])):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"adapters: {what} {repeated[0]} is given twice; each adapter is a run of its own")
    return named


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run(adapters: list[tuple[str | None, Any]], *, overwrite: bool = False, resume: bool = False) -> list[Tenant]:
    """Train every adapter (name or None, its sft or dpo config) over one base, a step each
    in turn; returns the Tenants, each with its summary or its error. An error before any
    run has written anything (bad data, an existing run directory) stops them all and is
    raised; a later one ends its own run alone."""
    from linnet.commands import dpo, sft

    turns = Turns()
    turns.tenants = [Tenant(name, config, turns) for name, config in check(adapters)]
    commands = {"sft": sft.run, "dpo": dpo.run}
    threads = torch.get_num_threads()  # a new thread starts with OpenMP's default, not this thread's setting

    def work(tenant: Tenant) -> None:
        torch.set_num_threads(threads)
        try:
            turns.wait(tenant)
            tenant.summary = commands[tenant.config.command](tenant.config, overwrite=overwrite, resume=resume,
                                                             tenant=tenant)
        except BaseException as error:  # noqa: BLE001 - reported by the caller, with the run's name
            tenant.error = error
            if not tenant.started:
                turns.stop()
        finally:  # its adapters off the base (a run that failed mid-step too), the turn to the next
            turns.pass_on(tenant, finished=True)

    workers = [threading.Thread(target=work, args=(t,), name=f"adapter {t.name}", daemon=True)
               for t in turns.tenants]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            while worker.is_alive():
                worker.join(0.5)
    except KeyboardInterrupt:
        turns.stop()  # the run computing ends its step; none starts another
        for worker in workers:
            worker.join()
        raise
    early = [t for t in turns.tenants if t.error is not None and not isinstance(t.error, Stopped) and not t.started]
    if early:  # nothing was written: said as the one error, with the adapter it belongs to
        error = early[0].error
        if isinstance(error, (ValueError, OSError)):
            raise ValueError(f"adapter {early[0].name!r}: {error}") from error
        raise error
    return turns.tenants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="linnet adapters", description="Train several LoRA adapters over one frozen base in one process, each "
        "from its own linnet sft or linnet dpo config, a step each in turn; each writes its own run directory.")
    parser.add_argument("--config", required=True, help="a YAML file listing the adapters' configs (adapters: [...])")
    parser.add_argument("--overwrite", action="store_true", help="replace the runs in their output directories")
    parser.add_argument("--resume", action="store_true", help="continue each run from its latest checkpoint")
    args = parser.parse_args(argv)
    from linnet.run import Preempted, stop_after_a_step

    with stop_after_a_step():
        try:
            tenants = run(read_list(args.config), overwrite=args.overwrite, resume=args.resume)
        except KeyboardInterrupt:
            print("linnet adapters: interrupted; the same command with --resume continues every run from its "
                  "latest checkpoint", file=sys.stderr)
            return 130
    rows, status = [], 0
    for t in tenants:
        if isinstance(t.error, Preempted):
            rows.append((t.name, f"stopped by SIGTERM after step {t.error.step}; --resume continues it"))
            status = status or 143
        elif t.error is not None:
            rows.append((t.name, f"failed: {t.error}"))
            status = 1
        else:
            s = t.summary
            rows.append((t.name, f"{s['steps_this_run']} steps, loss {s['first_loss']:.4g} -> {s['last_loss']:.4g}"
                                 + (f", held-out {s['held_out_loss']:.4g}" if "held_out_loss" in s else "")
                                 + f"; {s['final']}"))
    print_table(rows)
    return status
