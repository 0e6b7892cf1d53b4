"""The SFT data layer: chat masks from token ids (Llama 3 and ChatML templates), prompt/
completion formatting, one BOS, readers, and a clear error for each kind of bad data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from linnet import nest
from linnet.commands import spellings
from linnet.data import chat_example, examples_from_records, load_examples, load_tokenizer, read_records

# The templates as the models publish them (Meta-Llama-3-8B-Instruct, Qwen-style ChatML).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "? . , system user assistant Be brief Capital of France And Germany Paris Berlin Say hi Hello"
VOCAB = ["<unk>", *LLAMA3_SPECIALS, *CHATML_SPECIALS, "\n", " ", *WORDS.split(), *"2+3=5abcdefg"]
V = {token: i for i, token in enumerate(VOCAB)}

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Germany?"},
    {"role": "assistant", "content": "Berlin."},
]

BACKENDS = ["tokenizers", "transformers"]


def word_tokenizer(bos: str | None = None) -> Tokenizer:
    """Whole words, punctuation and single whitespace characters, so every id is known."""
    tok = Tokenizer(models.WordLevel(V, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(s, special=True) for s in LLAMA3_SPECIALS + CHATML_SPECIALS])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\s"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if bos is not None:  # like Llama 3's tokenizer.json: the post-processor adds BOS
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, V[bos])])
    return tok


def llama3(backend="tokenizers", template=LLAMA3, eos=("<|eot_id|>", "<|end_of_text|>")):
    return load_tokenizer(
        word_tokenizer("<|begin_of_text|>"),  # BOS: found from the post-processor
        chat_template=template,
        eos=eos,
        backend=backend,
    )


def chatml(backend="tokenizers", template=CHATML):
    return load_tokenizer(
        word_tokenizer(),
        chat_template=template,
        eos=["<|im_end|>", "<|endoftext|>"],
        pad="<|endoftext|>",
        backend=backend,
    )


def ids(*tokens: str) -> list[int]:
    return [V[t] for t in tokens]


def spans(learned: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.r_[0, learned.astype(int), 0]))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


# ---------------------------------------------------------------------------------------
# Chat masks


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama3_chat_learns_exactly_assistant_turns_and_eot(backend):
    if backend == "transformers":
        pytest.importorskip("transformers")
    tok = llama3(backend)
    ex = chat_example(CHAT, tok)
    tokens = ex.tokens.tolist()
    assert ex.tokens[ex.learned].tolist() == ids("Paris", ".", "<|eot_id|>", "Berlin", ".", "<|eot_id|>")
    header = ids("<|start_header_id|>", "assistant", "<|end_header_id|>", "\n", "\n")
    for start, end in spans(ex.learned):
        assert tokens[start - len(header) : start] == header  # the role header is context
        assert tokens[end - 1] in tok.eos_ids  # each learned turn ends on a stop token
    assert tokens[0] == V["<|begin_of_text|>"] and tokens.count(V["<|begin_of_text|>"]) == 1
    assert tok.decode(tokens) == tok.apply_chat_template(CHAT)  # the ids are the template's text
    assert ex.learned[-1]  # Llama 3 writes nothing after the last <|eot_id|>


@pytest.mark.parametrize("backend", BACKENDS)
def test_chatml_chat_learns_im_end_but_not_the_newline_after_it(backend):
    if backend == "transformers":
        pytest.importorskip("transformers")
    tok = chatml(backend)
    ex = chat_example(CHAT, tok)
    tokens = ex.tokens.tolist()
    assert ex.tokens[ex.learned].tolist() == ids("Paris", ".", "<|im_end|>", "Berlin", ".", "<|im_end|>")
    header = ids("<|im_start|>", "assistant", "\n")
    for start, end in spans(ex.learned):
        assert tokens[start - len(header) : start] == header
        assert tokens[end - 1] == V["<|im_end|>"] and tokens[end] == V["\n"]  # newline: not learned
    assert tok.bos_id is None and tokens[0] == V["<|im_start|>"]  # ChatML has no BOS
    assert tok.eos_ids == tuple(ids("<|im_end|>", "<|endoftext|>")) and tok.pad_id == V["<|endoftext|>"]


def test_backends_agree():
    pytest.importorskip("transformers")
    for make in (llama3, chatml):
        a, b = chat_example(CHAT, make("tokenizers")), chat_example(CHAT, make("transformers"))
        assert a.tokens.tolist() == b.tokens.tolist() and a.learned.tolist() == b.learned.tolist()


def test_exactly_one_bos():
    # the template leaves BOS out: the tokenizer's is added
    no_bos = LLAMA3.replace("bos_token + content", "content")
    assert chat_example(CHAT, llama3(template=no_bos)).tokens.tolist().count(V["<|begin_of_text|>"]) == 1
    # the template writes it twice: cut to one, with a warning
    twice = LLAMA3.replace("bos_token + content", "bos_token + bos_token + content")
    with pytest.warns(UserWarning, match="2 BOS"):
        tokens = chat_example(CHAT, llama3(template=twice)).tokens.tolist()
    assert tokens[0] == V["<|begin_of_text|>"] and tokens.count(V["<|begin_of_text|>"]) == 1


def test_template_that_is_not_prefix_stable_is_refused():
    # marks the final turn differently, as templates that drop earlier reasoning do
    unstable = CHATML.replace("+ '<|im_end|>'", "+ ('<|im_end|>' if loop.last else '.<|im_end|>')")
    with pytest.raises(
        ValueError,
        match=r"data\.jsonl line 3: messages\[:2\] with the generation prompt .* not prefix-stable",
    ):
        chat_example(CHAT, chatml(template=unstable), where="data.jsonl line 3")
    # the text is prefix-stable but "assistant" + "Paris" tokenize as one word
    glued = CHATML.replace("role'] + '\n'", "role']").replace("assistant\n", "assistant")
    with pytest.raises(ValueError, match="tokenizer merges text across the end of the prefix"):
        chat_example(CHAT, chatml(template=glued))


def test_learned_turn_without_a_stop_token_is_refused():
    with pytest.raises(ValueError, match="no stop token.*eos="):
        chat_example(CHAT, llama3(eos=["<|end_of_text|>"]))  # <|eot_id|> not a stop token


def test_chat_message_errors_name_the_record_and_field():
    tok = chatml()
    with pytest.raises(ValueError, match=r"rec 7: messages\[1\] field 'content' is missing"):
        chat_example([{"role": "user", "content": "hi"}, {"role": "assistant"}], tok, where="rec 7")
    with pytest.raises(ValueError, match="ShareGPT"):
        chat_example([{"from": "human", "text": "hi"}], tok)  # half ShareGPT, half neither
    with pytest.raises(ValueError, match="no assistant turn"):
        chat_example(CHAT[:2], tok)
    with pytest.raises(ValueError, match="needs a chat template"):
        chat_example(CHAT, load_tokenizer(word_tokenizer(), eos="<|im_end|>"))


# ---------------------------------------------------------------------------------------
# Prompt/completion records


def test_prompt_completion_through_the_chat_template():
    (ex,) = examples_from_records([{"prompt": "Say hi", "completion": "Hello"}], chatml(), tokens=64)
    assert ex.tokens[ex.learned].tolist() == ids("Hello", "<|im_end|>")
    assert ex.tokens.tolist()[:4] == ids("<|im_start|>", "user", "\n", "Say")


def test_prompt_completion_as_raw_text_ends_with_a_learned_eos():
    tok = llama3()
    (ex,) = examples_from_records([{"prompt": "2 + 3 =", "completion": " 5"}], tok, tokens=64, chat=False)
    assert ex.tokens.tolist() == ids(
        "<|begin_of_text|>", "2", " ", "+", " ", "3", " ", "=", " ", "5", "<|eot_id|>"
    )
    assert ex.learned.tolist() == [False] * 8 + [True] * 3


def test_alpaca_fields_found_and_mapped():
    tok = load_tokenizer(word_tokenizer(), eos="<|endoftext|>")  # no template: raw text
    records = [
        {"instruction": "Say hi", "input": "a", "response": "Hello"},
        {"instruction": "Say hi", "input": "", "response": "Hello"},
    ]
    a, b = examples_from_records(records, tok, tokens=64)
    # the instruction and the input are joined by a blank line
    assert a.tokens.tolist() == ids("Say", " ", "hi", "\n", "\n", "a", "Hello", "<|endoftext|>")
    assert b.tokens.tolist() == ids("Say", " ", "hi", "Hello", "<|endoftext|>")  # empty input skipped
    (c,) = examples_from_records(
        [{"q": "Say hi", "a": "Hello"}], tok, tokens=64, prompt="q", completion="a"
    )
    assert c.tokens.tolist() == b.tokens.tolist()


# ---------------------------------------------------------------------------------------
# Readers


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_json_and_json_lines_named_json(tmp_path):
    rows = [{"prompt": "Say hi", "completion": "Hello"}, {"prompt": "2 + 3 =", "completion": "5"}]
    jsonl = write_lines(tmp_path / "d.jsonl", [json.dumps(rows[0]), "", json.dumps(rows[1])])
    records = read_records(jsonl)
    assert [r.data for r in records] == rows
    assert [r.where for r in records] == [f"{jsonl} line 1", f"{jsonl} line 3"]
    listed = tmp_path / "d.json"
    listed.write_text(json.dumps(rows, indent=2))
    assert [r.where for r in read_records(listed)] == [f"{listed} record 0", f"{listed} record 1"]
    lines_named_json = write_lines(tmp_path / "e.json", [json.dumps(r) for r in rows])
    assert [r.data for r in read_records(lines_named_json)] == rows
    assert len(load_examples(jsonl, chatml(), tokens=64)) == 2


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}]), path)
    (record,) = read_records(path)
    assert record.where == f"{path} row 0" and record.data["messages"] == CHAT
    (ex,) = load_examples(path, llama3(), tokens=128)
    assert ex.tokens.tolist() == chat_example(CHAT, llama3()).tokens.tolist()


def test_iter_records_streams_jsonl_gz_and_parquet_columns(tmp_path):
    """The streaming reader under read_records: gzipped JSONL line by line, Parquet
    batch by batch reading only the columns asked for, nothing read until asked."""
    import gzip

    from linnet.data.readers import MissingColumn, iter_records

    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"text": "a"}\n\n{"text": "b"}\n{"text": }\n')
    records = iter_records(path)
    assert next(records) == (f"{path} line 1", {"text": "a"})
    assert next(records) == (f"{path} line 3", {"text": "b"})
    with pytest.raises(ValueError, match=r"d\.jsonl\.gz line 4: not valid JSON"):
        next(records)
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin\.jsonl line 2: not UTF-8 text .*save the file as UTF-8"):
        read_records(tmp_path / "latin.jsonl")
    for name, body in (("bom.jsonl", b'{"text": "a"}\r\n{"text": "b"}\r\n'), ("bom.json", b'[{"text": "a"}, {"text": "b"}]')):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body)  # a byte-order mark, as Windows editors write
        assert [r.data for r in read_records(tmp_path / name)] == [{"text": "a"}, {"text": "b"}]
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: no such file; data\.eval_path should name"):
        read_records(tmp_path / "nope.jsonl", field="data.eval_path")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["x", None, "z"], "n": [1, 2, 3]}), tmp_path / "t.parquet", row_group_size=2)
    rows = list(iter_records(tmp_path / "t.parquet", columns=["text"]))
    assert [(r.where, r.data) for r in rows] == [(f"{tmp_path / 't.parquet'} row {i}", {"text": t})
                                                 for i, t in enumerate(["x", None, "z"])]
    with pytest.raises(MissingColumn, match=r"t\.parquet: no column 'body' \(columns: text, n\)"):
        list(iter_records(tmp_path / "t.parquet", columns=["body"]))


def test_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "Say hi", "completion": "Hello"}])
    ds.save_to_disk(str(tmp_path / "saved"))
    for source in (ds, tmp_path / "saved"):
        (ex,) = load_examples(source, chatml(), tokens=64)
        assert ex.tokens[ex.learned].tolist() == ids("Hello", "<|im_end|>")
    datasets.DatasetDict(train=ds).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match="splits train; pass one split"):
        read_records(tmp_path / "splits")


# ---------------------------------------------------------------------------------------
# Bad data: one clear error each, naming the file, the line or record, the field and the fix


def test_empty_files(tmp_path):
    for name in ("empty.jsonl", "empty.json"):
        (tmp_path / name).write_text("\n")
        with pytest.raises(ValueError, match=rf"{name}: holds no records"):
            read_records(tmp_path / name)


def test_bad_json_line(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl", ['{"prompt": "a", "completion": "b"}', '{"prompt": "a", "completion": }']
    )
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: not valid JSON .*one whole JSON object"):
        read_records(path)
    write_lines(path, ['["a", "b"]'])
    with pytest.raises(ValueError, match=r"d\.jsonl line 1: a JSON list, not an object"):
        read_records(path)
    (tmp_path / "d.json").write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(ValueError, match=r"d\.json line 2 column 13: not valid JSON"):
        read_records(tmp_path / "d.json")
    (tmp_path / "d.json").write_text('{"data": []}')
    with pytest.raises(ValueError, match=r"d\.json: holds one JSON value \('data'\), not a list"):
        read_records(tmp_path / "d.json")


def test_missing_field_names_file_line_field_and_fix(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        ['{"instruction": "a", "output": "b"}', '{"instruction": "a", "outptu": "b"}'],
    )
    with pytest.raises(ValueError) as e:  # as `linnet sft` reads it: the config's names
        load_examples(path, chatml(), tokens=64, names=spellings.RECORDS)
    message = str(e.value)
    assert f"{path} line 2: field 'output' is missing" in message
    assert "'instruction', 'outptu'" in message and "set data.completion" in message
    with pytest.raises(ValueError, match="set completion= to the field") as e:  # from Python: its keywords
        load_examples(path, chatml(), tokens=64)
    assert "data." not in str(e.value)
    write_lines(path, ['{"text": "a"}'])
    with pytest.raises(
        ValueError, match=r"line 1: cannot tell which fields.*'text'.*data\.prompt and data\.completion"
    ):
        load_examples(path, chatml(), tokens=64, names=spellings.RECORDS)
    with pytest.raises(ValueError, match=r"line 1: cannot tell which fields.*'text'.*prompt= and completion="):
        load_examples(path, chatml(), tokens=64)
    write_lines(path, ['{"prompt": "a", "completion": 5}'])
    with pytest.raises(
        ValueError, match="line 1: field 'completion' holds an int; the completion must be text"
    ):
        load_examples(path, chatml(), tokens=64)


def test_record_longer_than_the_row(tmp_path):
    rows = [
        {"prompt": "a", "completion": "b"},  # 12 tokens in ChatML
        {"prompt": "a", "completion": "a b c d e f g"},  # 24: the answer starts at token 9
        {"prompt": "a b c d e f g", "completion": "Hello"},  # 24: the answer is at token 21
    ]
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(
        ValueError,
        match=r"2 record\(s\) longer than a row of 12 tokens: .*d\.jsonl line 2 \(24 tokens\); "
        r".*line 3 \(24 tokens\)\. .*truncate",
    ):
        load_examples(path, chatml(), tokens=12)
    with pytest.warns(UserWarning, match=r"dropped 1 record.*first 12 tokens.*line 3"):
        short, cut = load_examples(path, chatml(), tokens=12, truncate=True)
    assert len(short) == len(cut) == 12 and cut.tokens[cut.learned].tolist() == ids("a", " ", "b")


def test_files_that_are_not_data(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: no such file"):
        read_records(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"d\.csv: unknown data format '\.csv'; use \.jsonl"):
        read_records(tmp_path / "d.csv")
    with pytest.raises(ValueError, match="not written by datasets' save_to_disk"):
        read_records(tmp_path)


# ---------------------------------------------------------------------------------------
# Tokenizers from directories and cards


def save_tokenizer(directory: Path, template: str | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    word_tokenizer("<|begin_of_text|>").save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>", "special": True}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    return directory


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokenizer_from_a_model_directory_takes_the_cards_stop_tokens(tmp_path, backend):
    if backend == "transformers":
        pytest.importorskip("transformers")
    root = save_tokenizer(tmp_path / "model", LLAMA3)
    end = V["<|end_of_text|>"]
    config = nest.REGISTRY["debug"].hf_config() | {
        "eos_token_id": [end],
        "pad_token_id": end,
        "bos_token_id": 1,
    }
    (root / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(root, backend=backend)
    assert tok.bos_id == V["<|begin_of_text|>"]  # from the tokenizer's post-processor
    assert tok.eos_ids == tuple(ids("<|eot_id|>", "<|end_of_text|>"))  # its own eos, then the card's
    assert tok.pad_id == end  # the card's pad: the tokenizer names none
    assert chat_example(CHAT, tok).tokens.tolist() == chat_example(CHAT, llama3()).tokens.tolist()
    (root / "config.json").write_text(json.dumps(config | {"vocab_size": 8}))
    with pytest.raises(ValueError, match="tokenizer has .* tokens but card 'model' has vocab=8"):
        load_tokenizer(root, backend=backend)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="card 'debug' has no tokenizer"):
        load_tokenizer("debug")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"token '<\|eom_id\|>' is not in the vocabulary"):
        load_tokenizer(word_tokenizer(), eos="<|eom_id|>")


# ---------------------------------------------------------------------------------------
# Real data (the workplace's shared folder; absent from a plain checkout)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def gpt2_chatml():
    """GPT-2's byte-level BPE (the CS336 fixture files) with ChatML's special tokens."""
    fixtures = SHARED / "cs336_fixtures"
    if not fixtures.is_dir():
        pytest.skip(f"real data not present ({SHARED})")
    vocab = json.loads((fixtures / "gpt2_vocab.json").read_text())
    merges = [tuple(line.split()) for line in (fixtures / "gpt2_merges.txt").read_text().splitlines() if line]
    raw = Tokenizer(models.BPE(vocab, merges))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(s, special=True) for s in CHATML_SPECIALS])
    return load_tokenizer(raw, chat_template=CHATML, eos=["<|im_end|>"])


@pytest.mark.parametrize(
    "name, answer",
    [("llamafactory_demo/alpaca_en_demo.json", "output"), ("gpteacher/codegen-instruct.json", "response")],
)
def test_real_alpaca_records(gpt2_chatml, name, answer):
    """Real records through a real BPE: every prefix is stable and the learned ids are
    exactly the answer and <|im_end|>."""
    if not (SHARED / name).is_file():
        pytest.skip(f"real data not present ({SHARED / name})")
    records = read_records(SHARED / name)[:30]
    examples = examples_from_records(records, gpt2_chatml, tokens=8192)
    for record, ex in zip(records, examples, strict=True):
        assert gpt2_chatml.decode(ex.tokens[ex.learned].tolist()) == record.data[answer] + "<|im_end|>"


def test_sharegpt_and_openai_messages_learn_what_prompt_completion_records_learn(tmp_path):
    """The same two-turn exchanges as prompt/completion records, OpenAI messages and
    ShareGPT conversations (with a system turn in both chats): the same ids learned."""
    tok = chatml()
    pairs = [("Capital of France?", "Paris."), ("And Germany?", "Berlin, Germany.")]
    files = {
        "prompt_completion": [{"prompt": p, "completion": c} for p, c in pairs],
        "openai": [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                   for p, c in pairs],
        "sharegpt": [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": c}]}
                     for p, c in pairs],
    }
    got = {}
    for name, records in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
        got[name] = load_examples(path, tokenizer=tok, tokens=256)
    for a, b, c in zip(got["prompt_completion"], got["openai"], got["sharegpt"]):
        assert a.tokens.tolist() == b.tokens.tolist() == c.tokens.tolist()
        assert a.learned.tolist() == b.learned.tolist() == c.learned.tolist()
    system = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Say hi"},
                                 {"from": "gpt", "value": "Hello."}]}]
    (tmp_path / "system.jsonl").write_text(json.dumps(system[0]) + "\n")
    (example,) = load_examples(tmp_path / "system.jsonl", tokenizer=tok, tokens=256)
    assert tok.decode(example.tokens[example.learned].tolist()) == "Hello.<|im_end|>"
    (tmp_path / "odd.jsonl").write_text(json.dumps({"conversations": [{"from": "narrator", "value": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="turn 0 is from 'narrator'"):
        load_examples(tmp_path / "odd.jsonl", tokenizer=tok, tokens=256)


def _hub_cache(root, name: str, rows: list[dict]):
    """A dataset as `datasets.load_dataset(name)` leaves it in its cache: prepared once from a
    local file, then filed under the hub name, so it loads by name with no network."""
    import shutil

    datasets = pytest.importorskip("datasets")
    (root / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = datasets.load_dataset_builder("json", data_files={"train": str(root / "src.jsonl")},
                                            cache_dir=str(root / "prepared"))
    builder.download_and_prepare()
    (prepared,) = (root / "prepared" / "json").glob("default-*/0.0.0/*/")
    org, dataset = name.split("/")
    target = root / "cache" / f"{org}___{dataset}" / "default" / "0.0.0" / prepared.name
    shutil.copytree(prepared, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(arrow.with_name(arrow.name.replace("json-", f"{dataset}-")))
    return root / "cache"


def test_a_hub_dataset_by_name_and_a_saved_datasetdicts_split(tmp_path, monkeypatch):
    """data.path names a dataset on the hub (read from datasets' cache, offline here) with
    data.split; a saved DatasetDict takes its split the same way, and without one the error
    lists the splits and names the knob as its reader spells it."""
    datasets = pytest.importorskip("datasets")
    rows = [{"instruction": f"say {i}", "input": "", "output": f"{i}"} for i in range(4)]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", _hub_cache(tmp_path, "someone/alpaca-mini", rows))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    records = read_records("someone/alpaca-mini", split="train")
    assert [r.data for r in records] == rows and records[1].where == "someone/alpaca-mini[train] row 1"
    with pytest.raises(ValueError, match=r"someone/missing: no such local file, and datasets.load_dataset could not"):
        read_records("someone/missing")
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                                  "test": datasets.Dataset.from_list(rows[:1])})
    saved.save_to_disk(str(tmp_path / "saved"))
    assert len(read_records(tmp_path / "saved", split="test")) == 1
    with pytest.raises(ValueError, match=r"a DatasetDict with the splits train, test; pass one split: data.split"):
        read_records(tmp_path / "saved", names={"split": "data.split"})
    with pytest.raises(ValueError, match=r"has no split 'dev' with the splits train, test; pass one split: split="):
        read_records(tmp_path / "saved", split="dev")
