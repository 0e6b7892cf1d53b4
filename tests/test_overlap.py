"""Held-out records that repeat training ones: planted exact and near duplicates are all
found, a disjoint set gives none, `linnet data check` lists them, and the training
commands warn (or refuse) before training."""

from __future__ import annotations

import json

import numpy as np
import pytest

from linnet import cli
from linnet.data.overlap import normalize, overlap, question_text

pytest.importorskip("datasketch", reason="near duplicates need datasketch (pip install 'linnet[data]')")

VOCABULARY = [f"{a}{b}{c}" for a in "bcdfgklmnprst" for b in "aeiou" for c in "lmnrst"]  # 390 made-up words


def sentences(rng, n: int, words: int = 12) -> list[str]:
    return [" ".join(rng.choice(VOCABULARY, size=words, replace=False)) + "?" for _ in range(n)]


def planted(seed: int = 0):
    """300 training questions; held-out: 5 exact copies (case and punctuation changed), 5
    with their words reordered, 5 with two of twelve words replaced, then 20 new ones."""
    rng = np.random.default_rng(seed)
    train = sentences(rng, 300)
    exact = [train[i].upper().replace("?", " !") for i in range(0, 50, 10)]
    reordered = [" ".join(rng.permutation(train[i].rstrip("?").split())) for i in range(100, 150, 10)]
    reworded = []
    for i in range(200, 250, 10):
        words = train[i].rstrip("?").split()
        words[3], words[8] = "zebra", "quokka"
        reworded.append(" ".join(words) + "?")
    fresh = sentences(np.random.default_rng(seed + 99), 20)
    return train, exact + reordered + reworded + fresh


def test_planted_duplicates_are_all_found_and_nothing_else():
    train, held = planted()
    found = overlap([{"prompt": t} for t in train], [{"prompt": h, "completion": "x"} for h in held])
    assert found.exact == 5 and found.near == 10 and found.near_checked
    assert sorted((m.held_out, m.training) for m in found.pairs) == sorted(zip(range(15), [*range(0, 50, 10), *range(100, 150, 10),
                                                                             *range(200, 250, 10)]))
    assert [m.exact for m in found.pairs] == [True] * 5 + [False] * 10
    assert all(m.similarity == 1.0 for m in found.pairs[:10])  # a reordering keeps the words
    assert all(0.7 <= m.similarity < 1 for m in found.pairs[10:])
    assert not overlap(train, held[15:])  # a disjoint set: no false positive
    assert overlap(train, held, near=False).pairs == found.pairs[:5]  # the exact ones come first


def test_a_records_question_is_what_is_compared():
    assert question_text({"messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Why?"},
                                       {"role": "assistant", "content": "Because."}]}) == "Be brief.\nWhy?"
    assert question_text({"instruction": "Add", "input": "2 and 3", "output": "5"}) == "Add\n2 and 3"
    assert question_text({"chosen": "a b", "rejected": "a c"}) == "a b\na c"
    assert normalize("  Hello,\tWORLD!  ﬁne ") == "hello world fine"


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_data_check_lists_the_pairs_and_exits_3(tmp_path, capsys):
    train, held = planted()
    write(tmp_path / "train.jsonl", [{"prompt": t, "completion": "a"} for t in train])
    write(tmp_path / "eval.jsonl", [{"prompt": h, "answer": "a"} for h in held])
    write(tmp_path / "clean.jsonl", [{"prompt": h, "answer": "a"} for h in held[15:]])
    assert cli.main(["data", "check", str(tmp_path / "train.jsonl"), "--against", str(tmp_path / "eval.jsonl"),
                     str(tmp_path / "clean.jsonl"), "--out", str(tmp_path / "pairs.jsonl")]) == 3
    out = capsys.readouterr().out
    assert "5 exact duplicates, 10 near" in out and "0 exact duplicates, 0 near" in out
    assert f"{tmp_path / 'eval.jsonl'} line 1 ~ {tmp_path / 'train.jsonl'} line 1 (exact)" in out
    lines = [json.loads(x) for x in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert len(lines) == 15 and sum(x["exact"] for x in lines) == 5
    assert cli.main(["data", "check", str(tmp_path / "train.jsonl"), "--against", str(tmp_path / "clean.jsonl")]) == 0
    assert cli.main(["data", "check", str(tmp_path / "train.jsonl"), "--against", str(tmp_path / "clean.jsonl"),
                     "--out", str(tmp_path / "pairs.jsonl")]) == 2  # never over an existing file


def test_sft_warns_before_training_and_refuses_when_told(tmp_path, capsys):
    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    rng = np.random.default_rng(0)
    train = [f"{a:02d}+{b:02d}=" for a, b in rng.integers(0, 100, size=(60, 2))]
    write(tmp_path / "train.jsonl", [{"prompt": p, "completion": "1"} for p in train])
    write(tmp_path / "eval.jsonl", [{"prompt": p, "completion": "1"} for p in train[:3] + ["99+99=", "98+98="]])
    common = ["sft", "--set", f"model.card={tmp_path / 'model'}", "--set", f"data.path={tmp_path / 'train.jsonl'}",
              "--set", f"data.eval_path={tmp_path / 'eval.jsonl'}", "--set", "data.chat=false",
              "--set", "training.context_length=64", "--set", "training.steps=1", "--set", "lora.enabled=false",
              "--set", "lr_schedule.warmup_steps=0"]
    assert cli.main([*common, "--set", "data.overlap=refuse", "--set", f"runtime.output_dir={tmp_path / 'no'}"]) == 2
    err = capsys.readouterr().err
    assert "3 held-out record(s) repeat training records" in err and "data.overlap: off" in err
    assert not (tmp_path / "no").exists()
    assert cli.main([*common, "--set", f"runtime.output_dir={tmp_path / 'yes'}"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "3 held-out record(s) repeat" in err
    assert err.index("repeat training records") < err.index("parameters train")  # before the model loads


def test_a_large_training_set_checks_exact_repeats_only(monkeypatch):
    """Past NEAR_RECORDS training records a run checks exact repeats alone, and says so."""
    import types

    from linnet.commands import runs
    from linnet.data.readers import Record

    train, held = planted()
    config = types.SimpleNamespace(data=types.SimpleNamespace(overlap="warn", path="t.jsonl", eval_path="e.jsonl",
                                                              eval_share=0.0),
                                   runtime=types.SimpleNamespace(seed=0))
    records = [Record(f"t.jsonl line {i + 1}", {"prompt": t}) for i, t in enumerate(train)]
    held_records = [Record(f"e.jsonl line {i + 1}", {"prompt": h}) for i, h in enumerate(held)]
    monkeypatch.setattr(runs, "NEAR_RECORDS", 100)
    with pytest.warns(UserWarning) as caught:
        runs.check_held_out(config, records, held_records)
    messages = [str(w.message) for w in caught]
    assert any("only exact repeats" in m for m in messages)
    assert any("5 held-out record(s) repeat" in m and "5 exact, 0 near" in m for m in messages)
