"""The planner: memory, FLOPs, GPU-hours and cost of a training run, before renting a GPU.

    linnet plan llama-3.1-8b-instruct --method lora --rank 16 --seq 4096 \\
        --tokens 12e6 --mfu 0.35 --gpus 8 --gpu h100 --price 2.5
    linnet plan llama-3.1-70b-instruct --compare          # full vs LoRA vs QLoRA
    linnet plan path/to/hf-model-dir --tokens chinchilla --json
    python -m linnet.plan ...                              # the same, without the CLI

    plan = estimate("llama-3.1-8b-instruct", Method("lora", rank=16), Batch(seq=4096),
                    Cluster(accelerator("h100"), gpus=8, mfu=0.35, price=2.5), tokens=12e6)

Pure arithmetic over a card's shape: stdlib only, no torch, so it answers in well under a
second on any machine. Every convention the numbers rest on (bytes per parameter, the
activation formula, usable memory, 6ND) is derived in the docstring of the function that
uses it, and `render` lists the ones a plan used under its table.

Units: bytes are plain bytes, and GB in the output is 10^9 bytes (as accelerator data
sheets and the seed's tables count them), not GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from linnet import cards

GB = 1e9


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------
# Accelerators


@dataclass(frozen=True)
class Accelerator:
    """A GPU as the planner sees it: memory and dense (no 2:4 sparsity) tensor peaks."""

    name: str
    memory_gb: float
    bf16_tflops: float
    fp8_tflops: float | None = None

    def __post_init__(self):
        _require(self.memory_gb > 0, f"gpu {self.name!r}: memory_gb must be positive, got {self.memory_gb}")
        _require(self.bf16_tflops > 0, f"gpu {self.name!r}: bf16_tflops must be positive, got {self.bf16_tflops}")
        _require(
            self.fp8_tflops is None or self.fp8_tflops > 0,
            f"gpu {self.name!r}: fp8_tflops must be positive, or None where there are no fp8 tensor cores",
        )

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s for the matmul precision."""
        if precision == "bf16":
            return self.bf16_tflops * 1e12
        if precision == "fp8":
            if self.fp8_tflops is None:
                raise ValueError(
                    f"gpu {self.name!r} has no fp8 tensor cores; use precision 'bf16' "
                    "or give its fp8 peak (--gpu-fp8-tflops)"
                )
            return self.fp8_tflops * 1e12
        raise ValueError(f"precision {precision!r} is unknown; use one of {', '.join(PRECISIONS)}")


PRECISIONS = ("bf16", "fp8")

# Dense peaks from NVIDIA's data sheets (their headline numbers assume 2:4 sparsity; these
# are half of those). GeForce cards accumulate in f32 at half rate, which training uses.
ACCELERATORS: dict[str, Accelerator] = {
    gpu.name: gpu
    for gpu in [
        Accelerator("h100", 80, 989, 1979),  # H100 SXM5 80 GB
        Accelerator("h100-pcie", 80, 756, 1513),  # H100 PCIe 80 GB
        Accelerator("h200", 141, 989, 1979),  # H200 SXM: H100's compute, more HBM3e
        Accelerator("a100-40gb", 40, 312),  # A100 SXM4: no fp8
        Accelerator("a100-80gb", 80, 312),
        Accelerator("b200", 180, 2250, 4500),  # HGX/DGX B200: 1,440 GB over 8 GPUs
        Accelerator("l40s", 48, 362, 733),
        Accelerator("rtx4090", 24, 165, 330),  # with f32 accumulate (Ada whitepaper)
    ]
}


def accelerator(
    name: str,
    *,
    memory_gb: float | None = None,
    bf16_tflops: float | None = None,
    fp8_tflops: float | None = None,
) -> Accelerator:
    """A GPU from the table, with any number overridden; an unknown name needs at least
    its memory and bf16 peak, which makes a custom accelerator."""
    overrides = {
        key: value
        for key, value in dict(memory_gb=memory_gb, bf16_tflops=bf16_tflops, fp8_tflops=fp8_tflops).items()
        if value is not None
    }
    if name in ACCELERATORS:
        return dataclasses.replace(ACCELERATORS[name], **overrides)
    if memory_gb is None or bf16_tflops is None:
        raise ValueError(
            f"gpu {name!r} is unknown; use one of {', '.join(ACCELERATORS)}, or describe it "
            "with its memory and bf16 peak (--gpu-memory GB --gpu-tflops TFLOPS)"
        )
    return Accelerator(name, **overrides)


# ---------------------------------------------------------------------------------------
# What is trained, on what batch, on what cluster

METHODS = ("full", "lora", "qlora", "dora")
COMPARED = ("full", "lora", "qlora")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRADIENT_BYTES = {"bf16": 2, "fp32": 4}

# Bytes per parameter of weights in bf16: the compute copy of trainable weights, and
# frozen base weights for LoRA and DoRA.
BF16_BYTES = 2

