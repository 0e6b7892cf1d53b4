"""The GPU check: everything linnet does only on CUDA, and its speed there, in one run on one
GPU (under 9 minutes), written to bench/GPU.md with the device and absolute numbers.

    python bench/gpu_check.py                  # on a CUDA machine: bench/GPU.md (+ GPU_compare.md, GPU_generate.md)
    python bench/gpu_check.py --out DIR/GPU.md # the three reports in DIR instead
    python bench/gpu_check.py --dry-run        # on a CPU: the same plumbing on tiny models, print only

On a machine with no package registry whose Python has torch, transformers and peft but not
TRL, `bench/gpu_wheels.sh` (run where pip works) saves what TRL adds to .whl/; its header
gives the command that installs them there and runs this check. The report is rewritten
after every step, so a run stopped at a time limit keeps the steps it finished.

Steps, each in its own process with its own time limit (a failure is recorded, the rest run):
  1. the CUDA-only tests (tests/test_cuda.py: varlen attention, the pinned-memory loader,
     bf16 and compile="inductor" training, packed decentralized workers, fully_shard over
     NCCL in one process, the compiled engine with CUDA graphs against the eager one);
  2. SFT-LoRA, DPO and GRPO against TRL on a ~1.1B Llama-shaped random model at 4096 tokens,
     bf16 (bench/compare.py --device cuda --size 1b): step time, tokens/s, peak GPU memory,
     ratios;
  3. the Engine, eager and compiled, against transformers' `generate` (bench/generate.py
     --device cuda --compile), batch 32 x 64 new tokens.
--dry-run swaps in tiny models, CPU and one step or case each, and writes nowhere (unless
--out is given): the test suite runs it to keep the script working between runs on a GPU.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def steps(dry: bool, scratch: Path, reports: Path) -> list[tuple[str, list[str], int, Path | None]]:
    """(name, command, time limit in seconds, report the command writes). The limits add up to
    9 minutes, so the check fits in a 10-minute command with the machine's warm-up."""
    py = sys.executable
    if dry:
        return [
            ("CUDA-only tests", [py, "-m", "pytest", "-q", str(ROOT / "tests" / "test_cuda.py")], 120, None),
            ("SFT-LoRA against TRL", [py, str(HERE / "compare.py"), "--smoke", "--device", "cpu"], 240, None),
            ("Engine against generate", [py, str(HERE / "generate.py"), "--quick", "--dtypes", "float32",
                                         "--repeats", "1", "--new", "4", "--out", str(scratch / "generate.md")],
             120, scratch / "generate.md"),
        ]
    return [
        ("CUDA-only tests (and vLLM's, where it is installed)",
         [py, "-m", "pytest", "-q", "-rs", str(ROOT / "tests" / "test_cuda.py"), str(ROOT / "tests" / "test_vllm.py")],
         150, None),
        ("SFT-LoRA, DPO and GRPO against TRL (1.1B, 4096 tokens, bf16)",
         [py, str(HERE / "compare.py"), "--device", "cuda", "--size", "1b", "--dtype", "bf16", "--method", "sft-lora",
          "dpo", "grpo", "--steps", "4", "--out", str(reports / "GPU_compare.md")], 270, reports / "GPU_compare.md"),
        ("Engine against generate (batch 32 x 64 new tokens)",
         [py, str(HERE / "generate.py"), "--device", "cuda", "--batch", "32", "--new", "64", "--repeats", "2",
          "--compile", "--out", str(reports / "GPU_generate.md")], 120, reports / "GPU_generate.md"),
    ]


def device_line(dry: bool) -> str:
    import torch

    if dry or not torch.cuda.is_available():
        return "dry run on the CPU (no CUDA device)"
    p = torch.cuda.get_device_properties(0)
    return (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}")


def packages() -> str:
    """The versions the steps ran with (the machine's own or carried wheels), or "missing"."""
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} missing"

    return ", ".join(one(n) for n in ("transformers", "trl", "peft", "datasets", "accelerate", "vllm"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, print only: checks the plumbing")
    ap.add_argument("--out", help="the report (default bench/GPU.md; with --dry-run, none); the steps' own "
                                  "reports go beside it")
    args = ap.parse_args(argv)
    import tempfile

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench/gpu_check.py: no CUDA device here; run it on a GPU machine, or --dry-run to check the script")
    out = Path(args.out) if args.out else (None if args.dry_run else HERE / "GPU.md")
    lines = ["# The GPU check", "", "Produced by `bench/gpu_check.py`; numbers are measured, not edited.", "",
             f"- Device: {device_line(args.dry_run)}", f"- Packages: {packages()}", ""]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="linnet-gpu-check-") as tmp:
        for name, command, limit, report in steps(args.dry_run, Path(tmp), HERE if out is None else out.parent):
            t0 = time.perf_counter()
            try:
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit)
                status, text = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as e:
                status, text = "timeout", f"stopped after {limit} s\n" + (e.stdout or b"").decode(errors="replace")
            seconds = time.perf_counter() - t0
            failed += status != 0
            print(f"{name}: {'ok' if status == 0 else f'FAILED ({status})'} in {seconds:.0f} s", flush=True)
            lines += [f"## {name}", "", f"`{' '.join(Path(c).name if '/' in c else c for c in command)}` "
                      f"-> {'ok' if status == 0 else f'**failed ({status})**'} in {seconds:.0f} s", ""]
            if report is not None and report.is_file():
                lines += [report.read_text().split("<!--")[0].strip(), ""]
            lines += ["```", "\n".join(text.strip().splitlines()[-15:]), "```", ""]
            if out is not None:
                out.write_text("\n".join(lines) + "\n")
    if out is not None:
        print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
