"""Tokenizing a corpus for `linnet prepare`: the tokenizer, and the processes that run it.

    tok, eos, setting = resolve_tokenizer(config.data)    # data.tokenizer, or trained here
    tokenize_pool(batches, 4, tokenizer_file, eos, dtype, writers.write)

`resolve_tokenizer` loads `data.tokenizer` (a tokenizer.json, a model directory or a card
name) or trains a byte-level BPE on the training documents, and names its EOS token.

`tokenize_pool` sends batches of documents to a pool of tokenizer processes (fork
server, else spawn; never a plain fork: the parent may have imported torch or JAX) with
at most two batches in flight per worker, and hands the results on in submission order,
so the bytes written are the same for any worker count; `tokenize_serial` does the same
in the calling process. Each document is followed by the EOS token. The workers import
this module, numpy and tokenizers, never torch; they ignore Ctrl-C (the main process
cancels pending batches and waits for the running ones) and exit when the main process
is killed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from linnet.files.atomic import process_alive, tokenizer_file

if TYPE_CHECKING:
    from linnet.config.groups import CorpusConfig

TRAINED_EOS = "<|endoftext|>"
IN_FLIGHT_PER_WORKER = 2

Batches = Iterator[tuple[str, list[str], list[int]]]  # (split, texts, source positions)
Write = Callable[[str, np.ndarray, np.ndarray, list[int]], None]  # (split, tokens, lengths, positions)

# ---------------------------------------------------------------------------------------
# The tokenizer


def _train_tokenizer(d: CorpusConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from linnet.data.corpus import documents  # here: the workers need none of the corpus readers

    if d.dataset is not None:
        raise ValueError(f"data.dataset={d.dataset!r}: training a tokenizer on a streamed dataset is not "
                         "supported; set data.tokenizer (a tokenizer.json, a directory or a card name)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=d.vocab_size, special_tokens=[TRAINED_EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = (doc.text for doc in documents(d, for_tokenizer=True) if doc.split == "train")
    tok.train_from_iterator(texts, trainer)
    return tok


def resolve_tokenizer(d: CorpusConfig) -> tuple[Any, int, dict[str, Any]]:
    """(tokenizers.Tokenizer, EOS id, its settings entry) from data.tokenizer, or a
    byte-level BPE trained on the training documents when it is null."""

    if d.tokenizer is None:
        raw = _train_tokenizer(d)
        setting: dict[str, Any] = {"trained": "byte-level-bpe", "vocab_size": d.vocab_size}
        eos_name = d.eos_token or TRAINED_EOS
    else:
        path = Path(d.tokenizer)
        if path.is_file():
            raw = tokenizer_file(path)
            own_eos = None
        else:
            from linnet.data.tokenizer import load_tokenizer

            loaded = load_tokenizer(path if path.is_dir() else d.tokenizer, backend="tokenizers")
            raw = loaded.raw
            own_eos = loaded.eos_ids[0] if loaded.eos_ids else None
        setting = {"source": str(path.resolve()) if path.exists() else d.tokenizer}
        eos_name = d.eos_token
        if eos_name is None:
            if own_eos is not None:
                eos_name = raw.id_to_token(own_eos)
            else:
                eos_name = next((t for t in (TRAINED_EOS, "</s>", "<eos>", "<|end_of_text|>")
                                 if raw.token_to_id(t) is not None), None)
        if eos_name is None:
            raise ValueError(f"{d.tokenizer}: the tokenizer names no end-of-document token; set data.eos_token "
                             "to a token of its vocabulary")
    eos = raw.token_to_id(eos_name)
    if eos is None:
        raise ValueError(f"data.eos_token={eos_name!r} is not in the tokenizer's vocabulary")
    setting["eos_token"] = eos_name
    return raw, eos, setting


# ---------------------------------------------------------------------------------------
# Tokenizer workers (they import numpy and tokenizers, never torch)

_WORKER: dict[str, Any] = {}


def _watch_main(main: int) -> None:
    # A killed main process cannot drain its pool: exit instead of waiting for work
    # forever. (Under the fork server our parent is the server, which itself lives as
    # long as any worker holds its pipe, so the main process is what we watch.)
    while True:
        time.sleep(0.5)
        if not process_alive(main):
            os._exit(1)


def _start_worker(tokenizer_path: str, eos: int, dtype: str, main: int) -> None:
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and drains us
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process, one core
    import tokenizers

    _WORKER.update(tokenizer=tokenizers.Tokenizer.from_file(tokenizer_path), eos=eos, dtype=np.dtype(dtype))
    threading.Thread(target=_watch_main, args=(main,), daemon=True).start()


def encode_documents(texts: list[str], tokenizer=None, eos: int | None = None, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of every document each followed by EOS, per-document lengths with EOS)."""
    tokenizer = tokenizer or _WORKER["tokenizer"]
    eos = _WORKER["eos"] if eos is None else eos
    dtype = _WORKER["dtype"] if dtype is None else dtype
    encoded = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), np.int64, len(encoded))
    out = np.empty(int(lengths.sum()), dtype)
    ends = np.cumsum(lengths)
    for ids, end, n in zip(encoded, ends, lengths):
        out[end - n : end - 1] = ids
        out[end - 1] = eos
    return out, lengths