# QLoRA's NF4 with double quantization: 4 bits per weight, plus one 8-bit absmax per block
# of 64 weights, plus one f32 constant per block of 256 absmaxes (Dettmers et al. 2023):
# 4 + 8/64 + 32/(64*256) = 4.127 bits = 0.516 bytes per parameter.
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8


@dataclass(frozen=True)
class Method:
    """How the weights are trained, and what each trainable parameter costs in memory.

    The defaults are mixed-precision AdamW (Micikevicius et al. 2018): a bf16 weight the
    matmuls read (2 B), its bf16 gradient (2 B; 4 B with `grad_dtype="fp32"`), an f32
    master copy the optimizer updates (4 B), and Adam's two f32 moments (8 B): 16 bytes
    per trainable parameter. (linnet keeps trainable weights in f32 and casts them on use,
    so its 16 bytes split as a 4 B weight, a 4 B gradient and 8 B of moments: same total.)
    """

    name: str = "full"
    rank: int = 16
    targets: tuple[str, ...] = LINEAR_NAMES
    optimizer_bytes: float = 8
    grad_dtype: str = "bf16"
    master_bytes: float = 4

    def __post_init__(self):
        _require(self.name in METHODS, f"method {self.name!r} is unknown; use one of {', '.join(METHODS)}")
        _require(self.rank >= 1, f"rank must be a positive integer, got {self.rank}")
        unknown = [t for t in self.targets if t not in LINEAR_NAMES]
        _require(
            bool(self.targets) and not unknown,
            f"targets {list(unknown or self.targets)} are not linear layers of a block; "
            f"use 'all-linear' or names from {', '.join(LINEAR_NAMES)}",
        )
        _require(self.optimizer_bytes >= 0, f"optimizer_bytes must be >= 0 (8 for AdamW), got {self.optimizer_bytes}")
        _require(
            self.grad_dtype in GRADIENT_BYTES,
            f"grad_dtype {self.grad_dtype!r} is unknown; use one of {', '.join(GRADIENT_BYTES)}",
        )
        _require(
            self.master_bytes >= 0, f"master_bytes must be >= 0 (4 for f32, 0 for none), got {self.master_bytes}"
        )

    @property
    def adapters(self) -> bool:
        """Whether the base is frozen and only low-rank adapters train."""
        return self.name != "full"

    @property
    def base_bytes(self) -> float:
        """Bytes per parameter of the frozen base (unused by full fine-tuning)."""
        return NF4_BYTES if self.name == "qlora" else BF16_BYTES

    @property
    def bytes_per_trainable(self) -> float:
        return BF16_BYTES + GRADIENT_BYTES[self.grad_dtype] + self.master_bytes + self.optimizer_bytes


# A loss computed a block of rows at a time holds one block of f32 logits, not the whole
# [positions, vocab] matrix: 1 GiB on accelerators, linnet.torch.losses.BLOCK_BYTES (a test keeps them equal).
LOSS_BLOCK_BYTES = 2**30


@dataclass(frozen=True)
class Batch:
    """What one GPU runs per micro-step."""

    seq: int = 4096
    micro_batch: int = 1
    checkpointing: bool = True
    chunked_loss: bool = False

    def __post_init__(self):
        _require(self.seq >= 1, f"seq must be a positive number of tokens, got {self.seq}")
        _require(self.micro_batch >= 1, f"micro_batch must be a positive number of sequences, got {self.micro_batch}")


# Which states each sharding stage splits over the data-parallel GPUs (Rajbhandari et al.
# 2020): ZeRO-1 the optimizer (with its f32 master copy), ZeRO-2 also the gradients,
# ZeRO-3 / FSDP also the weights. Activations are never split: each GPU runs its own batch.
SHARDED_STATES: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "zero1": frozenset({"master", "optimizer"}),
    "zero2": frozenset({"master", "optimizer", "gradients"}),
    "fsdp": frozenset({"master", "optimizer", "gradients", "weights"}),
}


@dataclass(frozen=True)
class Cluster:
    """The GPUs a run rents and how well it uses them.

    `usable` is the share of each GPU's memory a run can fill: the CUDA context, the caching
    allocator's fragmentation and communication buffers take the rest. 0.9 is the value
    that reproduces the seed's minimum of 18 H100s for full fine-tuning of a 70B (with all
    80 GB usable the arithmetic gives 16; any share from 0.892 to 0.937 gives 18).
    `mfu` defaults to 0.35, the low end of the 35-50% BF16 MFU that good large dense runs
    reach on H100; small models and adapters usually reach less.
    """

    gpu: Accelerator = ACCELERATORS["h100"]
    gpus: int = 1
    shard: str = "none"
    usable: float = 0.9
    precision: str = "bf16"
    mfu: float = 0.35
    price: float | None = None

    def __post_init__(self):
        _require(self.gpus >= 1, f"gpus must be a positive integer, got {self.gpus}")
        _require(
            self.shard in SHARDED_STATES, f"shard {self.shard!r} is unknown; use one of {', '.join(SHARDED_STATES)}"
        )
        _require(0 < self.usable <= 1, f"usable must be a fraction in (0, 1] of GPU memory, got {self.usable}")
        _require(0 < self.mfu <= 1, f"mfu must be in (0, 1], got {self.mfu}; pass a fraction such as 0.35 for 35%")
        _require(self.price is None or self.price >= 0, f"price must be >= 0 dollars per GPU-hour, got {self.price}")
        self.gpu.peak_flops(self.precision)  # fails now, not halfway through a plan

    @property
    def usable_bytes(self) -> float:
        return self.usable * self.gpu.memory_gb * GB

    @property
    def peak_flops(self) -> float:
        return self.gpu.peak_flops(self.precision)


