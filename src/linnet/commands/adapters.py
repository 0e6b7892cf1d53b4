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
`linnet.commands.dpo.run`) in a greenlet of its own, all on the process's one thread; they
take turns (`Turns`), a step each, and the base carries only that run's adapters while it does
(`linnet.torch.lora.take_adapters` / `put_adapters`) and draws from that run's generators.
So every row runs the base once, with its own adapter's product alone, and each run keeps
its own optimizer state, checkpoints, metrics.jsonl, summary and PEFT export in final/,
equal to the run it would have been alone (tests/test_adapters.py). Every run reads and
checks its data and run directory before any of them writes anything.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from linnet.commands import runs
from linnet.commands.spellings import parse_with_config
from linnet.config import load_any
from linnet.config.fields import flatten, read_yaml
from linnet.report.tables import print_table

# one base: what every adapter's config must give alike
SHARED = ("model", "runtime.device", "runtime.threads", "runtime.deterministic", "training.activation_checkpointing",
          "training.mlp_tile", "training.shard")
ALONE = {"training.split": 1, "training.pipeline": 1, "training.context": 1}  # one process holds the whole base


class Stopped(Exception):
    """Thrown into the runs still waiting for a turn when another failed before anything was
    written, or was interrupted (Ctrl-C)."""


@dataclass
class Tenant:
    """One adapter's run over the shared base: what the command's run takes as `tenant=`
    (linnet.commands.runs.Job loads its model and reports its steps through it). Its run
    computes in a greenlet of its own, on the process's one thread (a thread of its own
    would compute at two thirds of the speed: each thread has its own OpenMP team)."""

    name: str
    config: Any
    turns: Turns
    slot: dict | None = None  # its adapters while another run computes (take_adapters)
    rng: dict | None = None  # its generators' state while another run computes
    grad: bool = True  # its autograd mode (a thread's, so every greenlet's)
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
        rt = config.runtime
        start_runtime(rt.seed, threads=rt.threads, deterministic=rt.deterministic)
        model = self.turns.base
        add_lora(model, **runs.lora_options(config))
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
        """Its adapters off the base and its generators' state kept, for the next run's turn."""
        from linnet.torch.lora import take_adapters
        from linnet.train.checkpoint import rng_state

        self.rng, self.grad = rng_state(), torch.is_grad_enabled()
        if self.turns.base is not None and self.turns.base.lora:
            self.slot = take_adapters(self.turns.base)

    def enter(self) -> None:
        from linnet.torch.lora import put_adapters
        from linnet.train.checkpoint import set_rng_state

        if self.rng is not None:
            set_rng_state(self.rng)
        torch.set_grad_enabled(self.grad)
        if self.slot is not None:
            put_adapters(self.turns.base, self.slot)
            self.slot = None


@dataclass
class Turns:
    """The runs take turns, in order: a run computes until it passes the turn on (its first
    turn reads and checks its inputs; its second loads and opens its run; each later one
    is one step), then the next unfinished run does. The base, the model, goes with the turn."""

    base: Any = None
    scheduler: Any = None  # the greenlet the runs pass their turns back to

    def pass_on(self, tenant: Tenant) -> None:
        """Hand the turn on and wait for it back."""
        tenant.leave()
        self.scheduler.switch()
        tenant.enter()


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
        flat = flatten(to_dict(config))
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


def run(adapters: list[tuple[str | None, Any]], *, overwrite: bool = False, resume: bool = False) -> list[Tenant]:
    """Train every adapter (name or None, its sft or dpo config) over one base, a step each
    in turn; returns the Tenants, each with its summary or its error. An error before any
    run has written anything (bad data, an existing run directory) stops them all and is
    raised; a later one ends its own run alone."""
    from linnet.commands import dpo, sft

    try:
        from greenlet import getcurrent, greenlet
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("linnet adapters needs greenlet: pip install 'linnet[adapters]'") from e

    turns = Turns(scheduler=getcurrent())
    tenants = [Tenant(name, config, turns) for name, config in check(adapters)]
    commands = {"sft": sft.run, "dpo": dpo.run}

    def work(tenant: Tenant) -> None:
        try:
            tenant.summary = commands[tenant.config.command](tenant.config, overwrite=overwrite, resume=resume,
                                                             tenant=tenant)
        except BaseException as error:  # noqa: BLE001 - reported by the caller, with the run's name
            tenant.error = error
        tenant.leave()  # a run that failed mid-step leaves the base clean for the next

    runners = {t.name: greenlet(work) for t in tenants}
    while not all(r.dead for r in runners.values()):
        for tenant in tenants:
            if runners[tenant.name].dead:
                continue
            runners[tenant.name].switch(tenant)  # its turn: until it passes the turn on, or ends
            early = tenant.error is not None and not tenant.started
            if early or isinstance(tenant.error, KeyboardInterrupt):
                for runner in runners.values():  # the others end where they wait: nothing written when early
                    if runner:
                        runner.throw(Stopped())
                if early and isinstance(tenant.error, (ValueError, OSError)):  # named with its adapter
                    raise ValueError(f"adapter {tenant.name!r}: {tenant.error}") from tenant.error
                raise tenant.error
    return tenants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="linnet adapters", description="Train several LoRA adapters over one frozen base in one process, each "
        "from its own linnet sft or linnet dpo config, a step each in turn; each writes its own run directory.")
    parser.add_argument("--config", required=True, help="a YAML file listing the adapters' configs (adapters: [...])")
    parser.add_argument("--overwrite", action="store_true", help="replace the runs in their output directories")
    parser.add_argument("--resume", action="store_true", help="continue each run from its latest checkpoint")
    args = parse_with_config(parser, argv)
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
