#!/usr/bin/env python3
"""Predicted step time of NCCL + LB-Micro and odc decoupled + LB-Mini from 2 to 512 GPUs.

    python benchmarks/scale_model.py            # writes <out-dir>/scale_model_<date>.json
    python benchmarks/scale_model.py --quick    # fewer minibatches and world sizes (a smoke run)

No GPU: an analytical model fed with what the repository measured (2 and 4 x H200) and with
published network bandwidths, checked against the measured 2- and 4-GPU runs of
``benchmarks/train_imbalanced.py`` (validation rows), then evaluated on the same long-tailed
workload at 2-512 GPUs. It is a model, not a measurement; every assumption is listed here.

Workload. The end-to-end benchmark's: Qwen2-1.5B shape (``train_imbalanced.QWEN2_1_5B``,
1 543 714 304 parameters: 28 decoder layers of 46 797 824, the tied embedding and final norm
233 375 232), documents from ``train_imbalanced.make_documents`` (lognormal, mean 16 500
tokens, capped at 65 536), 4 documents per rank per minibatch (``--docs-per-rank``), microbatches
of at most 65 536 tokens. Minibatch s uses seed 1000 + s (as ``balance_sim.py``). Plans come from
the real planners: ``balance.lb_micro`` (NCCL), ``balance.lb_mini`` (decoupled) and, with a
straggler, ``balance.lb_mini_weighted`` (the plan ``DynamicBalancer`` starts from once it has
learned the speeds; no work taking is simulated).

Compute. A microbatch's compute time is ``t_c = a + b * tokens + c * sum(length^2)``. The
scale predictions use the *training fit*: a, b, c fitted to the 23 microbatches that the
4-GPU run at 7f51d93 (``train_imbalanced_nvidia-h200-x4_20261122.json``, the run made after the
cuDNN plan fix) timed in its ``decoupled_local_lbmini`` configuration, where a microbatch waits
on no peer (mean absolute error 0.7 %). Those microbatches ran 5-16 % longer than the same
shapes in the run's own calibration before the runs (``summary.microbatch_time_fit``, mostly
in the attention term c; cause not established), so the validation shows both fits. The
intercept ``a`` is not split into launch and parameter-gather parts: it is poorly determined
(0.004-0.19 s across the runs' calibrations; 0.030 s in the training fit) and the exposed
parameter traffic of a calibration microbatch on NVLink is 3-4 ms by the model below, so the
whole of ``a`` is treated as compute and the parameter traffic is priced separately (double
counting at most those few ms per microbatch). Compute is spread evenly over the layers;
with activation checkpointing a layer's backward (recompute + backward) is 3x its forward:
per layer ``f = t_c / (4 L)`` forward and ``3 f`` backward. A straggler multiplies its t_c.

Communication per microbatch (FSDP2, one parameter group per decoder layer plus the root):
parameters gathered in bf16 (2 bytes), gradients reduced in fp32 (4 bytes). Each layer is
gathered twice per microbatch (forward; backward, which recomputes: reshard after forward),
the root once (FSDP2 keeps the root unsharded after forward). Per-layer sizes: 93.6 MB
gathered, 187.2 MB reduced; root 466.8 MB and 933.5 MB. What moves, per mode
(``docs/decoupled_mode.md``, ``docs/multi_host.md``):

* ``nccl`` (exact FSDP2 on NCCL): per microbatch one all-gather per layer in forward and in
  backward, one reduce-scatter per layer in backward. Ring collectives.
* ``exact`` (odc exact mode): the same operations, odc's measured bandwidths (one host only).
* ``owner`` (decoupled, ``accumulate="owner"``, the default): gets of the owners' published
  shards (what an all-gather moves) and, per layer and microbatch, a put-accumulate of the
  gradient rows into the owners' fp32 accumulators (what a reduce-scatter moves). One host
  only: NVSHMEM has no float atomics, so odc refuses owner mode for peers on other hosts.
* ``local`` (decoupled, ``accumulate="local"``, what decoupled mode uses across hosts): the
  same gets, gradients summed in a local fp32 buffer (no traffic per microbatch), and one
  reduce-scatter of the whole fp32 gradient (4 bytes x 1.54B) inside ``odc.sync``, exposed.

Link times. One host (W <= 8): ``(W - 1) / W * bytes / busbw`` with busbw interpolated (in log
size) from the measured curves: ``collectives_nvidia-h200-x2_20261122.json`` for W = 2,
``collectives_nvidia-h200-x4_20261122.json`` for W >= 4 (8 GPUs are assumed to get the 4-GPU
figures: no 8-GPU machine was measured), odc or NCCL, all-gather or reduce-scatter; reduce-scatter
curves (bf16 in the benchmark) are used for fp32 bytes at equal byte counts. The put-accumulate
adds 483 GB/s of gradient rows (16 blocks per peer, ``accumulate_probe_nvidia-h200-x2_20261122_f32.json``,
assumed the same on 4 and 8 GPUs). Several hosts (8 GPUs each, one NIC of ``B`` = 400 Gb/s per
GPU, taken at ``--nic-efficiency`` of line rate):

* NCCL ring: every ring crosses each host boundary once and NCCL runs one ring per NIC, so a
  NIC carries ``1/8`` of the data a GPU sends: ``max((W-1)/W * bytes / busbw_nvlink,
  (W-1)/W * bytes / (8 B)) + (W - 1) * latency``.
* odc (gets, puts; no hierarchy: every GPU reaches every remote owner through its own NIC):
  ``max(7/W * bytes / busbw_odc_nvlink, (W-8)/W * bytes / B) + latency``: 8x NCCL's network
  bytes. The transfers to W - 1 peers are issued by the host one by one (one lane per peer):
  ``--issue-us`` per peer and operation (10 us: two calls at the ~5 us per launch measured
  on the 4-GPU machine, docs/performance.md "1-4 MiB: fixed cost"), a bound on the microbatch's time.

Networks: ``nvlink`` (one host, W <= 8); ``ib_ndr400``: InfiniBand NDR, one ConnectX-7 at
400 Gb/s per GPU as in DGX H100/H200 (NVIDIA DGX H100 user guide, "Network Connections",
https://docs.nvidia.com/dgx/dgxh100-user-guide/); ``efa_p5``: AWS p5.48xlarge, 3 200 Gbps of
EFA per instance of 8 H100s = 400 Gb/s per GPU (https://aws.amazon.com/ec2/instance-types/p5/,
"EFA configuration for P5", https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html).
Both have the same bandwidth per GPU; the model tells them apart only by the per-transfer
latency, which is an assumption (5 us IB, 15 us EFA: not measured here, not from a spec; the
sensitivity rows multiply it by 4).

Overlap. Per layer a transfer overlaps the neighbouring layer's compute (FSDP2's prefetch):
``t_mb = g_root + L * max(f, g) + L * max(3 f, g + r) + r_root``, g and r a layer's gather and
reduction; the gather of the first layer and the reduction of the last are only exposed
through the root's terms (a few ms at most). In ``local`` mode r = 0. With the host bound:
``t_mb = max(t_mb, host issue time)``. An LB-Micro padding microbatch runs the benchmark's
8-token dummy (``t_c`` of 8 tokens plus the full communication).

Step time (one minibatch):

* synchronous (``nccl``, ``exact``): ``sum over LB-Micro steps of max over ranks of t_mb``
  (per-layer collectives make the step's microbatch as slow as its slowest rank's) + the
  optimizer step;
* decoupled: ``max over ranks of sum of its t_mb`` + ``odc.sync`` + the optimizer step (and
  publishing the new shards). ``odc.sync``: the last rank's sync in the 4-GPU owner run
  (6.6 ms: fence and gradient write-back), plus for ``local`` the reduce-scatter of the fp32
  gradient, plus, across hosts, the latency and one issue per peer;
* optimizer: the 4-GPU run's medians (10 ms NCCL/exact incl. clip_grad_norm, 32 ms decoupled),
  scaled by 4 / W (the shards shrink), at least 2 ms (an assumption).

Reported per W and network: tokens/s (all GPUs) and per GPU for both, ``ratio`` = decoupled
tokens/s / NCCL tokens/s, ``ideal`` = the same ratio with compute alone (the planners' own
prediction), bubble fractions (``1 - useful compute / (W x step)``), the decoupled step's
exposed sync and communication, and the break-even NIC bandwidth per GPU where ``ratio`` = 1.
Variants: a straggler (the last rank 1.3x slower: static LB-Mini and speed-weighted LB-Mini),
other documents per rank, and the sensitivity to latency and NIC efficiency.

Not modelled: congestion and adaptive routing in large fabrics, NCCL's choice of algorithms
other than rings (trees, PAT, NVLS/SHARP), HSDP (every mode here is 1-D FSDP over all GPUs),
per-layer jitter between ranks, the host's own Python overhead, memory, stragglers other than
one fixed slowdown, and dynamic work taking (``balance_sim.py`` models that part).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import _meta
from torch_odc_backend import balance
from train_imbalanced import QWEN2_1_5B, make_documents

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

GPUS_PER_HOST = 8
MAX_TOKENS = 65536
MEAN_LEN = 16500
DUMMY_TOKENS = 8  # the LB-Micro padding microbatch train_imbalanced.py runs
WORLDS = (2, 4, 8, 16, 32, 64, 128, 256, 512)

#: the run whose decoupled_local microbatches give the training fit (and the overheads)
FIT_RUN = "train_imbalanced_nvidia-h200-x4_20261122.json"
FIT_CONFIG = "decoupled_local_lbmini"
#: measured runs to validate against: (file, note)
VALIDATION_RUNS = (
    ("train_imbalanced_nvidia-h200-x4_20261122.json",
     "4 x H200, 7f51d93, 16 long-tailed documents per minibatch, 3 timed; attention plans built "
     "before timing (the cleanest run)"),
    ("train_imbalanced_nvidia-h200-x4_20261122_c69fe4a.json",
     "4 x H200, c69fe4a, same workload; before the cuDNN plan fix (configurations paid for "
     "attention plans unevenly)"),
    ("train_imbalanced_nvidia-h200-x2-docs8_20261122_9b8d173.json",
     "2 x H200, 9b8d173, 8 long-tailed documents per minibatch, 4 timed; before the cuDNN plan fix"),
    ("train_imbalanced_nvidia-h200-x4_balanced_20261122.json",
     "4 x H200, 7f51d93, balanced control (16 documents of 16 500 tokens), 4 timed"),
    ("train_imbalanced_nvidia-h200-x2-docs8_balanced_20261122_9b8d173.json",
     "2 x H200, 9b8d173, balanced control (8 documents of 16 500 tokens), 4 timed"),
)
#: configuration of train_imbalanced.py -> mode of this model
CONFIG_MODE = {"reference_lbmicro": "nccl", "exact_lbmicro": "exact",
               "decoupled_lbmini": "owner", "decoupled_local_lbmini": "local"}
COLLECTIVES = {2: "collectives_nvidia-h200-x2_20261122.json",
               4: "collectives_nvidia-h200-x4_20261122.json"}
ACCUMULATE = "accumulate_probe_nvidia-h200-x2_20261122_f32.json"
ACCUMULATE_BLOCKS = 16  # ODC_ACCUMULATE_BLOCKS default


# --------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Shape:
    """Parameter counts of the FSDP groups: ``layers`` decoder layers and the root."""

    layers: int
    layer_params: int
    root_params: int

    @classmethod
    def qwen2_1_5b(cls, total_params: int = 1_543_714_304) -> Shape:
        s = QWEN2_1_5B
        root = s["vocab_size"] * s["hidden_size"] + s["hidden_size"]  # tied embedding + final norm
        layers = s["num_hidden_layers"]
        if (total_params - root) % layers:
            raise ValueError("parameters do not split evenly over the layers")
        return cls(layers, (total_params - root) // layers, root)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


@dataclass(frozen=True)
class Network:
    name: str
    nic_GBps: float | None  # per GPU, line rate; None: one host (NVLink only)
    latency_s: float  # per network transfer step
    source: str


NETWORKS = {
    "nvlink": Network("nvlink", None, 0.0, "measured busbw, 2 and 4 x H200 (collectives_nvidia-h200-x{2,4}_20261122.json)"),
    "ib_ndr400": Network("ib_ndr400", 50.0, 5e-6,
                         "InfiniBand NDR: one ConnectX-7 400 Gb/s per GPU, as in DGX H100/H200 (NVIDIA DGX "
                         "H100 user guide, https://docs.nvidia.com/dgx/dgxh100-user-guide/); latency assumed"),
    "efa_p5": Network("efa_p5", 50.0, 15e-6,
                      "AWS p5.48xlarge: 3200 Gbps EFA per 8 GPUs = 400 Gb/s per GPU "
                      "(https://aws.amazon.com/ec2/instance-types/p5/); latency assumed"),
}


class Links:
    """Measured one-host bandwidths: busbw curves of odc and NCCL, and the put-accumulate."""

    def __init__(self, results: Path = RESULTS):
        self.curves: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
        self.sources = {}
        for world, name in COLLECTIVES.items():
            data = json.loads((results / name).read_text())
            self.sources[f"collectives_{world}"] = {"file": name, "commit": data.get("commit")}
            for row in data["rows"]:
                if row.get("op") in ("all_gather", "reduce_scatter") and row.get("backend") in ("odc", "nccl"):
                    key = (world, row["backend"], row["op"])
                    self.curves.setdefault(key, []).append((float(row["size_bytes"]), row["busbw_GBps"] * 1e9))
        for points in self.curves.values():
            points.sort()
        acc = json.loads((results / ACCUMULATE).read_text())
        rates = [row["GBps"] for rank in acc["per_rank"] for row in rank if row["blocks"] == ACCUMULATE_BLOCKS]
        self.accumulate_Bps = statistics.mean(rates) * 1e9
        self.sources["accumulate"] = {"file": ACCUMULATE, "blocks": ACCUMULATE_BLOCKS,
                                      "GBps": self.accumulate_Bps / 1e9}

    def busbw(self, world: int, backend: str, op: str, nbytes: float) -> float:
        """Bytes/s, interpolated in log(size) between measured sizes, clamped at the ends."""
        points = self.curves[(2 if world <= 2 else 4, backend, op)]
        if nbytes <= points[0][0]:
            return points[0][1]
        if nbytes >= points[-1][0]:
            return points[-1][1]
        for (s0, b0), (s1, b1) in zip(points, points[1:]):
            if s0 <= nbytes <= s1:
                w = math.log(nbytes / s0) / math.log(s1 / s0)
                return b0 + w * (b1 - b0)
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class Overheads:
    """Per-step costs outside the microbatches, measured in the 4-GPU run (FIT_RUN)."""

    optimizer_sync_s_at4: float  # NCCL / odc exact: clip_grad_norm + AdamW
    optimizer_decoupled_s_at4: float  # the same + publishing the new shards
    sync_fixed_s: float  # odc.sync of the last rank to arrive, owner mode
    optimizer_floor_s: float = 0.002

    def optimizer(self, mode: str, world: int) -> float:
        base = self.optimizer_sync_s_at4 if mode in ("nccl", "exact") else self.optimizer_decoupled_s_at4
        return max(self.optimizer_floor_s, base * 4 / world)


@dataclass(frozen=True)
class Params:
    """Everything the model's times depend on besides the plans and the compute fit."""

    shape: Shape
    overheads: Overheads
    nic_efficiency: float = 0.9
    issue_s: float = 10e-6  # host time per remote peer and odc operation
    latency_scale: float = 1.0  # sensitivity: multiplies every network's latency
    nic_GBps: float | None = None  # sensitivity / break-even: overrides the network's bandwidth


