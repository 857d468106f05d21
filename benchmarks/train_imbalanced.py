#!/usr/bin/env python3
"""Imbalanced variable-length training: per-layer synchronous FSDP2 vs odc decoupled mode.

    torchrun --standalone --nproc-per-node=2 benchmarks/train_imbalanced.py        # CPU, ~1 min
    torchrun --standalone --nproc-per-node=4 benchmarks/train_imbalanced.py        # GPUs: 1.5B Qwen2

The result goes under the system's temporary directory (``odc_results/``; the run prints the
path) unless ``--out-dir`` names a folder: ``--out-dir benchmarks/results`` writes the
committed headline file.

Each minibatch holds synthetic documents with long-tailed lengths (lognormal, seeded; or
constant lengths with ``--balanced``), packed into token-capped microbatches with
per-document causal attention. Configurations run side by side in one job, on the same
documents, from the same initial weights:

* ``reference_lbmicro``: FSDP2 on NCCL (gloo on CPU); ``balance.lb_micro`` gives every rank
  the same number of microbatches (an empty one becomes a zero-weight dummy, so every rank
  joins every layer's collectives);
* ``exact_lbmicro``: the same on odc exact mode;
* ``exact_registered_lbmicro``: the same with ``odc.use_registered_memory(model)`` (FSDP2's
  buffers in registered memory: zero-copy all-gathers and reduce-scatters; the pool, set up
  at the first of them, is memory outside PyTorch's allocator and stays for later configurations);
* ``decoupled_lbmini``: ``odc.decouple``; ``balance.lb_mini`` balances each rank's total
  cost, counts may differ; one ``odc.sync`` per minibatch.
* ``decoupled_dynamic``: ``odc.decouple`` with ``balance.DynamicBalancer``: each minibatch
  starts from LB-Mini weighted by the ranks' measured speeds, and a rank whose GPU is
  (nearly) free takes its next microbatch, or, its own queue empty, an item from the back of
  another rank's (fetch-adds on the group's store); one ``odc.sync`` per minibatch.
* ``decoupled_adaptive``: the same plans (LB-Mini weighted by the ranks' measured speeds), each
  rank keeping to its own share (``take_from_others=False``); with ``--hsdp`` its largest
  microbatch last, announced with ``odc.last_microbatch``.

``--hsdp R`` shards inside groups of world / R consecutive ranks and replicates across R of
them (FSDP2 HSDP; on several hosts, R = the hosts: ``torchrun ... -m
torch_odc_backend.emulate_hosts G benchmarks/train_imbalanced.py --hsdp R`` emulates them on one
machine). odc then runs one-sided inside a shard group and the replicate all-reduce on its
inner NCCL group, once per minibatch at ``odc.sync``. ``reference_lbmicro`` does what a careful
HSDP user does: ``set_requires_all_reduce`` only for a rank's last microbatch of the minibatch,
so the replicate all-reduce runs once per minibatch too; ``reference_arpermicro_lbmicro`` is
FSDP2's default, an all-reduce after every microbatch. With ``--hsdp`` every rank runs its
microbatches smallest first (LB-Micro's steps and LB-Mini's lists, which the planners give
most expensive first), so that the last backward, which the all-reduce overlaps, is the
longest; decoupled LB-Mini announces it with ``odc.last_microbatch``, and dynamic balancing
where a rank's take left nothing to take (``MinibatchClaims.exhausted``). The result's ``cross_host`` gives the
bytes each rank all-reduces across replicas per minibatch and the time of one such all-reduce
on the reference's replicate group, timed alone after the runs.

Workloads: long-tailed (default), ``--balanced`` (constant lengths, the control) and, with
either, ``--straggler RANK:FACTOR``: rank RANK runs every microbatch FACTOR times as long.
After each of its microbatches it waits (FACTOR - 1) times that microbatch's time: on a GPU a
spinning kernel (``torch.cuda._sleep``, cycles calibrated against CUDA events at start-up)
on the compute stream, for (FACTOR - 1) x the microbatch's calibrated time (the ``--cost
fitted`` model), so the host never waits for the GPU; on CPU a sleep for (FACTOR - 1) x the
measured time. Calibration runs before the slowdown starts.

On GPUs the model is a Qwen2-style decoder built from a ``transformers`` ``Qwen2Config``
(1.5B parameters, random weights; ``--layers`` shrinks it), bf16 compute with fp32 master
weights and fp32 gradient reduction, activation checkpointing per decoder layer, and a
chunked LM-head loss; each document attends causally to itself only (an attention function
registered with ``transformers.AttentionInterface``). On CPU a small transformer stands in
(``--model qwen2-tiny`` runs the GPU model's code path at toy size).

Reported per configuration (rank 0 writes ``<out-dir>/train_imbalanced_<kind>_<date>.json``):
tokens/s, step times (the slowest rank's), peak memory, the bubble rate (idle share of the
ranks' time, from the measured per-microbatch cost fit), odc's own sync-wait bubble in
decoupled mode, and per-rank timelines (``benchmarks/plot_timeline.py`` draws them). The
ideal speedup comes from measured microbatch times: ``--cost fitted`` (default) times seven
microbatch shapes before the runs and fits ``a + b * tokens + c * sum(length^2)``, which also
plans; ``--cost flops`` plans with FLOPs and fits ``t = a + s * flops`` to the decoupled run's
microbatches (which wait on no peer). Then ``sum over minibatches of (sum over LB-Micro rounds
of the slowest rank)``, an LB-Micro padding microbatch priced as the 8-token dummy it runs, is
compared with ``sum over minibatches of the slowest rank's LB-Mini total``. The
perfect-balance bound of a minibatch is ``balance.balance_bound`` of the dynamic packing's
fitted microbatch times and the ranks' slowdowns (``max(sum / sum of speeds, largest x the
fastest rank's slowdown)``); ``fraction_of_balance_bound`` is the bound over the dynamic run's
measured minibatch time (its steps minus the optimizer step, which follows odc.sync).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import _meta
import torch_odc_backend as odc
from torch_odc_backend import balance

# Qwen2-1.5B's shape (hidden 1536, 28 layers, 12 heads / 2 KV heads, SwiGLU 8960, vocab
# 151936, tied embeddings): 1.54B parameters.
QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=131072, rope_theta=1_000_000.0, tie_word_embeddings=True)
QWEN2_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)


# --------------------------------------------------------------------------- models

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x, mask):
        t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(t, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(0, 1).reshape(t, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class SmallPackedLM(nn.Module):
    """CPU stand-in: a small transformer with a dense per-document causal mask."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def layers(self):
        return list(self.blocks)

    def forward(self, tokens, labels, lengths):
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        same = doc_ids[:, None] == doc_ids[None, :]
        mask = same & torch.ones_like(same).tril()
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, mask)
        return F.cross_entropy(self.head(self.norm(x)), labels, reduction="sum")


