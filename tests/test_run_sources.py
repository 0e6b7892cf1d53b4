"""A run trained with its own tokenizer (data.tokenizer on a card with none) is read back
with it by eval, generate and export; prompts are encoded alike by eval and generate;
config-facing refusals name the config's fields; eval's framing and data.mixture's
sources are refused or read as themselves."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from linnet import cli
from linnet.commands import quickstart
from tests.conftest import quickstart_model

torch.set_num_threads(1)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer_directory(path: Path) -> Path:
    """A character tokenizer whose stop token is <|end|> (not the debug card's id 2)."""
    from linnet.data import character_tokenizer

    tok = character_tokenizer(["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"], eos="<|end|>")
    path.mkdir(parents=True)
    tok.raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|end|>",
                                                            "pad_token": "<|pad|>"}))
    return path


def config(root: Path, name: str, data: dict, **groups) -> Path:
    body = {"model": {"card": "debug", "weights": "random"}, "data": {"chat": False, **data},
            "lora": {"rank": 4}, "training": {"steps": 2, "context_length": 64}, "lr_schedule": {"warmup_steps": 1},
            "runtime": {"progress": False, "output_dir": str(root / name)}, **groups}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def records(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """An SFT run on the debug card (no tokenizer) with data.tokenizer."""
    root = tmp_path_factory.mktemp("own-tokenizer")
    tok = tokenizer_directory(root / "tok")
    data = records(root / "train.jsonl", [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(20)])
    assert cli.main(["sft", "--config", str(config(root, "sft", {"path": str(data), "tokenizer": str(tok)}))]) == 0
    records(root / "test.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)])
    return root


def test_eval_reads_the_runs_own_tokenizer(run, capsys):
    assert cli.main(["eval", str(run / "sft"), "--data", str(run / "test.jsonl"), "--no-chat",
                     "--max-new-tokens", "2"]) == 0, capsys.readouterr().err


def test_a_merged_export_holds_the_runs_tokenizer_and_its_ids_and_generates(run, capsys):
    from linnet.data import load_tokenizer

    out = run / "exported"
    assert cli.main(["export", str(run / "sft"), "--out", str(out), "--merge"]) == 0
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    tok = load_tokenizer(run / "tok")
    assert config["eos_token_id"] == list(tok.eos_ids) and config["pad_token_id"] == tok.pad_id
    assert config["bos_token_id"] is None  # the run's tokenizer starts prompts with none
    assert cli.main(["generate", str(out), "--chat", "--prompt", "1+1=", "--max-new-tokens", "2"]) == 0, \
        capsys.readouterr().err


def test_an_export_carries_the_runs_own_chat_template(run):
    """A run's data.chat_template (over its tokenizer folder's) is the template its export
    and `linnet generate --chat` on that export use."""
    from linnet.data import load_tokenizer

    own = TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|>A:{% endif %}")
    path = config(run, "templated", {"path": str(run / "train.jsonl"), "tokenizer": str(run / "tok"),
                                     "chat_template": own})
    assert cli.main(["sft", "--config", str(path)]) == 0
    assert cli.main(["export", str(run / "templated"), "--out", str(run / "templated-export"), "--merge"]) == 0
    assert load_tokenizer(run / "templated-export").chat_template == own


def test_generate_encodes_a_prompt_as_eval_does(tmp_path):
    """The quickstart's bare tokenizer.json adds no BOS; its card's goes first in both."""
    import argparse

    from linnet import nest
    from linnet.commands.generate import _encode
    from linnet.data import load_tokenizer, prompts_from_records
    from linnet.data.readers import Record

    model = quickstart_model(tmp_path / "model")
    tok, card = load_tokenizer(model), nest.resolve(model)
    args = argparse.Namespace(prompt="76+93=", chat=False, system=None)
    (evaluated,) = prompts_from_records([Record("x", {"prompt": "76+93=", "answer": "169"})], tok, chat=False,
                                        card=card)
    assert _encode(tok, card, args) == list(evaluated.ids) == [quickstart.BOS, *quickstart.encode("76+93=")]


def test_serve_starts_a_prompt_with_the_tokenizers_own_bos(tmp_path):
    """A tokenizer with a BOS of its own (its post-processor adds one) has it put first by
    serve, as eval and generate do: Tokenizer.encode adds no special tokens."""
    pytest.importorskip("fastapi", reason="linnet serve needs FastAPI")
    import tokenizers

    from linnet.commands.serve import load_served

    model = quickstart_model(tmp_path / "model")
    raw = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    raw.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.save(str(model / "tokenizer.json"))
    served = load_served(str(model), "m")["m"]
    assert served.tokenizer.bos_id == served.bos == quickstart.BOS


def test_a_module_in_the_working_directory_names_a_reward_and_an_environment(tmp_path, monkeypatch):
    from linnet.rl.environments import environment_factory
    from linnet.rl.rewards import resolve

    package = tmp_path / "my_local_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("def one(prompt, completion):\n    return 1.0\n\n\n"
                                         "class Env:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve("my_local_rewards:one", None)(None, [1]) == 1.0
    assert environment_factory("my_local_rewards:Env").__name__ == "Env"


def test_a_config_commands_refusal_names_the_config_field(tmp_path, capsys):
    from linnet import nest
    from linnet.data import load_tokenizer

    data = records(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}] * 4)
    assert cli.main(["inspect", "--config", str(config(tmp_path, "a", {"path": str(data)}))]) == 2
    assert "set data.tokenizer" in capsys.readouterr().err
    bare = config(tmp_path, "b", {"path": str(data), "tokenizer": str(tokenizer_directory(tmp_path / "tok"))},
                  model={"card": "debug"})
    assert cli.main(["sft", "--config", str(bare)]) == 2
    assert "set model.weights: random" in capsys.readouterr().err
    assert cli.main(["sft", "--set", "model.card=debug", "--set", f"data.path={data}"]) == 2  # a config from --set
    assert "set data.tokenizer" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"pass it: load_tokenizer\("):  # Python callers keep Python's fix
        load_tokenizer("debug")
    with pytest.raises(ValueError, match="pass weights='random'"):
        nest.load("debug")


