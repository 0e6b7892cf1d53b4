"""Mixture-of-experts settings of a card (Qwen3-MoE, Qwen2-MoE, Mixtral): plain data, read
from and written to a Hugging Face config.json, and the checkpoint names of the experts'
weights.

In a mixture-of-experts block the MLP is replaced by `count` expert MLPs and a router: a
linear map from the hidden state to one logit an expert, softmax, the `per_token` largest
probabilities kept (renormalized to sum to 1 where the family says so) as the weights of
the experts each position goes through. linnet holds a block's experts as transformers 5
does in memory, two stacked tensors, `<block>.mlp.experts.gate_up_proj` [count,
2 x intermediate, hidden] (each expert's gate rows, then its up rows) and `down_proj`
[count, hidden, intermediate], beside the router's `<block>.mlp.gate.weight`, so that
adapters name them as PEFT does; checkpoints store one tensor an expert and part, and
Mixtral's under `block_sparse_moe` (`expert_checkpoint_names`, `checkpoint_name`).
Qwen2-MoE adds a shared expert, an ordinary MLP every position goes through, its output
scaled by a sigmoid gate (`mlp.shared_expert.*_proj`, `mlp.shared_expert_gate.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# family -> (the checkpoint's name of a block's experts' module, of an expert's gate, up and down)
PARTS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
         "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
         "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


@dataclass(frozen=True)
class Experts:
    """count experts a block, per_token of them a position, each an MLP of `intermediate`
    units; `normalize`: the chosen experts' probabilities rescaled to sum to 1; `aux_loss`:
    the coefficient of the router's load-balancing loss where the config applies it
    (output_router_logits), else 0; `shared`: the width of the shared expert (0: none)."""

    count: int
    per_token: int
    intermediate: int
    normalize: bool
    aux_loss: float = 0.0
    shared: int = 0

    def __post_init__(self):
        if not 0 < self.per_token <= self.count or self.intermediate <= 0 or self.shared < 0:
            raise ValueError(f"experts: {self.per_token} of {self.count} experts a position, each of "
                             f"{self.intermediate} units; need 0 < experts_per_token <= experts and a positive width")


def experts_from_config(config: dict, family: str, where: str) -> Experts | None:
    """The Experts of a config.json of a mixture-of-experts family (None for the others);
    what the blocks cannot compute is refused, naming the field."""
    if family not in PARTS:
        return None
    shared = 0
    if family in ("qwen3_moe", "qwen2_moe"):
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(f"{where}: mlp_only_layers and decoder_sparse_step other than 1 (dense blocks among the "
                             "experts' blocks) are not supported")
        count = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 writes the latter
        width, normalize = config.get("moe_intermediate_size"), bool(config.get("norm_topk_prob", False))
        if family == "qwen2_moe":
            shared = config.get("shared_expert_intermediate_size", 0)
    else:
        if float(config.get("router_jitter_noise") or 0.0):
            raise ValueError(f"{where}: router_jitter_noise={config['router_jitter_noise']} is not supported; set it "
                             "to 0.0")
        count, width, normalize = config.get("num_local_experts"), config.get("intermediate_size"), True
    per_token = config.get("num_experts_per_tok")
    if not all(isinstance(v, int) for v in (count, width, per_token, shared)):
        raise ValueError(f"{where}: a {family} config needs integer expert counts and widths "
                         f"(experts {count!r}, per token {per_token!r}, width {width!r}, shared {shared!r})")
    aux = float(config.get("router_aux_loss_coef") or 0.0) if config.get("output_router_logits") else 0.0
    return Experts(count, per_token, width, normalize, aux, shared)


def experts_config(family: str, experts: Experts) -> dict[str, Any]:
    """The config.json fields transformers reads for these experts."""
    common = {"num_experts_per_tok": experts.per_token, "router_aux_loss_coef": experts.aux_loss,
              "output_router_logits": experts.aux_loss > 0}
    if family in ("qwen3_moe", "qwen2_moe"):
        return {**common, "num_experts": experts.count, "moe_intermediate_size": experts.intermediate,
                "norm_topk_prob": experts.normalize, "decoder_sparse_step": 1, "mlp_only_layers": [],
                **({"shared_expert_intermediate_size": experts.shared} if family == "qwen2_moe" else {})}
    return {**common, "num_local_experts": experts.count, "intermediate_size": experts.intermediate,
            "router_jitter_noise": 0.0}


def expert_checkpoint_names(path: str, family: str, count: int) -> list[list[str]] | None:
    """Each expert's checkpoint tensors of a stacked experts tensor's path, in the order they
    join along its rows (`...mlp.experts.gate_up_proj` -> [[`...mlp.experts.0.gate_proj.weight`,
    `...mlp.experts.0.up_proj.weight`], ...]; Mixtral's `...block_sparse_moe.experts.0.w1.weight`
    and `w3`); None for any other path."""
    block, _, name = path.rpartition(".mlp.experts.")
    if family not in PARTS or name not in ("gate_up_proj", "down_proj"):
        return None
    part, (gate, up, down) = PARTS[family]
    stored = (gate, up) if name == "gate_up_proj" else (down,)
    return [[f"{block}.{part}.experts.{e}.{n}.weight" for n in stored] for e in range(count)]


def checkpoint_name(path: str, family: str, *, back: bool = False) -> str:
    """The checkpoint's name of a parameter path other than the stacked experts' (Mixtral's
    router is `block_sparse_moe.gate`); with `back`, the path of a checkpoint's name."""
    if family != "mixtral":
        return path
    ours, theirs = ".mlp.gate.weight", ".block_sparse_moe.gate.weight"
    return path.replace(theirs, ours) if back else path.replace(ours, theirs)