def training_fit(results: Path = RESULTS) -> tuple[balance.FittedCost, dict]:
    """a, b, c fitted to the FIT_RUN's FIT_CONFIG microbatches (they wait on no peer)."""
    data = json.loads((results / FIT_RUN).read_text())
    samples = [(e[4], e[2] - e[1]) for rank in data["results"][FIT_CONFIG]["timelines"]
               for line in rank for e in line if e[0] == "micro"]
    fit = balance.FittedCost.fit(samples)
    errors = [abs(fit(d) - t) / t for d, t in samples]
    return fit, {"from": FIT_RUN, "config": FIT_CONFIG, "samples": len(samples),
                 "a_s": fit.a, "b_s_per_token": fit.b, "c_s_per_token_pair": fit.c,
                 "mean_abs_rel_error": statistics.mean(errors), "max_abs_rel_error": max(errors)}


def measured_overheads(results: Path = RESULTS) -> Overheads:
    data = json.loads((results / FIT_RUN).read_text())
    res = data["results"]

    def durations(config, what):
        return [e[2] - e[1] for rank in res[config]["timelines"] for line in rank for e in line if e[0] == what]

    last_sync = [min(e[2] - e[1] for rank in res["decoupled_lbmini"]["timelines"] for e in rank[k] if e[0] == "sync")
                 for k in range(len(res["decoupled_lbmini"]["step_times_s"]))]
    return Overheads(
        optimizer_sync_s_at4=statistics.median(durations("reference_lbmicro", "optimizer")),
        optimizer_decoupled_s_at4=statistics.median(durations("decoupled_lbmini", "optimizer")
                                                    + durations("decoupled_local_lbmini", "optimizer")),
        sync_fixed_s=statistics.median(last_sync))


