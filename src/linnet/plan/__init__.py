"""The planner: memory, FLOPs, GPU-hours and cost of a training run, before renting a GPU.

    linnet plan llama-3.1-8b-instruct --method lora --rank 16 --context-length 4096 \\
        --total-targets 12e6 --mfu 0.35 --gpus 8 --gpu h100 --price 2.5      # linnet.commands.plan
    plan = estimate("llama-3.1-8b-instruct", Method("lora", rank=16), Workload(tokens=4096),
                    Cluster(accelerator("h100"), gpus=8, mfu=0.35, price=2.5), total_targets=12e6)

Pure arithmetic over a card's shape: stdlib only, no torch, so it answers in well under a
second on any machine. The memory of a step (states, the activations linnet's blocks keep,
the chunked loss, the peak of each phase) is linnet.plan.memory's, whose names this module
re-exports; accelerators, clusters, FLOPs and cost are here. Every convention the numbers
rest on is derived in the docstring of the function that uses it, and `linnet plan` lists
the ones a plan used under its table.

Units: bytes are plain bytes, and GB in the output is 10^9 bytes (as accelerator data
sheets and the seed's tables count them), not GiB.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from linnet import cards, hardware
from linnet.experts import Experts
from linnet.plan import experts, traffic
from linnet.plan.experts import EXPERT_NAMES  # noqa: F401  (re-exported)
from linnet.plan.memory import (  # noqa: F401  (re-exported: the planner's public names)
    CHECKPOINTING,
    COMPARED,
    CPU_LOSS_BLOCK_BYTES,
    CPU_LOSS_MIN_ROWS,
    CPU_REORDER_MIN_ELEMENTS,
    DEVICES,
    DTYPES,
    GRADIENT_BYTES,
    LINEAR_NAMES,
    LOSS_BLOCK_BYTES,
    METHODS,
    NF4_BYTES,
    PHASES,
    SHARDED_STATES,
    Activations,
    Method,
    Moment,
    States,
    Workload,
    activation_bytes,
    block_activation_bytes,
    logits_bytes,
    loss_rows,
    part_states,
    quantized_params,
    state_bytes,
    step_moments,
    trainable_params,
)
from linnet.plan.parts import (  # noqa: F401  (re-exported)
    SCHEDULES,
    Part,
    SettingError,
    _require,
    model_parts,
    whole,
)
from linnet.plan.ring import RING_SCORE_BYTES, ring_bytes  # noqa: F401  (re-exported)

GB = 1e9
DEFAULT_METHOD, DEFAULT_WORKLOAD = Method(), Workload()  # frozen: safe as argument defaults


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
        _require(self.memory_gb > 0, f"{{gpu}} {self.name!r}: {{memory_gb}} must be positive, got {self.memory_gb}")
        _require(self.bf16_tflops > 0, f"{{gpu}} {self.name!r}: {{bf16_tflops}} must be positive, got {self.bf16_tflops}")
        _require(
            self.fp8_tflops is None or self.fp8_tflops > 0,
            f"{{gpu}} {self.name!r}: {{fp8_tflops}} must be positive, or None where there are no fp8 tensor "
            "cores",
        )

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s for the matmul precision."""
        if precision == "bf16":
            return self.bf16_tflops * 1e12
        if precision == "fp8":
            if self.fp8_tflops is None:
                raise SettingError(f"{{gpu}} {self.name!r} has no fp8 tensor cores; use {{precision}} 'bf16' or give "
                                   "its fp8 peak ({fp8_tflops})")
            return self.fp8_tflops * 1e12
        raise SettingError(f"{{precision}} {precision!r} is unknown; use one of {', '.join(PRECISIONS)}")


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
        raise SettingError(f"{{gpu}} {name!r} is unknown; use one of {', '.join(ACCELERATORS)}, or describe it "
                           "with its memory and bf16 peak ({memory_gb} and {bf16_tflops})")
    return Accelerator(name, **overrides)


# ---------------------------------------------------------------------------------------
# The cluster


