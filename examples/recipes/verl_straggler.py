"""A slow rank for the verl SFT comparison (examples/recipes/verl_sft.py --straggler RANK:FACTOR).

Loaded through verl's ``VERL_USE_EXTERNAL_MODULES`` (imported with ``verl``) in both runs.
On rank RANK, after each decoder layer's forward, the GPU spins for (FACTOR - 1) times twice
the forward's time: with activation checkpointing (the recipe's GPU setting) a layer runs its
forward twice per step and its backward costs about two forwards, so each forward call stands
for two forwards' work, and the layers' share of the step grows by FACTOR. It is a
``torch.cuda._sleep`` kernel on the compute stream whose length comes from the previous call's
CUDA events (a running average of the layers' time per token), so the host never waits for
the GPU. PyTorch's public global forward hooks attach it.

``RANK:FACTOR:host`` slows the rank's host instead, for steps bound by the host (verl's
per-token log-probability loop where flash-attn is missing keeps the GPU waiting for launches,
so a longer GPU kernel there costs nothing): before each microbatch's forward of the model
(the module whose class name ends in ``ForCausalLM`` or ``ForTokenClassification``) and before
each optimizer step, the host sleeps (FACTOR - 1) times the wall time since the previous such
point of the same step, so every microbatch, its log-probabilities and its backward included,
takes about FACTOR times as long. PyTorch's public global forward and optimizer pre-hooks
attach it.
"""
from __future__ import annotations

import os
import time

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_SPEC = os.environ.get("ODC_RECIPE_STRAGGLER", "")


def _install(rank: int, factor: float) -> None:
    if int(os.environ.get("RANK", "0")) != rank or not torch.cuda.is_available():
        return
    rate = {"ms_per_token": None, "cycles_per_ms": None}  # the layers' time per token; the spin's speed
    pending: list[tuple] = []

    def is_layer(module) -> bool:
        return type(module).__name__.endswith("DecoderLayer")

    def before(module, args):
        if is_layer(module):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            module._odc_straggler_start = start

    def calibrate() -> float:  # on the rank's own GPU, at its first layer (verl set the device)
        torch.cuda._sleep(1_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(100_000_000)
        b.record()
        b.synchronize()
        return 100_000_000 / a.elapsed_time(b)

    def after(module, args, output):
        if not is_layer(module):
            return
        if rate["cycles_per_ms"] is None:
            rate["cycles_per_ms"] = calibrate()
        tokens = int(args[0].shape[-2]) if args and hasattr(args[0], "shape") and args[0].dim() >= 2 else 1
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        pending.append((module._odc_straggler_start, end, tokens))
        while pending and pending[0][1].query():  # fold in the calls that have finished
            s, e, n = pending.pop(0)
            ms = s.elapsed_time(e) / n
            old = rate["ms_per_token"]
            rate["ms_per_token"] = ms if old is None else 0.9 * old + 0.1 * ms
        if rate["ms_per_token"] is not None:
            torch.cuda._sleep(int((factor - 1.0) * 2 * rate["ms_per_token"] * tokens * rate["cycles_per_ms"]))

    torch.nn.modules.module.register_module_forward_pre_hook(before)
    torch.nn.modules.module.register_module_forward_hook(after)


def _install_host(rank: int, factor: float) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    since = {"t": None}  # the previous microbatch's start in this step (None: the step's first is next)

    def pay() -> None:  # the work since the previous point, once more times (FACTOR - 1)
        if since["t"] is not None:
            time.sleep((factor - 1.0) * (time.perf_counter() - since["t"]))

    def before_forward(module, args):
        if type(module).__name__.endswith(("ForCausalLM", "ForTokenClassification")):
            pay()
            since["t"] = time.perf_counter()

    def before_step(optimizer, args, kwargs):
        pay()
        since["t"] = None

    torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
    register_optimizer_step_pre_hook(before_step)


def parse(spec: str) -> tuple[int, float, str]:
    """``RANK:FACTOR`` (the GPU) or ``RANK:FACTOR:host``: (rank, factor, "gpu" or "host")."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("gpu", "host")):
        raise ValueError(f"ODC_RECIPE_STRAGGLER={spec!r}: expected RANK:FACTOR or RANK:FACTOR:host")
    if float(parts[1]) <= 1.0:
        raise ValueError(f"ODC_RECIPE_STRAGGLER factor must be > 1, got {parts[1]}")
    return int(parts[0]), float(parts[1]), parts[2] if len(parts) == 3 else "gpu"


if _SPEC:
    _rank, _factor, _where = parse(_SPEC)
    (_install_host if _where == "host" else _install)(_rank, _factor)
