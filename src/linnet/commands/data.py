"""`linnet data check`: held-out records that repeat training records, exact and near
duplicates (linnet.data.overlap), listed pair by pair before anything trains on them.

    linnet data check train.jsonl --against test.jsonl
    linnet data check train.jsonl --against test.jsonl general.jsonl --threshold 0.8 --out leaks.jsonl

A record is compared by its question (prompt fields, a chat's user turns, a document's
text). Near duplicates need datasketch (pip install 'linnet[data]'). The exit status is 0
when nothing repeats and 3 when something does, so a script can stop on a leak.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FOUND = 3  # the exit status when held-out records repeat training ones


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linnet data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="held-out records that repeat training records")
    check.add_argument("train", help="the training records: .jsonl, .json, .parquet, a saved dataset")
    check.add_argument("--against", nargs="+", required=True, metavar="EVAL",
                       help="held-out record files checked against the training records")
    check.add_argument("--threshold", type=float, default=0.7,
                       help="the Jaccard similarity of two word sets from which they are near duplicates (default 0.7)")
    check.add_argument("--ngram", type=int, default=1,
                       help="words a shingle (default 1: a reordering is still a duplicate; 3-5 for long documents)")
    check.add_argument("--exact-only", action="store_true", help="skip the near-duplicate search")
    check.add_argument("--show", type=int, default=10, help="pairs printed a file (default 10)")
    check.add_argument("--out", metavar="PATH", help="every pair as JSON lines (a new file)")
    return p


def shorten(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    from linnet.data import read_records
    from linnet.data.overlap import overlap, question_text
    from linnet.files.atomic import check_writable, write_text

    args = parser().parse_args(argv)
    if args.out:
        out = Path(args.out)
        if out.exists():
            raise ValueError(f"--out {out}: exists; data check writes over no file: give a new path")
        check_writable(out.parent, "the --out file's folder")
    train = read_records(args.train, field="the file to check")
    held = {path: read_records(path, field="--against") for path in args.against}  # every file read before any is compared
    lines, total = [], 0
    for path, records in held.items():
        found = overlap(train, records, threshold=args.threshold, ngram=args.ngram, near=not args.exact_only)
        total += len(found.pairs)
        near = f", {found.near} near" if found.near_checked and not args.exact_only else (
            "" if args.exact_only else " (near duplicates not checked: pip install datasketch)")
        print(f"{path}: {len(records):,} records, {found.exact} exact duplicates{near} of {args.train}'s "
              f"{len(train):,}")
        for j, i, similarity, exact in found.pairs[:args.show]:
            print(f"  {records[j].where} ~ {train[i].where} ({'exact' if exact else f'similarity {similarity:.2f}'})"
                  f"\n    held out: {shorten(question_text(records[j].data))}"
                  f"\n    training: {shorten(question_text(train[i].data))}")
        if len(found.pairs) > args.show:
            print(f"  ... and {len(found.pairs) - args.show} more" + (f" (all in {args.out})" if args.out else ""))
        lines += [json.dumps({"held_out": records[j].where, "training": train[i].where, "similarity": similarity,
                              "exact": exact}) + "\n" for j, i, similarity, exact in found.pairs]
    if args.out:
        write_text(args.out, "".join(lines))
    if total:
        print(f"{total} held-out record(s) repeat training ones: drop them from one side before trusting the eval",
              file=sys.stderr)
    return FOUND if total else 0
