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
    with pytest.raises(ValueError, match=r"field 'rejected' is missing \(the record has 'prompt', 'chosen'\); add it"):
        pairs_from_records([{"prompt": "1+3=", "chosen": "4"}], chatml(), chat=False)
    with pytest.raises(ValueError, match="field 'prompt' holds an int; with chat off it must be text"):
        pairs_from_records([{"prompt": 13, "chosen": "4", "rejected": "5"}], chatml(), chat=False)


def test_hh_rlhf_text_reads_as_the_dialogue_it_spells():
    """Anthropic's hh-rlhf records are two whole dialogues in its Human/Assistant text: the
    same pair as the dialogues written as messages."""
    head = "\n\nHuman: Capital of France?\n\nAssistant: Paris.\n\nHuman: And Germany?\n\nAssistant:"
    (pair,) = pairs_from_records([{"chosen": head + " Berlin.", "rejected": head + " Paris."}], chatml())
    turns = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "And Germany?"}]
    (same,) = pairs_from_records([{"chosen": turns + [{"role": "assistant", "content": "Berlin."}],
                                   "rejected": turns + [{"role": "assistant", "content": "Paris."}]}], chatml())
    assert pair == same and pair.chosen == ids("Berlin", ".", "<|im_end|>")


def test_texts_sharing_a_beginning_take_it_as_the_prompt():
    """TRL's implicit prompt for text: the shared prefix, up to the space before the answers."""
    (implicit,) = pairs_from_records([{"chosen": "Capital of France? Paris.", "rejected": "Capital of France? Berlin."}],
                                     chatml(), chat=False)
    (explicit,) = pairs_from_records([{"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Berlin."}],
                                     chatml(), chat=False)
    assert implicit == explicit
    with pytest.raises(ValueError, match="share no beginning to take as the prompt"):
        pairs_from_records([{"chosen": "Paris.", "rejected": "Berlin."}], chatml(), chat=False)


def test_pairs_longer_than_a_row_are_listed_at_once_or_cut_prompt_first():
    records = [{"prompt": "Capital of France? " * n, "chosen": "Paris.", "rejected": "Berlin."} for n in (1, 6, 8)]
    names = {"tokens": "training.context_length", "truncate": "data.truncate: true"}
    with pytest.raises(ValueError, match=r"2 pair\(s\), record 1 \(\d+\); record 2 \(\d+\): each needs more "
                                         r"positions .* than a row of 32; raise training.context_length .*"
                                         r"data.truncate: true"):
        pairs_from_records(records, chatml(), chat=False, tokens=32, names=names)
    whole = pairs_from_records(records, chatml(), chat=False)
    with pytest.warns(UserWarning, match=r"cut 2 pair\(s\) to rows of 32 positions"):
        cut = pairs_from_records(records, chatml(), chat=False, tokens=32, truncate=True)
    assert cut[0] == whole[0]
    for short, full in zip(cut[1:], whole[1:]):
        assert 2 * len(short.prompt) + len(short.chosen) + len(short.rejected) <= 32
        assert (short.chosen, short.rejected) == (full.chosen, full.rejected)  # the prompt alone is cut ...
        assert list(full.prompt)[-len(short.prompt):] == list(short.prompt)  # ... keeping its end
