"""`linnet pretrain`: pretrain a Llama decoder from a token cache (linnet.pretrain.runner),
with epoch validation, checkpoint policies and exact resume.

    linnet prepare  --config configs/pretrain-tiny-cpu.yaml
    linnet pretrain --config configs/pretrain-tiny-cpu.yaml
    linnet pretrain --config runs/tiny/config.yaml --resume     # continue from the latest checkpoint
    linnet pretrain --config runs/tiny/config.yaml --resume runs/tiny/epoch-010.pt \\
        --set runtime.output_dir=runs/tiny-branch                # branch from epoch 10's snapshot
    linnet pretrain --config runs/tiny/config.yaml --resume-from runs/tiny/checkpoints/step-00000480 \\
        --set runtime.output_dir=runs/tiny-branch                # the same, by its step directory
    linnet pretrain --config a.yaml --config b.yaml      # run (or finish) several experiments
    linnet pretrain --config a.yaml --plan               # the budget table, no training
    torchrun --nproc_per_node 2 -m linnet.cli pretrain --config configs/pretrain-tiny-cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from linnet.commands.spellings import parse_with_config
from linnet.config import PretrainConfig, load, template
from linnet.files import checkpoints as layout
from linnet.pretrain.runner import CHECKPOINTS, plan, run
from linnet.report.tables import print_table
from linnet.run import Preempted, stop_after_a_step
from linnet.torch.distributed import process_group, world


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linnet pretrain", description="Pretrain a Llama decoder from a token cache.")
    p.add_argument("--config", action="append", default=[],
                   help="YAML config (repeat to run several experiments in turn)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. training.epochs=4 (repeatable)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="CKPT",
                   help="alone: continue the run in runtime.output_dir from its latest checkpoint (what running a "
                        "config whose run is incomplete does anyway); with CKPT, as seed 002 writes it: the same "
                        "as --resume-from CKPT")
    p.add_argument("--resume-from", metavar="CKPT",
                   help="continue from this snapshot: RUN/epoch-NNN.pt or RUN/final.pt (seed 002's names), a "
                        "checkpoints/step-… directory, or a run directory's latest; into runtime.output_dir: the "
                        "same run, or a branch in a fresh one")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in runtime.output_dir (once the new run takes its first update)")
    p.add_argument("--plan", action="store_true", help="print the budget and exit")
    p.add_argument("--template", action="store_true", help="print every field with its default and help")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cli = parser()
    args = parse_with_config(cli, argv)
    if args.template:
        print(template(PretrainConfig))
        return 0
    paths = args.config or ([None] if args.set else [])
    if not paths:
        cli.error("give --config FILE (and/or --set KEY=VALUE); --template shows the fields")
    named = args.resume if isinstance(args.resume, str) else None  # `--resume CKPT`, the seed's spelling
    if named and args.resume_from:
        cli.error(f"--resume {named} and --resume-from {args.resume_from}: give one checkpoint")
    resume_from = named or args.resume_from
    if resume_from and len(paths) > 1:
        cli.error(f"{'--resume' if named else '--resume-from'} CKPT takes one --config")
    if args.overwrite and args.resume is True:
        cli.error("--resume continues the run in runtime.output_dir and --overwrite replaces it; give one")
    with process_group(), stop_after_a_step():  # under torchrun; SIGTERM stops after the step in progress
        for path in paths:
            config = load(PretrainConfig, path, args.set)
            if args.plan:
                rows = plan(config)
            else:
                try:
                    # --resume alone is the runner's own default: an incomplete run in runtime.output_dir
                    # continues from its latest checkpoint; --resume CKPT or --resume-from CKPT names it
                    summary = run(config, resume=resume_from, overwrite=args.overwrite)
                except KeyboardInterrupt:
                    found = layout.checkpoints(Path(config.runtime.output_dir) / CHECKPOINTS)
                    where = f"the latest checkpoint is {found[-1]}; " if found else "no training state was kept; "
                    print(f"linnet pretrain: interrupted; {where}running the same command resumes the run",
                          file=sys.stderr)
                    return 130
                except Preempted as stopped:
                    kept = f"its state is in {stopped.checkpoint}" if stopped.checkpoint else "no training state is kept"
                    print(f"linnet pretrain: stopped by SIGTERM after update {stopped.step}; {kept}; running the "
                          "same command resumes the run", file=sys.stderr)
                    return 143
                rows = [(k, json.dumps(v) if isinstance(v, dict) else str(v)) for k, v in summary.items()]
            if world()[0] == 0:
                print_table(rows)
    return 0