@dataclass(frozen=True)
class Cluster:
    """The GPUs a run rents and how well it uses them.

    `usable` is the share of each GPU's memory a run can fill: the CUDA context, the caching
    allocator's fragmentation and communication buffers take the rest. 0.9 is the value
    that reproduces the seed's minimum of 18 H100s for full fine-tuning of a 70B (with all
    80 GB usable the arithmetic gives 16; any share from 0.882 to 0.933 gives 18).
    `mfu` defaults to 0.35, the low end of the 35-50% BF16 MFU that good large dense runs
    reach on H100; small models and adapters usually reach less. `split` GPUs split every
    block (tensor parallel) and `pipeline` stages hold consecutive blocks (two chunks a stage
    with `pipeline_schedule` "interleaved"): split x pipeline GPUs hold one copy of the
    model, and `gpus` counts every copy's. `context` GPUs take the same rows, each a whole
    copy (or split's part) computing 1/context of every row's positions (context parallel:
    `ring_bytes`).
    `sequence_parallel`: a split's GPUs also share the blocks' norms' positions. `expert`
    GPUs split a mixture of experts' experts between them (expert parallel,
    `training.expert`; groups of them copies of each other when `gpus` is a multiple), each
    holding the rest of the model and rows of its own. `gpus_per_node`: the GPUs a node's
    fast links join (8 on an HGX / DGX board); groups that span more cross the network.
    """

    gpu: Accelerator = ACCELERATORS["h100"]
    gpus: int = 1
    gpus_per_node: int = traffic.GPUS_PER_NODE
    shard: str = "none"
    split: int = 1
    pipeline: int = 1
    pipeline_schedule: str = "1f1b"
    context: int = 1
    sequence_parallel: bool = False
    expert: int = 1
    usable: float = 0.9
    precision: str = "bf16"
    mfu: float = 0.35
    price: float | None = None

    def __post_init__(self):
        _require(self.gpus >= 1, f"{{gpus}} must be a positive integer, got {self.gpus}")
        _require(
            self.shard in SHARDED_STATES, f"{{shard}} {self.shard!r} is unknown; use one of {', '.join(SHARDED_STATES)}"
        )
        _require(self.pipeline_schedule in SCHEDULES,
                 f"{{pipeline_schedule}} {self.pipeline_schedule!r}: use one of {', '.join(SCHEDULES)}")
        _require(self.split >= 1 and self.pipeline >= 1,
                 f"{{split}} and {{pipeline}} must be positive numbers of GPUs, got {self.split} and {self.pipeline}")
        _require(self.context >= 1, f"{{context}} must be a positive number of GPUs, got {self.context}")
        _require(self.gpus_per_node >= 1, f"{{gpus_per_node}} must be a positive integer, got {self.gpus_per_node}")
        _require(self.gpus % (self.context * self.split) == 0, f"{{gpus}}={self.gpus}: {{context}} {self.context} x "
                 f"{{split}} {self.split} GPUs take each row; use a multiple of {self.context * self.split} GPUs")
        _require(not self.sequence_parallel or self.split > 1,
                 "{sequence_parallel} shares a split's positions: linnet runs it with {split} 2 or more")
        per_copy = self.split * self.pipeline
        _require(self.gpus % per_copy == 0, f"{{gpus}}={self.gpus}: {{split}} {self.split} x {{pipeline}} {self.pipeline} = "
                 f"{per_copy} GPUs hold one copy of the model; use a multiple of {per_copy} GPUs")
        _require(per_copy == 1 or self.shard in ("none", "fsdp"),
                 f"{{shard}} {self.shard!r} with {{split}} {self.split} and {{pipeline}} {self.pipeline}: linnet "
                 "shards the parts of a split or pipelined model over their copies with fsdp alone ({shard} none "
                 "or fsdp)")
        experts.check_cluster(self)
        _require(0 < self.usable <= 1, f"{{usable}} must be a fraction in (0, 1] of GPU memory, got {self.usable}")
        _require(0 < self.mfu <= 1, f"{{mfu}} must be in (0, 1], got {self.mfu}; pass a fraction such as 0.35 for 35%")
        _require(self.price is None or self.price >= 0, f"{{price}} must be >= 0 dollars per GPU-hour, got {self.price}")
        self.gpu.peak_flops(self.precision)  # fails now, not halfway through a plan

    @property
    def usable_bytes(self) -> float:
        return self.usable * self.gpu.memory_gb * GB

    @property
    def peak_flops(self) -> float:
        return self.gpu.peak_flops(self.precision)


# ---------------------------------------------------------------------------------------
# GPUs


def min_gpus(states: float, activations: float, usable_bytes: float) -> int | None:
    """Fewest GPUs that hold one moment of a step with every state sharded (FSDP /
    ZeRO-3): the smallest n with states / n + activations <= usable. Activations do not
    shrink with n (each GPU runs its own micro-batch), so None when they alone overflow
    one GPU. A plan takes the largest n over the moments of its step (step_moments)."""
    room = usable_bytes - activations
    if room <= 0:
        return None
    return max(1, math.ceil(states / room))