def _doc_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          cu_seq_lens_q=None, **kwargs):
    """transformers attention function: causal attention inside each packed document.

    ``query`` is (1, heads, tokens, head_dim), ``key``/``value`` (1, kv_heads, tokens,
    head_dim); ``cu_seq_lens_q`` holds the document boundaries (a Python list here). One
    causal SDPA call per document (cuDNN attention on H200): cost ~ sum of squared lengths.

    Each document's q / k / v are made contiguous: cuDNN builds an attention plan per
    shape *and strides* (tens to hundreds of ms of CPU, the GPU idle meanwhile), and a slice
    of the packed tensors has strides that depend on the packed length, so every new packing
    of a document cost a new plan, charged to whichever configuration met it first. With
    contiguous inputs the plan depends on the document's length alone, and
    ``warm_attention`` builds them all before anything is timed.
    """
    groups = query.shape[1] // key.shape[1]
    out = []
    for s, e in zip(cu_seq_lens_q[:-1], cu_seq_lens_q[1:]):
        k, v = key[:, :, s:e], value[:, :, s:e]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out.append(F.scaled_dot_product_attention(query[:, :, s:e].contiguous(), k.contiguous(),
                                                  v.contiguous(), is_causal=True, scale=scaling))
    return torch.cat(out, 2).transpose(1, 2).contiguous(), None


def warm_attention(lengths, heads: int, head_dim: int, device) -> float:
    """Run the per-document attention once for every distinct length, so that cuDNN's plans
    exist before any configuration is timed. PyTorch caches them per thread: a checkpointed
    layer runs its forward (grad enabled) on this thread and again, recomputed, on autograd's
    device thread before the backward there; the warm-up does the same. Returns seconds."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim ** -0.5)

    t0 = time.perf_counter()
    for n in sorted(set(lengths)):
        q, k, v = (torch.randn(1, heads, n, head_dim, device=device, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        checkpoint(attend, q, k, v, use_reentrant=False).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


class Checkpointed(nn.Module):
    """Activation checkpointing of one decoder layer (FSDP2 wraps this module; the
    recomputation runs inside its backward, with its parameters gathered)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class PackedQwen2(nn.Module):
    """Qwen2ForCausalLM over one packed sequence; returns the summed token loss."""

    def __init__(self, shape: dict, activation_checkpointing: bool, loss_chunk: int):
        super().__init__()
        from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

        AttentionInterface.register("odc_doc_causal", _doc_causal_attention)
        config = Qwen2Config(**shape)
        self.lm = Qwen2ForCausalLM(config)
        self.lm.config._attn_implementation = "odc_doc_causal"
        if activation_checkpointing:
            blocks = self.lm.model.layers
            for i in range(len(blocks)):
                blocks[i] = Checkpointed(blocks[i])
        self.loss_chunk = loss_chunk

    def layers(self):
        return list(self.lm.model.layers)

    def _chunk_loss(self, hidden, labels):
        logits = self.lm.lm_head(hidden).float()
        return F.cross_entropy(logits, labels, reduction="sum")

    def forward(self, tokens, labels, lengths):
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        positions = torch.cat([torch.arange(n, device=tokens.device) for n in lengths])
        hidden = self.lm.model(input_ids=tokens[None], position_ids=positions[None],
                               cu_seq_lens_q=bounds, cu_seq_lens_k=bounds,
                               use_cache=False).last_hidden_state[0]
        # chunked, recomputed LM head: never holds all of a 64K-token microbatch's logits
        loss = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[0], self.loss_chunk):
            loss = loss + checkpoint(self._chunk_loss, hidden[s:s + self.loss_chunk],
                                     labels[s:s + self.loss_chunk], use_reentrant=False)
        return loss


# --------------------------------------------------------------------------- data

