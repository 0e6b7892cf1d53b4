"""`linnet prepare` curating a corpus before tokenizing: exact and near duplicates and the
quality filters drop what they should, say how many and why, and change the cache's
identity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from linnet.commands.prepare import main as cli
from linnet.config import PretrainConfig, load
from linnet.data.curation import Curation, letters, repetition
from linnet.pretrain.cache import open_cache
from tests.conftest import WORDS, word_tokenizer


def test_the_filters_measure_what_they_name():
    assert repetition("a b c a b c a b c") == pytest.approx(4 / 7)
    assert repetition(" ".join(WORDS[:20])) == 0.0
    assert letters("ab12 !!") == pytest.approx(2 / 6)
    c = Curation(dedup="exact", min_characters=5, max_repetition=0.5, min_letters=0.5)
    kept = [t for t in ["Hello there, world", "hello there world!", "hi", "x y z x y z x y z", "12345 678 90 ab"]
            if c.keep(t)]
    assert kept == ["Hello there, world"]
    assert c.dropped == {"exact duplicate": 1, "too short": 1, "repetitive": 1, "too few letters": 1}


def test_prepare_drops_planted_duplicates_and_junk_and_reports_them(tmp_path, capsys):
    pytest.importorskip("datasketch", reason="near duplicates need datasketch (pip install 'linnet[data]')")
    g = np.random.default_rng(0)
    docs = [" ".join(g.choice(WORDS, size=200)) for _ in range(100)]
    near = []
    for d in docs[:10]:  # two of 200 words changed: a near duplicate (0.9 of their 5-grams shared)
        words = d.split()
        words[5], words[130] = "x0", "x1"
        near.append(" ".join(words))
    planted = docs + [d.upper() + " ." for d in docs[10:15]] + near + ["w1 w2 w3 " * 10, "w1", "1 2 3 4 5 6 7 8 9"]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in planted))
    word_tokenizer(tmp_path / "tokenizer.json", extra=2)
    yaml = tmp_path / "prepare.yaml"
    yaml.write_text(f"data:\n  cache: {tmp_path / 'cache'}\n  source: [{tmp_path / 'corpus.jsonl'}]\n"
                    f"  tokenizer: {tmp_path / 'tokenizer.json'}\n  eos_token: <eos>\n  validation_every: 0\n"
                    "  prepare_workers: 1\n  dedup: near\n  min_characters: 5\n  max_repetition: 0.5\n"
                    "  min_letters: 0.3\n")  # the words here are w0 ... w39: a third or more letters
    assert cli(["--config", str(yaml)]) == 0
    out = capsys.readouterr().out
    assert "dropped" in out and "5 exact duplicate" in out and "10 near duplicate" in out
    assert "1 too short" in out and "1 repetitive" in out and "1 too few letters" in out
    cache = open_cache(tmp_path / "cache")
    assert cache.train.documents == 100 and cache.manifest["settings"]["curation"]["dedup"] == "near"
    with pytest.raises(ValueError, match="data.curation: cache has"):  # another curation: another cache
        load_config = load(PretrainConfig, yaml, ["data.dedup=exact"])
        from linnet.pretrain.prepare import prepare

        prepare(load_config.data)


def test_validation_documents_that_repeat_training_ones_are_warned_about_or_refused(tmp_path):
    """Every fifth document is validation, and every validation document also appears
    among the training ones: prepare warns and records it, pretrain warns again or
    refuses (data.overlap), and data.dedup=exact removes the repeats before the split."""
    from linnet.pretrain.prepare import prepare
    from linnet.pretrain.runner import run

    g = np.random.default_rng(1)
    docs = [" ".join(g.choice(WORDS, size=12)) for _ in range(40)]
    planted = [d for i, d in enumerate(docs) for d in ([d, d] if i % 8 == 0 else [d])]  # 5 documents twice
    (tmp_path / "c.txt").write_text("\n".join(planted) + "\n")
    word_tokenizer(tmp_path / "tok.json")

    def config(cache: str, *more: str):
        return load(PretrainConfig, None, [
            f"data.cache={tmp_path / cache}", f"data.source=[{tmp_path / 'c.txt'}]", f"data.tokenizer={tmp_path / 'tok.json'}",
            "data.document_split=line", "data.prepare_workers=1", "data.validation_every=2", "data.shuffle_buffer=1",
            "model.vocab=64", "model.hidden=16", "model.intermediate=32", "model.layers=1", "model.heads=1",
            "training.context_length=8", "training.micro_batch_size=2", "training.accumulation=1",
            "training.total_targets=32", "data.repeat=true", f"runtime.output_dir={tmp_path / 'run'}", *more])

    with pytest.warns(UserWarning, match="document.s. of the validation split repeat training documents"):
        prepare(config("cache").data)
    assert open_cache(tmp_path / "cache").manifest["validation_repeats"] > 0
    with pytest.raises(ValueError, match="cache's validation split repeat training documents"):
        run(config("cache", "data.overlap=refuse"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="repeat training documents"):
        prepare(config("refused", "data.overlap=refuse").data)
    assert not (tmp_path / "refused").exists()  # nothing published
    prepare(config("deduped", "data.dedup=exact").data)
    assert open_cache(tmp_path / "deduped").manifest["validation_repeats"] == 0
