"""Writing files so that a crash at any instant leaves either the old file or the new
one, never a torn one: write beside the target under a temporary name, then rename. Their
checksums, to tell a damaged file from a good one; the leftovers a killed write leaves,
and how a run directory is set aside while a new run replaces it.

Every temporary name starts with a dot and holds `.tmp` (a file or directory being
written) or `.old-` / `.replaced-` (one being swapped out), so `remove_leftovers` can tell
them from what a run keeps.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TEMPORARY = (".tmp", ".old-", ".replaced-")


def _ordinary_permissions(path: str | os.PathLike) -> None:
    """A published file gets the permissions an ordinary write would give it (mkstemp
    makes its files private to their owner)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        _ordinary_permissions(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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


def recover_set_aside(path: str | os.PathLike) -> None:
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
            shutil.rmtree(path, ignore_errors=True)
            os.rename(aside, path)


class SetAside:
    """A directory moved out of the way of a new one that replaces it: `restore()` puts it
    back (the new one failed to start), `drop()` deletes it (the new one started)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.aside = self.path.parent / f".{self.path.name}.replaced-{os.getpid()}"
        os.rename(self.path, self.aside)

    def restore(self) -> None:
        if self.aside.exists():
            shutil.rmtree(self.path, ignore_errors=True)
            os.rename(self.aside, self.path)

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
