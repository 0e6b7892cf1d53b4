"""The buffered loader: a stream fixed by seed and layout, targets across shard
boundaries, a cursor that continues it exactly, validation subsets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet.config import PretrainConfig
from linnet.config import load as load_config
from linnet.pretrain.cache import open_cache
from linnet.pretrain.loader import Loader, Validation, shard_groups
from linnet.pretrain.prepare import prepare
from tests.conftest import WORDS, word_tokenizer


def load(path, overrides=()):
    return load_config(PretrainConfig, path, overrides)

torch.set_num_threads(1)
T = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Shards of 97 tokens (not a multiple of T): most shard ends fall inside a sequence."""
    root = tmp_path_factory.mktemp("loader")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(word_tokenizer(root / "tok.json")))
    g = np.random.default_rng(0)
    docs = [" ".join(g.choice(WORDS, size=int(g.integers(2, 25)))) for _ in range(300)]
    (root / "train.txt").write_text("\n".join(docs[:260]) + "\n")
    (root / "valid.txt").write_text("\n".join(docs[260:]) + "\n")
    d = load(None, [f"data.cache={root / 'cache'}", f"data.source=[{root / 'train.txt'}]",
                    f"data.validation_source=[{root / 'valid.txt'}]", f"data.tokenizer={root / 'tok.json'}",
                    "data.document_split=line", "data.shuffle_buffer=1", "data.shard_tokens=97",
                    "data.prepare_workers=1"]).data
    prepare(d)
    expected = [tok.token_to_id(w) for doc in docs[:260] for w in [*doc.split(), "<eos>"]]
    valid = [tok.token_to_id(w) for doc in docs[260:] for w in [*doc.split(), "<eos>"]]
    return open_cache(root / "cache"), np.array(expected), np.array(valid)


def _loader(cache, **kw):
    args = dict(context=T, group_size=3, seed=0, prefetch=True)
    return Loader(cache.train, **{**args, **kw})


def test_every_sequence_and_its_targets_match_the_corpus_across_shard_boundaries(cache):
    c, stream, _ = cache
    assert np.array_equal(c.train.read(0, c.train.tokens), stream)
    n = (len(stream) - 1) // T
    crossing = [i for i in range(n) if (i * T) // 97 != (i * T + T) // 97]
    assert len(crossing) > 20 and len(c.train.shards) > 10
    with _loader(c) as loader:
        assert loader.sequences_per_pass == n
        got = loader.sequences(n)
    windows = np.stack([stream[i * T : i * T + T + 1] for i in range(n)])
    assert sorted(map(tuple, got)) == sorted(map(tuple, windows))  # each once, lookahead included
    # each group hands out exactly the sequences that start in its shards, in its own order
    offset = 0
    for group in shard_groups(c.train, T, 3):
        block = got[offset : offset + group.count]
        assert sorted(map(tuple, block)) == sorted(map(tuple, windows[group.first : group.stop]))
        assert not np.array_equal(block, windows[group.first : group.stop])  # shuffled
        offset += group.count
    # as the model sees it: targets are the next corpus token, also at the row's end
    with _loader(c) as loader:
        batch = loader.batch(5)
    rows = batch.tokens.view(5, T).numpy()
    for row, targets in zip(rows, batch.targets.view(5, T).numpy()):
        i = next(i for i in range(n) if np.array_equal(windows[i][:T], row))
        assert targets.tolist() == stream[i * T + 1 : i * T + T + 1].tolist()
    assert batch.bounds.tolist() == [0, 16, 32, 48, 64, 80]
    assert batch.positions.tolist()[:18] == list(range(16)) + [0, 1] and batch.tokens.dtype == torch.int64


def test_the_stream_depends_on_seed_and_layout_only(cache):
    c, _, _ = cache
    with _loader(c) as a:
        reference = a.sequences(100)
    with _loader(c, prefetch=False) as b:  # other batch sizes, no prefetch: the same stream
        pieces = [b.sequences(k) for k in (1, 7, 13, 29, 50)]
    assert np.array_equal(np.concatenate(pieces), reference)
    with _loader(c, seed=1) as other:
        reseeded = other.sequences(100)
    assert not np.array_equal(reseeded, reference)
    first = shard_groups(c.train, T, 3)[0].count  # the group order stays fixed
    assert sorted(map(tuple, reseeded[:first])) == sorted(map(tuple, reference[:first]))
    with _loader(c, group_size=2) as regrouped:
        assert not np.array_equal(regrouped.sequences(100), reference)


def test_a_longer_budget_starts_with_the_shorter_one_and_a_cursor_continues_it(cache):
    c, _, _ = cache
    with _loader(c) as loader:
        long = loader.sequences(120)
    with _loader(c) as loader:
        short = loader.sequences(45)
        cursor = loader.cursor()
    assert np.array_equal(long[:45], short)
    row = _loader(c).locate(cursor["position"])[2]
    assert row > 0  # the cursor sits inside a shard group
    with Loader.restore(c.train, cursor, context=T, group_size=3, seed=0, prefetch=True) as resumed:
        assert np.array_equal(resumed.sequences(75), long[45:])
    with pytest.raises(ValueError, match=r"group_size 3 \(saved\) vs 2 \(now\)"):
        Loader.restore(c.train, cursor, context=T, group_size=2, seed=0)


def test_passes_repeat_only_when_allowed(cache):
    c, _, _ = cache
    with _loader(c) as loader:
        n = loader.sequences_per_pass
        loader.sequences(n - 2)
        with pytest.raises(ValueError, match=r"holds \d+ sequences and \d+ are asked for.*data.repeat=true"):
            loader.sequences(3)
    with _loader(c, repeat=True) as loader:
        both = loader.sequences(2 * n + 5)
    assert sorted(map(tuple, both[:n])) == sorted(map(tuple, both[n : 2 * n]))
    assert not np.array_equal(both[:n], both[n : 2 * n])  # each pass reshuffled


def test_validation_subset_is_fixed_and_full_validation_is_in_order(cache):
    c, _, valid = cache
    n = (len(valid) - 1) // T
    v = Validation(c.validation, context=T, subset_sequences=5, chunk=7)  # chunks smaller than the split
    assert v.total == n and v.subset.shape == (5, T + 1)
    picks = np.linspace(0, n - 1, 5).round().astype(int)
    assert [list(s) for s in v.subset] == [valid[i * T : i * T + T + 1].tolist() for i in picks]
    full = [b.tokens.view(-1, T).numpy() for b in v.full_batches(4)]
    assert np.array_equal(np.concatenate(full), np.stack([valid[i * T : i * T + T] for i in range(n)]))
    assert [b.real for b in v.subset_batches(2)] == [2 * T, 2 * T, T]
