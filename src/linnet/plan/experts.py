"""A mixture of experts in the planner (linnet.experts, linnet.torch.moe): which stacked
tensors adapters take, what an MoE block keeps for backward, what expert parallel adds,
and the settings linnet refuses with experts. `linnet.plan.memory` and `linnet.plan` count
with these; stdlib only, no torch.

Shapes: H hidden, I an expert's width, E experts a block, K experts a position (card.experts),
N positions a micro-step, c bytes of the compute dtype, r the adapters' rank. A routed pair
is one (position, chosen expert): N·K of them a block.
"""

from __future__ import annotations

from typing import Any

from linnet import cards
from linnet.experts import Experts
from linnet.plan.parts import _require

# a dense block's linear layers (what all-linear adapts), and a mixture of experts' stacked
# expert tensors, as add_lora and PEFT name them (linnet.torch.moe.STACKED)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_NAMES = ("gate_up_proj", "down_proj")
ATTENTION_NAMES = LINEAR_NAMES[:4]


def expert_shapes(card: cards.Card) -> dict[str, tuple[int, int]]:
    """(out, in) of one expert's slice of each stacked tensor: gate_up_proj [2I, H], down_proj [H, I]."""
    e = card.experts
    return {"gate_up_proj": (2 * e.intermediate, card.hidden), "down_proj": (card.hidden, e.intermediate)}


def held_expert_params(card: cards.Card, held: int | None = None) -> int:
    """A block's expert weights held by one process: `held` experts (None: all E) of 3·I·H
    each; 0 for a dense card. The router [E, H] is not one of them: every process holds it."""
    e = card.experts
    return 0 if e is None else (e.count if held is None else held) * 3 * e.intermediate * card.hidden


