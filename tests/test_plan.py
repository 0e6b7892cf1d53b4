"""The planner against the seed's printed numbers (course module 004, sections 2, 3, 5, 6),
against what linnet's own blocks save for backward, its CLI, and its input checks. Golden
values are copied as printed, with their precision."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest

from linnet import plan
from linnet.commands import plan as plan_command
from linnet.plan import (
    ACCELERATORS,
    Cluster,
    Method,
    Workload,
    accelerator,
    activation_bytes,
    block_activation_bytes,
    chinchilla_tokens,
    estimate,
    gpu_hours,
    logits_bytes,
    plan_inputs,
    state_bytes,
    train_tokens,
    training_flops,
)
from linnet.plan import memory as step_memory
from linnet.plan import parts as plan_parts

L8B, L70B = "llama-3.1-8b-instruct", "llama-3.1-70b-instruct"
H100 = ACCELERATORS["h100"]
# The seed's "Why LoRA fits on one GPU" setting: rank 16 on every linear layer, seq 4096,
# micro-batch 1, activation checkpointing, one H100-80GB.
SEED_WORKLOAD = Workload(tokens=4096, micro_batch_size=1, activation_checkpointing=True)


def seed_plan(card: str, method: str, gpu: plan.Accelerator = H100) -> plan.Plan:
    return estimate(card, Method(method, rank=16, targets=plan.LINEAR_NAMES), SEED_WORKLOAD, Cluster(gpu=gpu))


def assert_printed(value: float, printed: str) -> None:
    """`value` rounds to `printed` ("8.03B", "1,129 GB", "0.57 GB") at its precision."""
    number, unit = re.fullmatch(r"([\d,.]+)\s*(B|M|GB|)", printed).groups()
    decimals = len(number.partition(".")[2])
    scale = {"B": 1e9, "M": 1e6, "GB": 1e9, "": 1}[unit]
    assert round(value / scale, decimals) == float(number.replace(",", "")), (value, printed)


# card, method, trainable, % of all (where printed), the seed's states, + activations and
# minimum H100-80GB, and ours (docs/plan.md, "How it compares with the course module's
# figures", explains each difference)
WHY_LORA_FITS = [
    (L8B, "full", "8.03B", None, "128.5 GB", "132 GB", 2, "128.5 GB", "144.5 GB", 3),
    (L8B, "lora", "41.9M", "0.5", "16.7 GB", "20.5 GB", 1, "16.7 GB", "19.8 GB", 1),
    (L8B, "qlora", "41.9M", None, "4.8 GB", "8.6 GB", 1, "6.4 GB", "9.5 GB", 1),
    (L70B, "full", "70.6B", None, "1,129 GB", "1,138 GB", 18, "1,129 GB", "1,270 GB", 18),
    (L70B, "lora", "207M", "0.3", "144.4 GB", "153 GB", 3, "144.4 GB", "151.3 GB", 3),
    (L70B, "qlora", "207M", None, "39.7 GB", "48.3 GB", 1, "42.8 GB", "49.8 GB", 1),
]


@pytest.mark.parametrize("card, method, trainable, share, seed_states, seed_total, seed_gpus, states, total, gpus",
                         WHY_LORA_FITS)
def test_why_lora_fits_on_one_gpu(card, method, trainable, share, seed_states, seed_total, seed_gpus, states,
                                  total, gpus):
    p = seed_plan(card, method)
    assert_printed(p.trainable, trainable)
    if share is not None:
        assert round(100 * p.trainable / p.params, 1) == float(share)
    assert_printed(p.states.total, states)
    assert_printed(p.total, total)
    assert p.min_gpus == gpus
    if method != "qlora":  # 16 B a trained parameter, 2 B a frozen one: the seed's states exactly
        assert states == seed_states
    assert (gpus == seed_gpus) == ((card, method) != (L8B, "full"))


def test_qlora_keeps_embeddings_and_head_in_bf16():
    # The seed counts every parameter at NF4's 0.516 B; linnet (like bitsandbytes and PEFT)
    # quantizes the blocks' linear weights alone: the embedding and head stay 2 B each.
    card = plan.cards.resolve(L8B)
    quantized = plan.quantized_params(card, Method("qlora"))
    assert quantized == card.layers * sum(o * i for o, i in card.linear_shapes().values())
    assert card.params() - quantized == 2 * card.vocab * card.hidden + (2 * card.layers + 1) * card.hidden
    seed_states = card.params() * plan.NF4_BYTES + 16 * seed_plan(L8B, "qlora").trainable
    assert_printed(seed_states, "4.8 GB")
    assert seed_plan(L8B, "qlora").states.total - seed_states == pytest.approx(
        (card.params() - quantized) * (2 - plan.NF4_BYTES))  # about 1.6 GB
    assert plan.quantized_params(card, Method("lora")) == 0


def test_full_fine_tuning_peaks_in_the_optimizer_step():
    # Every gradient and AdamW's foreach temporary (the square root of every second moment
    # at once, 4 B a parameter) are live in the step; the bf16 copies of the weights are not.
    p = seed_plan(L8B, "full")
    assert p.peak_phase == "optimizer"
    assert p.total == pytest.approx(p.states.total - p.states.weights + 4 * p.trainable)
    cpu = estimate(L8B, Method("full"), Workload(device="cpu"))
    card = plan.cards.resolve(L8B)
    assert cpu.phases["optimizer"] == pytest.approx(cpu.states.total - cpu.states.weights
                                                    + 2 * 4 * card.vocab * card.hidden)  # tensor by tensor


def test_bytes_per_parameter_section():
    # "16 (18 with FP32 grads)"; an 8B needs ~128 GB of states and a 70B ~1.1 TB.
    assert Method().bytes_per_trainable == 16
    assert Method(grad_dtype="fp32").bytes_per_trainable == 18
    assert_printed(seed_plan(L8B, "full").states.total, "128 GB")
    assert round(seed_plan(L70B, "full").states.total / 1e12, 1) == 1.1
    # QLoRA: 4 + 8/64 + 32/(64*256) bits = "4.127 bits ≈ 0.516 bytes/param".
    assert round(plan.NF4_BYTES * 8, 3) == 4.127 and round(plan.NF4_BYTES, 3) == 0.516


def test_f32_compute_reads_the_master_itself():
    # linnet on a CPU without bf16: an f32 weight (the master), f32 gradient, two moments.
    f32 = Method(dtype="f32", grad_dtype="fp32")
    assert f32.copy_bytes == 0 and f32.bytes_per_trainable == 16
    assert Method(dtype="f32", master_bytes=0).copy_bytes == 4  # no master: the f32 weight is trained itself
    lora = state_bytes(1000, 10, Method("lora", dtype="f32"))
    assert lora.weights == 4 * 1000  # the frozen base in the compute dtype
    with pytest.raises(ValueError, match="dtype 'fp16' is unknown"):
        Method(dtype="fp16")


def test_activation_section():
    # The seed's 34·s·b·d is Korthikanti et al.'s GPT block (a 4·d MLP, dropout masks); a
    # Llama block in bf16 keeps 16d + 4q + 4k + 4·heads + 8 + 8F bytes a token: 49·d for
    # the 8B (0.82 GB at s = 4096, where the seed prints ~0.57 GB). Logits s·V·4 bytes =
    # 2.1 GB per 4K sequence at V = 128K, as the seed says.
    card = plan.cards.resolve(L8B)
    d, q, k, f = card.hidden, card.heads * card.head_dim, card.kv_heads * card.head_dim, card.intermediate
    per_token = block_activation_bytes(card, Method(), Workload(tokens=1))
    assert per_token == 16 * d + 4 * q + 4 * k + 4 * card.heads + 8 + 8 * f
    assert round(per_token / d) == 49
    assert_printed(block_activation_bytes(card, Method(), Workload(tokens=4096)), "0.82 GB")
    assert_printed(logits_bytes(128256, Workload(tokens=4096)), "2.1 GB")
    p = seed_plan(L8B, "lora")
    assert p.activations_uncheckpointed > 5 * p.activations_checkpointed  # "an order of magnitude"
    lora = block_activation_bytes(card, Method("lora"), Workload(tokens=1))
    assert per_token - lora == 2 * 2 * d - 7 * 2 * 16  # frozen norms keep no normalised input; x·Aᵀ per matrix


def test_chunked_loss_holds_one_block_of_logits():
    full = estimate(L8B, Method("lora"), workload=SEED_WORKLOAD)
    chunked = estimate(L8B, Method("lora"), workload=Workload(tokens=4096, chunked_loss=True))
    rows = 2**30 // (4 * 128256)  # about 1 GiB of f32 logits on a GPU
    assert full.logits == full.activations.loss == 4 * 128256 * 4096
    assert chunked.logits == 4 * 128256 * rows
    # the block, the hidden states' gradient and a [rows, d] product in bf16, the block cast to bf16
    assert chunked.activations.loss == chunked.logits + 2 * 4096 * (4096 + rows) + 2 * rows * 128256
    assert estimate(L8B, workload=Workload(tokens=256, chunked_loss=True)).logits == logits_bytes(128256, Workload(tokens=256))
    cpu = Workload(tokens=4096, chunked_loss=True, device="cpu")  # 16 MiB blocks, but at least 512 rows
    assert plan.loss_rows(128256, cpu) == 512 and plan.loss_rows(32000, cpu) == 512
    assert plan.loss_rows(2000, cpu) == 2**24 // (4 * 2000)
    # in f32 on a CPU the loss also reorders the head for oneDNN: one more copy of it
    f32 = Method("lora", dtype="f32")
    on_cpu, on_gpu = (activation_bytes(plan.cards.resolve(L8B), f32, Workload(tokens=4096, chunked_loss=True, device=d)) for d in ("cpu", "gpu"))
    rows = {"cpu": 512, "gpu": 2**30 // (4 * 128256)}
    extra = {d: 4 * 128256 * rows[d] + 4 * 4096 * (4096 + rows[d]) for d in rows}
    assert on_cpu.loss - on_gpu.loss == extra["cpu"] - extra["gpu"] + 4 * 128256 * 4096


def test_loss_blocks_are_the_torch_losses_blocks():
    from linnet.torch import losses  # torch is loaded by conftest anyway; plan itself must not

    assert plan.LOSS_BLOCK_BYTES == losses.BLOCK_BYTES
    assert (plan.CPU_LOSS_BLOCK_BYTES, plan.CPU_LOSS_MIN_ROWS) == (losses.CPU_BLOCK_BYTES, losses.CPU_MIN_ROWS)
    assert (step_memory.CPU_REORDER_MIN_ROWS, step_memory.CPU_REORDER_MIN_ELEMENTS) == \
        (losses.REORDER_MIN_ROWS, losses.REORDER_MIN_ELEMENTS)
    for vocab, device in [(32000, "cpu"), (128256, "cuda"), (2000, "cpu"), (151936, "cuda")]:
        assert plan.loss_rows(vocab, Workload(tokens=10**6, device="cpu" if device == "cpu" else "gpu")) == \
            losses.rows_per_block(vocab, __import__("torch").device(device))


# ---------------------------------------------------------------------------------------
# What linnet's blocks keep, counted by autograd


def saved_per_token(forward, lengths=(32, 64), keep=()) -> float:
    """Bytes a forward leaves for backward, per token: the storages autograd saves (and
    `keep(result)`'s), measured at two lengths so that what does not grow with them
    (weights, their casts) cancels."""
    import torch

    totals = []
    for n in lengths:
        seen: dict[int, int] = {}

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result, skip = forward(n)
        for t in keep(result) if keep else ():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        totals.append(sum(size for ptr, size in seen.items() if ptr not in {s.untyped_storage().data_ptr()
                                                                            for s in skip}))
    return (totals[1] - totals[0]) / (lengths[1] - lengths[0])


def small_model(method: str, dtype: str, targets=plan.LINEAR_NAMES, **card_fields):
    from linnet import nest

    card = nest.resolve("debug").replace(**card_fields)
    model = nest.load(card, weights="random", trainable=method == "full",
                      dtype={"f32": "float32", "bf16": "bfloat16"}[dtype],
                      **({"quantize": "nf4"} if method == "qlora" else {}))
    if method != "full":
        model.add_lora([f"*.{name}" for name in targets], rank=4, dora=method == "dora")
    return card, model


def _first_block(card, model):
    """saved_per_token's forward: n random positions through the model's first block."""
    import torch

    from linnet.torch import attention

    def forward(n):
        x = torch.randn(n, card.hidden, dtype=model.dtype, requires_grad=True)
        angles = torch.arange(n)[:, None].float() * model.inv_freq[None]
        cos, sin = (torch.cat((angles, angles), -1).cos().to(model.dtype), torch.cat((angles, angles), -1).sin()
                    .to(model.dtype))
        return model.model.layers[0](x, cos, sin, [0, n], attention.documents), (cos, sin)

    return forward


MLP, QKV = ("gate_proj", "up_proj", "down_proj"), ("q_proj", "k_proj", "v_proj")
BLOCK_CASES = [("full", "f32", {}), ("lora", "f32", {}), ("dora", "f32", {}), ("full", "bf16", {}),
               ("lora", "bf16", {}), ("dora", "bf16", {}), ("full", "f32", {"qk_norm": True}),
               ("lora", "bf16", {"qk_norm": True}), ("qlora", "f32", {})]
# adapters on some matrices: a frozen matmul without one keeps nothing of its input
PARTIAL_CASES = [("lora", "f32", MLP), ("lora", "bf16", QKV), ("dora", "f32", ("o_proj", "up_proj"))]


@pytest.mark.parametrize("method, dtype, targets", PARTIAL_CASES)
def test_block_count_follows_which_matrices_carry_adapters(method, dtype, targets):
    card, model = small_model(method, dtype, targets)
    expected = block_activation_bytes(card, Method(method, rank=4, dtype=dtype, targets=targets),
                                      Workload(tokens=1, device="cpu"))
    assert saved_per_token(_first_block(card, model)) == expected
    assert expected < block_activation_bytes(card, Method(method, rank=4, dtype=dtype), Workload(tokens=1, device="cpu"))


@pytest.mark.parametrize("method, dtype, fields", BLOCK_CASES)
def test_block_count_is_what_autograd_saves(method, dtype, fields):
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    card, model = small_model(method, dtype, **fields)
    expected = block_activation_bytes(card, Method(method, rank=4, dtype=dtype), Workload(tokens=1, device="cpu"))
    assert saved_per_token(_first_block(card, model)) == expected


@pytest.mark.parametrize("method, targets, fields", [
    ("full", plan.LINEAR_NAMES, {}), ("lora", plan.LINEAR_NAMES, {}), ("lora", MLP, {}), ("lora", QKV, {}),
    ("lora", ("o_proj", "down_proj"), {}), ("lora", MLP, {"qk_norm": True})])
def test_kept_activations_are_what_the_trunk_saves(method, targets, fields):
    # Every block, the final norm (its output is the loss's input), the RoPE tables, and the
    # first norm's input only where the embedding trains (and then the token ids); with a
    # frozen embedding, of the first block only what follows its first adapter.
    import numpy as np

    from linnet.packing import Example, pack

    card, model = small_model(method, "f32", targets, **fields)

    def forward(n):
        row = next(pack([Example.plain(np.arange(3, 3 + n) % card.vocab)], tokens=n))
        return model.hidden_packed(row), ()

    acts = activation_bytes(card, Method(method, rank=4, dtype="f32", targets=targets),
                            Workload(tokens=1, device="cpu", activation_checkpointing="none", chunked_loss=True))
    assert saved_per_token(forward, keep=lambda h: [h]) == acts.kept


def test_activations_scale_with_micro_batch_not_with_sharding():
    one = estimate(L8B, workload=Workload(micro_batch_size=1))
    two = estimate(L8B, workload=Workload(micro_batch_size=2))
    assert two.activations.peak == pytest.approx(2 * one.activations.peak)
    sharded = estimate(L8B, workload=Workload(micro_batch_size=1), cluster=Cluster(gpus=8, shard="fsdp"))
    assert sharded.activations == one.activations
    assert sharded.states.total == pytest.approx(one.states.total / 8)


# The seed's ZeRO table: per-GPU bytes for Ψ parameters over N_d ranks, as
# replicated + sharded / N_d bytes per parameter.
@pytest.mark.parametrize("shard, replicated, sharded", [
    ("none", 16, 0), ("zero", 8, 8), ("zero1", 4, 12), ("zero2", 2, 14), ("fsdp", 0, 16),
])
def test_zero_stages(shard, replicated, sharded):
    psi, ranks = 7e9, 8
    states = state_bytes(psi, psi, Method("full"), shard, ranks)
    assert states.total == pytest.approx(psi * (replicated + sharded / ranks))


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_fsdp_splits_the_frozen_base_and_leaves_adapters_whole(method):
    """linnet's fully_shard splits the base over the GPUs, but FSDP ignores the adapters:
    their copies, gradients, master weights and optimizer moments stay whole on each GPU."""
    m = Method(method)
    one, four = (state_bytes(7e9, 4e7, m, "fsdp", gpus, quantized=6e9 if method == "qlora" else 0) for gpus in (1, 4))
    for name in ("gradients", "master", "optimizer"):
        assert getattr(four, name) == getattr(one, name) > 0, name
    adapters = m.copy_bytes * 4e7
    assert four.weights - adapters == pytest.approx((one.weights - adapters) / 4)


def test_dora_adds_one_magnitude_per_output_row():
    lora, dora = seed_plan(L8B, "lora"), seed_plan(L8B, "dora")
    out_rows = sum(d_out for d_out, _ in plan.cards.resolve(L8B).linear_shapes().values())
    assert dora.trainable - lora.trainable == 32 * out_rows


def test_pretraining_8b_on_15t_tokens():
    # Section 2's worked example: N = 8.03e9, D = 15e12, H100 at 40% MFU, 1,024 GPUs.
    cluster = Cluster(gpu=H100, gpus=1024, mfu=0.4, price=2)
    compute = estimate(L8B, Method("full"), cluster=cluster, total_targets=15e12).compute
    assert f"{compute.flops:.2e}" == "7.23e+23"
    assert f"{cluster.peak_flops * cluster.mfu:.2e}" == "3.96e+14"
    assert f"{compute.gpu_hours * 3600:.2e}" == "1.83e+09"
    assert round(compute.gpu_hours, -3) == 507_000
    assert round(compute.days, 1) == 20.6
    assert round(compute.cost / 1e6, 1) == 1.0  # "$1.0-1.5M" at $2-3 per H100-hour
    assert round(compute.gpu_hours * 3 / 1e6, 1) == 1.5
    assert round(15e12 / chinchilla_tokens(8.03e9)) == 93  # "~93x Chinchilla-optimal"


def test_lora_job_of_12m_tokens():
    # Section 6: 5,000 examples × 800 tokens × 3 epochs on an 8B with LoRA, 35% MFU, one H100.
    tokens = train_tokens(5000, 800, 3)
    assert tokens == 12e6
    flops = training_flops(8e9, tokens, frozen_base=True)
    assert f"{flops:.1e}" == "3.8e+17"
    assert round(gpu_hours(flops, H100.peak_flops("bf16"), 0.35), 1) == 0.3
    from_card = estimate(L8B, Method("lora"), cluster=Cluster(gpu=H100, mfu=0.35), total_targets=tokens)
    assert round(from_card.compute.gpu_hours, 1) == 0.3
    full = estimate(L8B, Method("full"), cluster=Cluster(gpu=H100, mfu=0.35), total_targets=tokens)
    assert full.compute.flops == pytest.approx(1.5 * from_card.compute.flops)  # 6ND vs 4ND


def test_chinchilla_tokens_for_pretraining():
    p = estimate("tinyllama-1.1b-chat", total_targets="chinchilla")
    assert p.compute.total_targets == 20 * p.params


# ---------------------------------------------------------------------------------------
# Accelerators


def test_custom_accelerator_numbers():
    assert accelerator("h100", memory_gb=94).memory_gb == 94
    assert accelerator("h100", memory_gb=94).bf16_tflops == 989
    mi300x = accelerator("mi300x", memory_gb=192, bf16_tflops=1307)
    p = seed_plan(L70B, "full", gpu=mi300x)
    assert p.peak_phase == "optimizer"  # every state, no activation: n GPUs hold 1/n of it each
    assert p.min_gpus == math.ceil(p.phases["optimizer"] / (0.9 * 192e9)) == 8
    with pytest.raises(ValueError, match="no fp8"):
        Cluster(gpu=mi300x, precision="fp8")


def test_accelerator_table_covers_the_issue():
    for name in ("h100", "h200", "a100-40gb", "a100-80gb", "b200", "l40s", "rtx4090"):
        gpu = ACCELERATORS[name]
        assert gpu.memory_gb > 0 and gpu.bf16_tflops > 0
        assert gpu.fp8_tflops is None or gpu.fp8_tflops == pytest.approx(2 * gpu.bf16_tflops, rel=0.02)


def test_fp8_doubles_the_peak_not_the_memory():
    bf16 = estimate(L8B, cluster=Cluster(precision="bf16"), total_targets=1e9)
    fp8 = estimate(L8B, cluster=Cluster(precision="fp8"), total_targets=1e9)
    assert bf16.compute.gpu_hours == pytest.approx(fp8.compute.gpu_hours * 1979 / 989)
    assert fp8.total == bf16.total


# ---------------------------------------------------------------------------------------
# Bad input


def test_unknown_gpu_says_how_to_describe_one():
    """In Python's names to a Python caller; `linnet plan` names its flags (below)."""
    with pytest.raises(ValueError, match="memory_gb and bf16_tflops") as refused:
        accelerator("h800")
    assert "--gpu-memory" not in str(refused.value)
    assert refused.value.named({"memory_gb": "--gpu-memory", "bf16_tflops": "--gpu-tflops"}).endswith(
        "(--gpu-memory and --gpu-tflops)")


@pytest.mark.parametrize("mfu", [0, -0.1, 1.5, 35])
def test_mfu_outside_zero_one(mfu):
    with pytest.raises(ValueError, match=r"mfu must be in \(0, 1\]"):
        Cluster(mfu=mfu)


def test_mfu_of_one_is_allowed():
    assert Cluster(mfu=1.0).mfu == 1.0


@pytest.mark.parametrize("fields, message", [
    (dict(name="sgd"), "method 'sgd' is unknown"),
    (dict(name="lora", rank=0), "rank must be a positive"),
    (dict(name="lora", targets=("qkv_proj",)), "not linear layers"),
    (dict(grad_dtype="fp16"), "grad_dtype 'fp16'"),
])
def test_bad_method(fields, message):
    with pytest.raises(ValueError, match=message):
        Method(**fields)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="unknown plan settings \\['lr'\\]"):
        plan_inputs({"lr": 1e-4})
    with pytest.raises(ValueError, match="shard 'zero3'"):
        plan_inputs({"shard": "zero3"})
    with pytest.raises(ValueError, match="no fp8"):
        plan_inputs({"gpu": "a100-80gb", "precision": "fp8", "total_targets": 1e9})
    with pytest.raises(ValueError, match="mfu, price only matter for a count of tokens trained on; add total_targets"):
        plan_inputs({"mfu": 0.4, "price": 2.5})
    with pytest.raises(ValueError, match="total_targets must be a positive count"):
        estimate(L8B, total_targets=-1)


