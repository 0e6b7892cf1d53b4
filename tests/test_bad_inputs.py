"""Bad input to every command, table-driven: each is refused with exit status 2 and one
line naming the file, the field or the fix, no traceback, and every file that existed
before is byte-identical after (nothing written, nothing lost)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from linnet import cli
from linnet.commands import quickstart
from tests.conftest import quickstart_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A tiny model, data for every command, configs, a finished SFT run, a prepared
    token cache, a stand-in pretraining run, a folder of other files and a plain file."""
    from conftest import word_tokenizer

    root = tmp_path_factory.mktemp("bad")
    quickstart_model(root / "model")
    rng = np.random.default_rng(0)
    problems = quickstart.problems(rng, 60, 2)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in problems))
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": p, "chosen": a, "rejected": f"{(int(a) + 1) % 200:03d}"}) + "\n" for p, a in problems))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in problems))
    common = {"model": {"card": str(root / "model")}, "lora": {"rank": 4},
              "optimizer": {"lr": 1e-3}, "lr_schedule": {"warmup_steps": 1}, "runtime": {"progress": False}}
    configs = {
        "sft": {"data": {"path": str(root / "train.jsonl"), "chat": False}, "training": {"steps": 2,
                                                                                          "context_length": 64}},
        "dpo": {"data": {"path": str(root / "pairs.jsonl"), "chat": False}, "training": {"steps": 2,
                                                                                          "context_length": 64},
                "dpo": {"pairs_per_step": 4}},
        "grpo": {"data": {"path": str(root / "prompts.jsonl"), "chat": False}, "training": {"steps": 2,
                                                                                             "context_length": 64},
                 "grpo": {"group": 2, "prompts_per_step": 2, "max_new_tokens": 3}},
    }
    for name, config in configs.items():
        config = {**common, **config, "runtime": {**common["runtime"], "output_dir": str(root / "runs" / name)}}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["sft", "--config", str(root / "sft.yaml"), "--set", f"runtime.output_dir={root / 'done'}",
                     "--set", "training.checkpoint_every=1"]) == 0
    word_tokenizer(root / "tok.json")
    (root / "corpus.txt").write_text("\n".join(" ".join(f"w{(i * j) % 40}" for j in range(12)) for i in range(300)))
    pretrain = {"data": {"cache": str(root / "cache"), "source": [str(root / "corpus.txt")],
                         "tokenizer": str(root / "tok.json"), "document_split": "line", "shard_tokens": 300,
                         "prepare_workers": 1, "overlap": "off"},  # its lines repeat: a warning would join each refusal
                "model": {"hidden": 32, "intermediate": 64, "layers": 1, "heads": 2, "vocab": 64},
                "training": {"context_length": 16, "micro_batch_size": 2, "accumulation": 1, "total_targets": 256,
                             "epochs": 2},
                "lr_schedule": {"warmup_steps": 1}, "evaluation": {"subset_sequences": 4, "batch_size": 2},
                "runtime": {"progress": False, "output_dir": str(root / "runs" / "pretrain")}}
    (root / "pretrain.yaml").write_text(yaml.safe_dump(pretrain))
    assert cli.main(["prepare", "--config", str(root / "pretrain.yaml")]) == 0
    (root / "fake-pretrain").mkdir()
    (root / "fake-pretrain" / "run.json").write_text(json.dumps({"command": "pretrain", "recipe": {}}))
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("not a run\n")
    (root / "afile").write_text("a plain file\n")
    return root


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _copy(ws: Path, name: str, change: Callable[[Path], None]) -> Path:
    """A copy of a workspace file, changed: the bad input of one case."""
    (ws / "cases").mkdir(exist_ok=True)
    target = Path(tempfile.mkdtemp(dir=ws / "cases")) / name
    if (ws / name).is_dir():
        shutil.copytree(ws / name, target, dirs_exist_ok=True)
    else:
        shutil.copy(ws / name, target)
    change(target)
    return target


def _lines(path: Path, *records: dict | str) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _bad_config_json(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = str(config["hidden_size"])
    (path / "config.json").write_text(json.dumps(config))


def _truncate(path: Path) -> None:
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _damage_latest(path: Path) -> None:
    latest = sorted((path / "checkpoints").iterdir())[-1]
    (latest / "trained.safetensors").write_bytes(b"\0" * 64)


def _perturb_weights(path: Path) -> None:
    """The model's weights replaced by other (valid) ones, under the same name."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _retokenize(path: Path) -> None:
    """The model's tokenizer replaced by another (valid) one of the same size: two
    digits' ids swapped."""
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (path / "tokenizer.json").write_text(json.dumps(spec))


def _in_run(ws: Path, where: str, source: str) -> Path:
    """A copy of the finished run `done` with a copy of the workspace's `source` placed at
    `where` inside it; returns that copy of the run."""
    def place(run: Path) -> None:
        target = run / where
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ws / source).is_dir() else shutil.copy)(ws / source, target)

    return _copy(ws, "done", place)


