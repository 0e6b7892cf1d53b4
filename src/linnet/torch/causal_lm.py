"""CausalLM: a linnet decoder behind the call that transformers-style trainers make.

    from linnet.torch import CausalLM
    lm = CausalLM(nest.load(card, trainable=True))
    trainer = transformers.Trainer(model=lm, args=args, train_dataset=data, data_collator=collate)
    trainer = trl.SFTTrainer(model=lm, args=trl.SFTConfig(...), train_dataset=data,
                             processing_class=tokenizer)

`lm(input_ids=, attention_mask=, labels=, position_ids=, num_items_in_batch=)` returns a
`transformers.modeling_outputs.CausalLMOutput` (`.loss`, `["loss"]`). Underneath:

1. The padding goes (attention_mask 0), and the rows are laid end to end in one packed row
   (`linnet.packing.Packed`). Each row is a sequence; a 0 in `position_ids` starts a new
   one inside a row (TRL's padding-free batches). Sequences never attend to each other.
2. Labels follow transformers: -100 leaves a position out and the shift happens inside
   (position t learns labels[t+1]); a pre-shifted `shift_labels` is taken as is. A label
   on the first token of a sequence is never learned: nothing of the sequence precedes it
   (transformers would score it from the padding, or the previous packed sequence, before
   it; TRL's collators put -100 there).
3. For the loss, each sequence is cut after its last learned position (later tokens cannot
   change the loss) and sequences with nothing learned are dropped.
4. The row's length rounds up to a multiple of `bucket` (a padding document of weight 0),
   so a compiled model sees few shapes.
5. The decoder's `loss_packed` entry gives (sum, count) without the [P, V] logits; the loss
   is sum / num_items_in_batch when the trainer passes it (so gradient accumulation takes
   the mean over the whole step), else sum / count.

What TRL reads besides the call: `config` (a transformers config built from the card),
`generation_config`, `base_model` (hidden states in the input's [B, T, D] layout, zeros at
padding, from the decoder's `hidden_packed`) and `get_output_embeddings()` (the head weight)
for its fused chunked loss; `logits=True` (constructor or call) returns [B, T, V] float32
logits in the input's layout, computed without gradients. `save_pretrained` writes a
directory transformers loads, or a PEFT adapter directory when the decoder has LoRA
adapters. `generate` samples through `linnet.serve.Engine` (KV cache) on a frozen copy of
the decoder that it refreshes with the current weights each call.

Shapes: B rows and T columns of the trainer's batch, N = B*T, P positions of the packed
row, D hidden, V vocabulary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

try:
    import transformers
    from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "linnet.torch.CausalLM serves transformers-style trainers and needs transformers: "
        "pip install transformers"
    ) from e

from linnet.files.atomic import write_text
from linnet.packing import Packed
from linnet.torch.losses import linear_cross_entropy

IGNORE = -100  # transformers' ignore_index
BUCKET = 256

# Keys trainers send that a packed call does not need: the packed row carries the same
# information (cu_seq_lens_* / max_length_* / seq_idx are TRL's padding-free boundaries,
# which position_ids already give), or they do not apply (no cache in training).
_REDUNDANT = frozenset({
    "use_cache", "return_dict", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
    "max_length_k", "seq_idx", "cache_position", "return_loss",
})
# Keys accepted only at their "off" value.
_OFF = {"output_attentions": False, "output_hidden_states": False, "output_router_logits": False,
        "logits_to_keep": 0}


# What the packed calls take, and the fix for a keyword they refuse.
_TAKES = ("the packed decoder takes input_ids, attention_mask, position_ids, labels / shift_labels and "
          "num_items_in_batch", "drop it from the batch or the trainer's arguments")


def _refuse_extras(kwargs: dict[str, Any], where: str, takes: tuple[str, str] = _TAKES) -> None:
    """A TypeError for a keyword `where` does not take: `takes` is (what it does take, the fix)."""
    for key, value in kwargs.items():
        if value is None or key in _REDUNDANT or (key in _OFF and value == _OFF[key]):
            continue
        raise TypeError(f"CausalLM.{where}: {key}={_short(value)} is not supported ({takes[0]}); {takes[1]}")


def _short(value: Any) -> str:
    return f"<tensor {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)[:40]


def _host(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()  # the one host sync: document bounds are host ints
    return np.asarray(x)


# ---------------------------------------------------------------------------------------
# From a trainer's batch to one packed row


@dataclass
class PackedBatch:
    """A trainer's [B, T] batch as one packed row.

    row    the packed row (numpy fields), `bucket`-padded
    index  [row.real] flat index (row * T + column) of each packed position in the batch
    shape  (B, T)
    """

    row: Packed
    index: np.ndarray
    shape: tuple[int, int]


def pack_batch(input_ids, attention_mask=None, position_ids=None, labels=None, shift_labels=None,
               *, bucket: int | None = BUCKET, trim: bool = True) -> PackedBatch:
    """Pack a transformers-style batch into one row (see the module docstring).

    trim=True keeps, of each sequence, only the tokens up to its last learned position
    (enough for the loss); trim=False keeps every real token (for hidden states/logits).
    """
    ids = _host(input_ids).astype(np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"CausalLM: input_ids must be [batch, length], got shape {ids.shape}")
    B, T = ids.shape
    N = B * T

    def as_2d(x, name):
        a = _host(x)
        if a.ndim == 1:
            a = a[None]
        try:
            return np.broadcast_to(a, (B, T))
        except ValueError:
            raise ValueError(
                f"CausalLM: {name} has shape {a.shape} but input_ids has {(B, T)}; "
                f"{name} must be [batch, length] (4-D attention masks are not supported)"
            ) from None

    real = np.ones((B, T), bool) if attention_mask is None else as_2d(attention_mask, "attention_mask") != 0
    if position_ids is None:
        positions = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
        start = np.zeros((B, T), bool)
    else:
        positions = as_2d(position_ids, "position_ids").astype(np.int64)
        start = positions == 0  # TRL's padding-free rows: a 0 starts the next sequence
    start = start.copy()
    start[:, 0] = True

    targets = np.zeros((B, T), np.int64)
    learned = np.zeros((B, T), bool)
    if shift_labels is not None:
        given = as_2d(shift_labels, "shift_labels").astype(np.int64)
        ok = given != IGNORE
        targets = np.where(ok, given, 0)
        learned = real & ok
    elif labels is not None:
        nxt = as_2d(labels, "labels").astype(np.int64)[:, 1:]
        ok = (nxt != IGNORE) & ~start[:, 1:]
        targets[:, :-1] = np.where(ok, nxt, 0)
        learned[:, :-1] = real[:, :-1] & ok
    if (targets < 0).any():
        bad = int(targets[targets < 0][0])
        raise ValueError(f"CausalLM: label {bad} is negative; only -100 marks an ignored position")

    real, learned = real.reshape(N), learned.reshape(N)
    document = np.cumsum(start.reshape(N)) - 1  # [N] sequence of each batch position
    if trim:
        last = np.full(document[-1] + 1, -1, np.int64)
        hits = np.flatnonzero(learned)
        np.maximum.at(last, document[hits], hits)
        keep = real & (np.arange(N) <= last[document])
    else:
        keep = real.copy()
    if not keep.any():  # nothing to learn or no real token: one token of weight 0 keeps the graph
        keep[int(np.argmax(real)) if real.any() else 0] = True

    index = np.flatnonzero(keep)
    P = len(index)
    kept_docs = document[index]
    bounds = [0, *(np.flatnonzero(np.diff(kept_docs)) + 1).tolist(), P]
    size = P if not bucket else -(-P // bucket) * bucket
    row_tokens = np.zeros(size, np.int64)
    row_targets = np.zeros(size, np.int64)
    row_weights = np.zeros(size, np.float32)
    row_positions = np.zeros(size, np.int64)
    row_tokens[:P] = ids.reshape(N)[index]
    row_targets[:P] = targets.reshape(N)[index]
    row_weights[:P] = learned[index]
    row_positions[:P] = positions.reshape(N)[index]
    if size > P:  # the padding to the bucket is a document of its own, weight 0
        row_positions[P:] = np.arange(size - P)
        bounds.append(size)
    documents = len(bounds) - 1 - (size > P)
    row = Packed(row_tokens, row_targets, row_weights, row_positions, np.asarray(bounds, np.int64),
                 real=P, examples=documents)
    return PackedBatch(row, index, (B, T))


def _unpack(values_PX: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """[B, T, X] with each packed position's values back in its batch place, zeros elsewhere
    (differentiable with respect to `values_PX`)."""
    B, T = batch.shape
    index = torch.from_numpy(batch.index).to(values_PX.device)
    out = values_PX.new_zeros(B * T, values_PX.shape[-1])
    return out.index_copy(0, index, values_PX[: batch.row.real]).view(B, T, -1)


# ---------------------------------------------------------------------------------------
# What TRL's fused head reads


class _Backbone:
    """`CausalLM.base_model`: called like a transformers backbone, it returns the final
    hidden states in the input's layout ([B, T, D], zeros at padding) from the decoder's
    `hidden_packed` entry."""

    def __init__(self, lm: CausalLM):
        self.lm = lm

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs) -> BaseModelOutput:
        return BaseModelOutput(last_hidden_state=self.lm.hidden_states(input_ids, attention_mask, position_ids, **kwargs))


class _Head:
    """`CausalLM.get_output_embeddings()`: the output head's weight (the embedding when
    tied) and no bias, as TRL's chunked log-probabilities read them."""

    bias = None

    def __init__(self, decoder):
        self._decoder = decoder

    @property
    def weight(self) -> torch.Tensor:
        return self._decoder.head_weight


