"""`linnet pretrain` on a tiny model: exact resume (branch and in place), refusals of
other recipes and damaged checkpoints, checkpoint policies, clipping, the CLI, and two
processes (forked, gloo) equal to one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from linnet.commands.pretrain import main as cli
from linnet.config import PretrainConfig
from linnet.config import load as load_config
from linnet.pretrain.prepare import prepare
from linnet.pretrain.runner import run
from tests.conftest import WORDS, in_processes, word_tokenizer


def load(path, overrides=()):
    return load_config(PretrainConfig, path, overrides)

torch.set_num_threads(1)
STEPS = 32  # 4 epochs of 8 updates of 2 x 4 sequences of 16 tokens


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A learnable corpus (each word has three possible successors) and its cache."""
    root = tmp_path_factory.mktemp("pretrain")
    word_tokenizer(root / "tok.json")
    g = np.random.default_rng(0)
    successors = g.integers(0, 40, size=(40, 3))
    docs = []
    for _ in range(500):
        w = [int(g.integers(40))]
        for _ in range(int(g.integers(6, 20))):
            w.append(int(successors[w[-1], g.integers(3)]))
        docs.append(" ".join(WORDS[i] for i in w))
    (root / "corpus.txt").write_text("\n".join(docs) + "\n")
    overrides = [f"data.cache={root / 'cache'}", f"data.source=[{root / 'corpus.txt'}]",
                 f"data.tokenizer={root / 'tok.json'}", "data.document_split=line", "data.shard_tokens=300",
                 "data.prepare_workers=1", "data.validation_every=10", "data.shuffle_buffer=50"]
    prepare(load(None, overrides).data)
    return root


def _sets(workspace: Path, out: Path, *changes: str) -> list[str]:
    return [
        f"data.cache={workspace / 'cache'}", "data.shuffle_group_size=2",
        # vocab 1024 rather than the tokenizer's 42: linear_cross_entropy allocates an
        # arange of 2**28 / vocab rows per call, 51 MB (60 ms) at 42
        "model.vocab=1024", "model.hidden=32", "model.intermediate=64", "model.layers=2", "model.heads=2",
        "training.context_length=16", "training.micro_batch_size=4", "training.accumulation=2",
        f"training.total_targets={STEPS * 128}", "training.epochs=4",
        "optimizer.lr=0.01", "lr_schedule.warmup_steps=3", "evaluation.subset_sequences=8",
        "evaluation.batch_size=4", "runtime.progress=false", f"runtime.output_dir={out}", *changes,
    ]


def _config(workspace: Path, out: Path, *changes: str):
    return load(None, _sets(workspace, out, *changes))


def _cli_args(workspace: Path, out: Path, *changes: str) -> list[str]:
    return [arg for x in _sets(workspace, out, *changes) for arg in ("--set", x)]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def straight(workspace):
    """The reference: 32 updates straight, every epoch's weights and training state kept."""
    out = workspace / "straight"
    run(_config(workspace, out, "training.checkpoint_policy=interval", "training.save_epoch_training_state=true"))
    return out


def test_a_straight_run_learns_and_keeps_what_its_policy_says(workspace, straight):
    rows = _metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    held = [r["held_out_loss"] for r in rows if "held_out_loss" in r]
    assert [r["step"] for r in rows if "held_out_loss" in r] == [8, 16, 24, 32]
    assert held[-1] < held[0] < rows[0]["loss"] - 1.0  # ln(1024) = 6.9 at the start
    names = sorted(p.name for p in straight.iterdir())
    assert names == ["best.json", "checkpoints", "config.yaml", "curves.png", "epoch-001.safetensors", "epoch-002.safetensors",
                     "epoch-003.safetensors", "epoch-004.safetensors", "final.safetensors", "metrics.jsonl",
                     "run.json", "summary.json"]
    assert [p.name for p in sorted((straight / "checkpoints").iterdir())] == [
        "step-00000008", "step-00000016", "step-00000024", "step-00000032"]
    best = json.loads((straight / "best.json").read_text())
    assert best["held_out_loss"] == min(held) and best["weights"] == f"epoch-{best['epoch']:03d}.safetensors"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["full_validation_loss"] > 0 and summary["targets"] == STEPS * 128
    record = json.loads((straight / "run.json").read_text())
    assert record["recipe"]["identity"] == summary["recipe"] and record["budget"]["boundaries"] == [8, 16, 24, 32]
    assert _same_weights(straight / "epoch-004.safetensors", straight / "final.safetensors")