# ---------------------------------------------------------------------------------------
# Memory


def trainable_params(card: cards.Card, method: Method) -> int:
    """Parameters the optimizer updates.

    Full fine-tuning trains every parameter. LoRA replaces the update of each targeted
    d_out x d_in matrix by B A with A: r x d_in and B: d_out x r, so it trains
    r (d_in + d_out) per matrix (Hu et al. 2021). DoRA adds a magnitude per output row
    of each targeted matrix (Liu et al. 2024). QLoRA trains the same adapters as LoRA.
    """
    if not method.adapters:
        return card.params()
    shapes = [shape for path, shape in card.linear_shapes().items() if path.rsplit(".", 1)[-1] in method.targets]
    per_block = sum(method.rank * (d_out + d_in) for d_out, d_in in shapes)
    if method.name == "dora":
        per_block += sum(d_out for d_out, _ in shapes)
    return card.layers * per_block


@dataclass(frozen=True)
class States:
    """Bytes of weights, gradients, f32 master weights and optimizer state on one GPU."""

    weights: float
    gradients: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master + self.optimizer


def state_bytes(params: int, trainable: int, method: Method, shard: str = "none", gpus: int = 1) -> States:
    """Bytes of model and optimizer state per GPU.

    Trainable parameters cost `method.bytes_per_trainable` (16 B for mixed-precision
    AdamW: 2 + 2 + 4 + 8). Adapter methods keep the whole base frozen: its parameters
    need no gradient, master copy or optimizer moments, which removes 14 of those 16
    bytes (2 B/param left in bf16, 0.516 B/param in QLoRA's NF4; every parameter is
    counted at that rate, embeddings and output head included, as the seed's table does:
    bitsandbytes leaves those two in bf16, 1.5 B/param more for them). `shard` splits the
    states over `gpus` data-parallel ranks as in SHARDED_STATES.
    """
    frozen = params if method.adapters else 0
    whole = {
        "weights": method.base_bytes * frozen + BF16_BYTES * trainable,
        "gradients": GRADIENT_BYTES[method.grad_dtype] * trainable,
        "master": method.master_bytes * trainable,
        "optimizer": method.optimizer_bytes * trainable,
    }
    split = SHARDED_STATES[shard]
    return States(**{name: value / gpus if name in split else value for name, value in whole.items()})


def block_activation_bytes(hidden: int, seq: int, micro_batch: int) -> float:
    """Bytes one decoder block keeps for its backward pass: 34 s b d in bf16.

    Korthikanti et al. 2022 count s b d (34 + 5 a s / d) bytes per transformer layer; the
    5 a s^2 b attention-score term vanishes with FlashAttention, which recomputes the scores
    in backward. The 34 is their GPT block's (4d MLP, full-width K/V); a Llama block with
    GQA and a SwiGLU MLP keeps a somewhat different amount, and we keep their published
    constant, as the seed does.
    """
    return 34 * seq * micro_batch * hidden


def logits_bytes(vocab: int, seq: int, micro_batch: int, chunked_loss: bool = False) -> float:
    """The f32 logits of the loss: s b V 4 bytes (2.1 GB for 4096 tokens of a 128K vocab),
    or one block of LOSS_BLOCK_BYTES when the loss runs a block of rows at a time."""
    whole = 4 * seq * micro_batch * vocab
    return min(whole, LOSS_BLOCK_BYTES) if chunked_loss else whole


def activation_bytes(layers: int, hidden: int, vocab: int, batch: Batch) -> float:
    """Activation bytes per GPU at the peak of the backward pass, logits included.

    Without checkpointing every block keeps 34 s b d. With checkpointing each block keeps
    only its bf16 input, 2 s b d, and recomputes the rest during backward, so one block's
    34 s b d is live on top of the L inputs; without that block our totals would fall
    0.6 GB (8B) and 1.1 GB (70B) below the seed's with-activations column.
    Adapters' own activations, r values per token and adapted matrix, are left out: well
    under 1% of a block's.
    """
    tokens = batch.seq * batch.micro_batch
    block = block_activation_bytes(hidden, batch.seq, batch.micro_batch)
    blocks = layers * 2 * tokens * hidden + block if batch.checkpointing else layers * block
    return blocks + logits_bytes(vocab, batch.seq, batch.micro_batch, batch.chunked_loss)