# ---------------------------------------------------------------------------------------


class CausalLM(transformers.PreTrainedModel):
    """A linnet `Decoder` seen as a transformers causal LM by `transformers.Trainer` and TRL.
    A PreTrainedModel to them, so that the Trainer's `save_model` and checkpoints go
    through `save_pretrained` (a directory transformers or PEFT loads); its own weights are
    never initialised or loaded by transformers (`from_pretrained` is not for it: wrap
    `nest.load(directory)`).

    bucket: packed rows round up to a multiple of this many positions (None: no rounding).
    logits: return [B, T, V] logits (float32, no gradients) from every call, as well as
        the loss when labels are given; a call can also pass logits=True.

    The parameters are the decoder's own (same objects), under the Hugging Face names
    (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), so an optimizer built on
    `CausalLM(decoder).parameters()` trains `decoder`, and `state_dict()` reads like a
    transformers checkpoint. `lm.decoder` is the linnet model.
    """

    main_input_name = "input_ids"
    accepts_loss_kwargs = True  # transformers.Trainer then passes num_items_in_batch
    loss_type = "ForCausalLM"  # Trainer counts num_items_in_batch over the shifted labels
    _keys_to_ignore_on_save = None
    supports_gradient_checkpointing = True

    def __init__(self, decoder: nn.Module, *, bucket: int | None = BUCKET, logits: bool = False):
        if not hasattr(decoder, "loss_packed") or not hasattr(decoder, "card"):
            raise TypeError(
                f"CausalLM wraps a linnet decoder (nest.load(card)), got {type(decoder).__name__}"
            )
        if bucket is not None and bucket < 1:
            raise ValueError(f"CausalLM: bucket={bucket}; use a positive multiple (256) or None")
        super().__init__(hf_config(decoder.card))
        self.__dict__["_decoder"] = decoder  # not a submodule: its parts are, under HF names
        self.model = decoder.model
        if not decoder.card.tied_embeddings:
            self.lm_head = decoder.lm_head
        self.bucket = bucket
        self.logits = logits
        self.config = hf_config(decoder.card)
        self.generation_config = transformers.GenerationConfig.from_model_config(self.config)
        self.model_tags: list[str] = []
        self._sampler = None  # generate's Engine, built on first use
        self.train(decoder.training)

    # -- what trainers read --------------------------------------------------------

    @property
    def decoder(self) -> nn.Module:
        return self._decoder

    @property
    def card(self):
        return self._decoder.card

    @property
    def device(self) -> torch.device:
        return self._decoder.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (trainable weights are float32 masters)."""
        return self._decoder.dtype

    @property
    def base_model(self) -> _Backbone:
        return _Backbone(self)

    def get_output_embeddings(self) -> _Head:
        return _Head(self._decoder)

    def get_input_embeddings(self) -> nn.Module:
        return self._decoder.model.embed_tokens

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        skip = {id(self._decoder.model.embed_tokens.weight), id(self._decoder.head_weight)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if id(p) not in skip and (p.requires_grad or not only_trainable))

    def add_model_tags(self, tags: str | Iterable[str]) -> None:
        for tag in [tags] if isinstance(tags, str) else tags:
            if tag not in self.model_tags:
                self.model_tags.append(tag)

    # Activation checkpointing: transformers and TRL call these from gradient_checkpointing
    # (TRL's default is on); the decoder then keeps each block's input alone and computes the
    # block again in backward (Decoder.checkpoint_activations): the same gradients, less memory.
    @property
    def is_gradient_checkpointing(self) -> bool:
        return self._decoder.checkpointing is not None

    is_activation_checkpointing = is_gradient_checkpointing

    def activation_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """Checkpoint every block, keeping a mode the decoder was loaded with ("selective").
        transformers' gradient_checkpointing_kwargs, such as use_reentrant, have no meaning
        here: linnet's checkpointing is non-reentrant."""
        if self._decoder.checkpointing is None:
            self._decoder.checkpoint_activations(True)

    gradient_checkpointing_enable = activation_checkpointing_enable

    def activation_checkpointing_disable(self) -> None:
        self._decoder.checkpoint_activations(False)

    gradient_checkpointing_disable = activation_checkpointing_disable

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A Trainer's resume reads its checkpoint's model.safetensors back: with adapters,
        the trained tensors alone (the frozen base comes from the card), which then leaves
        no trained parameter missing."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        trained = {n for n, p in self.named_parameters() if p.requires_grad}
        missing = [k for k in result.missing_keys if k in trained or not self._decoder.lora]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"CausalLM.load_state_dict: missing {missing[:5]}, unexpected "
                               f"{result.unexpected_keys[:5]}")
        return type(result)(missing, result.unexpected_keys)

    # -- module plumbing: the decoder (buffers, training flag) follows the wrapper ---------

    def _apply(self, fn, recurse=True):
        self._decoder._apply(fn, recurse)
        return self

    def train(self, mode: bool = True):
        self.training = mode
        self._decoder.train(mode)
        return self

    # -- the call -----------------------------------------------------------------

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                num_items_in_batch=None, logits: bool | None = None, **kwargs) -> CausalLMOutput:
        """The loss (labels given) and/or the logits (logits=True), as transformers' causal
        LMs return them. Extra keys: `shift_labels` (pre-shifted labels), and the keys
        trainers send that a packed call ignores (use_cache, cu_seq_lens_*, …)."""
        shift_labels = kwargs.pop("shift_labels", None)
        _refuse_extras(kwargs, "forward")
        if input_ids is None:
            raise ValueError("CausalLM: input_ids are required (inputs_embeds are not supported)")
        want_logits = self.logits if logits is None else bool(logits)
        has_labels = labels is not None or shift_labels is not None
        if not has_labels and not want_logits:
            raise ValueError(
                "CausalLM got no labels: pass labels for the loss, or logits=True (CausalLM(model, "
                "logits=True) or model(..., logits=True)) for [B, T, V] logits, which a Trainer's "
                "compute_metrics and TRL's return_outputs need; label_smoothing_factor and "
                "compute_loss_func need logits with gradients and are not supported"
            )
        if want_logits and not has_labels and self.training and torch.is_grad_enabled():
            raise ValueError(
                "CausalLM computes logits without gradients, so a loss built from them in training "
                "(label_smoothing_factor, compute_loss_func, a custom compute_loss) cannot train the "
                "model; pass labels and use the model's own loss instead"
            )
        batch = pack_batch(input_ids, attention_mask, position_ids, labels, shift_labels,
                           bucket=self.bucket, trim=not want_logits)
        loss = out = None
        if not want_logits:
            total, count = self._decoder.loss_packed(batch.row)
        else:
            h_PD = self._decoder.hidden_packed(batch.row)
            head = self._decoder.head_weight
            if has_labels:
                weights = torch.from_numpy(batch.row.weights).to(h_PD.device)
                targets = torch.from_numpy(batch.row.targets).to(h_PD.device)
                total, count = linear_cross_entropy(h_PD, head, targets, weights), weights.sum()
            with torch.no_grad():
                h_PD = h_PD.detach()[: batch.row.real]
                out = _unpack((h_PD @ head.to(h_PD.dtype).T).float(), batch)
        if has_labels:
            if num_items_in_batch is not None:
                denominator = torch.as_tensor(num_items_in_batch, device=total.device).to(total.dtype)
            else:
                denominator = count.clamp(min=1)
            loss = total / denominator
        return CausalLMOutput(loss=loss, logits=out)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
        """[B, T, D] final hidden states in the input's layout (zeros at padding), from the
        decoder's `hidden_packed` over the unpadded, packed row."""
        _refuse_extras(kwargs, "base_model")
        batch = pack_batch(input_ids, attention_mask, position_ids, bucket=self.bucket, trim=False)
        return _unpack(self._decoder.hidden_packed(batch.row), batch)

    # -- saving -------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, *, is_main_process: bool = True,
                        state_dict=None, safe_serialization: bool = True, dtype=None, **kwargs) -> None:
        """A directory transformers loads (model.safetensors, config.json, tokenizer files
        of the card), or, when the decoder has LoRA adapters, a PEFT adapter directory
        (adapter_config.json + adapter_model.safetensors) for the card's base weights, with
        the trained tensors under their names here too (model.safetensors, which a Trainer's
        resume_from_checkpoint loads). `transformers.Trainer.save_model` and its checkpoints
        call this (CausalLM is a PreTrainedModel to the Trainer), so they write the same.
        dtype: of the saved full weights (default: the compute dtype)."""
        if kwargs:
            raise TypeError(f"CausalLM.save_pretrained: {', '.join(kwargs)} not supported")
        if state_dict is not None or not safe_serialization:
            raise ValueError("CausalLM.save_pretrained writes the decoder's own weights as safetensors; "
                             "state_dict= and safe_serialization=False are not supported")
        if not is_main_process:
            return
        directory = Path(save_directory)
        if self._decoder.lora:
            from safetensors.torch import save_file

            from linnet.files.atomic import atomic_path
            from linnet.torch.lora import save_peft

            save_peft(self._decoder, directory)
            # what a Trainer's resume_from_checkpoint reads back: the trained tensors by their names here
            trained = {n: p.detach().to("cpu").contiguous() for n, p in self.named_parameters() if p.requires_grad}
            with atomic_path(directory / "model.safetensors") as tmp:
                save_file(trained, str(tmp), metadata={"format": "pt"})
            return
        self._decoder.save_weights(directory, dtype=dtype)
        # The trainers align special tokens with the tokenizer on self.config; keep that.
        config = json.loads((directory / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            config[key] = getattr(self.config, key, config.get(key))
        write_text(directory / "config.json", json.dumps(config, indent=2) + "\n")
        write_text(directory / "generation_config.json", self.generation_config.to_json_string())

    # -- generation ---------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int | None = None,
                 do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
                 pad_token_id: int | None = None, num_return_sequences: int | None = None,
                 generation_config=None, generator: torch.Generator | None = None, **kwargs) -> torch.Tensor:
        """[B * n, T + new] prompts followed by their continuations, as transformers'
        `generate` returns them (rows that stopped are filled with pad_token_id; each
        prompt's n = num_return_sequences samples in consecutive rows, the prompt passing
        the model once for all n). Prompts in a batch must be padded on the left; each
        needs one real token at least.

        Sampled by a `linnet.serve.Engine` (KV cache) over a frozen copy of the decoder,
        built on the first call and kept; every call copies the decoder's current weights
        into it (adapters merged), so generation follows training."""
        gc = generation_config or self.generation_config
        _refuse_generation(gc, kwargs)
        ids = torch.as_tensor(input_ids, device=self.device)
        ids = ids[None] if ids.ndim == 1 else ids
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask, device=ids.device)
        mask = mask[None] if mask.ndim == 1 else mask
        if (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError("CausalLM.generate: prompts are padded on the right; pad them on the left "
                             "(tokenizer.padding_side = 'left')")
        if not mask[:, -1].all():
            raise ValueError(f"CausalLM.generate: row {int((mask[:, -1] == 0).nonzero()[0])} is all padding; "
                             "every prompt needs at least one token (its bos token, if nothing else)")

        def setting(value, name):
            value = getattr(gc, name, None) if value is None else value
            return _GENERATION_DEFAULTS[name] if value is None else value

        if max_new_tokens is None:
            max_new_tokens = gc.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = setting(None, "max_length") - ids.shape[1]
        if max_new_tokens < 1:
            return ids
        eos = gc.eos_token_id if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = pad_token_id if pad_token_id is not None else gc.pad_token_id
        pad = pad if pad is not None else (eos[0] if eos else 0)
        sampled = setting(do_sample, "do_sample")
        n = setting(num_return_sequences, "num_return_sequences")
        if n > 1 and not sampled:
            raise ValueError(f"CausalLM.generate: num_return_sequences={n} needs do_sample=True (greedy "
                             "decoding gives one sequence a prompt)")
        done = self._engine().sample(
            [row[m != 0].tolist() for row, m in zip(ids, mask)], n=n, max_new_tokens=max_new_tokens,
            temperature=setting(temperature, "temperature") if sampled else 0.0,
            top_k=setting(top_k, "top_k"), top_p=setting(top_p, "top_p"), stop=eos, generator=generator)
        new = ids.new_full((len(done), max(len(c.tokens) for c in done)), pad)
        for b, c in enumerate(done):
            new[b, : len(c.tokens)] = torch.tensor(c.tokens)
        return torch.cat([ids.repeat_interleave(n, dim=0), new], dim=1)

    def _engine(self):
        """The generation engine with the decoder's current weights; rebuilt when the
        decoder has moved to another device or dtype."""
        from linnet.torch.engine import Engine

        d, engine = self._decoder, self._sampler
        if engine is None or engine.model.device != d.device or engine.model.dtype != d.dtype:
            engine = self._sampler = Engine(_frozen_copy(d))
        engine.load_weights(d)
        return engine


def _frozen_copy(decoder):
    """An empty frozen decoder like `decoder` (card, compute dtype, device, attention path):
    frozen weights are stored in the compute dtype, and `Engine.load_weights` fills them all."""
    from linnet.torch.model import Decoder

    with torch.device("meta"):
        copy = Decoder(decoder.card, dtype=decoder.dtype, attention=decoder.attention)
        copy.set_trainable(False)
    copy.to_empty(device=decoder.device)
    copy.inv_freq = decoder.inv_freq.clone()
    return copy


# transformers' values for the generation settings a GenerationConfig leaves unset
# (transformers 5 keeps them None in the config and fills them in at generate time)
_GENERATION_DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                        "num_return_sequences": 1}
# Settings the engine has no counterpart for, accepted only at their "off" value.
_GENERATION_OFF = {"num_beams": 1, "repetition_penalty": 1.0, "min_new_tokens": 0,
                   "no_repeat_ngram_size": 0, "min_p": 0.0, "return_dict_in_generate": False}