def test_eval_names_a_shot_separator_the_model_cannot_spell(tmp_path, capsys):
    model = quickstart_model(tmp_path / "model")
    data = records(tmp_path / "h.jsonl", [{"prompt": p, "answer": a}
                                          for p, a in quickstart.problems(np.random.default_rng(0),
                                                                          8, 2)])
    assert cli.main(["eval", str(model), "--data", str(data), "--no-chat", "--max-new-tokens", "2",
                     "--system", "1+1=2"]) == 2
    err = capsys.readouterr().err
    assert "--shot-separator '\\n\\n'" in err and "h.jsonl" not in err


def test_a_mixture_reads_each_source_as_its_own_shape_and_names_them(tmp_path, capsys):
    tok = tokenizer_directory(tmp_path / "tok")
    chats = records(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i % 5}"},
                                                             {"role": "assistant", "content": "a"}]}
                                               for i in range(40)])
    pairs = records(tmp_path / "pairs.jsonl", [{"prompt": f"p{i}", "completion": "c"} for i in range(40)])
    path = config(tmp_path, "mix", {"mixture": [{"path": str(chats), "weight": 1}, {"path": str(pairs), "weight": 1}],
                                    "tokenizer": str(tok), "chat": True, "eval_share": 0.25})
    assert cli.main(["inspect", "--config", str(path)]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert f"{chats} and {pairs} (data.eval_share's held-out share)" in err
    assert f"training records of {chats} and {pairs}" in err


def test_a_runs_base_that_is_not_found_names_the_runs_config(tmp_path, monkeypatch):
    """A LoRA run whose model.card is a relative path (or a name) not found from where the
    command runs: the error names the run's config.json, for the loaders and resolve alike."""
    from linnet.cards import resolve
    from linnet.export import load_trained

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"command": "sft"}))
    (run / "config.json").write_text(json.dumps({"model": {"card": "my-base"}}))
    (run / "final" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "my-base"}))
    monkeypatch.chdir(tmp_path)
    for load in (load_trained, resolve):
        with pytest.raises(ValueError, match=r"run/config.json: model.card 'my-base' is not a registered card nor a "
                                             r"path from here"):
            load(run)


