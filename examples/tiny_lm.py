"""The small decoder-only transformer of the examples, the recipes and the tests.

``TinyLM(vocab, d_model, heads, layers, seq)`` is the example's model: learned positions,
LayerNorm, biases everywhere but the output head, weights drawn from N(0, 0.02). The FSDP
unit is ``Block``. Weights are drawn in registration order from torch's generator: seed it
before building for the same weights on every rank and in every run.

The keyword options give the tests' variant (tests/fsdp_models.py): no position embedding
(``seq=None``), an MLP width of its own, norm types alternating over the blocks, no bias in
``qkv``, a bias in the head, PyTorch's default initialisation (``init_std=None``) and
logits flattened to (batch * seq, vocab) by a 2-D matmul.

Importable from a script in ``examples/`` as it is, and from elsewhere with ``examples/``
on ``sys.path``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, *, mlp: int | None = None,
                 norm: Callable[[int], nn.Module] = nn.LayerNorm, qkv_bias: bool = True):
        super().__init__()
        mlp = mlp or 4 * d_model
        self.heads = heads
        self.ln1 = norm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=qkv_bias)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = norm(d_model)
        self.fc1 = nn.Linear(d_model, mlp)
        self.fc2 = nn.Linear(mlp, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # padding (if any) is at the end
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """``seq``: positions learned (None: no position embedding). ``norms``: the norm type of
    block i is ``norms[i % len(norms)]``, the final norm's is ``norms[0]``. ``init_std``:
    Linear and Embedding weights drawn from N(0, init_std) with zero biases (None: PyTorch's
    default initialisation). ``flat_logits``: (batch * seq, vocab) instead of (batch, seq, vocab)."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int | None = None, *,
                 mlp: int | None = None, norms: Sequence[Callable[[int], nn.Module]] = (nn.LayerNorm,),
                 qkv_bias: bool = True, head_bias: bool = False, init_std: float | None = 0.02,
                 flat_logits: bool = False):
        super().__init__()
        self.flat_logits = flat_logits
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model) if seq is not None else None
        self.blocks = nn.ModuleList(Block(d_model, heads, mlp=mlp, norm=norms[i % len(norms)], qkv_bias=qkv_bias)
                                    for i in range(layers))
        self.ln_f = norms[0](d_model)
        self.head = nn.Linear(d_model, vocab, bias=head_bias)
        if init_std is not None:
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=init_std)
                    if getattr(m, "bias", None) is not None:
                        nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        # flattened before the head: a 2-D matmul's output, not a view (FSDP warns of views)
        return self.head(x.flatten(0, 1) if self.flat_logits else x)
