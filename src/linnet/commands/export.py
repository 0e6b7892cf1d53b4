"""`linnet export`: a trained model as a merged Hugging Face directory (with a model card), a
PEFT adapter, and/or a GGUF file for llama.cpp; optionally pushed to the Hub.

    linnet export runs/sft --out exports/sft --merge --dtype bf16
    linnet export runs/sft --out exports/sft --merge --gguf q8_0     # or f16, q4_0, q4_k_m, ...
    linnet export runs/sft --out exports/sft --merge --push me/my-model
"""

from __future__ import annotations

import argparse
from pathlib import Path

from linnet.export.gguf_file import KINDS as GGUF_KINDS

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="linnet export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a run directory (its final/), a model directory or a PEFT adapter directory")
    p.add_argument("--out", required=True, help="the export directory (new or empty)")
    p.add_argument("--merge", action="store_true",
                   help="fold LoRA/DoRA adapters into the base and write a whole model (otherwise an adapter "
                        "run is exported as its PEFT adapter)")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32", help="weights of the exported model (default f32)")
    p.add_argument("--gguf", choices=list(GGUF_KINDS), metavar="KIND",
                   help="also write model-KIND.gguf for llama.cpp (merges first): f32, f16, q8_0, q5_1, q5_0, q4_1, "
                        "q4_0; q4_k_m, q5_k_m, q6_k through llama.cpp's quantizer (needs llama-cpp-python)")
    p.add_argument("--push", metavar="REPO", help="upload the export to this Hugging Face Hub repository")
    return p


def run(args) -> Path:
    from linnet.export import export_directory, load_trained, plan_gguf
    from linnet.export.gguf_file import written_types
    from linnet.files.atomic import check_writable

    out = Path(args.out)
    check_writable(out, "--out")  # a file, under a file, read-only
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty; export into a new directory")
    model, about = load_trained(args.source)  # every input is read and checked before anything is written
    plan = plan_gguf(model, args.gguf) if args.gguf else None
    export_directory(model, out, about=about, merge=args.merge or args.gguf is not None, dtype=DTYPES[args.dtype],
                     gguf=args.gguf, plan=plan)  # written beside --out and renamed: never half-written
    if plan is not None:
        counts = written_types(out / f"model-{args.gguf}.gguf")
        print(f"model-{args.gguf}.gguf: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items())) + " tensors"
              + (f"; {len(plan.fallbacks)} kept wider because their rows do not divide into blocks "
                 f"({plan.fallbacks[0]}{', ...' if len(plan.fallbacks) > 1 else ''})" if plan.fallbacks else ""))
    if args.push:
        push(out, args.push)
    return out


def push(folder: Path, repo: str) -> None:
    """Upload `folder` to the Hub repository `repo` (created if missing)."""
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(folder))
    except Exception as e:  # offline, no token, no rights: one line, the export stays
        raise ValueError(f"--push {repo}: the upload failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                         f"the export in {folder} is complete, push it later with huggingface-cli upload") from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = run(args)
    print(f"exported to {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return 0
