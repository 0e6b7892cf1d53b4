"""Pipeline stages (linnet.torch.pipeline, in linnet.torch.stages): forked processes (gloo), each holding
consecutive blocks, train like one process training the whole model on the same rows;
saved weights and checkpoints read as the whole model's."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from linnet import nest
from linnet.torch import pipeline
from linnet.torch.sharding import copy_first
from linnet.train import train
from linnet.train.checkpoint import load_checkpoint
from linnet.train.evaluation import held_out_loss
from tests.conftest import gathered, in_processes
from tests.test_sharding import STEPS, _dpo, _pairs, _rows  # eight rows of unequal learned counts; DPO pairs

CARD = nest.resolve("debug").replace(vocab=64, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8,
                                     layers=4, tied_embeddings=False)


def test_the_documented_name_is_the_function_after_the_stages_load():
    """`from linnet.torch import pipeline` gives the function, also once the module that
    holds it has been imported (linnet.train imports it: a submodule of the same name
    would have taken the package's attribute)."""
    import linnet.torch
    import linnet.torch.stages  # noqa: F401
    from linnet.torch import pipeline as again

    assert again is pipeline is linnet.torch.pipeline and callable(pipeline)


def _model(lora: bool, tied: bool, adapt: bool = True):
    model = nest.load(CARD.replace(tied_embeddings=tied), weights="random", seed=0, trainable=not lora)
    if lora and adapt:
        torch.manual_seed(0)  # every process draws the same A
        model.add_lora("*_proj.weight", rank=4)
    return model


def _run(model, rows, accumulate, steps=STEPS, **kw):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    history = train(model, rows, optimizer=opt, steps=steps, accumulate=accumulate, clip=0.5, **kw)
    return [(s.loss, s.grad_norm, s.learned) for s in history.steps]


def _staged(rank, schedule, lora, tied, recompute, out):
    model = pipeline(_model(lora, tied, adapt=False), schedule=schedule)
    if lora:  # after the cut, as `linnet sft` adds them; each A set to one process's draw
        model.add_lora("*_proj.weight", rank=4)
        drawn = dict(_model(lora, tied).named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.copy_(drawn[name])
    if recompute:
        model.checkpoint_activations(True)
    names = [n for n, _ in model.named_parameters()]
    steps = _run(model, _rows(), 2, save_to=out / "final", checkpoint=out / "ckpt", checkpoint_every=2)
    with torch.no_grad():
        held_out = held_out_loss(model, _rows()[:3])
    return steps, names, held_out


def _same_steps(got, reference):
    for (loss, norm, learned), (ref_loss, ref_norm, ref_learned) in zip(got, reference, strict=True):
        assert learned == ref_learned
        assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.parametrize("schedule, lora, tied, recompute",
                         [("1f1b", False, True, False), ("gpipe", True, False, True),
                          ("interleaved", False, False, False), ("zero-bubble", True, False, False)])
def test_stages_train_like_one_process(tmp_path, schedule, lora, tied, recompute):
    """Two stages of two blocks each (the first with the embedding, the last with the norm
    and head) take the losses, gradient norms and learned counts of one process over the
    same rows, full fine-tuning on 1F1B (a tied head trains apart from the embedding, as
    an untied copy's does) and LoRA on GPipe with activation checkpointing (the adapters
    added after the cut, as `linnet sft` adds them), and full fine-tuning on interleaved
    1F1B (blocks 0 and 2 on the first process, 1 and 3 on the second), and LoRA on the
    zero-bubble schedule (the same chunks, each backward split into the input's gradient
    and the weights'); the saved
    weights and adapters, gathered from both, equal one process's; the held-out loss
    through the stages equals the whole model's; the checkpoint resumes in one process."""
    assert any(r.real < len(r.tokens) for r in _rows())  # rows with trailing padding pass stages whole
    out = tmp_path / "staged"
    results = in_processes(_staged, schedule, lora, tied, recompute, out)
    (steps, first, held), (steps1, second, held1) = results
    assert steps == steps1 and held == held1
    assert "model.embed_tokens.weight" in first and "model.norm.weight" in second
    interleaved = schedule in ("interleaved", "zero-bubble")
    assert {n.split(".")[2] for n in first if ".layers." in n} == ({"0", "2"} if interleaved else {"0", "1"})
    assert {n.split(".")[2] for n in second if ".layers." in n} == ({"1", "3"} if interleaved else {"2", "3"})
    whole = _model(lora, tied)
    whole.untie_head()
    reference = _run(whole, _rows(), 2, save_to=tmp_path / "one")
    _same_steps(steps, reference)
    with torch.no_grad():
        assert held == pytest.approx(held_out_loss(whole, _rows()[:3]), rel=1e-6)
    file = "adapter_model.safetensors" if lora else "model.safetensors"
    two, one = (load_file(str(d / file)) for d in (out / "final", tmp_path / "one"))
    assert two.keys() == one.keys() and set(first).isdisjoint(second)
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=3e-5, rtol=0, msg=key)
    (tmp_path / "whole").mkdir()
    shutil.copytree(out / "ckpt" / "step-00000002", tmp_path / "whole" / "step-00000002")
    resumed = _model(lora, tied)
    resumed.untie_head()
    _same_steps(_run(resumed, _rows(), 2, checkpoint=tmp_path / "whole"), reference[2:])


def _quantized_stages(rank, out):
    """A stage of an NF4 base built alone with its adapters (`nest.load(pipeline=,
    quantize="nf4", lora=)`), trained; its steps and quantized weights' names."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("stages",))
    torch.manual_seed(0)
    model = nest.load(CARD, weights="random", seed=0, quantize="nf4", pipeline=mesh, pipeline_schedule="gpipe",
                      lora=dict(patterns="*_proj.weight", rank=4))
    steps = _run(model, _rows(), 2, save_to=out / "final", checkpoint=out / "ckpt", checkpoint_every=2)
    return steps, sorted(f"{n}.weight" for n, m in model.named_modules() if getattr(m, "quant_state", None) is not None)


def _quantized_whole():
    model = nest.load(CARD, weights="random", seed=0, quantize="nf4")
    torch.manual_seed(0)
    model.add_lora("*_proj.weight", rank=4)
    return model


def test_stages_of_an_nf4_base_train_like_one_process(tmp_path):
    """QLoRA in two pipeline stages, each built alone (its blocks quantized as they load,
    never the other stage's; its adapters the draws one process makes, the other stage's
    drawn and dropped): one process's losses, gradient norms and adapters over the same
    rows, and the checkpoint resumes in one process."""
    out = tmp_path / "staged"
    (steps, first), (steps1, second) = in_processes(_quantized_stages, out)
    assert steps == steps1
    assert {n.split(".")[2] for n in first} == {"0", "1"} and {n.split(".")[2] for n in second} == {"2", "3"}
    whole = _quantized_whole()
    whole.untie_head()
    reference = _run(whole, _rows(), 2, save_to=tmp_path / "one")
    _same_steps(steps, reference)
    two, one = (load_file(str(d / "adapter_model.safetensors")) for d in (out / "final", tmp_path / "one"))
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=3e-5, rtol=0, msg=key)
    (tmp_path / "whole").mkdir()
    shutil.copytree(out / "ckpt" / "step-00000002", tmp_path / "whole" / "step-00000002")
    resumed = _quantized_whole()
    resumed.untie_head()
    _same_steps(_run(resumed, _rows(), 2, checkpoint=tmp_path / "whole"), reference[2:])


def _staged_dpo(rank, lora, cache):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("stages",))
    torch.manual_seed(0)
    model = nest.load(CARD, weights="random", seed=0, trainable=not lora, pipeline=mesh, pipeline_schedule="1f1b",
                      lora=dict(patterns="*_proj.weight", rank=4) if lora else None)
    return _dpo(model, _dpo_pairs(), 4, cache)


def _dpo_pairs():
    return [p for s in range(2) for r in range(2) for p in _pairs(r, s)]


@pytest.mark.parametrize("lora", [True, False])
def test_stages_train_dpo_like_one_process(tmp_path, lora):
    """DPO through two pipeline stages (the last computing each row's pair losses from its
    log-probabilities; one or two rows a step, 1F1B falling back to GPipe for one) takes one
    process's losses, gradient norms and accuracies: LoRA with the policy's own
    log-probabilities before training as the reference (computed through the stages), full
    fine-tuning with them cached (one file: both stages agree on the pipeline's key)."""
    cache = None if lora else tmp_path / "cache"
    steps = in_processes(_staged_dpo, lora, cache)
    assert lora or len(list(cache.glob("*.npy"))) == 1
    torch.manual_seed(0)
    whole = nest.load(CARD, weights="random", seed=0, trainable=not lora,
                      lora=dict(patterns="*_proj.weight", rank=4) if lora else None)
    reference = _dpo(whole, _dpo_pairs(), 4, None if lora else tmp_path / "cache")
    assert steps[0] == steps[1]
    for got, want in zip(steps[0], reference, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def _interleaved(rank, schedule):
    """Steps of 1, 4 and 5 rows (GPipe-like, interleaved 1F1B or zero-bubble in two rounds,
    and in chunk order when the rows do not divide into rounds), and DPO with its reference
    passes."""
    runs = [_run(pipeline(_model(False, False), schedule=schedule), _rows(), m, steps=2) for m in (1, 4, 5)]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("stages",))
    model = nest.load(CARD, weights="random", seed=0, trainable=True, pipeline=mesh, pipeline_schedule=schedule)
    return runs, _dpo(model, _dpo_pairs(), 4)


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble"])
def test_interleaved_stages_take_any_number_of_rows_like_one_process(schedule):
    (runs, dpo), (runs1, dpo1) = in_processes(_interleaved, schedule)
    assert runs == runs1 and dpo == dpo1
    for got, m in zip(runs, (1, 4, 5), strict=True):
        _same_steps(got, _run(_model(False, False), _rows(), m, steps=2))
    whole = nest.load(CARD, weights="random", seed=0, trainable=True)
    for got, want in zip(dpo, _dpo(whole, _dpo_pairs(), 4), strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def _one_row_a_step(rank):
    return _run(pipeline(_model(False, False), schedule="1f1b"), _rows(), 1, steps=2)


def test_a_1f1b_step_with_fewer_rows_than_stages_runs_as_gpipe():
    steps = in_processes(_one_row_a_step)
    assert steps[0] == steps[1]
    _same_steps(steps[0], _run(_model(False, False), _rows(), 1, steps=2))


def _resumed(rank, out):
    return _run(pipeline(_model(False, False)), _rows(), 2, checkpoint=out)


def _copies(rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("copies", "stages"))
    model = pipeline(_model(False, False), mesh["stages"])
    return _run(model, _rows()[mesh.get_local_rank("copies")::2], 2, steps=2)


def test_two_pipelines_train_like_one_and_resume_as_stages(tmp_path):
    """Two copies of a two-stage pipeline (four processes), each on its share of the
    rows, take one process's steps over every row; a two-stage run stopped at step 2
    resumes from its checkpoint to the same steps 3 and 4."""
    results = in_processes(_copies, processes=4)
    assert all(r == results[0] for r in results)
    _same_steps(results[0], _run(_model(False, False), _rows(), 4, steps=2))
    out = tmp_path / "staged"
    whole = _run(_model(False, False), _rows(), 2)
    shutil.copytree(_checkpoint_at_two(tmp_path), out / "step-00000002")
    resumed = in_processes(_resumed, out)
    assert resumed[0] == resumed[1]
    _same_steps(resumed[0], whole[2:])


SHARES = ([0, 2, 4, 6], [1, 3, 5])  # each copy's rows: the second's last step has one row, the first's two


def _sharded_stages(rank, lora, schedule, out):
    """Two copies of a two-stage pipeline (rank = 2 x copy + stage), each stage's blocks
    sharded over its two copies as they load: SFT on each copy's rows (SHARES) and a
    held-out loss over three rows, or with LoRA DPO on _pairs (two rows a step against
    one). Returns the sharded parameters' local shapes and what the run reported."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("copies", "stages"))
    copy = mesh.get_local_rank("copies")
    torch.manual_seed(0)
    model = nest.load(CARD, weights="random", seed=0, trainable=not lora, pipeline=mesh["stages"], fully_shard=True,
                      pipeline_schedule=schedule, lora=dict(patterns="*_proj.weight", rank=4) if lora else None)
    parts = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    if lora:
        return parts, _dpo(model, [p for s in range(2) for p in _pairs(copy, s)], 2)
    steps = _run(model, [_rows()[i] for i in SHARES[copy]], 2, steps=2, save_to=out / "final",
                 checkpoint=out / "ckpt")
    with torch.no_grad():
        held = held_out_loss(model, _rows()[:3], share=copy, shares=2)
    return parts, steps, held


@pytest.mark.parametrize("lora, schedule", [(False, "1f1b"), (True, "1f1b"), (False, "interleaved")])
def test_stages_sharded_over_their_copies_train_like_one_process(tmp_path, lora, schedule):
    """Pipeline stages sharded over their copies (`nest.load(pipeline=, fully_shard=True)`):
    each process holds half of each of its stage's weights (the blocks, the embedding, the
    norm and the head), and a copy with fewer rows in a step (SFT) or fewer rows of pairs (DPO,
    its reference log-probabilities through the stages) passes rows that learn nothing, so
    the copies' gathers meet; the steps equal one process's over every row, the held-out
    loss (a copy with one row of three) the whole model's, and the saved weights and the
    checkpoint one process's trained weights; and so on the interleaved schedule (blocks 0
    and 2 on the first stage)."""
    out = tmp_path / "staged"
    results = in_processes(_sharded_stages, lora, schedule, out, processes=4)
    q = "model.layers.{}.self_attn.q_proj.weight"
    for rank, (parts, *_) in enumerate(results):
        assert parts[q.format(rank % 2 if schedule == "interleaved" else 2 * (rank % 2))] == \
            (CARD.heads * CARD.head_dim // 2, CARD.hidden)
        root = "lm_head.weight" if rank % 2 else "model.embed_tokens.weight"
        assert parts[root] == (CARD.vocab // 2, CARD.hidden)
    assert all(r[1:] == results[0][1:] for r in results)
    torch.manual_seed(0)
    whole = nest.load(CARD, weights="random", seed=0, trainable=not lora,
                      lora=dict(patterns="*_proj.weight", rank=4) if lora else None)
    if lora:
        reference = _dpo(whole, [p for s in range(2) for r in range(2) for p in _pairs(r, s)], 4)
        for got, want in zip(results[0][1], reference, strict=True):
            assert got == pytest.approx(want, rel=1e-5)
        return
    _, steps, held = results[0]
    _same_steps(steps, _run(whole, [_rows()[i] for i in (0, 2, 1, 3, 4, 6, 5)], 4, steps=2, save_to=tmp_path / "one"))
    with torch.no_grad():
        assert held == pytest.approx(held_out_loss(whole, _rows()[:3]), rel=1e-6)
    saved = load_file(str(out / "final" / "model.safetensors"))
    restored = _model(False, False)
    load_checkpoint(out / "ckpt", model=restored)
    trained = {n: p.detach() for n, p in whole.named_parameters()}
    for name, value in restored.named_parameters():
        torch.testing.assert_close(value.detach(), trained[name], atol=3e-5, rtol=0, msg=name)
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert saved.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(saved[key], one[key], atol=3e-5, rtol=0, msg=key)


def _sharded_quantized_stages(rank):
    """QLoRA in two copies of two stages sharded over them: the steps, and whether this
    process's NF4 codes are its half of each block's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("copies", "stages"))
    torch.manual_seed(0)
    model = nest.load(CARD, weights="random", seed=0, quantize="nf4", pipeline=mesh["stages"], fully_shard=True,
                      lora=dict(patterns="*_proj.weight", rank=4))
    codes = [m.weight for m in model.modules() if getattr(m, "quant_state", None) is not None]
    halves = all(isinstance(w, DTensor) and w.to_local().shape[0] * 2 == w.shape[0] for w in codes)
    return _run(model, [_rows()[i] for i in SHARES[mesh.get_local_rank("copies")]], 2, steps=2), bool(codes) and halves


