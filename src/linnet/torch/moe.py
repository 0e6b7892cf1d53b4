"""A mixture-of-experts block's MLP (linnet.experts): a router and `count` expert MLPs held
as stacked tensors, each position through its `per_token` chosen experts, dropless (every
position goes through every expert it chose; no capacity).

For each expert the positions that chose it are gathered, go through its SwiGLU MLP
(x @ [gate; up].T in one product, silu(gate) * up @ down.T), are weighed by their routing weight and
added back: a loop over the experts that some position chose, each a few dense products on
its own rows (what transformers computes, with the experts' weights side by side).

The router's load-balancing loss (Switch Transformer, Fedus et al. 2021, as transformers
computes it for these families): count x sum over experts of (the share of positions routed
to it) x (its mean router probability), both pooled over the blocks and over the forward
passes that `balancing` watches (a micro-batch's: linnet.train.loop adds it to every
objective's loss), times the card's coefficient. In training each block also counts the
positions routed to each expert, which `router_metrics` reports a step.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from linnet.cards import Card
from linnet.torch.quantize import dense, linear_4bit, move_states
from linnet.torch.sharding import local


class Router(nn.Module):
    """One logit an expert from the hidden state (`weight` [count, hidden], no bias); with
    count 1, a shared expert's gate."""

    def __init__(self, hidden: int, count: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, hidden))


STACKED = ("gate_up_proj", "down_proj")  # in the order PEFT wraps them (the first innermost)


