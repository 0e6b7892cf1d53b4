"""What the bench scripts share: the machine, peak memory, a child process, the report.

The machine they ran on, peak memory (Linux), one measurement in a fresh child process, and
the markdown report they write: functions, one implementation each."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

GiB = 1 << 30

# -- the machine ---------------------------------------------------------------------------


def machine() -> str:
    """The CPU model (marked with its widest vector unit and bf16 support: these machines
    differ, and bf16 is emulated without them), CPU count, memory, OS, C library, Python
    and torch."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        have = set(out.split())
        flags = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
                                         ("amx_bf16", "AMX-BF16")) if flag in have]
        if not flags and "avx2" in have:
            flags = ["AVX2 only: bf16 emulated"]
    except (OSError, StopIteration):
        model, flags = platform.processor() or platform.machine(), []
    with open("/proc/meminfo") as f:
        mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    import torch

    marks = f" ({', '.join(flags)})" if flags else ""
    return (f"{model}{marks}, {os.cpu_count()} CPUs, {mem / GiB:.0f} GiB RAM; "
            f"{platform.system()} {platform.release()}, {'-'.join(platform.libc_ver())}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


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


def matmul_peak(dtype: str = "float32", threads: int = 1, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of torch.mm on n x n matrices on `threads` threads, best of `repeats` after two
    warm-ups (the machine is shared)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(before)
    return 2 * n**3 / best


def cpu_now() -> tuple[float, float, float]:
    """(wall, CPU seconds busy machine-wide, CPU seconds of this process and its finished
    children): two of these give `others_busy`."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    t = os.times()
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), t.user + t.system + t.children_user + t.children_system


def others_busy(before, after) -> float:
    """Fraction of the machine's CPUs other processes kept busy between two `cpu_now()`."""
    wall = after[0] - before[0]
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (wall * os.cpu_count())


def wait_quiet(limit_s: float, threshold: float = 0.15) -> float:
    """Wait (at most `limit_s`) for half a second in which other processes use under
    `threshold` of the CPUs; return the last measured fraction."""
    deadline = time.monotonic() + limit_s
    while True:
        before = cpu_now()
        time.sleep(0.5)
        busy = others_busy(before, cpu_now())
        if busy < threshold or time.monotonic() > deadline:
            return busy


# -- peak memory (Linux) ---------------------------------------------------------------------
# Read from /proc/self/status. VmHWM is what `getrusage(RUSAGE_SELF).ru_maxrss` reports for a
# live process, except that ru_maxrss also counts the parent's RSS at the fork before exec (a
# child of a large parent reads the parent's size); VmHWM can also be reset.


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    """Resident set size now, in bytes."""
    return _status("VmRSS")


def peak_rss() -> int:
    """Resident set size at its highest since the process started or `reset_peak()`."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Set the high-water mark back to the current RSS (Linux >= 4.0: clear_refs 5), so that
    nothing before this moment can hide a later peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# -- one measurement in a fresh process --------------------------------------------------------

RESULT = "RESULT "


def send_result(result: dict) -> None:
    """Child side: hand `result` back to `run_child` (one line on stdout)."""
    print(RESULT + json.dumps(result), flush=True)


def run_child(args: list, env: dict | None = None) -> dict:
    """Run `python *args` in a fresh process (its memory is its own) and return what it passed
    to `send_result`, or {"error": last line of its output, "log": its output's end}. `env`
    adds to the environment; a value of None removes that variable."""
    env = None if env is None else {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT):])
    tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return {"error": f"exit {proc.returncode}: {tail[-1] if tail else '?'}",
            "log": f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"}


def random_llama(directory, quick: bool = False, eos: tuple[int, ...] = ()) -> None:
    """A random Llama saved with a word-level tokenizer ("t0" .. "t8191", one token a word):
    4 layers, hidden 256, vocabulary 8,192, ~7M parameters (quick: 2 layers, hidden 128);
    `eos`: its stop tokens (none: a completion runs to its length)."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    from linnet import nest

    directory = Path(directory)
    card = nest.Card("bench-llama", "llama", vocab=8192, hidden=128 if quick else 256,
                     intermediate=352 if quick else 704, layers=2 if quick else 4, heads=4, kv_heads=2,
                     head_dim=32 if quick else 64, max_positions=512, tied_embeddings=False, bos_token_id=None,
                     eos_token_ids=eos, pad_token_id=0, dtype="float32", source="bench")
    nest.load(card, weights="random", seed=0).save_weights(directory)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8192)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(directory / "tokenizer.json"))


# -- the report ---------------------------------------------------------------------------------


def command(script: str, argv: list[str] | None = None, env: tuple[str, ...] = ()) -> str:
    """The command line that ran `script` (a file in bench/) with `argv` (default: this
    process's arguments), after the variables of `env` that are set."""
    args = sys.argv[1:] if argv is None else argv
    prefix = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in env if k in os.environ)
    return prefix + shlex.join(["python", f"bench/{os.path.basename(script)}", *args])


def table(head: list[str], rows: list[list], align: str = "") -> list[str]:
    """A markdown table's lines; `align` has an "r" for each right-aligned column."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(head)))
    return ["| " + " | ".join(head) + " |", rule, *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


# notes written by hand under a generated report start at this line, and outlive a rerun
def alternate(script: str, specs: dict[str, dict], repeats: int, label: str = "") -> dict[str, list]:
    """{case: its results}: each case's spec run by `script --child` in a fresh process (its
    memory its own), `repeats` rounds, the cases' order reversed each round so drift
    falls on both; stops naming a case that failed. Prints each run's median step after
    the first two (and its peak memory, when the child sends one)."""
    got: dict[str, list] = {case: [] for case in specs}
    order = list(specs)
    for _ in range(repeats):
        for case in order:
            r = run_child([script, "--child", json.dumps(specs[case])])
            if "error" in r:
                raise SystemExit(f"{label}{case}: {r['error']}\n{r['log']}")
            got[case].append(r)
            peak = f"  peak {r['peak_bytes'] / GiB:4.2f} GiB" if "peak_bytes" in r else ""
            print(f"  {label}{case:10} step {statistics.median(r['seconds'][2:]):5.2f} s{peak}", flush=True)
        order.reverse()
    return got


KEEP = "<!-- everything below this line is kept when the script rewrites the file -->"


def write_report(text: str, out: str, keep: str | None = None) -> None:
    """Print the report, and write it to `out` unless that is '-'. With `keep` (a marker line)
    the report ends with the marker, followed by what followed it in the file being replaced
    (notes written by hand)."""
    if keep:
        old = ""
        if out != "-" and os.path.exists(out):
            with open(out) as f:
                old = f.read()
        text = text.rstrip("\n") + "\n\n" + (old[old.index(keep):] if keep in old else keep + "\n")
    print()
    print(text)
    if out != "-":
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}")