def test_settings_take_dataclass_defaults_and_parse_targets():
    inputs = plan_inputs({"method": "lora", "targets": "q_proj, v_proj", "tokens": None, "gpus": 4})
    assert inputs["method"] == Method("lora", targets=("q_proj", "v_proj"))
    assert inputs["workload"] == Workload()
    assert inputs["cluster"].gpus == 4 and inputs["cluster"].gpu == H100
    assert plan_inputs({"targets": "all-linear"})["method"].targets == plan.LINEAR_NAMES


# ---------------------------------------------------------------------------------------
# The command line


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_command.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_row(out: str, label: str) -> list[str]:
    """The values of the table row whose label starts with `label`."""
    for line in out.splitlines():
        if line.startswith(label):
            return re.split(r"\s{2,}", line[len(label):].strip())
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_cli_table_for_the_issue_command(capsys):
    code, out, err = run_cli(capsys, L8B, "--method", "lora", "--rank", "16", "--context-length", "4096", "--total-targets",
                             "12e6", "--mfu", "0.35", "--gpus", "8", "--gpu", "h100", "--price", "2.5")
    assert code == 0 and err == ""
    assert table_row(out, "trainable") == ["41.9M (0.5%)"]
    assert table_row(out, "states") == ["16.7 GB"]
    assert table_row(out, "total per GPU (checkpointing)") == ["19.8 GB"]
    assert table_row(out, "GPU-hours") == ["0.309"]
    assert table_row(out, "cost") == ["$0.77"]  # 0.309 GPU-hours × $2.50
    assumptions = out.split("assumptions:")[1]
    assert "989 TFLOP/s dense bf16 × 35% MFU" in assumptions
    assert "rank 16 adapters" in assumptions and "/ 8 GPUs" in assumptions


