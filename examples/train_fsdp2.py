#!/usr/bin/env python3
"""Train a small decoder-only transformer with FSDP2 over the "odc" backend.

Launch under torchrun, e.g.

    torchrun --standalone --nproc-per-node=2 examples/train_fsdp2.py            # CPU
    torchrun --standalone --nproc-per-node=4 examples/train_fsdp2.py --hsdp     # 4 GPUs

Device is picked automatically: CUDA when available (process group
"cpu:gloo,cuda:odc", bf16 parameters with fp32 gradient reduction), else CPU
("cpu:odc", fp32). ``--backend reference`` runs the same training on the stock
backends (NCCL on GPUs, gloo on CPU) for comparison.

The model code is unmodified FSDP2: ``fully_shard`` on every block and on the
root, over a mesh from ``init_device_mesh``. The data is synthetic and
learnable: each sequence is an arithmetic progression modulo the vocabulary,
``x[t] = (x0 + t * stride) % vocab`` with a random start and a random stride
from a small set, so the loss falls from ln(vocab) towards zero once the model
reads the stride off the context.
"""
from __future__ import annotations

import os

# NVLink multicast stays off (docs/configuration.md: a program using it can take a shared
# host's GPUs out of service);
# these must be set before torch.distributed / NCCL initialise.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import torch_odc_backend as odc  # noqa: E402  (registers "odc"; import it before CUDA initialises)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from tiny_lm import TinyLM  # noqa: E402  (examples/tiny_lm.py, beside this file)

try:  # public since torch 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

# Defaults per device: small enough for ~1 minute with 2 processes on 2 CPU cores.
CPU_DEFAULTS = dict(layers=2, d_model=128, heads=4, vocab=256, seq=64, batch=8, steps=100, lr=3e-3)
GPU_DEFAULTS = dict(layers=4, d_model=256, heads=8, vocab=512, seq=128, batch=32, steps=200, lr=3e-3)
STRIDES = (1, 2, 3, 5)


# --------------------------------------------------------------------------- data
def make_batch(gen: torch.Generator, batch: int, seq: int, vocab: int, device) -> torch.Tensor:
    """Arithmetic progressions mod vocab; returns (batch, seq + 1) token ids."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (batch, 1), generator=gen)]
    t = torch.arange(seq + 1).unsqueeze(0)
    return ((start + t * stride) % vocab).to(device, non_blocking=True)


# --------------------------------------------------------------------------- setup
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 100 CPU / 200 GPU)")
    p.add_argument("--backend", choices=("auto", "odc", "reference"), default="auto",
                   help="auto = odc; reference = stock NCCL (GPU) / gloo (CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--hsdp", action="store_true",
                   help="2-D mesh (replicate x shard); needs an even world size")
    p.add_argument("--shard-size", type=int, default=2,
                   help="with --hsdp: ranks per shard group (default 2)")
    p.add_argument("--grad-accum", type=int, default=1, help="microbatches per optimizer step")
    p.add_argument("--sync-every-micro", action="store_true",
                   help="reduce-scatter after every microbatch instead of only the last one")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per microbatch per rank")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--decoupled", action="store_true",
                   help="odc decoupled mode: one synchronisation per step (odc.decouple / odc.sync)")
    p.add_argument("--accumulate", choices=("owner", "local"), default="owner",
                   help="decoupled mode's gradient accumulation: atomic adds into the owners' "
                        "accumulators during backward, or local fp32 sums reduce-scattered in sync")
    return p.parse_args(argv)


def setup(args):
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        sys.exit("--device cuda requested but CUDA is not available")
    backend_kind = "odc" if args.backend in ("auto", "odc") else "reference"
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # The odc backend refuses init_process_group(device_id=...): set the device first.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        pg_backend = "cpu:gloo,cuda:odc" if backend_kind == "odc" else "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        pg_backend = "cpu:odc" if backend_kind == "odc" else "gloo"
    dist.init_process_group(pg_backend)
    defaults = GPU_DEFAULTS if use_cuda else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return device, pg_backend


def build_mesh(args, device):
    world = dist.get_world_size()
    if args.hsdp:
        if world % args.shard_size != 0 or world % 2 != 0:
            sys.exit(f"--hsdp needs a world size divisible by 2 and by --shard-size; got {world}")
        return init_device_mesh(device.type, (world // args.shard_size, args.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))


def main(argv=None) -> int:
    args = parse_args(argv)
    device, pg_backend = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.d_model % args.heads:
        sys.exit("--d-model must be divisible by --heads")

    mesh = build_mesh(args, device)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = TinyLM(args.vocab, args.d_model, args.heads, args.layers, args.seq).to(device)
    n_params = sum(p.numel() for p in model.parameters())

    fsdp_kwargs = dict(mesh=mesh, reshard_after_forward=not args.no_reshard_after_forward)
    if device.type == "cuda":
        fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if args.decoupled:  # (odc.decouple refuses a model that is not on an odc mesh)
        odc.decouple(model, opt, accumulate=args.accumulate)  # the first of the two lines decoupled mode adds
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # different data per rank
    tokens_per_step = world * args.grad_accum * args.batch * args.seq
    if rank == 0:
        mesh_desc = "x".join(str(s) for s in mesh.shape)
        print(f"[train_fsdp2] backend={pg_backend}{' (decoupled)' if args.decoupled else ''} "
              f"device={device.type} world={world} mesh={mesh_desc}"
              f"{' (replicate x shard)' if args.hsdp else ''} params={n_params / 1e6:.2f}M "
              f"layers={args.layers} d={args.d_model} vocab={args.vocab} seq={args.seq} "
              f"batch={args.batch} grad_accum={args.grad_accum} steps={args.steps}", flush=True)

    first_loss = last_loss = None
    t0 = t_last = time.perf_counter()
    tokens_since = 0
    for step in range(1, args.steps + 1):
        loss_sum = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            last_micro = micro == args.grad_accum - 1
            if args.grad_accum > 1 and not args.sync_every_micro and not args.decoupled:
                model.set_requires_gradient_sync(last_micro)
            data = make_batch(gen, args.batch, args.seq, args.vocab, device)
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), data[:, 1:].reshape(-1))
            (loss / args.grad_accum).backward()
            loss_sum += loss.detach()
        if args.decoupled:
            odc.sync(model)  # the second: every rank's gradients have landed, .grad is final
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens_since += tokens_per_step

        if step % args.log_every == 0 or step == 1 or step == args.steps:
            # Mean loss over microbatches and ranks (a collective: every rank logs together).
            avg = loss_sum / args.grad_accum
            dist.all_reduce(avg, op=dist.ReduceOp.SUM)
            avg = avg.item() / world  # .item() synchronises the device, so timings below are real
            now = time.perf_counter()
            if first_loss is None:
                first_loss = avg
            last_loss = avg
            if rank == 0:
                tps = tokens_since / max(now - t_last, 1e-9)
                print(f"step {step:5d}/{args.steps}  loss {avg:7.4f}  tokens/s {tps:10.0f}  "
                      f"elapsed {now - t0:7.1f}s", flush=True)
            t_last, tokens_since = now, 0

    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(f"[train_fsdp2] done: loss {first_loss:.4f} -> {last_loss:.4f} "
              f"(ln(vocab) = {math.log(args.vocab):.4f}) in {elapsed:.1f}s, "
              f"{tokens_per_step * args.steps / elapsed:.0f} tokens/s overall", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