def test_resume_from_the_middle_of_a_shard_group_equals_the_straight_run(workspace, straight, tmp_path):
    """Stop after epoch 2 (inside a shard group), resume on a branch with another
    prefetch, device spelling and retention: the same losses and the same weights."""
    from linnet.pretrain.cache import open_cache
    from linnet.pretrain.loader import Loader

    checkpoint = straight / "checkpoints" / "step-00000016"
    cursor = torch.load(checkpoint / "state.pt", weights_only=True)["extra"]["cursor"]
    with Loader(open_cache(workspace / "cache").train, context=16, group_size=2, seed=0) as loader:
        assert loader.locate(cursor["position"])[2] > 0  # mid-group
    branch = tmp_path / "branch"
    config = _config(workspace, branch, "data.prefetch=false", "runtime.device=cpu", "training.checkpoint_policy=final")
    run(config, resume=checkpoint)
    assert [r["loss"] for r in _metrics(branch)] == [r["loss"] for r in _metrics(straight)]
    assert [r.get("held_out_loss") for r in _metrics(branch)] == [r.get("held_out_loss") for r in _metrics(straight)]
    assert _same_weights(branch / "final.safetensors", straight / "final.safetensors")
    assert json.loads((branch / "run.json").read_text())["resumed_from"] == str(checkpoint)
    # and writing snapshots did not perturb the straight run: a run that keeps none agrees
    plain = tmp_path / "plain"
    run(_config(workspace, plain))
    assert _same_weights(plain / "final.safetensors", straight / "final.safetensors")
    assert sorted(p.name for p in plain.iterdir()) == ["best.json", "checkpoints", "config.yaml", "curves.png",
                                                       "final.safetensors",
                                                       "metrics.jsonl", "run.json", "summary.json"]
    best = json.loads((plain / "best.json").read_text())  # epoch 3, whose weights were not kept
    assert best["epoch"] == 3 and best["weights"] is None


def test_the_seeds_command_resumes_an_epoch_by_its_name(workspace, straight, tmp_path):
    """Seed 002's line, `--config RUN/config.yaml --resume RUN/epoch-002.pt --set
    runtime.output_dir=BRANCH`, branches from epoch 2's snapshot (checkpoints/step-00000016)
    and ends with the straight run's weights."""
    from linnet.pretrain.snapshots import find_checkpoint

    branch = tmp_path / "branch"
    assert cli(["--config", str(straight / "config.yaml"), "--resume", str(straight / "epoch-002.pt"),
                "--set", f"runtime.output_dir={branch}"]) == 0
    assert json.loads((branch / "run.json").read_text())["resumed_from"] == str(straight / "checkpoints" / "step-00000016")
    assert [r["loss"] for r in _metrics(branch)] == [r["loss"] for r in _metrics(straight)]
    assert _same_weights(branch / "final.safetensors", straight / "final.safetensors")
    for name, step in (("epoch-001.pt", 8), ("epoch-003", 24), ("final.pt", 32), ("epoch-004.pt", 32)):
        assert find_checkpoint(straight / name) == straight / "checkpoints" / f"step-{step:08d}"
    with pytest.raises(FileNotFoundError, match=r"epoch-001.pt: .* keeps no training-state snapshot of epoch 1; it "
                                                r"keeps epoch-003.pt, final.pt \(epoch-004.pt\)"):
        run(_config(workspace, tmp_path / "twig"), resume=branch / "epoch-001.pt")
    plain = tmp_path / "plain"  # the default policy keeps the final state alone
    run(_config(workspace, plain, "training.epochs=1", f"training.total_targets={8 * 128}"))
    with pytest.raises(FileNotFoundError, match=r"epoch 0; it keeps final.pt \(epoch-001.pt\)"):
        find_checkpoint(plain / "epoch-000.pt")


