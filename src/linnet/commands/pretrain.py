"""`linnet pretrain`: pretrain a Llama decoder from a token cache (linnet.pretrain.runner),
with epoch validation, checkpoint policies and exact resume.

    linnet prepare  --config configs/pretrain-tiny-cpu.yaml
    linnet pretrain --config configs/pretrain-tiny-cpu.yaml
    linnet pretrain --config runs/tiny/config.yaml --resume runs/tiny/checkpoints/step-00000480 \\
        --set runtime.output_dir=runs/tiny-branch
    linnet pretrain --config a.yaml --config b.yaml      # run (or finish) several experiments
    linnet pretrain --config a.yaml --plan               # the budget table, no training
    torchrun --nproc_per_node 2 -m linnet.cli pretrain --config configs/pretrain-tiny-cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from linnet.config import PretrainConfig, load, template
from linnet.files import checkpoints as layout
from linnet.pretrain.runner import CHECKPOINTS, plan, run
from linnet.report.tables import print_table
from linnet.torch.distributed import process_group, world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linnet pretrain", description="Pretrain a Llama decoder from a token cache.")
    parser.add_argument("--config", action="append", default=[],
                        help="YAML config (repeat to run several experiments in turn)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. training.epochs=4 (repeatable)")
    parser.add_argument("--resume", metavar="CKPT", help="a checkpoints/step-… directory (or a run directory)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run in runtime.output_dir (once the new run takes its first update)")
    parser.add_argument("--plan", action="store_true", help="print the budget and exit")
    parser.add_argument("--template", action="store_true", help="print every field with its default and help")
    args = parser.parse_args(argv)
    if args.template:
        print(template(PretrainConfig))
        return 0
    paths = args.config or ([None] if args.set else [])
    if not paths:
        parser.error("give --config FILE (and/or --set KEY=VALUE); --template shows the fields")
    if args.resume and len(paths) > 1:
        parser.error("--resume takes one --config")
    with process_group():  # under torchrun
        for path in paths:
            config = load(PretrainConfig, path, args.set)
            if args.plan:
                rows = plan(config)
            else:
                try:
                    summary = run(config, resume=args.resume, overwrite=args.overwrite)
                except KeyboardInterrupt:
                    found = layout.checkpoints(Path(config.runtime.output_dir) / CHECKPOINTS)
                    where = f"the latest checkpoint is {found[-1]}; " if found else "no training state was kept; "
                    print(f"linnet pretrain: interrupted; {where}running the same command resumes the run",
                          file=sys.stderr)
                    return 130
                rows = [(k, json.dumps(v) if isinstance(v, dict) else str(v)) for k, v in summary.items()]
            if world()[0] == 0:
                print_table(rows)
    return 0
