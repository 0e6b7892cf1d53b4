"""Pipeline stages: each process holds a run of consecutive blocks (the first stage the
embedding too, the last the final norm and the head), and a step's micro-batches flow
through the stages on a schedule, PyTorch's own (`torch.distributed.pipelining`: GPipe,
1F1B, interleaved 1F1B or zero-bubble), so a model too deep for one process trains over
several without splitting any one weight.

    parallel.join()                                     # under torchrun
    model = nest.load(card, device=..., trainable=True)   # add_lora before, if any
    pipeline(model)                                     # every process one stage, in place
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    train(model, pack(examples, tokens=4096), optimizer=optimizer, steps=1000, accumulate=8)

The processes of a pipeline take the same batches; a step's `accumulate` packed rows are
its micro-batches (1F1B wants at least as many as stages: a step with fewer runs GPipe);
every objective (`dpo`, `kto`, `reward`, `distill`, `grpo`) passes its rows so, the last
stage computing their losses (`Pipe.run`'s `head`: from each row's log-probabilities, or
with `HiddenAt` from its final hidden states at some positions: a reward model's answer
ends, a student's learned positions). Each micro-batch's summed loss is divided by the
step's count of learned positions on the last stage before its backward, so gradients
equal one process's over the same rows; `train` then adds each stage's squared gradient
norm across the pipeline for clipping and reports the last stage's loss on every process. With several pipelines (`mesh` one dimension of a
("copies", "stages") mesh), each stage's gradients are summed across its copies, as a
split model's are; with fully_shard=True each stage is sharded over its copies instead
(FSDP), and a copy with fewer micro-batches passes blank ones so their gathers meet.
A stage may also split every row's positions over a context group (`split_context` after
the cut): each process passes its share's hidden states to its place in the next stage's
group, and the last stage sums the row's loss over the group, or gathers the row's
log-probabilities or hidden states for an objective's head.

A head tied to the embedding is untied first (the first stage embeds, the last predicts):
it starts as a copy of the embedding and trains apart from it, as under tensor_parallel.
Parameters keep their whole-model names, so `save_weights` and `save_peft` (every process
calls them; the first writes the gathered stages) and checkpoints (each stage writes its
parts with torch.distributed.checkpoint) read as the unsplit model's: a pipeline's
checkpoint resumes in one process, or under another pipeline. A stage runs only inside
the training functions' steps and their held-out passes: sample with the saved weights
loaded whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from linnet.torch.context import gather_row, sum_over
from linnet.torch.distributed import most_across, sum_across
from linnet.torch.sharding import copies_group, is_sharded

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero-bubble")


class Blocks(nn.Module):
    """A stage's blocks under their whole-model indices (`model.layers.5…`), so parameter
    names, saved files and checkpoints match the unsplit model's; iterates like the
    ModuleList it replaces."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for i, block in blocks.items():
            self.add_module(str(i), block)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


def pipeline(model, mesh=None, *, schedule: str = "1f1b", tensor_parallel=None, fully_shard: bool = False):
    """Cut `model` (a linnet Decoder, loaded whole) into one stage a process of `mesh` (a
    one-dimension DeviceMesh, e.g. mesh["stages"] of a ("copies", "stages") mesh; default:
    every process, one pipeline) and keep this process's stage, in place: consecutive
    blocks, as evenly as the layers divide. schedule: "1f1b" (a micro-batch's backward as
    soon as the last stage has it: activations of at most `stages` micro-batches held),
    "gpipe" (every forward, then every backward) or "interleaved" (interleaved 1F1B,
    Narayanan et al. 2021: the blocks cut into two chunks a process, process i of P holding
    chunks i and i + P, so a micro-batch passes each process twice and the pipeline's idle
    start and end shrink by half, for twice the hand-offs) or "zero-bubble" (the interleaved
    chunks, each backward split in two, Qi et al. 2023: the input's gradient first, passed
    on at once, the weights' later, filling the idle turns). tensor_parallel: a one-dimension mesh
    (mesh["split"] of a ("copies", "stages", "split") mesh) whose processes then split the
    stage's blocks and head as `nest.load(..., tensor_parallel=)` does. fully_shard=True:
    shard each stage over its copies (the processes holding the same stage in the other
    pipelines, or each process's part of a split stage over the processes holding it in the
    other copies; FSDP, `linnet.torch.fully_shard`: a unit a block, and one for the embedding,
    final norm and head). Adapters go on before (after, with tensor_parallel). Call before
    building the optimizer; returns the model. `nest.load(card, pipeline=mesh["stages"])`
    builds the stage alone instead, never holding the other stages' weights."""
    mesh = check(model, mesh, schedule, tensor_parallel, fully_shard)
    cut(model, mesh, schedule)
    if tensor_parallel is not None:
        from linnet.torch.sharding import tensor_parallel as split

        split(model, tensor_parallel)
    copies = stage_copies(mesh, tensor_parallel)
    if fully_shard:
        shard_stage(model, copies, model.device.type, tensor_parallel)
    return staged(model, mesh, schedule, copies)


