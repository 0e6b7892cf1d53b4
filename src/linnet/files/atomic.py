"""Writing files so that a crash at any instant leaves either the old file or the new
one, never a torn one: write beside the target under a temporary name, then rename. Their
checksums, to tell a damaged file from a good one; the leftovers a killed write leaves,
and how a run directory is set aside while a new run replaces it.

Every temporary name starts with a dot and holds `.tmp` (a file or directory being
written) or `.old-` / `.replaced-` (one being swapped out), so `remove_leftovers` can tell
them from what a run keeps.

A write that fails for want of space (a full disk or quota) is raised as `DiskFull`: one
line naming the file and the fix, with the temporary file and any directory the write
made for it removed.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

TEMPORARY = (".tmp", ".old-", ".replaced-")

# What a linnet run writes in its directory (runtime.output_dir), fine-tuning and pretraining
# alike: --overwrite replaces these and leaves anything else there (a user's notes, data) alone.
RUN_ENTRIES = ("run.json", "config.json", "config.yaml", "metrics.jsonl", "summary.json", "best.json", "curves.png",
               "checkpoints", "final", "final.safetensors", "epoch-*.safetensors", "node-*", "tensorboard", "wandb",
               "mlruns")

# The files of a model directory that linnet reads (the weights, their config, the tokenizer
# and chat template, a PEFT adapter's): what `model_files` fingerprints.
MODEL_FILES = ("*.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
               "chat_template.jinja", "chat_template.json", "model.safetensors.index.json", "adapter_config.json")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _ordinary_permissions(path: str | os.PathLike) -> None:
    """A published file gets the permissions an ordinary write would give it (mkstemp
    makes its files private to their owner)."""
    os.chmod(path, 0o666 & ~_umask())


def ordinary_permissions(tree: str | os.PathLike) -> None:
    """Give a directory written in private (a checkpoint before it is published) and every
    file and directory under it the permissions an ordinary write gives under the user's
    umask: files 0o666 & ~umask, directories 0o777 & ~umask (safetensors makes its files
    0600)."""
    umask = _umask()
    tree = Path(tree)
    for path in [tree, *tree.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


class DiskFull(OSError):
    """A write that failed for want of space: one line naming the file and the fix."""

    def __init__(self, path: str | os.PathLike | None, reason: str):
        super().__init__(errno.ENOSPC, reason, None if path is None else str(path))
        what = "a write failed" if path is None else f"{path}: not written"
        self.message = (f"{what} ({reason}): the disk is full. Free space there, or write somewhere else, and run "
                        "the command again (a training run continues from its latest checkpoint with --resume)")

    def __str__(self) -> str:
        return self.message


_FULL = ("No space left on device", "Disk quota exceeded", "StorageFull", "QuotaExceeded", "file write failed")


def disk_full(error: BaseException, path: str | os.PathLike | None) -> DiskFull | None:
    """`error` as a DiskFull of `path` when it says a write ran out of space: an OSError
    ENOSPC or EDQUOT, PyTorch's "file write failed" (torch.save) or safetensors' own
    error wrapping ENOSPC; None for any other error."""
    if isinstance(error, DiskFull):
        return error
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(path, error.strerror or os.strerror(error.errno))
    if isinstance(error, Exception) and not isinstance(error, (KeyboardInterrupt, ValueError)):
        text = str(error)
        for mark in _FULL:
            if mark in text:
                return DiskFull(path, "file write failed" if mark == "file write failed" else
                                os.strerror(errno.EDQUOT if "uota" in mark else errno.ENOSPC))
    return None


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Inside it, a write that runs out of space is raised as `DiskFull` naming `path`."""
    try:
        yield
    except Exception as e:
        full = disk_full(e, path)
        if full is None or full is e:
            raise
        raise full from None


def _make_parents(directory: Path) -> list[Path]:
    """Make `directory` and its missing parents; the ones made, deepest first."""
    made = []
    missing = directory
    while not missing.exists():
        made.append(missing)
        missing = missing.parent
    directory.mkdir(parents=True, exist_ok=True)
    return made