def _resume_from_damaged(ws: Path) -> list[str]:
    run = _copy(ws, "done", _damage_latest)
    latest = sorted((run / "checkpoints").iterdir())[-1]
    return ["sft", "--config", str(ws / "sft.yaml"), "--set", f"runtime.output_dir={run}", "--resume-from", str(latest)]


def SFT(*sets: str) -> Callable[[Path], list[str]]:
    return lambda ws: ["sft", "--config", str(ws / "sft.yaml"), *[a for s in sets for a in ("--set", s)]]


def DPO(*sets: str) -> Callable[[Path], list[str]]:
    return lambda ws: ["dpo", "--config", str(ws / "dpo.yaml"), *[a for s in sets for a in ("--set", s)]]


def GRPO(*sets: str) -> Callable[[Path], list[str]]:
    return lambda ws: ["grpo", "--config", str(ws / "grpo.yaml"), *[a for s in sets for a in ("--set", s)]]


def PRETRAIN(*sets: str, command: str = "pretrain") -> Callable[[Path], list[str]]:
    return lambda ws: [command, "--config", str(ws / "pretrain.yaml"), *[a for s in sets for a in ("--set", s)]]


# (case, argv from the workspace, what the one line must say)
CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    # the config: values, names, fields a command does not read
    ("steps-zero", SFT("training.steps=0"), r"training.steps=0; it must be a positive integer"),
    ("lr-negative", SFT("optimizer.lr=-1"), r"optimizer.lr=-1.0; use a positive, finite"),
    ("lr-nan", SFT("optimizer.lr=.nan"), r"optimizer.lr=nan"),
    ("lr-inf", SFT("optimizer.lr=.inf"), r"optimizer.lr=inf"),
    ("betas-length", SFT("optimizer.betas=[0.9]"), r"optimizer.betas=\[0.9\]; give two numbers"),
    ("clip-negative", SFT("optimizer.grad_clip=-1"), r"optimizer.grad_clip=-1.0; use a positive threshold"),
    ("clip-zero", SFT("optimizer.grad_clip=0"), r"optimizer.grad_clip=0.0"),
    ("epochs-inf", SFT("training.steps=null", "training.epochs=.inf"), r"training.epochs=inf"),
    ("keep-zero", SFT("training.keep=0"), r"training.keep=0"),
    ("threads-negative", SFT("runtime.threads=-2"), r"runtime.threads=-2"),
    ("set-not-yaml", SFT("data.path=[unclosed"), r"--set 'data.path=\[unclosed': .* is not a YAML value"),
    ("set-no-equals", lambda ws: ["sft", "--config", str(ws / "sft.yaml"), "--set", "training.steps"],
     r"expected KEY=VALUE"),
    ("unknown-field", SFT("training.stpes=3"), r"unknown field 'stpes'"),
    ("former-accumulate", SFT("training.accumulate=2"), r"training.accumulate is a former field.*accumulation"),
    ("former-output", SFT("output=x"), r"output is a former field.*runtime.output_dir"),
    ("former-schedule", SFT("schedule.warmup=2"), r"schedule is a former field.*warmup_steps"),
    ("unread-field", SFT("training.targets_per_parameter=5"), r"targets_per_parameter is not read by `linnet sft`"),
    ("lora-rank", SFT("lora.rank=0"), r"lora.rank=0"),
    ("lora-dropout", SFT("lora.dropout=1.5"), r"lora.dropout=1.5"),
    ("schedule-name", SFT("lr_schedule.name=linear"), r"lr_schedule.name: 'linear' is not one of"),
    ("context-short", SFT("training.context_length=8"), r"training.context_length=8; a packed row needs"),
    ("eval-share", SFT("data.eval_share=1.5"), r"data.eval_share=1.5"),
    ("split-shard", SFT("training.split=2", "training.shard=zero"), r"training.split=2 with training.shard=zero is not supported"),
    ("shard-name", SFT("training.shard=ddp"), r"training.shard: 'ddp' is not one of"),
    ("config-missing", lambda ws: ["sft", "--config", str(ws / "nope.yaml")], r"nope.yaml: no such config file"),
    ("config-not-yaml", lambda ws: ["sft", "--config", str(_copy(ws, "sft.yaml", lambda p: p.write_text(
        "model: [\n")))], r"sft.yaml line 2 column 1: not valid YAML \(expected the node content, but found "
                            r"'<stream end>'\); fix the file there$"),
    # every value checked, every name answered (issue 41)
    ("wd-nan", SFT("optimizer.weight_decay=.nan"), r"--set optimizer.weight_decay=.nan: optimizer.weight_decay=nan; "
     r"use a finite number"),
    ("wd-inf", SFT("optimizer.weight_decay=inf"), r"optimizer.weight_decay=inf; use a finite number"),
    ("wd-absurd", SFT("optimizer.weight_decay=5000"), r"optimizer.weight_decay=5000 with optimizer.lr=0.001: AdamW's "
     r"decoupled decay multiplies .* by 1 - lr x weight_decay = -4"),
    ("dpo-beta-inf", DPO("dpo.beta=.inf"), r"dpo.beta=inf; use a finite number"),
    ("dpo-smoothing-ipo", DPO("dpo.loss_type=ipo", "dpo.label_smoothing=0.1"),
     r"dpo.label_smoothing=0.1 is read by dpo.loss_type sigmoid, robust or simpo only, and dpo.loss_type=ipo would "
     r"ignore it"),
    ("dpo-kto-weight-sigmoid", DPO("dpo.desirable_weight=2"), r"dpo.desirable_weight=2.0 is read by dpo.loss_type kto"),
    ("grpo-beta-nan", GRPO("grpo.beta=.nan"), r"grpo.beta=nan; use a finite number"),
    ("grpo-clip-inf", GRPO("grpo.clip=[0.2, .inf]"), r"grpo.clip\[1\]=inf; use a finite number"),
    ("grpo-pass-reward-nan", GRPO("grpo.pass_reward=.nan"), r"grpo.pass_reward=nan"),
    ("grpo-temperature-zero", GRPO("grpo.temperature=0"), r"grpo.temperature=0 samples greedily: .* nothing is learned"),
    ("reward-margin-nan", lambda ws: ["reward", *SFT("reward.margin=.nan")(ws)[1:]], r"reward.margin=nan"),
    ("lora-dora-disabled", SFT("lora.enabled=false", "lora.dora=true"),
     r"lora.enabled=false trains every weight, without adapters, so lora.rank=4, lora.dora=true would be ignored"),
    ("lora-rank-huge", SFT("lora.rank=100000"), r"rank=100000 is larger than the adapted layer .*: .* the largest "
     r"useful rank is \d+"),
    ("lora-target-typo", SFT("lora.targets=[qq_proj]"), r"^linnet sft: lora.targets: pattern 'qq_proj' matches no linear weight; .*q_proj "
     r"\(PEFT's target_modules\), or all-linear"),
    ("lora-target-head", SFT("lora.targets=[lm_head]"), r"lora.targets: pattern 'lm_head' matches no linear weight; "
     r".*; the output head takes no adapter \(it trains in full fine-tuning, lora.enabled: false\)$"),
    ("config-twice", lambda ws: ["sft", "--config", str(_copy(ws, "sft.yaml", lambda p: p.write_text(
        p.read_text() + "optimizer:\n  lr: 0.5\n")))], r"sft.yaml line \d+: optimizer is given twice \(lines \d+ and "
     r"\d+\); .* keep one"),
    ("config-directory", lambda ws: ["sft", "--config", str(ws / "other")], r"other: is a directory; --config takes"),
    ("config-not-utf8", lambda ws: ["sft", "--config", str(_copy(ws, "sft.yaml", lambda p: p.write_bytes(
        b"model: \xff\xfe\n")))], r"sft.yaml: not a UTF-8 text file"),
    ("unknown-trl-name", SFT("learning_rate=1e-4"), r"--set learning_rate=1e-4: unknown field 'learning_rate' \(a TRL, "
     r"PEFT or Axolotl name\); use optimizer.lr"),
    ("unknown-axolotl-name", SFT("sequence_len=512"), r"unknown field 'sequence_len' .*; use training.context_length"),
    ("unknown-nearest", SFT("optimizer.weight_decy=0.1"), r"unknown field 'weight_decy' in optimizer; did you mean "
     r"optimizer.weight_decay\?"),
    ("unknown-moved", SFT("seed=3"), r"unknown field 'seed'; did you mean runtime.seed\?"),
    ("unknown-word", SFT("training.warmup=3"), r"unknown field 'warmup' in training; did you mean lr_schedule.warmup_steps\?"),
    ("unknown-batch-size", SFT("training.batch_size=4"), r"unknown field 'batch_size' in training .*; linnet has none: a "
     r"micro-batch is one packed row"),
    ("other-commands-group", lambda ws: ["sft", "--config", str(ws / "dpo.yaml")], r"dpo.yaml line \d+: the dpo group "
     r"belongs to a `linnet dpo` config, which `linnet sft` does not read; run `linnet dpo --config .*dpo.yaml`$"),
    ("range-in-file", lambda ws: ["sft", "--config", str(_copy(ws, "sft.yaml", lambda p: p.write_text(
        yaml.safe_dump({**yaml.safe_load(p.read_text()), "lora": {"rank": 4, "dropout": 2}}))))],
     r"sft.yaml line \d+: lora.dropout=2.0; it must be in \[0, 1\)$"),
    ("schedule-fit", SFT("lr_schedule.warmup_steps=5"), r"--set lr_schedule.warmup_steps=5: lr_schedule.warmup_steps=5 "
     r"is more than the run's 2 steps; lower lr_schedule.warmup_steps \(0: no warmup\) or train for more steps$"),
    ("card-unknown", SFT("model.card=no-such-card"), r"--set model.card=no-such-card: model.card: unknown card "
     r"'no-such-card': not a registered name"),
    ("tokenizer-missing", SFT("data.tokenizer=/nonexistent"), r"--set data.tokenizer=/nonexistent: "
     r"data.tokenizer='/nonexistent': no such directory; give a directory holding tokenizer.json"),
    ("tokenizer-no-json", lambda ws: SFT(f"data.tokenizer={ws / 'other'}")(ws), r"data.tokenizer: .*other: no "
     r"tokenizer.json"),
    ("weights-missing", SFT("model.weights=/nonexistent"), r"--set model.weights=/nonexistent: model.weights: "
     r"/nonexistent: no weights found"),
    ("unknown-several", lambda ws: ["sft", "--config", str(_copy(ws, "sft.yaml", lambda p: p.write_text(
        p.read_text() + "lora_r: 8\nnum_train_epochs: 2\n"))), "--set", "training.stpes=3"],
     r"3 fields are not read by `linnet sft`:$"),
    # the data
    ("data-missing", SFT("data.path=/nonexistent/train.jsonl"), r"train.jsonl: no such file"),
    ("data-empty", lambda ws: SFT(f"data.path={_copy(ws, 'train.jsonl', lambda p: p.write_text(''))}")(ws),
     r"holds no records"),
    ("data-not-json", lambda ws: SFT(f"data.path={_copy(ws, 'train.jsonl', lambda p: _lines(p, '{oops'))}")(ws),
     r"train.jsonl line 1: not valid JSON"),
    ("data-no-completion", lambda ws: SFT(f"data.path={_copy(ws, 'train.jsonl', lambda p: _lines(p, {'prompt': '1+2='}))}")(ws),
     r"line 1: .*completion"),
    ("data-empty-completion", lambda ws: SFT(f"data.path={_copy(ws, 'train.jsonl', lambda p: _lines(p, {'prompt': '01+02=', 'completion': ' '}))}")(ws),
     r"line 1: field 'completion' is empty"),
    ("data-unknown-text", lambda ws: SFT(f"data.path={_copy(ws, 'train.jsonl', lambda p: _lines(p, *[{'prompt': 'what is one plus two?', 'completion': 'three'}] * 4))}")(ws),
     r"of the tokens .* are the unknown token '<pad>'"),
    ("data-unknown-role", lambda ws: SFT(f"data.path={_copy(ws, 'train.jsonl', lambda p: _lines(p, {'messages': [{'role': 'user', 'content': '1+2='}, {'role': 'narrator', 'content': 'x'}, {'role': 'assistant', 'content': '003'}]}))}", "data.chat=true")(ws),
     r"messages\[1\] has the role 'narrator'"),
    ("model-missing-card", SFT("model.card=no-such-card"), r"unknown card 'no-such-card'"),
    ("model-truncated-weights", lambda ws: SFT(f"model.card={_copy(ws, 'model', _truncate)}")(ws),
     r"model.safetensors: not a readable safetensors file"),
    ("model-config-string", lambda ws: SFT(f"model.card={_copy(ws, 'model', _bad_config_json)}")(ws),
     r"config.json: hidden_size is '\d+'; it must be an integer"),
    ("model-tokenizer-empty", lambda ws: SFT(f"model.card={_copy(ws, 'model', lambda p: (p / 'tokenizer.json').write_text(''))}")(ws),
     r"tokenizer.json: not a readable tokenizer.json"),
    ("device-cuda", SFT("runtime.device=cuda"), r"runtime.device=cuda: no CUDA device is visible"),
    # the run directory
    ("out-is-file", lambda ws: SFT(f"runtime.output_dir={ws / 'afile'}")(ws), r"afile: runtime.output_dir is a file"),
    ("out-under-file", lambda ws: SFT(f"runtime.output_dir={ws / 'afile' / 'run'}")(ws), r"is a file, so runtime.output_dir"),
    ("out-used", lambda ws: SFT(f"runtime.output_dir={ws / 'done'}")(ws), r"pass --resume .* or --overwrite"),
    ("out-overwrite-other", lambda ws: [*SFT(f"runtime.output_dir={ws / 'other'}")(ws), "--overwrite"],
     r"other: holds files but no linnet run"),
    ("resume-and-overwrite", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}")(ws), "--resume", "--overwrite"],
     r"give one of them"),
    ("resume-changed-data", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}", f"data.path={_copy(ws, 'train.jsonl', lambda p: _lines(p, *p.read_text().splitlines()[:-1]))}")(ws), "--resume"],
     r"another config or data; differing: data.fingerprint: .*train.jsonl holds other records than those the run "
     r"began with"),
    ("resume-changed-lr", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}", "optimizer.lr=0.5")(ws), "--resume"],
     r"differing: optimizer.lr: 0.001 \(run\) vs 0.5"),
    ("resume-other-kind", lambda ws: [*SFT(f"runtime.output_dir={ws / 'fake-pretrain'}")(ws), "--resume"],
     r"a `linnet pretrain` run, not a `linnet sft` one"),
    ("resume-from-no-run", lambda ws: [*SFT(f"runtime.output_dir={ws / 'fresh'}")(ws), "--resume-from", str(ws / "other")],
     r"--resume-from .*other: .*fresh \(runtime.output_dir\) holds no run to resume"),
    ("resume-from-elsewhere", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}")(ws), "--resume-from", str(ws / "other")],
     r"--resume-from takes a checkpoint of this run"),
    ("resume-from-damaged", lambda ws: _resume_from_damaged(ws),
     r"trained.safetensors: corrupt or truncated .*--resume-from"),
    # nothing a user owns is overwritten, only a run's own files of the same command (issue 41)
    ("overwrite-other-command", lambda ws: [*SFT(f"runtime.output_dir={_copy(ws, 'fake-pretrain', lambda p: (p / 'run.json').write_text(json.dumps({'command': 'dpo', 'recipe': {}})))}")(ws), "--overwrite"],
     r"run.json: a `linnet dpo` run; `linnet sft --overwrite` replaces only a `linnet sft` run"),
    ("overwrite-data-in-final", lambda ws: (lambda run: [*SFT(f"runtime.output_dir={run}", f"data.path={run / 'final' / 'train.jsonl'}")(ws), "--overwrite"])(_in_run(ws, "final/train.jsonl", "train.jsonl")),
     r"data.path=.*final/train.jsonl lies in .*final, which --overwrite replaces: an output is never an input"),
    ("overwrite-model-in-checkpoints", lambda ws: (lambda run: [*SFT(f"runtime.output_dir={run}", f"model.card={run / 'checkpoints' / 'base'}")(ws), "--overwrite"])(_in_run(ws, "checkpoints/base", "model")),
     r"model.card=.*checkpoints/base lies in .*checkpoints, which --overwrite replaces"),
    ("eval-json-is-data", lambda ws: ["eval", str(ws / "model"), "--data", str(ws / "prompts.jsonl"), "--json", str(ws / "prompts.jsonl")],
     r"--json .*prompts.jsonl is the --data file: eval never writes over its input"),
    ("eval-json-other-file", lambda ws: ["eval", str(ws / "model"), "--data", str(ws / "prompts.jsonl"), "--json", str(ws / "afile")],
     r"--json .*afile: exists and is not a `linnet eval` result"),
    ("eval-json-model-file", lambda ws: ["eval", str(ws / "done"), "--data", str(ws / "prompts.jsonl"), "--json", str(ws / "done" / "final" / "adapter_config.json")],
     r"--json .*adapter_config.json: a file of the model or run .*done, which eval reads"),
    ("eval-json-new-model-file", lambda ws: ["eval", str(ws / "model"), "--data", str(ws / "prompts.jsonl"), "--json", str(ws / "model" / "generation_config.json")],
     r"generation_config.json: a file of the model or run"),
    ("pretrain-overwrite-sft-run", lambda ws: [*PRETRAIN(f"runtime.output_dir={ws / 'done'}")(ws), "--overwrite"],
     r"done/run.json: a `linnet sft` run; `linnet pretrain --overwrite` replaces only a `linnet pretrain` run"),
    ("quickstart-out-sft-run", lambda ws: ["quickstart", "--steps", "1", "--out", str(ws / "done"), "--overwrite"],
     r"done: holds a `linnet sft` run; `linnet quickstart --overwrite` replaces only a quickstart run"),
    # a resumed run: its budget extended, never cut below what it did; its model by its files (issue 41)
    ("resume-fewer-steps", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}", "training.steps=1")(ws), "--resume"],
     r"training.steps=1 is fewer than the 2 steps the run has taken"),
    ("resume-steps-to-epochs", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}", "training.steps=null", "training.epochs=3")(ws), "--resume"],
     r"the run's budget is training.steps=2; extend it with a larger training.steps, not training.epochs"),
    ("resume-changed-weights", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}", f"model.card={_copy(ws, 'model', _perturb_weights)}")(ws), "--resume"],
     r"differing: model.card: .*/model.safetensors changed since the run began"),
    ("resume-changed-tokenizer", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}", f"model.card={_copy(ws, 'model', _retokenize)}")(ws), "--resume"],
     r"differing: model.card: .*/tokenizer.json changed since the run began"),
    ("resume-changed-lr-extended", lambda ws: [*SFT(f"runtime.output_dir={ws / 'done'}", "training.steps=4", "optimizer.lr=0.5")(ws), "--resume"],
     r"differing: optimizer.lr: 0.001 \(run\) vs 0.5"),
    # records (issue 41)
    ("grpo-answer-null", lambda ws: GRPO(f"data.path={_copy(ws, 'prompts.jsonl', lambda p: _lines(p, {'prompt': '01+02=', 'answer': None}))}")(ws),
     r"line 1: field 'answer' is null, no reference answer"),
    ("grpo-answer-empty", lambda ws: GRPO(f"data.path={_copy(ws, 'prompts.jsonl', lambda p: _lines(p, {'prompt': '01+02=', 'answer': ''}))}")(ws),
     r"line 1: field 'answer' is \"\", no reference answer"),
    ("dpo-same-after-encoding", lambda ws: DPO(f"data.path={_copy(ws, 'pairs.jsonl', lambda p: _lines(p, {'prompt': '01+02=', 'chosen': '00é', 'rejected': '00ü'}, *p.read_text().splitlines()))}")(ws),
     r"pairs.jsonl line 1: 'chosen' and 'rejected' encode to the same tokens"),
    # devices and attention paths a run cannot use (issue 41)
    ("device-mps", SFT("runtime.device=mps"), r"runtime.device=mps: linnet computes on cpu or cuda \(cuda:N\); mps is not"),
    ("device-tpu", SFT("runtime.device=tpu"), r"runtime.device=tpu: not a device name; use cpu, cuda or cuda:N"),
    ("config-binary", lambda ws: ["sft", "--config", str(_copy(ws, "sft.yaml", lambda p: p.write_bytes(b"\x00\x01model: x\n")))],
     r"sft.yaml: a binary file \(byte 0x00 at offset 0\), not YAML text; --config takes a YAML file"),
    ("attention-flex-cpu", SFT("model.attention=flex", "runtime.device=cpu"), r"attention='flex' cannot train on a CPU"),
    # dpo
    ("dpo-same-answers", lambda ws: DPO(f"data.path={_copy(ws, 'pairs.jsonl', lambda p: _lines(p, {'prompt': '1+2=', 'chosen': '003', 'rejected': '003'}))}")(ws),
     r"line 1: 'chosen' and 'rejected' are the same answer"),
    ("dpo-empty-answer", lambda ws: DPO(f"data.path={_copy(ws, 'pairs.jsonl', lambda p: _lines(p, {'prompt': '1+2=', 'chosen': '003', 'rejected': ''}))}")(ws),
     r"line 1: the 'rejected' answer is empty"),
    ("dpo-pairs-per-step", DPO("dpo.pairs_per_step=1000"), r"dpo.pairs_per_step=1000 is more than the 57 training examples"),
    ("dpo-beta", DPO("dpo.beta=0"), r"--set dpo.beta=0: dpo.beta=0.0; it must be > 0$"),
    ("dpo-label-smoothing", DPO("dpo.label_smoothing=0.7"), r"dpo.label_smoothing=0.7; it must be in \[0, 0.5\)$"),
    ("dpo-rpo-orpo", DPO("dpo.loss_type=orpo", "dpo.rpo_alpha=1"), r"dpo.rpo_alpha=1.0; use a finite weight >= 0, "
     r"and 0 with dpo.loss_type orpo"),
    ("dpo-accumulation", DPO("training.accumulation=2"), r"accumulation is not read by `linnet dpo`"),
    ("dpo-two-prompts", DPO("data.prompt=[a, b]"), r"`linnet dpo` reads one prompt field"),
    ("dpo-row-short", DPO("training.context_length=16"), r"needs .* positions .* raise training.context_length"),
    # grpo
    ("grpo-clip-low", GRPO("grpo.clip=[1.5, 0.2]"), r"grpo.clip=\[1.5, 0.2\]; give \[low, high\]"),
    ("grpo-clip-former", GRPO("grpo.clip_low=0.3"), r"grpo.clip_low.*use grpo.clip: \[low, high\]"),
    ("grpo-bad-regex", GRPO("grpo.rewards=[format]", "grpo.format_pattern=("), r"grpo.format_pattern='\(' is not a regular expression"),
    ("grpo-unknown-reward", GRPO("grpo.rewards=[nosuch]"), r"grpo.rewards 'nosuch': use exact, numeric, format"),
    ("grpo-reward-import", GRPO("grpo.rewards=[nosuch_module:f]"), r"grpo.rewards 'nosuch_module:f': cannot import"),
    ("grpo-group", GRPO("grpo.group=1"), r"grpo.group >= 2"),
    ("grpo-prompts-per-step", GRPO("grpo.prompts_per_step=999"), r"grpo.prompts_per_step=999 is more than"),
    ("grpo-pass-k", GRPO("grpo.pass_k=1"), r"grpo.pass_k is 0 \(off\) or >= 2"),
    ("grpo-no-answer", lambda ws: GRPO(f"data.path={_copy(ws, 'prompts.jsonl', lambda p: _lines(p, {'prompt': '1+2='}))}")(ws),
     r"line 1: missing field 'answer'"),
    ("grpo-top-p", GRPO("grpo.top_p=2"), r"grpo.top_p in \(0, 1\]"),
    ("grpo-vllm-cpu", GRPO("grpo.engine=vllm", "runtime.device=cpu"),
     r"grpo.engine=vllm samples on a CUDA GPU, and this run computes on cpu.*set grpo.engine=builtin"),
    ("grpo-vllm-engine", GRPO("grpo.engine=sglang"), r"grpo.engine: 'sglang' is not one of"),
    ("grpo-vllm-memory", GRPO("grpo.vllm_gpu_memory_utilization=0.5"),
     r"grpo.vllm_gpu_memory_utilization=0.5 is read with grpo.engine=vllm only"),
    ("grpo-engine-dtype-vllm", GRPO("grpo.engine=vllm", "grpo.engine_dtype=bfloat16"),
     r"grpo.engine_dtype=bfloat16 is read with grpo.engine=builtin only"),
    ("grpo-engine-dtype", GRPO("grpo.engine_dtype=float16"), r"grpo.engine_dtype: 'float16' is not one of"),
    ("grpo-vllm-pipeline", GRPO("grpo.engine=vllm", "training.pipeline=2"),
     r"grpo.engine=vllm with training.pipeline=2 is not supported yet .*use grpo.engine=builtin"),
    # jax, inspect, generate, quickstart, plan, plot, info
    ("jax-pytorch-field", lambda ws: ["jax", *SFT("training.shard=fsdp")(ws)[1:]], r"training.shard='fsdp' is for the PyTorch backend"),
    ("inspect-pretrain-config", lambda ws: ["inspect", "--config", str(ws / "pretrain.yaml")], r"linnet inspect shows "
     r"sft, dpo, reward, grpo and ppo configs; this is a `linnet pretrain` config$"),
    ("inspect-bad-data", lambda ws: ["inspect", *SFT("data.path=/nonexistent.jsonl")(ws)[1:]], r"no such file"),
    ("generate-too-long", lambda ws: ["generate", str(ws / "model"), "--prompt", "12+34=", "--max-new-tokens", "5000"],
     r"--max-new-tokens 5000 after a prompt of .* passes"),
    ("generate-temperature", lambda ws: ["generate", str(ws / "model"), "--prompt", "1", "--temperature", "-1"],
     r"--temperature -1.0: give a number at least 0 \(0: greedy\)$"),
    ("generate-top-k", lambda ws: ["generate", str(ws / "model"), "--prompt", "1", "--top-k", "0"],
     r"--top-k 0: give a number at least 1$"),
    ("generate-cuda", lambda ws: ["generate", str(ws / "model"), "--prompt", "1", "--max-new-tokens", "4", "--device", "cuda"],
     r"--device=cuda: no CUDA device"),
    ("quickstart-digits", lambda ws: ["quickstart", "--digits", "0", "--out", str(ws / "qs")], r"--digits 0: use 2 to 6"),
    ("quickstart-steps", lambda ws: ["quickstart", "--steps", "-1", "--out", str(ws / "qs")], r"--steps must be >= 1"),
    ("quickstart-demos", lambda ws: ["quickstart", "--demos", "6000", "--out", str(ws / "qs")],
     r"--demos 6000, --practice 4000: .* 2-digit addition has 10,000 problems, 500 of them held out"),
    ("quickstart-out-used", lambda ws: ["quickstart", "--steps", "1", "--out", str(ws / "other")],
     r"other: exists and is not empty; pass --overwrite"),
    ("quickstart-out-other", lambda ws: ["quickstart", "--steps", "1", "--out", str(ws / "other"), "--overwrite"],
     r"holds files but no quickstart run"),
    ("quickstart-out-file", lambda ws: ["quickstart", "--steps", "1", "--out", str(ws / "afile")], r"afile: --out is a file"),
    ("plan-unknown-card", lambda ws: ["plan", "no-such-card"], r"unknown card 'no-such-card'"),
    ("plan-yaml-as-card", lambda ws: ["plan", str(ws / "sft.yaml")], r"sft.yaml is a YAML file, not a card; give a "
     r"run's config as --config .*sft.yaml$"),
    ("plan-config-field", lambda ws: ["plan", "--config", str(_copy(ws, "sft.yaml", lambda p: p.write_text(
        p.read_text() + "extra: 1\n")))], r"unknown field 'extra'"),
    ("plot-no-metrics", lambda ws: ["plot", str(ws / "other")], r"no metrics; is .* a linnet run directory"),
    ("plot-data-file", lambda ws: ["plot", str(ws / "train.jsonl")], r"train.jsonl: no metric to plot"),
    ("info-unknown", lambda ws: ["info", "no-such-card"], r"unknown card 'no-such-card'"),
    # pretraining
    ("prepare-cache-under-file", lambda ws: PRETRAIN(f"data.cache={ws / 'afile' / 'cache'}", command="prepare")(ws),
     r"is a file, so data.cache cannot be made"),
    ("prepare-missing-source", PRETRAIN("data.source=[/nonexistent.txt]", "data.cache=/tmp/linnet-no-cache",
                                        command="prepare"), r"nonexistent.txt: no such corpus file"),
    ("pretrain-epochs", PRETRAIN("training.epochs=2.5"), r"training.epochs=2.5; pretraining splits its budget into a whole"),
    ("pretrain-card", PRETRAIN("model.card=debug"), r"model.card is not read by `linnet pretrain`"),
    ("pretrain-missing-cache", PRETRAIN("data.cache=/nonexistent/cache", "data.source=[]"), r"/nonexistent/cache"),
    ("pretrain-overwrite-other", lambda ws: [*PRETRAIN(f"runtime.output_dir={ws / 'other'}")(ws), "--overwrite"],
     r"other: holds files but no linnet run"),
    ("pretrain-out-file", lambda ws: PRETRAIN(f"runtime.output_dir={ws / 'afile'}")(ws), r"afile: runtime.output_dir is a file"),
    ("pretrain-sft-checkpoint", lambda ws: [*PRETRAIN()(ws), "--resume-from", str(ws / "done")],
     r"not a pretraining checkpoint"),
]

