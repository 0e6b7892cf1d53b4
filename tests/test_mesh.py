"""Several parallelism axes on one mesh, through `linnet sft`: every block split (tensor
parallel) with each process's part sharded over the copies (FSDP x TP), and that cut into
pipeline stages too (2 x 2 x 2, eight processes), or the split's norms on a share of the
positions (sequence parallel), against one process taking the same rows; a checkpoint of
one layout resumed under another."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file

from linnet import nest
from linnet.commands import quickstart
from linnet.commands.sft import run
from linnet.config import SFTConfig, load
from tests.conftest import in_processes, same_metrics
from tests.test_sft import _sft_process

KEYS = ("loss", "grad_norm", "held_out_loss", "learned")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The quickstart's card untied (a split head trains apart from the embedding), its
    tokenizer and 120 records."""
    root = tmp_path_factory.mktemp("mesh")
    nest.load(quickstart.CARD.replace(tied_embeddings=False), weights="random", seed=0).save_weights(root / "model")
    quickstart.save_tokenizer(root / "model" / "tokenizer.json")
    rows = quickstart.problems(np.random.default_rng(0), 120, 2)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in rows))
    return root


def _common(workspace, *extra) -> list[str]:
    return [f"model.card={workspace / 'model'}", f"data.path={workspace / 'train.jsonl'}", "data.chat=false",
            "training.context_length=64", "data.eval_share=0.1", "optimizer.lr=3e-3", "lr_schedule.warmup_steps=1",
            "evaluation.every=2", *extra]


LR = 3e-3  # optimizer.lr of these runs: one AdamW step moves a weight by about this much at most


def _same_weights(run_dir, reference, name: str) -> None:
    """Every weight within 3e-4 of the one-process run's, but for a rare element (one in a
    thousand at most) whose gradient is so near zero that rounding flips its sign: AdamW
    then steps it the other way, by up to the learning rate a step (seen: one element of
    2,048 of a LoRA A, 3e-3 apart after three steps)."""
    x, y = (load_file(str(d / "final" / name)) for d in (run_dir, reference))
    assert x.keys() == y.keys()
    for key in y:
        apart = (x[key].float() - y[key].float()).abs()
        assert (apart > 3e-4).float().mean() <= 1e-3 and apart.max() <= 3 * LR, f"{key}: {apart.max():.2e} apart"


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp_over_a_split_takes_one_process_steps(workspace, tmp_path, lora):
    """training.split=2 with training.shard=fsdp in four processes: two copies of a two-way
    split, each process's part sharded over the two copies (a quarter of each block's
    weights a process; LoRA: the frozen base so, the adapters split and whole across the
    copies). The same losses, gradient norms and held-out losses as one process taking both
    copies' rows, and the same weights or adapters."""
    common = _common(workspace, "training.steps=3", f"lora.enabled={str(lora).lower()}")
    four = common + [f"runtime.output_dir={tmp_path / 'four'}", "training.split=2", "training.shard=fsdp"]
    assert in_processes(_sft_process, four, processes=4) == [0] * 4
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}", "training.accumulation=2"]))
    same_metrics(tmp_path / "four", tmp_path / "one", ("loss", "held_out_loss", "learned"), steps=3, rel=1e-5)
    # the norm sums squares reduce-scattered over the copies and all-reduced over the split: one
    # run measured 1.2e-5 apart, the float32 rounding of two more reductions
    same_metrics(tmp_path / "four", tmp_path / "one", ("grad_norm",), steps=3, rel=3e-5)
    _same_weights(tmp_path / "four", tmp_path / "one", "adapter_model.safetensors" if lora else "model.safetensors")