def check(model, mesh, schedule: str, tensor_parallel, fully_shard: bool = False):
    """Refuse what `pipeline` cannot do; the stages' mesh (every process's, by default)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: schedule={schedule!r}; use one of {', '.join(SCHEDULES)}")
    if fully_shard and schedule == "zero-bubble":
        raise ValueError("pipeline: schedule='zero-bubble' with fully_shard is not supported yet (FSDP reshards a "
                         "block after its forward and reduces its gradients when its backward ends, so the weights' "
                         "half finds nothing to compute); use 'interleaved'")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("pipeline needs a process group: run under torchrun and call "
                           "linnet.torch.distributed.join() (or torch.distributed.init_process_group) first")
    if model.pipe is not None or model.copies is not None or is_sharded(model):
        raise ValueError("pipeline: this model is already cut, split or sharded; load it whole and cut it once "
                         "(pipeline(..., tensor_parallel=) splits the stages)")
    if mesh is None:
        if tensor_parallel is not None:
            raise ValueError("pipeline: with tensor_parallel=, pass the stages' mesh too (mesh['stages'] of the "
                             "same ('copies', 'stages', 'split') mesh)")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(model.device.type, (dist.get_world_size(),), mesh_dim_names=("stages",))
    chunks = mesh.size() * _chunks(schedule)
    if model.card.layers < chunks:
        raise ValueError(f"pipeline: card {model.card.name!r} has {model.card.layers} layers, fewer than "
                         f"{chunks} {'chunks (two a stage)' if chunks > mesh.size() else 'stages'}")
    return mesh


def _chunks(schedule: str) -> int:
    """Chunks of blocks a process holds under `schedule`."""
    return 2 if schedule in ("interleaved", "zero-bubble") else 1


def held(index: int, stages: int, layers: int, schedule: str) -> list[range]:
    """The blocks of process `index`'s chunks, a range a chunk: the layers cut into
    stages x chunks-a-stage chunks as evenly as they divide, process i holding chunks i,
    i + stages, ..."""
    n = stages * _chunks(schedule)
    return [range(c * layers // n, (c + 1) * layers // n) for c in range(index, n, stages)]


def cut(model, mesh, schedule: str = "1f1b") -> None:
    """Keep this process's stage of `model` (its parameters may still be on meta): its
    blocks (`held`), the embedding on the first stage, the final norm and the head (untied)
    on the last."""
    stages, index, layers = mesh.size(), mesh.get_local_rank(), model.card.layers
    if model.card.tied_embeddings:
        model.untie_head()
    model.stage_pass = MethodType(_stage_pass, model)
    model.model.layers = Blocks({i: model.model.layers[i] for run in held(index, stages, layers, schedule)
                                 for i in run})
    if index > 0:
        del model.model.embed_tokens
    if index < stages - 1:
        del model.model.norm
        del model.lm_head


def stage_copies(mesh, tensor_parallel):
    """The group of the processes holding this process's part of the model in the other
    pipelines (its stage, and its part of the split): the group its gradients sum over. A
    collective: every process makes every group."""
    return copies_group(mesh, *(() if tensor_parallel is None else (tensor_parallel,)))


def shard_stage(model, copies, device_type: str, tensor_parallel=None) -> None:
    """Shard the cut `model` over `copies` (its stage's processes in the other pipelines):
    each block a unit, and the root (its embedding, final norm and head) one that
    `stage_pass`, the method every pass of the stage runs through, gathers as a forward. A
    split stage's parts over the copies dimension of the split's own mesh (FSDP wants both
    from one mesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    from linnet.torch.sharding import copies_mesh, fully_shard

    mesh = (DeviceMesh.from_group(copies, device_type, mesh_dim_names=("copies",)) if tensor_parallel is None
            else copies_mesh(tensor_parallel))
    fully_shard(model, mesh=mesh, entries=("stage_pass",))


def _stage_pass(model, run, *args):
    """run(*args): one pass of a stage's chunk (`model.stage_pass`), a method of the model
    so that fully_shard can gather the stage's root around it."""
    return run(*args)


def staged(model, mesh, schedule: str, copies):
    """Make the cut (and perhaps split or sharded) `model` a stage: its `copies` group and
    its Pipe."""
    model.copies = copies
    model.pipe = Pipe(model, mesh, schedule)
    return model


@dataclass(frozen=True)
class HiddenAt:
    """A pipelined objective's `head` that reads a row's final (normed) hidden states at
    `positions(row)` (an array of positions) rather than its log-probabilities: head(index,
    row, hidden [len(positions), D]) -> what a log-probability head returns. The last block
    computes only those positions."""

    positions: Callable
    head: Callable


class Pipe:
    """This process's stage of a pipeline, as `train`'s step drives it: `run` takes the
    step's micro-batches through the schedule (forward and backward) and returns the
    pipeline's summed loss, the same on every stage; `loss` is `loss_packed`'s forward
    only (a held-out loss)."""

    def __init__(self, model, mesh, schedule: str):
        self.model, self.mesh, self.schedule = model, mesh, schedule  # mesh: the stages' (one dimension)
        self.group, self.index, self.stages = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        self.first, self.last = self.index == 0, self.index == self.stages - 1
        # blocks sharded over the copies (shard_stage): each pass gathers across them, so every copy makes as many
        self.matched = any(isinstance(block, FSDPModule) for block in model.model.layers)
        self._built: dict[tuple, tuple] = {}  # (micro-batches, row length, backward) -> (schedule, its _Stage)

    def __repr__(self) -> str:
        return f"Pipe(stage {self.index + 1} of {self.stages}, {self.schedule})"

    def run(self, rows: Sequence, count: float, head=None, stats: Sequence[str] = ()) -> tuple[float, list[float]]:
        """Forward and backward of every micro-batch in `rows` through the pipeline, each
        loss divided by `count` (the step's normaliser) before its backward. The loss is
        `loss_packed`'s, or with `head` an objective's: head(index, row, log_probs) ->
        (summed loss, {name: float} of `stats`), from the row's `log_probs_packed` on the
        last stage (or a `HiddenAt`'s, from hidden states). Returns the summed (undivided)
        loss and the summed stats, the same on every stage. 1F1B wants as many
        micro-batches as stages: with fewer, GPipe runs them. No rows (a GRPO step whose
        groups were all dropped, the same on every stage): nothing runs, unless another
        copy of sharded stages has rows (`_blanks`)."""
        rows = list(rows)
        if any(len(r.tokens) != len(rows[0].tokens) for r in rows):
            raise ValueError("pipeline: a step's rows must have one length (pack them with one `tokens`)")
        total, summed, _ = self._flow(rows, count, backward=True, head=head, stats=stats)
        return total, summed

    def loss(self, row) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss_packed` of one row through the stages, forward only (held-out loss): every
        stage of the pipeline calls it together and gets the summed loss and count."""
        if torch.is_grad_enabled():
            raise RuntimeError("a pipelined model computes losses with gradients only inside a linnet.train step "
                               "(its schedule); call loss_packed under torch.no_grad() to evaluate")
        total, _, _ = self._flow([row], 1.0, backward=False)
        device = self.model.device
        return torch.tensor(total, dtype=torch.float32, device=device), torch.as_tensor(row.weights).to(device).float().sum()

    def values(self, rows: Sequence, head, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Forward only (no gradients): head(index, row, log_probs) -> a float tensor of
        sizes[index] values a row, computed on the last stage from each row's
        `log_probs_packed` (or a `HiddenAt`'s, from hidden states), and returned on every
        stage (float64)."""
        with torch.no_grad():
            _, _, found = self._flow(list(rows), 1.0, backward=False, head=head, values=True)
        if not sizes:
            return []
        flat = torch.zeros(sum(sizes), dtype=torch.float64, device=self.model.device)
        if self.last:
            flat.copy_(torch.cat([v.double() for v in found]))
        dist.all_reduce(flat, group=self.group)  # the last stage's values, zeros elsewhere: exact
        return list(flat.split(list(sizes)))

    def _flow(self, rows: list, count: float, backward: bool, head=None, stats: Sequence[str] = (),
              values: bool = False) -> tuple[float, list[float], list[torch.Tensor] | None]:
        """The rows through the schedule: the last stage's summed loss and stats on every
        stage, and with `values` what `head` returned for each row there (else None)."""
        real = len(rows)
        rows = rows + self._blanks(rows)
        if not rows:
            return 0.0, [0.0] * len(stats), []
        kind = "gpipe" if not backward or len(rows) < self.stages else self.schedule
        key = (len(rows), len(rows[0].tokens), backward, kind)
        if key not in self._built:
            self._built[key] = self._schedule(*key)
        schedule, chunks = self._built[key]
        for stage in chunks:
            stage.rows, stage.real, stage.count, stage.summed, stage.head = rows, real, count, [], head
            stage.stats, stage.values = dict.fromkeys(stats, 0.0), [] if values else None
        tokens = (torch.stack([torch.as_tensor(r.tokens) for r in rows]).to(self.model.device),) if self.first else ()
        schedule.step(*tokens, mb=torch.arange(len(rows)), target=torch.zeros(len(rows)) if self.last else None,
                      return_outputs=False)
        stage = chunks[-1]  # on the last stage, the chunk that computes the losses
        mine = [float(sum(stage.summed)), *stage.stats.values()] if self.last else [0.0] * (1 + len(stats))
        total, *summed = sum_across(mine, self.group)  # the last stage's, on every stage
        return total, summed, stage.values

    def _blanks(self, rows: list) -> list:
        """Rows that learn nothing, enough to bring `rows` to the busiest copy's count when
        the stages are sharded over the copies (their every pass a collective there); else none."""
        if not self.matched:
            return []
        short = most_across(len(rows), self.model.copies) - len(rows)
        if not short:
            return []
        from linnet.packing import Example, pack

        return [next(pack([Example.plain([0, 0])], tokens=len(rows[0].tokens) if rows else 16))] * short

    def _schedule(self, M: int, P: int, backward: bool, kind: str):
        """(PyTorch's schedule for M micro-batches of P positions, this process's _Stage
        chunks in order)."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleLoopedBFS,
        )

        m = self.model
        if self.schedule == "zero-bubble" and m.checkpointing:
            raise ValueError("pipeline: schedule='zero-bubble' with activation checkpointing is not supported: the "
                             "split backward keeps each recomputed block until its weights' half runs (measured: "
                             "more memory than without checkpointing); use 'interleaved', or no checkpointing")
        runs = held(self.index, self.stages, m.card.layers, self.schedule)
        n = self.stages * len(runs)
        stages = []
        for j, run in enumerate(runs):
            c = self.index + j * self.stages  # the chunk's place in the pipeline
            chunk = _Stage(m, [getattr(m.model.layers, str(i)) for i in run], first=c == 0, last=c == n - 1)
            mine = P if m.context is None else P // dist.get_world_size(m.context)  # a context group's share
            hidden = torch.empty(1, mine, m.card.hidden, dtype=m.dtype, device=m.device, requires_grad=True)
            entering = torch.empty(1, P, dtype=torch.long, device=m.device) if chunk.first else hidden
            leaving = torch.empty((), device=m.device) if chunk.last else hidden
            stages.append(PipelineStage(chunk, c, n, m.device, input_args=entering, output_args=leaving,
                                        group=self.group))
        chunks = [s.submod for s in stages]
        # forward only: no loss function, every forward in turn
        loss = dict(loss_fn=lambda loss, _: loss, scale_grads=False) if backward else {}
        if len(stages) == 1:
            order = Schedule1F1B if backward and kind == "1f1b" else ScheduleGPipe
            return order(stages[0], n_microbatches=M, **loss), chunks
        # interleaved 1F1B and zero-bubble take their micro-batches in rounds of `stages`; else each chunk in turn
        rounds = max(1, M // self.stages)
        order = ScheduleLoopedBFS
        if backward and kind != "gpipe" and M % rounds == 0:
            order = ScheduleInterleavedZeroBubble if kind == "zero-bubble" else ScheduleInterleaved1F1B
        return order(stages, n_microbatches=M, **loss), chunks


class _Stage(nn.Module):
    """The module a PipelineStage runs: micro-batch `mb` of the step's rows through `blocks`,
    this process's part of the decoder (one chunk of it, interleaved). In: the row's tokens
    [1, P] on the first stage, else the previous stage's hidden states [1, P, D]; out:
    hidden states [1, P, D] (a row's trailing padding zeros), or on the last stage the
    row's summed loss over the step's count, a scalar."""

    def __init__(self, model, blocks: list, first: bool, last: bool):
        super().__init__()
        self.model = model
        self.blocks, self.first, self.last = blocks, first, last
        self.rows: list = []
        self.real = 0  # rows past it are Pipe._blanks: loss_packed's loss, times zero
        self.count = 1.0
        self.summed: list[torch.Tensor] = []
        self.head = None  # an objective's loss from a row's log-probabilities or a HiddenAt (Pipe.run)
        self.stats: dict[str, float] = {}
        self.values: list[torch.Tensor] | None = None  # Pipe.values' per-row results

    def forward(self, x, mb):
        return self.model.stage_pass(self._pass, x, mb)

    def _pass(self, x, mb):
        m = self.model
        index = int(mb)
        row = self.rows[index]
        blank = index >= self.real
        head = None if blank else self.head
        tokens, positions, layout, targets, weights = m._fields(row)
        n = len(tokens)
        if self.first:
            x = nn.functional.embedding(tokens, m.model.embed_tokens.weight).to(m.dtype)
        else:
            x = x[0, :n]
        hidden = isinstance(head, HiddenAt)
        keep = None
        if self.last and m.context is None:  # the positions the head reads: the last block computes those alone
            keep = torch.as_tensor(head.positions(row), device=m.device) if hidden else m._learned(row, n)
        h = m._blocks(x, positions, *layout, keep=keep, blocks=self.blocks)
        if not self.last:
            # a tensor of its own: zero-bubble schedules detach it in place, and a sharded root's backward
            # hook on it then fires before the last block's, whatever the row's padding
            return (h if m.context is not None else m._padded(h, row)).unsqueeze(0).clone()
        if head is None:
            loss, _ = m._head_loss(m.model.norm(h), targets, weights, keep)
            if m.context is not None:  # the row's loss on every process of the group, each its own part's gradient
                loss = sum_over(loss, m.context)
            if blank:
                return loss * 0
        else:
            final = m.model.norm(h)
            if hidden:  # under context parallel the whole row's, then the positions the head reads
                at = None if m.context is None else torch.as_tensor(head.positions(row), device=m.device)
                found = head.head(index, row, final if at is None else _whole(m, final, row)[at])
            else:
                logp = m.head_log_probs(final, targets, keep, row)
                found = head(index, row, logp if m.context is None else _whole(m, logp[:n], row))
            if self.values is not None:
                self.values.append(found.detach())
                return found.new_zeros(())
            loss, stats = found
            for name, value in stats.items():
                self.stats[name] += value
        self.summed.append(loss.detach())
        return loss / self.count


def _whole(model, x: torch.Tensor, row) -> torch.Tensor:
    """A context-parallel last stage's per-position values (this process's positions) as
    the whole row's, on every process of the group; each gets its own positions' gradient."""
    return gather_row(x, len(row.tokens), model.context)