def adapted_experts(experts: Experts | None, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The stacked tensors adapters go on, as add_lora matches names to the end of a path:
    down_proj where the targets name it (in Qwen2-MoE also the shared expert's), gate_up_proj
    where they name it or name every linear layer (all-linear, the default: LINEAR_NAMES).
    () for a dense card (`experts` None)."""
    if experts is None:
        return ()
    every = set(LINEAR_NAMES) <= set(targets)
    return tuple(name for name in EXPERT_NAMES if name in targets or every)


def layer_names(experts: Experts | None) -> tuple[str, ...]:
    """The names of a block's linear layers: a dense block's seven; a mixture of experts'
    attention and its shared expert's MLP (Qwen2-MoE), beside the stacked tensors."""
    if experts is None:
        return LINEAR_NAMES
    return ATTENTION_NAMES + (LINEAR_NAMES[4:] if experts.shared else ())


def adapted_names(experts: Experts | None, targets: tuple[str, ...]) -> list[str]:
    """The layers and stacked tensors adapters go on, by name."""
    picked = [name for name in targets if name in layer_names(experts)] + list(adapted_experts(experts, targets))
    return list(dict.fromkeys(picked))


def expert_adapter_params(card: cards.Card, method: Any) -> int:
    """A block's adapter parameters on its stacked tensors: one low-rank pair an expert,
    A [E·r, in] and B [out, r·E] a stacked tensor (PEFT's target_parameters layout):
    E·r·(in + out) each, whole on every process under expert parallel."""
    if card.experts is None or not method.adapters:
        return 0
    shapes = expert_shapes(card)
    return sum(
        card.experts.count * method.rank * sum(shapes[name]) for name in adapted_experts(card.experts, method.targets)
    )


def moe_bytes_per_token(card: cards.Card, method: Any) -> float:
    """Bytes a token of what one of linnet's MoE MLPs keeps for backward (linnet.torch.moe.MoE,
    in place of a dense MLP's 4·c·F): the router's float32 softmax (4E) and, with a
    load-balancing coefficient, the softmax `balancing` takes again (4E); the top-k indices,
    the pairs' order by expert and their positions (3 x 8K, int64); renormalizing, the
    top-k weights and their sum in float32 (4K + 4). Per routed pair (K a token): the
    experts' [gate; up] output (2·c·I) and silu(gate) (c·I), the experts' results, their
    weighted copy index_add reads and the weight (c·(2H + 1)); the gathered row (c·H) where
    gate_up_proj trains or carries an adapter, the product down_proj reads (c·I) where it
    does, and an adapter's x·Aᵀ (c·r) on each adapted one. A shared expert of width S
    (Qwen2-MoE) keeps its gate and up, silu(gate) (3·c·S), the product its down_proj reads
    where that trains or is adapted (c·S), its output and the sigmoid gate that scales it
    (c·(H + 1)); its adapters are counted with the block's linear layers'. Under adapters
    the block's second norm's output is kept by nothing here (a frozen router keeps no
    input) unless a shared expert's gate or up projection is adapted: less c·H a token
    then (the norm counts it)."""
    e, c = card.experts, method.compute_bytes
    trains = not method.adapters
    adapted = adapted_experts(e, method.targets) if method.adapters else ()
    router = 4 * e.count * (1 + (e.aux_loss > 0)) + 3 * 8 * e.per_token + (4 * e.per_token + 4 if e.normalize else 0)
    pair = c * (3 * e.intermediate + 2 * card.hidden + 1 + method.rank * len(adapted))
    pair += c * card.hidden * (trains or "gate_up_proj" in adapted) + c * e.intermediate * (
        trains or "down_proj" in adapted
    )
    shared = c * (3 * e.shared + card.hidden + 1) + c * e.shared * (trains or "down_proj" in method.targets)
    reads_input = trains or (e.shared and {"gate_proj", "up_proj"} & set(method.targets))
    return router + e.per_token * pair + (shared if e.shared else 0) - (0 if reads_input else c * card.hidden)


def moe_backward_bytes(card: cards.Card, c: int, tokens: int, exchanged: bool) -> float:
    """What an MoE block's backward holds beside its saved tensors, counted as a dense MLP's
    two [s·b, F] gradients are: two of each width it works in, the gradients of the pairs'
    results and of their gathered rows, [N·K, H], and an expert's own, [N·K/E, I] with the
    load balanced (counting the live tensors of a backward on a CPU finds three of each,
    for the dense MLP and for this one alike). Under expert parallel (`exchanged`) also the
    all-to-all buffers (`exchange_bytes`), whose gradients backward exchanges back the same
    way."""
    e, pairs = card.experts, card.experts.per_token * tokens
    inflight = 2 * c * pairs * (card.hidden + e.intermediate / e.count)
    return inflight + (exchange_bytes(card, c, tokens) if exchanged else 0)


def exchange_bytes(card: cards.Card, c: int, tokens: int) -> float:
    """The all-to-all buffers of one block under expert parallel (MoE._dispatched), beside
    what one process computes: the rows it receives for its experts, its experts' results and
    those regrouped by the process they go back to, each [R, H] with R the pairs routed to
    this process's experts, N·K with the load balanced (every process sends its N·K rows
    out and receives as many). The rows sent and the results received back are the
    gathered rows and results a block has without expert parallel; of what is exchanged,
    autograd keeps the received rows regrouped (in place of the gathered ones) and the
    results received back (in place of the experts' own), the same bytes: the kept count is
    unchanged."""
    return 3 * c * card.hidden * card.experts.per_token * tokens


def check(card: cards.Card, method: Any, workload: Any, cluster: Any) -> None:
    """Refuse what linnet refuses with a mixture of experts, or with expert parallel, and
    adapters' targets that name no layer of the card (add_lora refuses a pattern that
    matches nothing; all-linear takes what there is)."""
    e, n = card.experts, cluster.expert
    every = set(LINEAR_NAMES) <= set(method.targets)
    missing = [t for t in method.targets if t not in layer_names(e) + (EXPERT_NAMES if e else ())]
    _require(
        not method.adapters or every or not missing,
        f"{{targets}} {', '.join(missing)}: card {card.name!r} has no such layer"
        + (
            "; a mixture of experts holds every expert's gate and up rows in one stacked tensor, gate_up_proj"
            if e
            else ""
        ),
    )
    if e is None:
        _require(
            n == 1, f"{{expert}} {n} splits a mixture of experts' experts; card {card.name!r} ({card.family}) has none"
        )
        return
    moe = f"a mixture of experts ({card.name!r}, {card.family})"
    for name, value in (("split", cluster.split), ("pipeline", cluster.pipeline)):
        _require(
            value == 1,
            f"{{{name}}} {value} with {moe}: linnet does not split or cut its blocks yet; train "
            "it whole, sharded ({shard} fsdp) or with its experts split ({expert})",
        )
    _require(
        not workload.mlp_tile,
        f"{{mlp_tile}} {workload.mlp_tile} with {moe}: its MLPs are its experts, which "
        "run on their own rows (linnet refuses it)",
    )
    adapted = adapted_experts(card.experts, method.targets) if method.adapters else ()
    _require(
        not (adapted and method.name == "dora"),
        f"dora on {moe}'s experts ({{targets}} {', '.join(adapted)}): their adapters take no DoRA; adapt the "
        f"attention alone ({{targets}} {','.join(ATTENTION_NAMES)}) or use lora",
    )
    if n == 1:
        return
    _require(
        e.count % n == 0,
        f"{{expert}} {n}: card {card.name!r} has {e.count} experts a block, which {n} GPUs "
        f"cannot split evenly; use a divisor of {e.count}",
    )
    _require(
        method.name != "qlora",
        f"{{expert}} {n} with qlora: linnet's expert parallel does not split experts "
        "stored in NF4 yet; plan lora, or one GPU's experts whole ({expert} 1)",
    )


def check_cluster(cluster: Any) -> None:
    """Expert parallel as linnet runs it (training.expert): the experts split over groups of
    `expert` GPUs (the groups copies of each other), each GPU holding the rest of the model,
    whole or sharded with fsdp over every GPU, and its share of each row's positions under
    context parallel."""
    n = cluster.expert
    _require(n >= 1, f"{{expert}} must be a positive number of GPUs, got {n}")
    if n == 1:
        return
    _require(
        cluster.split == cluster.pipeline == 1,
        f"{{expert}} {n} with {{split}} {cluster.split} and {{pipeline}} {cluster.pipeline}: linnet splits the "
        "experts over GPUs that each hold the rest of the model whole or sharded; set them to 1",
    )
    _require(
        cluster.gpus % n == 0,
        f"{{gpus}}={cluster.gpus}: {{expert}} {n} splits the experts over groups of "
        f"{n} GPUs; use a multiple of {n} GPUs",
    )
    _require(
        cluster.shard in ("none", "fsdp"),
        f"{{expert}} {n} with {{shard}} {cluster.shard}: beside the split experts linnet shards the dense "
        "parts with fsdp alone ({shard} none or fsdp)",
    )


def config_targets(card: cards.Card, patterns: list[str]) -> list[str]:
    """The planner's names (linnet.plan.Method.targets) of the layers a config's
    lora.targets pick in `card`'s blocks, as add_lora picks them (linnet.paths): its
    projections' names, or a mixture of experts' attention, shared expert and stacked
    tensors (a name once: down_proj may be the shared expert's and the experts')."""
    from linnet.paths import target_matches

    paths = [f"model.layers.0.{path}" for path in card.linear_shapes()]
    paths += [f"model.layers.0.mlp.experts.{name}" for name in EXPERT_NAMES] if card.experts is not None else []
    return list(
        dict.fromkeys(path.rsplit(".", 1)[-1] for path in paths if any(target_matches(path, p) for p in patterns))
    )


def describe(plan: Any) -> list[str]:
    """`linnet plan`'s assumption lines for a plan of a mixture of experts (none for a dense card)."""
    e, cluster, method = plan.experts, plan.cluster, plan.method
    if e is None:
        return []
    adapted = adapted_experts(e, method.targets) if method.adapters else ()
    lines = [
        f"mixture of experts: {e.per_token} of {e.count} experts a position, each {e.intermediate} wide; "
        f"parameters count every expert, active ones a token's {e.per_token} (FLOPs use those); "
        + (
            f"adapters on the experts' {', '.join(adapted)}: one pair an expert, E·r·(in + out) each; "
            if adapted
            else ""
        )
        + "activations: the router's softmax and top-k, each position's rows gathered for its chosen experts "
        "and their MLP's intermediates, the results and their weighted copy (balanced routing)"
    ]
    if cluster.expert > 1:
        groups = cluster.gpus // cluster.expert
        lines.append(
            f"expert parallel over {cluster.expert} GPUs"
            + (f" ({groups} groups of them)" if groups > 1 else "")
            + f": each holds {e.count // cluster.expert} of every block's {e.count} experts with their "
            "states (never sharded by --shard; their adapters whole on every GPU), and a block's all-to-all "
            "buffers while it runs: the rows received, its experts' results and those sent back, 3·c·H a routed "
            "pair with the load balanced"
        )
    return lines