@pytest.mark.parametrize("layout", ["split", "tiles", "fsdp", "pipeline"])
def test_sequence_parallel_split_takes_one_process_steps(workspace, tmp_path, layout):
    """training.split=2 with training.sequence_parallel=true: both processes of a split take
    the same rows, each running the norms on half of every row's positions (its MLP in
    tiles of 16 positions, 8 of each process's, gathered and scattered a tile at a time;
    with fsdp, two copies of such a split, each part sharded over them; with two pipeline
    stages, each split so); the steps and weights of one process."""
    common = _common(workspace, "training.steps=3", "lora.enabled=false")
    extra = {"split": [], "tiles": ["training.mlp_tile=16"], "fsdp": ["training.shard=fsdp"],
             "pipeline": ["training.pipeline=2"]}[layout]
    processes, copies = (2, 1) if layout in ("split", "tiles") else (4, 2 if layout == "fsdp" else 1)
    many = common + [f"runtime.output_dir={tmp_path / 'many'}", "training.split=2", "training.sequence_parallel=true",
                     *extra, *(["training.accumulation=2"] if layout == "pipeline" else [])]
    assert in_processes(_sft_process, many, processes=processes) == [0] * processes
    rows = copies * (2 if layout == "pipeline" else 1)
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}", f"training.accumulation={rows}"]))
    same_metrics(tmp_path / "many", tmp_path / "one", KEYS, steps=3, rel=1e-5)
    _same_weights(tmp_path / "many", tmp_path / "one", "model.safetensors")


@pytest.mark.parametrize("layout", ["split", "fsdp", "fsdp-lora", "sequence"])
def test_context_parallel_beside_a_split_takes_one_process_steps(workspace, tmp_path, layout):
    """training.split=2 with training.context=2 in four processes: each row's positions
    split over two splits (each process a quarter of the work: its share of the heads and
    MLP for its half of the positions), the ring passing each split's share of the keys and
    values. With fsdp each part is also sharded over the context group (FSDP x TP x CP: the
    reduce-scatter sums both processes' positions; LoRA: the base so, the adapters summed
    over the group by hooks); with sequence parallel each process of a split runs the norms
    on half of its positions, its MLP in tiles of 16 (TP x SP x CP). The steps and weights of
    one process."""
    lora = layout == "fsdp-lora"
    extra = {"split": [], "fsdp": ["training.shard=fsdp"], "fsdp-lora": ["training.shard=fsdp"],
             "sequence": ["training.sequence_parallel=true", "training.mlp_tile=16"]}[layout]
    common = _common(workspace, "training.steps=3", f"lora.enabled={str(lora).lower()}")
    four = common + [f"runtime.output_dir={tmp_path / 'four'}", "training.split=2", "training.context=2", *extra]
    assert in_processes(_sft_process, four, processes=4) == [0] * 4
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}"]))
    same_metrics(tmp_path / "four", tmp_path / "one", KEYS, steps=3, rel=1e-5)
    _same_weights(tmp_path / "four", tmp_path / "one", "adapter_model.safetensors" if lora else "model.safetensors")


@pytest.mark.parametrize("layout", ["stages", "stages-fsdp-lora"])
def test_context_parallel_through_pipeline_stages_takes_one_process_steps(workspace, tmp_path, layout):
    """training.pipeline=2 with training.context=2 in four processes: each stage's pair
    takes the same rows, each process half of every row's positions, and hands its half's
    hidden states to the same place in the next stage; the last stage's loss is the row's
    on both (with fsdp each stage sharded over its pair, LoRA adapters summed over it). The
    steps and weights of one process."""
    lora = layout.endswith("lora")
    common = _common(workspace, "training.steps=3", f"lora.enabled={str(lora).lower()}", "training.accumulation=2")
    extra = ["training.shard=fsdp"] if "fsdp" in layout else []
    four = common + [f"runtime.output_dir={tmp_path / 'four'}", "training.pipeline=2", "training.context=2", *extra]
    assert in_processes(_sft_process, four, processes=4) == [0] * 4
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}"]))
    same_metrics(tmp_path / "four", tmp_path / "one", KEYS, steps=3, rel=1e-5)
    _same_weights(tmp_path / "four", tmp_path / "one", "adapter_model.safetensors" if lora else "model.safetensors")