# --------------------------------------------------------------------------- communication

@dataclass(frozen=True)
class Comm:
    """Seconds per microbatch's transfers: one layer's gather g and reduction r, the root's,
    and the host's time to issue them all (a lower bound on the microbatch)."""

    g: float
    r: float
    g_root: float
    r_root: float
    host: float = 0.0


def _nic_Bps(net: Network, p: Params) -> float:
    return (p.nic_GBps if p.nic_GBps is not None else net.nic_GBps) * 1e9 * p.nic_efficiency


def ring_time(op: str, nbytes: float, world: int, net: Network, links: Links, p: Params) -> float:
    """NCCL ring all-gather / reduce-scatter of ``nbytes`` (the full, unsharded size)."""
    share = (world - 1) / world * nbytes
    t = share / links.busbw(world, "nccl", op, nbytes)
    if world > GPUS_PER_HOST:
        t = max(t, share / GPUS_PER_HOST / _nic_Bps(net, p)) + (world - 1) * net.latency_s * p.latency_scale
    return t


def direct_time(op: str, nbytes: float, world: int, net: Network, links: Links, p: Params) -> float:
    """odc: every rank gets from (or puts to) every owner directly, remote owners through its NIC."""
    if world <= GPUS_PER_HOST:
        return (world - 1) / world * nbytes / links.busbw(world, "odc", op, nbytes)
    on_host = (GPUS_PER_HOST - 1) / world * nbytes / links.busbw(GPUS_PER_HOST, "odc", op, nbytes)
    off_host = (world - GPUS_PER_HOST) / world * nbytes / _nic_Bps(net, p)
    return max(on_host, off_host) + net.latency_s * p.latency_scale