# ---------------------------------------------------------------------------------------
# Compute and cost


def training_flops(params: float, total_targets: float, frozen_base: bool = False) -> float:
    """FLOPs of training `params` parameters on `total_targets` tokens (each predicted once).

    A forward pass costs 2N FLOPs per token (a multiply and an add per parameter); the
    backward pass 4N: 2N for the gradients with respect to the activations and 2N for
    those with respect to the weights. Hence 6ND (Kaplan et al. 2020). A frozen base
    needs no weight gradients, so LoRA, QLoRA and DoRA cost about 4ND (the adapters' own
    FLOPs are under 1%; QLoRA's dequantization shows up as lower MFU, not more FLOPs).
    Attention's 12 L d s per token is left out: small until the context is long.
    """
    return (4 if frozen_base else 6) * params * total_targets


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
    """What training on `total_targets` tokens costs."""

    total_targets: float
    flops: float
    gpu_hours: float
    days: float
    cost: float | None  # dollars, None without a price per GPU-hour


def compute_cost(params: float, total_targets: float, method: Method, cluster: Cluster) -> Compute:
    """FLOPs, GPU-hours, wall time and dollars of training on `total_targets` tokens, `params`
    the parameters a token computes with (card.active_params(): of a mixture of experts' only
    the chosen ones)."""
    flops = training_flops(params, total_targets, frozen_base=method.adapters)
    hours = gpu_hours(flops, cluster.peak_flops, cluster.mfu)
    cost = None if cluster.price is None else hours * cluster.price
    return Compute(total_targets, flops, hours, wall_days(hours, cluster.gpus), cost)


# ---------------------------------------------------------------------------------------
# A plan


@dataclass(frozen=True)
class ProcessPlan:
    """The memory of one process's part of the model (step_memory.Part): the whole model,
    or under split / pipeline one stage's share."""

    name: str
    params: int
    trainable: int
    states: States
    activations: Activations
    phases: dict[str, float]


