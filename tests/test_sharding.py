"""fully_shard: two forked processes (gloo) train a sharded model like one process
training the whole model on both their batches; checkpoints hold each process's parts
and resume under two processes or one."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from linnet import nest
from linnet.packing import Example, Pair, Unpaired, pack
from linnet.torch import fully_shard
from linnet.torch.sharding import local, scatter_positions
from linnet.train import train
from linnet.train.checkpoint import load_checkpoint, save_checkpoint
from linnet.train.distill import distill
from linnet.train.dpo import dpo
from linnet.train.grpo import Prompt, grpo
from linnet.train.kto import kto
from linnet.train.reward import add_score_head, held_out_accuracy, reward
from tests.conftest import gathered, in_processes

CARD = nest.resolve("debug").replace(vocab=64, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8,
                                     layers=2, tied_embeddings=False)
STEPS = 4


def _rows():
    """Eight rows of unequal learned counts: step s takes rows 2s and 2s + 1."""
    g = np.random.default_rng(0)
    docs = [Example.prompted(g.integers(3, 64, 4).tolist(), g.integers(3, 64, int(n)).tolist())
            for n in g.integers(1, 12, size=48)]
    rows = list(pack(docs, tokens=40))[: 2 * STEPS]
    assert len(rows) == 2 * STEPS and len({r.learned for r in rows}) > 2
    return rows


def _model(lora: bool, dtype: str, tied: bool = False):
    card = CARD.replace(tied_embeddings=tied)
    model = nest.load(card, weights="random", seed=0, trainable=not lora, dtype=dtype)
    if lora:
        model.add_lora("*_proj.weight", rank=4)
    return model


def _run(model, rows, accumulate, **kw):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    history = train(model, rows, optimizer=opt, steps=STEPS, accumulate=accumulate, clip=0.5, **kw)
    return [(s.loss, s.grad_norm, s.learned) for s in history.steps]


def _sharded_run(rank, lora, dtype, out, tied=False):
    model = fully_shard(_model(lora, dtype, tied))
    return _run(model, _rows()[rank::2], 1, save_to=out / "final", checkpoint=out / "ckpt", checkpoint_every=2)


def _held(rank):
    """(elements this process holds, elements of the whole model) of the weights and,
    after a step, of AdamW's state."""
    from linnet.torch.sharding import local

    model = fully_shard(_model(False, "float32"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, _rows()[rank::2][:1], optimizer=opt, steps=1)
    held = sum(local(p).numel() for p in model.parameters())
    held += sum(local(v).numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    return held, 3 * sum(p.numel() for p in model.parameters())


def test_each_process_holds_half_the_weights_and_optimizer_state():
    for held, whole in in_processes(_held):
        assert held == whole // 2


@pytest.mark.parametrize("lora,dtype,tied,tol", [(False, "float32", False, 1e-5), (False, "float32", True, 1e-5),
                                                 (True, "bfloat16", False, 2e-3)])
def test_sharded_processes_train_like_one(tmp_path, lora, dtype, tied, tol):
    """Losses, gradient norms and the saved result equal one process's over both
    batches: sharded f32 full fine-tuning (the head apart or tied to the embedding), and
    LoRA over bf16 weights split in bf16."""
    steps = in_processes(_sharded_run, lora, dtype, tmp_path / "two", tied)
    model = _model(lora, dtype, tied)
    reference = _run(model, _rows(), 2, save_to=tmp_path / "one")
    assert steps[0] == steps[1]
    for (loss, norm, learned), (ref_loss, ref_norm, ref_learned) in zip(steps[0], reference, strict=True):
        assert learned == ref_learned
        assert loss == pytest.approx(ref_loss, rel=tol) and norm == pytest.approx(ref_norm, rel=10 * tol)
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    two, one = load_file(str(tmp_path / "two" / "final" / name)), load_file(str(tmp_path / "one" / name))
    assert two.keys() == one.keys()
    for key in one:
        # AdamW magnifies rounding where a gradient is tiny: weights agree less closely than losses
        torch.testing.assert_close(two[key].float(), one[key].float(), atol=max(10 * tol, 3e-4), rtol=0, msg=key)
    parts = sorted(p.name for p in (tmp_path / "two" / "ckpt" / "step-00000004" / "sharded").iterdir())
    assert parts == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each process writes its parts


def _resumed(rank, start, out):
    model = fully_shard(_model(False, "float32"))
    return _run(model, _rows()[rank::2], 1, checkpoint=out, checkpoint_every=2)


def test_sharded_checkpoint_resumes_under_two_processes_or_one(tmp_path):
    """Resuming the step-2 checkpoint gives the straight run's steps 3 and 4, whether two
    sharded processes or one whole model read it."""
    straight = in_processes(_sharded_run, False, "float32", tmp_path / "straight")[0]
    for copy in ("two", "one"):
        (tmp_path / copy).mkdir()
        src = tmp_path / "straight" / "ckpt" / "step-00000002"
        shutil.copytree(src, tmp_path / copy / src.name)
    two = in_processes(_resumed, 2, tmp_path / "two")[0]
    one = _run(_model(False, "float32"), _rows(), 2, checkpoint=tmp_path / "one")
    for resumed in (two, one):
        assert len(resumed) == 2
        for (loss, norm, _), (ref_loss, ref_norm, _) in zip(resumed, straight[2:], strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


def _refuse_plain_checkpoint(rank, path):
    model = fully_shard(_model(False, "float32"))
    with pytest.raises(ValueError, match="without fully_shard"):
        load_checkpoint(path, model=model)
    with pytest.raises(ValueError, match="sharded already"):
        fully_shard(model)
    from linnet.torch.lora import merge_lora

    with pytest.raises(ValueError, match="merge them on one process"):
        merge_lora(model)
    return True


def test_sharding_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(RuntimeError, match="needs a process group"):
        fully_shard(_model(False, "float32"))
    model = _model(False, "float32")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = save_checkpoint(tmp_path, model=model, optimizer=opt, step=1)
    assert in_processes(_refuse_plain_checkpoint, plain) == [True, True]


def _pairs(process: int, step: int) -> list[Pair]:
    """Two pairs; process 0's fill a row each, process 1's share one."""
    g = np.random.default_rng(10 * step + process)
    n = 14 if process == 0 else 3
    return [Pair(g.integers(3, 64, 4).tolist(), g.integers(3, 64, n).tolist(), g.integers(3, 64, n).tolist())
            for _ in range(2)]


def _dpo(model, pairs, per_step, cache=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    history = dpo(model, pairs, optimizer=opt, steps=2, pairs_per_step=per_step, tokens=40, reference_cache=cache)
    return [(s.loss, s.grad_norm, s.metrics["rewards/accuracies"]) for s in history.steps]


def _sharded_dpo(rank, cache=None):
    return _dpo(fully_shard(_model(True, "float32")), [p for s in range(2) for p in _pairs(rank, s)], 2, cache)


def test_sharded_dpo_with_uneven_rows_trains_like_one_process():
    """Process 0 packs two rows a step, process 1 one: process 1 makes idle passes so
    their gathers and reductions meet, and the steps equal one process over all pairs
    (its own log-probabilities before training as the reference)."""
    steps = in_processes(_sharded_dpo)
    reference = _dpo(_model(True, "float32"), [p for s in range(2) for r in range(2) for p in _pairs(r, s)], 4)
    assert steps[0] == steps[1]
    for got, want in zip(steps[0], reference, strict=True):
        assert got == pytest.approx(want, rel=1e-5)



def _unpaired(process: int, step: int) -> list[Unpaired]:
    """Two answers to one shared prompt (so KTO's mismatched pairs do not depend on the
    order); process 0's take a row each, process 1's share one."""
    g = np.random.default_rng(10 * step + process)
    n = 25 if process == 0 else 3
    return [Unpaired([5, 6, 7, 8], g.integers(3, 64, n).tolist(), desirable=bool(i)) for i in range(2)]


def _objective(name: str, model, items, per_step: int):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if name == "dpo":
        history = dpo(model, items, optimizer=opt, steps=2, pairs_per_step=per_step, tokens=40)
        return [x for s in history.steps for x in (s.loss, s.grad_norm, s.metrics["rewards/margins"])]
    if name == "kto":
        history = kto(model, items, optimizer=opt, steps=2, examples_per_step=per_step, tokens=40)
        return [x for s in history.steps for x in (s.loss, s.grad_norm, s.metrics["kl"])]
    history = reward(model, items, optimizer=opt, steps=2, pairs_per_step=per_step, tokens=40)
    return [x for s in history.steps for x in (s.loss, s.grad_norm, s.metrics["accuracy"])] + \
        [held_out_accuracy(model, items, tokens=40)["held_out_loss"]]


def _objective_model(name: str, **parallel):
    """A LoRA model (split or cut into stages by `parallel`: nest.load's options), its
    adapters drawn as one process would."""
    torch.manual_seed(0)
    model = nest.load(CARD, weights="random", seed=0, dtype="float32", lora=dict(patterns="*_proj.weight", rank=4),
                      **parallel)
    return add_score_head(model) if name == "reward" else model


def _items(name: str, process: int, step: int) -> list:
    return _unpaired(process, step) if name == "kto" else _pairs(process, step)


def _sharded_objective(rank, name):
    return _objective(name, fully_shard(_objective_model(name)), [x for s in range(2) for x in _items(name, rank, s)], 2)


@pytest.mark.parametrize("name", ["kto", "reward"])
def test_sharded_kto_and_reward_with_uneven_rows_train_like_one_process(name):
    """Process 0 packs more rows than process 1 (in training and in the reference or
    scoring passes): process 1 makes idle passes with the objective's own loss, so the
    gathers meet, and the steps equal one process's over every item (they hung before)."""
    steps = in_processes(_sharded_objective, name)
    whole = [x for s in range(2) for r in range(2) for x in _items(name, r, s)]
    reference = _objective(name, _objective_model(name), whole, 4)
    assert steps[0] == steps[1]
    assert steps[0] == pytest.approx(reference, rel=1e-5)


def _parallel_objective(rank, name, mode):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(mode,))
    parallel = dict(tensor_parallel=mesh) if mode == "split" else dict(pipeline=mesh, pipeline_schedule="1f1b")
    return _objective(name, _objective_model(name, **parallel), [x for s in range(2) for r in range(2)
                                                                 for x in _items(name, r, s)], 4)


@pytest.mark.parametrize("mode", ["split", "pipeline"])
@pytest.mark.parametrize("name", ["dpo", "kto", "reward"])
def test_split_and_pipelined_models_train_preferences_like_one_process(name, mode):
    """DPO, KTO and reward models on a model split over two processes, or cut into two
    pipeline stages (the last computing the losses; the reference's, the KL estimate's and
    the held-out scores passing through both), with the same items on both, take one
    process's steps: each step's counts and gradients are summed over the model's copies
    alone (before, KTO and reward models summed over the split too)."""
    steps = in_processes(_parallel_objective, name, mode)
    whole = [x for s in range(2) for r in range(2) for x in _items(name, r, s)]
    assert steps[0] == steps[1]
    assert steps[0] == pytest.approx(_objective(name, _objective_model(name), whole, 4), rel=1e-5, abs=1e-6)



def _grpo_steps(policy, seed: int, mode: str = "split") -> list[float]:
    """Two GRPO steps; a pipelined policy's with two iterations a step and a KL term
    against a whole reference on every process (the last stage computes it)."""
    from linnet.serve import Engine

    engine = Engine(nest.load(CARD, weights="random", seed=0))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    more = dict(iterations=2, beta=0.1, reference=nest.load(CARD, weights="random", seed=0)) if mode == "pipeline" \
        else {}
    history = grpo(policy, engine, [Prompt([3, 4, 5]), Prompt([6, 7])], lambda p, c: float(sum(c) % 5),
                   optimizer=opt, steps=2, group=4, prompts_per_step=2, max_new_tokens=4, tokens=32, seed=seed,
                   verbose=False, **more)
    return [x for s in history.steps for x in (s.loss, s.grad_norm, s.metrics["reward"], s.metrics["kl"])]


def _parallel_grpo(rank, mode):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(mode,))
    parallel = dict(tensor_parallel=mesh) if mode == "split" else dict(pipeline=mesh, pipeline_schedule="1f1b")
    return _grpo_steps(_objective_model("grpo", **parallel), seed=rank, mode=mode)  # each process would sample its own


@pytest.mark.parametrize("mode", ["split", "pipeline"])
def test_split_or_pipelined_grpo_trains_on_the_first_processs_samples_like_one_process(mode):
    """GRPO on a model split over two processes, or cut into two pipeline stages (every
    stage's engine taking the whole policy from the stages, the last stage computing the
    losses and the KL term), whose engines draw differently (seeds 0 and 1): both train on
    the first process's completions, and take one process's steps with seed 0."""
    steps = in_processes(_parallel_grpo, mode)
    assert steps[0] == steps[1]
    assert steps[0] == pytest.approx(_grpo_steps(_objective_model("grpo"), seed=0, mode=mode), rel=1e-5, abs=1e-6)

def test_sharded_dpo_reads_and_writes_a_reference_cache(tmp_path):
    """dpo.reference_cache under fully_shard: each process's share gets the file one process
    would write for those pairs (the key hashes the gathered weights), and when one process
    has its file and the other not, both compute again rather than wait on each other."""
    from linnet.train.dpo import cache_key

    plain = in_processes(_sharded_dpo)
    first = in_processes(_sharded_dpo, tmp_path)
    with torch.random.fork_rng():  # the adapters' draw the forked processes make, leaving theirs as it was
        whole = _model(True, "float32")
    keys = [cache_key(whole, [p for s in range(2) for p in _pairs(r, s)]) for r in range(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"dpo-reference-{k}.npy" for k in keys)
    (tmp_path / f"dpo-reference-{keys[1]}.npy").unlink()
    again = in_processes(_sharded_dpo, tmp_path)
    assert first == again == plain

def _sharded_grpo(rank, out):
    from linnet.serve import Engine

    policy = fully_shard(_model(False, "float32"))
    engine = Engine(nest.load(CARD, weights="random", seed=0))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    prompts = [Prompt([3 + rank, 4, 5])] * 2
    # process 1's reward is constant: its groups are uniform and dropped, leaving it no row
    reward = (lambda prompt, completion: float(sum(completion) % 5)) if rank == 0 else (lambda p, c: 1.0)
    history = grpo(policy, engine, prompts, reward, optimizer=opt, steps=3, group=4, prompts_per_step=1,
                   max_new_tokens=4, tokens=32, drop_uniform=True, save_to=out, verbose=False, seed=rank)
    engine.load_weights(policy)  # gathers the trained parts on both processes
    return [(s.grad_norm, s.metrics["uniform"]) for s in history.steps], engine.model.lm_head.weight.numpy().copy()


def test_sharded_grpo_runs_when_a_process_has_nothing_to_train(tmp_path):
    """A process whose groups were all dropped still meets the other's passes; the
    engine takes the gathered policy on both processes."""
    (steps0, head0), (steps1, head1) = in_processes(_sharded_grpo, tmp_path)
    assert [n for n, _ in steps0] == [n for n, _ in steps1] and all(n > 0 for n, _ in steps0)
    assert [u for _, u in steps0] == [0.0] * 3 and [u for _, u in steps1] == [1.0] * 3
    saved = load_file(str(tmp_path / "model.safetensors"))["lm_head.weight"].numpy()
    np.testing.assert_array_equal(head0, head1)
    np.testing.assert_allclose(saved, head0, atol=1e-6)
    assert not np.allclose(saved, _model(False, "float32").lm_head.weight.detach().numpy(), atol=1e-4)


def _whole(tied: bool):
    """The whole model a split one trains like: a tied card's split model has its own head,
    a copy of the embedding (the same random draws for every other parameter)."""
    model = _model(False, "float32")
    if tied:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    return model


def _split_head_log_probs_equal_whole(model, place: int, tied: bool) -> None:
    """The head split by vocabulary: log-probabilities, and this process's rows of the
    head's gradient, equal the whole model's."""
    from linnet.torch.sharding import local

    whole, row = _whole(tied), _rows()[0]
    head = local(model.lm_head.weight)
    assert head.shape[0] * 2 == CARD.vocab
    for m in (model, whole):
        m.log_probs_packed(row).sum().backward()
    np.testing.assert_allclose(model.log_probs_packed(row).detach().numpy(),
                               whole.log_probs_packed(row).detach().numpy(), atol=1e-5)
    rows = slice(place * head.shape[0], (place + 1) * head.shape[0])
    np.testing.assert_allclose(local(model.lm_head.weight.grad).numpy(), whole.lm_head.weight.grad[rows].numpy(),
                               atol=1e-5)
    model.zero_grad(set_to_none=True)


def _split_run(rank, copies, out, tied, shard):
    from torch.distributed.device_mesh import init_device_mesh

    split = 4 // copies if copies > 1 else 2
    mesh = init_device_mesh("cpu", (copies, split), mesh_dim_names=("copies", "split"))
    model = nest.load(CARD.replace(tied_embeddings=tied), weights="random", seed=0, trainable=True,
                      tensor_parallel=mesh["split"], fully_shard=shard)
    copy = mesh.get_local_rank("copies")
    heads = model.model.layers[0].self_attn.shape[0]
    if shard:  # each part of the split sharded over the two copies: a quarter of a block's weights a process
        proj = model.model.layers[0].mlp.up_proj.weight
        assert proj.device_mesh.mesh_dim_names == ("copies", "split") and local(proj).numel() * 4 == proj.numel()
    else:
        _split_head_log_probs_equal_whole(model, mesh.get_local_rank("split"), tied)
    steps = _run(model, _rows()[copy::copies], 2 // copies, save_to=out / "final", checkpoint=out / "ckpt",
                 checkpoint_every=2)
    return steps, heads


@pytest.mark.parametrize("copies,tied,shard", [(1, False, False), (2, False, False), (1, True, False),
                                               (2, True, True)])
def test_split_processes_train_like_one(tmp_path, copies, tied, shard):
    """tensor_parallel: two processes splitting every block (one copy), or two copies of a
    two-way split (four processes), the copies' parts sharded over them by fully_shard or
    not (FSDP x TP), take the steps and write the weights of one process training the whole
    model on every copy's batches; the parts' checkpoint resumes into a whole model in one
    process. A head tied to the embedding trains apart from it once split, as an untied
    model's head starting from the embedding does."""
    out = tmp_path / "split"
    results = in_processes(_split_run, copies, out, tied, shard, processes=2 * copies)
    assert all(heads == CARD.heads // 2 for _, heads in results)
    assert all(steps == results[0][0] for steps, _ in results)
    reference = _run(_whole(tied), _rows(), 2, save_to=tmp_path / "one")
    for (loss, norm, learned), (ref_loss, ref_norm, ref_learned) in zip(results[0][0], reference, strict=True):
        assert learned == ref_learned
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)
    two, one = (load_file(str(d / "model.safetensors")) for d in (out / "final", tmp_path / "one"))
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=3e-4, rtol=0, msg=key)
    assert not torch.allclose(two["lm_head.weight"], two["model.embed_tokens.weight"], atol=1e-3)
    assert nest.resolve(out / "final").tied_embeddings is False
    (tmp_path / "whole").mkdir()
    shutil.copytree(out / "ckpt" / "step-00000002", tmp_path / "whole" / "step-00000002")
    resumed = _run(_model(False, "float32"), _rows(), 2, checkpoint=tmp_path / "whole")
    assert [x[0] for x in resumed] == pytest.approx([x[0] for x in reference[2:]], rel=1e-5)


def _split_lora_run(rank, out, dora, dropout):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("split",))
    model = nest.load(CARD, weights="random", seed=0, tensor_parallel=mesh)
    torch.manual_seed(0)  # A is drawn whole (the first process's draw goes to both); so are dropout's masks
    model.add_lora("*_proj.weight", rank=4, dora=dora, dropout=dropout)
    a = model.model.layers[0].mlp.down_proj.lora_a
    assert local(a).shape[1] * 2 == a.shape[1]  # beside a weight split by columns, A is split too
    return _run(model, _rows(), 2, save_to=out / "final", checkpoint=out / "ckpt", checkpoint_every=2)


@pytest.mark.parametrize("dora, dropout", [(False, 0.0), (True, 0.0), (False, 0.3), (True, 0.3)])
def test_split_processes_train_adapters_like_one(tmp_path, dora, dropout):
    """LoRA and DoRA on a split model: two processes splitting every block take the steps
    (losses, gradient norms after clipping) of one process training the adapters of the
    whole model, and write the same PEFT adapters (DoRA's magnitudes included). With
    adapter dropout the split draws the masks one process draws, each process keeping its
    part of an input split by columns."""
    results = in_processes(_split_lora_run, tmp_path / "split", dora, dropout)
    assert results[0] == results[1]
    whole = nest.load(CARD, weights="random", seed=0)
    torch.manual_seed(0)
    whole.add_lora("*_proj.weight", rank=4, dora=dora, dropout=dropout)
    reference = _run(whole, _rows(), 2, save_to=tmp_path / "one")
    for (loss, norm, learned), (ref_loss, ref_norm, ref_learned) in zip(results[0], reference, strict=True):
        assert learned == ref_learned
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)
    two, one = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "split" / "final", tmp_path / "one"))
    assert two.keys() == one.keys() and len(one) == (3 if dora else 2) * 7 * CARD.layers
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-5, rtol=0, msg=key)