def comm_for(mode: str, world: int, net: Network, links: Links, p: Params) -> Comm:
    s = p.shape
    layer_ag, layer_rs = 2.0 * s.layer_params, 4.0 * s.layer_params
    root_ag, root_rs = 2.0 * s.root_params, 4.0 * s.root_params
    multi = world > GPUS_PER_HOST
    if multi and net.nic_GBps is None:
        raise ValueError(f"{net.name} is one host: at most {GPUS_PER_HOST} GPUs")
    if mode == "nccl":
        return Comm(ring_time("all_gather", layer_ag, world, net, links, p),
                    ring_time("reduce_scatter", layer_rs, world, net, links, p),
                    ring_time("all_gather", root_ag, world, net, links, p),
                    ring_time("reduce_scatter", root_rs, world, net, links, p))
    if mode in ("owner", "exact") and multi:
        raise ValueError(f"mode {mode!r} is modelled on one host only (owner mode is refused "
                         "across hosts: NVSHMEM has no float atomics)")
    g = direct_time("all_gather", layer_ag, world, net, links, p)
    g_root = direct_time("all_gather", root_ag, world, net, links, p)
    operations = 2 * s.layers + 1  # gathers per microbatch
    if mode == "exact":
        r = direct_time("reduce_scatter", layer_rs, world, net, links, p)
        r_root = direct_time("reduce_scatter", root_rs, world, net, links, p)
    elif mode == "owner":
        r, r_root = layer_rs / links.accumulate_Bps, root_rs / links.accumulate_Bps
    elif mode == "local":
        r = r_root = 0.0
    else:
        raise ValueError(f"unknown mode {mode!r}")
    host = operations * (world - 1) * p.issue_s if multi else 0.0
    return Comm(g, r, g_root, r_root, host)


def sync_time(mode: str, world: int, net: Network, links: Links, p: Params) -> float:
    """odc.sync of the last rank to arrive (0 for the synchronous modes: FSDP2 already reduced)."""
    if mode in ("nccl", "exact"):
        return 0.0
    t = p.overheads.sync_fixed_s
    if mode == "local":
        t += direct_time("reduce_scatter", 4.0 * p.shape.params, world, net, links, p)
    if world > GPUS_PER_HOST:
        t += (world - 1) * p.issue_s + net.latency_s * p.latency_scale
    return t


def microbatch_time(t_c: float, comm: Comm, layers: int) -> float:
    """Compute overlapped layer by layer with the transfers (see the module docstring)."""
    f = t_c / (4 * layers)
    gpu = comm.g_root + layers * max(f, comm.g) + layers * max(3 * f, comm.g + comm.r) + comm.r_root
    return max(gpu, comm.host)


