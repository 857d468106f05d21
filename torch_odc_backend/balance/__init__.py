"""Workload balancing for variable-length training: which samples each data-parallel rank
trains in a minibatch, packed into which token-capped microbatches. Cost models
(:mod:`.cost`) price a microbatch from its documents' lengths; :mod:`.partition` splits costs
into near-equal groups and packs samples into microbatches; :mod:`.plan` spreads a minibatch
over the ranks as LB-Micro (equal counts, balanced per synchronous step) or LB-Mini (balanced
totals, one synchronisation per minibatch) and predicts the times; :mod:`.samplers` delivers
plans through a DataLoader; :mod:`.dynamic` (decoupled mode only) lets ranks take work as they
become free. Every planning function is deterministic: all ranks compute the identical plan
from the same inputs, so no communication is needed to agree on it."""
from __future__ import annotations

from .cost import CostModel, FittedCost, TransformerCost
from .dynamic import DynamicBalancer, DynamicBatchSampler, MinibatchClaims
from .dynamic import _odc_backend_of  # noqa: F401 - benchmarks reach a group's odc backend through it
from .partition import greedy_partition, karmarkar_karp, optimal_partition, pack
from .plan import Plan, balance_bound, lb_micro, lb_mini, lb_mini_weighted, microbatches, plan_stats
from .samplers import BalancedBatchSampler, MicrobatchDataset, MinibatchDataset

__all__ = [
    "CostModel",
    "TransformerCost",
    "FittedCost",
    "pack",
    "karmarkar_karp",
    "greedy_partition",
    "optimal_partition",
    "lb_micro",
    "lb_mini",
    "plan_stats",
    "microbatches",
    "BalancedBatchSampler",
    "MinibatchDataset",
    "lb_mini_weighted",
    "DynamicBalancer",
    "MinibatchClaims",
    "DynamicBatchSampler",
    "MicrobatchDataset",
    "balance_bound",
]