def _odd_row():
    """35 real positions of 40: a split of two computes 36 of them."""
    return next(pack([Example.plain(list(range(3, 38)))], tokens=40))


def _sequence_run(rank, lora, out):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("split",))
    model = nest.load(CARD, weights="random", seed=0, trainable=not lora, tensor_parallel=mesh,
                      sequence_parallel=True)
    if lora:
        torch.manual_seed(0)
        model.add_lora("*_proj.weight", rank=4)
    seen = []  # positions each norm of the blocks computes, and each projection's input
    for name, module in model.model.layers[0].named_modules():
        if name in ("input_layernorm", "self_attn.q_proj", "mlp.down_proj"):
            module.register_forward_hook(lambda m, args, _, name=name: seen.append((name, local(args[0]).shape[0])))
    with torch.no_grad():
        odd = model.loss_packed(_odd_row())[0].item()
    first = dict(seen)
    with pytest.raises(ValueError, match="does not split into 2 equal shares"):
        model.loss_packed(next(pack([Example.plain(list(range(3, 12)))], tokens=9)))
    with pytest.raises(ValueError, match="3 positions do not split into 2 equal shares"):  # a context share's
        scatter_positions(torch.zeros(3, CARD.hidden), mesh)
    with pytest.raises(ValueError, match="use a multiple of 2"):
        model.tile_mlp(7)
    model.tile_mlp(8)  # each process's 4 positions of a tile, the tile's 8 gathered for the MLP, and trained so
    seen.clear()
    with torch.no_grad():
        tiled = model.loss_packed(_odd_row())[0].item()
    assert tiled == pytest.approx(odd, rel=1e-6) and ("mlp.down_proj", 8) in seen, seen
    return first, odd, _run(model, _rows(), 2, save_to=out / "final")


