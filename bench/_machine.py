"""What every bench report says about where it ran (the machine, the code) and how it is
written out."""

from __future__ import annotations

import os
import platform
import subprocess

GiB = 1 << 30


def machine() -> str:
    """The CPU model (marked when it has AMX-BF16), CPU count and memory."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        amx = "amx_bf16" in out
    except (OSError, StopIteration):
        model, amx = platform.processor(), False
    with open("/proc/meminfo") as f:
        mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    return f"{model}{' (AMX-BF16)' if amx else ''}, {os.cpu_count()} CPUs, {mem / GiB:.0f} GiB RAM"


def revision(path: str) -> str:
    """The checkout's commit, marked when `path` (from the repository root) has local changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", path], capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return "unknown revision"
    return f"{head}{f' + local changes to {os.path.basename(path)}' if dirty else ''}" if head else "unknown revision"


def write_report(text: str, out: str) -> None:
    """Print the report, and write it to `out` unless that is '-'."""
    print()
    print(text)
    if out != "-":
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}")