GPUS_PER_NODE = 8  # an HGX / DGX node


def min_gpus(states: float, activations: float, usable_bytes: float) -> int | None:
    """Fewest GPUs that hold a run with every state sharded (FSDP / ZeRO-3): the smallest
    n with states / n + activations <= usable. Activations do not shrink with n (each GPU
    runs its own micro-batch), so None when they alone overflow one GPU."""
    room = usable_bytes - activations
    if room <= 0:
        return None
    return max(1, math.ceil(states / room))


# ---------------------------------------------------------------------------------------
# Compute and cost


def training_flops(params: float, tokens: float, frozen_base: bool = False) -> float:
    """FLOPs of training `params` parameters on `tokens` tokens.

    A forward pass costs 2N FLOPs per token (a multiply and an add per parameter); the
    backward pass 4N: 2N for the gradients with respect to the activations and 2N for
    those with respect to the weights. Hence 6ND (Kaplan et al. 2020). A frozen base
    needs no weight gradients, so LoRA, QLoRA and DoRA cost about 4ND (the adapters' own
    FLOPs are under 1%; QLoRA's dequantization shows up as lower MFU, not more FLOPs).
    Attention's 12 L d s per token is left out: small until the context is long.
    """
    return (4 if frozen_base else 6) * params * tokens


def gpu_hours(flops: float, peak_flops: float, mfu: float) -> float:
    """GPU-hours at `mfu` of a dense peak. MFU counts model FLOPs (6ND), so the forward
    pass that activation checkpointing recomputes lowers MFU instead of adding FLOPs."""
    return flops / (peak_flops * mfu) / 3600


def wall_days(gpu_hours: float, gpus: int) -> float:
    """Days of wall-clock time for `gpu_hours` spread evenly over `gpus` GPUs."""
    return gpu_hours / gpus / 24


def chinchilla_tokens(params: float) -> float:
    """Compute-optimal pretraining tokens: about 20 per parameter (Hoffmann et al. 2022,
    who found loss for a fixed 6ND budget lowest with N and D scaled alike)."""
    return 20 * params


def train_tokens(examples: int, tokens_per_example: float, epochs: float = 1) -> float:
    """Tokens a fine-tune trains on: examples x average tokens per example x epochs."""
    return examples * tokens_per_example * epochs


@dataclass(frozen=True)
class Compute:
    """What training on `tokens` tokens costs."""

    tokens: float
    flops: float
    gpu_hours: float
    days: float
    cost: float | None  # dollars, None without a price per GPU-hour


def compute_cost(params: float, tokens: float, method: Method, cluster: Cluster) -> Compute:
    """FLOPs, GPU-hours, wall time and dollars of training on `tokens` tokens."""
    flops = training_flops(params, tokens, frozen_base=method.adapters)
    hours = gpu_hours(flops, cluster.peak_flops, cluster.mfu)
    cost = None if cluster.price is None else hours * cluster.price
    return Compute(tokens, flops, hours, wall_days(hours, cluster.gpus), cost)


# ---------------------------------------------------------------------------------------
# A plan


@dataclass(frozen=True)
class Plan:
    """Memory per GPU and, given a token count, compute and cost of one run."""

    model: str
    params: int
    trainable: int
    method: Method
    batch: Batch
    cluster: Cluster
    states: States  # per GPU, split as cluster.shard says over cluster.gpus
    activations_checkpointed: float
    activations_uncheckpointed: float
    logits: float  # included in both activation figures
    min_gpus: int | None  # with every state sharded; None: activations alone overflow a GPU
    compute: Compute | None

    @property
    def activations(self) -> float:
        """Activation bytes with checkpointing as the batch chose it."""
        return self.activations_checkpointed if self.batch.checkpointing else self.activations_uncheckpointed

    @property
    def total(self) -> float:
        return self.states.total + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.cluster.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        """Every input and result as JSON-ready data; bytes are plain bytes."""
        data = dataclasses.asdict(self)
        data["states"]["total"] = self.states.total
        data.update(activations=self.activations, total=self.total, fits=self.fits,
                    usable=self.cluster.usable_bytes)
        return data