# --------------------------------------------------------------------------- step times

def sync_step(costs: list[list[float | None]], comm: Comm, layers: int, dummy_c: list[float]) -> float:
    """Synchronous minibatch: sum over steps of the slowest rank's microbatch. ``costs``: per
    rank, per microbatch, its compute time (None: a padding dummy, which costs ``dummy_c[rank]``)."""
    steps = max((len(c) for c in costs), default=0)
    total = 0.0
    for j in range(steps):
        total += max(microbatch_time(c[j] if c[j] is not None else dummy_c[r], comm, layers)
                     for r, c in enumerate(costs) if j < len(c))
    return total


def decoupled_step(costs: list[list[float]], comm: Comm, layers: int) -> float:
    return max((sum(microbatch_time(t, comm, layers) for t in c) for c in costs), default=0.0)


def plan_costs(plan, lengths, cost, slowdowns=None) -> list[list[float | None]]:
    """Per rank, per microbatch: compute seconds (times the rank's slowdown); None for padding."""
    out = []
    for r, rank_plan in enumerate(plan):
        k = slowdowns[r] if slowdowns else 1.0
        out.append([cost([lengths[i] for i in mb]) * k if mb else None for mb in rank_plan])
    return out


@dataclass
class Minibatch:
    tokens: int
    micro: list[list[float | None]]  # LB-Micro, per rank per microbatch compute seconds
    mini: list[list[float]]  # LB-Mini
    weighted: list[list[float]] | None  # speed-weighted LB-Mini (straggler only)
    dummy_c: float  # compute seconds of the padding dummy at speed 1
    slowdowns: list[float]


def sample(world: int, minibatches: int, docs_per_rank: int, cost, slowdown: float = 1.0) -> list[Minibatch]:
    """Plan ``minibatches`` long-tailed minibatches with the real planners."""
    slow = [1.0] * (world - 1) + [slowdown]
    out = []
    for s in range(minibatches):
        d = make_documents(docs_per_rank * world, 1000 + s, False, MEAN_LEN, MAX_TOKENS)
        micro = balance.lb_micro(d, world, MAX_TOKENS, cost)
        mini = balance.lb_mini(d, world, MAX_TOKENS, cost)
        weighted = balance.lb_mini_weighted(d, slow, MAX_TOKENS, cost) if slowdown != 1.0 else None
        out.append(Minibatch(
            tokens=sum(d), micro=plan_costs(micro, d, cost, slow), mini=plan_costs(mini, d, cost, slow),
            weighted=plan_costs(weighted, d, cost, slow) if weighted is not None else None,
            dummy_c=cost([DUMMY_TOKENS]), slowdowns=slow))
    return out


def _useful(costs) -> float:
    return sum(t for c in costs for t in c if t is not None)


def evaluate(mbs: list[Minibatch], world: int, net: Network, links: Links, p: Params,
             dec_mode: str | None = None, compute_only: bool = False) -> dict:
    """Predicted totals over the minibatches for NCCL + LB-Micro and decoupled + LB-Mini."""
    dec_mode = dec_mode or ("owner" if world <= GPUS_PER_HOST else "local")
    L = p.shape.layers
    zero = Comm(0.0, 0.0, 0.0, 0.0)
    c_sync = zero if compute_only else comm_for("nccl", world, net, links, p)
    c_dec = zero if compute_only else comm_for(dec_mode, world, net, links, p)
    t_sync_dec = 0.0 if compute_only else sync_time(dec_mode, world, net, links, p)
    opt_sync = 0.0 if compute_only else p.overheads.optimizer("nccl", world)
    opt_dec = 0.0 if compute_only else p.overheads.optimizer(dec_mode, world)
    tot = {"tokens": 0, "nccl_s": 0.0, "dec_s": 0.0, "dec_weighted_s": 0.0, "useful_s": 0.0,
           "dec_compute_max_s": 0.0, "dec_sync_s": 0.0, "dec_optimizer_s": 0.0, "nccl_optimizer_s": 0.0}
    for mb in mbs:
        tot["tokens"] += mb.tokens
        # a rank's padding dummy runs at that rank's speed
        nccl = sync_step(mb.micro, c_sync, L, [mb.dummy_c * k for k in mb.slowdowns])
        tot["nccl_s"] += nccl + opt_sync
        tot["nccl_optimizer_s"] += opt_sync
        tot["dec_s"] += decoupled_step(mb.mini, c_dec, L) + t_sync_dec + opt_dec
        tot["dec_sync_s"] += t_sync_dec
        tot["dec_optimizer_s"] += opt_dec
        tot["dec_compute_max_s"] += max(sum(c) for c in mb.mini)
        if mb.weighted is not None:
            tot["dec_weighted_s"] += decoupled_step(mb.weighted, c_dec, L) + t_sync_dec + opt_dec
        tot["useful_s"] += _useful(mb.mini)
    n = len(mbs)
    row = {
        "world": world, "network": net.name, "decoupled_mode": dec_mode, "minibatches": n,
        "tokens_per_minibatch": tot["tokens"] / n,
        "nccl_step_s": tot["nccl_s"] / n, "decoupled_step_s": tot["dec_s"] / n,
        "nccl_tokens_per_s": tot["tokens"] / tot["nccl_s"],
        "decoupled_tokens_per_s": tot["tokens"] / tot["dec_s"],
        "ratio": tot["nccl_s"] / tot["dec_s"],
        "nccl_bubble": 1.0 - tot["useful_s"] / (world * tot["nccl_s"]),
        "decoupled_bubble": 1.0 - tot["useful_s"] / (world * tot["dec_s"]),
        "decoupled_compute_max_s": tot["dec_compute_max_s"] / n,
        "decoupled_sync_s": tot["dec_sync_s"] / n,
        "decoupled_comm_exposed_s": (tot["dec_s"] - tot["dec_compute_max_s"] - tot["dec_sync_s"]
                                     - tot["dec_optimizer_s"]) / n,
        "per_microbatch_comm": {"nccl": asdict(c_sync), dec_mode: asdict(c_dec)},
    }
    row["nccl_tokens_per_s_per_gpu"] = row["nccl_tokens_per_s"] / world
    row["decoupled_tokens_per_s_per_gpu"] = row["decoupled_tokens_per_s"] / world
    if any(mb.weighted is not None for mb in mbs):
        row["decoupled_weighted_step_s"] = tot["dec_weighted_s"] / n
        row["ratio_weighted"] = tot["nccl_s"] / tot["dec_weighted_s"]
    return row


