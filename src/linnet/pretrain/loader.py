"""Sequential buffered loading from a token cache, with a committed cursor.

    loader = Loader(cache.train, context=1024, group_size=2, seed=0)
    batch = loader.batch(32)            # a Packed row of 32 sequences on the device
    state = loader.cursor()             # store in a checkpoint after the update
    loader = Loader(..., position=state["position"])   # or Loader.restore(split, state, ...)

Training sequence i is tokens [i*T, i*T + T) of the split's stream with targets
[i*T + 1, i*T + T + 1): the one token of lookahead crosses shard (and group) boundaries, so
every target is the token that follows in the corpus. The loader visits consecutive groups
of `group_size` shards in file order. A sequence belongs to the group holding its first
token; a group's sequences (plus lookahead) are read into one compact buffer in the cache
dtype and handed out in a permutation fixed by (seed, pass, group index). Only the
microbatch is converted to int64. On CUDA it is assembled in pinned host memory and copied
with non_blocking=True; with `prefetch`, one background thread reads the next group.

The stream depends only on the cache contents and shard layout, context length, group size
and seed: not on batch sizes, prefetch or the budget, so a longer budget's stream starts
with a shorter one's, and `position` (sequences handed out) is the whole cursor. With
`repeat`, the stream continues with a new pass over the groups (reshuffled by pass).
Under several processes every loader follows the whole stream and `skip`s the sequences
the other processes train on, so the cursor does not depend on the process count.

Validation keeps a fixed, evenly spaced subset in memory (collected in one sequential
scan) for epoch ends, and streams the whole split in order for the final full validation.

Shapes: N sequences in a microbatch, T context length.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from linnet.packing import Packed
from linnet.pretrain.cache import Split
from linnet.pretrain.recipe import LOADER_VERSION


@dataclass(frozen=True)
class Group:
    index: int  # physical group index: shards [index*G, (index+1)*G)
    first: int  # first sequence whose first token lies in the group
    stop: int  # one past the last

    @property
    def count(self) -> int:
        return self.stop - self.first


def shard_groups(split: Split, context: int, group_size: int) -> list[Group]:
    """The groups of `split` that hold at least one sequence start, in file order."""
    n = split.sequences(context)
    shards = len(split.shards)
    out = []
    for g in range(math.ceil(shards / group_size)):
        a = int(split.offsets[g * group_size])
        b = int(split.offsets[min((g + 1) * group_size, shards)])
        first, stop = -(-a // context), min(-(-b // context), n)
        if stop > first:
            out.append(Group(g, first, stop))
    return out


def _windows(buffer: np.ndarray, count: int, context: int) -> np.ndarray:
    """[count, T+1] overlapping views: row j is sequence j and its lookahead token."""
    step = buffer.strides[0]
    return np.lib.stride_tricks.as_strided(buffer, (count, context + 1), (context * step, step), writeable=False)


class Rows:
    """Microbatches as `Packed` rows for the model's `loss_packed`: N sequences end to
    end, positions restarting every T, every target learned."""

    def __init__(self, context: int, device: torch.device | str | None = None):
        self.context = context
        self.device = torch.device(device or "cpu")
        self.pinned = self.device.type == "cuda"
        self._constant: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}

    def host(self, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """An int64 host buffer [n, T+1] to fill (a view of pinned memory on CUDA)."""
        t = torch.empty((n, self.context + 1), dtype=torch.int64, pin_memory=self.pinned)
        return t.numpy(), t

    def packed(self, host: torch.Tensor) -> Packed:
        n, T = host.shape[0], self.context
        x = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host
        if n not in self._constant:
            self._constant[n] = (
                torch.arange(T, device=self.device).repeat(n),
                torch.ones(n * T, dtype=torch.float32, device=self.device),
                np.arange(0, n * T + 1, T, dtype=np.int64),
            )
        positions, weights, bounds = self._constant[n]
        return Packed(
            tokens=x[:, :T].reshape(-1), targets=x[:, 1:].reshape(-1), weights=weights,
            positions=positions, bounds=bounds, real=n * T, examples=n,
        )

    def from_array(self, x: np.ndarray) -> Packed:
        """A row from [n, T+1] tokens of any integer dtype."""
        buf, t = self.host(len(x))
        buf[...] = x
        return self.packed(t)


class Loader:
    """The training stream of one split (see the module docstring)."""

    def __init__(self, split: Split, *, context: int, group_size: int, seed: int, repeat: bool = False,
                 prefetch: bool = True, device: torch.device | str | None = None, position: int = 0):
        if context < 1 or group_size < 1:
            raise ValueError(f"loader: context={context} and group_size={group_size} must be positive")
        self.split, self.context, self.group_size, self.seed = split, context, group_size, seed
        self.repeat = repeat
        self.groups = shard_groups(split, context, group_size)
        self.sequences_per_pass = sum(g.count for g in self.groups)
        if self.sequences_per_pass == 0:
            raise ValueError(f"{split.name} split: {split.tokens} tokens hold no sequence of {context}+1 tokens; "
                             "prepare a larger corpus or lower training.context_length")
        self._starts = np.cumsum([0] + [g.count for g in self.groups])
        self.rows = Rows(context, device)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="linnet-prefetch") if prefetch else None
        self._next: tuple[tuple[int, int], Future] | None = None
        self._current: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None
        self.position = 0
        self.read_seconds = 0.0  # time the training thread waited for group reads
        self.seek(position)

    # -- the cursor ---------------------------------------------------------------

    def cursor(self) -> dict:
        """What a checkpoint stores to continue the stream exactly."""
        return {"version": LOADER_VERSION, "position": self.position, "context": self.context,
                "group_size": self.group_size, "seed": self.seed, "sequences_per_pass": self.sequences_per_pass}

    @classmethod
    def restore(cls, split: Split, cursor: dict, **kw) -> Loader:
        loader = cls(split, **kw, position=0)
        mine = loader.cursor()
        keys = ("version", "context", "group_size", "seed", "sequences_per_pass")
        differing = [f"{k} {cursor.get(k)!r} (saved) vs {mine[k]!r} (now)" for k in keys if cursor.get(k) != mine[k]]
        if differing:
            loader.close()
            raise ValueError("loader cursor: saved under another layout (" + "; ".join(differing) +
                             "); resume with the cache, context length, shard-group size and seed of the run")
        loader.seek(int(cursor["position"]))
        return loader

    def seek(self, position: int) -> None:
        if position < 0 or (not self.repeat and position > self.sequences_per_pass):
            raise ValueError(f"loader: position {position} outside the split's {self.sequences_per_pass} sequences")
        self.position = position

    def skip(self, n: int) -> None:
        """Pass over the next n sequences unread: the share of an update that other
        processes train on (so the cursor is the same on every process)."""
        self.seek(self.position + n)

    def locate(self, position: int) -> tuple[int, int, int]:
        """(pass, group slot, row within the group) of stream position `position`."""
        pass_, r = divmod(position, self.sequences_per_pass)
        slot = int(np.searchsorted(self._starts, r, side="right")) - 1
        return pass_, slot, r - int(self._starts[slot])

    # -- groups -------------------------------------------------------------------

    def _read(self, key: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        pass_, slot = key
        g = self.groups[slot]
        buffer = self.split.read(g.first * self.context, g.stop * self.context + 1)
        order = np.random.default_rng([self.seed, pass_, g.index]).permutation(g.count)
        return buffer, order

    def _following(self, key: tuple[int, int]) -> tuple[int, int] | None:
        pass_, slot = key
        if slot + 1 < len(self.groups):
            return pass_, slot + 1
        return (pass_ + 1, 0) if self.repeat else None

    def _group(self, key: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        if self._current is not None and self._current[0] == key:
            return self._current[1], self._current[2]
        import time

        t0 = time.perf_counter()
        if self._next is not None and self._next[0] == key:
            buffer, order = self._next[1].result()  # waits if the reader is not done
        else:
            buffer, order = self._read(key)
        self._next = None
        self.read_seconds += time.perf_counter() - t0
        self._current = (key, buffer, order)
        following = self._following(key)
        if self._reader is not None and following is not None:
            self._next = (following, self._reader.submit(self._read, following))
        return buffer, order

    # -- batches ------------------------------------------------------------------

    def fill(self, out: np.ndarray) -> None:
        """Fill `out` [n, T+1] with the next n sequences (and their lookahead)."""
        n, done = len(out), 0
        if not self.repeat and self.position + n > self.sequences_per_pass:
            raise ValueError(
                f"{self.split.name} split: the stream holds {self.sequences_per_pass} sequences and "
                f"{self.position + n} are asked for; prepare a larger cache, lower the budget, or set data.repeat=true"
            )
        while done < n:
            pass_, slot, row = self.locate(self.position)
            buffer, order = self._group((pass_, slot))
            take = min(n - done, len(order) - row)
            out[done : done + take] = _windows(buffer, len(order), self.context)[order[row : row + take]]
            done += take
            self.position += take

    def sequences(self, n: int) -> np.ndarray:
        """The next n sequences as int64 [n, T+1] (tokens and the target after the last)."""
        out = np.empty((n, self.context + 1), np.int64)
        self.fill(out)
        return out

    def batch(self, n: int) -> Packed:
        """The next microbatch of n sequences as a Packed row on the device."""
        buf, host = self.rows.host(n)
        self.fill(buf)
        return self.rows.packed(host)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None
        self._next = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Validation:
    """The validation split: a fixed in-memory subset and a streamed full pass."""

    def __init__(self, split: Split, *, context: int, subset_sequences: int, device=None, chunk: int = 4096):
        self.split, self.context = split, context
        self.total = split.sequences(context)
        if self.total == 0:
            raise ValueError(
                f"validation split: {split.tokens} tokens hold no sequence of {context}+1 tokens; prepare a cache "
                "with more validation text (data.validation_every, data.validation_source) or shorten the context"
            )
        self.rows = Rows(context, device)
        self.chunk = chunk
        k = min(subset_sequences, self.total)
        picks = np.unique(np.linspace(0, self.total - 1, k).round().astype(np.int64)) if k else np.zeros(0, np.int64)
        self.subset = np.empty((len(picks), context + 1), split.dtype)
        filled = 0
        for start, block in self._blocks():  # one sequential scan
            inside = picks[(picks >= start) & (picks < start + len(block))]
            self.subset[filled : filled + len(inside)] = block[inside - start]
            filled += len(inside)
        assert filled == len(picks)

    def _blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first sequence, [k, T+1] windows) over the whole split in order."""
        T = self.context
        for start in range(0, self.total, self.chunk):
            stop = min(start + self.chunk, self.total)
            buffer = self.split.read(start * T, stop * T + 1)
            yield start, _windows(buffer, stop - start, T)

    def subset_batches(self, batch_size: int) -> Iterator[Packed]:
        for i in range(0, len(self.subset), batch_size):
            yield self.rows.from_array(self.subset[i : i + batch_size])

    def full_batches(self, batch_size: int) -> Iterator[Packed]:
        for _, block in self._blocks():
            for i in range(0, len(block), batch_size):
                yield self.rows.from_array(block[i : i + batch_size])