def estimate(
    card: cards.Card | str,
    method: Method = Method(),
    batch: Batch = Batch(),
    cluster: Cluster = Cluster(),
    tokens: float | str | None = None,
) -> Plan:
    """Plan a run of `card` (a Card, registered name or model directory). `tokens` is the
    training token count, "chinchilla" for 20 per parameter, or None for memory only."""
    card = cards.resolve(card)
    params = card.params()
    trainable = trainable_params(card, method)
    activations = {
        flag: activation_bytes(card.layers, card.hidden, card.vocab, dataclasses.replace(batch, checkpointing=flag))
        for flag in (True, False)
    }
    if tokens == "chinchilla":
        tokens = chinchilla_tokens(params)
    _require(
        tokens is None or (not isinstance(tokens, str) and tokens > 0),
        f"tokens must be a positive count such as 12e6, or 'chinchilla'; got {tokens!r}",
    )
    return Plan(
        model=card.name,
        params=params,
        trainable=trainable,
        method=method,
        batch=batch,
        cluster=cluster,
        states=state_bytes(params, trainable, method, cluster.shard, cluster.gpus),
        activations_checkpointed=activations[True],
        activations_uncheckpointed=activations[False],
        logits=logits_bytes(card.vocab, batch.seq, batch.micro_batch, batch.chunked_loss),
        min_gpus=min_gpus(
            state_bytes(params, trainable, method).total, activations[batch.checkpointing], cluster.usable_bytes
        ),
        compute=None if tokens is None else compute_cost(params, tokens, method, cluster),
    )


def compare(
    card: cards.Card | str,
    method: Method = Method(),
    batch: Batch = Batch(),
    cluster: Cluster = Cluster(),
    tokens: float | str | None = None,
    names: Sequence[str] = COMPARED,
) -> list[Plan]:
    """The same run planned with each method in `names` (rank, targets and optimizer
    taken from `method`)."""
    card = cards.resolve(card)
    return [estimate(card, dataclasses.replace(method, name=name), batch, cluster, tokens) for name in names]


# ---------------------------------------------------------------------------------------
# Settings: the flags by their Python names; a run config will map onto the same names.

_GPU_SETTINGS = {"gpu_memory": "memory_gb", "gpu_tflops": "bf16_tflops", "gpu_fp8_tflops": "fp8_tflops"}


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def plan_inputs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `estimate` from flat settings named as `linnet plan`'s flags
    (method, rank, targets, seq, micro_batch, gpu, gpu_memory, gpus, shard, mfu, price,
    tokens, ...). A missing or None value takes the default."""
    given = {key: value for key, value in settings.items() if value is not None}
    method_keys = _field_names(Method) - {"name"} | {"method"}
    batch_keys = _field_names(Batch)
    cluster_keys = _field_names(Cluster) - {"gpu"}
    known = method_keys | batch_keys | cluster_keys | set(_GPU_SETTINGS) | {"gpu", "tokens"}
    unknown = sorted(set(given) - known)
    _require(not unknown, f"unknown plan settings {unknown}; known: {', '.join(sorted(known))}")
    costing = sorted({"mfu", "precision", "price"} & set(given))
    _require(
        "tokens" in given or not costing,
        f"{', '.join(costing)} only matter for a token count; add tokens (--tokens 12e6, or chinchilla)",
    )
    if "targets" in given:
        given["targets"] = _targets(given["targets"])
    method = Method(**{("name" if key == "method" else key): given[key] for key in method_keys & set(given)})
    gpu = accelerator(
        given.get("gpu", Cluster().gpu.name),
        **{_GPU_SETTINGS[key]: given[key] for key in set(_GPU_SETTINGS) & set(given)},
    )
    return dict(
        method=method,
        batch=Batch(**{key: given[key] for key in batch_keys & set(given)}),
        cluster=Cluster(gpu=gpu, **{key: given[key] for key in cluster_keys & set(given)}),
        tokens=given.get("tokens"),
    )


def _targets(value: str | Sequence[str]) -> tuple[str, ...]:
    """'all-linear' (PEFT's spelling), 'q_proj,v_proj', or a list of names."""
    if value == "all-linear":
        return LINEAR_NAMES
    names = value.split(",") if isinstance(value, str) else value
    return tuple(name.strip() for name in names if name.strip())


# ---------------------------------------------------------------------------------------
# Rendering


def _gb(n: float) -> str:
    v = n / GB
    if v >= 0.01:
        return f"{v:,.0f} GB" if v >= 1000 else f"{v:.1f} GB" if v >= 1 else f"{v:.2f} GB"
    return f"{n / 1e6:.3g} MB"  # tiny debug cards


def _count(n: float) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:g}"


def _sci(x: float) -> str:
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _duration(days: float) -> str:
    for unit, per_day in (("days", 1), ("hours", 24), ("minutes", 24 * 60)):
        if days * per_day >= 1:
            return f"{days * per_day:.3g} {unit}"
    return f"{days * 86400:.3g} seconds"


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _money(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:.2f}"


def _gpu_count(n: int | None) -> str:
    if n is None:
        return "none: activations overflow one GPU"
    nodes = math.ceil(n / GPUS_PER_NODE)
    return f"{n} ({nodes} nodes of {GPUS_PER_NODE})" if nodes > 1 else str(n)


