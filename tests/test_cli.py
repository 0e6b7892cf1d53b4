"""The `linnet` command: dispatch, info, errors; and compiled blocks."""

from __future__ import annotations

import pytest
import torch

from linnet import cli, nest
from linnet.packing import Example, pack


def test_info_prints_counts(capsys):
    assert cli.main(["info", "llama-3.1-8b-instruct"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out and "14.96 GiB" in out and "llama3" not in out.split("rope scaling")[0]


def test_unknown_command_and_card(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli.main(["info", "no-such-card"]) == 2  # refused input
    assert "qwen3-0.6b" in capsys.readouterr().err


def test_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("quickstart", "sft", "plan", "info"))


def _row():
    return next(pack([Example.plain(list(range(3, 20))), Example.prompted([5, 6], [7, 8, 9])], tokens=32))


def test_compiled_blocks_match_eager():
    eager = nest.load("debug", weights="random", seed=2)
    compiled = nest.load("debug", weights="random", seed=2, compile="aot_eager")
    row = _row()
    with torch.no_grad():  # compiled blocks keep the padding (fixed length), eager skips it
        real = slice(0, row.real)
        torch.testing.assert_close(compiled.log_probs_packed(row)[real], eager.log_probs_packed(row)[real])


def test_compile_true_and_inductor_are_one_mode(monkeypatch):
    """The seed's two spellings compile every block with inductor alike (the compile
    itself runs in tests/test_seed_examples.py); another string names another backend."""
    from linnet.torch.model import Block

    seen = []
    monkeypatch.setattr(Block, "compile", lambda self, **options: seen.append(options))
    for spelling, backend in ((True, "inductor"), ("inductor", "inductor"), ("aot_eager", "aot_eager")):
        seen.clear()
        model = nest.load("debug", weights="random", compile=spelling)
        assert model.compiled and seen == [{"backend": backend}] * model.card.layers


@pytest.mark.slow
def test_inductor_blocks_train_like_eager():
    eager = nest.load("debug", weights="random", seed=2, trainable=True)
    compiled = nest.load("debug", weights="random", seed=2, trainable=True, compile=True, attention="dense")
    row = _row()
    a, _ = eager.loss_packed(row)
    b, _ = compiled.loss_packed(row)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    ga = eager.model.layers[0].mlp.up_proj.weight.grad
    gb = compiled.model.layers[0].mlp.up_proj.weight.grad
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)


def test_specified_but_unbuilt_names_say_so():
    with pytest.raises(ValueError, match="does not take tensor_parallel"):
        nest.load("debug", backend="jax", weights="random", tensor_parallel=object())


@pytest.mark.parametrize("argv, message", [
    (["eval", "run", "--tokens", "512"], "--tokens was renamed --context-length"),
    (["eval", "run", "--k", "8"], "--k was renamed --pass-k"),
    (["eval", "run", "--samples", "16"], "--samples was renamed --pass-samples"),
    (["eval", "run", "--reward", "numeric"], "--reward was renamed --rewards"),  # not taken as a prefix of it
    (["plan", "debug", "--seq", "512"], "--seq was renamed --context-length"),
    (["plan", "debug", "--tokens", "12M"], "--tokens was renamed --total-targets"),
    (["plan", "debug", "--workers", "4"], "--workers was renamed --num-models"),
    (["plan", "debug", "--micro-batch", "2"], "--micro-batch was renamed --micro-batch-size"),
    (["pretrain", "--config", "c.yaml", "--resume", "--overwrite"], "--overwrite replaces it; give one"),
    # `--resume CKPT` is seed 002's spelling of --resume-from CKPT (tests/test_pretrain_packed.py runs it)
    (["pretrain", "--config", "c.yaml", "--resume", "runs/x/epoch-002.pt", "--resume-from", "runs/x/final.pt"],
     "give one checkpoint"),
])
def test_former_flags_are_refused_naming_the_new_one(capsys, argv, message):
    """A user's former flag gets one argparse error naming its replacement, not a silent alias."""
    with pytest.raises(SystemExit) as refused:
        cli.main(argv)
    assert refused.value.code == 2 and message in capsys.readouterr().err


def test_eval_flags_take_the_yaml_names():
    from linnet.commands import eval as eval_command

    args = eval_command.parser().parse_args(["run", "--rewards", "exact", "numeric", "--pass-k", "4",
                                             "--pass-samples", "8", "--context-length", "512"])
    assert (args.rewards, args.pass_k, args.pass_samples, args.context_length) == (["exact", "numeric"], 4, 8, 512)


def test_linnets_warnings_print_as_the_commands_own_lines(tmp_path, capsys):
    """A warning from linnet (a value that works but likely is not meant) reads as the
    command's line, not Python's `file:line: UserWarning:`."""
    config = tmp_path / "run.yaml"
    config.write_text("model: {card: qwen2.5-0.5b-instruct}\ndata: {path: x.jsonl}\noptimizer: {weight_decay: 2.0}\n")
    assert cli.main(["plan", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert "linnet plan: warning: config: optimizer.weight_decay=2 is far above" in err and "UserWarning" not in err
    import warnings

    assert warnings.showwarning.__module__ == "warnings"  # Python's own again after the command
