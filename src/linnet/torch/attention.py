"""Causal attention over packed rows whose documents never see each other.

Shapes: H query heads, K key/value heads, P positions of a packed row, d head dim.
Every path takes q [1, H, P, d], k and v [1, K, P, d] and the row's document offsets
`bounds` (host ints: 0 = b0 < b1 < … < bn = P; padding at the end is a document of its
own) and returns [1, H, P, d]. Rows with shared prompts (`linnet.packing.pack_prompted`)
also pass `prefix`: for each document, the earlier document whose keys it sees in full
before its own (its prompt), or -1; every path but varlen takes it.

Paths (bench/attention.md has the measurements behind `choose`: on CPU the per-document loop
beat every dense variant in all 24 cases, a row filled by one document included):
  documents  one causal SDPA call per document: no wasted work, a Python loop (in f32
             on CPU for bf16/f16 inputs: faster there).
  dense      one SDPA call with a [P, P] block-diagonal causal mask: one kernel,
             but P² work most of which is masked out.
  flex       flex_attention with a block mask; compiled. Forward only on CPU.
  varlen     torch's variable-length flash attention; CUDA only.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
import torch.nn.functional as F

PATHS = ("auto", "documents", "dense", "flex", "varlen")


@torch.compiler.disable  # document lengths vary per row: keep them out of compiled graphs
def documents(q, k, v, bounds: list[int], prefix: list[int] | None = None):
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        # torch's CPU flash attention is slower in bf16 than in f32, its backward above all:
        # f32 made bf16 steps 1.04-1.18x faster (bench/RESULTS.md), at no measured memory cost
        return _documents(q.float(), k.float(), v.float(), bounds, prefix).to(q.dtype)
    return _documents(q, k, v, bounds, prefix)


def _documents(q, k, v, bounds: list[int], prefix: list[int] | None):
    gqa = q.shape[1] != k.shape[1]
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    if len(set(lengths)) == 1 and len(lengths) > 1 and prefix is None:
        # equal documents (pretraining sequences): one batched call, documents as the batch
        n_tokens, n = lengths[0], len(lengths)

        def split(x):
            return x[0].unflatten(1, (n, n_tokens)).transpose(0, 1)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, enable_gqa=gqa)
        return out.transpose(0, 1).flatten(1, 2)[None]
    # split, not slices: a slice's backward fills a zero gradient of the whole row for
    # every document, split's concatenates once (bench/attention.md: 1.4x on average)
    qs, ks, vs = q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2)
    outs = []
    for j, (qd, kd, vd) in enumerate(zip(qs, ks, vs)):
        i = -1 if prefix is None else prefix[j]
        if i < 0:
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa))
            continue
        # the prompt's keys in full, then causal over the document's own
        seen, n = lengths[i], lengths[j]
        mask = torch.ones(n, seen + n, dtype=torch.bool, device=q.device).tril_(seen)
        outs.append(F.scaled_dot_product_attention(qd, torch.cat((ks[i], kd), 2), torch.cat((vs[i], vd), 2),
                                                   attn_mask=mask, enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def document_ids(bounds: list[int], device) -> torch.Tensor:
    """[P] index of the document each position belongs to."""
    lengths = torch.tensor([e - s for s, e in zip(bounds[:-1], bounds[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def _may_attend(doc, prefix: list[int] | None, device):
    """(query index, key index) -> bool over [P] document ids: same document and not
    later, or the key in the query's prompt document."""
    seen = None if prefix is None else torch.tensor(prefix, device=device)[doc]  # [P] each query's prompt doc

    def allowed(qi, ki):
        own = (doc[qi] == doc[ki]) & (ki <= qi)
        return own if seen is None else own | (seen[qi] == doc[ki])
    return allowed


def block_causal_mask(bounds: list[int], device, prefix: list[int] | None = None) -> torch.Tensor:
    """[P, P] boolean: True where query i may attend key j (same document, j <= i; or j
    in i's prompt document)."""
    doc = document_ids(bounds, device)
    idx = torch.arange(len(doc), device=device)
    return _may_attend(doc, prefix, device)(idx[:, None], idx[None, :])


def dense(q, k, v, bounds: list[int], prefix: list[int] | None = None):
    mask = block_causal_mask(bounds, q.device, prefix)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=4)
def _flex_mask(bounds: tuple[int, ...], prefix: tuple[int, ...] | None, device: torch.device):
    """The row's BlockMask, built once for all the layers that attend over it."""
    from torch.nn.attention.flex_attention import create_block_mask

    allowed = _may_attend(document_ids(list(bounds), device), None if prefix is None else list(prefix), device)

    def mask_mod(b, h, qi, ki):
        return allowed(qi, ki)

    return create_block_mask(mask_mod, None, None, bounds[-1], bounds[-1], device=device)


def flex(q, k, v, bounds: list[int], prefix: list[int] | None = None):
    mask = _flex_mask(tuple(bounds), None if prefix is None else tuple(prefix), q.device)
    return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def varlen(q, k, v, bounds: list[int], prefix: list[int] | None = None):
    from torch.nn.attention.varlen import varlen_attn

    if prefix is not None:
        raise ValueError("attention='varlen' does not take shared prompts; pack with share=False "
                         "(linnet.torch.attention.shares_prompts says which paths do)")
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    out = varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, longest, longest,
                      **varlen_causal(varlen_attn, gqa=q.shape[1] != k.shape[1]))
    return out.transpose(0, 1)[None]


def varlen_causal(varlen_attn, gqa: bool) -> dict:
    """varlen_attn's keywords for causal attention in this torch: `window_size=(-1, 0)`
    where it has it (2.11 on), else `is_causal`; `enable_gqa` where it asks for it before
    taking fewer key/value heads (the flash kernels take them either way)."""
    params = inspect.signature(varlen_attn).parameters
    options = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        options["enable_gqa"] = gqa
    return options


@functools.cache
def has_varlen() -> bool:
    """Whether this torch has `torch.nn.attention.varlen` (2.10 on)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def shares_prompts(path: str, device: torch.device) -> bool:
    """Whether `path` takes rows whose completions share their prompt (prefix)."""
    return choose(path, device) is not varlen


def choose(path: str, device: torch.device, *, training: bool = False):
    """The attention function for `path`; "auto" takes the fastest measured one that
    supports training on `device` (bench/attention.py). `training`: the model trains, so
    a path without a backward pass on `device` (flex on a CPU) is refused."""
    if path == "auto":
        path = "varlen" if device.type == "cuda" and has_varlen() else "documents"
    if path == "flex" and training and device.type == "cpu":
        raise ValueError("attention='flex' cannot train on a CPU (FlexAttention has no backward pass there); use "
                         "'documents' or 'dense' on a CPU, or train with 'flex' on CUDA")
    if path == "varlen" and device.type != "cuda":
        raise ValueError("attention='varlen' needs CUDA; use 'documents' or 'dense' on CPU")
    if path == "varlen" and not has_varlen():
        raise ValueError(f"attention='varlen' needs torch 2.10 or later (torch.nn.attention.varlen); this is torch "
                         f"{torch.__version__}: use 'documents'")
    try:
        return {"documents": documents, "dense": dense, "flex": flex, "varlen": varlen}[path]
    except KeyError:
        raise ValueError(f"unknown attention path {path!r}; choose one of {', '.join(PATHS)}") from None