def _rows(plans: Sequence[Plan]) -> list[tuple[str, list[str]]]:
    """(label, one value per plan) for the table."""
    first = plans[0]
    chosen = "checkpointing" if first.batch.checkpointing else "no checkpointing"
    memory = {
        "parameters": lambda p: _count(p.params),
        "trainable": lambda p: f"{_count(p.trainable)} ({p.trainable / p.params:.1%})",
        "weights": lambda p: _gb(p.states.weights),
        "gradients": lambda p: _gb(p.states.gradients),
        "master weights": lambda p: _gb(p.states.master),
        "optimizer state": lambda p: _gb(p.states.optimizer),
        "states": lambda p: _gb(p.states.total),
        "activations, checkpointing": lambda p: _gb(p.activations_checkpointed),
        "activations, no checkpointing": lambda p: _gb(p.activations_uncheckpointed),
        f"total per GPU ({chosen})": lambda p: _gb(p.total),
        f"fits {_gb(first.cluster.usable_bytes)} usable": lambda p: "yes" if p.fits else "no",
        f"minimum {first.cluster.gpu.name} GPUs (FSDP)": lambda p: _gpu_count(p.min_gpus),
    }
    compute = {
        "tokens": lambda c: _count(c.tokens),
        "FLOPs": lambda c: _sci(c.flops),
        "GPU-hours": lambda c: f"{c.gpu_hours:,.0f}" if c.gpu_hours >= 100 else f"{c.gpu_hours:.3g}",
        f"wall time on {_gpus(first.cluster.gpus)}": lambda c: _duration(c.days),
    }
    if first.cluster.price is not None:
        compute["cost"] = lambda c: _money(c.cost)
    rows = [(label, [value(p) for p in plans]) for label, value in memory.items()]
    if first.compute is not None:
        rows += [(label, [value(p.compute) for p in plans]) for label, value in compute.items()]
    return rows


def _assumptions(plans: Sequence[Plan]) -> list[str]:
    """The conventions behind the numbers, filled in with this plan's values."""
    first = plans[0]
    method, batch, cluster = first.method, first.batch, first.cluster
    names = {p.method.name for p in plans}
    adapted = [p.method.name for p in plans if p.method.adapters]
    lines = [
        "GB = 10^9 bytes (MB = 10^6); memory is per GPU",
        f"each trainable parameter: {BF16_BYTES} B bf16 weight + {GRADIENT_BYTES[method.grad_dtype]} B "
        f"{method.grad_dtype} gradient + {method.master_bytes:g} B f32 master + {method.optimizer_bytes:g} B "
        f"optimizer state = {method.bytes_per_trainable:g} B",
    ]
    if adapted:
        lines.append(
            f"{', '.join(adapted)}: base frozen (no gradient, master or optimizer state); rank {method.rank} "
            f"adapters on {', '.join(method.targets)} in every block, r·(d_in + d_out) parameters each"
        )
    if names & {"lora", "dora"}:
        lines.append(f"frozen base in bf16: {BF16_BYTES} B per parameter")
    if "qlora" in names:
        lines.append(
            f"qlora base in NF4 with double quantization: 4 + 8/64 + 32/(64·256) bits = {NF4_BYTES:.3f} B "
            "per parameter, embeddings and head included"
        )
    if "dora" in names:
        lines.append("dora also trains one magnitude per output row of each adapted matrix")
    lines += [
        "activations in bf16: 34·s·b·d bytes per block (Korthikanti et al., FlashAttention); with "
        f"checkpointing each block keeps its 2·s·b·d input and one block is recomputed; s = {batch.seq}, "
        f"b = {batch.micro_batch}",
        f"logits in f32: s·b·V·4 bytes = {_gb(first.logits)}"
        + (" (one block of the chunked loss)" if batch.chunked_loss else " (--chunked-loss holds one 1 GiB block)"),
    ]
    split = [name for name in dataclasses.asdict(first.states) if name in SHARDED_STATES[cluster.shard]]
    lines.append(
        f"--shard {cluster.shard}: {', '.join(split)} split over {_gpus(cluster.gpus)}; activations on every GPU"
        if split
        else "states not sharded: every GPU holds all of them (--shard zero1, zero2 or fsdp splits them)"
    )
    lines.append(
        f"usable memory: {cluster.usable:.0%} of {cluster.gpu.memory_gb:g} GB per {cluster.gpu.name} (CUDA "
        "context, allocator fragmentation, communication buffers); minimum GPUs shards every state (FSDP)"
    )
    if first.compute is not None:
        lines += [
            "FLOPs = 6·N·D when the base trains, 4·N·D when it is frozen (no weight gradients in backward); "
            "N counts every parameter",
            f"GPU-hours = FLOPs / ({cluster.peak_flops / 1e12:g} TFLOP/s dense {cluster.precision} × "
            f"{cluster.mfu:.0%} MFU) / 3600; MFU counts model FLOPs, so recomputation lowers MFU",
            f"wall time = GPU-hours / {_gpus(cluster.gpus)}"
            + ("" if cluster.price is None else f"; cost = GPU-hours × ${cluster.price:,.2f}, compute only"),
        ]
    return lines


