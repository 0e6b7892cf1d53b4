"""The specification's own examples, run as a user copying them would: every code block of
seed 000 ("Training") and seed 001 ("Full fine-tuning across GPUs") that a CPU can run,
with the calls and keywords as the seeds write them.

What is adapted, and only that: the card (a tiny local model directory rather than
Llama 3.1 8B), the data (the quickstart's addition problems stand in for Alpaca and
UltraFeedback), the sizes (tokens, steps, groups), CUDA and NCCL (CPU and gloo, the
processes forked by tests.conftest.in_processes). The seed's own parameter paths
(`layers.*.attention.*_proj.weight`) run as written (linnet.paths.from_seed_path). A learning rate
of 1e-5 moves a random tiny model too little to see, so the steps take LR.

compile="inductor" is passed as written, and each block compiles with torch.compile's
"eager" backend here (`cheap_compile`): dynamo captures the blocks as it would, over
FSDP's and DTensor's parameters and adapters alike, without inductor's code generation
(about 20 s a graph on a 2-core CPU). An Engine given compile=True samples eagerly here:
dynamo's capture of its passes took a minute of this module's time, and its compiled
passes are checked against eager ones in tests/test_engine.py. Which backend each spelling
selects is tested in tests/test_cli.py, inductor's blocks against eager ones in its slow
test.

Not here: what needs CUDA (NCCL, peak memory, bf16 speed). The seed's JAX names have
their counterparts, tested in tests/test_jax.py: `linnet.jax.load_source` (what
`save_weights` writes, read back), `JaxModel.shard(mesh)` (an engine's model split over a
mesh) and `JaxModel.copy_weights` (a policy's parameters, split or whole, into an engine's
model, as `Engine.load_weights` does).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from linnet import nest
from linnet.commands import quickstart
from linnet.serve import Engine
from linnet.torch.model import Block
from tests.conftest import in_processes

torch.set_num_threads(1)

TOKENS = 64  # the seeds' 4096
STEPS = 3  # the seeds' 1000
LR = 3e-3  # the seeds' 1e-5


@pytest.fixture(autouse=True)
def cheap_compile(monkeypatch):
    """Every block compiles with the "eager" backend, whatever backend was asked (see the
    module docstring); returns the backends asked for in this process."""
    asked = []

    def compile(self, *, backend):
        asked.append(backend)
        nn.Module.compile(self, backend="eager")

    monkeypatch.setattr(Block, "compile", compile)
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, model, **kw: init(self, model, **{**kw, "compile": False}))
    return asked


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    """A tiny local model directory (random weights, the quickstart's tokenizer) as a user's
    card: the seeds' `card`."""
    directory = tmp_path_factory.mktemp("seed") / "tiny"
    tiny = quickstart.CARD.replace(name="seed-tiny", layers=2, hidden=64, intermediate=128, head_dim=16)
    nest.load(tiny, weights="random", seed=0).save_weights(directory)
    quickstart.save_tokenizer(directory / "tokenizer.json")
    return nest.resolve(directory)


def _data(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) token ids: "07+45=" -> "052" and the stop token."""
    return [([quickstart.BOS] + quickstart.encode(p), quickstart.encode(a) + [quickstart.EOS])
            for p, a in quickstart.problems(np.random.default_rng(seed), n, 2)]


def _wrong(completion: list[int]) -> list[int]:
    """A wrong answer of the same length: the last digit changed."""
    digits = quickstart.encode("0123456789")
    return completion[:-2] + [digits[(digits.index(completion[-2]) + 1) % 10], completion[-1]]


# -- seed 000: Training ---------------------------------------------------------------


def test_supervised_fine_tuning(card, tmp_path):
    from linnet.train import Example, cosine_schedule, pack, train

    model = nest.load(card, backend="torch", trainable=True)
    data = _data(64)
    examples = [Example.prompted(prompt, completion) for prompt, completion in data]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    history = train(model, pack(examples, tokens=TOKENS), optimizer=optimizer, steps=STEPS,
                    accumulate=2, schedule=cosine_schedule(optimizer, 1, STEPS), save_to=tmp_path / "run")
    assert len(history.steps) == STEPS and history.losses[-1] < history.losses[0]
    saved = nest.load(tmp_path / "run")
    for (name, p), (_, q) in zip(model.named_parameters(), saved.named_parameters(), strict=True):
        torch.testing.assert_close(q, p.detach(), msg=name)


def test_checkpoints_resume_and_a_loop_of_your_own(card, tmp_path):
    """checkpoint= writes every checkpoint_every steps, keeps the two latest, and a run
    reloaded as the first was and given the same checkpoint takes up where it stopped, with
    the uninterrupted run's losses; save_checkpoint / load_checkpoint for a loop of one's own."""
    from linnet.train import Example, load_checkpoint, pack, save_checkpoint, train

    examples = [Example.prompted(prompt, completion) for prompt, completion in _data(64)]

    def run(steps, **options):
        model = nest.load(card, backend="torch", trainable=True)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        return model, optimizer, train(model, pack(examples, tokens=TOKENS), optimizer=optimizer, steps=steps,
                                       **options)

    _, _, straight = run(5)
    run(3, checkpoint=tmp_path / "run", checkpoint_every=1)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-00000002", "step-00000003"]
    model, optimizer, resumed = run(5, checkpoint=tmp_path / "run", checkpoint_every=1)
    assert [s.step for s in resumed.steps] == [4, 5]
    assert resumed.losses == pytest.approx(straight.losses[3:], rel=1e-6)
    save_checkpoint(tmp_path / "own", model=model, optimizer=optimizer, step=5)
    other = nest.load(card, backend="torch", trainable=True)
    assert load_checkpoint(tmp_path / "own", model=other)["step"] == 5
    torch.testing.assert_close(other.model.norm.weight, model.model.norm.weight)


def _sharded_scripts(rank, card, out):
    """Seed 001's sft_torch.py, which holds seed 000's fully_shard block, in one of two
    CPU processes (already joined in one gloo group: the seed's init_process_group("nccl"))."""
    from linnet.torch import fully_shard
    from linnet.train import Example, cosine_schedule, pack, train

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = "cpu"  # the seed: f"cuda:{torch.cuda.current_device()}"
    batches = list(pack([Example.prompted(p, c) for p, c in _data(128)], TOKENS))
    model = nest.load(
        card,
        backend="torch",
        device=device,
        numerics="fast",
        compile="inductor",
        generics={"Batch": 1, "MaxSeq": TOKENS, "T": "f32"},  # the seed's bf16 is emulated on most CPUs
        cast_dtype=True,
        trainable=True,
    )
    fully_shard(model)  # parts in f32; gathered in the model's dtype
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0)
    schedule = cosine_schedule(optimizer, 1, STEPS, floor=0.0)
    reports = []

    def report(step):
        if rank == 0:
            reports.append(f"step {step.step}: loss {step.loss:.3f}, {step.seconds:.2f} s")

    history = train(model, iter(batches[rank::world]), optimizer=optimizer, steps=STEPS, schedule=schedule,
                    on_step=report)
    model.save_weights(out, dtype=torch.bfloat16)  # every process calls it; the first writes
    return history.losses, reports


def test_fully_shard_and_seed_001_sft_torch(card, tmp_path):
    results = in_processes(_sharded_scripts, card, tmp_path / "out")
    (losses, reports), (other, none) = results
    assert losses == other and losses[-1] < losses[0]
    assert len(reports) == STEPS and reports[-1].startswith(f"step {STEPS}: loss ") and none == []
    saved = nest.load(tmp_path / "out")
    assert saved.card.layers == card.layers and saved.model.norm.weight.abs().sum() > 0


def _split_block(rank, card):
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch.sharding import full
    from linnet.train import Example, pack, train

    copies = 1  # four processes would make two copies of the two-way split
    mesh = init_device_mesh("cpu", (copies, 2), mesh_dim_names=("copies", "split"))
    model = nest.load(card, backend="torch", device="cpu", compile="inductor",
                      trainable=True, tensor_parallel=mesh["split"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    examples_of_this_copy = [Example.prompted(p, c) for p, c in _data(64)]
    history = train(model, pack(examples_of_this_copy, tokens=TOKENS), optimizer=optimizer, steps=STEPS)
    apart = not torch.allclose(full(model.lm_head.weight), model.model.embed_tokens.weight)
    return history.losses, apart


def test_split_training(card):
    """A tensor-parallel split of a tied card: both processes take the same steps, and the
    head trains apart from the embedding."""
    (losses, apart), (other, _) = in_processes(_split_block, card)
    assert card.tied_embeddings and apart
    assert losses == other and losses[-1] < losses[0]


def test_other_trainers(card, tmp_path):
    """CausalLM inside transformers.Trainer and TRL's SFTTrainer."""
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from linnet.torch import CausalLM

    model = nest.load(card, backend="torch", trainable=True)
    common = dict(max_steps=2, per_device_train_batch_size=4, learning_rate=LR, logging_steps=1, report_to=[],
                  use_cpu=True, save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    data = datasets.Dataset.from_list([{"input_ids": p + c, "attention_mask": [1] * len(p + c),
                                        "labels": [-100] * len(p) + c} for p, c in _data(16)])
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **common)
    trainer = transformers.Trainer(model=CausalLM(model), args=args, train_dataset=data)
    trainer.train()
    tokenizer = quickstart.transformers_tokenizer()
    data = datasets.Dataset.from_list([{"prompt": p, "completion": a}
                                       for p, a in quickstart.problems(np.random.default_rng(0), 16, 2)])
    trainer = trl.SFTTrainer(model=CausalLM(model), args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), bf16=False,
                                                                     max_length=TOKENS, **common),
                             train_dataset=data, processing_class=tokenizer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_reinforcement_learning(card, cheap_compile):
    """GRPO with a policy and an engine from one card. A random model answers no problem
    right: every group's rewards are equal, and each step reports them all as uniform."""
    from linnet.serve import Engine
    from linnet.train.grpo import Prompt, grpo

    data = _data(8)  # (prompt ids, the right answer's ids)
    reward = quickstart.exact_answer  # reward(prompt, completion): 1 for the right answer
    policy = nest.load(card, backend="torch", device="cpu", compile="inductor", trainable=True)
    engine = Engine(nest.load(card, backend="torch", device="cpu", compile=True))
    engine.warmup([len(data[0][0])])
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6)
    history = grpo(policy, engine, [Prompt(ids, answer) for ids, answer in data], reward,
                   optimizer=optimizer, steps=2, group=4, prompts_per_step=2, max_new_tokens=5)
    assert len(history.steps) == 2 and cheap_compile == ["inductor"] * card.layers * 2
    assert [s.metrics["uniform"] for s in history.steps] == [1.0, 1.0]
    assert 0 < engine.stats.sampled_tokens <= 2 * 2 * 4 * 5


def test_preferences(card):
    from linnet.train.dpo import Pair, dpo

    model = nest.load(card, backend="torch", trainable=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    data = [(prompt, completion, _wrong(completion)) for prompt, completion in _data(8)]
    pairs = [Pair(prompt, chosen, rejected) for prompt, chosen, rejected in data]
    history = dpo(model, pairs, optimizer=optimizer, steps=2, pairs_per_step=4, beta=0.1)
    assert history.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # the model is its own reference
    assert {"rewards/accuracies", "rewards/margins"} <= set(history.steps[1].metrics)


def test_low_rank_adapters(card, tmp_path, cheap_compile):
    """add_lora, training the adapters alone, save_weights(names="linnet", include=...),
    merge_lora; the saved adapters bind into a fresh model given the same adapters."""
    from linnet.torch.weights import bind_weights
    from linnet.train import Example, pack, train

    path = card.weights.path  # the seed's load("src/model.linnet", weights="init/")
    model = nest.load(card, generics={"T": "f32"}, weights=path, compile="inductor")
    model.add_lora("layers.*.attention.*_proj.weight", rank=16, alpha=32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    row = next(pack([Example.prompted(p, c) for p, c in _data(4, seed=1)], tokens=TOKENS))
    train(model, pack([Example.prompted(p, c) for p, c in _data(64)], tokens=TOKENS), optimizer=optimizer,
          steps=STEPS, save_to=tmp_path / "run")
    assert (tmp_path / "run" / "adapter_config.json").is_file()  # save_to: the adapters alone
    model.save_weights(tmp_path / "adapters.safetensors", names="linnet", include=["*.lora_a", "*.lora_b"])
    with torch.no_grad():
        adapted = model.log_probs_packed(row)[: row.real]
        model.merge_lora()  # plain weights again, for serving or export
        merged = model.log_probs_packed(row)[: row.real]
    assert not any("lora" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)
    fresh = nest.load(card, weights=path)
    fresh.add_lora("layers.*.attention.*_proj.weight", rank=16, alpha=32)
    assert len(bind_weights(fresh, tmp_path / "adapters.safetensors", strict=False)) == 2 * 4 * card.layers
    with torch.no_grad():
        torch.testing.assert_close(fresh.log_probs_packed(row)[: row.real], adapted, atol=1e-5, rtol=0)
    assert cheap_compile == ["inductor"] * card.layers


def test_losses():
    """The losses table: the linear_ forms equal the plain ones over hidden @ weight.T."""
    from linnet.torch.losses import (
        cross_entropy,
        entropy,
        linear_cross_entropy,
        linear_token_log_probs,
        log_softmax,
        token_log_probs,
    )

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(32, 8, generator=g)
    targets, weights = torch.randint(0, 32, (10,), generator=g), (torch.arange(10) % 3 > 0).float()
    logits = hidden @ weight.T
    per_token = token_log_probs(logits, targets)
    torch.testing.assert_close(per_token, log_softmax(logits).gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(cross_entropy(logits, targets, weights), -(per_token * weights).sum())
    torch.testing.assert_close(entropy(logits), -(log_softmax(logits).exp() * log_softmax(logits)).sum(-1))
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, weights),
                               cross_entropy(logits, targets, weights))
    torch.testing.assert_close(linear_token_log_probs(hidden, weight, targets), per_token)


# -- JAX (seed 000's JAX section, seed 001's sft_jax.py) ------------------------------


@pytest.fixture(scope="module")
def jx():
    """jax, with the host devices tests/conftest.py asks for."""
    return pytest.importorskip("jax")


@pytest.mark.jax
def test_jax(card, jx, tmp_path):
    """The JAX section's block, and save_weights(params, path) read back. (Its adapters,
    add_lora and merge_lora, are tested against PyTorch's in tests/test_jax.py.)"""
    import optax

    from linnet.jax.model import save_weights
    from linnet.jax.train import train
    from linnet.packing import Example, pack

    examples = [Example.prompted(prompt, completion) for prompt, completion in _data(64)]
    model = nest.load(card, backend="jax_source", entry="loss_packed",
                      generics={"Batch": 1, "MaxSeq": TOKENS, "T": "bf16"}, cast_dtype=True)
    params, history = train(model, pack(examples, tokens=TOKENS), optimizer=optax.adamw(LR),
                            steps=STEPS, accumulate=2)
    assert len(history.steps) == STEPS and history.losses[-1] < history.losses[0]
    save_weights(params, tmp_path / "w.safetensors")
    again = nest.load(card, backend="jax", weights=tmp_path / "w.safetensors")
    assert all(np.array_equal(again.params[k], params[k]) for k in params)


@pytest.mark.jax
def test_seed_001_sft_jax(card, jx):
    """sft_jax.py's calls: numerics="fast", every device as one mesh, remat (the script's
    default; tests/test_examples.py runs examples/07_fully_shard_jax.py --no-remat), the
    median step and each device's peak memory."""
    import statistics

    import optax
    from jax.sharding import Mesh

    from linnet.jax.train import train
    from linnet.packing import Example, pack

    jax = jx
    if len(jax.devices()) < 2:
        pytest.skip("needs two host devices (tests/conftest.py sets XLA_FLAGS; it was overridden)")
    batches = list(pack((Example.prompted(p, c) for p, c in _data(128)), TOKENS))
    model = nest.load(
        card,
        backend="jax_source",
        entry="loss_packed",
        numerics="fast",
        generics={"Batch": 1, "MaxSeq": TOKENS, "T": "f32"},  # the seed's bf16 compiles slower for a CPU mesh
        cast_dtype=True,
    )
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, 3, 2 * STEPS, 0.0)
    reports = []

    def report(step):
        reports.append(f"step {step.step}: loss {step.loss:.3f}, {step.seconds:.2f} s")

    params, history = train(
        model,
        iter(batches),
        optimizer=optax.adamw(schedule, weight_decay=0.0),
        steps=2 * STEPS,
        mesh=mesh,
        remat=True,  # the script's args.remat
        on_step=report,
    )
    step = statistics.median(s.seconds for s in history.steps[2:])
    # the seed's d.memory_stats().get(...): a CPU device has no memory stats (None)
    peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices()) / 2**30
    assert step > 0 and peak >= 0 and len(reports) == 2 * STEPS and history.losses[-1] < history.losses[0]
    embed = params["model.embed_tokens.weight"]
    assert embed.addressable_shards[0].data.size * mesh.size == embed.size  # each device holds a part
