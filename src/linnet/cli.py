"""The `linnet` command: a dispatch table over the command modules (linnet.commands), each
a thin layer over library functions.

    linnet quickstart          SFT, DPO and GRPO of a small model on an embedded task, no files needed
    linnet sft --config F      supervised fine-tuning (LoRA or full) from a YAML config
    linnet dpo --config F      preference optimization (DPO, IPO, SimPO, ORPO, KTO, ...) from a YAML config
    linnet grpo --config F     GRPO with the KV-cache engine and built-in, model or custom rewards
    linnet ppo --config F      PPO: a critic, GAE and a KL-penalised reward, with GRPO's rewards
    linnet reward --config F   a reward model (scalar head, Bradley-Terry) from preference pairs
    linnet distill --config F  a student from a frozen teacher: logit, sequence-level or on-policy
    linnet adapters --config F several LoRA adapters (sft and dpo configs) trained over one base
    linnet jax --config F      the sft run trained by the JAX backend (--fully-shard, --no-remat)
    linnet inspect --config F  examples, pairs or prompts as they are learned or sampled; the batch table
    linnet prepare --config F  tokenize a corpus into a checksummed shard cache (--verify)
    linnet pretrain --config F pretrain from a token cache: budgets, epochs, exact resume
    linnet generate CARD --prompt T   stream a completion (KV-cache engine)
    linnet export RUN --out D  a merged Hugging Face directory with a model card, a PEFT adapter, GGUF
    linnet eval RUN --data F   held-out loss, perplexity, exact match / reward / pass@k, samples;
                               several models compared with intervals and a paired test
    linnet data check TRAIN --against EVAL   held-out records that repeat training ones (exact, near)
    linnet serve MODEL         an OpenAI-compatible HTTP server (--adapter NAME=DIR for each tenant)
    linnet plan CARD ...       memory, FLOPs, GPU-hours and cost before a run (--config F: a run's)
    linnet plot RUN_DIR        curves.png from a run's metrics.jsonl
    linnet info CARD           the card, parameter counts, memory of a bf16 copy

`linnet --quiet COMMAND …` (or --quiet anywhere) turns progress bars off; they are off anyway
when the output is not a terminal. `linnet --version` prints linnet's version.

Exit status: 0 done; 1 training stopped on a non-finite loss or gradient; 2 refused input
(one line naming the file, the field and the fix; nothing was written) or a write that
failed (a full disk: one line naming the file; no temporary file is left); 3 `data check`
found held-out records that repeat training ones; 130 interrupted by Ctrl-C, 143 stopped by
SIGTERM after a step's checkpoint (a training command says which checkpoint resumes).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings

from linnet.commands.spellings import CONFIG_FIXES
from linnet.errors import SettingError

# name -> module of linnet.commands; each has main(argv) -> exit code.
COMMANDS = {
    "quickstart": "quickstart",
    "sft": "sft",
    "dpo": "dpo",
    "grpo": "grpo",
    "ppo": "ppo",
    "reward": "reward",
    "distill": "distill",
    "adapters": "adapters",
    "jax": "jax_sft",
    "inspect": "inspect",
    "prepare": "prepare",
    "pretrain": "pretrain",
    "generate": "generate",
    "export": "export",
    "eval": "eval",
    "data": "data",
    "serve": "serve",
    "plan": "plan",
    "plot": "plot",
    "info": "info",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nRun `linnet COMMAND --help` for a command's options.")
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        from linnet import __version__

        print(f"linnet {__version__}")
        return 0
    if "--quiet" in argv:  # anywhere on the line: no progress bars (summaries still print)
        argv = [a for a in argv if a != "--quiet"]
        os.environ["LINNET_QUIET"] = "1"
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"linnet: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    binary = _binary_config(rest)
    if binary is not None:
        print(f"linnet {name}: {binary}", file=sys.stderr)
        return 2
    try:
        with _warnings_as(name):
            return importlib.import_module(f"linnet.commands.{COMMANDS[name]}").main(rest)
    except BrokenPipeError:  # `linnet info CARD | head` stopped reading: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except SettingError as e:  # a library refusal: its fix as the config spells it, under --config
        print(f"linnet {name}: {e.named(CONFIG_FIXES if _config_given(rest) else {})}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # refused input: one line naming the file, field or fix
        print(f"linnet {name}: {_placed(_one_line(e), rest)}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # a non-finite loss or gradient stopped training
        print(f"linnet {name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"linnet {name}: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _warnings_as(name: str):
    """linnet's warnings (a UserWarning: a config value that works but likely is not meant,
    records dropped) printed as the command's own lines, `linnet sft: warning: ...`, not
    Python's `file:line: UserWarning: ...`; other libraries' warnings as Python prints them."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UserWarning) and not issubclass(category, (DeprecationWarning, FutureWarning)) \
                and ("linnet" in filename.replace("\\", "/").split("/") or filename == "<string>"):
            print(f"linnet {name}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _config_given(argv: list[str]) -> bool:
    """Whether the command line gives a config (--config FILE or --set FIELD=VALUE): its
    settings are the YAML's fields."""
    return any(arg.split("=", 1)[0] in ("--config", "--set") for arg in argv)


def _option_values(argv: list[str], option: str) -> list[str]:
    """Every value given to `option` (`--set X` or `--set=X`), in order."""
    return [argv[i + 1] if arg == option else arg.removeprefix(f"{option}=") for i, arg in enumerate(argv)
            if arg == option and i + 1 < len(argv) or arg.startswith(f"{option}=")]


def _placed(message: str, argv: list[str]) -> str:
    """A config check's refusal (`config: FIELD=...`), made after the config loaded, placed
    where FIELD was given on this command line (`Origins.placed`)."""
    if not message.startswith("config: ") or not _config_given(argv):
        return message
    from linnet.config.commands import read

    try:
        _, origins = read((_option_values(argv, "--config") or [None])[-1], _option_values(argv, "--set"))
    except (ValueError, OSError):
        return message
    return origins.placed(message)


def _binary_config(argv: list[str]) -> str | None:
    """The refusal of a `--config` file holding bytes no YAML text holds (a binary file
    that happens to decode as UTF-8), else None; directories and other encodings are the
    config reader's to refuse."""
    for path in _option_values(argv, "--config"):
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        found = next((i for i, b in enumerate(head) if b < 0x20 and b not in b"\t\n\r" or b == 0x7F), None)
        if found is not None:
            return (f"{path}: a binary file (byte 0x{head[found]:02x} at offset {found}), not YAML text; --config "
                    "takes a YAML file")
    return None


def _one_line(error: BaseException) -> str:
    """A refusal's or a failed write's message: a full disk named plainly with its file
    (linnet.files.atomic.DiskFull) wherever the write was."""
    from linnet.files.atomic import disk_full

    full = disk_full(error, getattr(error, "filename", None)) if isinstance(error, OSError) else None
    return str(full if full is not None else error)


if __name__ == "__main__":
    raise SystemExit(main())
