"""QLoRA's frozen base (Dettmers et al. 2023, arXiv:2305.14314): every block's linear
weight, and a mixture of experts' stacked expert tensors, stored as 4-bit NormalFloat with
double quantization, through bitsandbytes.

Each block of 64 weights keeps a 4-bit code per weight and one absmax; the absmaxes are
themselves quantized to 8 bits in blocks of 256 with one float32 constant per block:
about 0.52 bytes per weight. The layer computes with bitsandbytes' `matmul_4bit`, which
dequantizes the weight for the product and saves only the 4-bit form for backward, so no
full-precision copy of a frozen weight outlives its layer. Embeddings, norms and the
output head stay in the compute dtype, as in the paper and in PEFT. A stacked experts'
tensor [count, out, in] is quantized an expert at a time (codes [count, out x in / 2], one
state an expert), so each expert's product dequantizes its own weight alone.

Why bitsandbytes and not torchao's NF4 tensor (both installed here, both run on CPU and
CUDA): torchao requires every weight's size to divide by 64 x 256 (SmolLM2-135M's
192 x 576 key projection and every small test model fail), and on this project's CPU its
dequantization of a 2048 x 2048 weight took 27 ms against bitsandbytes' 1.9 ms.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

BLOCK = 64  # weights per absmax
QUANTIZE = ("nf4",)


@contextmanager
def _quiet(*names: str):
    """bitsandbytes logs, at import, which optional kernels it did not find: not ours to show."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def bitsandbytes():
    """The bitsandbytes module, or an error that says how to install it."""
    try:
        with _quiet("bitsandbytes", "bitsandbytes.cextension", "root"):
            import bitsandbytes
    except ImportError as e:
        raise ModuleNotFoundError("quantize='nf4' and the 8-bit optimizer need bitsandbytes: "
                                  "pip install 'linnet[qlora]'") from e
    return bitsandbytes


def is_quantized(layer) -> bool:
    """Whether a module stores its weight (or its stacked experts) as NF4 codes."""
    return getattr(layer, "quant_state", None) is not None


def quant_states(model) -> dict:
    """{path: quantization state} of the weights stored as NF4 codes, which cannot train or
    take plain weights (a stacked experts' tensor: a list, one state an expert)."""
    found = {}
    for name, m in model.named_modules():
        state = getattr(m, "quant_state", None)
        if isinstance(state, dict):
            found.update({f"{name}.{tensor}": each for tensor, each in state.items()})
        elif state is not None:
            found[f"{name}.weight"] = state
    return found


def nf4(weight: torch.Tensor, dtype: torch.dtype):
    """(codes, state): the frozen NF4 form of `weight`, quantized from `dtype` (the compute
    dtype, which it dequantizes to), on the weight's device. The codes are a plain uint8
    parameter (the packed 4-bit pairs, [out * in / 2, 1]) and the layer keeps the state, so
    anything that moves plain tensors (FSDP's split and gather, checkpoints) moves them."""
    codes, state = bitsandbytes().functional.quantize_4bit(
        weight.detach().to(dtype), blocksize=BLOCK, compress_statistics=True, quant_type="nf4")
    return nn.Parameter(codes, requires_grad=False), state


def quantize_into(module: nn.Module, name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The NF4 codes of `weight` for `module.<name>`, its state kept on the module: a linear
    layer's one, or for stacked experts [count, out, in] one an expert, under
    `module.quant_state[name]`."""
    if weight.dim() == 2:
        codes, module.quant_state = nf4(weight, dtype)
        return codes
    pairs = [nf4(w, dtype) for w in weight]
    module.quant_state = {**(module.quant_state or {}), name: [state for _, state in pairs]}
    return torch.stack([codes.detach().view(-1) for codes, _ in pairs])


def dense(weight: torch.Tensor, state=None) -> torch.Tensor:
    """A weight as an ordinary tensor: NF4 codes (with their `state`, or an expert's list)
    dequantized to the dtype they were quantized from, any other weight as it is."""
    if state is None:
        return weight
    if isinstance(state, list):
        return torch.stack([dense(codes.view(-1, 1), each) for codes, each in zip(weight, state, strict=True)])
    return bitsandbytes().functional.dequantize_4bit(weight, state)


def move_states(module: nn.Module, device: torch.device) -> None:
    """Move a quantized module's states (a linear layer's, or its experts') to `device`."""
    state = module.quant_state
    for each in state.values() if isinstance(state, dict) else [[state]]:
        for one in each:
            one.to(device)


def linear_4bit(x: torch.Tensor, codes: torch.Tensor, state) -> torch.Tensor:
    """x @ W.T for an NF4 weight; backward dequantizes W again rather than keeping it."""
    return bitsandbytes().matmul_4bit(x, codes.t(), state)


def quantized_bytes(model) -> int:
    """Bytes the quantized weights take: codes, absmaxes and their own constants (this
    process's part of codes split by fully_shard)."""
    params, total = dict(model.named_parameters()), 0
    for name, state in quant_states(model).items():
        codes = params[name]
        total += (codes.to_local() if isinstance(codes, DTensor) else codes).numel()
        for s in state if isinstance(state, list) else [state]:
            parts = [s.absmax] + ([s.state2.absmax, s.offset] if s.nested else [])
            total += sum(t.numel() * t.element_size() for t in parts)
    return total