def break_even_nic_GBps(mbs, world, net, links, p: Params, lo=0.5, hi=400.0) -> float | None:
    """NIC line rate per GPU (GB/s) at which decoupled equals NCCL: below it NCCL wins. None
    when decoupled loses even at ``hi`` (8x today's 400 Gb/s: its compute gain does not cover
    its fixed costs), 0.0 when it wins even at ``lo``."""
    def ratio(bw):
        return evaluate(mbs, world, net, links, replace(p, nic_GBps=bw))["ratio"]

    if ratio(hi) < 1.0:
        return None
    if ratio(lo) >= 1.0:
        return 0.0
    for _ in range(40):  # ratio grows with bandwidth
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ratio(mid) < 1.0 else (lo, mid)
    return hi


# --------------------------------------------------------------------------- validation

def recorded_plan(res: dict, k: int, world: int) -> list[list[list[int] | None]]:
    """Per rank, the document lengths of each microbatch the run trained in timed step k
    (None: a padding dummy)."""
    return [[(e[4] if e[0] == "micro" else None) for e in res["timelines"][r][k] if e[0] in ("micro", "dummy")]
            for r in range(world)]


def planners_reproduce(data: dict) -> bool:
    """Whether today's lb_micro / lb_mini, with the run's planning cost, give the plans it ran."""
    f = data["summary"]["microbatch_time_fit"]
    cost = balance.FittedCost(f["a_s"], f["b_s_per_token"], f["c_s_per_token_pair"])
    world, docs = data["world_size"], data["documents"][1:]
    planners = {"lbmicro": balance.lb_micro, "lbmini": balance.lb_mini}
    for name, res in data["results"].items():
        suffix = name.rsplit("_", 1)[1]
        if suffix not in planners:
            continue
        for k, d in enumerate(docs):
            plan = planners[suffix](d, world, data["args"]["max_tokens"], cost)
            ran = [sorted(tuple(sorted(e[5])) for e in res["timelines"][r][k] if e[0] == "micro") for r in range(world)]
            planned = [sorted(tuple(sorted(mb)) for mb in rank_plan if mb) for rank_plan in plan]
            if ran != planned:
                return False
    return True


def validate(links: Links, p: Params, fit_train: balance.FittedCost, results: Path = RESULTS,
             runs=VALIDATION_RUNS) -> list[dict]:
    """Predicted vs measured tokens/s for every configuration of the measured runs, with the
    run's own calibration fit ("calibration") and with the training fit ("training")."""
    rows = []
    for name, note in runs:
        data = json.loads((results / name).read_text())
        world = data["world_size"]
        f = data["summary"]["microbatch_time_fit"]
        fits = {"calibration": balance.FittedCost(f["a_s"], f["b_s_per_token"], f["c_s_per_token_pair"]),
                "training": fit_train}
        tokens = [sum(d) for d in data["documents"][1:]]
        reproduce = planners_reproduce(data)
        measured_nccl = data["results"].get("reference_lbmicro", {}).get("tokens_per_s")
        for config, res in data["results"].items():
            mode = CONFIG_MODE.get(config)
            if mode is None:
                continue
            row = {"run": name, "note": note, "commit": data.get("commit", "")[:7], "world": world,
                   "config": config, "mode": mode, "timed_minibatches": len(res["step_times_s"]),
                   "measured_tokens_per_s": res["tokens_per_s"], "measured_step_s": res["step_times_s"],
                   "planners_reproduce_the_run": reproduce}
            if measured_nccl:
                row["measured_ratio_vs_nccl"] = res["tokens_per_s"] / measured_nccl
            net = NETWORKS["nvlink"]
            for fit_name, cost in fits.items():
                comm = comm_for(mode, world, net, links, p)
                steps = []
                for k in range(len(res["step_times_s"])):
                    plan = recorded_plan(res, k, world)
                    costs = [[cost(d) if d is not None else None for d in rank] for rank in plan]
                    if mode in ("nccl", "exact"):
                        t = sync_step(costs, comm, p.shape.layers, [cost([DUMMY_TOKENS])] * world)
                    else:
                        t = decoupled_step(costs, comm, p.shape.layers) + sync_time(mode, world, net, links, p)
                    steps.append(t + p.overheads.optimizer(mode, world))
                pred = sum(tokens) / sum(steps)
                row[f"predicted_step_s_{fit_name}"] = steps
                row[f"predicted_tokens_per_s_{fit_name}"] = pred
                row[f"error_{fit_name}"] = pred / res["tokens_per_s"] - 1.0
            rows.append(row)
        if measured_nccl:  # predicted ratios vs NCCL, per fit
            ref = next(r for r in rows if r["run"] == name and r["config"] == "reference_lbmicro")
            for r in rows:
                if r["run"] == name:
                    for fit_name in fits:
                        r[f"predicted_ratio_vs_nccl_{fit_name}"] = (r[f"predicted_tokens_per_s_{fit_name}"]
                                                                    / ref[f"predicted_tokens_per_s_{fit_name}"])
    return rows


