"""Attention for packed sequences without flash-attn: ``attn_implementation=odc_varlen``.

verl packs a microbatch's sequences into one row (``use_remove_padding=True``) and, with
flash-attn installed, attends inside each sequence with its variable-length kernel. Where
flash-attn is not installed, transformers' ``sdpa`` builds a dense block-diagonal mask of the
packed row (tokens squared per layer) and attends through it: on an H200 that made a step of
the SFT comparison about ten times slower than its matmuls. This module registers PyTorch's
own variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``, causal, one
call per layer) with transformers' ``AttentionInterface`` and no mask
(``AttentionMaskInterface``), for both engines of examples/recipes/verl_sft.py on GPUs. Loaded
through verl's ``VERL_USE_EXTERNAL_MODULES``; the sequence starts are where ``position_ids`` is 0.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

NAME = "odc_varlen"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     position_ids=None, **kwargs):
    """``query`` (1, heads, tokens, dim), ``key``/``value`` (1, kv heads, tokens, dim) of one
    packed row; returns (1, tokens, heads, dim)."""
    from torch.nn.attention.varlen import varlen_attn

    if query.shape[0] != 1 or position_ids is None:
        raise ValueError(f"{NAME}: expects one packed row with position_ids (use_remove_padding=True)")
    tokens = query.shape[2]
    starts = torch.nonzero(position_ids.reshape(-1) == 0).flatten().tolist() + [tokens]
    longest = max(b - a for a, b in zip(starts[:-1], starts[1:]))
    cu = torch.tensor(starts, dtype=torch.int32).to(query.device, non_blocking=True)
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest,
                      scale=scaling, window_size=(-1, 0))
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, varlen_attention)
AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)