def test_an_nf4_base_in_stages_sharded_over_their_copies_trains_like_one_process():
    """QLoRA (`nest.load(quantize="nf4", pipeline=, fully_shard=True, lora=)`): each process
    quantizes and keeps half of its stage's NF4 codes, and the steps equal one process's
    QLoRA over every row."""
    results = in_processes(_sharded_quantized_stages, processes=4)
    assert all(halves for _, halves in results) and all(r[0] == results[0][0] for r in results)
    _same_steps(results[0][0], _run(_quantized_whole(), [_rows()[i] for i in (0, 2, 1, 3, 4, 6, 5)], 4, steps=2))


def _checkpoint_at_two(tmp_path):
    in_processes(_first_two, tmp_path / "two")
    return tmp_path / "two" / "step-00000002"


def _first_two(rank, out):
    model = pipeline(_model(False, False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    train(model, _rows(), optimizer=opt, steps=2, accumulate=2, clip=0.5, checkpoint=out)


def _refusals(rank):
    with pytest.raises(ValueError, match="with tensor_parallel=, pass the stages' mesh too"):
        pipeline(_model(False, False), tensor_parallel=object())
    with pytest.raises(ValueError, match="schedule='zbv'"):
        pipeline(_model(False, False), schedule="zbv")
    checkpointed = pipeline(_model(False, False), schedule="zero-bubble")
    checkpointed.checkpoint_activations(True)
    with pytest.raises(ValueError, match="'zero-bubble' with activation checkpointing is not supported"):
        _run(checkpointed, _rows(), 2, steps=1)
    with pytest.raises(ValueError, match="1 layers, fewer than 2 stages"):
        pipeline(nest.load(CARD.replace(layers=1), weights="random", seed=0))
    with pytest.raises(ValueError, match=r"3 layers, fewer than 4 chunks \(two a stage\)"):
        pipeline(nest.load(CARD.replace(layers=3), weights="random", seed=0), schedule="interleaved")
    model = pipeline(_model(False, False))
    with pytest.raises(ValueError, match="already cut"):
        pipeline(model)
    with pytest.raises(RuntimeError, match="under torch.no_grad"):
        model.loss_packed(_rows()[0])
    with pytest.raises(RuntimeError, match="cut into pipeline stages"):
        model.log_probs_packed(_rows()[0])
    if rank == 0:  # a score head put on the first stage by hand: refused before any pass
        from linnet.train.reward import reward

        model.score = torch.nn.Linear(CARD.hidden, 1, bias=False)
        with pytest.raises(ValueError, match="a stage before the last holds a score head"):
            reward(model, _dpo_pairs(), optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1)
    return True


def test_pipeline_refuses_what_it_cannot_do():
    assert in_processes(_refusals) == [True, True]
    with pytest.raises(RuntimeError, match="needs a process group"):
        pipeline(_model(False, False))
    with pytest.raises(ValueError, match="'zero-bubble' with fully_shard is not supported yet"):
        pipeline(_model(False, False), schedule="zero-bubble", fully_shard=True)


def _split_stages(rank, lora, out):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stages", "split"))
    model = pipeline(nest.load(CARD, weights="random", seed=0, trainable=not lora), mesh["stages"],
                     tensor_parallel=mesh["split"])
    if lora:
        torch.manual_seed(0)  # A is drawn whole on the split's first process and sent to the other
        model.add_lora("*_proj.weight", rank=4)
    first = copy_first(model, lambda: rank)  # what the copy's first process (stage 0, split 0) computed
    return [first] + _run(model, _rows(), 2, save_to=out / "final", checkpoint=out / "ckpt", checkpoint_every=2)


def test_split_stages_train_like_one_process(tmp_path):
    """Two stages, each split over two processes (tensor parallel inside a stage: four
    processes), take one process's steps over the same rows and write its weights; the
    checkpoint of their parts resumes whole in one process. Adapters added after the cut
    and split are drawn as one process draws them (each stage drawing the others' too, and
    dropping them) and take its steps; they save whole. `copy_first` hands every process
    the first one's value."""
    adapted = in_processes(_split_stages, True, tmp_path / "lora", processes=4)
    assert all(r == adapted[0] for r in adapted) and adapted[0][0] == 0
    adapted = [r[1:] for r in adapted]
    for (loss, norm, learned), (ref_loss, ref_norm, ref_learned) in zip(adapted[0], _run(_model(True, False), _rows(), 2),
                                                                        strict=True):
        assert learned == ref_learned and loss == pytest.approx(ref_loss, rel=1e-6)
        assert norm == pytest.approx(ref_norm, rel=1e-4)  # the split sums each adapter's products apart
    saved = load_file(str(tmp_path / "lora" / "final" / "adapter_model.safetensors"))
    assert len(saved) == 2 * 7 * CARD.layers
    out = tmp_path / "split"
    results = [r[1:] for r in in_processes(_split_stages, False, out, processes=4)]
    assert all(r == results[0] for r in results)
    reference = _run(_model(False, False), _rows(), 2, save_to=tmp_path / "one")
    _same_steps(results[0], reference)
    two, one = (load_file(str(d / "model.safetensors")) for d in (out / "final", tmp_path / "one"))
    assert two.keys() == one.keys()
    for key in one:  # AdamW magnifies rounding where a gradient is tiny (a split sums its products apart)
        torch.testing.assert_close(two[key], one[key], atol=3e-4, rtol=0, msg=key)
    (tmp_path / "whole").mkdir()
    shutil.copytree(out / "ckpt" / "step-00000002", tmp_path / "whole" / "step-00000002")
    _same_steps(_run(_model(False, False), _rows(), 2, checkpoint=tmp_path / "whole"), reference[2:])


def _split_zero_bubble(rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stages", "split"))
    model = pipeline(nest.load(CARD, weights="random", seed=0, trainable=True), mesh["stages"],
                     tensor_parallel=mesh["split"], schedule="zero-bubble")
    return _run(model, _rows(), 2)


def test_split_stages_on_the_zero_bubble_schedule_train_like_one_process():
    """Two stages split two ways on the zero-bubble schedule (each split chunk's backward in
    two halves): one process's steps."""
    results = in_processes(_split_zero_bubble, processes=4)
    assert all(r == results[0] for r in results)
    _same_steps(results[0], _run(_model(False, False), _rows(), 2))


def _held(rank, split, stages, lora):
    """(stage, parameters held, trained) of this process, built as `linnet sft` builds it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, stages, split), mesh_dim_names=("copies", "stages", "split"))
    model = nest.load(CARD.replace(tied_embeddings=True), weights="random", seed=0, trainable=not lora,
                      tensor_parallel=mesh["split"] if split > 1 and stages == 1 else None)
    if stages > 1:
        pipeline(model, mesh["stages"], tensor_parallel=mesh["split"] if split > 1 else None)
    if lora:
        model.add_lora("*_proj.weight", rank=4)

    def count(p):
        return p.to_local().numel() if hasattr(p, "to_local") else p.numel()

    return (mesh["stages"].get_local_rank(), sum(count(p) for p in model.parameters()),
            sum(count(p) for p in model.parameters() if p.requires_grad))


@pytest.mark.parametrize("split, stages, lora", [(2, 1, True), (1, 2, False), (2, 2, True)])
def test_the_planner_counts_what_each_process_holds(split, stages, lora):
    """`linnet plan`'s part for each process of a split, pipelined or split-and-pipelined copy
    (a tied head untied, adapters added after the cut) counts exactly the model's parameters
    and the trained ones that the process holds (bench/plan_parallel.md sets its memory
    beside the measured)."""
    from linnet import plan

    settings = dict(method="lora" if lora else "full", rank=4, split=split, pipeline=stages, gpus=split * stages)
    parts = plan.estimate(CARD.replace(tied_embeddings=True), **plan.plan_inputs(settings)).processes
    for stage, params, trained in in_processes(_held, split, stages, lora, processes=split * stages):
        base = params - trained if lora else params  # the planner's parameters are the model's, adapters apart
        assert (parts[stage].params, parts[stage].trainable) == (base, trained)


def _sharded_held(rank):
    """(stage, parameters this process holds) of two copies of two stages sharded over them."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("copies", "stages"))
    model = nest.load(CARD.replace(tied_embeddings=True), weights="random", seed=0, trainable=True,
                      pipeline=mesh["stages"], fully_shard=True)
    return mesh["stages"].get_local_rank(), sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                                for p in model.parameters())


def test_the_planner_counts_what_sharded_stages_hold():
    """`linnet plan --pipeline 2 --gpus 4 --shard fsdp`: each stage's states are those of its
    half of the stage (blocks, embedding or head alike), parameter for parameter
    (mixed-precision AdamW: 2 B of gradient, 4 of master copy, 8 of moments a parameter held)."""
    from linnet import plan

    settings = dict(method="full", pipeline=2, gpus=4, shard="fsdp")
    parts = plan.estimate(CARD.replace(tied_embeddings=True), **plan.plan_inputs(settings)).processes
    held = dict(in_processes(_sharded_held, processes=4))
    assert held[0] < parts[0].params  # sharded: less than the stage
    for stage, n in held.items():
        states = parts[stage].states
        assert (states.gradients, states.master, states.optimizer) == (2 * n, 4 * n, 8 * n)


def _built(rank, weights, tied, stages, split):
    """This process's parameters built as its part alone, and cut and split from the whole
    model."""
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch.sharding import tensor_parallel

    mesh = init_device_mesh("cpu", (stages, split), mesh_dim_names=("stages", "split"))
    card = CARD.replace(tied_embeddings=tied)
    options = dict(weights=weights, seed=0, trainable=True)
    splitting = mesh["split"] if split > 1 else None
    if stages > 1:
        alone = nest.load(card, pipeline=mesh["stages"], pipeline_schedule="gpipe", tensor_parallel=splitting,
                          **options)
        cut = pipeline(nest.load(card, **options), mesh["stages"], schedule="gpipe", tensor_parallel=splitting)
        assert (alone.pipe.index, alone.pipe.schedule) == (cut.pipe.index, cut.pipe.schedule)
    else:
        alone = nest.load(card, tensor_parallel=splitting, **options)
        cut = tensor_parallel(nest.load(card, **options), splitting)
    assert alone.card == cut.card

    return gathered(alone), gathered(cut)


@pytest.mark.parametrize("weights, tied, stages, split", [("random", True, 2, 1), ("file", False, 2, 1),
                                                          ("file", True, 2, 2), ("file", True, 1, 2)])
def test_a_part_built_alone_equals_one_cut_from_the_whole_model(tmp_path, weights, tied, stages, split):
    """nest.load(card, pipeline=mesh['stages'], tensor_parallel=mesh['split']) builds only this
    process's part (cut and split on meta, then each weight read or drawn whole and its part
    copied in: no process holds the whole model) and holds exactly what pipeline() and
    tensor_parallel() keep of a whole model: the same names and values, a tied head untied
    from the embedding."""
    if weights == "file":
        nest.load(CARD.replace(tied_embeddings=tied), weights="random", seed=3).save_weights(tmp_path / "w")
        weights = str(tmp_path / "w")
    for alone, cut in in_processes(_built, weights, tied, stages, split, processes=stages * split):
        assert alone.keys() == cut.keys()
        for name in cut:
            np.testing.assert_array_equal(alone[name], cut[name], err_msg=name)