def test_an_interrupted_run_resumes_itself_from_its_latest_snapshot(workspace, straight, tmp_path, monkeypatch):
    from linnet.train import loop

    out = tmp_path / "interrupted"
    config = _config(workspace, out, "training.checkpoint_policy=interval", "training.checkpoint_epochs=2",
                     "training.save_epoch_training_state=true")
    real_step = loop.optimizer_step

    def stop_at_21(params, plumbing, loss, step, **options):
        if step == 21:
            raise KeyboardInterrupt
        return real_step(params, plumbing, loss, step, **options)

    monkeypatch.setattr(loop, "optimizer_step", stop_at_21)
    with pytest.raises(KeyboardInterrupt):
        run(config)
    assert len(_metrics(out)) == 20 and not (out / "summary.json").exists()
    monkeypatch.setattr(loop, "optimizer_step", real_step)
    summary = run(config)  # finds the incomplete run and resumes it from update 16
    assert summary["steps_this_session"] == 16
    assert [r["step"] for r in _metrics(out)] == list(range(1, STEPS + 1))  # 17-20 not logged twice
    assert [r["loss"] for r in _metrics(out)] == [r["loss"] for r in _metrics(straight)]
    assert _same_weights(out / "final.safetensors", straight / "final.safetensors")
    assert run(config) == summary  # complete: left as it is


def test_sigterm_keeps_the_updates_state_and_the_run_resumes_to_the_same_weights(workspace, straight, tmp_path,
                                                                                 monkeypatch):
    """A SIGTERM during update 10 (mid-epoch): the update finishes, its state is kept as a
    snapshot, and running the config again ends with the uninterrupted run's weights."""
    import os
    import signal

    from linnet.run import Preempted, stop_after_a_step
    from linnet.train import loop

    out = tmp_path / "stopped"
    config = _config(workspace, out)
    real, calls = loop.take_step, []

    def notice_during_update_10(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "take_step", notice_during_update_10)
    with stop_after_a_step(), pytest.raises(Preempted) as stopped:
        run(config)
    assert stopped.value.step == 10 and len(_metrics(out)) == 10 and not (out / "summary.json").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000010"]
    monkeypatch.setattr(loop, "take_step", real)
    summary = run(config)
    assert summary["steps_this_session"] == STEPS - 10
    assert [r["loss"] for r in _metrics(out)] == [r["loss"] for r in _metrics(straight)]
    assert _same_weights(out / "final.safetensors", straight / "final.safetensors")


