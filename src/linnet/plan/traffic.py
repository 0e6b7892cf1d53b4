"""A layout's step time, roughly: what orders `linnet plan --suggest`'s layouts.

The step's FLOPs at the cluster's MFU, the pipeline's idle turns, and what each axis
sends between GPUs at the bandwidth of the link its group spans: NVLink (or PCIe) inside
a node (Cluster.gpus_per_node GPUs, GPUS_PER_NODE by default), the network between
nodes. The mesh puts the split on consecutive GPUs, then the context group, the stages
and the copies (linnet.commands.runs.run_mesh), so an axis stays inside a node while the
product of its size and the sizes inside it is at most a node's GPUs.

What a GPU sends a step of `accumulate` micro-batches, with S positions a row, a context
group's GPU holding S/C of them (activations in the compute dtype, f32 gradients where
linnet reduces in f32):

  split    4 all-reduces of a block's [S/C, d] output a micro-batch (6 when checkpointing
           computes the forward again), each 2(s-1)/s of it: the step waits for them
  context  the ring, each block: C-1 hops of the GPU's keys and values forward (again when
           recomputed), C-1 of them with their f32 gradients backward and one more to bring
           those home: the step waits (linnet's ring does not overlap its hops)
  stages   a micro-batch's [S/C, d] hidden states to the next stage and their gradient
           back (twice with two chunks a stage); and the idle turns at the step's ends,
           (P-1)/M of the compute for M micro-batches (half that interleaved)
  copies   the trained gradients summed over the GPUs holding the same part (copies and
           context group), 2(n-1)/n of them, after backward; zero also gathers the updated
           weights; fsdp gathers each block's weights forward and backward and scatters its
           gradients, every micro-batch, overlapped with compute (only the excess counts)
  expert   4 all-to-alls of a block's routed rows a micro-batch (top-k copies of each row)

Compute counts 6N FLOPs a token for full fine-tuning, 4N with a frozen base, 2N more when
checkpointing recomputes the forward, and causal attention's 2·S·H·dh·L a forward (a row
one document: an upper bound for packed rows). MFU is one number for every layout, so
what splitting costs in kernel efficiency is not modelled: the estimate ranks layouts by
their traffic and idle time, it does not predict a step to the second.
"""

from __future__ import annotations

from dataclasses import dataclass

from linnet.plan.memory import GRADIENT_BYTES, trainable_params
from linnet.plan.parts import model_parts

GPUS_PER_NODE = 8  # an HGX / DGX node: Cluster.gpus_per_node's default
# bytes/s a GPU sends one way: to a GPU of its node, and out of its node (one NIC a GPU)
IN_NODE = {"h100": 450e9, "h200": 450e9, "b200": 900e9, "a100-40gb": 300e9, "a100-80gb": 300e9,
           "h100-pcie": 64e9}  # NVLink; the PCIe card's PCIe Gen5 x16
PCIE = 32e9  # the other GPUs, without NVLink: PCIe Gen4 x16
NETWORK = {"a100-40gb": 25e9, "a100-80gb": 25e9, "b200": 100e9}  # else 50e9: 400 Gb/s InfiniBand a GPU
DEFAULT_NETWORK = 50e9
REDUCE_BYTES = 4  # FSDP reduces gradients in f32 (MixedPrecisionPolicy's reduce_dtype)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, by where they go; `tokens_per_second` the whole cluster's."""

    compute: float
    idle: float  # the pipeline's turns without work
    split: float
    context: float
    stages: float
    copies: float  # the copies' (and context group's) gradient sums, ZeRO's gather, FSDP's excess
    expert: float
    tokens: float  # the cluster's positions a step

    @property
    def seconds(self) -> float:
        return self.compute + self.idle + self.split + self.context + self.stages + self.copies + self.expert

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def bandwidth(gpu: str, span: int, per_node: int = GPUS_PER_NODE) -> float:
    """Bytes/s a GPU sends to the others of a group spanning `span` consecutive GPUs, on
    nodes of `per_node` GPUs."""
    if span <= per_node:
        return IN_NODE.get(gpu, PCIE)
    return NETWORK.get(gpu, DEFAULT_NETWORK)


def step_time(card, method, workload, cluster) -> StepTime:
    """`cluster`'s layout's step (see the module docstring), per GPU."""
    s, p, c, e = cluster.split, cluster.pipeline, cluster.context, cluster.expert
    a, S, rows, m = method.compute_bytes, workload.tokens, workload.micro_batch_size, workload.accumulate
    recompute = workload.activation_checkpointing not in (False, "none")
    L, d = card.layers, card.hidden

    def link(span: int) -> float:
        return bandwidth(cluster.gpu.name, span, cluster.gpus_per_node)

    attention = 2 * S * card.heads * card.head_dim * L  # a token's causal attention, forward
    per_token = (4 if method.adapters else 6) * card.active_params() + 3 * attention
    if recompute:
        per_token += 2 * card.active_params() + attention
    copy = 1 if e > 1 else s * p * c  # GPUs that take one row together
    compute = m * rows * S * per_token / (copy * cluster.peak_flops * cluster.mfu)
    chunks = 1 if cluster.pipeline_schedule == "1f1b" else 2
    idle = compute * (p - 1) / (m * chunks) if p > 1 and cluster.pipeline_schedule != "zero-bubble" else 0.0
    held = S // c * rows  # a GPU's positions of a micro-batch
    blocks = L / p
    split = 0.0
    if s > 1:
        sent = blocks * (6 if recompute else 4) * 2 * (s - 1) / s * held * d * a
        split = m * sent / link(s)
    context = 0.0
    if c > 1:
        kv = card.kv_heads // s * card.head_dim * held
        forward = (c - 1) * 2 * kv * a * (2 if recompute else 1)
        backward = (c - 1) * 2 * kv * (a + 4) + 2 * kv * 4
        context = m * blocks * (forward + backward) / link(s * c)
    stages = m * 2 * chunks * held * d * a / link(s * c * p) if p > 1 else 0.0
    part = max(model_parts(card, s, p, m, cluster.pipeline_schedule, cluster.sequence_parallel, e),
               key=lambda q: q.params())
    n = cluster.gpus // (s * p)  # GPUs holding this part: copies and context groups
    ring = 2 * (n - 1) / n
    trained = trainable_params(card, method, part)
    grads = GRADIENT_BYTES[method.grad_dtype]
    copies = 0.0
    if n > 1 and cluster.shard == "fsdp":
        gathered = m * (ring * part.params() * a + (n - 1) / n * trained * REDUCE_BYTES)
        copies = max(0.0, gathered / link(cluster.gpus) - compute - idle)
    elif n > 1:
        sent = ring * trained * grads + ((n - 1) / n * trained * a if cluster.shard == "zero" else 0.0)
        copies = sent / link(cluster.gpus)
    expert = 0.0
    if e > 1 and card.experts is not None:
        routed = held * card.experts.per_token * d * a * (e - 1) / e
        expert = m * L * 4 * routed / link(e)
    rows_taken = cluster.gpus // copy * m * rows
    return StepTime(compute, idle, split, context, stages, copies, expert, rows_taken * S)
