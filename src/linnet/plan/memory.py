"""What one training step holds in memory, phase by phase: the planner's memory arithmetic
(`linnet.plan` builds plans on it and re-exports every name here).

    memory = step_memory(card, Method("lora", dtype="f32"), Workload(tokens=4096, device="cpu"))
    memory.peak, memory.phases["forward"], memory.activations.kept

A run is described by a `Method` (what trains, in which dtype, with which optimizer) and a
`Workload` (tokens per micro-step, checkpointing, the loss, the device). The counts describe
linnet's own step (linnet.torch.model, linnet.torch.losses, linnet.train): the tensors its
decoder keeps for backward, its chunked loss's working set, the gradients as backward
makes them and AdamW's temporaries. Every count is derived in the docstring of the function
that makes it, and `bench/plan_vs_measured.py` measures them. Stdlib only, no torch.

Shapes in the counts: s·b tokens per micro-step, d hidden, F intermediate, q = heads·head_dim,
k = kv_heads·head_dim, V vocabulary, L layers, c bytes of the compute dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from linnet import cards
from linnet.plan.experts import (
    EXPERT_NAMES,
    LINEAR_NAMES,
    adapted_experts,
    expert_adapter_params,
    expert_shapes,
    held_expert_params,
    moe_backward_bytes,
    moe_bytes_per_token,
)
from linnet.plan.parts import Part, _require, whole

METHODS = ("full", "lora", "qlora", "dora")
COMPARED = ("full", "lora", "qlora")
GRADIENT_BYTES = {"bf16": 2, "fp32": 4}
DTYPES = {"bf16": 2, "f32": 4}  # compute dtype -> bytes per value
DEVICES = ("gpu", "cpu")
CHECKPOINTING = ("full", "selective", "offload", "none")

# QLoRA's NF4 with double quantization: 4 bits per weight, plus one 8-bit absmax per block
# of 64 weights, plus one f32 constant per block of 256 absmaxes (Dettmers et al. 2023):
# 4 + 8/64 + 32/(64*256) = 4.127 bits = 0.516 bytes per parameter.
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8

# linnet.torch.losses' blocks (a test keeps them equal): 1 GiB of f32 logits a block on
# accelerators; on a CPU 16 MiB, but never fewer than 512 rows.
LOSS_BLOCK_BYTES = 2**30
CPU_LOSS_BLOCK_BYTES = 2**24
CPU_LOSS_MIN_ROWS = 512
# From this many rows a float32 loss on a CPU reorders a head of this many weights or more
# for oneDNN: a copy of it (linnet.torch.losses.REORDER_MIN_ROWS, REORDER_MIN_ELEMENTS).
CPU_REORDER_MIN_ROWS = 256
CPU_REORDER_MIN_ELEMENTS = 2**20


@dataclass(frozen=True)
class Method:
    """How the weights are trained, in which compute dtype, and what each trainable
    parameter costs.

    The defaults are mixed-precision AdamW as the seed counts it (Micikevicius et al.
    2018): a bf16 weight the matmuls read (2 B), its bf16 gradient (2 B; 4 B with
    `grad_dtype="fp32"`), an f32 master copy the optimizer updates (4 B) and Adam's two
    f32 moments (8 B): 16 bytes per trainable parameter. linnet keeps each trainable weight
    in f32 (the master), makes its gradient in f32 (`grad_dtype="fp32"`) and, computing in
    bf16, casts the weight to bf16 in every forward: that copy is the 2 B, and it lives
    until backward has used it. With `dtype="f32"` the matmuls read the f32 master itself,
    so there is no copy. Frozen parameters are stored in the compute dtype (QLoRA's block
    weights in NF4).
    """

    name: str = "full"
    rank: int = 16
    targets: tuple[str, ...] = LINEAR_NAMES
    optimizer_bytes: float = 8
    grad_dtype: str = "bf16"
    master_bytes: float = 4
    dtype: str = "bf16"

    def __post_init__(self):
        _require(self.name in METHODS, f"{{method}} {self.name!r} is unknown; use one of {', '.join(METHODS)}")
        _require(self.rank >= 1, f"{{rank}} must be a positive integer, got {self.rank}")
        unknown = [t for t in self.targets if t not in LINEAR_NAMES + EXPERT_NAMES]
        _require(
            bool(self.targets) and not unknown,
            f"{{targets}} {list(unknown or self.targets)} are not linear layers of a block; "
            f"use 'all-linear' or names from {', '.join(LINEAR_NAMES)} (a mixture of experts': gate_up_proj)",
        )
        _require(self.optimizer_bytes >= 0, f"{{optimizer_bytes}} must be >= 0 (8 for AdamW), got {self.optimizer_bytes}")
        _require(
            self.grad_dtype in GRADIENT_BYTES,
            f"{{grad_dtype}} {self.grad_dtype!r} is unknown; use one of {', '.join(GRADIENT_BYTES)}",
        )
        _require(
            self.master_bytes >= 0, f"{{master_bytes}} must be >= 0 (4 for f32, 0 for none), got {self.master_bytes}"
        )
        _require(self.dtype in DTYPES, f"{{dtype}} {self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")

    @property
    def adapters(self) -> bool:
        """Whether the base is frozen and only low-rank adapters train."""
        return self.name != "full"

    @property
    def compute_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def copy_bytes(self) -> float:
        """Bytes of the weight the matmuls read, per trainable parameter: a compute-dtype
        copy of the master; none when master and compute are both f32; without a master
        (master_bytes 0), the trained weight itself."""
        return 0 if self.master_bytes and self.dtype == "f32" else self.compute_bytes

    @property
    def bytes_per_trainable(self) -> float:
        return self.copy_bytes + GRADIENT_BYTES[self.grad_dtype] + self.master_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Workload:
    """What one GPU runs per micro-step, and how (not a batch of data: the shape of one).

    `tokens`: positions per row (a packed row's length, `pack(examples, tokens=)`);
    `micro_batch_size`: rows per micro-step. `activation_checkpointing`: "full" (or True)
    keeps each block's input and computes the block again in backward; "selective" also
    keeps attention's outputs; "offload" keeps the inputs in host memory (on a GPU: one
    block's input copied back at a time); "none" (or False) keeps every activation (as
    `nest.load(activation_checkpointing=)`). `chunked_loss`: linnet's loss, a block of rows
    at a time, instead of the whole f32 logits. `device`: "cpu" for linnet's CPU paths
    (16 MiB loss blocks; bf16 attention computed in f32; AdamW tensor by tensor); GPU counts
    and costs still come from the Cluster. `accumulate`: micro-steps per optimizer step;
    from the second on, the gradients of the earlier ones are live through the forward.
    `num_models`: packed decentralized training's whole models (and micro-batches) per GPU.
    `mlp_tile`: positions each block's MLP computes at a time, each tile computed again in
    backward (`Decoder.tile_mlp`); None: the whole micro-step at once.
    """

    tokens: int = 4096
    micro_batch_size: int = 1
    activation_checkpointing: bool | str = True
    chunked_loss: bool = False
    device: str = "gpu"
    accumulate: int = 1
    num_models: int = 1
    mlp_tile: int | None = None

    def __post_init__(self):
        _require(self.tokens >= 1, f"{{tokens}} must be a positive number of positions (a row's length), got {self.tokens}")
        _require(self.micro_batch_size >= 1,
                 f"{{micro_batch_size}} must be a positive number of rows, got {self.micro_batch_size}")
        mode = self.activation_checkpointing
        if isinstance(mode, bool):
            mode = "full" if mode else "none"
        _require(mode in CHECKPOINTING, f"{{activation_checkpointing}} {self.activation_checkpointing!r} is "
                                        f"unknown; use one of {', '.join(CHECKPOINTING)}")
        object.__setattr__(self, "activation_checkpointing", mode)
        _require(self.device in DEVICES, f"{{device}} {self.device!r} is unknown; use one of {', '.join(DEVICES)}")
        _require(self.accumulate >= 1, f"{{accumulate}} must be a positive number of micro-steps, got {self.accumulate}")
        _require(self.num_models >= 1, f"{{num_models}} must be a positive number of packed models, got {self.num_models}")
        _require(self.mlp_tile is None or self.mlp_tile >= 1,
                 f"{{mlp_tile}} must be a positive number of positions, got {self.mlp_tile}")

    @property
    def positions(self) -> int:
        """Positions per micro-step: tokens x micro_batch_size."""
        return self.tokens * self.micro_batch_size


# Which states each sharding stage splits over the data-parallel GPUs (Rajbhandari et al.
# 2020): ZeRO-1 the optimizer (with its f32 master copy), ZeRO-2 also the gradients,
# ZeRO-3 / FSDP also the weights. "zero" is torch's ZeroRedundancyOptimizer, what linnet's
# `training.shard: zero` runs: the optimizer state alone, every process keeping the whole f32
# trained parameters. Activations are never split: each GPU runs its own batch.
SHARDED_STATES: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "zero": frozenset({"optimizer"}),
    "zero1": frozenset({"master", "optimizer"}),
    "zero2": frozenset({"master", "optimizer", "gradients"}),
    "fsdp": frozenset({"master", "optimizer", "gradients", "weights"}),
}


# ---------------------------------------------------------------------------------------
# States


def trainable_params(card: cards.Card, method: Method, part: Part | None = None) -> int:
    """Parameters the optimizer updates (of `part`, default the whole model).

    Full fine-tuning trains every parameter. LoRA replaces the update of each targeted
    d_out x d_in matrix by B A with A: r x d_in and B: d_out x r, so it trains
    r (d_in + d_out) per matrix (Hu et al. 2021). DoRA adds a magnitude per output row
    of each targeted matrix (Liu et al. 2024). QLoRA trains the same adapters as LoRA. A
    mixture of experts' adapted stacked tensors train one pair an expert
    (linnet.plan.experts.expert_adapter_params).
    """
    part = part or whole(card)
    if not method.adapters:
        return part.params()
    shapes = _targeted(part.card, method)
    per_block = sum(method.rank * (d_out + d_in) for d_out, d_in in shapes)
    if method.name == "dora":
        per_block += sum(d_out for d_out, _ in shapes)
    return part.card.layers * (per_block + expert_adapter_params(part.card, method))


def _largest_trainable(part: Part, method: Method) -> int:
    """Values in the largest trainable tensor of a part (a mixture's stacked experts' tensors
    held, or their adapters, whole, among them)."""
    c, e = part.card, part.card.experts
    stacked = expert_shapes(c).items() if e is not None else ()
    if method.adapters:
        adapted = [e.count * max(shape) for name, shape in stacked if name in adapted_experts(e, method.targets)]
        return method.rank * max([max(shape) for shape in _targeted(c, method)] + adapted)
    held = 0 if e is None else e.count if part.experts_held is None else part.experts_held
    return max(c.vocab * c.hidden if part.embeds else 0, part.head_rows * c.hidden,
               *(o * i for o, i in c.linear_shapes().values()), *(held * o * i for _, (o, i) in stacked))


def _targeted(card: cards.Card, method: Method) -> list[tuple[int, int]]:
    return [shape for path, shape in card.linear_shapes().items() if path.rsplit(".", 1)[-1] in method.targets]


def quantized_params(card: cards.Card, method: Method, part: Part | None = None) -> int:
    """Frozen parameters QLoRA stores in NF4 (of `part`, default the whole model): every
    block's seven linear weights, whichever carry adapters (linnet.torch.loading.nf4_layout),
    in a mixture of experts its linear layers (attention, a shared expert) and the experts'
    stacked tensors (those held); embeddings, norms, routers and the head stay in the
    compute dtype. 0 for the other methods."""
    if method.name != "qlora":
        return 0
    part = part or whole(card)
    c = part.card
    return c.layers * (sum(o * i for o, i in c.linear_shapes().values()) + held_expert_params(c, part.experts_held))


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


def state_bytes(params: int, trainable: int, method: Method, shard: str = "none", gpus: int = 1,
                quantized: int = 0) -> States:
    """Bytes of model and optimizer state per GPU.

    Trainable parameters cost `method.bytes_per_trainable` (16 B for mixed-precision
    AdamW: 2 + 2 + 4 + 8). Adapter methods keep the whole base frozen: its parameters
    need no gradient, master copy or optimizer moments, so they cost the compute dtype's
    bytes (2 in bf16), except the `quantized` ones (QLoRA's block weights) at NF4_BYTES.
    `shard` splits the states over `gpus` data-parallel ranks as in SHARDED_STATES, except
    that linnet's fsdp leaves adapters whole on every GPU (FSDP ignores them): there it
    splits the frozen base alone.
    """
    frozen = params if method.adapters else 0
    base = method.compute_bytes * (frozen - quantized) + NF4_BYTES * quantized
    trained = {
        "weights": method.copy_bytes * trainable,
        "gradients": GRADIENT_BYTES[method.grad_dtype] * trainable,
        "master": method.master_bytes * trainable,
        "optimizer": method.optimizer_bytes * trainable,
    }
    split = SHARDED_STATES[shard]
    adapters_whole = method.adapters and shard == "fsdp"
    per_gpu = {name: value / gpus if name in split and not adapters_whole else value
               for name, value in trained.items()}
    per_gpu["weights"] += base / gpus if "weights" in split else base
    return States(**per_gpu)


def part_states(card: cards.Card, method: Method, part: Part, shard: str = "none", gpus: int = 1) -> States:
    """state_bytes of `part` with `shard` over `gpus`; a share of a mixture's experts that
    expert parallel gave it stays whole (linnet's fsdp shards the dense parts beside them)."""
    def states(p: Part, shard: str, gpus: int, less: Part | None = None) -> States:
        counts = [f(p) - (f(less) if less else 0) for f in (Part.params, lambda q: trainable_params(card, method, q),
                                                           lambda q: quantized_params(card, method, q))]
        return state_bytes(counts[0], counts[1], method, shard, gpus, counts[2])

    if not part.experts_held:
        return states(part, shard, gpus)
    dense = dataclasses.replace(part, experts_held=0)
    return States(*(a + b for a, b in zip(dataclasses.astuple(states(dense, shard, gpus)),
                                          dataclasses.astuple(states(part, "none", 1, dense)), strict=True)))


# ---------------------------------------------------------------------------------------
# Activations


def _norm_bytes(width: int, c: int, trains: bool, sequence: int = 1, read: bool = True) -> float:
    """Per token, what one of linnet's RMSNorms keeps: its input in f32 (4·width; in f32
    compute the input itself), 1/rms (4), its output (c·width, the next matmuls' input,
    where one of them trains or carries an adapter: `read`) and, when its weight trains,
    the normalised input (c·width) for that weight's gradient. With sequence parallel over
    `sequence` GPUs all but the output are a GPU's share of the positions; the output is
    gathered whole for the matmuls."""
    return (4 * width + 4 + c * width * trains) / sequence + c * width * read


def _untracked(card: cards.Card, method: Method, a: int) -> float:
    """Per token, what the first block keeps in `block_activation_bytes`' count but not
    when nothing before it trains (adapters: a frozen embedding): its first norm's input
    and 1/rms; with no adapter on q, k or v, attention's own tensors too (all but its
    output where o_proj's adapter reads it), and with none on o_proj either, the second
    norm's input and 1/rms (the residual stream takes no gradient before the MLP)."""
    d, q, kv = card.hidden, card.heads * card.head_dim, card.kv_heads * card.head_dim
    out = 4 * d + 4
    if not _reads(method, "q_proj", "k_proj", "v_proj"):
        out += a * (q + 2 * kv) + 4 * card.heads + (a * q if not _reads(method, "o_proj") else 0)
        out += 4 * (q + kv) + 4 * (card.heads + card.kv_heads) if card.qk_norm else 0
        out += 4 * d + 4 if not _reads(method, "o_proj") else 0
    return out


def _reads(method: Method, *names: str) -> bool:
    """Whether matmuls `names` keep their input for backward: their weights train, or one
    of them carries an adapter (a frozen weight's input gradient needs the weight alone)."""
    return not method.adapters or any(name in method.targets for name in names)


def block_activation_bytes(card: cards.Card, method: Method, workload: Workload, sequence: int = 1) -> float:
    """Bytes one of linnet's decoder blocks keeps for its backward pass, for s·b tokens.

    These are autograd's saved tensors in linnet's eager block (linnet.torch.model), per
    token: two RMSNorms (_norm_bytes, their outputs where the next matmuls read them:
    `_reads`); attention keeps q, k, v and its output (a·(2q + 2k), a = 4 where linnet runs
    attention in f32, which it does for bf16 on a CPU, else c), its log-sum-exp (4 per head)
    and, when a is not c, the output cast back (c·q) where o_proj reads it; the SwiGLU MLP
    keeps gate, up, silu(gate) and, where down_proj reads it, their product (4·c·F), or in
    tiles (`mlp_tile`) only its input, the norm's output. Each adapted matrix adds
    x·Aᵀ (c·r) and DoRA also the sum it rescales (c·d_out); Qwen3's qk-norm adds a norm
    per head of q and of k. A mixture of experts' MLP keeps its router's and its routed
    pairs' tensors instead (linnet.plan.experts.moe_bytes_per_token). For Llama 3 8B, bf16
    on a GPU, full fine-tuning: 49·d bytes a token (0.82 GB at 4,096 tokens). Korthikanti et
    al. (2022) count 34·d for a GPT block (a 4·d MLP, dropout masks, a bf16 LayerNorm
    input): not this block. `sequence`: the GPUs a sequence-parallel split shares the
    norms' positions among.
    """
    c = method.compute_bytes
    a = 4 if workload.device == "cpu" else c
    q, kv = card.heads * card.head_dim, card.kv_heads * card.head_dim
    trains = not method.adapters
    mlp = (moe_bytes_per_token(card, method) if card.experts is not None
           else (3 + _reads(method, "down_proj")) * c * card.intermediate)
    dense_mlp_reads = _reads(method, "gate_proj", "up_proj") or bool(workload.mlp_tile)  # tiles keep their input
    norms = _norm_bytes(card.hidden, c, trains, sequence, _reads(method, "q_proj", "k_proj", "v_proj")) \
        + _norm_bytes(card.hidden, c, trains, sequence, card.experts is not None or dense_mlp_reads)
    per_token = norms + a * (2 * q + 2 * kv) + 4 * card.heads + (c * q if a != c and _reads(method, "o_proj") else 0) \
        + (0 if workload.mlp_tile else mlp)
    if method.adapters:
        shapes = _targeted(card, method)
        per_token += c * method.rank * len(shapes) + (c * sum(o for o, _ in shapes) if method.name == "dora" else 0)
    if card.qk_norm:
        per_token += (4 + c * trains) * (q + kv) + 4 * (card.heads + card.kv_heads)
    return per_token * workload.positions


def loss_rows(vocab: int, workload: Workload) -> int:
    """Rows of logits linnet's chunked loss holds at once (linnet.torch.losses.rows_per_block)."""
    if workload.device == "cpu":
        rows = max(CPU_LOSS_MIN_ROWS, CPU_LOSS_BLOCK_BYTES // (4 * vocab))
    else:
        rows = max(1, LOSS_BLOCK_BYTES // (4 * vocab))
    return min(rows, workload.positions)


def logits_bytes(vocab: int, workload: Workload) -> float:
    """The f32 logits the loss holds: s·b·V·4 bytes (2.1 GB for 4,096 tokens of a 128K
    vocabulary), or with the chunked loss one block of them."""
    return 4 * vocab * (loss_rows(vocab, workload) if workload.chunked_loss else workload.positions)


@dataclass(frozen=True)
class Activations:
    """Activation bytes on one GPU by when they are live (activation_bytes)."""

    kept: float  # saved for backward when the forward ends
    loss: float  # the loss's working set at the end of the forward
    recompute: float  # a block computed again in backward (checkpointing), less what it kept
    backward: float  # what a block's backward holds beside its saved tensors
    top: float  # still kept when backward reaches the last block (the final norm's are freed)
    bottom: float  # still kept when backward reaches the first block
    buffers: float = 0  # a pipeline stage's receive buffers, kept for the whole run
    each: float = 0  # kept for one micro-batch, of the `kept` of those in flight

    @property
    def peak(self) -> float:
        """The most activation bytes live at once: at the end of the forward, or in a block's backward."""
        return max(self.kept + self.loss, self.top + self.recompute + self.backward) + self.buffers


def activation_bytes(card: cards.Card, method: Method, workload: Workload, part: Part | None = None) -> Activations:
    """Activation bytes per GPU, by phase, of `part` (default the whole model).

    kept: without checkpointing every block's saved tensors (block_activation_bytes);
    with it each block's input (c·d a token: torch's non-reentrant checkpoint keeps the
    arguments) and, selective, what attention's kernel returned (a·q + 4·heads). Beside
    the blocks, the final norm's, the RoPE tables (2·c·head_dim) and, when the embedding
    trains, the token ids its gradient reads (8). With a frozen embedding (adapters) the
    first block keeps nothing before its first adapted matmul but that matmul's input
    (`_untracked`).
    loss: logits_bytes; with the chunked loss also the hidden states' gradient (c·d a
    token) and a [rows, d] product; in bf16 the logits block cast to bf16 and, when the
    head trains, its bf16 copy and the slices its f32 gradient is accumulated through;
    in f32 on a CPU the head's copy reordered for oneDNN (4·V·d). A head split by vocabulary
    makes its gradients in backward instead (`_split_loss`).
    recompute: with checkpointing, the block computed again (less what selective kept),
    with DoRA's merged f32 weight while it takes the row norms; QLoRA's dequantized weight;
    with MLP tiles, one tile's MLP computed again.
    backward: the gradients in flight inside a block's backward, two [s·b, F] tensors in
    the compute dtype (measured: bench/plan_vs_measured.md), or two a tile, and then also
    two [s·b, d]: the tiles' input gradients, held until the last tile's arrives, and their
    concatenation (a GPU's share of the positions under sequence parallel; measured:
    bench/long_context.md, 16K to 64K positions); in a mixture of
    experts two [s·b·K, d] and two [s·b·K/E, I], and in a part holding a share of the experts
    (expert parallel) the all-to-all buffers (linnet.plan.experts.moe_backward_bytes).
    QLoRA's dequantized weight is the largest of a block's linear weights and an expert's
    [gate; up].
    A pipeline stage (Part) keeps `in_flight` micro-batches' activations; a stage that sends
    its output on keeps it (c·d a token) for its backward instead of a final norm's; one
    that receives its input reads it from a receive buffer (`buffers`: c·d a token, one a
    micro-batch, and as many for the gradients coming back to a stage that sends), which
    then is what its first block keeps of its input (measured: bench/plan_parallel.md).
    """
    part = part or whole(card)
    card = part.card
    c, d, tokens = method.compute_bytes, card.hidden, workload.positions
    a = 4 if workload.device == "cpu" else c
    block = block_activation_bytes(card, method, workload, part.sequence)
    selective = (a * card.heads * card.head_dim + 4 * card.heads) * tokens
    kept = c * d * tokens / part.sequence  # a checkpointed block's input: a GPU's share of the positions
    host = workload.activation_checkpointing == "offload" and workload.device != "cpu"  # the inputs off the GPU
    per_block = {"none": block, "full": kept, "offload": 0 if host else kept,
                 "selective": kept + selective}[workload.activation_checkpointing]
    frozen_input = _untracked(card, method, a) * tokens if method.adapters and workload.activation_checkpointing == "none" \
        else 0
    if part.receives:  # the input needs its gradient, and is the receive buffer
        frozen_input = (c * d if workload.activation_checkpointing != "none" else 4 * d if c == 4 else 0) * tokens
    rope = 2 * c * card.head_dim * tokens + (0 if method.adapters or not part.embeds else 8 * tokens)  # + token ids
    top = card.layers * per_block + rope - frozen_input
    loss = 0
    if part.split_head:
        loss = _split_loss(card, method, workload, part.head_rows)
    elif part.head_rows:
        V = part.head_rows
        loss = logits_bytes(V, workload)
        if workload.chunked_loss:
            rows = loss_rows(V, workload)
            loss += c * d * (tokens + rows) + (2 * rows * V if c == 2 else 0) + _reordered_head(V, d, c, workload)
            if not method.adapters and c == 2:
                loss += (2 * V * d if method.master_bytes else 0) + min(V, 2**26 // (4 * d)) * d * 6
    largest = max(o * i for o, i in card.linear_shapes().values())
    one_expert = 2 * card.experts.intermediate * d if card.experts is not None else 0
    recompute = c * max(largest, one_expert) if method.name == "qlora" else 0
    mlp_rows = min(workload.mlp_tile or tokens, tokens)
    recompute += 4 * c * card.intermediate * mlp_rows if workload.mlp_tile else 0
    if workload.activation_checkpointing != "none":
        recompute += block - (selective if workload.activation_checkpointing == "selective" else 0)
        recompute += kept if host else 0  # the block's input, back from host memory
        recompute += (3 + (c == 2)) * 4 * largest if method.name == "dora" else 0
    each = top + (_norm_bytes(d, c, not method.adapters) * tokens if part.head_rows else c * d * tokens)
    earlier = (part.in_flight - 1) * each  # the other micro-batches in flight
    if part.awaiting:  # their whole graph: the blocks' activations unchecked, each trained matmul's output gradient
        earlier += part.awaiting / part.chunks * card.layers * (block - per_block +
                                                                 _output_gradients(card, method) * tokens)
    buffers = (part.receives + part.sends) * part.micro_batches * c * d * tokens
    if card.experts is not None:
        exchanged = part.experts_held is not None and part.experts_held < card.experts.count
        backward = moe_backward_bytes(card, c, tokens, exchanged)
    else:
        backward = 2 * c * card.intermediate * mlp_rows
        backward += 2 * c * d * tokens / part.sequence if mlp_rows < tokens else 0  # the tiles' input gradients
    return Activations(each + earlier, loss, recompute, backward, top + earlier,
                       per_block + rope - frozen_input + earlier, buffers, each)


def _output_gradients(card: cards.Card, method: Method) -> int:
    """Bytes a token of the gradients of a block's trained products' outputs (each matmul's
    and a trained norm's), which a zero-bubble schedule keeps from a pass's backward for
    its input to the one for its weights."""
    c, shapes = method.compute_bytes, card.linear_shapes()
    if method.adapters:
        return c * sum(o + method.rank for path, (o, _) in shapes.items() if path.rsplit(".", 1)[-1] in method.targets)
    return c * (sum(o for o, _ in shapes.values()) + 2 * card.hidden)


def _reordered_head(rows: int, d: int, c: int, workload: Workload) -> int:
    """The head's copy reordered for oneDNN that a float32 loss on a CPU makes
    (linnet.torch.losses._block_logits), or 0."""
    if workload.device == "cpu" and c == 4 and workload.positions >= CPU_REORDER_MIN_ROWS and rows * d >= CPU_REORDER_MIN_ELEMENTS:
        return 4 * rows * d
    return 0


def _split_loss(card: cards.Card, method: Method, workload: Workload, rows_held: int) -> float:
    """The working set of linnet.torch.losses' loss over a head split by vocabulary: one
    f32 block of logits over the rows held (and the head reordered for oneDNN), in the forward
    and again in backward, which recomputes it; the block's bf16 gradient in bf16."""
    V, c = rows_held, method.compute_bytes
    rows = loss_rows(V, dataclasses.replace(workload, chunked_loss=True))
    return 4 * rows * V + (2 * rows * V if c == 2 else 0) + _reordered_head(V, card.hidden, c, workload)


# ---------------------------------------------------------------------------------------
# The step, phase by phase

PHASES = ("forward", "backward", "optimizer")
# f32 copies of the largest trained tensor bitsandbytes' AdamW8bit holds at once on a CPU
# (bench/plan_vs_measured_adamw8bit.md: 0.33 GB over the 60M model's 65 MB embedding)
EIGHT_BIT_CPU_COPIES = 5


@dataclass(frozen=True)
class Moment:
    """A point of a step: the states then live, by kind (they shard as SHARDED_STATES
    says), and the activations (never sharded)."""

    states: dict[str, float]
    activations: float

    def on(self, shard: str, gpus: int) -> float:
        """Bytes per GPU with `shard` over `gpus` data-parallel ranks."""
        split = SHARDED_STATES[shard]
        return sum(v / gpus if k in split else v for k, v in self.states.items()) + self.activations


def step_moments(card: cards.Card, method: Method, workload: Workload, acts: Activations,
                 part: Part | None = None, over: int = 1) -> dict[str, list[Moment]]:
    """For each phase of a training step, the moments that may hold its peak (whole states:
    one GPU, nothing sharded). linnet sets gradients to None after every optimizer step, so
    the first micro-step's forward holds no gradient but the head's, which the chunked loss
    computes in the forward; with accumulation, later micro-steps hold every gradient.

    forward, at its end inside the loss: the stored weights (frozen base; trained weights
    are the master), the master and optimizer state, the compute copies of trained block
    weights (bf16 without checkpointing; the head's is in the loss's working set), what the
    forward kept and the loss's working set.
    backward, at three moments: its start (the loss's backward scales the head's gradient
    into a new tensor, so two exist, beside the hidden states' gradient); its first block
    (the head's gradient, everything kept, the block recomputed and gradients in flight);
    its last block (every gradient but the embedding's, which comes last, and that block's
    activations).
    optimizer: every state and the step's temporaries. On a GPU foreach AdamW takes the
    square root of every second moment at once (4 B a trainable parameter); on a CPU it
    goes tensor by tensor (two f32 copies of the largest); bitsandbytes' 8-bit AdamW
    (`optimizer_bytes` 2) too, holding `EIGHT_BIT_CPU_COPIES` f32 tensors of the largest
    there (its moments dequantized and the update's temporaries); fused on a GPU. Other
    optimizers: none counted.
    A part (model_parts) holds its own states; a stage without the head starts its backward
    with the gradient of its output, received into a buffer; a head split by vocabulary
    makes the head's gradient and the hidden states' in backward, recomputing the logits.
    `over` > 1: the part is a pipeline stage sharded over `over` copies
    (linnet.torch.stages.shard_stage): the moments are then one GPU's, every state, the
    compute copies and the optimizer's temporaries split over the copies (adapters whole), a
    block gathered whole as it runs, the root (embedding, final norm, head) gathered whole
    through the step's passes (FSDP keeps a root unit from its forward to its backward), and
    the head's and embedding's gradients made whole before they are reduced to parts.
    A part holding a share of a mixture's experts (expert parallel) holds their states whole
    whatever the shard: each moment gives them under keys of their own ("experts' weights",
    ...: what the moment holds beyond the same part without experts), which no shard splits.
    """
    part = part or whole(card)
    moments = _moments(card, method, workload, acts, part, over)
    if not part.experts_held:
        return moments
    dense = _moments(card, method, workload, acts, dataclasses.replace(part, experts_held=0), over)
    return {phase: [Moment({**d.states, **{f"experts' {k}": v - d.states[k] for k, v in m.states.items()}},
                           m.activations) for m, d in zip(ms, dense[phase], strict=True)]
            for phase, ms in moments.items()}


def _moments(card: cards.Card, method: Method, workload: Workload, acts: Activations, part: Part,
             over: int) -> dict[str, list[Moment]]:
    """step_moments' moments, every state under its kind."""
    trainable = trainable_params(card, method, part)
    states = state_bytes(part.params(), trainable, method, "fsdp" if over > 1 else "none", over,
                         quantized_params(card, method, part))
    blocks = part.card
    held, largest = trainable, _largest_trainable(part, method)  # trained values this GPU holds; its largest tensor
    if over > 1 and not method.adapters:  # adapters stay whole
        held, largest = trainable / over, largest / over
    grad, c, tokens = GRADIENT_BYTES[method.grad_dtype], method.compute_bytes, workload.positions
    gathered = c * (part.params() - blocks.layers * part.block_params()) if over > 1 else 0  # the root, whole
    copies = method.copy_bytes * held if method.master_bytes else 0
    stored = states.weights - copies
    if method.adapters:
        per_layer = copies / blocks.layers  # one block's compute copies
    else:  # the embedding and head are not copied by the blocks' linears
        per_layer = method.copy_bytes * part.block_params() if method.master_bytes else 0
        copies = per_layer * blocks.layers / over
    if over > 1:  # a sharded block is gathered whole in the compute dtype as it runs
        per_layer = max(per_layer, c * part.block_params())
    head = 0 if method.adapters else grad * part.head_rows * card.hidden
    embedding = 0 if method.adapters or part.tied or not part.embeds else grad * card.vocab * card.hidden
    # the head's gradient the chunked loss makes in its forward, one a pass until its backward (for the
    # weights, on the zero-bubble schedule)
    in_forward = head * max(1, part.awaiting) if workload.chunked_loss and not part.split_head else 0
    kept_copies = copies if workload.activation_checkpointing == "none" else 0

    def moment(activations: float, gradients: float = 0, copies: float = 0, temporary: float = 0) -> Moment:
        return Moment({"weights": stored + copies, "gradients": gradients, "master": states.master,
                       "optimizer": states.optimizer + temporary}, activations + acts.buffers)

    if method.optimizer_bytes not in (2, 8) or (method.optimizer_bytes == 2 and workload.device != "cpu"):
        temporary = 0
    elif method.optimizer_bytes == 2:
        temporary = EIGHT_BIT_CPU_COPIES * 4 * largest
    elif workload.device == "cpu":
        temporary = 2 * 4 * largest
    else:
        temporary = 4 * held
    if part.split_head:  # the hidden states' gradient and the logits again, in backward
        start = acts.kept + c * card.hidden * tokens + acts.loss
    elif part.head_rows:
        start = acts.kept + (c * card.hidden * tokens if workload.chunked_loss else logits_bytes(card.vocab, workload))
    else:
        start = acts.kept
    working = acts.recompute + acts.backward
    live = states.gradients if workload.accumulate > 1 else 0  # new gradients add into these
    # beside every micro-batch in flight only once a backward came first: 1F1B past its warm-up
    earlier = live if workload.accumulate > part.in_flight else 0
    moments = {
        "forward": [moment(acts.kept + acts.loss, earlier + in_forward, kept_copies + gathered)],
        "backward": [moment(start, earlier + head + in_forward, kept_copies + gathered),
                     moment(acts.top + working, max(earlier, head), (kept_copies or per_layer) + gathered),
                     moment(acts.bottom + working, max(earlier, states.gradients - embedding / over),
                            per_layer + gathered)],
        "optimizer": [moment(0, states.gradients, temporary=temporary)],
    }
    if over > 1 and embedding:  # backward's end: the embedding's whole gradient beside every part, and its copy
        # in the flat buffer it is reduced from, beside what the other micro-batches in flight keep
        moments["backward"].append(moment(acts.kept - acts.each, states.gradients + 2 * embedding, gathered))
    if live and not earlier:  # every forward before the first backward: the later backwards hold one fewer
        moments["backward"] += [moment(acts.top - acts.each + working, live, (kept_copies or per_layer) + gathered),
                                moment(acts.bottom - acts.each + working, live, per_layer + gathered)]
    return moments
