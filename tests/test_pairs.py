"""Preference records to token-id pairs."""

from __future__ import annotations

import pytest

from linnet.data import pairs_from_records
from tests.test_data import chatml, ids, llama3


def test_prompt_and_text_answers_through_chatml():
    (pair,) = pairs_from_records([{"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Berlin."}],
                                 chatml())
    assert pair.chosen == ids("Paris", ".", "<|im_end|>")
    assert pair.rejected == ids("Berlin", ".", "<|im_end|>")
    assert pair.prompt[-3:] == ids("<|im_start|>", "assistant", "\n")


def test_full_dialogues_share_all_but_the_last_turn():
    head = [{"role": "user", "content": "Capital of France?"}]
    record = {"chosen": head + [{"role": "assistant", "content": "Paris."}],
              "rejected": head + [{"role": "assistant", "content": "Berlin."}]}
    (pair,) = pairs_from_records([record], llama3())
    assert pair.chosen == ids("Paris", ".", "<|eot_id|>")
    assert pair.prompt[0] == ids("<|begin_of_text|>")[0] and pair.prompt.count(pair.prompt[0]) == 1
    bad = {"chosen": head + [{"role": "assistant", "content": "Paris."}],
           "rejected": [{"role": "user", "content": "Capital of Germany?"}, {"role": "assistant", "content": "Berlin."}]}
    with pytest.raises(ValueError, match="record 1: .*do not share their prompt"):
        pairs_from_records([record, bad], llama3())


def test_missing_field_and_empty_data():
    with pytest.raises(ValueError, match="missing field 'rejected'"):
        pairs_from_records([{"prompt": "Capital of France?", "chosen": "Paris."}], chatml())
    with pytest.raises(ValueError, match="no records"):
        pairs_from_records([], chatml())
