"""A plain FSDP2 training script: it never imports torch_odc_backend and never names a
backend (init_device_mesh creates the default group with init_process_group() and no
backend). With ODC_DEFAULT_BACKEND set, the installed package's torch.backends entry point
makes odc the default backend, and this same script trains on odc.

    torchrun --standalone --nproc-per-node=2 tests/integrations/plain_fsdp2.py --out DIR [--device cuda]

Each rank writes DIR/rank<r>.pt: its losses, grad norms, final parameters, the backend that
served its device, and whether torch_odc_backend was imported before the group existed.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fsdp_models as fm  # noqa: E402  (the tests' tiny transformer and its training loop)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":  # ranks share the GPUs where there are fewer
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    imported_before = "torch_odc_backend" in sys.modules
    mesh = init_device_mesh(args.device, (world,))
    dev = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    backend = dist.group.WORLD._get_backend(torch.device(args.device))
    res = fm.train(mesh, device=dev, steps=args.steps, clip_norm=0.05)  # clipping: an all-reduce too
    stats = dict(backend.stats()) if backend.name() == "odc" else {}
    torch.save({"backend": backend.name(), "imported_before_group": imported_before, "stats": stats,
                "losses": res["losses"], "norms": res["norms"], "params": res["params"]},
               os.path.join(args.out, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()
    # groups left to interpreter shutdown (FSDP2 and the mesh keep them) sometimes abort the
    # process there ("terminate called without an active exception", gloo too): free them now
    del mesh, backend, res
    gc.collect()


if __name__ == "__main__":
    main()