def test_there_are_many_cases_across_every_command():
    commands = {case.split("-")[0] for case, _, _ in CASES}
    assert len(CASES) >= 60
    assert {"dpo", "grpo", "jax", "inspect", "generate", "quickstart", "plan", "plot", "info", "prepare",
            "pretrain"} <= commands  # and sft: the cases without a prefix


@pytest.mark.parametrize("command", ["sft", "dpo", "pretrain", "prepare", "adapters"])
def test_a_config_file_given_without_the_flag_is_shown_the_flag(command, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "run.yaml"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"linnet {command}: error: unrecognized arguments: run.yaml; "
                                                        "give the config as --config run.yaml")


@pytest.mark.parametrize("case, argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_by_name_and_changes_nothing(ws, case, argv, message, capsys):
    args = argv(ws)  # a case's bad file is made here, before the workspace is fingerprinted
    before = _tree(ws)
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    last = [line for line in err.splitlines() if line.startswith("linnet ")]
    assert len(last) == 1, err
    assert re.search(message, last[0]), last[0]
    assert _tree(ws) == before, "a refused command changed files"


def test_records_past_the_cards_positions_train_with_a_warning(ws, capsys):
    long = ws / "cases" / "long.jsonl"
    long.parent.mkdir(exist_ok=True)
    _lines(long, *[{"prompt": "12+34=" * 12, "completion": "046"}] * 3, *[{"prompt": "1+2=", "completion": "003"}] * 20)
    assert cli.main(["inspect", *SFT(f"data.path={long}", "training.context_length=128",
                                     "data.eval_share=0")(ws)[1:], "--examples", "0"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "positions" in line]
    assert warned == ["linnet inspect: warning: 3 record(s) run past the 64 positions of model (the longest: 76 "
                      "tokens), which it has not learned; extend its context with model.rope_scaling "
                      "(docs/long_context.md) or shorten the records"]


def test_inspect_shows_a_dpo_configs_pairs_and_a_grpo_configs_prompts(ws, capsys):
    assert cli.main(["inspect", "--config", str(ws / "dpo.yaml"), "--examples", "1"]) == 0
    out = capsys.readouterr().out
    first = json.loads((ws / "pairs.jsonl").read_text().splitlines()[0])
    assert f"{first['prompt']}[[{first['chosen']}</s>]]" in out and f"{first['prompt']}[[{first['rejected']}</s>]]" in out
    assert out.count("--- pair ") == 2 and "training pairs" in out and "pairs per step  4" in out
    assert cli.main(["inspect", "--config", str(ws / "grpo.yaml"), "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt ") == 2 and ", answer '" in out and "[[" not in out
    assert "rewards           exact" in out and "prompts per step  2" in out
    labelled = ws / "cases" / "labelled.jsonl"
    labelled.parent.mkdir(exist_ok=True)
    _lines(labelled, *[{"prompt": f"{i:02d}+01=", "completion": f"{i + 1:03d}", "label": i % 2 == 0} for i in range(8)])
    assert cli.main(["inspect", "--config", str(ws / "dpo.yaml"), "--set", f"data.path={labelled}", "--set",
                     "dpo.loss_type=kto", "--set", "data.eval_share=0", "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "--- example 0, desirable" in out and "00+01=[[001</s>]]" in out and "--- example 1, undesirable" in out
    assert "training examples  8" in out