def test_cli_compare_puts_methods_side_by_side(capsys):
    code, out, _ = run_cli(capsys, L70B, "--compare")
    assert code == 0
    header = out.splitlines()[2].split()
    assert header == ["full", "lora", "qlora"]
    assert table_row(out, "states") == ["1,129 GB", "144.4 GB", "42.8 GB"]
    assert table_row(out, "minimum h100 GPUs (FSDP)") == ["18 (3 nodes of 8)", "3", "1"]
    assert "NF4" in out.split("assumptions:")[1]
    code, out, _ = run_cli(capsys, L8B, "--compare", "--method", "dora")
    assert out.splitlines()[2].split() == ["full", "lora", "qlora", "dora"]


def test_cli_json_matches_the_python_api(capsys):
    code, out, _ = run_cli(capsys, L8B, "--method", "qlora", "--total-targets", "12M", "--price", "2", "--json")
    data = json.loads(out)
    expected = estimate(L8B, Method("qlora"), cluster=Cluster(price=2), total_targets=12e6)
    assert code == 0 and data == json.loads(json.dumps(expected.to_dict()))
    assert data["trainable"] == 41_943_040 and data["compute"]["total_targets"] == 12e6
    assert data["total"] == max(data["phases"].values()) == data["phases"][data["peak_phase"]]
    code, out, _ = run_cli(capsys, L8B, "--compare", "--json")
    assert [p["method"]["name"] for p in json.loads(out)] == ["full", "lora", "qlora"]


def test_cli_custom_gpu(capsys):
    code, out, _ = run_cli(capsys, L70B, "--gpu", "mi300x", "--gpu-memory", "192", "--gpu-tflops", "1307", "--json")
    data = json.loads(out)
    assert code == 0 and data["cluster"]["gpu"]["memory_gb"] == 192 and data["min_gpus"] == 8


def test_cli_reads_a_local_model_directory(capsys, tmp_path):
    config = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=112,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    # 2 × 97·64 embeddings and head + 2 blocks × (64·64·2 + 32·64·2 + 3·112·64 + 2·64) + 64
    assert code == 0 and json.loads(out)["params"] == 80_320


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "h800"], "--gpu 'h800' is unknown"),
    (["--mfu", "35", "--total-targets", "1e9"], "--mfu must be in (0, 1], got 35.0; pass a fraction such as 0.35"),
    (["--gpu", "a100-40gb", "--precision", "fp8", "--total-targets", "1e9"], "no fp8"),
    (["--price", "2.5"], "add --total-targets"),
    (["--context-length", "0"], "--context-length must be a positive number of positions (a row's length), got 0"),
    (["--accumulation", "0"], "--accumulation must be a positive number of micro-steps, got 0"),
    (["--targets", "attn"], "not linear layers"),
])
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, L8B, *argv)
    assert code == 2 and out == ""
    assert err.startswith("linnet plan: error:") and message in err


@pytest.mark.parametrize("old, new", sorted(plan_command.FORMER_FLAGS.items()))
def test_former_flags_are_refused_naming_their_replacement(capsys, old, new):
    with pytest.raises(SystemExit) as exit:
        plan_command.main([L8B, old, "4096"] if not old.startswith("--no-") else [L8B, old])
    assert exit.value.code == 2 and f"{old} was renamed {new}" in capsys.readouterr().err


def test_a_config_s_refusal_names_the_config_s_field(tmp_path, capsys):
    """What came from a config is named as the config names it; what came from a flag, as the flag."""
    path = tmp_path / "sft.yaml"
    path.write_text("model: {card: tinyllama-1.1b-chat}\ndata: {path: x.jsonl}\nlora: {enabled: false}\n"
                    "training: {pipeline: 2, activation_checkpointing: true}\n")
    code, out, err = run_cli(capsys, "--config", str(path), "--pipeline-schedule", "zero-bubble")
    assert code == 2 and "zero-bubble with training.activation_checkpointing: linnet refuses it" in err
    code, out, err = run_cli(capsys, "--config", str(path), "--pipeline-schedule", "zero-bubble",
                             "--activation-checkpointing", "selective")
    assert code == 2 and "or --activation-checkpointing none" in err


def test_cli_unknown_card_and_method(capsys):
    code, _, err = run_cli(capsys, "no-such-model")
    assert code == 2 and "unknown card 'no-such-model'" in err
    with pytest.raises(SystemExit) as exit_:
        plan_command.main([L8B, "--method", "sgd"])
    assert exit_.value.code == 2
    assert "invalid choice: 'sgd'" in capsys.readouterr().err


def test_plan_imports_no_torch_and_runs_as_a_command():
    subprocess.run([sys.executable, "-c", "import linnet.commands.plan, sys; assert 'torch' not in sys.modules"],
                   check=True)
    done = subprocess.run([sys.executable, "-m", "linnet.cli", "plan", "tinyllama-1.1b-chat", "--json"],
                          check=True, capture_output=True, text=True)
    assert json.loads(done.stdout)["model"] == "tinyllama-1.1b-chat"


def planned_config(tmp_path, capsys, text: str) -> tuple[str, dict]:
    """(the config's path, `linnet plan --config PATH --json`'s answer)."""
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert plan_command.main(["--config", str(config), "--json"]) == 0
    return str(config), json.loads(capsys.readouterr().out)


def test_plan_reads_a_run_config(tmp_path, capsys):
    config, data = planned_config(tmp_path, capsys, (
        "model: {card: llama-3.1-8b-instruct}\n"
        "data: {path: x.jsonl}\n"
        "lora: {rank: 8, targets: ['model.layers.*.self_attn.q_proj', 'model.layers.*.self_attn.v_proj']}\n"
        "training: {steps: 100, accumulation: 4, context_length: 4096}\n"))
    assert data["method"]["rank"] == 8 and data["method"]["targets"] == ["q_proj", "v_proj"]
    assert data["workload"]["tokens"] == 4096 and data["workload"]["chunked_loss"] is True
    assert data["compute"]["total_targets"] == 100 * 4 * 4096
    assert plan_command.main(["--config", str(config), "--method", "full", "--json"]) == 0  # flags override the file
    assert json.loads(capsys.readouterr().out)["method"]["name"] == "full"
    assert plan_command.main([]) == 2