def make_documents(n: int, seed: int, balanced: bool, mean: int, cap: int) -> list[int]:
    rng = random.Random(seed)
    if balanced:
        return [mean] * n
    sigma = 1.0
    mu = math.log(mean) - sigma * sigma / 2  # lognormal with the requested mean (before the cap)
    return [max(8, min(cap, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def microbatch(step: int, doc_indices: list[int], doc_lengths: list[int], vocab: int, device):
    """Random tokens for documents packed back to back: (inputs, labels), each sum(lengths).
    A document's tokens depend on (step, its index) only, whichever microbatch it lands in."""
    toks = [torch.randint(0, vocab, (n + 1,), generator=torch.Generator().manual_seed(step * 100003 + i))
            for i, n in zip(doc_indices, doc_lengths)]
    x = torch.cat([t[:-1] for t in toks]).to(device)
    y = torch.cat([t[1:] for t in toks]).to(device)
    return x, y


# --------------------------------------------------------------------------- timing

class Clock:
    """Marks on the GPU's compute stream (CUDA events) or the CPU clock; read after a step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def since(self, start, mark) -> float:
        """Seconds from ``start`` to ``mark`` (CUDA: call after the events completed)."""
        return start.elapsed_time(mark) / 1e3 if self.cuda else mark - start


def train_steps(model, opt, plans, docs, args, decoupled, device, cpu_group, first_step=0,
                balancer=None, straggler=None, cost=None, hsdp_once=False):
    """One optimizer step per minibatch. Returns this rank's step times, timelines (per
    step, a list of (what, start_s, end_s, tokens, doc lengths, doc indices) from the step's
    start) and its share of each minibatch's loss. With a ``balancer`` (dynamic balancing)
    the ranks take the minibatch's work as they become free (``cost`` plans it); otherwise a
    plan is every rank's microbatches."""
    rank = dist.get_rank()
    clock = Clock(device)
    times, timelines, losses = [], [], []
    for step, (plan, lengths) in enumerate(zip(plans, docs), start=first_step):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=cpu_group)  # every configuration's step starts together
        t0 = time.perf_counter()
        start = clock.mark()
        marks = []
        loss_sum = torch.zeros((), device=device)
        tokens = sum(lengths)  # the minibatch's global token count normalises the loss
        mine = balancer.minibatch(lengths, args.max_tokens, cost) if balancer is not None else plan[rank]
        for i, mb in enumerate(mine):
            if hsdp_once:  # HSDP: the replicate all-reduce after the minibatch's last microbatch only
                model.set_requires_all_reduce(i == len(mine) - 1)
            if decoupled and balancer is None and i == len(mine) - 1:
                odc.last_microbatch(model)  # HSDP: the cross-replica all-reduces start in its backward
            h0 = time.perf_counter()
            docs_mb = [lengths[i] for i in mb] if mb else [8]
            weight = 1.0 if mb else 0.0  # LB-Micro padding: a zero-weight dummy joins the collectives
            x, y = microbatch(step, mb or [-1], docs_mb, args.vocab, device)
            m0 = clock.mark()
            loss = model(x, y, docs_mb) * (weight / tokens)
            if decoupled and balancer is not None and args.hsdp > 1 and mine.exhausted():
                odc.last_microbatch(model)  # nothing left to take: this backward is the rank's last
            loss.backward()
            if straggler is not None:
                straggler.after_microbatch(docs_mb, h0)
            loss_sum += loss.detach()
            marks.append(("micro" if mb else "dummy", m0, clock.mark(), sum(docs_mb) if mb else 0,
                          docs_mb if mb else [], list(mb)))
        s0 = clock.mark()
        if decoupled:
            odc.sync(model)
        s1 = clock.mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        s2 = clock.mark()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        line = [(what, clock.since(start, a), clock.since(start, b), n, d, ix) for what, a, b, n, d, ix in marks]
        line.append(("sync", clock.since(start, s0), clock.since(start, s1), 0, [], []))
        line.append(("optimizer", clock.since(start, s1), clock.since(start, s2), 0, [], []))
        timelines.append(line)
        losses.append(loss_sum.item())  # this rank's share of the minibatch's mean token loss
    return times, timelines, losses


class Straggler:
    """Slows one rank by a fixed factor (see the module docstring); a no-op on other ranks."""

    def __init__(self, spec: str | None, rank: int, device: torch.device, cost):
        self.factor = 1.0
        self.rank = -1
        if spec:
            who, factor = spec.split(":")
            self.rank, self.factor = int(who), float(factor)
            if self.factor < 1.0:
                raise ValueError(f"--straggler factor must be >= 1, got {self.factor}")
        self.active = rank == self.rank and self.factor > 1.0
        self.cuda = device.type == "cuda"
        self.cost = cost
        self.cycles_per_s = None
        if self.active and self.cuda:
            if not isinstance(cost, balance.FittedCost):
                raise ValueError("--straggler on GPUs needs --cost fitted (seconds per microbatch)")
            self.cycles_per_s = self._spin_rate()

    @staticmethod
    def _spin_rate() -> float:
        torch.cuda._sleep(10_000_000)  # warm-up
        rates = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(200_000_000)
            b.record()
            b.synchronize()
            rates.append(200_000_000 / (a.elapsed_time(b) / 1e3))
        return sorted(rates)[1]

    def slowdowns(self, world: int) -> list[float]:
        return [self.factor if r == self.rank else 1.0 for r in range(world)]

    def after_microbatch(self, doc_lengths: list[int], started_s: float) -> None:
        """Called right after a microbatch's backward was issued (``started_s``: host clock
        when it began, used on CPU where the work is done by now)."""
        if not self.active:
            return
        extra = self.factor - 1.0
        if self.cuda:
            torch.cuda._sleep(int(extra * self.cost(doc_lengths) * self.cycles_per_s))
        else:
            time.sleep(extra * (time.perf_counter() - started_s))


# --------------------------------------------------------------------------- analysis

@contextlib.contextmanager
def profiled(enabled: bool):
    """torch.profiler over the block (CUDA kernels only), or nothing."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield prof


def kernel_summary(prof, top: int = 25) -> dict:
    """GPU time per kernel name (the ``top`` largest, names cut to 120 characters), and each
    odc kernel's count, total, median and max duration: where the time of a step goes."""
    from torch.autograd import DeviceType

    per_name: dict = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        per_name.setdefault(e.name, []).append(us)
    rows = sorted(((n, len(v), sum(v)) for n, v in per_name.items()), key=lambda r: -r[2])
    out = {"total_kernel_ms": sum(r[2] for r in rows) / 1e3,
           "top": [{"name": n[:120], "count": c, "total_ms": t / 1e3} for n, c, t in rows[:top]],
           "odc": {}}
    for n, v in per_name.items():
        if "odc" in n or "accumulate" in n:
            v = sorted(v)
            out["odc"][n[:120]] = {"count": len(v), "total_ms": sum(v) / 1e3,
                                   "median_us": v[len(v) // 2], "max_us": v[-1]}
    return out


def fit_time(samples, cost) -> tuple[float, float]:
    """Least squares ``t = a + s * cost(lengths)`` over (lengths, seconds) samples."""
    import numpy as np

    xs = np.array([cost(d) for d, _ in samples], dtype=float)
    ts = np.array([t for _, t in samples], dtype=float)
    if len(samples) < 2 or np.ptp(xs) == 0:  # one microbatch size: no intercept to tell apart
        return 0.0, float(ts.sum() / max(xs.sum(), 1e-30))
    s, a = np.polyfit(xs, ts, 1)
    return float(a), float(s)


def calibration_set(max_tokens: int) -> list[list[int]]:
    """Microbatch compositions that vary both the token count and the document lengths."""
    m = max_tokens
    return [[m], [m // 2], [m // 2] * 2, [m // 4] * 4, [m // 16] * 16, [m // 4], [m // 8] * 2]


def calibrate(model, args, device, cpu_group) -> tuple[balance.FittedCost, list[dict]]:
    """Fit ``a + b * tokens + c * sum(length^2)`` (seconds) to timed microbatches.

    Every rank runs the same compositions at once (FSDP exact mode: ranks wait for each
    other per layer, so equal work keeps the timings clean); the mean over ranks is used.
    """
    clock = Clock(device)
    samples = []
    compositions = calibration_set(args.max_tokens)
    for k, lengths in enumerate([compositions[-1]] + compositions):  # the first is a warm-up
        x, y = microbatch(10**6 + k, list(range(len(lengths))), lengths, args.vocab, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=cpu_group)
        a = clock.mark()
        (model(x, y, lengths) * 0.0).backward()
        b = clock.mark()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k > 0:
            samples.append((lengths, clock.since(a, b)))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [t for _, t in samples], group=cpu_group)
    mean = [sum(ts[i] for ts in gathered) / len(gathered) for i in range(len(samples))]
    fit = balance.FittedCost.fit([(lengths, t) for (lengths, _), t in zip(samples, mean)])
    # noise can make a coefficient slightly negative; a cost model must not be
    fit = balance.FittedCost(max(fit.a, 0.0), max(fit.b, 0.0), max(fit.c, 0.0))
    return fit, [{"lengths": lengths, "seconds": t} for (lengths, _), t in zip(samples, mean)]


def analyse(results, plans_by, docs, cost, world, slowdowns):
    """Fitted per-microbatch time, ideal speedup, bubble rates (in place) and the
    perfect-balance bound. plans_by: the LB-Micro and LB-Mini plans ("lbmicro", "lbmini") and
    the dynamic packing ("dynamic"), per minibatch; slowdowns: each rank's time factor."""
    dec = results.get("decoupled_lbmini") or next(r for n, r in results.items() if n.startswith("decoupled"))
    samples = [(d, e - s) for rank_lines in dec["timelines"] for line in rank_lines
               for what, s, e, _, d, _ix in line if what == "micro"]
    if isinstance(cost, balance.FittedCost):  # calibrated before the runs: already seconds
        fitted = cost
        fit = {"a_s": cost.a, "b_s_per_token": cost.b, "c_s_per_token_pair": cost.c, "source": "calibration"}
    else:  # FLOPs: fit seconds = a + s * FLOPs to the decoupled run's microbatches
        a, s = fit_time(samples, cost)
        fitted = lambda lengths: a + s * cost(lengths)  # noqa: E731
        fit = {"a_s": a, "s_per_flop": s, "source": "decoupled run"}
    fit.update(samples=len(samples),
               mean_abs_error_s=sum(abs(fitted(d) - t) for d, t in samples) / max(len(samples), 1))
    # plan_stats prices an empty (padding) microbatch at 0; the run executes an 8-token dummy
    sync_time = sum(balance.plan_stats([[mb or [len(d)] for mb in rank_plan] for rank_plan in p],
                                       d + [8], fitted)["sync_time"]
                    for p, d in zip(plans_by["lbmicro"], docs))
    decoupled_time = sum(balance.plan_stats(p, d, fitted)["decoupled_time"]
                         for p, d in zip(plans_by["lbmini"], docs))
    for name, res in results.items():  # busy: the fitted time of the real (non-padding) work
        busy = sum(fitted(d) * slowdowns[r] for r, rank_lines in enumerate(res["timelines"])
                   for line in rank_lines for what, _s, _e, _n, d, _ix in line if what == "micro")
        res["bubble_rate"] = max(0.0, 1.0 - busy / (world * sum(res["step_times_s"])))
    # perfect balance of the dynamic packing's microbatches: priced by the calibrated fit, and
    # by their measured times in the dynamic run (a rank's time divided by its slowdown)
    bound = {"fitted_s": sum(balance.balance_bound([fitted([d[i] for i in mb]) for mb in p], slowdowns)
                             for p, d in zip(plans_by["dynamic"], docs))}
    if "decoupled_dynamic" in results:
        lines = results["decoupled_dynamic"]["timelines"]
        bound["measured_s"] = sum(
            balance.balance_bound([(e - s) / slowdowns[r] for r in range(world)
                                   for what, s, e, *_ in lines[r][k] if what == "micro"], slowdowns)
            for k in range(len(docs)))
    return fit, sync_time / decoupled_time, bound


# --------------------------------------------------------------------------- main

def sharding_meshes(device, world: int, replicas: int, ref_backend: str | None):
    """odc's mesh (the default group's backend) and the reference's (groups of
    ``ref_backend``): 1-D, or with ``replicas`` > 1 HSDP (replicas, world / replicas)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % replicas:
        raise SystemExit(f"--hsdp {replicas}: the world size {world} is not a multiple of it")
    shape = (world,) if replicas == 1 else (replicas, world // replicas)
    dims = ("shard",) if replicas == 1 else ("replicate", "shard")
    # Distinct dim names: meshes of one shape compare equal otherwise, and FSDP2 then gave the
    # second model's parameters the first mesh (seen on torch 2.13: odc runs moved by gloo).
    meshes = {"odc": init_device_mesh(device.type, shape, mesh_dim_names=tuple(f"odc_{d}" for d in dims))}
    if ref_backend is not None:  # the same shape on groups of NCCL (gloo on CPU)
        names = tuple(f"reference_{d}" for d in dims)
        meshes["reference"] = init_device_mesh(device.type, shape, mesh_dim_names=names,
                                               backend_override={n: ref_backend for n in names})
    return meshes


def cross_host_traffic(mesh, shard_numel: int, device, cpu_group) -> dict:
    """What the replicate all-reduce moves per minibatch (fp32 gradients: each rank's shard)
    and how long one takes on ``mesh``'s replicate group, timed alone (best of two)."""
    group = mesh.get_group(0)
    grads = torch.ones(shard_numel, dtype=torch.float32, device=device)
    times = []
    for _ in range(3):  # the first one warms the communicator up
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=cpu_group)
        t0 = time.perf_counter()
        dist.all_reduce(grads, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    n = group.size()
    best = min(times[1:])
    return {"replicas": n, "bytes_per_rank_per_allreduce": shard_numel * 4, "allreduce_s": best,
            "allreduce_s_all": times,
            "busbw_gbps": shard_numel * 4 * 2 * (n - 1) / n / best / 1e9,
            "backend": group._get_backend(device).name()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--model", choices=("auto", "small", "qwen2-tiny", "qwen2-1.5b"), default="auto",
                   help="auto: qwen2-1.5b on GPUs, small on CPU")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--steps", type=int, default=None, help="minibatches, the first one untimed")
    p.add_argument("--docs-per-step", type=int, default=None, help="documents per minibatch (global)")
    p.add_argument("--mean-len", type=int, default=None, help="mean document length (tokens)")
    p.add_argument("--max-tokens", type=int, default=None, help="token cap per microbatch")
    p.add_argument("--loss-chunk", type=int, default=8192, help="tokens per LM-head chunk (GPU model)")
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--configs", default="reference_lbmicro,exact_lbmicro,decoupled_lbmini,decoupled_dynamic",
                   help="comma-separated, from reference_lbmicro, reference_arpermicro_lbmicro (--hsdp: "
                        "the replicate all-reduce after every microbatch), exact_lbmicro, exact_registered_lbmicro, "
                        "decoupled_lbmini, decoupled_dynamic, decoupled_adaptive, decoupled_local_lbmini "
                        "(odc.decouple(..., accumulate='local'))")
    p.add_argument("--straggler", default=None, metavar="RANK:FACTOR",
                   help="rank RANK runs every microbatch FACTOR times as long (e.g. 1:1.3)")
    p.add_argument("--cost", choices=("fitted", "flops"), default="fitted",
                   help="planning cost model: fitted to timed microbatches before the runs, or "
                        "TransformerCost FLOPs")
    p.add_argument("--balanced", action="store_true", help="constant document lengths (control)")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="HSDP: R replicas of world / R shards each (R > 1; across hosts: R = the hosts)")
    p.add_argument("--profile", action="store_true",
                   help="diagnosis, not a benchmark: run the timed steps under torch.profiler and "
                        "record per configuration and rank the GPU kernels' time by name (tokens/s "
                        "then include the profiler's overhead)")
    p.add_argument("--trace-dir", default=None, help="with --profile: also write Chrome traces there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(_meta.default_out_dir()), help=_meta.OUT_DIR_HELP)
    args = p.parse_args()
    if args.trace_dir and not args.profile:
        p.error("--trace-dir writes the traces of --profile: add --profile")
    if "reference_arpermicro_lbmicro" in args.configs.split(",") and args.hsdp == 1:
        p.error("reference_arpermicro_lbmicro is an HSDP configuration: add --hsdp R")
    return args


def setup(args) -> SimpleNamespace:
    """The process group, the device, the model's shape and builder, and the planning cost
    model (before calibration) from the arguments (filled in where they were left out)."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        # ranks may share GPUs (odc allows it; then leave out reference_lbmicro: NCCL does not)
        local_rank = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("cpu:gloo,cuda:odc")
        ref_backend = "nccl"
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("cpu:odc")
        ref_backend = "gloo"

    world, rank = dist.get_world_size(), dist.get_rank()
    model_kind = args.model if args.model != "auto" else ("qwen2-1.5b" if use_cuda else "small")
    gpu_scale = model_kind == "qwen2-1.5b"
    args.steps = args.steps or (5 if gpu_scale else 9)
    args.mean_len = args.mean_len or (16500 if gpu_scale else 200)
    args.max_tokens = args.max_tokens or (65536 if gpu_scale else 768)
    # 4 documents per rank on average: the 2-GPU runs with 8 per rank left LB-Micro little to lose
    default_docs = 4 * world if gpu_scale else 10
    docs_label = f"-docs{args.docs_per_step}" if args.docs_per_step not in (None, default_docs) else ""
    args.docs_per_step = args.docs_per_step or default_docs

    if model_kind == "small":
        shape = dict(hidden_size=128, num_hidden_layers=args.layers or 4, num_attention_heads=4,
                     vocab_size=512, intermediate_size=512)
        build = lambda: SmallPackedLM(shape["vocab_size"], shape["hidden_size"],  # noqa: E731
                                      shape["num_attention_heads"], shape["num_hidden_layers"])
        cost = balance.TransformerCost.from_hf_config(SimpleNamespace(**shape), gated_mlp=False)
    else:
        shape = dict(QWEN2_1_5B if model_kind == "qwen2-1.5b" else QWEN2_TINY)
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        ac = not args.no_activation_checkpointing
        build = lambda: PackedQwen2(shape, ac, args.loss_chunk)  # noqa: E731
        cost = balance.TransformerCost.from_hf_config(SimpleNamespace(**shape),
                                                      linear_training_factor=4.0 if ac else 3.0)
    args.vocab = shape["vocab_size"]

    return SimpleNamespace(use_cuda=use_cuda, device=device, ref_backend=ref_backend, world=world,
                           rank=rank, model_kind=model_kind, gpu_scale=gpu_scale, docs_label=docs_label,
                           shape=shape, build=build, cost=cost)


def run_configuration(name, env, args, meshes, build_sharded, plans, docs, straggler, cost, cpu_group):
    """Train one configuration: a warm-up minibatch, then the timed ones; every rank's
    timings and losses merged (rank 0 prints them). Returns (merged result, this rank's
    shard elements, the model's parameters)."""
    use_cuda, device, world, rank = env.use_cuda, env.device, env.world, env.rank
    model = opt = prof = None
    decoupled = name.startswith("decoupled")
    # FSDP2's reference cycles keep the previous configuration's model, gradients and
    # optimizer state alive until a collection: without one they count in this one's peak
    gc.collect()
    if use_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        used_before = torch.cuda.mem_get_info(device)
    mesh = meshes["reference" if name.startswith("reference") else "odc"]
    model = build_sharded(mesh)
    n_params = sum(q.numel() for q in model.parameters())  # global: DTensor numel
    shard_numel = sum(q.to_local().numel() for q in model.parameters())  # this rank's
    on = next(model.parameters()).device_mesh  # the mesh FSDP2 gave the parameters
    moved_by = on.get_group(on.ndim - 1)._get_backend(device).name()
    if moved_by != ("odc" if mesh is meshes["odc"] else env.ref_backend):
        raise RuntimeError(f"{name}: the parameters' mesh moves {device.type} tensors with {moved_by}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if "_registered" in name:
        odc.use_registered_memory(model)
    if decoupled:
        odc.decouple(model, opt, accumulate="local" if "_local" in name else "owner")
    balancer = None
    if name.endswith("_dynamic"):
        balancer = balance.DynamicBalancer(name=name)
    elif name.endswith("_adaptive"):  # each rank to its own queue; with HSDP its largest last
        balancer = balance.DynamicBalancer(name=name, take_from_others=False, largest_last=args.hsdp > 1)
    plan = plans[name]
    run = dict(balancer=balancer, straggler=straggler, cost=cost,
               hsdp_once=args.hsdp > 1 and name == "reference_lbmicro")
    train_steps(model, opt, plan[:1], docs[:1], args, decoupled, device, cpu_group, **run)  # warm-up
    before = odc.metrics(model) if decoupled else None
    with profiled(args.profile and use_cuda) as prof:
        times, timelines, losses = train_steps(model, opt, plan[1:], docs[1:], args, decoupled,
                                               device, cpu_group, first_step=1, **run)
    res = {"local_step_times_s": times, "local_losses": losses}
    if prof is not None:
        res["kernels"] = kernel_summary(prof)
        if args.trace_dir:  # Chrome traces (gzip), one per configuration and rank
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace_dir) / f"trace_{name}_rank{rank}.json.gz"))
    if use_cuda:
        free, total = torch.cuda.mem_get_info(device)
        res.update(peak_allocated_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                   device_used_gib=(total - free) / 2**30,
                   device_used_growth_gib=(used_before[0] - free) / 2**30)
    if decoupled:
        after = odc.metrics(model)
        busy = after["busy_s"] - before["busy_s"]
        wait = after["sync_wait_s"] - before["sync_wait_s"]
        res.update(odc_busy_s=busy, odc_sync_wait_s=wait, odc_bubble_rate=wait / (busy + wait))
    gathered = [None] * world
    dist.all_gather_object(gathered, (res, timelines), group=cpu_group)
    per_rank, lines = [g[0] for g in gathered], [g[1] for g in gathered]
    merged = {"step_times_s": [max(r["local_step_times_s"][k] for r in per_rank) for k in range(len(times))],
              "loss_per_step": [sum(r["local_losses"][k] for r in per_rank) for k in range(len(times))],
              "per_rank": per_rank, "timelines": lines,
              "per_rank_microbatches": [[sum(1 for e in lines[r][k] if e[0] in ("micro", "dummy"))
                                         for r in range(world)] for k in range(len(times))]}
    # the minibatch's time: every rank done with odc.sync (the optimizer step follows)
    merged["minibatch_times_s"] = [max(next(e[2] for e in lines[r][k] if e[0] == "sync")
                                       for r in range(world)) for k in range(len(times))]
    merged["mean_step_s"] = sum(merged["step_times_s"]) / len(times)
    merged["tokens_per_s"] = sum(sum(d) for d in docs[1:]) / sum(merged["step_times_s"])
    if use_cuda:
        merged["peak_reserved_gib_max"] = max(r["peak_reserved_gib"] for r in per_rank)
        merged["device_used_gib_max"] = max(r["device_used_gib"] for r in per_rank)
    if rank == 0:
        mem = f", peak reserved {merged['peak_reserved_gib_max']:.1f} GiB" if use_cuda else ""
        odcb = (f", time in odc.sync {100 * sum(r['odc_bubble_rate'] for r in per_rank) / world:.1f}%"
                if decoupled else "")
        print(f"[train_imbalanced] {name:22s} {merged['tokens_per_s']:9.0f} tokens/s, "
              f"step {merged['mean_step_s'] * 1e3:8.1f} ms{mem}{odcb}; loss per step "
              + " ".join(f"{v:.4f}" for v in merged["loss_per_step"]), flush=True)
    del model, opt
    if use_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    return merged, shard_numel, n_params


def summarize(results, plans_by, docs, cost, world, straggler, args, use_cuda) -> dict:
    """Speedups, the ideal and the balance bound, bubble rates, memory ratios."""
    summary = {}
    timed_docs = docs[1:]
    if any(n.startswith("decoupled") for n in results) and (
            "exact_lbmicro" in results or "reference_lbmicro" in results):
        timed_plans = {n: pl[1:] for n, pl in plans_by.items()}
        fit, ideal, bound = analyse(results, timed_plans, timed_docs, cost, world, straggler.slowdowns(world))
        summary.update(microbatch_time_fit=fit, ideal_speedup=ideal, straggler=args.straggler,
                       slowdowns=straggler.slowdowns(world), balance_bound=bound)
        base = results.get("reference_lbmicro", results.get("exact_lbmicro"))
        for name, res in results.items():
            summary[f"speedup_{name}_vs_{'reference' if 'reference_lbmicro' in results else 'exact'}_lbmicro"] = \
                res["tokens_per_s"] / base["tokens_per_s"]
        if "decoupled_dynamic" in results:  # the dynamic-balancing targets' fields
            dyn = results["decoupled_dynamic"]
            summary["speedup_dynamic_vs_nccl_lbmicro"] = (
                dyn["tokens_per_s"] / results["reference_lbmicro"]["tokens_per_s"]
                if "reference_lbmicro" in results else None)
            summary["speedup_dynamic_vs_static_lbmini"] = (
                dyn["tokens_per_s"] / results["decoupled_lbmini"]["tokens_per_s"]
                if "decoupled_lbmini" in results else None)
            # the bound is compute only: compare with the time to the end of odc.sync; the
            # measured microbatch times price it (the fit's error would move it)
            summary["fraction_of_balance_bound"] = bound["measured_s"] / sum(dyn["minibatch_times_s"])
            summary["fraction_of_balance_bound_fitted"] = bound["fitted_s"] / sum(dyn["minibatch_times_s"])
            for name, res in results.items():
                res["fraction_of_balance_bound"] = bound["measured_s"] / sum(res["minibatch_times_s"])
        for name in (n for n in results if n.startswith("decoupled")):
            tag = name[:-len("_lbmini")] if name.endswith("_lbmini") else name  # decoupled, decoupled_local, decoupled_dynamic
            sp = results[name]["tokens_per_s"] / base["tokens_per_s"]
            summary[f"{tag}_speedup_over_ideal"] = sp / ideal
            summary[f"{tag}_fraction_of_ideal_gain"] = (sp - 1) / (ideal - 1) if ideal > 1 + 1e-9 else None
            if use_cuda and "reference_lbmicro" in results:
                summary[f"peak_memory_ratio_{tag}_vs_reference"] = (
                    results[name]["peak_reserved_gib_max"] / base["peak_reserved_gib_max"])
        summary["bubble_rate"] = {n: r["bubble_rate"] for n, r in results.items()}
    return summary


def make_plans(docs, world, args, cost, names):
    """Every planner's plans of the minibatches (plans_by), and each configuration's (its
    name's suffix names its planner)."""
    plans_by = {"lbmicro": [balance.lb_micro(d, world, args.max_tokens, cost) for d in docs],
                "lbmini": [balance.lb_mini(d, world, args.max_tokens, cost) for d in docs],
                # dynamic: planned in the run; this packing prices the perfect-balance bound
                "dynamic": [balance.pack(d, args.max_tokens, cost) for d in docs]}
    plans_by["adaptive"] = plans_by["dynamic"]  # planned in the run too
    if args.hsdp > 1:  # each rank's largest microbatch last: its backward hides the cross-replica all-reduce
        for name in ("lbmicro", "lbmini"):
            plans_by[name] = [[list(reversed(rank_plan)) for rank_plan in plan] for plan in plans_by[name]]
    plans = {name: plans_by[name.rsplit("_", 1)[1]] for name in names}
    return plans_by, plans


def write_result(args, env, device, world, n_params, calibration, warm_s, cost, cross_host, docs,
                 results, summary) -> None:
    """Rank 0: the result file (<out-dir>/train_imbalanced_<kind>_<date>.json)."""
    shape = env.shape
    kind = _meta.machine_kind(device, world)
    if args.hsdp > 1:  # emulated or real hosts: one replica a host (ODC_HOST_SIZE says so)
        kind += f"-{args.hsdp}hosts" if os.environ.get("ODC_HOST_SIZE") else f"-hsdp{args.hsdp}"
    if not os.environ.get("ODC_BENCH_KIND"):  # unless the caller names the kind
        kind += env.docs_label  # another minibatch size than the default: its own result file
    suffix = ("_balanced" if args.balanced else "") + ("_straggler" if args.straggler else "")
    out = _meta.result_path(args.out_dir, "train_imbalanced", kind, suffix)
    out.write_text(json.dumps({
        "benchmark": "train_imbalanced", "kind": kind, "world_size": world, "model": env.model_kind,
        "model_shape": shape, "parameters": n_params, "device": str(device.type),
        **_meta.stamp(device, world), "args": vars(args), "calibration": calibration,
        "attention_warmup_s": warm_s,
        "cost_model": (dataclasses.asdict(cost) if dataclasses.is_dataclass(cost) else str(cost)),
        "hsdp_replicas": args.hsdp, "odc_host_size": os.environ.get("ODC_HOST_SIZE"),
        "nccl_hostid": os.environ.get("NCCL_HOSTID"), "cross_host": cross_host,
        "documents": docs, "results": results, "summary": summary}, indent=1))
    print(f"[train_imbalanced] wrote {out}", flush=True)


def main() -> int:
    args = parse_args()
    env = setup(args)
    use_cuda, device, world, rank = env.use_cuda, env.device, env.world, env.rank
    shape, build, cost = env.shape, env.build, env.cost
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cpu_group = dist.new_group(backend="gloo")
    names = [n for n in args.configs.split(",") if n]
    meshes = sharding_meshes(device, world, args.hsdp,
                             env.ref_backend if any(n.startswith("reference") for n in names) else None)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if use_cuda else MixedPrecisionPolicy())

    def build_sharded(mesh):
        torch.manual_seed(args.seed)  # the same initial weights every time
        with device:
            model = build()
        for layer in model.layers():
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    docs = [make_documents(args.docs_per_step, args.seed * 100 + s, args.balanced, args.mean_len,
                           args.max_tokens) for s in range(args.steps)]
    warm_s = None
    if env.model_kind.startswith("qwen2") and use_cuda:  # every document length of the run, and calibration's
        heads = shape["num_attention_heads"]
        warm_s = warm_attention([n for d in docs for n in d] + [n for c in calibration_set(args.max_tokens) for n in c],
                                heads, shape["hidden_size"] // heads, device)
        if rank == 0:
            print(f"[train_imbalanced] attention plans for every document length built in {warm_s:.1f} s",
                  flush=True)
    calibration = None
    if args.cost == "fitted":
        model = build_sharded(meshes["odc"])
        cost, calibration = calibrate(model, args, device, cpu_group)
        del model
        if rank == 0:
            print(f"[train_imbalanced] calibrated microbatch time: {cost.a * 1e3:.1f} ms + "
                  f"{cost.b * 1e6:.3f} us/token + {cost.c * 1e12:.3f} ps/token pair", flush=True)

    plans_by, plans = make_plans(docs, world, args, cost, names)
    if rank == 0:
        n_tokens = sum(map(sum, docs))
        straggling = f"; rank {args.straggler.replace(':', ' runs x')}" if args.straggler else ""
        print(f"[train_imbalanced] {env.model_kind} ({shape['num_hidden_layers']} layers) on {world} x "
              f"{torch.cuda.get_device_name(device) if use_cuda else 'cpu'}; {args.steps} minibatches "
              f"of {args.docs_per_step} {'balanced' if args.balanced else 'long-tailed'} documents "
              f"({n_tokens / args.steps:.0f} tokens each), <= {args.max_tokens} tokens per microbatch"
              f"{straggling}", flush=True)
    straggler = Straggler(args.straggler, rank, device, cost)

    results = {}
    for name in names:
        results[name], shard_numel, n_params = run_configuration(name, env, args, meshes, build_sharded, plans,
                                                       docs, straggler, cost, cpu_group)

    cross_host = None
    if args.hsdp > 1:  # the replicate all-reduce's bytes and time (the reference's group; odc's is its inner one)
        cross_host = cross_host_traffic(meshes.get("reference", meshes["odc"]), shard_numel, device, cpu_group)
        cross_host["allreduces_per_minibatch"] = {
            n: (max(c for c in r["per_rank_microbatches"][0]) if n == "reference_arpermicro_lbmicro" else 1)
            for n, r in results.items()}
        if rank == 0:
            print(f"[train_imbalanced] cross-replica all-reduce: {cross_host['bytes_per_rank_per_allreduce'] / 2**30:.2f}"
                  f" GiB per rank in {cross_host['allreduce_s']:.3f} s ({cross_host['busbw_gbps']:.2f} GB/s bus, "
                  f"{cross_host['backend']})", flush=True)
    summary = summarize(results, plans_by, docs, cost, world, straggler, args, use_cuda)
    if rank == 0:
        for k, v in summary.items():
            if not isinstance(v, dict):
                print(f"[train_imbalanced] {k}: {v:.3f}" if isinstance(v, float) else f"[train_imbalanced] {k}: {v}")
        print("[train_imbalanced] bubble rate: "
              + ", ".join(f"{n} {100 * b:.1f}%" for n, b in summary.get("bubble_rate", {}).items()), flush=True)
        write_result(args, env, device, world, n_params, calibration, warm_s, cost, cross_host, docs,
                     results, summary)
    dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main())