@pytest.mark.parametrize("lora", [False, True])
def test_sequence_parallel_splits_the_positions_and_trains_like_one(tmp_path, lora):
    """nest.load(tensor_parallel=, sequence_parallel=True): each process's norms run on half
    of a row's positions, q and the MLP see them all (gathered), and the output
    projections' partial sums arrive summed and scattered; the steps and the weights (or
    adapters) are one process's, the MLP in tiles (each process's share of a tile gathered
    for it). A row of odd length is refused, and so is a tile the split cannot share."""
    results = in_processes(_sequence_run, lora, tmp_path / "split")
    whole = _whole(False) if not lora else nest.load(CARD, weights="random", seed=0)
    if lora:
        torch.manual_seed(0)
        whole.add_lora("*_proj.weight", rank=4)
    with torch.no_grad():
        odd = whole.loss_packed(_odd_row())[0].item()
    for seen, loss, _ in results:  # the row's padding cut to an even count of positions: 36
        assert seen == {"input_layernorm": 18, "self_attn.q_proj": 36, "mlp.down_proj": 36}
        assert loss == pytest.approx(odd, rel=1e-6)
    assert results[0][2] == results[1][2]
    reference = _run(whole, _rows(), 2, save_to=tmp_path / "one")
    for (loss, norm, learned), (ref_loss, ref_norm, ref_learned) in zip(results[0][2], reference, strict=True):
        assert learned == ref_learned
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    two, one = (load_file(str(d / name)) for d in (tmp_path / "split" / "final", tmp_path / "one"))
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=3e-4 if not lora else 1e-5, rtol=0, msg=key)