@contextlib.contextmanager
def _serial_tokenizers():
    """Keep the tokenizer to one thread in serial mode, as in each worker."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def tokenize_serial(batches: Batches, tok, eos: int, dtype: np.dtype, write: Write) -> None:
    """Encode `batches` in this process, passing each result to `write`."""
    with _serial_tokenizers():
        for split, texts, positions in batches:
            tokens, lengths = encode_documents(texts, tok, eos, dtype)
            write(split, tokens, lengths, positions)


def _worker_context():
    """Fork server where there is one (workers fork from a clean server that has imported
    this module once), else spawn. Never a plain fork: the parent may have imported torch
    or JAX."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["linnet.pretrain.tokenize"])  # _start_worker, encode_documents
        return context
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _ctrl_c_held():
    """Hold a Ctrl-C until the block ends: `ProcessPoolExecutor.submit` starts workers
    under the pool's lock, and an interrupt half-way through can leave a pool that never
    shuts down. (Only the main thread receives signals; elsewhere this does nothing.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def tokenize_pool(batches: Batches, workers: int, tokenizer_file: Path, eos: int, dtype: np.dtype,
                  write: Write) -> None:
    """Encode `batches` in `workers` processes (each loads `tokenizer_file`), passing the
    results to `write` in submission order."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with _ctrl_c_held():
        pool = ProcessPoolExecutor(workers, mp_context=_worker_context(), initializer=_start_worker,
                                   initargs=(str(tokenizer_file), eos, dtype.str, os.getpid()))
    in_flight: deque = deque()
    try:
        for split, texts, positions in batches:
            with _ctrl_c_held():
                in_flight.append((split, positions, pool.submit(encode_documents, texts)))
            while len(in_flight) >= IN_FLIGHT_PER_WORKER * workers:
                split_done, done_positions, future = in_flight.popleft()
                write(split_done, *future.result(), done_positions)
        while in_flight:  # in submission order, whatever order they finish in
            split_done, done_positions, future = in_flight.popleft()
            write(split_done, *future.result(), done_positions)
    except BaseException as e:
        # Failure or Ctrl-C: cancel what has not started, wait for what has.
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(e, BrokenProcessPool):
            raise ValueError(
                f"a tokenizer worker died abruptly ({e}); nothing was published. Out of memory? Lower "
                "data.prepare_workers or data.prepare_batch_documents, or run with data.prepare_workers=1 to "
                "see the error in the main process. From a script: each worker imports it, so its top level "
                "must sit under `if __name__ == \"__main__\":`"
            ) from None
        raise
    pool.shutdown(wait=True)