def _remove_empty(directories: list[Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (another write put something there), or gone
            return


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target`. On a
    failure the temporary file goes, and so do the directories made for it that stay
    empty (no empty final/ after a failed first write); a full disk is a DiskFull."""
    target = Path(target)
    made = _make_parents(target.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except BaseException as e:
        _remove_empty(made)
        full = disk_full(e, target)
        if full is None:
            raise
        raise full from None
    os.close(fd)
    try:
        yield Path(tmp)
        _ordinary_permissions(tmp)
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _remove_empty(made)
        full = disk_full(e, target)
        if full is None or full is e:
            raise
        raise full from None


def write_text(target: str | os.PathLike, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, or of a directory's files (names and bytes, in
    sorted order): what a resumed run compares to know its data did not change."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(file.relative_to(path).as_posix().encode() + b"\0" + sha256_file(file).encode())
    return h.hexdigest()


@contextlib.contextmanager
def safetensors_file(path: str | os.PathLike, framework: str, **options):
    """`safetensors.safe_open`, with a truncated, damaged or foreign file refused by name."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework=framework, **options)
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise ValueError(f"{path}: not a readable safetensors file ({e}); it may be cut short or of another "
                         "format: copy or save it again") from None
    with handle as f:
        yield f


def tokenizer_file(path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from tokenizer.json, with an empty or damaged file refused by name."""
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{path}: not a readable tokenizer.json ({e}); copy it again from the model's "
                         "files") from None


def model_files(path: str | os.PathLike) -> dict[str, str]:
    """{name: SHA-256} of the files that make a model: a file itself (named by its name),
    or the files of a model directory that linnet reads (MODEL_FILES); for a run directory
    (run.json), its config.json and what its final/ holds. What a resumed run compares to
    know its model is the one it began with, wherever that now lies."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    if (path / "run.json").is_file():
        found = [path / "config.json"] + sorted((path / "final").glob("*"))
    else:
        found = sorted(path.glob("*"))
    return {file.relative_to(path).as_posix(): sha256_file(file) for file in found
            if file.is_file() and any(fnmatch.fnmatch(file.name, p) for p in MODEL_FILES)}


def is_model_file(path: str | os.PathLike) -> bool:
    """Whether `path`'s name is one a model directory's reader takes (MODEL_FILES)."""
    return any(fnmatch.fnmatch(Path(path).name, p) for p in MODEL_FILES)


def run_entries(path: str | os.PathLike, entries: Collection[str] = RUN_ENTRIES) -> list[Path]:
    """What `path` holds of a run's own files and directories (`entries`: names or glob
    patterns; default RUN_ENTRIES), temporary leftovers left out."""
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if not is_leftover(p) and any(fnmatch.fnmatch(p.name, e) for e in entries))


def is_leftover(path: Path) -> bool:
    return path.name.startswith(".") and any(mark in path.name for mark in TEMPORARY)


def remove_leftovers(*directories: str | os.PathLike) -> list[Path]:
    """Delete what interrupted writes left in `directories` (not below them): temporary
    files and directories (see the module docstring). Call it only where no other
    process writes. Returns what it removed."""
    removed = []
    for directory in map(Path, directories):
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if is_leftover(path):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process not yet reaped by its parent is a zombie: dead to us
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def remove_stale(target: str | os.PathLike) -> None:
    """Delete the `.<name>.tmp-<pid>` directories beside `target` whose process is gone:
    what a killed write of `target` left."""
    target = Path(target)
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _put_back(aside: Path, path: Path, entries: Collection[str]) -> None:
    """Move what `aside` holds back into `path`, the replacing run's own entries removed
    first; then remove `aside`."""
    path.mkdir(parents=True, exist_ok=True)
    for entry in run_entries(path, entries):
        _remove(entry)
    for entry in aside.iterdir():
        if (path / entry.name).exists():
            _remove(path / entry.name)
        os.rename(entry, path / entry.name)
    aside.rmdir()


def recover_set_aside(path: str | os.PathLike, entries: Collection[str] = RUN_ENTRIES) -> None:
    """Settle what a killed replacement left beside `path` (see SetAside): a run set aside
    by a process that is gone comes back if the new run never took a step (no metrics
    row), and is deleted otherwise."""
    path = Path(path)
    for aside in path.parent.glob(f".{path.name}.replaced-*"):
        pid = aside.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or process_alive(int(pid)):
            continue
        metrics = path / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().strip():
            shutil.rmtree(aside)
        else:
            _put_back(aside, path, entries)


class SetAside:
    """A run's own files and directories (`entries`, default RUN_ENTRIES) moved out of the
    way of a new run that replaces them, into `.<name>.replaced-<pid>` beside the
    directory; anything else in the directory stays where it is. `restore()` puts them
    back (the new run failed to start: its own entries go), `drop()` deletes them (the new
    one started)."""

    def __init__(self, path: str | os.PathLike, entries: Collection[str] = RUN_ENTRIES):
        self.path, self.entries = Path(path), entries
        self.aside = self.path.parent / f".{self.path.name}.replaced-{os.getpid()}"
        self.aside.mkdir()
        for entry in run_entries(self.path, entries):
            os.rename(entry, self.aside / entry.name)

    def restore(self) -> None:
        if self.aside.exists():
            _put_back(self.aside, self.path, self.entries)

    def drop(self) -> None:
        shutil.rmtree(self.aside, ignore_errors=True)


def check_writable(directory: str | os.PathLike, what: str) -> None:
    """Refuse an output directory that cannot be made or written: a file, under a file,
    or without write permission. Reads only."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: {what} is a file, not a directory; choose another {what}")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{path}: {existing} is a file, so {what} cannot be made under it; choose another {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: {existing} is not writable; choose another {what}")