def _split_refusals(rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("split",))
    with pytest.raises(ValueError, match="kv_heads=1, which 2 processes cannot split"):
        nest.load(CARD.replace(kv_heads=1), weights="random", trainable=True, tensor_parallel=mesh)
    model = nest.load(CARD, weights="random", trainable=True, tensor_parallel=mesh)
    student = nest.load(CARD, weights="random", trainable=True)  # a split student distils; a split teacher does not
    with pytest.raises(ValueError, match="distill: the teacher is split"):
        distill(student, model, [], optimizer=torch.optim.SGD(student.parameters(), lr=0.1), steps=1)
    return True


def test_split_models_refuse_what_they_cannot_do():
    assert in_processes(_split_refusals) == [True, True]


def _sharded_at_load(rank, tied, weights, compile):
    """Parameters and steps of a model sharded as it loads, and of one sharded after."""
    card = CARD.replace(tied_embeddings=tied)
    models = [nest.load(card, weights=weights, seed=0, trainable=True, fully_shard=True, compile=compile),
              fully_shard(nest.load(card, weights=weights, seed=0, trainable=True, compile=compile))]
    values = [gathered(m) for m in models]
    steps = []
    for m in models:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        steps.append([(s.loss, s.grad_norm) for s in train(m, _rows()[rank::2], optimizer=opt, steps=2).steps])
    return values, steps