def render(plans: Sequence[Plan]) -> str:
    """A table with one column per plan, and the assumptions under it."""
    first = plans[0]
    cluster = first.cluster
    title = (
        f"{first.model}: seq {first.batch.seq} × micro-batch {first.batch.micro_batch} "
        f"on {cluster.gpus} × {cluster.gpu.name}"
    )
    rows = _rows(plans)
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(p.method.name), *(len(values[i]) for _, values in rows)) for i, p in enumerate(plans)]

    def line(label: str, values: Sequence[str]) -> str:
        return f"{label:<{label_width}}" + "".join(f"  {value:>{width}}" for value, width in zip(values, widths))

    lines = [title, "", line("", [p.method.name for p in plans])] + [line(*row) for row in rows]
    lines += ["", "assumptions:"] + [f"  - {assumption}" for assumption in _assumptions(plans)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Command line


def _token_count(text: str) -> float | str:
    """'12e6', '12M', '15T' or 'chinchilla'."""
    if text == "chinchilla":
        return text
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper(), 1)
    try:
        return float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count; use e.g. 12e6, 12M, 15T or chinchilla"
        ) from None


def _parser() -> argparse.ArgumentParser:
    method, batch, cluster = Method(), Batch(), Cluster()
    parser = argparse.ArgumentParser(
        prog="linnet plan",
        description="Memory per GPU, minimum GPUs, FLOPs, GPU-hours and cost of a training run, "
        "from a model card, before anyone rents a GPU. Unset flags take the defaults shown.",
    )
    parser.add_argument(
        "card", nargs="?",
        help=f"a registered card ({', '.join(sorted(cards.REGISTRY))}) or a Hugging Face model directory",
    )
    parser.add_argument("--config", metavar="YAML",
                        help="plan the run a `linnet sft` / `dpo` / `grpo` config describes (flags override it)")

    what = parser.add_argument_group("what is trained").add_argument
    what("--method", choices=METHODS, help=f"full fine-tuning or an adapter method (default {method.name})")
    what("--rank", type=int, metavar="R", help=f"adapter rank r (default {method.rank})")
    what("--targets", metavar="NAMES",
         help="adapted linear layers: all-linear, or names such as q_proj,v_proj (default all-linear)")
    what("--optimizer-bytes", type=float, metavar="B",
         help="optimizer state bytes per trainable parameter: 8 for AdamW's two f32 moments, 2 for 8-bit "
         f"Adam, 0 for plain SGD (default {method.optimizer_bytes:g})")
    what("--grad-dtype", choices=list(GRADIENT_BYTES),
         help=f"gradient dtype (default {method.grad_dtype}; fp32 when gradients accumulate in f32)")
    what("--master-bytes", type=float, metavar="B",
         help="master weight bytes per trainable parameter: 4 for an f32 copy, 0 for pure bf16 training "
         f"(default {method.master_bytes:g})")

    run = parser.add_argument_group("batch").add_argument
    run("--seq", type=int, metavar="TOKENS", help=f"tokens per sequence (default {batch.seq})")
    run("--micro-batch", type=int, metavar="N",
        help=f"sequences per GPU per micro-step (default {batch.micro_batch})")
    run("--checkpointing", action=argparse.BooleanOptionalAction,
        help="activation checkpointing: keep each block's input, recompute the rest (default on)")
    run("--chunked-loss", action=argparse.BooleanOptionalAction,
        help="compute the loss a block of rows at a time instead of holding every logit (default off)")

    hardware = parser.add_argument_group("hardware").add_argument
    hardware("--gpu", metavar="NAME",
             help=f"accelerator: {', '.join(ACCELERATORS)}; any other name needs --gpu-memory and "
             f"--gpu-tflops (default {cluster.gpu.name})")
    hardware("--gpu-memory", type=float, metavar="GB", help="memory per GPU in GB (10^9 bytes), overriding the table")
    hardware("--gpu-tflops", type=float, metavar="TFLOPS", help="dense bf16 peak in TFLOP/s, overriding the table")
    hardware("--gpu-fp8-tflops", type=float, metavar="TFLOPS", help="dense fp8 peak in TFLOP/s, overriding the table")
    hardware("--gpus", type=int, metavar="N", help=f"GPUs the run uses, data-parallel (default {cluster.gpus})")
    hardware("--shard", choices=list(SHARDED_STATES),
             help=f"which states split over the GPUs: ZeRO-1, ZeRO-2 or FSDP (default {cluster.shard})")
    hardware("--usable", type=float, metavar="FRACTION",
             help=f"share of GPU memory a run can fill (default {cluster.usable:g})")

    cost = parser.add_argument_group("compute and cost").add_argument
    cost("--tokens", type=_token_count, metavar="N",
         help="training tokens (12e6, 12M, 15T), or chinchilla for 20 per parameter; adds FLOPs, "
         "GPU-hours and wall time")
    cost("--mfu", type=float, metavar="FRACTION",
         help=f"model FLOPs utilization, a fraction in (0, 1] (default {cluster.mfu:g})")
    cost("--precision", choices=PRECISIONS,
         help=f"matmul precision whose peak the MFU applies to (default {cluster.precision})")
    cost("--price", type=float, metavar="DOLLARS", help="dollars per GPU-hour; adds a cost row")

    output = parser.add_argument_group("output").add_argument
    output("--compare", action="store_true", help="full, lora and qlora side by side (and --method if another)")
    output("--json", action="store_true", help="print JSON for scripts (bytes in bytes) instead of the table")
    return parser