@dataclass(frozen=True)
class Plan:
    """Memory per GPU and, given a token count, compute and cost of one run. Split or
    pipelined, the memory figures are the fullest process's, and `processes` has each
    stage's."""

    model: str
    params: int
    active: int  # the parameters a token computes with: a mixture of experts' chosen experts alone
    trainable: int
    method: Method
    workload: Workload
    cluster: Cluster
    states: States  # per GPU, split as cluster.shard says over cluster.gpus
    activations: Activations  # with checkpointing as the workload chose it
    activations_checkpointed: float  # the activation peak with full checkpointing
    activations_uncheckpointed: float  # and without
    logits: float  # part of every activation figure
    phases: dict[str, float]  # the most bytes live per GPU in each phase of a step (PHASES)
    min_gpus: int | None  # with every state sharded; None: activations alone overflow a GPU
    compute: Compute | None
    processes: tuple[ProcessPlan, ...] = ()  # one a pipeline stage (its split's processes hold alike)
    experts: Experts | None = None  # a mixture of experts' (card.experts); None for a dense model

    @property
    def total(self) -> float:
        """Peak bytes per GPU: the largest phase."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phases.__getitem__)

    @property
    def fits(self) -> bool:
        return self.total <= self.cluster.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        """Every input and result as JSON-ready data; bytes are plain bytes."""
        data = dataclasses.asdict(self)
        data["states"]["total"] = self.states.total
        data["activations"]["peak"] = self.activations.peak
        data.update(total=self.total, peak_phase=self.peak_phase, fits=self.fits, usable=self.cluster.usable_bytes)
        return data


def estimate(
    card: cards.Card | str,
    method: Method = DEFAULT_METHOD,
    workload: Workload = DEFAULT_WORKLOAD,
    cluster: Cluster = Cluster(),
    total_targets: float | str | None = None,
) -> Plan:
    """Plan a run of `card` (a Card, registered name or model directory). `total_targets`
    is the count of tokens trained on (prediction targets), "chinchilla" for 20 per
    parameter (every one, a mixture's experts all counted), or None for memory only. FLOPs
    count the parameters a token computes with (card.active_params())."""
    card = cards.resolve(card)
    experts.check(card, method, workload, cluster)
    params = card.params()
    trainable = trainable_params(card, method)
    if total_targets == "chinchilla":
        total_targets = chinchilla_tokens(params)
    _require(
        total_targets is None or (not isinstance(total_targets, str) and total_targets > 0),
        f"{{total_targets}} must be a positive count such as 12e6, or 'chinchilla'; got {total_targets!r}",
    )
    cut = cluster.split * cluster.pipeline > 1
    _require(not (cluster.split > 1 and method.name == "qlora"),
             "qlora with {split}: linnet splits an NF4 base with {shard} fsdp, or cuts it into pipeline stages; "
             "plan it so")
    _require(not cut or workload.num_models == 1,
             "{num_models} with {split} or {pipeline}: each packed model is a whole model")
    _require(cluster.pipeline == 1 or cluster.pipeline_schedule != "zero-bubble"
             or workload.activation_checkpointing == "none",
             "zero-bubble with {activation_checkpointing}: linnet refuses it (the split backward keeps each "
             "recomputed block until its weights' half); plan interleaved, or {activation_checkpointing} none")
    _require(not (cluster.shard == "fsdp" and cut and cluster.pipeline_schedule == "zero-bubble"),
             "zero-bubble with {shard} fsdp: linnet refuses it; plan interleaved")
    processes, modes = [], []
    copies = cluster.gpus // (cluster.split * cluster.pipeline)  # what each part's states shard over
    _require(workload.tokens % (2 * cluster.context) == 0,
             f"{{tokens}} {workload.tokens} with {{context}} {cluster.context}: a row cuts into 2 x context equal "
             f"chunks; use a multiple of {2 * cluster.context}")
    mine = dataclasses.replace(workload, tokens=workload.tokens // cluster.context)  # a GPU's positions of a row
    _require(not cluster.sequence_parallel or (mine.tokens % cluster.split == 0
                                                and (workload.mlp_tile or 0) % cluster.split == 0),
             "{sequence_parallel}: {tokens} (over {context}: a GPU's share of them) and {mlp_tile} multiples of "
             "{split} (each GPU takes an equal share)")
    for part in model_parts(card, cluster.split, cluster.pipeline, workload.accumulate, cluster.pipeline_schedule,
                            cluster.sequence_parallel, cluster.expert):
        acts = {mode: activation_bytes(card, method, dataclasses.replace(mine, activation_checkpointing=mode),
                                       part) for mode in CHECKPOINTING}
        # a split's share of the heads passed round: live in attention's backward, after the MLP's has ended
        ring = ring_bytes(part.card, mine, cluster.context)
        acts = {mode: dataclasses.replace(a, backward=max(a.backward, ring)) for mode, a in acts.items()}
        over = copies if cut and cluster.shard == "fsdp" else 1  # a stage sharded over its copies
        # per GPU when over > 1
        moments = step_moments(card, method, mine, acts[workload.activation_checkpointing], part, over)
        states = part_states(card, method, part, cluster.shard, copies)
        n = workload.num_models
        if n > 1:  # packed workers: n whole models, their states and their micro-batches side by side
            moments = {phase: [Moment({k: v * n for k, v in m.states.items()}, m.activations * n) for m in ms]
                       for phase, ms in moments.items()}
            acts = {mode: Activations(*(v * n for v in dataclasses.astuple(a))) for mode, a in acts.items()}
            states = States(*(v * n for v in dataclasses.astuple(states)))
        shard = "none" if over > 1 else cluster.shard
        phases = {phase: max(m.on(shard, copies) for m in moments[phase]) for phase in PHASES}
        processes.append(ProcessPlan(part.name, part.params(), trainable_params(card, method, part), states,
                                     acts[workload.activation_checkpointing], phases))
        modes.append((acts, moments))
    fullest = max(range(len(processes)), key=lambda i: max(processes[i].phases.values()))
    acts, moments = modes[fullest]
    if cut or cluster.expert > 1:  # the fewest GPUs that hold the whole model with every state sharded, as one
        moments = step_moments(card, method, workload, activation_bytes(card, method, workload))
    fewest = [min_gpus(sum(m.states.values()), m.activations, cluster.usable_bytes)
              for ms in moments.values() for m in ms]
    return Plan(
        model=card.name,
        params=params,
        active=card.active_params(),
        trainable=trainable,
        method=method,
        workload=workload,
        cluster=cluster,
        states=processes[fullest].states,
        activations=acts[workload.activation_checkpointing],
        activations_checkpointed=acts["full"].peak,
        activations_uncheckpointed=acts["none"].peak,
        logits=logits_bytes(card.vocab, workload),
        phases={phase: max(p.phases[phase] for p in processes) for phase in PHASES},
        min_gpus=None if None in fewest else max(fewest),
        compute=None if total_targets is None else compute_cost(card.active_params(), total_targets, method, cluster),
        processes=tuple(processes),
        experts=card.experts,
    )


def compare(
    card: cards.Card | str,
    method: Method = DEFAULT_METHOD,
    workload: Workload = DEFAULT_WORKLOAD,
    cluster: Cluster = Cluster(),
    total_targets: float | str | None = None,
    names: Sequence[str] = COMPARED,
) -> list[Plan]:
    """The same run planned with each method in `names` (rank, targets and optimizer
    taken from `method`)."""
    card = cards.resolve(card)
    return [estimate(card, dataclasses.replace(method, name=name), workload, cluster, total_targets)
            for name in names]


# ---------------------------------------------------------------------------------------
# Settings: flat, by their Python names (`linnet plan` maps its flags onto them).

_GPU_SETTINGS = ("memory_gb", "bf16_tflops", "fp8_tflops")  # accelerator()'s overrides


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def plan_inputs(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `estimate` from flat settings by their Python names: Method's
    fields (`method` for its name), Workload's, Cluster's, `gpu` and accelerator()'s
    overrides (memory_gb, bf16_tflops, fp8_tflops), and `total_targets`. A missing or None
    value takes the default."""
    given = {key: value for key, value in settings.items() if value is not None}
    method_keys = _field_names(Method) - {"name"} | {"method"}
    workload_keys = _field_names(Workload)
    cluster_keys = _field_names(Cluster) - {"gpu"}
    known = method_keys | workload_keys | cluster_keys | set(_GPU_SETTINGS) | {"gpu", "total_targets"}
    unknown = sorted(set(given) - known)
    _require(not unknown, f"unknown plan settings {unknown}; known: {', '.join(sorted(known))}")
    costing = sorted({"mfu", "precision", "price"} & set(given))
    _require(
        "total_targets" in given or not costing,
        f"{', '.join('{' + key + '}' for key in costing)} only matter for a count of tokens trained on; add "
        "{total_targets} (12e6, or chinchilla)",
    )
    if "targets" in given:
        given["targets"] = _targets(given["targets"])
    method = Method(**{("name" if key == "method" else key): given[key] for key in method_keys & set(given)})
    gpu = accelerator(given.get("gpu", Cluster().gpu.name), **{key: given[key] for key in _GPU_SETTINGS if key in given})
    return dict(
        method=method,
        workload=Workload(**{key: given[key] for key in workload_keys & set(given)}),
        cluster=Cluster(gpu=gpu, **{key: given[key] for key in cluster_keys & set(given)}),
        total_targets=given.get("total_targets"),
    )


def _targets(value: str | Sequence[str]) -> tuple[str, ...]:
    """'all-linear' (PEFT's spelling), 'q_proj,v_proj', or a list of names."""
    if value == "all-linear":
        return LINEAR_NAMES
    names = value.split(",") if isinstance(value, str) else value
    return tuple(name.strip() for name in names if name.strip())


def sampling_memory(card: cards.Card, rows: int, slots: int, dtype: str = "bf16",
                    method: Method = DEFAULT_METHOD, shares_base: bool = True, cpu: bool = False) -> dict[str, Any]:
    """Bytes GRPO's sampling engine holds beside training: its own copy of the weights in
    its dtype (the policy's, or grpo.engine_dtype), and a KV cache of `rows` completions x
    `slots` positions (keys and values, every layer, in that dtype). Under QLoRA it shares
    the policy's NF4 block weights and holds f32 copies of the adapters instead
    (`Engine.load_weights`), unless the policy is split by FSDP or cut into pipeline stages
    (shares_base=False): then it holds every weight, dequantized and merged (every stage's
    engine the whole model). A float32 engine on a CPU (`cpu`) also holds its head reordered
    for oneDNN (from 2^20 weights) and, where this CPU has AVX-512, its projections
    (`hardware.cpu_reorders_projections`): `reordered_bytes`, within weights_bytes. Not
    part of `estimate`'s totals."""
    size = DTYPES[dtype]
    shared = quantized_params(card, method) if shares_base else 0
    reordered = 0
    if cpu and dtype == "f32" and not shared:
        head = card.vocab * card.hidden
        reordered = 4 * ((head if head >= CPU_REORDER_MIN_ELEMENTS else 0)
                         + (card.layers * sum(o * i for o, i in card.linear_shapes().values())
                            if hardware.cpu_reorders_projections() else 0))
    weights = (card.params() - shared) * size + (trainable_params(card, method) * 4 if shared else 0) + reordered
    cache = rows * slots * card.layers * 2 * card.kv_heads * card.head_dim * size
    return {"rows": rows, "slots": slots, "dtype": dtype, "weights_bytes": weights, "reordered_bytes": reordered,
            "cache_bytes": cache}