@pytest.mark.parametrize("tied, weights, compile", [(True, "random", False), (False, "file", False),
                                                    (False, "random", "aot_eager")])
def test_a_model_sharded_as_it_loads_equals_one_sharded_after(tmp_path, tied, weights, compile):
    """nest.load(..., fully_shard=True) shards the model while it is on meta and fills each
    process's parts alone (no process holds the whole model): the same parameters, and the
    same steps, as fully_shard() after a whole load (compiled blocks too); a tied head stays
    the embedding."""
    if weights == "file":
        nest.load(CARD.replace(tied_embeddings=tied), weights="random", seed=3).save_weights(tmp_path / "w")
        weights = str(tmp_path / "w")
    for (alone, after), (steps, steps_after) in in_processes(_sharded_at_load, tied, weights, compile):
        assert alone.keys() == after.keys()
        for name in after:
            np.testing.assert_array_equal(alone[name], after[name], err_msg=name)
        assert steps == steps_after
    with pytest.raises(ValueError, match="shards a model that trains"):
        nest.load(CARD, weights="random", fully_shard=True)


def _adapted_at_load(rank, adapters, quantize):
    """Parameters (NF4 codes dequantized) and steps of a model loaded sharded with its
    adapters placed first, and of one loaded whole, given add_lora, then sharded."""
    from linnet.torch.quantize import dense

    models = []
    for at_load in (True, False):
        torch.manual_seed(7)  # the adapters' draws: the same global RNG state in both
        if at_load:
            models.append(nest.load(CARD, weights="random", seed=0, quantize=quantize, lora=adapters,
                                    fully_shard=True))
        else:
            whole = nest.load(CARD, weights="random", seed=0, quantize=quantize)
            whole.add_lora(**adapters)
            models.append(fully_shard(whole))
    values = []
    for m in models:
        states = {f"{name}.weight": layer.quant_state for name, layer in m.named_modules()
                  if getattr(layer, "quant_state", None) is not None}
        values.append({name: dense(torch.from_numpy(v), states.get(name)).numpy() if name in states else v
                       for name, v in gathered(m).items()})
    steps = []
    for m in models:
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        steps.append([(s.loss, s.grad_norm) for s in train(m, _rows()[rank::2], optimizer=opt, steps=2).steps])
    peak_dense = max(local(p).numel() for name, p in models[0].named_parameters() if "layers" in name)
    return values, steps, peak_dense


