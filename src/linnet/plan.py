"""The planner: memory, FLOPs, GPU-hours and cost of a training run, before renting a GPU.

    linnet plan llama-3.1-8b-instruct --method lora --rank 16 --seq 4096 \\
        --tokens 12e6 --mfu 0.35 --gpus 8 --gpu h100 --price 2.5      # linnet.commands.plan
    plan = estimate("llama-3.1-8b-instruct", Method("lora", rank=16), Batch(seq=4096),
                    Cluster(accelerator("h100"), gpus=8, mfu=0.35, price=2.5), tokens=12e6)

Pure arithmetic over a card's shape: stdlib only, no torch, so it answers in well under a
second on any machine. Every convention the numbers rest on (bytes per parameter, the
activation formula, usable memory, 6ND) is derived in the docstring of the function that
uses it, and `linnet plan` lists the ones a plan used under its table.

Units: bytes are plain bytes, and GB in the output is 10^9 bytes (as accelerator data
sheets and the seed's tables count them), not GiB.
"""

from __future__ import annotations

import dataclasses
import math
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


def sampling_memory(card: cards.Card, rows: int, slots: int) -> dict[str, float]:
    """Bytes GRPO's sampling engine holds beside training: its own copy of the weights in
    bf16, and a KV cache of `rows` completions x `slots` positions (keys and values, every
    layer, bf16). Not part of `estimate`'s totals."""
    cache = rows * slots * card.layers * 2 * card.kv_heads * card.head_dim * BF16_BYTES
    return {"rows": rows, "slots": slots, "weights_bytes": card.params() * BF16_BYTES, "cache_bytes": cache}
