"""Packing rows: whole examples, shifted targets, restarting positions, bounds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from linnet.packing import Example, pack


def test_row_layout():
    rows = list(pack([Example.prompted([1, 2, 3], [4, 5]), Example.plain([6, 7, 8, 9])], tokens=12, pad_id=99))
    assert len(rows) == 1
    r = rows[0]
    assert r.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 99, 99]
    # targets shift inside each example only: the last token of a document has none
    assert r.targets[:9].tolist() == [2, 3, 4, 5, 0, 7, 8, 9, 0]
    assert r.weights.tolist() == [0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0]
    assert r.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert r.bounds.tolist() == [0, 5, 9, 12]
    assert (r.real, r.examples, r.truncated, r.learned) == (9, 2, 0, 5)


def test_rows_hold_whole_examples_in_order():
    examples = [Example.plain(list(range(1, n + 1))) for n in (5, 4, 3, 6, 2)]
    rows = list(pack(examples, tokens=9))
    assert [r.examples for r in rows] == [2, 2, 1]
    assert all(len(r.tokens) == 9 for r in rows)
    for r in rows:
        for s in r.bounds[:-1]:
            if s < r.real:
                assert r.tokens[s] == 1 and r.positions[s] == 0  # each document starts whole


def test_full_row_has_no_padding_document():
    (r,) = pack([Example.plain([1, 2, 3, 4])], tokens=4)
    assert r.bounds.tolist() == [0, 4] and r.real == 4


def test_long_example_is_truncated_and_counted():
    examples = [Example.plain([1, 2]), Example.prompted([1, 2], list(range(3, 20))), Example.plain([5, 6])]
    with pytest.warns(UserWarning, match="longer than a row"):
        rows = list(pack(examples, tokens=8))
    assert [r.truncated for r in rows] == [0, 1, 0]
    assert rows[1].real == 8 and rows[1].tokens.tolist() == list(range(1, 9))


def test_truncated_example_without_learned_tokens_is_dropped():
    examples = [Example.prompted(list(range(1, 12)), [50]), Example.plain([5, 6])]
    with pytest.warns(UserWarning):
        rows = list(pack(examples, tokens=8))
    assert len(rows) == 1 and rows[0].examples == 1


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        list(pack([], tokens=8))
    with pytest.raises(ValueError, match="no token is learned"):
        Example.prompted([1, 2, 3], [])
    with pytest.raises(ValueError, match="no token is learned"):
        Example([1, 2, 3], [True, False, False])
    with pytest.raises(ValueError, match="learned flags"):
        Example([1, 2, 3], [True, True])
    with pytest.raises(TypeError, match="Example"):
        list(pack([[1, 2, 3]], tokens=8))


def test_numpy_only():
    code = "import linnet.packing, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_pack_is_the_same_rows():
    torch = pytest.importorskip("torch")
    from linnet.train import pack as torch_pack

    examples = [Example.prompted([1, 2, 3], [4, 5, 6]), Example.plain([7, 8, 9])]
    (a,) = pack(examples, tokens=10)
    (b,) = torch_pack(examples, tokens=10)
    for field in ("tokens", "targets", "weights", "positions"):
        assert isinstance(getattr(b, field), torch.Tensor)
        np.testing.assert_array_equal(getattr(b, field).numpy(), getattr(a, field))
    assert b.bounds.tolist() == a.bounds.tolist() and b.real == a.real


def test_pack_groups_keeps_each_group_in_one_row():
    from linnet.packing import pack_groups

    pairs = [[Example.plain([1, 2, 3]), Example.plain([1, 2, 4, 5])] for _ in range(3)]
    rows = list(pack_groups(pairs, tokens=10))
    assert [r.examples for r in rows] == [2, 2, 2]  # 7 tokens a pair: never split across rows
    assert rows[0].bounds.tolist() == [0, 3, 7, 10]
    with pytest.raises(ValueError, match="group 0 holds 7 tokens"):
        list(pack_groups(pairs, tokens=6))


def test_pack_prompted_places_each_prompt_once():
    from linnet.packing import pack_prompted

    (row,) = pack_prompted([([1, 2, 3, 4], [[5, 6], [7]]), ([9], [[8]])], tokens=12)
    # prompt less its last token; each completion opens with that token, positions continuing
    assert row.tokens.tolist()[:10] == [1, 2, 3, 4, 5, 6, 4, 7, 9, 8]
    assert row.positions.tolist()[:10] == [0, 1, 2, 3, 4, 5, 3, 4, 0, 1]
    assert row.bounds.tolist() == [0, 3, 6, 8, 10, 12] and row.prefix.tolist() == [-1, 0, 0, -1, -1]
    assert row.examples == 3 and row.real == 10
    learned = row.targets[row.weights > 0].tolist()
    assert learned == [5, 6, 7, 8]  # every completion token, predicted from what precedes it
    (plain,) = pack_prompted([([1, 2, 3, 4], [[5, 6], [7]])], tokens=12, share=False)
    assert plain.prefix is None and plain.targets[plain.weights > 0].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="group 0"):
        list(pack_prompted([([1, 2, 3], [[4, 5, 6]] * 3)], tokens=8))


def test_grpo_splits_a_group_longer_than_a_row():
    from types import SimpleNamespace

    from linnet.rl.rollouts import prompt_groups

    prompts = [SimpleNamespace(ids=[1, 2, 3, 4])]
    samples = [SimpleNamespace(prompt=0, tokens=[5] * n, learned=None) for n in (3, 3, 3)]
    shared = list(prompt_groups(samples, prompts, tokens=12, share=True))
    assert [len(c) for _, c in shared] == [2, 1]  # 4 + (1 + 3) * 2 fits 12, a third does not
    assert [len(c) for _, c in prompt_groups(samples, prompts, tokens=12, share=False)] == [1, 1, 1]