@pytest.mark.parametrize("adapters, quantize", [(dict(patterns="*_proj.weight", rank=4), None),
                                                (dict(patterns="*_proj.weight", rank=4, dora=True), None),
                                                (dict(patterns="*_proj.weight", rank=4, dora=True), "nf4")])
def test_adapters_placed_before_a_sharded_load_equal_adapters_added_before_fully_shard(adapters, quantize):
    """nest.load(lora=..., fully_shard=True) adds the adapters on meta, shards, fills each
    process's part (an NF4 base quantized weight by weight, its codes split) and then draws
    the adapters (DoRA's magnitudes from the gathered weights): the same model, and the same
    steps, as a whole load, add_lora and fully_shard; no process holds a whole block weight."""
    whole_weight = CARD.intermediate * CARD.hidden
    for (alone, after), (steps, steps_after), peak in in_processes(_adapted_at_load, adapters, quantize):
        assert alone.keys() == after.keys() and any(name.endswith("lora_a") for name in alone)
        for name in after:
            np.testing.assert_array_equal(alone[name], after[name], err_msg=name)
        assert steps == steps_after
        assert peak < whole_weight  # each block weight (or its codes) split in two


def _state_bytes(rank, lora):
    """This process's bytes of parameters, gradients and AdamW moments after a step under
    fully_shard, counted from the tensors."""
    model = nest.load(CARD, weights="random", seed=0, trainable=not lora, fully_shard=True,
                      lora=dict(patterns="*_proj.weight", rank=4) if lora else None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train(model, _rows()[rank::2], optimizer=opt, steps=1)  # AdamW's moments
    loss, _ = model.loss_packed(_rows()[rank])
    loss.backward()  # the gradients, as a step holds them

    def size(t):
        t = local(t)
        return t.numel() * t.element_size()

    return dict(params=sum(size(p) for p in model.parameters()),
                gradients=sum(size(p.grad) for p in model.parameters() if p.grad is not None),
                optimizer=sum(size(v) for s in opt.state.values() for k, v in s.items() if k != "step"))


@pytest.mark.parametrize("lora", [False, True])
def test_the_planner_counts_what_each_fully_sharded_process_holds(lora):
    """`linnet plan --shard fsdp` per GPU equals what each of two processes holds: every state
    split for a full fine-tune; for LoRA the frozen base split and the adapters, with their
    gradients and moments, whole on each (FSDP ignores them)."""
    from linnet import plan

    settings = dict(method="lora" if lora else "full", rank=4, shard="fsdp", gpus=2, dtype="f32",
                    grad_dtype="fp32", device="cpu")
    states = plan.estimate(CARD, **plan.plan_inputs(settings)).states
    for held in in_processes(_state_bytes, lora):
        assert held == dict(params=states.weights + states.master, gradients=states.gradients,
                            optimizer=states.optimizer)