def test_another_recipe_is_refused_naming_the_fields(workspace, straight, tmp_path):
    changed = _config(workspace, tmp_path / "other", "optimizer.lr=0.02", "training.epochs=8")
    with pytest.raises(ValueError, match=r"written by another recipe .*optimizer.lr: 0.01 \(run\) vs 0.02 \(config\); "
                                         r"training.epochs: 4 \(run\) vs 8 \(config\)"):
        run(changed, resume=straight / "checkpoints" / "step-00000016")
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match=r"run.json: written by another recipe .*runtime.seed: 0 \(run\) vs 1"):
        run(_config(workspace, straight, "runtime.seed=1"))  # the run directory itself


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_still_resumes(workspace, straight, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(straight, run_dir)
    latest, previous = run_dir / "checkpoints" / "step-00000024", run_dir / "checkpoints" / "step-00000016"
    data = bytearray((latest / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (latest / "optimizer.pt").write_bytes(bytes(data))
    config = _config(workspace, tmp_path / "b1")
    with pytest.raises(ValueError, match=rf"optimizer.pt: corrupt or truncated .*previous checkpoint is {previous}"):
        run(config, resume=latest)
    final = run_dir / "checkpoints" / "step-00000032"
    (final / "trained.safetensors").write_bytes((final / "trained.safetensors").read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"trained.safetensors: corrupt or truncated"):
        run(config, resume=final)
    (previous / "checksums.json").rename(tmp_path / "aside.json")
    with pytest.raises(ValueError, match=r"incomplete checkpoint \(no checksums.json"):
        run(config, resume=previous)
    (tmp_path / "aside.json").rename(previous / "checksums.json")
    run(config, resume=previous)
    assert _same_weights(tmp_path / "b1" / "final.safetensors", straight / "final.safetensors")


def test_policy_none_keeps_no_weights_and_explicit_keeps_the_listed_epochs(workspace, tmp_path):
    none = tmp_path / "none"
    run(_config(workspace, none, "training.checkpoint_policy=none", "training.total_targets=2048",
                "evaluation.full_validation=false"))
    assert sorted(p.name for p in none.iterdir()) == ["best.json", "config.yaml", "curves.png", "metrics.jsonl", "run.json",
                                                      "summary.json"]
    explicit = tmp_path / "explicit"
    run(_config(workspace, explicit, "training.checkpoint_policy=explicit", "training.checkpoint_epochs=[1, 3]",
                "training.total_targets=2048"))
    assert sorted(p.name for p in explicit.glob("*.safetensors")) == [
        "epoch-001.safetensors", "epoch-003.safetensors", "final.safetensors"]
    best = json.loads((explicit / "best.json").read_text())  # the last epoch, not in the list: the final weights
    assert best["epoch"] == 4 and best["weights"] == "final.safetensors"
    metrics = _metrics(explicit)
    held = {r["epoch"]: r["held_out_loss"] for r in metrics if "held_out_loss" in r}
    assert held[4] == min(held.values()) and held[2] > held[4]  # epoch 2's weights are kept nowhere
    assert [p.name for p in (explicit / "checkpoints").iterdir()] == ["step-00000016"]  # final state only


def test_grad_clip_null_still_logs_the_norm(workspace, tmp_path):
    common = ["training.checkpoint_policy=none", "training.total_targets=1024", "evaluation.full_validation=false"]
    free, tight = tmp_path / "free", tmp_path / "tight"
    run(_config(workspace, free, "optimizer.grad_clip=null", *common))
    run(_config(workspace, tight, "optimizer.grad_clip=0.05", *common))
    a, b = _metrics(free), _metrics(tight)
    assert a[0]["grad_norm"] == b[0]["grad_norm"] > 0.05  # measured before clipping
    assert a[0]["loss"] == b[0]["loss"] and a[2]["loss"] != b[2]["loss"]


def test_refusals_before_training(workspace, tmp_path):
    with pytest.raises(ValueError, match=r"the budget needs 4,096 training sequences .*set data.repeat=true"):
        run(_config(workspace, tmp_path / "big", f"training.total_targets={4096 * 16}"))
    (tmp_path / "other.txt").write_text("w1 w2\n")
    with pytest.raises(ValueError, match=r"prepared with other settings than this config: .*data.source: cache has"):
        run(_config(workspace, tmp_path / "o", f"data.source=[{tmp_path / 'other.txt'}]"))
    with pytest.raises(ValueError, match=r"warmup_steps=40 is more than the run's 32 steps; lower lr_schedule.warmup_steps"):
        run(_config(workspace, tmp_path / "w", "lr_schedule.warmup_steps=40"))
    assert not any((tmp_path / name).exists() for name in ("big", "o", "w"))


def test_cli_plan_and_a_complete_run(workspace, straight, capsys):
    assert cli(["--config", str(straight / "config.yaml"), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "32 (4,096 targets trained)" in out and "4 of 8-8 updates" in out
    assert cli(["--config", str(straight / "config.yaml")]) == 0  # complete: prints its summary
    assert json.loads((straight / "summary.json").read_text())["recipe"] in capsys.readouterr().out


def _cli_runs(rank: int, runs: list[list[str]]) -> list:
    """One of two processes running the CLI once per argument list (each joins the
    group as under torchrun; a refusal is kept as its message)."""
    outcomes = []
    for args in runs:
        try:
            outcomes.append(cli(args))
        except ValueError as e:
            outcomes.append(str(e))
    return outcomes


def _close_weights(a: Path, b: Path, atol: float) -> None:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    for k in x:
        torch.testing.assert_close(x[k], y[k], atol=atol, rtol=0, msg=k)


def _trained_like(run_dir: Path, reference_dir: Path) -> None:
    """A run's steps, losses, validation and final weights are the reference run's."""
    rows, reference = _metrics(run_dir), _metrics(reference_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in reference], atol=1e-5, rtol=0)
    held = [r["held_out_loss"] for r in rows if "held_out_loss" in r]
    np.testing.assert_allclose(held, [r["held_out_loss"] for r in reference if "held_out_loss" in r], atol=1e-5)
    _close_weights(run_dir / "final.safetensors", reference_dir / "final.safetensors", atol=1e-5)


def test_two_processes_train_like_one_and_resume(workspace, straight, tmp_path):
    """Two processes, one micro-batch each of the two an update: the straight run's losses,
    validation, weights and files, with the same loader cursor in its checkpoints; a
    branch resumed under two processes from their checkpoint, and one resumed in one
    process, both finish like it. An accumulation that does not split is refused."""
    two, branch, single = tmp_path / "two", tmp_path / "branch", tmp_path / "single"
    keep = ["training.checkpoint_policy=interval", "training.save_epoch_training_state=true"]
    outcomes = in_processes(_cli_runs, [
        _cli_args(workspace, two, *keep),
        _cli_args(workspace, branch) + ["--resume-from", str(two / "checkpoints" / "step-00000016")],
        _cli_args(workspace, tmp_path / "uneven", "training.accumulation=3"),
    ])
    assert outcomes[0][:2] == outcomes[1][:2] == [0, 0]
    assert "training.accumulation=3 micro-batches an update do not split evenly over 2 processes" in outcomes[0][2]
    assert not (tmp_path / "uneven").exists()

    for run_dir in (two, branch):
        _trained_like(run_dir, straight)
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in straight.iterdir())
    assert json.loads((two / "run.json").read_text())["processes"] == 2
    assert json.loads((two / "run.json").read_text())["recipe"] == json.loads((straight / "run.json").read_text())["recipe"]
    state = torch.load(two / "checkpoints" / "step-00000016" / "state.pt", weights_only=True)
    assert state["extra"]["cursor"] == torch.load(straight / "checkpoints" / "step-00000016" / "state.pt",
                                                  weights_only=True)["extra"]["cursor"]
    assert _same_weights(branch / "final.safetensors", two / "final.safetensors")  # the same layout: bitwise
    run(_config(workspace, single), resume=two / "checkpoints" / "step-00000024")
    _close_weights(single / "final.safetensors", two / "final.safetensors", atol=1e-5)


@pytest.mark.parametrize("shard", ["zero", "fsdp"])
def test_two_sharded_processes_train_like_one_and_resume(workspace, straight, tmp_path, shard):
    """training.shard=zero (AdamW's state split) or fsdp (weights, gradients and state
    split, the model drawn a part a process) in two processes: the straight run's losses,
    validation and weights (gathered and written once); a branch resumed from their
    step-16 checkpoint under two processes, and one resumed in a single whole process,
    finish like it."""
    two, branch, single = tmp_path / "two", tmp_path / "branch", tmp_path / "single"
    sharded = [f"training.shard={shard}", "training.checkpoint_policy=interval",
               "training.save_epoch_training_state=true"]
    outcomes = in_processes(_cli_runs, [
        _cli_args(workspace, two, *sharded),
        _cli_args(workspace, branch, f"training.shard={shard}") + ["--resume-from", str(two / "checkpoints" / "step-00000016")],
    ])
    assert outcomes[0] == outcomes[1] == [0, 0]
    for run_dir in (two, branch):
        _trained_like(run_dir, straight)
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in straight.iterdir())
    parts = two / "checkpoints" / "step-00000016" / "sharded"  # fsdp: each process wrote its parts
    assert parts.is_dir() == (shard == "fsdp") and len(list(parts.glob("*.distcp"))) == (2 if shard == "fsdp" else 0)
    _close_weights(two / "epoch-002.safetensors", straight / "epoch-002.safetensors", atol=1e-5)
    run(_config(workspace, single), resume=two / "checkpoints" / "step-00000024")
    _close_weights(single / "final.safetensors", two / "final.safetensors", atol=1e-5)


def test_every_update_and_the_summary_report_mfu_and_hfu(straight):
    rows = _metrics(straight)
    assert all(0 < r["mfu"] <= r["hfu"] < 1 for r in rows)
    summary = json.loads((straight / "summary.json").read_text())
    assert 0 < summary["mfu"] <= summary["hfu"] < 1