def local_sync_check(links: Links, p: Params, results: Path = RESULTS) -> dict:
    """odc.sync of the last rank in the 4-GPU local-mode run: measured vs the model."""
    data = json.loads((results / FIT_RUN).read_text())
    res = data["results"]["decoupled_local_lbmini"]
    last = [min(e[2] - e[1] for rank in res["timelines"] for e in rank[k] if e[0] == "sync")
            for k in range(len(res["step_times_s"]))]
    return {"measured_s": statistics.median(last),
            "predicted_s": sync_time("local", data["world_size"], NETWORKS["nvlink"], links, p)}


# --------------------------------------------------------------------------- report

def networks_for(world: int) -> list[Network]:
    if world <= GPUS_PER_HOST:
        return [NETWORKS["nvlink"]]
    return [NETWORKS["ib_ndr400"], NETWORKS["efa_p5"]]


def minibatches_for(world: int, quick: bool) -> int:
    """Fewer minibatches where planning is slow (Karmarkar-Karp over 4 x W documents) and
    the mean is steadier (many ranks per minibatch)."""
    if quick:
        return 4 if world <= 64 else 2
    return {256: 12, 512: 8}.get(world, 60 if world <= 32 else 30)


def run(worlds=WORLDS, quick: bool = False, docs_per_rank: int = 4, straggler: float = 1.3,
        sensitivity: bool = True, doc_sweep=(2, 8), doc_sweep_worlds=(16, 128, 512),
        params: Params | None = None, results: Path = RESULTS, log=print) -> dict:
    t_start = time.perf_counter()
    links = Links(results)
    fit, fit_info = training_fit(results)
    p = params or Params(Shape.qwen2_1_5b(), measured_overheads(results))
    out = {"benchmark": "scale_model", "training_fit": fit_info, "links": links.sources,
           "networks": {k: asdict(v) for k, v in NETWORKS.items()},
           "params": {"shape": asdict(p.shape), "overheads": asdict(p.overheads),
                      "nic_efficiency": p.nic_efficiency, "issue_s": p.issue_s,
                      "gpus_per_host": GPUS_PER_HOST, "max_tokens": MAX_TOKENS, "mean_len": MEAN_LEN,
                      "docs_per_rank": docs_per_rank, "straggler_slowdown": straggler}}
    out["validation"] = validate(links, p, fit, results)
    out["local_sync_check"] = local_sync_check(links, p, results)
    log(f"[scale_model] validation done ({time.perf_counter() - t_start:.1f} s)")
    rows, strag, sens, planning_s = [], [], [], {}
    for world in worlds:
        t0 = time.perf_counter()
        n = minibatches_for(world, quick)
        mbs = sample(world, n, docs_per_rank, fit)
        smbs = sample(world, n, docs_per_rank, fit, slowdown=straggler) if straggler and straggler != 1.0 else None
        planning_s[world] = time.perf_counter() - t0
        for net in networks_for(world):
            row = evaluate(mbs, world, net, links, p)
            row["ideal"] = evaluate(mbs, world, net, links, p, compute_only=True)["ratio"]
            if net.nic_GBps is not None:
                row["break_even_nic_GBps"] = break_even_nic_GBps(mbs, world, net, links, p)
            rows.append(row)
            if smbs is not None:
                s = evaluate(smbs, world, net, links, p)
                s["straggler_slowdown"] = straggler
                strag.append(s)
            if sensitivity and net.nic_GBps is not None:
                for label, q in (("latency_x4", replace(p, latency_scale=4.0)),
                                 ("nic_efficiency_0.5", replace(p, nic_efficiency=0.5)),
                                 ("issue_x4", replace(p, issue_s=4 * p.issue_s))):
                    sens.append({"world": world, "network": net.name, "variant": label,
                                 "ratio": evaluate(mbs, world, net, links, q)["ratio"], "ratio_base": row["ratio"]})
        log(f"[scale_model] W={world}: {n} minibatches planned in {planning_s[world]:.1f} s")
    docs_rows = []
    for dpr in doc_sweep:
        for world in doc_sweep_worlds:
            if world not in worlds:
                continue
            n = max(2, minibatches_for(world, quick) // 2)
            mbs = sample(world, n, dpr, fit)
            for net in networks_for(world)[:1]:
                row = evaluate(mbs, world, net, links, p)
                row["ideal"] = evaluate(mbs, world, net, links, p, compute_only=True)["ratio"]
                row["docs_per_rank"] = dpr
                docs_rows.append(row)
            log(f"[scale_model] docs/rank={dpr} W={world} done")
    out.update(rows=rows, straggler_rows=strag, docs_per_rank_rows=docs_rows, sensitivity=sens,
               planning_s=planning_s, elapsed_s=time.perf_counter() - t_start)
    out["decoupling_stops_paying"] = stops_paying(rows)
    return out


def stops_paying(rows: list[dict]) -> dict:
    """Per network: the smallest W from which decoupled's ratio stays <= 1."""
    out = {}
    for name in sorted({r["network"] for r in rows}):
        mine = sorted((r for r in rows if r["network"] == name), key=lambda r: r["world"])
        first = None
        for r in mine:
            if r["ratio"] <= 1.0:
                first = r["world"] if first is None else first
            else:
                first = None
        out[name] = first
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def markdown(out: dict) -> str:
    lines = ["### Validation: predicted vs measured (NVLink, one host)", "",
             "| run | W | configuration | measured tok/s | predicted (calibration fit) | error | "
             "predicted (training fit) | error | measured × NCCL | predicted × NCCL (cal. / train.) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in out["validation"]:
        ratio = (f"{r['predicted_ratio_vs_nccl_calibration']:.3f} / {r['predicted_ratio_vs_nccl_training']:.3f}"
                 if "predicted_ratio_vs_nccl_training" in r else "")
        lines.append(f"| `{r['run'].replace('train_imbalanced_nvidia-h200-', '').replace('.json', '')}` | {r['world']} | "
                     f"{r['config']} | {r['measured_tokens_per_s']:,.0f} | {r['predicted_tokens_per_s_calibration']:,.0f} | "
                     f"{_pct(r['error_calibration'])} | {r['predicted_tokens_per_s_training']:,.0f} | "
                     f"{_pct(r['error_training'])} | {r.get('measured_ratio_vs_nccl', float('nan')):.3f} | {ratio} |")
    ls = out["local_sync_check"]
    lines += ["", f"odc.sync in local mode, 4 GPUs (last rank): measured {1e3 * ls['measured_s']:.1f} ms, "
              f"predicted {1e3 * ls['predicted_s']:.1f} ms.", "",
              "### Predictions: long-tailed workload, 4 documents per rank", "",
              "| W | network | decoupled mode | NCCL + LB-Micro tok/s | decoupled + LB-Mini tok/s | ratio | ideal "
              "(compute only) | bubble NCCL | bubble decoupled | decoupled exposed comm + sync (ms/step) | "
              "break-even NIC Gb/s per GPU |",
              "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in out["rows"]:
        be = r.get("break_even_nic_GBps", "n/a")
        be = ("> 3,200" if be is None else "n/a" if be == "n/a" else "< 4" if be == 0.0 else f"{8 * be:,.0f}")
        lines.append(f"| {r['world']} | {r['network']} | {r['decoupled_mode']} | {r['nccl_tokens_per_s']:,.0f} | "
                     f"{r['decoupled_tokens_per_s']:,.0f} | {r['ratio']:.3f} | {r['ideal']:.3f} | "
                     f"{100 * r['nccl_bubble']:.1f} % | {100 * r['decoupled_bubble']:.1f} % | "
                     f"{1e3 * (r['decoupled_comm_exposed_s'] + r['decoupled_sync_s']):.0f} | {be} |")
    if out["straggler_rows"]:
        lines += ["", f"### With a straggler (last rank {out['params']['straggler_slowdown']}x slower)", "",
                  "| W | network | ratio static LB-Mini | ratio speed-weighted LB-Mini | bubble NCCL | bubble decoupled (static) |",
                  "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in out["straggler_rows"]:
            lines.append(f"| {r['world']} | {r['network']} | {r['ratio']:.3f} | {r.get('ratio_weighted', float('nan')):.3f} | "
                         f"{100 * r['nccl_bubble']:.1f} % | {100 * r['decoupled_bubble']:.1f} % |")
    if out["docs_per_rank_rows"]:
        lines += ["", "### Other minibatch sizes (documents per rank)", "",
                  "| docs per rank | W | network | ratio | ideal | NCCL tok/s per GPU | decoupled tok/s per GPU |",
                  "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in out["docs_per_rank_rows"]:
            lines.append(f"| {r['docs_per_rank']} | {r['world']} | {r['network']} | {r['ratio']:.3f} | {r['ideal']:.3f} | "
                         f"{r['nccl_tokens_per_s_per_gpu']:,.0f} | {r['decoupled_tokens_per_s_per_gpu']:,.0f} |")
    lines += ["", "Decoupling stops paying (smallest W from which ratio <= 1, per network): "
              + ", ".join(f"{k}: {v if v is not None else 'not within the range'}"
                          for k, v in out["decoupling_stops_paying"].items())]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few minibatches (a smoke run)")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    p.add_argument("--docs-per-rank", type=int, default=4)
    p.add_argument("--straggler", type=float, default=1.3, help="slowdown of the last rank (1: none)")
    p.add_argument("--nic-efficiency", type=float, default=0.9, help="fraction of the NICs' line rate reached")
    p.add_argument("--issue-us", type=float, default=10.0, help="host time per remote peer and odc operation")
    p.add_argument("--out-dir", default=str(_meta.default_out_dir()), help=_meta.OUT_DIR_HELP)
    args = p.parse_args()
    params = Params(Shape.qwen2_1_5b(), measured_overheads(), nic_efficiency=args.nic_efficiency,
                    issue_s=args.issue_us * 1e-6)
    out = run(worlds=tuple(int(w) for w in args.worlds.split(",")), quick=args.quick,
              docs_per_rank=args.docs_per_rank, straggler=args.straggler, params=params)
    out.update(_meta.stamp(torch.device("cpu")))
    table = markdown(out)
    print(table)
    # result_path names files <benchmark>_<kind>...: "scale" + "model" gives scale_model_<date>.json
    path = _meta.result_path(args.out_dir, "scale", "model", "_quick" if args.quick else "")
    out["markdown"] = table
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