@pytest.mark.slow  # eight processes; each pair of these axes runs beside context in the default run (above)
def test_every_axis_at_once_takes_one_process_steps(workspace, tmp_path):
    """Two pipeline stages, each row's positions split over a context pair, every block
    split two ways, each part sharded over its context pair (eight processes, one copy):
    the steps and weights of one process."""
    common = _common(workspace, "training.steps=3", "lora.enabled=false", "training.accumulation=2")
    eight = common + [f"runtime.output_dir={tmp_path / 'eight'}", "training.pipeline=2", "training.context=2",
                      "training.split=2", "training.shard=fsdp"]
    assert in_processes(_sft_process, eight, processes=8) == [0] * 8
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}"]))
    same_metrics(tmp_path / "eight", tmp_path / "one", KEYS, steps=3, rel=1e-5)
    _same_weights(tmp_path / "eight", tmp_path / "one", "model.safetensors")


def test_stages_split_and_sharded_take_one_process_steps_and_resume_under_other_layouts(workspace, tmp_path):
    """2 x 2 x 2: two pipeline stages, each split two ways, each part sharded over the two
    copies (eight processes, one thread each). The same steps and weights as one process;
    its checkpoint at step 2, its parts regathered, resumes as one process and as four (a
    split sharded over two copies) and finishes as the uninterrupted runs did."""
    common = _common(workspace, "training.steps=4", "training.checkpoint_every=2", "lora.enabled=false")
    eight = common + [f"runtime.output_dir={tmp_path / 'eight'}", "training.split=2", "training.pipeline=2",
                      "training.shard=fsdp"]
    assert in_processes(_sft_process, eight, processes=8) == [0] * 8
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}", "training.accumulation=2"]))
    same_metrics(tmp_path / "eight", tmp_path / "one", KEYS, steps=4, rel=1e-5)
    _same_weights(tmp_path / "eight", tmp_path / "one", "model.safetensors")
    for name, processes, layout in (("as-one", 1, ["training.accumulation=2"]),
                                    ("as-four", 4, ["training.split=2", "training.shard=fsdp"])):
        out = tmp_path / name  # killed after step 3: step 2's checkpoint and two metrics lines remain
        shutil.copytree(tmp_path / "eight", out)
        shutil.rmtree(out / "checkpoints" / "step-00000004")
        (out / "summary.json").unlink()
        metrics = out / "metrics.jsonl"
        metrics.write_text("\n".join(metrics.read_text().splitlines()[:2]) + "\n")
        again = common + [f"runtime.output_dir={out}", *layout]
        if processes == 1:
            run(load(SFTConfig, None, again), resume=True)
        else:
            assert in_processes(_sft_process, again, "--resume", processes=processes) == [0] * processes
        same_metrics(out, tmp_path / "one", KEYS, steps=4, rel=1e-5)
        _same_weights(out, tmp_path / "one", "model.safetensors")


def test_a_run_resumes_under_another_layout_only_with_the_same_rows_a_step(workspace, tmp_path):
    """The layout may change between sessions; the rows a step learns from may not."""
    common = _common(workspace, "training.steps=2", "training.checkpoint_every=1", "lora.enabled=false",
                     f"runtime.output_dir={tmp_path / 'run'}")
    run(load(SFTConfig, None, common + ["training.accumulation=2", "training.steps=1"]))
    with pytest.raises(ValueError, match=r"training.rows_per_step: 2 \(run\) vs 1 \(now\)"):
        run(load(SFTConfig, None, common), resume=True)


@pytest.mark.parametrize("settings, message", [
    (["training.sequence_parallel=true"], "set training.split to 2 or more"),
    (["training.sequence_parallel=true", "training.split=2", "training.context_length=63"], "a multiple of it"),
    (["training.sequence_parallel=true", "training.split=2", "training.mlp_tile=15"], "with training.mlp_tile=15"),
    (["training.sequence_parallel=true", "training.split=4", "training.context=2", "training.context_length=68"],
     r"a multiple of it x training.context"),
    (["training.split=2", "training.shard=zero"], "training.split=2 with training.shard=zero is not supported"),
])
def test_layouts_linnet_does_not_run_are_refused_naming_the_pair(settings, message):
    with pytest.raises(ValueError, match=message):
        load(SFTConfig, None, ["data.path=x.jsonl", *settings])