def settings_from_run_config(path: str) -> dict[str, Any]:
    """The card and plan settings of a `linnet sft` / `dpo` / `grpo` YAML, read as plain
    data (no torch): LoRA or full, rank, adapted layers, the packed row as the sequence,
    linnet's blockwise loss, and the token count when the steps are fixed."""
    import fnmatch

    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    model, lora, data = config.get("model", {}), config.get("lora", {}), config.get("data", {})
    training = config.get("training", {})
    settings: dict[str, Any] = {"card": model.get("card", "debug"), "chunked_loss": True, "checkpointing": False,
                                "micro_batch": 1, "seq": data.get("tokens", 2048)}
    if lora.get("enabled", True):
        settings["method"] = "lora"
        settings["rank"] = lora.get("rank", 16)
        patterns = lora.get("targets", ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"])
        patterns = [patterns] if isinstance(patterns, str) else patterns
        parents = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
        settings["targets"] = [
            name for name in LINEAR_NAMES
            if any(fnmatch.fnmatch(f"model.layers.0.{parents.get(name, 'mlp')}.{name}{end}", pattern)
                   for pattern in patterns for end in ("", ".weight"))
        ]
    else:
        settings["method"] = "full"
    if training.get("steps"):
        settings["tokens"] = training["steps"] * training.get("accumulate", 1) * settings["seq"]
    if "grpo" in config:  # the grpo defaults of linnet.reinforce.GRPOSettings
        g = config["grpo"] or {}
        settings["sampling_rows"] = g.get("prompts_per_step", 8) * g.get("group", 8)
    return settings


def sampling_memory(card: cards.Card, rows: int, slots: int) -> dict[str, float]:
    """Bytes GRPO's sampling engine holds beside training: its own copy of the weights in
    bf16, and a KV cache of `rows` completions x `slots` positions (keys and values, every
    layer, bf16). Not part of `estimate`'s totals."""
    cache = rows * slots * card.layers * 2 * card.kv_heads * card.head_dim * BF16_BYTES
    return {"rows": rows, "slots": slots, "weights_bytes": card.params() * BF16_BYTES, "cache_bytes": cache}


def cli(argv: list[str] | None = None) -> int:
    """`linnet plan CARD [flags]` or `linnet plan --config RUN.yaml`: print the plan; 2 on bad input."""
    args = vars(_parser().parse_args(argv))
    card, as_json, side_by_side = args.pop("card"), args.pop("json"), args.pop("compare")
    config = args.pop("config")
    sampling_rows = None
    try:
        if config is not None:
            settings = settings_from_run_config(config)
            config_card = settings.pop("card")
            sampling_rows = settings.pop("sampling_rows", None)
            card = card or config_card
            args = {**settings, **{k: v for k, v in args.items() if v is not None}}
        if card is None:
            raise ValueError("give a CARD, or --config RUN.yaml")
        inputs = plan_inputs(args)
        if side_by_side:
            names = list(dict.fromkeys((*COMPARED, inputs["method"].name)))
            plans = compare(card, **inputs, names=names)
        else:
            plans = [estimate(card, **inputs)]
        # a completion and its prompt fit one packed row, so the cache needs at most seq slots
        sampling = None if sampling_rows is None else sampling_memory(
            cards.resolve(card), sampling_rows, inputs["batch"].seq)
    except (ValueError, OSError) as error:
        print(f"linnet plan: error: {error}", file=sys.stderr)
        return 2
    if as_json:
        data = [p.to_dict() for p in plans]
        data = data if side_by_side else data[0]
        if sampling is not None:
            data = {"plans": data, "sampling": sampling} if side_by_side else {**data, "sampling": sampling}
        print(json.dumps(data, indent=2))
    else:
        print(render(plans))
        if sampling is not None:
            print(f"GRPO also holds its sampling engine, not in the totals above: a bf16 copy of the weights "
                  f"({_gb(sampling['weights_bytes'])}) and a KV cache of {sampling['rows']} completions x at most "
                  f"{sampling['slots']:,} positions ({_gb(sampling['cache_bytes'])}).")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