# What generate takes, and the fix for a keyword it refuses.
_GENERATE_TAKES = ("generate takes input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, "
                   "top_p, eos_token_id, pad_token_id, num_return_sequences, generation_config and generator",
                   "drop it from the call")


def _refuse_generation(gc, kwargs: dict[str, Any]) -> None:
    """Refuse what generate cannot do, naming what it can: a setting the engine lacks,
    given as an argument or in `gc`, other than off (beam search, penalties), or a
    keyword generate does not take."""
    for name, off in _GENERATION_OFF.items():
        given = name in kwargs
        value = kwargs.pop(name) if given else getattr(gc, name, None)
        if value is not None and value != off:
            raise ValueError(f"CausalLM.generate: {name if given else 'generation_config.' + name}={_short(value)} "
                             "is not supported (greedy or sampled decoding only: do_sample, temperature, top_k, "
                             f"top_p, num_return_sequences); set it to {off!r} or leave it out")
    kwargs.pop("use_cache", None)
    _refuse_extras(kwargs, "generate", _GENERATE_TAKES)


def hf_config(card) -> transformers.PretrainedConfig:
    """The transformers config of a card (`Card.hf_config()` as a config object)."""
    fields = card.hf_config()
    config = transformers.AutoConfig.for_model(**fields)
    config._name_or_path = card.weights.path or card.weights.repo or ""
    return config