class ExpertWeights(nn.Module):
    """Every expert's SwiGLU weights, stacked: gate_up_proj [count, 2 x intermediate, hidden]
    (its gate rows, then its up rows), down_proj [count, hidden, intermediate].

    Adapters on them (`adapt`) are laid out as PEFT's adapters of a stacked parameter: A
    [count x r, in] (expert e's rows e r .. e r + r - 1) and B [out, r x count] (expert e's
    columns e, e + count, ...), one pair a stacked tensor. PEFT wraps the second tensor's
    adapter around the first's, so with both adapted the first's pair sits in `base_layer`
    (`experts.base_layer.lora_a`) and the second's in the module (`experts.lora_a`); with one,
    in the module."""

    def __init__(self, hidden: int, count: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, intermediate))
        self.shapes = {"gate_up_proj": (count, 2 * intermediate, hidden), "down_proj": (count, hidden, intermediate)}
        self.targets: tuple[str, ...] = ()  # the adapted stacked tensors, in STACKED's order
        self.lora_a: nn.Parameter | None = None
        self.lora_b: nn.Parameter | None = None
        self.lora_scale = 0.0
        self.quant_state: dict | None = None  # QLoRA: {stacked tensor: one NF4 state an expert} (quantize_into)

    def _apply(self, fn, recurse=True):
        """model.to(device) moves the experts' NF4 states with their codes."""
        super()._apply(fn, recurse)
        if self.quant_state is not None:
            move_states(self, self.down_proj.device)
        return self

    def adapt(self, targets: list[str], rank: int, scale: float) -> None:
        """Fresh adapters on `targets` (PEFT's init: A as a Linear's weight of count x r rows,
        from the global RNG; B zeros; nothing drawn on meta)."""
        self.targets = tuple(t for t in STACKED if t in targets)
        for holder, name in self._holders():
            holder.lora_a, holder.lora_b = (nn.Parameter(t) for t in self._draw(name, rank, self.down_proj.device))
        self.lora_scale = scale

    def redraw(self, device) -> None:
        """`adapt`'s draws again, into adapters placed while the model was on meta, once its
        weights are filled (linnet.torch.lora.draw_adapters)."""
        for holder, name in self._holders():  # new parameters: a meta tensor takes no data
            a, b = self._draw(name, holder.lora_a.shape[0] // self.shapes[name][0], device)
            holder.lora_a, holder.lora_b = nn.Parameter(a), nn.Parameter(b)

    def _holders(self) -> list[tuple[nn.Module, str]]:
        """(the module holding its adapter, the stacked tensor) for each adapted tensor."""
        return list(zip([self] if len(self.targets) == 1 else [self.base_layer_module(), self], self.targets))

    def _draw(self, name: str, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        count, out, inputs = self.shapes[name]
        a = torch.empty(count * rank, inputs, device=device)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        return a, torch.zeros(out, rank * count, device=device)

    def base_layer_module(self) -> nn.Module:
        if not hasattr(self, "base_layer"):
            self.base_layer = nn.Module()
        return self.base_layer

    def adapter(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [count, r, in], B [out, r, count]) of stacked tensor `name`, or None."""
        if name not in self.targets:
            return None
        holder = self.base_layer if len(self.targets) == 2 and name == self.targets[0] else self
        count = self.down_proj.shape[0]
        return holder.lora_a.view(count, -1, holder.lora_a.shape[1]), holder.lora_b.view(holder.lora_b.shape[0], -1,
                                                                                           count)

    def altered(self) -> tuple[str, ...]:
        """The stacked tensors whose plain weights are not the parameter as it is: adapted, or
        stored in NF4."""
        return tuple(t for t in STACKED if t in self.targets or t in (self.quant_state or {}))

    def dense(self, name: str) -> torch.Tensor:
        """Stacked tensor `name` as plain weights (NF4 codes dequantized)."""
        return dense(getattr(self, name).detach(), (self.quant_state or {}).get(name))

    def merged(self, name: str) -> torch.Tensor:
        """Stacked tensor `name` with its adapter folded in (float32)."""
        weight = self.dense(name).float()
        pair = self.adapter(name)
        if pair is None:
            return weight
        a, b = pair
        return weight + torch.einsum("ore,eri->eoi", b.detach().float(), a.detach().float()) * self.lora_scale

    def drop_adapters(self) -> None:
        self.targets, self.lora_a, self.lora_b, self.lora_scale = (), None, None, 0.0
        if hasattr(self, "base_layer"):
            del self.base_layer


class MoE(nn.Module):
    """The experts' MLP of one block: [N, hidden] -> [N, hidden]; `shared`, the card's
    shared expert (an MLP every position goes through, scaled by a sigmoid gate), if any."""

    def __init__(self, card: Card, shared: nn.Module | None = None):
        super().__init__()
        e = card.experts
        self.per_token, self.normalize = e.per_token, e.normalize
        self.gate = Router(card.hidden, e.count)
        self.experts = ExpertWeights(card.hidden, e.count, e.intermediate)
        if shared is not None:
            self.shared_expert, self.shared_expert_gate = shared, Router(card.hidden, 1)
        self.record: list | None = None  # within `balancing`: (positions an expert, probability sums, positions)
        self.load: torch.Tensor | None = None  # positions routed to each expert since router_metrics (on the host)
        self.parallel: tuple | None = None  # expert_parallel's (group, processes, this one's rank, experts a process)
        self.balancing: list[float] = []  # each pooled load-balancing loss since router_metrics (first block)

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [N, count], each position's chosen experts [N, per_token] and
        their weights [N, per_token] in x's dtype): softmax in float32 over the logits,
        the largest kept, renormalized to sum to 1 where the family says so."""
        logits = F.linear(x_ND, self.gate.weight.to(x_ND.dtype))
        weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.per_token, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, chosen, weights.to(x_ND.dtype)

    def forward(self, x):
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        logits, chosen_NK, weights_NK = self.route(x_ND)
        flat = chosen_NK.flatten()
        order = torch.argsort(flat, stable=True)  # (position, slot) pairs grouped by expert
        routed = torch.bincount(flat, minlength=self.gate.weight.shape[0])
        if self.record is not None and torch.is_grad_enabled():
            self.record.append((routed, torch.softmax(logits.float(), dim=-1).sum(0), len(x_ND)))
        if torch.is_grad_enabled():
            self.load = routed.cpu() if self.load is None else self.load + routed.cpu()
        rows = order // self.per_token
        h = x_ND.index_select(0, rows)  # a pair's position, in the experts' order
        y = self._experts(h, routed) if self.parallel is None else self._dispatched(h, routed)
        out = torch.zeros_like(x_ND).index_add(0, rows, y * weights_NK.flatten()[order, None])
        if hasattr(self, "shared_expert"):
            gate = torch.sigmoid(F.linear(x_ND, self.shared_expert_gate.weight.to(x_ND.dtype)))
            out = out + gate * self.shared_expert(x_ND)
        return out.view(shape)

    def _experts(self, h: torch.Tensor, counts: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Rows `h` grouped by expert, counts[e] of them for this process's expert e (expert
        first + e of the block), each through its expert's MLP, in their order."""
        w, out = self.experts, []
        for expert, part in enumerate(h.split(counts.tolist())):
            if len(part):
                gate, up = _product(w, "gate_up_proj", expert, part, first).chunk(2, dim=-1)
                out.append(_product(w, "down_proj", expert, F.silu(gate) * up, first))
        return torch.cat(out) if out else h[:0]

    def _dispatched(self, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """Expert parallel (`expert_parallel`): rows to the processes holding their experts
        and back, all-to-all with uneven splits (the experts of a process are consecutive,
        so rows grouped by expert are grouped by process)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        def exchange(x, output_splits, input_splits):  # autograd's all-to-all, its result awaited
            return wait_tensor(all_to_all_single_autograd(x, output_splits, input_splits, group))

        group, size, rank, per = self.parallel
        sent = routed.view(size, per)  # [process, its experts]: rows this process sends
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)  # [source, my experts]
        out_splits, in_splits = received.sum(1).tolist(), sent.sum(1).tolist()
        mine = exchange(h.contiguous(), out_splits, in_splits)
        by_source = mine.split(out_splits)  # each source's rows, grouped by my experts: regroup by expert
        parts = [p.split(c) for p, c in zip(by_source, received.tolist())]
        grouped = torch.cat([parts[s][e] for e in range(per) for s in range(size)])
        y = self._experts(grouped, received.sum(0), rank * per)
        pieces = y.split(received.t().flatten().tolist())  # (expert, source) -> back to (source, expert)
        back = torch.cat([pieces[e * size + s] for s in range(size) for e in range(per)])
        return exchange(back, in_splits, out_splits)


def _product(w: ExpertWeights, name: str, expert: int, x: torch.Tensor, first: int = 0) -> torch.Tensor:
    """x through this process's expert `expert` of stacked tensor `name` (NF4 codes through
    bitsandbytes), and its adapter where it has one (every expert's, whole on each
    process: expert first + expert's)."""
    states = (w.quant_state or {}).get(name)
    if states is not None:
        y = linear_4bit(x, getattr(w, name)[expert].view(-1, 1), states[expert])
    else:
        y = F.linear(x, local(getattr(w, name))[expert].to(x.dtype))  # an expert-parallel process's own experts
    pair = w.adapter(name)
    if pair is None:
        return y
    a, b = pair
    return y + F.linear(F.linear(x, a[first + expert].to(x.dtype)), b[:, :, first + expert].to(x.dtype)) * w.lora_scale


@contextlib.contextmanager
def balancing(model):
    """Within it, the mixture-of-experts blocks of `model` record the routing of every
    forward pass that builds a graph; the list it yields then holds the load-balancing loss
    of all of them pooled, times the card's coefficient (one tensor), or stays empty: for a
    model without a coefficient, or when nothing trained."""
    e = getattr(model.card, "experts", None)
    blocks = [m for m in model.modules() if isinstance(m, MoE)] if e is not None and e.aux_loss else []
    seen: list = []
    for block in blocks:
        block.record = seen
    weighted: list = []
    try:
        yield weighted
    finally:
        for block in blocks:
            block.record = None
    if seen:
        routed = sum(r for r, _, _ in seen).float()
        probs = sum(p for _, p, _ in seen)
        positions = sum(n for _, _, n in seen)
        loss = e.count * (routed / positions * probs / positions).sum()
        weighted.append(e.aux_loss * loss)
        blocks[0].balancing.append(float(loss.detach()))  # one value a pooled loss, for router_metrics


def router_metrics(model) -> dict[str, float]:
    """The routing in training since the last call: in the block where it is largest, the
    busiest expert's count of routed positions over the block's mean count
    (expert_load_max; 1 is a perfect balance), and the idlest's where smallest
    (expert_load_min); where the loss has it, the mean load-balancing loss of the
    micro-batches (router_balancing_loss, before its coefficient); {} for a model without
    experts or before any training."""
    every = [m for m in model.modules() if isinstance(m, MoE)]
    balancing = [v for m in every for v in m.balancing]
    for m in every:
        m.balancing = []
    blocks = [m for m in every if m.load is not None]
    if not blocks:
        return {}
    load = torch.stack([m.load for m in blocks]).float()  # [blocks, experts]
    for m in blocks:
        m.load = None
    share = load / load.mean(dim=1, keepdim=True).clamp(min=1e-9)
    return {"expert_load_max": float(share.max()), "expert_load_min": float(share.min()),
            **({"router_balancing_loss": sum(balancing) / len(balancing)} if balancing else {})}


def expert_parallel(model, mesh) -> None:
    """Split every mixture-of-experts block's experts over the processes of `mesh`'s last
    dimension (a DeviceMesh named "expert" there, e.g. the run mesh's): process r of it
    keeps experts r*E/P .. (r+1)*E/P - 1, the stacked tensors becoming DTensors split along
    the experts, and each block sends every position to the processes holding its chosen
    experts and takes the results back (`MoE._dispatched`). A first dimension holds copies
    of that split (expert parallel inside data parallel), the experts replicated along it.
    Each process trains on rows of its own; the dense parameters' gradients are summed over
    every process as in data parallel (reduce_gradients), the experts' over the copies
    alone (each copy's expert gets every position routed to it within its group: a
    DTensor's part, which clip_gradients counts once, and save_weights and checkpoints
    gather or split). Adapters on the experts stay whole on every process (an expert's pair
    holds rank / width of its weights' count): each process's experts add their rows' share
    to their gradients, which are summed over every process as the dense ones are. Call it on the same model in
    every process, before the optimizer is made."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if mesh.mesh_dim_names is None or mesh.mesh_dim_names[-1] != "expert" or mesh.ndim > 2:
        raise ValueError("expert_parallel: a DeviceMesh of one or two dimensions, the last named 'expert' "
                         f"(optionally after its copies); got names {mesh.mesh_dim_names}")
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    mesh, whole_mesh = mesh["expert"], mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    for block in [m for m in model.modules() if isinstance(m, MoE)]:
        w = block.experts
        count = w.down_proj.shape[0]
        if count % size:
            raise ValueError(f"expert_parallel: {count} experts do not split over {size} processes; use a divisor")
        if w.quant_state is not None:
            raise ValueError("expert_parallel: the experts are stored in NF4 (quantize), which expert parallel does "
                             "not split yet; load them unquantized, or train on one process")
        for name in STACKED:
            whole = getattr(w, name)
            setattr(w, name, nn.Parameter(distribute_tensor(whole.detach(), whole_mesh, placements),
                                          requires_grad=whole.requires_grad))
        block.parallel = (mesh.get_group(), size, rank, count // size)