def test_a_runs_relative_paths_are_read_from_where_it_trained(tmp_path, monkeypatch, capsys):
    """A LoRA run whose model.card and data.tokenizer are relative paths is read from
    another folder: eval, export and the run's checkpoints find them where it trained."""
    from linnet.cards import resolve

    trained_in, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    quickstart_model(trained_in / "base")
    elsewhere.mkdir()
    (trained_in / "tok").mkdir()
    (trained_in / "tok" / "tokenizer.json").write_text((trained_in / "base" / "tokenizer.json").read_text())
    problems = quickstart.problems(np.random.default_rng(0), 40, 2)
    records(trained_in / "d.jsonl", [{"prompt": p, "completion": a} for p, a in problems])
    monkeypatch.chdir(trained_in)
    path = config(trained_in, "sft", {"path": "d.jsonl", "tokenizer": "tok"}, model={"card": "base"},
                  training={"steps": 2, "context_length": 64, "checkpoint_every": 1})
    assert cli.main(["sft", "--config", str(path)]) == 2  # a tokenizer.json alone names no stop token
    assert capsys.readouterr().err.endswith("tok: no stop token to end a completion; name one as eos_token in the "
                                            "tokenizer_config.json beside its tokenizer.json\n")
    (trained_in / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert cli.main(["sft", "--config", str(path)]) == 0
    monkeypatch.chdir(elsewhere)
    run = trained_in / "sft"
    for source in (run, run / "checkpoints" / "step-00000002"):
        assert resolve(source).tokenizer.path == str(trained_in / "tok")
    held = records(elsewhere / "h.jsonl", [{"prompt": p, "answer": a} for p, a in problems[:4]])
    assert cli.main(["eval", str(run), "--data", str(held), "--no-chat", "--max-new-tokens", "2"]) == 0, \
        capsys.readouterr().err
    assert cli.main(["export", str(run), "--out", "out"]) == 0, capsys.readouterr().err
    assert (elsewhere / "out" / "adapter_config.json").is_file()
    (trained_in / "base").rename(tmp_path / "moved")  # gone from both places: refused, naming the run's config
    with pytest.raises(ValueError, match=r"sft/config.json: model.card 'base' is not a registered card nor a path "
                                         r"from here or from where the run trained"):
        resolve(run)


def test_eval_and_export_take_a_checkpoint_of_an_unfinished_run(tmp_path, capsys):
    """A run's checkpoints/step-N is a model for eval and export (what the refusal of a run
    without final/ points to), with its adapters folded in."""
    base = quickstart_model(tmp_path / "base")
    problems = quickstart.problems(np.random.default_rng(0), 40, 2)
    data = records(tmp_path / "d.jsonl", [{"prompt": p, "completion": a} for p, a in problems])
    path = config(tmp_path, "sft", {"path": str(data)}, model={"card": str(base)},
                  training={"steps": 2, "context_length": 64, "checkpoint_every": 1})
    assert cli.main(["sft", "--config", str(path)]) == 0
    checkpoint = tmp_path / "sft" / "checkpoints" / "step-00000001"
    held = records(tmp_path / "h.jsonl", [{"prompt": p, "answer": a} for p, a in problems[:4]])
    assert cli.main(["eval", str(checkpoint), "--data", str(held), "--no-chat", "--max-new-tokens", "2"]) == 0, \
        capsys.readouterr().err
    assert cli.main(["export", str(checkpoint), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_eval_refuses_lengths_that_cannot_be_sampled(tmp_path, capsys):
    """Past the card's positions a completion is noise, and a length below 1 means
    nothing: eval refuses both by flag, as generate does, before measuring."""
    model = quickstart_model(tmp_path / "model")
    held = records(tmp_path / "h.jsonl", [{"prompt": "12+34=", "answer": "046"}])
    positions = quickstart.CARD.max_positions
    for flags, message in ((["--max-new-tokens", str(positions)], "passes .* positions; lower --max-new-tokens to at "
                                                                  f"most {positions - 7}"),
                           (["--context-length", "-5"], "--context-length -5: give a positive number")):
        assert cli.main(["eval", str(model), "--data", str(held), "--no-chat", *flags]) == 2
        assert re.search(message, capsys.readouterr().err)
    assert cli.main(["eval", str(model), "--data", str(held), "--no-chat"]) == 0, capsys.readouterr().err  # 256 capped
    assert cli.main(["generate", str(model), "--prompt", "12+34="]) == 0, capsys.readouterr().err


def test_resume_on_a_folder_without_a_run_says_it_starts_one(tmp_path, capsys):
    from linnet.commands.run_directory import RunDirectory
    from linnet.config import SFTConfig, load

    data = records(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}] * 4)
    run = RunDirectory(load(SFTConfig, config(tmp_path, "fresh", {"path": str(data)})), overwrite=False, resume=True)
    assert run.step == 0
    assert f"{tmp_path / 'fresh'} holds no run yet: --resume starts one" in capsys.readouterr().err
