"""Cost models: what a packed microbatch costs, from the lengths of its documents. Any callable
mapping a list of document lengths to a finite cost >= 0 works (:data:`CostModel`);
:class:`TransformerCost` counts the training FLOPs of a dense decoder-only transformer from its
config, and :class:`FittedCost` is fitted to measured times."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ._checks import _check_lengths, _check_positive_int

#: A cost model maps the document lengths of one packed microbatch to its cost (FLOPs,
#: seconds, any unit). It is also called with the empty list (the fixed cost of a
#: microbatch, 0 if none). It must return a finite value >= 0 and should not decrease
#: when a document is added.
CostModel = Callable[[Sequence[int]], float]


def _eval_cost(cost: CostModel, lengths: Sequence[int]) -> float:
    value = float(cost(lengths))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost model returned {value!r} for document lengths {list(lengths)}; "
                         "costs must be finite and >= 0")
    return value


@dataclass(frozen=True)
class TransformerCost:
    """Training FLOPs of a packed microbatch of a dense decoder-only transformer.

    ``cost(lengths) = sum_i (flops_per_token * n_i + attention_flops(n_i))``:

    * linear term: every token passes through the matmul weights once per layer, plus
      the LM head; 2 FLOPs per multiply-add, times ``linear_training_factor`` for
      forward + backward (3: the backward pass costs two forwards; the usual "6 x
      parameters per token"; use 4 with activation recomputation);
    * attention term: per layer, each (query, key) pair costs ``4 * num_heads *
      head_dim`` forward FLOPs (``QK^T`` and ``PV``); a causal document of length n has
      ``n (n + 1) / 2`` pairs (``n^2`` when ``causal=False``); documents packed together
      do not attend to each other. ``attention_training_factor`` is 3.5 by default:
      a flash-attention backward recomputes ``QK^T`` and runs four more matmuls.

    Norms, activations, softmax and the embedding lookup are ignored. Mixture-of-experts
    layers are not modelled (set ``intermediate_size`` to the active experts' total).
    """

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    num_kv_heads: int | None = None  # None: same as num_heads (no grouped-query attention)
    head_dim: int | None = None  # None: hidden_size // num_heads
    gated_mlp: bool = True  # SwiGLU-style MLP with three matrices (Llama, Qwen, Mistral)
    causal: bool = True
    linear_training_factor: float = 3.0
    attention_training_factor: float = 3.5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "vocab_size"):
            _check_positive_int(getattr(self, name), name)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _check_positive_int(self.num_kv_heads, "num_kv_heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                                 f"num_heads={self.num_heads}; pass head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive_int(self.head_dim, "head_dim")
        for name in ("linear_training_factor", "attention_training_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> TransformerCost:
        """Build from a transformers-style config object (read with ``getattr``).

        Reads ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
        ``num_attention_heads``, ``vocab_size`` and, when present, ``num_key_value_heads``
        and ``head_dim``; a multimodal config's ``text_config`` is used when present.
        Keyword ``overrides`` replace any field (e.g. ``gated_mlp=False`` for GPT-style
        MLPs, or a value the config lacks).
        """
        config = getattr(config, "text_config", None) or config
        fields = {
            "hidden_size": "hidden_size",
            "num_layers": "num_hidden_layers",
            "intermediate_size": "intermediate_size",
            "num_heads": "num_attention_heads",
            "vocab_size": "vocab_size",
            "num_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim",
        }
        optional = {"num_kv_heads", "head_dim"}
        kwargs: dict[str, Any] = {}
        for field_name, attr in fields.items():
            if field_name in overrides:
                continue
            value = getattr(config, attr, None)
            if value is None and field_name not in optional:
                raise ValueError(f"config has no {attr!r}; pass {field_name}=... to from_hf_config")
            kwargs[field_name] = value
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def params_per_token(self) -> int:
        """Matmul weights each token passes through (all layers plus the LM head)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp) + self.hidden_size * self.vocab_size

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token of the linear (length-independent) part."""
        return 2.0 * self.linear_training_factor * self.params_per_token

    @property
    def flops_per_token_pair(self) -> float:
        """Training FLOPs per attended (query, key) pair, all layers."""
        return 4.0 * self.attention_training_factor * self.num_layers * self.num_heads * self.head_dim

    def attention_flops(self, length: int) -> float:
        """Training FLOPs of the attention scores/values of one document."""
        pairs = length * (length + 1) / 2 if self.causal else float(length * length)
        return self.flops_per_token_pair * pairs

    def __call__(self, lengths: Sequence[int]) -> float:
        return sum(self.flops_per_token * n + self.attention_flops(n) for n in lengths)


@dataclass(frozen=True)
class FittedCost:
    """Measured cost: ``a + b * sum(lengths) + c * sum(length ** 2)`` (e.g. seconds).

    ``a`` is the fixed cost of a microbatch (for FSDP: the parameter gathers, kernel
    launches), ``b`` the per-token cost, ``c`` the attention's quadratic cost. The empty
    microbatch costs ``a``.
    """

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

    def __call__(self, lengths: Sequence[int]) -> float:
        return self.a + self.b * sum(lengths) + self.c * sum(n * n for n in lengths)

    @classmethod
    def fit(cls, samples: Iterable[tuple[Sequence[int], float]]) -> FittedCost:
        """Least-squares fit on measured ``(document lengths, cost)`` pairs.

        The samples must vary both the total token count and how it is split into
        documents, or ``b`` and ``c`` cannot be told apart (``ValueError``). Noisy data
        can give negative coefficients; check the fit before using it.
        """
        import numpy as np

        rows, targets = [], []
        for k, (lengths, measured) in enumerate(samples):
            lengths = _check_lengths(lengths, name=f"samples[{k}] lengths")
            measured = float(measured)
            if not math.isfinite(measured):
                raise ValueError(f"samples[{k}] cost {measured!r} is not finite")
            rows.append([1.0, float(sum(lengths)), float(sum(n * n for n in lengths))])
            targets.append(measured)
        if len(rows) < 3:
            raise ValueError(f"need at least 3 samples to fit a, b, c, got {len(rows)}")
        design = np.asarray(rows)
        scale = np.abs(design).max(axis=0)
        scale[scale == 0] = 1.0  # an all-zero column makes the system rank-deficient below
        coef, _, rank, _ = np.linalg.lstsq(design / scale, np.asarray(targets), rcond=None)
        if rank < 3:
            raise ValueError("samples do not determine a, b, c: vary both the total tokens "
                             "and the document lengths")
        a, b, c = (coef / scale).tolist()
        return cls(a, b, c)