def test_plan_of_a_grpo_config_adds_the_sampling_engine(tmp_path, capsys):
    config = tmp_path / "grpo.yaml"
    config.write_text("model: {card: llama-3.2-1b-instruct}\ndata: {path: p.jsonl}\ntraining: {context_length: 1024}\n"
                      "grpo: {group: 8, prompts_per_step: 4}\n")
    assert plan_command.main(["--config", str(config), "--json"]) == 0
    sampling = json.loads(capsys.readouterr().out)["sampling"]
    card = plan.cards.resolve("llama-3.2-1b-instruct")  # 16 layers, 8 kv heads of 64
    assert sampling["rows"] == 32 and sampling["slots"] == 1024
    assert sampling["cache_bytes"] == 32 * 1024 * 16 * 2 * 8 * 64 * 2
    assert sampling["weights_bytes"] == card.params() * 2
    assert plan_command.main(["--config", str(config)]) == 0
    assert "sampling engine, not in the totals above: a bf16 copy" in capsys.readouterr().out
    # the engine computes in the policy's dtype (float32 here), unless grpo.engine_dtype says otherwise
    for engine, size in (("", 4), (", engine_dtype: bfloat16", 2)):
        config.write_text("model: {card: llama-3.2-1b-instruct, dtype: float32}\ndata: {path: p.jsonl}\n"
                          f"training: {{context_length: 1024}}\ngrpo: {{group: 8, prompts_per_step: 4{engine}}}\n")
        assert plan_command.main(["--config", str(config), "--json"]) == 0
        sampling = json.loads(capsys.readouterr().out)["sampling"]
        assert sampling["weights_bytes"] == card.params() * size
        assert sampling["cache_bytes"] == 32 * 1024 * 16 * 2 * 8 * 64 * size
    # QLoRA: the engine shares the policy's NF4 blocks and copies the adapters (f32) beside them
    config.write_text("model: {card: llama-3.2-1b-instruct, dtype: bfloat16, quantize: nf4}\ndata: {path: p.jsonl}\n"
                      "training: {context_length: 1024}\ngrpo: {group: 8, prompts_per_step: 4}\n")
    assert plan_command.main(["--config", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    blocks = card.layers * sum(o * i for o, i in card.linear_shapes().values())
    assert data["method"]["name"] == "qlora"
    assert data["sampling"]["weights_bytes"] == (card.params() - blocks) * 2 + data["trainable"] * 4
    # split by fsdp or cut into stages, the base is the policy's parts: the engine holds every weight,
    # dequantized and merged
    qlora = config.read_text()
    for cut in ("shard: fsdp", "pipeline: 2"):
        config.write_text(qlora.replace("context_length: 1024", f"context_length: 1024, {cut}"))
        assert plan_command.main(["--config", str(config), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["sampling"]["weights_bytes"] == card.params() * 2, cut


def test_plan_of_a_ppo_config_adds_its_engine_of_samples_x_prompts_rows(tmp_path, capsys):
    config = tmp_path / "ppo.yaml"
    config.write_text("model: {card: llama-3.2-1b-instruct}\ndata: {path: p.jsonl}\ntraining: {context_length: 1024}\n"
                      "ppo: {samples: 2, prompts_per_step: 16}\n")
    assert plan_command.main(["--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"]["rows"] == 32
    assert plan_command.main(["--config", str(config)]) == 0
    assert "PPO also holds its sampling engine" in capsys.readouterr().out
    config.write_text(config.read_text().replace("prompts_per_step: 16}", "prompts_per_step: 16, engine: vllm}"))
    assert plan_command.main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "PPO's vLLM engine takes 30%" in out and "(ppo.vllm_gpu_memory_utilization)" in out


@pytest.mark.parametrize("projections", [True, False])
def test_a_float32_engine_on_a_cpu_counts_its_weights_reordered_for_onednn(tmp_path, capsys, monkeypatch, projections):
    """The head reordered again (Llama 3.2 1B's is over 2^20 weights), and on an AVX-512 CPU
    every projection too (`Engine`, `linnet.torch.passes.reorder_weights`)."""
    from linnet import hardware

    monkeypatch.setattr(hardware, "cpu_reorders_projections", lambda: projections)
    config = tmp_path / "grpo.yaml"
    config.write_text("model: {card: llama-3.2-1b-instruct, dtype: float32}\ndata: {path: p.jsonl}\n"
                      "runtime: {device: cpu}\ntraining: {context_length: 1024}\ngrpo: {group: 8, prompts_per_step: 4}\n")
    assert plan_command.main(["--config", str(config), "--json"]) == 0
    sampling = json.loads(capsys.readouterr().out)["sampling"]
    card = plan.cards.resolve("llama-3.2-1b-instruct")
    blocks = card.layers * sum(o * i for o, i in card.linear_shapes().values())
    assert sampling["reordered_bytes"] == 4 * (card.vocab * card.hidden + (blocks if projections else 0))
    assert sampling["weights_bytes"] == card.params() * 4 + sampling["reordered_bytes"]
    assert plan_command.main(["--config", str(config)]) == 0
    assert "of them again reordered for oneDNN" in capsys.readouterr().out


@pytest.mark.parametrize("share, usable", [("", 0.6), (", vllm_gpu_memory_utilization: 0.4", 0.5)])
def test_plan_of_a_grpo_config_with_vllm_leaves_vllms_share_to_it(tmp_path, capsys, share, usable):
    """vLLM takes its share of each GPU (0.3 unless the config says otherwise) for its
    weights and cache: training plans with what the default 90% leaves."""
    config = tmp_path / "grpo.yaml"
    config.write_text("model: {card: llama-3.2-1b-instruct}\ndata: {path: p.jsonl}\n"
                      f"grpo: {{group: 8, prompts_per_step: 4, engine: vllm{share}}}\n")
    assert plan_command.main(["--config", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["usable"] == pytest.approx(usable)
    assert data["sampling"]["engine"] == "vllm"
    assert data["sampling"]["bytes"] == pytest.approx((0.9 - usable) * 80e9)
    assert plan_command.main(["--config", str(config), "--usable", "0.8"]) == 0  # a flag overrides
    assert "80% of 80 GB" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# Describing linnet's run: dtype, device, checkpointing modes, accumulation


def test_checkpointing_modes():
    assert Workload(activation_checkpointing=True).activation_checkpointing == "full"
    assert Workload(activation_checkpointing=False).activation_checkpointing == "none"
    card = plan.cards.resolve(L8B)
    modes = {mode: activation_bytes(card, Method("lora"), Workload(activation_checkpointing=mode))
             for mode in plan.CHECKPOINTING}
    attention_out = 4096 * (2 * card.heads * card.head_dim + 4 * card.heads)  # the output in bf16, log-sum-exp in f32
    assert modes["full"].top == card.layers * 2 * 4096 * card.hidden + 2 * 2 * card.head_dim * 4096  # inputs, RoPE
    assert modes["selective"].kept - modes["full"].kept == card.layers * attention_out
    assert modes["full"].recompute - modes["selective"].recompute == attention_out
    assert modes["none"].recompute == 0 and modes["none"].kept > modes["selective"].kept > modes["full"].kept
    for bad, message in [(dict(activation_checkpointing="some"), "activation_checkpointing 'some' is unknown"),
                         (dict(device="tpu"), "device 'tpu' is unknown"), (dict(accumulate=0), "accumulate must be")]:
        with pytest.raises(ValueError, match=message):
            Workload(**bad)


def test_accumulation_keeps_every_gradient_through_the_forward():
    one = estimate(L8B, Method("full"), Workload(chunked_loss=True))
    four = estimate(L8B, Method("full"), Workload(chunked_loss=True, accumulate=4))
    # the first micro-step's forward holds only the head's gradient, which the chunked loss
    # makes there; later ones also every gradient of the earlier micro-steps
    assert four.phases["forward"] - one.phases["forward"] == pytest.approx(one.states.gradients)
    assert four.phases["optimizer"] == one.phases["optimizer"]


def test_cpu_device_and_f32_dtype_change_only_what_they_describe():
    card = plan.cards.resolve("tinyllama-1.1b-chat")
    gpu = Workload(chunked_loss=True)
    cpu = Workload(chunked_loss=True, device="cpu")
    f32 = Method("lora", dtype="f32")
    # f32 compute: attention in f32 either way, so a CPU changes only the loss's block
    assert block_activation_bytes(card, f32, gpu) == block_activation_bytes(card, f32, cpu)
    assert activation_bytes(card, f32, cpu).loss < activation_bytes(card, f32, gpu).loss
    # bf16 on a CPU: linnet computes attention in f32, so q, k, v and the output take 4 B, plus the cast back
    q, k = card.heads * card.head_dim, card.kv_heads * card.head_dim
    assert (block_activation_bytes(card, Method("lora"), Workload(tokens=1, device="cpu"))
            - block_activation_bytes(card, Method("lora"), Workload(tokens=1))) == 2 * (2 * q + 2 * k) + 2 * q
    assert block_activation_bytes(card, f32, Workload(tokens=1)) == 2 * block_activation_bytes(
        card, Method("lora"), Workload(tokens=1)) - 2 * (4 * card.hidden + 4) - 4 * card.heads  # f32 norms' inputs, lse


def test_cli_describes_a_cpu_run(capsys):
    argv = ["tinyllama-1.1b-chat", "--method", "lora", "--dtype", "f32", "--device", "cpu", "--activation-checkpointing",
            "selective", "--chunked-loss", "--grad-dtype", "fp32", "--accumulation", "2"]
    code, out, _ = run_cli(capsys, *argv, "--json")
    data = json.loads(out)
    expected = estimate("tinyllama-1.1b-chat", Method("lora", dtype="f32", grad_dtype="fp32"),
                        Workload(activation_checkpointing="selective", chunked_loss=True, device="cpu", accumulate=2))
    assert code == 0 and data == json.loads(json.dumps(expected.to_dict()))
    assert data["workload"]["activation_checkpointing"] == "selective" and data["method"]["dtype"] == "f32"
    code, out, _ = run_cli(capsys, *argv)
    assert table_row(out, "activations, selective checkpointing") == [gb_text(expected.activations.peak)]
    assert table_row(out, "total per GPU (selective checkpointing)") == [gb_text(expected.total)]
    assert "AdamW tensor by tensor" in out and "f32 compute reads the f32 master" in out
    for flags, mode in [(["--activation-checkpointing"], "full"), (["--no-activation-checkpointing"], "none"),
                        ([], "full"), (["--activation-checkpointing", "none"], "none")]:
        code, out, _ = run_cli(capsys, L8B, "--json", *flags)
        assert code == 0 and json.loads(out)["workload"]["activation_checkpointing"] == mode
    with pytest.raises(SystemExit):
        plan_command.main([L8B, "--activation-checkpointing", "some"])
    assert "invalid choice: 'some'" in capsys.readouterr().err


def gb_text(value: float) -> str:
    from linnet.report.tables import gb

    return gb(value)


def test_plan_of_a_config_describes_linnets_run(tmp_path, capsys):
    _, data = planned_config(tmp_path, capsys, (
        "model: {card: tinyllama-1.1b-chat, dtype: float32, quantize: nf4}\n"
        "data: {path: x.jsonl}\n"
        "lora: {rank: 8}\n"
        "optimizer: {name: adamw8bit}\n"
        "runtime: {device: cpu}\n"
        "training: {context_length: 1024, accumulation: 4, activation_checkpointing: selective}\n"))
    assert data["method"]["name"] == "qlora" and data["method"]["dtype"] == "f32"
    assert data["method"]["grad_dtype"] == "fp32" and data["method"]["optimizer_bytes"] == 2
    assert data["workload"] == {"tokens": 1024, "micro_batch_size": 1, "activation_checkpointing": "selective",
                                "chunked_loss": True, "device": "cpu", "accumulate": 4, "num_models": 1,
                                "mlp_tile": None}


def test_a_packed_config_plans_its_models_side_by_side(capsys):
    """A packed pretraining config: N whole models' states and N micro-batches' activations."""
    from linnet.commands import plan as plan_command

    assert plan_command.main(["--config", "configs/packed4-20m-awc.yaml", "--json"]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert plan_command.main(["--config", "configs/packed4-20m-awc.yaml", "--json", "--num-models", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert packed["workload"]["num_models"] == 4 and one["workload"]["num_models"] == 1
    assert packed["states"]["optimizer"] == pytest.approx(4 * one["states"]["optimizer"])
    assert packed["total"] == pytest.approx(4 * one["total"], rel=1e-6)


@pytest.mark.parametrize("command", ["sft", "pretrain"])
@pytest.mark.parametrize("shard, split", [("zero", {"optimizer"}), ("fsdp", {"weights", "gradients", "master", "optimizer"})])
def test_plan_of_a_config_splits_what_its_training_shard_splits(tmp_path, capsys, shard, split, command):
    """`training.shard: zero` runs ZeroRedundancyOptimizer, which splits the optimizer state
    alone (8-bit states included); fsdp splits every state; fine-tuning and pretraining alike."""
    import yaml

    config = tmp_path / "run.yaml"
    if command == "pretrain":
        text = yaml.safe_load(open("configs/pretrain-20m.yaml"))
        text.setdefault("training", {})["shard"] = shard
        config.write_text(yaml.safe_dump(text))
    else:
        eight_bit = "optimizer: {name: adamw8bit}\n" if shard == "zero" else ""  # fsdp refuses 8-bit states
        config.write_text("model: {card: qwen2.5-0.5b-instruct}\ndata: {path: x.jsonl}\nlora: {enabled: false}\n"
                          f"training: {{shard: {shard}}}\n{eight_bit}")
    states = {}
    for gpus in (1, 4):
        assert plan_command.main(["--config", str(config), "--gpus", str(gpus), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["cluster"]["shard"] == shard
        states[gpus] = data["states"]
    for name in ("weights", "gradients", "master", "optimizer"):
        expected = states[1][name] / 4 if name in split else states[1][name]
        assert states[4][name] == pytest.approx(expected, rel=1e-6), name


@pytest.mark.parametrize("split, stages", [(2, 1), (1, 2), (2, 2)])
def test_plan_of_a_config_split_or_cut_holds_a_part_a_process(tmp_path, capsys, split, stages):
    """A config's training.split and training.pipeline plan one copy over split x pipeline
    GPUs: a line a stage, the table's memory the fullest process's, each holding less than
    the whole model does."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{card: qwen2.5-0.5b-instruct}}\ndata: {{path: x.jsonl}}\nlora: {{enabled: false}}\n"
                      f"training: {{split: {split}, pipeline: {stages}, accumulation: 4}}\n")
    assert plan_command.main(["--config", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["cluster"]["split"], data["cluster"]["pipeline"], data["cluster"]["gpus"]) == (split, stages,
                                                                                                split * stages)
    assert len(data["processes"]) == stages
    assert data["total"] == max(max(p["phases"].values()) for p in data["processes"])
    whole = plan.estimate("qwen2.5-0.5b-instruct", **plan.plan_inputs(
        {k: v for k, v in plan_command.settings_from_config(str(config)).items()
         if k not in ("card", "split", "pipeline", "gpus")}))
    assert all(p["states"]["weights"] < whole.states.weights for p in data["processes"])
    assert plan_command.main(["--config", str(config)]) == 0
    assert ("peak, stage 1 of 2" in capsys.readouterr().out) == (stages == 2)


PARTS_CARD = plan.cards.resolve("debug").replace(vocab=64, hidden=32, intermediate=64, heads=4, kv_heads=2,
                                                 head_dim=8, layers=5, tied_embeddings=True)


def test_model_parts_divide_the_model_as_linnet_does():
    """Stages hold consecutive blocks (5 over 2: 2 and 3), the first the embedding, the last
    the norm and an untied head, so the stages together hold the model and a second head;
    1F1B (micro-batches >= stages) keeps P - i in flight at stage i, GPipe every one; a
    split divides each block's projections and the head's rows, not the embedding or norms."""
    card = PARTS_CARD
    parts = plan_parts.model_parts(card, stages=2, micro_batches=8)
    assert [p.card.layers for p in parts] == [2, 3] and [p.embeds for p in parts] == [True, False]
    assert [p.head_rows for p in parts] == [0, 64] and not any(p.tied for p in parts)
    assert sum(p.params() for p in parts) == card.params() + card.vocab * card.hidden
    assert [p.in_flight for p in plan_parts.model_parts(card, stages=4, micro_batches=8)] == [4, 3, 2, 1]
    assert [p.in_flight for p in plan_parts.model_parts(card, stages=4, micro_batches=2)] == [2, 2, 2, 2]


def test_interleaved_stages_hold_two_chunks_and_keep_their_warm_up_in_flight():
    """Interleaved, 5 blocks over 2 stages are cut into 4 chunks (1, 1, 1, 2 blocks): stage 1
    holds chunks 0 and 2 (2 blocks), stage 2 chunks 1 and 3 (3). With 4 micro-batches (two
    rounds of 2) stage i keeps PyTorch's warm-up, 2 passes of a round through one chunk and
    2 (P - 1 - i) more, and the one in hand, each half a micro-batch: 2.5 and 1.5. Micro-
    batches that do not divide into rounds (5) pass each chunk in turn: all in flight; fewer
    than the stages, GPipe. Each chunk that receives or sends has its buffers; the planner
    and `linnet plan` take the schedule, and refuse a card with fewer layers than chunks."""
    card = PARTS_CARD
    parts = plan_parts.model_parts(card, stages=2, micro_batches=4, schedule="interleaved")
    assert [p.card.layers for p in parts] == [2, 3] and [p.in_flight for p in parts] == [2.5, 1.5]
    assert [(p.receives, p.sends) for p in parts] == [(1, 2), (2, 1)]
    for m, flight in ((5, [5, 5]), (1, [1, 1])):
        assert [p.in_flight for p in plan_parts.model_parts(card, stages=2, micro_batches=m,
                                                             schedule="interleaved")] == flight
    with pytest.raises(ValueError, match="fewer than the chunks"):
        plan_parts.model_parts(card, stages=3, schedule="interleaved")
    settings = dict(tokens=256, accumulate=4, gpus=2, pipeline=2)
    one, two = (plan.estimate(card, **plan.plan_inputs({**settings, "pipeline_schedule": s}))
                for s in ("1f1b", "interleaved"))
    # the first stage: more in flight (2.5 micro-batches against 2) and three buffers' worth against one
    assert max(two.processes[0].phases.values()) > max(one.processes[0].phases.values())
    (split,) = plan_parts.model_parts(card, split=2)
    linears = sum(o * i for o, i in card.linear_shapes().values())
    norms = card.block_params() - linears
    assert split.params() == (card.vocab * card.hidden + card.vocab // 2 * card.hidden + card.hidden
                              + card.layers * (linears // 2 + norms))
    assert split.split_head and plan_parts.model_parts(card.replace(vocab=63), split=2)[0].head_rows == 63
    lora = plan.Method("lora", rank=4)
    assert plan.trainable_params(card, lora, split) == plan.trainable_params(card, lora) - card.layers * 4 * sum(
        (o if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) else i) // 2
        for name, (o, i) in card.linear_shapes().items())


def test_fsdp_over_a_split_or_stages_and_split_shards_each_part_over_its_copies():
    """2 x 2 (a split sharded over two copies) and 2 x 2 x 2 (stages too): each GPU holds
    its part's states divided by the copies, and gathers one block's part at a time."""
    for cut in (dict(split=2), dict(split=2, pipeline=2)):
        per_copy = cut.get("split", 1) * cut.get("pipeline", 1)
        whole, sharded = (plan.estimate(PARTS_CARD, **plan.plan_inputs({**cut, "gpus": per_copy * copies, **extra}))
                          for copies, extra in ((1, {}), (2, {"shard": "fsdp"})))
        for mine, alone in zip(sharded.processes, whole.processes, strict=True):  # a stage's part each
            assert mine.name == alone.name
            for a, b in zip(dataclasses.astuple(mine.states), dataclasses.astuple(alone.states), strict=True):
                assert a == pytest.approx(b / 2)
        assert sharded.total < whole.total


def test_offloaded_checkpointing_keeps_one_blocks_input_on_the_gpu():
    """activation_checkpointing 'offload': the blocks' inputs wait in host memory and one at
    a time comes back for its block's backward; on a CPU, host memory is the device's."""
    full, offload = (activation_bytes(PARTS_CARD, Method("full"), Workload(tokens=64, activation_checkpointing=m))
                     for m in ("full", "offload"))
    kept = 2 * PARTS_CARD.hidden * 64  # one block's bf16 input
    assert full.kept - offload.kept == PARTS_CARD.layers * kept and offload.recompute == full.recompute + kept
    on_cpu = [activation_bytes(PARTS_CARD, Method("full"), Workload(tokens=64, activation_checkpointing=m,
                                                                     device="cpu")) for m in ("full", "offload")]
    assert on_cpu[0] == on_cpu[1]


def test_mlp_tiles_hold_their_input_gradients_in_a_blocks_backward():
    """With the MLP in tiles a block's backward holds one tile's two [tile, F] gradients and
    the tiles' input gradients with their concatenation, two [s·b, d] (bench/long_context.md:
    without them the planner fell 7-10% short at 16K-64K); none when one tile holds the row,
    and a GPU's share of them under sequence parallel."""
    card, c = PARTS_CARD, 4  # f32
    f32 = Method("full", dtype="f32")
    d, F = card.hidden, card.intermediate
    for tile, expected in ((16, 2 * c * F * 16 + 2 * c * d * 64), (64, 2 * c * F * 64)):
        assert activation_bytes(card, f32, Workload(tokens=64, mlp_tile=tile)).backward == expected
    share = plan_parts.model_parts(card, split=2, sequence=True)[0]
    assert activation_bytes(card, f32, Workload(tokens=64, mlp_tile=16), share).backward == \
        2 * c * F // 2 * 16 + 2 * c * d * 64 / 2


def test_sequence_parallel_shares_the_norms_and_block_inputs_among_the_split():
    """--sequence-parallel with --split 2: each norm's input, 1/rms and normalised input
    and a checkpointed block's input are half a row's; the norms' outputs whole (gathered
    for the projections)."""
    full = Method("full")  # bf16: c = 2
    w = Workload(tokens=64, activation_checkpointing="none")
    part, shared = (plan_parts.model_parts(PARTS_CARD, split=2, sequence=s)[0] for s in (False, True))
    assert shared.sequence == 2 and part.sequence == 1
    d = PARTS_CARD.hidden
    norm_share = (4 * d + 4 + 2 * d) * 64 / 2  # of each of a block's two norms, trained
    assert block_activation_bytes(part.card, full, w) - block_activation_bytes(part.card, full, w, 2) == 2 * norm_share
    checked = dataclasses.replace(w, activation_checkpointing="full")
    assert activation_bytes(PARTS_CARD, full, checked, part).kept - activation_bytes(
        PARTS_CARD, full, checked, shared).kept == PARTS_CARD.layers * 2 * d * 64 / 2
    plans = [plan.estimate(PARTS_CARD, **plan.plan_inputs(dict(split=2, gpus=2, tokens=64, sequence_parallel=s)))
             for s in (False, True)]
    assert plans[1].phases["backward"] < plans[0].phases["backward"]
    tiled = plan.estimate(PARTS_CARD, **plan.plan_inputs(dict(split=2, gpus=2, tokens=64, sequence_parallel=True,
                                                              mlp_tile=16)))
    # a checkpointed block computed again in backward holds the split MLP's activations for one tile's positions
    assert tiled.activations.recompute < plans[1].activations.recompute
    assert tiled.phases["backward"] < plans[1].phases["backward"]
    for settings, message in ((dict(sequence_parallel=True), "sequence_parallel shares a split's positions"),
                              (dict(split=2, gpus=2, sequence_parallel=True, mlp_tile=15), "multiples of split")):
        with pytest.raises(ValueError, match=message):
            plan.estimate(PARTS_CARD, **plan.plan_inputs(settings))


@pytest.mark.parametrize("settings, message", [
    (dict(split=3), "heads=4, which 3 processes cannot split evenly"),
    (dict(pipeline=6), "5 layers, fewer than the stages"),
    (dict(split=2, gpus=3), "use a multiple of 2 GPUs"),
    (dict(split=2, gpus=4, shard="zero"), "shards the parts of a split or pipelined model over their copies with "
                                          "fsdp alone"),
    (dict(pipeline=2, gpus=4, shard="zero"), "with fsdp alone"),
    (dict(pipeline=2, pipeline_schedule="zero-bubble"), "zero-bubble with activation_checkpointing: linnet refuses"),
    (dict(pipeline=2, gpus=4, shard="fsdp", pipeline_schedule="zero-bubble", activation_checkpointing="none"),
     "zero-bubble with shard fsdp"),
    (dict(split=2, gpus=2, method="qlora"), "qlora with split: linnet splits an NF4 base with shard fsdp"),
    (dict(pipeline=2, gpus=2, num_models=2), "num_models with split or pipeline"),
])
def test_split_and_pipeline_plans_refuse_what_linnet_refuses(settings, message):
    settings = {"gpus": settings.get("split", 1) * settings.get("pipeline", 1), **settings}
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.estimate(PARTS_CARD, **plan.plan_inputs(settings))


def test_plan_of_a_distill_config_adds_the_teacher_and_on_policy_the_sampling_engine(tmp_path, capsys):
    config = tmp_path / "distill.yaml"
    text = ("model: {card: qwen2.5-0.5b-instruct}\ndata: {path: x.jsonl}\nlora: {enabled: false}\n"
            "training: {context_length: 1024, accumulation: 2, steps: 10}\n"
            "distill: {teacher: llama-3.2-1b-instruct, mode: MODE, prompts_per_step: 4}\n")
    teacher = plan.cards.resolve("llama-3.2-1b-instruct")
    for mode in ("logit", "on_policy"):
        config.write_text(text.replace("MODE", mode))
        assert plan_command.main(["--config", str(config), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["teacher"] == {"card": teacher.name, "params": teacher.params(), "bytes": teacher.params() * 2}
        assert data["workload"]["accumulate"] == 2 and data["compute"]["total_targets"] == 10 * 2 * 1024
        assert ("sampling" in data) == (mode == "on_policy")
        assert mode == "logit" or (data["sampling"]["rows"], data["sampling"]["slots"]) == (4, 1024)
    # a teacher the plan cannot size is named, not fatal
    config.write_text(text.replace("MODE", "logit").replace("llama-3.2-1b-instruct", "some-unknown-teacher"))
    assert plan_command.main(["--config", str(config)]) == 0
    assert "frozen teacher some-unknown-teacher, not in the totals above: no card" in capsys.readouterr().out



@pytest.mark.parametrize("targets, adapted", [("[q_proj, v_proj]", ["q_proj", "v_proj"]),
                                              ("all-linear", list(plan.LINEAR_NAMES)),
                                              ("['model.layers.*.mlp.*_proj']", ["gate_proj", "up_proj", "down_proj"])])
def test_a_configs_lora_targets_plan_as_they_train(tmp_path, targets, adapted):
    """lora.targets in PEFT's names, all-linear or globs plan the layers add_lora adapts."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{card: qwen2.5-0.5b-instruct}}\ndata: {{path: x.jsonl}}\nlora: {{targets: {targets}}}\n")
    assert sorted(plan_command.settings_from_config(str(config))["targets"]) == sorted(adapted)


# seed 004's "Why LoRA fits on one GPU": (card, method) -> trainable, states GB, + activations GB, min H100-80GB
MODULE_TABLE = {
    ("llama-3.1-8b-instruct", "full"): ("8.03B", 128.5, 132, 2),
    ("llama-3.1-8b-instruct", "lora"): ("41.9M", 16.7, 20.5, 1),
    ("llama-3.1-8b-instruct", "qlora"): ("41.9M", 4.8, 8.6, 1),
    ("llama-3.1-70b-instruct", "full"): ("70.6B", 1129, 1138, 18),
    ("llama-3.1-70b-instruct", "lora"): ("207M", 144.4, 153, 3),
    ("llama-3.1-70b-instruct", "qlora"): ("207M", 39.7, 48.3, 1),
}


def test_the_textbook_plan_prints_every_figure_of_the_modules_table(capsys):
    """`linnet plan --textbook` counts as the module does (16 B a trained parameter, 2 B or
    4.127 bits a frozen one, 34·s·b·d + 2·s·b·d·L + f32 logits): every figure of its table,
    at the precision it prints, beside linnet's own plan and a reason a row."""
    from linnet.plan.textbook import textbook

    for (card, method), (trainable, states, total, gpus) in MODULE_TABLE.items():
        (row,) = [r for r in textbook(card) if r.method == method]
        assert round(row.states / 1e9, 1 if isinstance(states, float) else 0) == states, (card, method)
        # the module's 1,138 GB (70B full) is 70.6B x 16 B + 8.6 GB; the card's exact 70.55B give 1,137.5
        slack = 0.05 if isinstance(total, float) else 0.5 if (card, method) != ("llama-3.1-70b-instruct", "full") else 0.55
        assert abs(row.total / 1e9 - total) <= slack, (card, method)
        scale, unit = (1e9, "B") if trainable.endswith("B") else (1e6, "M")
        assert f"{row.trainable / scale:.3g}{unit}" == trainable and row.gpus == gpus, (card, method)
    assert plan_command.main(["--textbook"]) == 0
    out = capsys.readouterr().out
    for figure in ("128.5 GB", "132.2 GB", "16.7 GB", "20.5 GB", "4.8 GB", "8.6 GB", "1,128.9 GB", "1,137.5 GB",
                   "144.4 GB", "153.0 GB", "39.7 GB", "48.3 GB", "41.9M (0.5%)", "207.1M (0.3%)"):
        assert figure in out, figure
    assert out.count("linnet's peak:") == 6 and "QLoRA keeps the embeddings and the head in bf16" in out


def test_context_parallel_plans_a_gpus_share_of_each_row_and_the_rings_buffers():
    """Each of `context` GPUs holds the activations of tokens / context positions, plus
    the ring's tile of scores and its neighbour's keys and values in backward; the
    states are a whole copy's, or with fsdp a quarter of it (CP x FSDP: sharded over every
    GPU); the tile is linnet.torch.context's."""
    from linnet.torch import context

    assert plan.RING_SCORE_BYTES == context.SCORE_BYTES
    card = plan.cards.resolve("qwen2.5-0.5b-instruct")
    method, work = Method("full"), Workload(tokens=32768, chunked_loss=True)
    whole = plan.estimate(card, method, work)
    ring = plan.estimate(card, method, work, Cluster(gpus=4, context=4))
    quarter = activation_bytes(card, method, Workload(tokens=8192, chunked_loss=True))
    assert ring.states == whole.states and ring.activations.kept == quarter.kept
    sharded = plan.estimate(card, method, work, Cluster(gpus=4, context=4, shard="fsdp"))
    for a, b in zip(dataclasses.astuple(sharded.states), dataclasses.astuple(whole.states), strict=True):
        assert a == pytest.approx(b / 4)
    assert sharded.activations.kept == quarter.kept
    kv, q = card.kv_heads * card.head_dim, card.heads * card.head_dim
    added = 4 * plan.RING_SCORE_BYTES + 32 * kv * 8192 + 8 * q * 8192
    assert plan.ring_bytes(card, Workload(tokens=8192), 4) == added
    fused = plan.RING_SCORE_BYTES + 32 * kv * 8192 + 16 * q * 8192  # a CPU's: a tile's mask, no scores
    assert plan.ring_bytes(card, Workload(tokens=8192, device="cpu"), 4) == fused
    # the ring's buffers live in attention's backward, the MLP's in-flight gradients before it: the larger
    assert ring.activations.backward == max(quarter.backward, added) == added
    tiled = Workload(tokens=32768, chunked_loss=True, mlp_tile=512, device="cpu")
    small = plan.estimate(card, method, tiled, Cluster(gpus=4, context=4))
    mine = activation_bytes(card, method, dataclasses.replace(tiled, tokens=8192))
    assert small.activations.backward == max(mine.backward, fused) and mine.backward > 0
    assert plan.ring_bytes(card, work, 1) == 0
    for bad, message in [
                         (dict(gpus=4, context=4, split=2), "use a multiple of 8 GPUs"),
                         (dict(gpus=3, context=2), "multiple of 2")]:
        with pytest.raises(ValueError, match=message):
            plan.estimate(card, method, work, Cluster(**bad))
    # beside a split, each GPU passes its share of the heads' keys and values round the ring
    both = plan.estimate(card, method, work, Cluster(gpus=8, context=4, split=2))
    half = card.replace(heads=card.heads // 2, kv_heads=card.kv_heads // 2, intermediate=card.intermediate // 2)
    fourth = dataclasses.replace(work, tokens=work.tokens // 4)
    assert both.activations.backward == max(plan.activation_bytes(
        card, method, fourth, plan_parts.model_parts(card, split=2)[0]).backward, plan.ring_bytes(half, fourth, 4))
    with pytest.raises(ValueError, match="multiple of 8"):
        plan.estimate(card, method, Workload(tokens=1001), Cluster(gpus=4, context=4))
    # a split's parts sharded over its copies and the context group together (FSDP x TP x CP)
    cube = plan.estimate(card, method, work, Cluster(gpus=8, context=2, split=2, shard="fsdp"))
    split = plan.estimate(card, method, work, Cluster(gpus=2, split=2))
    for a, b in zip(dataclasses.astuple(cube.states), dataclasses.astuple(split.states), strict=True):
        assert a == pytest.approx(b / 4)
    # and its norms on a GPU's share of that GPU's positions (TP x SP x CP)
    spread = plan.estimate(card, method, work, Cluster(gpus=4, context=2, split=2, sequence_parallel=True))
    assert spread.activations.kept < plan.estimate(card, method, work, Cluster(gpus=4, context=2, split=2)).activations.kept
    # and through pipeline stages: each stage's GPUs a share of its positions and the ring's buffers
    staged = plan.estimate(card, method, work, Cluster(gpus=4, context=2, pipeline=2))
    alone = plan.estimate(card, method, dataclasses.replace(work, tokens=work.tokens // 2), Cluster(gpus=2, pipeline=2))
    assert staged.activations.backward == max(alone.activations.backward, plan.ring_bytes(
        card, dataclasses.replace(work, tokens=work.tokens // 2), 2))
    with pytest.raises(ValueError, match="a GPU's share of them"):
        plan.estimate(card, method, Workload(tokens=8196), Cluster(gpus=8, context=2, split=4, sequence_parallel=True))


def test_suggest_plans_every_layout_linnet_runs_fastest_that_fits_first(capsys):
    """`linnet plan --suggest`: every layout of the GPUs that linnet runs (whole copies,
    zero, fsdp, split, pipeline, context and their mixes, context beside a split, sharded
    or sequence parallel, included), those that fit first, by kind
    of communication then peak; each layout's settings load as a config."""
    from linnet.config.groups import TrainingConfig
    from linnet.plan.layouts import suggest

    card = plan.cards.resolve("llama-3.1-8b-instruct")
    work = Workload(tokens=32768, chunked_loss=True, mlp_tile=2048)
    layouts = suggest(card, Method("full"), work, Cluster(gpus=8))
    fits = [x.fits for x in layouts]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    assert not layouts[-1].fits
    fitting = [x.tokens_per_second for x in layouts if x.fits]  # the fastest first, by the estimated step
    assert fitting == sorted(fitting, reverse=True) and layouts[0].settings == "training.shard=fsdp"
    kinds = {(x.shard, x.split, x.pipeline, x.context) for x in layouts}
    assert ("none", 1, 1, 1) in kinds and ("zero", 1, 1, 2) in kinds and ("fsdp", 1, 4, 1) in kinds
    assert ("none", 2, 4, 1) in kinds and ("fsdp", 2, 2, 1) in kinds and ("fsdp", 1, 1, 4) in kinds
    assert ("none", 1, 2, 2) in kinds and ("fsdp", 2, 2, 2) in kinds  # context through pipeline stages
    assert ("none", 2, 1, 2) in kinds  # a split, each row over two such splits
    assert ("fsdp", 2, 1, 2) in kinds  # its parts sharded over the copies and the context group
    assert any(x.sequence_parallel and x.context > 1 for x in layouts)
    assert {x.settings for x in layouts} >= {"whole copies (the defaults)", "training.shard=zero training.context=2"}
    for x in layouts:  # what it says to set is a config linnet takes
        TrainingConfig(context_length=32768, shard=x.shard, split=x.split, pipeline=x.pipeline, context=x.context,
                       sequence_parallel=x.sequence_parallel, mlp_tile=2048)
        assert x.peak == estimate(card, Method("full"), work, Cluster(
            gpus=8, shard=x.shard, split=x.split, pipeline=x.pipeline, context=x.context,
            sequence_parallel=x.sequence_parallel)).total
    assert any(x.sequence_parallel for x in layouts)  # with the MLP's tiles too
    assert plan_command.main(["llama-3.1-8b-instruct", "--method", "full", "--gpus", "2", "--context-length",
                              "131072", "--suggest"]) == 0
    out = capsys.readouterr().out
    assert "training.context=2" in out and "none fits" in out and "tokens/s (est.)" in out
    assert plan_command.main(["llama-3.1-8b-instruct", "--method", "full", "--gpus", "4", "--suggest", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    fastest = [r["tokens_per_second"] for r in rows if r["fits"]]
    assert fastest and fastest == sorted(fastest, reverse=True)


def test_step_time_counts_each_axis_at_the_bandwidth_of_the_link_it_spans():
    """linnet.plan.traffic: compute at the MFU, the pipeline's idle turns, and each axis's
    bytes over NVLink inside a node of 8, the network beyond, as its docstring counts them."""
    from linnet.plan.traffic import bandwidth, step_time

    card = plan.cards.resolve("llama-3.1-8b-instruct")
    full, work = Method("full"), Workload(tokens=8192, accumulate=4)
    peak = 989e12 * 0.35
    per_token = 8 * card.params() + 4 * 2 * 8192 * card.heads * card.head_dim * card.layers  # 6N + 2N again
    one = step_time(card, full, work, Cluster(gpus=1))
    assert one.compute == pytest.approx(4 * 8192 * per_token / peak) and one.seconds == one.compute
    assert one.tokens_per_second == pytest.approx(4 * 8192 / one.compute)
    assert bandwidth("h100", 8) == 450e9 and bandwidth("h100", 16) == 50e9 and bandwidth("l40s", 2) == 32e9
    split = step_time(card, full, work, Cluster(gpus=2, split=2))
    sent = 4 * card.layers * 6 * 8192 * card.hidden * 2  # 6 all-reduces a block a micro-batch, 2(s-1)/s = 1
    assert split.split == pytest.approx(sent / 450e9) and split.compute == pytest.approx(one.compute / 2)
    staged = step_time(card, full, work, Cluster(gpus=2, pipeline=2))
    assert staged.idle == pytest.approx(staged.compute / 4)  # (P - 1) / M of the compute
    ring = step_time(card, full, work, Cluster(gpus=2, context=2))
    kv = card.kv_heads * card.head_dim * 4096
    assert ring.context == pytest.approx(4 * card.layers * (2 * kv * 2 * 2 + 2 * kv * 6 + 2 * kv * 4) / 450e9)
    wide = step_time(card, full, work, Cluster(gpus=16, context=16))  # over two nodes: the network's bandwidth
    kv = card.kv_heads * card.head_dim * 512
    assert wide.context == pytest.approx(4 * card.layers * (15 * 2 * kv * 2 * 2 + 15 * 2 * kv * 6 + 2 * kv * 4) / 50e9)
    copies = step_time(card, full, work, Cluster(gpus=8))  # whole copies: the gradients all-reduced after backward
    assert copies.copies == pytest.approx(2 * 7 / 8 * card.params() * 2 / 450e9)
    assert copies.tokens_per_second == pytest.approx(8 * one.tokens_per_second, rel=0.02)
    assert step_time(card, full, work, Cluster(gpus=8, shard="fsdp")).copies == 0  # hidden behind compute
    small = Workload(tokens=256)  # too little compute to hide FSDP's gathers over the network
    assert step_time(card, full, small, Cluster(gpus=64, shard="fsdp")).copies > 0
    # nodes of 4 GPUs: a context group of 8 spans two of them, its ring at the network's bandwidth
    assert bandwidth("h100", 8, per_node=4) == 50e9 and bandwidth("h100", 4, per_node=4) == 450e9
    ring8 = [step_time(card, full, work, Cluster(gpus=8, context=8, gpus_per_node=n)).context for n in (8, 4)]
    assert ring8[1] == pytest.approx(ring8[0] * 450e9 / 50e9)


def test_gpus_per_node_counts_nodes_and_is_checked(capsys):
    assert plan_command.main(["llama-3.1-70b-instruct", "--gpus-per-node", "4"]) == 0
    assert table_row(capsys.readouterr().out, "minimum h100 GPUs (FSDP)")[0] == "18 (5 nodes of 4)"
    with pytest.raises(ValueError, match="gpus_per_node must be a positive integer, got 0"):
        Cluster(gpus_per_node=0)


# ---------------------------------------------------------------------------------------
# A mixture of experts (linnet.plan.experts)

MOE_CARD = plan.cards.resolve("debug").replace(name="tiny-moe", family="qwen3_moe", qk_norm=True,
                                               experts=plan.Experts(8, 2, 24, True))
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def moe_directory(tmp_path, card=MOE_CARD):
    """A model directory of `card` (its config.json), as linnet plan reads one."""
    directory = tmp_path / card.name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(card.hf_config()))
    return directory


def moe_model(method: str, dtype: str, targets=(), card=MOE_CARD):
    """A linnet decoder of `card` with random weights, its routers scaled up so that the
    positions spread over the experts, and adapters of rank 4 on `targets` (add_lora's
    patterns) unless it trains in full."""
    import torch

    from linnet import nest

    model = nest.load(card, weights="random", trainable=method == "full",
                      dtype={"f32": "float32", "bf16": "bfloat16"}[dtype],
                      **({"quantize": "nf4"} if method == "qlora" else {}))
    if method != "full":
        model.add_lora(list(targets), rank=4)
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.gate.weight.normal_(0, 1.0)
    return model


# Qwen2-MoE's block: a shared expert, 40 wide, beside the routed ones
SHARED_CARD = MOE_CARD.replace(name="tiny-moe-shared", family="qwen2_moe", qk_norm=False, qkv_bias=True,
                               experts=plan.Experts(8, 2, 24, False, shared=40))
RAW_WEIGHTS = MOE_CARD.replace(experts=dataclasses.replace(MOE_CARD.experts, normalize=False, count=6))
# (method, dtype, add_lora's patterns, the planner's targets, the card)
MOE_BLOCK_CASES = [
    ("full", "f32", (), plan.LINEAR_NAMES, MOE_CARD),
    ("full", "bf16", (), plan.LINEAR_NAMES, MOE_CARD),
    ("full", "f32", (), plan.LINEAR_NAMES, RAW_WEIGHTS),
    ("lora", "f32", ("all-linear",), plan.LINEAR_NAMES, MOE_CARD),
    ("lora", "bf16", ("all-linear",), plan.LINEAR_NAMES, MOE_CARD),
    ("lora", "f32", ATTENTION, ATTENTION, MOE_CARD),
    ("lora", "bf16", ("q_proj", "o_proj", "gate_up_proj"), ("q_proj", "o_proj", "gate_up_proj"), MOE_CARD),
    ("lora", "f32", ("q_proj", "model.layers.*.mlp.experts.down_proj"), ("q_proj", "down_proj"), MOE_CARD),
    ("qlora", "f32", ("all-linear",), plan.LINEAR_NAMES, MOE_CARD),
    ("full", "f32", (), plan.LINEAR_NAMES, MOE_CARD.replace(experts=dataclasses.replace(MOE_CARD.experts, aux_loss=0.01))),
    ("full", "f32", (), plan.LINEAR_NAMES, SHARED_CARD),
    ("full", "bf16", (), plan.LINEAR_NAMES, SHARED_CARD),
    ("lora", "f32", ("all-linear",), plan.LINEAR_NAMES, SHARED_CARD),
    ("lora", "f32", ATTENTION, ATTENTION, SHARED_CARD),
    ("lora", "bf16", ("q_proj", "o_proj", "up_proj", "down_proj"), ("q_proj", "o_proj", "up_proj", "down_proj"),
     SHARED_CARD),
]


@pytest.mark.parametrize("method, dtype, patterns, targets, card", MOE_BLOCK_CASES)
def test_moe_block_count_is_what_autograd_saves(method, dtype, patterns, targets, card):
    """A mixture of experts' block keeps its router's softmax and top-k, each position's rows
    gathered for its chosen experts with their MLP's intermediates, the results and their
    weighted copy (and Qwen2-MoE's shared expert): the planner's count per token is
    autograd's, for full fine-tuning, QLoRA and adapters on the attention, the experts or
    both; its adapters are add_lora's, its NF4 weights nest.load's."""
    import torch

    from linnet.torch import attention
    from linnet.torch.moe import balancing

    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    model = moe_model(method, dtype, patterns, card)
    planned = Method(method, rank=4, targets=targets, dtype=dtype)

    def forward(n):
        x = torch.randn(n, card.hidden, dtype=model.dtype, generator=torch.Generator().manual_seed(n),
                        requires_grad=True)
        angles = torch.arange(n)[:, None].float() * model.inv_freq[None]
        cos, sin = (torch.cat((angles, angles), -1).cos().to(model.dtype), torch.cat((angles, angles), -1).sin()
                    .to(model.dtype))
        with balancing(model):  # as training runs it: with a coefficient the router's loss takes the softmax again
            return model.model.layers[0](x, cos, sin, [0, n], attention.documents), (cos, sin)

    assert saved_per_token(forward, lengths=(64, 128)) == block_activation_bytes(
        card, planned, Workload(tokens=1, device="cpu"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.trainable_params(card, planned) == trained
    if method == "qlora":  # NF4 codes, two weights a byte: the attention's and every expert's, not the router's
        assert 2 * sum(p.numel() for p in model.parameters() if p.dtype == torch.uint8) == plan.quantized_params(
            card, planned)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("card", [MOE_CARD, SHARED_CARD])
def test_moe_kept_activations_are_what_the_trunk_saves(method, card):
    import numpy as np

    from linnet.packing import Example, pack

    model = moe_model(method, "f32", ("all-linear",), card)

    def forward(n):
        row = next(pack([Example.plain(np.arange(3, 3 + n) % card.vocab)], tokens=n))
        return model.hidden_packed(row), ()

    acts = activation_bytes(card, Method(method, rank=4, dtype="f32"),
                            Workload(tokens=1, device="cpu", activation_checkpointing="none", chunked_loss=True))
    assert saved_per_token(forward, lengths=(64, 128), keep=lambda h: [h]) == acts.kept


def test_moe_counts_every_expert_in_states_and_the_active_ones_in_flops():
    card = MOE_CARD
    e, experts = card.experts, card.layers * card.experts.count * 3 * card.experts.intermediate * card.hidden
    full = estimate(card, Method("full"), total_targets=1e9)
    assert (full.params, full.active, full.trainable) == (card.params(), card.active_params(), card.params())
    assert full.active == card.params() - card.layers * (e.count - e.per_token) * 3 * e.intermediate * card.hidden
    assert full.states.total == 16 * card.params()
    assert full.compute.flops == 6 * card.active_params() * 1e9 < 6 * card.params() * 1e9
    lora = estimate(card, Method("lora", rank=4), total_targets=1e9)
    assert lora.compute.flops == 4 * card.active_params() * 1e9
    # all-linear: the attention's four and one pair an expert on each stacked tensor, E·r·(in + out)
    attention = 4 * sum(o + i for o, i in card.linear_shapes().values())
    stacked = e.count * 4 * ((2 * e.intermediate + card.hidden) + (card.hidden + e.intermediate))
    assert lora.trainable == card.layers * (attention + stacked)
    assert plan.trainable_params(card, Method("lora", rank=4, targets=ATTENTION)) == card.layers * attention
    attention_weights = sum(o * i for o, i in card.linear_shapes().values())
    assert plan.quantized_params(card, Method("qlora")) == card.layers * attention_weights + experts


def test_expert_parallel_splits_the_experts_states_and_adds_the_all_to_all_buffers():
    """Over 4 GPUs each holds a quarter of every block's experts with their states, never
    sharded again (fsdp shards the rest over the same GPUs), and a block's backward holds
    the all-to-all buffers, 3·c·d a routed pair; what blocks keep is unchanged."""
    card, work = MOE_CARD, Workload(tokens=512, chunked_loss=True)
    e, c = card.experts, 2
    experts = card.layers * e.count * 3 * e.intermediate * card.hidden
    dense = card.params() - experts
    one = estimate(card, Method("full"), work, Cluster(gpus=4))
    split = estimate(card, Method("full"), work, Cluster(gpus=4, expert=4))
    sharded = estimate(card, Method("full"), work, Cluster(gpus=4, expert=4, shard="fsdp"))
    assert one.states.total == 16 * card.params()
    assert split.states.total == 16 * (dense + experts / 4)
    assert sharded.states.total == pytest.approx(16 * (dense / 4 + experts / 4))
    assert split.activations.kept == one.activations.kept
    # a block's backward: the pairs' results' and gathered rows' gradients, and an expert's own, two of each
    assert one.activations.backward == 2 * c * e.per_token * 512 * (card.hidden + e.intermediate / e.count)
    assert split.activations.backward - one.activations.backward == 3 * c * card.hidden * e.per_token * 512
    assert [p.params for p in split.processes] == [dense + experts // 4]
    # the optimizer step (no bf16 copies; foreach AdamW's 4 B): fsdp splits the dense states of each moment over
    # the GPUs, the experts' stay a quarter
    assert one.phases["optimizer"] == 18 * card.params() and split.phases["optimizer"] == 18 * (dense + experts / 4)
    assert sharded.phases["optimizer"] == pytest.approx(18 * (dense / 4 + experts / 4))
    # the fewest GPUs is the whole model's, every state sharded
    assert split.min_gpus == one.min_gpus
    # two groups of 4 (copies of each other): the experts a quarter, the dense parts sharded over all 8
    groups = estimate(card, Method("full"), work, Cluster(gpus=8, expert=4, shard="fsdp"))
    assert groups.states.total == pytest.approx(16 * (dense / 8 + experts / 4))
    adapters = estimate(card, Method("lora", targets=ATTENTION), work, Cluster(gpus=4, expert=4, shard="fsdp"))
    # the frozen base in bf16: its dense part sharded, its experts split; the adapters' copies whole
    assert adapters.states.weights == pytest.approx(2 * dense / 4 + 2 * experts / 4 + 2 * adapters.trainable)


@pytest.mark.parametrize("card, settings, message", [
    (PARTS_CARD, dict(expert=2, gpus=2), "expert 2 splits a mixture of experts' experts; card 'debug' (llama) has none"),
    (MOE_CARD, dict(expert=3, gpus=3), "expert 3: card 'tiny-moe' has 8 experts a block, which 3 GPUs cannot split"),
    (MOE_CARD, dict(expert=4, gpus=6), "gpus=6: expert 4 splits the experts over groups of 4 GPUs; use a multiple"),
    (MOE_CARD, dict(expert=2, gpus=2, method="qlora", targets="q_proj"), "expert 2 with qlora: linnet's expert "
                                                                         "parallel does not split experts stored in NF4"),
    (MOE_CARD, dict(expert=2, gpus=4, split=2), "expert 2 with split 2 and pipeline 1"),
    (MOE_CARD, dict(expert=2, gpus=4, pipeline=2), "expert 2 with split 1 and pipeline 2"),
    (MOE_CARD, dict(expert=2, gpus=2, shard="zero"), "beside the split experts linnet shards the dense parts with "
                                                     "fsdp alone"),
    (MOE_CARD, dict(split=2, gpus=2), "split 2 with a mixture of experts ('tiny-moe', qwen3_moe): linnet does not "
                                      "split or cut its blocks yet"),
    (MOE_CARD, dict(pipeline=2, gpus=2), "pipeline 2 with a mixture of experts"),
    (MOE_CARD, dict(mlp_tile=64), "mlp_tile 64 with a mixture of experts"),
    (MOE_CARD, dict(method="dora"), "dora on a mixture of experts ('tiny-moe', qwen3_moe)'s experts"),
    (MOE_CARD, dict(method="lora", targets="q_proj,gate_proj"), "targets gate_proj: card 'tiny-moe' has no such "
                                                                "layer; a mixture of experts holds every expert's gate "
                                                                "and up rows in one stacked tensor, gate_up_proj"),
    (PARTS_CARD, dict(method="lora", targets="gate_up_proj"), "targets gate_up_proj: card 'debug' has no such layer"),
])
def test_moe_plans_refuse_what_linnet_refuses(card, settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.estimate(card, **plan.plan_inputs(settings))


def test_moe_plans_with_context_parallel_and_adapters_beside_expert_parallel():
    """Context parallel runs a mixture of experts (its blocks on a GPU's positions), beside
    expert parallel too: a GPU's share of a row's positions goes through the all-to-all;
    under expert parallel the experts' adapters stay whole on every GPU, with their states."""
    assert estimate(MOE_CARD, workload=Workload(tokens=512), cluster=Cluster(gpus=2, context=2)).fits
    e, c, work = MOE_CARD.experts, 2, Workload(tokens=512, chunked_loss=True)
    alone, both = (estimate(MOE_CARD, Method("full"), work, Cluster(gpus=4, context=context, expert=2))
                   for context in (1, 2))
    halved = estimate(MOE_CARD, Method("full"), Workload(tokens=256, chunked_loss=True), Cluster(gpus=4, expert=2))
    assert both.states == alone.states and both.activations.kept == halved.activations.kept
    assert both.activations.backward - halved.activations.backward > 0  # the ring's buffers, beside the all-to-all
    assert halved.activations.backward - estimate(MOE_CARD, Method("full"), Workload(tokens=256, chunked_loss=True),
                                                  Cluster(gpus=4)).activations.backward == \
        3 * c * MOE_CARD.hidden * e.per_token * 256
    one = estimate(MOE_CARD, Method("lora"), cluster=Cluster(gpus=2))
    split = estimate(MOE_CARD, Method("lora"), cluster=Cluster(gpus=2, expert=2, shard="fsdp"))
    experts = MOE_CARD.layers * MOE_CARD.experts.count * 3 * MOE_CARD.experts.intermediate * MOE_CARD.hidden
    assert split.trainable == one.trainable == plan.trainable_params(MOE_CARD, Method("lora"))
    for name in ("gradients", "master", "optimizer"):
        assert getattr(split.states, name) == getattr(one.states, name) > 0, name
    base = 2 * (MOE_CARD.params() - experts)  # the frozen base: the dense part sharded, the experts split
    assert split.states.weights == pytest.approx(base / 2 + 2 * experts / 2 + 2 * one.trainable)


def test_cli_plans_a_mixture_of_experts_with_both_counts(tmp_path, capsys):
    from linnet.report.tables import count

    directory = moe_directory(tmp_path)
    code, out, err = run_cli(capsys, str(directory), "--method", "lora", "--total-targets", "1e9")
    assert code == 0 and err == ""
    assert table_row(out, "parameters") == [count(MOE_CARD.params())] == ["132K"]
    assert table_row(out, "active a token") == [count(MOE_CARD.active_params())] == ["77.2K"]
    assumptions = out.split("assumptions:")[1]
    assert "adapters on q_proj, k_proj, v_proj, o_proj, gate_up_proj, down_proj in every block" in assumptions
    assert "mixture of experts: 2 of 8 experts a position" in assumptions
    code, out, _ = run_cli(capsys, str(directory), "--expert", "4", "--gpus", "4", "--json")
    data = json.loads(out)
    assert code == 0 and data["cluster"]["expert"] == 4 and data["experts"]["count"] == 8
    assert (data["params"], data["active"]) == (MOE_CARD.params(), MOE_CARD.active_params())
    code, _, err = run_cli(capsys, str(directory), "--expert", "3", "--gpus", "3")
    assert code == 2 and "--expert 3: card 'tiny-moe' has 8 experts a block" in err
    code, _, err = run_cli(capsys, L8B, "--expert", "2", "--gpus", "2")
    assert code == 2 and err.startswith("linnet plan: error: --expert 2 splits a mixture of experts' experts")


def test_a_config_with_training_expert_plans_the_experts_split(tmp_path, capsys):
    """training.expert: the experts split over that many GPUs (every one of the run); a
    config's lora.targets name the stacked tensors as add_lora picks them."""
    directory = moe_directory(tmp_path)
    _, data = planned_config(tmp_path, capsys, f"model: {{card: {directory}}}\ndata: {{path: x.jsonl}}\n"
                                               "lora: {enabled: false}\ntraining: {expert: 4, shard: fsdp}\n")
    assert data["cluster"]["expert"] == data["cluster"]["gpus"] == 4 and data["cluster"]["shard"] == "fsdp"
    assert data["states"]["total"] == estimate(MOE_CARD, Method("full", grad_dtype="fp32"),
                                               cluster=Cluster(gpus=4, expert=4, shard="fsdp")).states.total
    for targets, adapted in [("all-linear", [*ATTENTION, "gate_up_proj", "down_proj"]),
                             ("['model.layers.*.self_attn.*_proj']", list(ATTENTION)),
                             ("[gate_up_proj]", ["gate_up_proj"])]:
        config = tmp_path / "lora.yaml"
        config.write_text(f"model: {{card: {directory}}}\ndata: {{path: x.jsonl}}\nlora: {{targets: {targets}}}\n")
        assert plan_command.settings_from_config(str(config))["targets"] == adapted
    config.write_text(f"model: {{card: {directory}, quantize: nf4}}\ndata: {{path: x.jsonl}}\ntraining: {{expert: 4}}\n")
    assert plan_command.main(["--config", str(config)]) == 2
    assert "training.expert 4 with qlora: linnet's expert parallel does not split" in capsys.readouterr().err


def test_suggest_splits_a_mixture_of_experts_experts_where_linnet_does(capsys):
    from linnet.plan.layouts import suggest

    card = MOE_CARD.replace(layers=16)
    layouts = suggest(card, Method("full"), Workload(tokens=1024), Cluster(gpus=4))
    kinds = {(x.shard, x.split, x.pipeline, x.context, x.expert) for x in layouts}
    assert {("none", 1, 1, 1, 2), ("fsdp", 1, 1, 1, 2), ("none", 1, 1, 1, 4), ("fsdp", 1, 1, 1, 4)} <= kinds
    assert not any(x[1] > 1 or x[2] > 1 for x in kinds)  # linnet splits and cuts no mixture of experts
    for x in layouts:
        assert x.peak == estimate(card, Method("full"), Workload(tokens=1024),
                                  Cluster(gpus=4, shard=x.shard, context=x.context, expert=x.expert)).total
    order = [x.settings for x in layouts]
    assert {"training.expert=4", "training.shard=fsdp training.expert=2"} <= set(order) and all(x.fits for x in layouts)
    speeds = [x.tokens_per_second for x in layouts]  # every one fits: the fastest first
    assert speeds == sorted(speeds, reverse=True)
    assert all((x.time.expert > 0) == (x.expert > 1) for x in layouts)  # the all-to-alls of the experts split
