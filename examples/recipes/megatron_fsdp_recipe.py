#!/usr/bin/env python3
"""Megatron-FSDP (``pip install megatron-fsdp``), used as its README's Quick Start uses it,
on odc through ``ODC_DEFAULT_BACKEND`` alone.

The training code (``train``) names no backend: ``torch.distributed.init_process_group()``
takes PyTorch's per-device defaults (``Backend.default_device_backend_map``), and
``megatron_fsdp.fully_shard_model`` without a mesh builds its own
(``init_device_mesh("cuda", (world, 1), ("fsdp", "tp"))``) from the default group. So::

    ODC_DEFAULT_BACKEND=cuda torchrun --standalone --nproc-per-node=2 \\
        examples/recipes/megatron_fsdp_recipe.py train --out odc.json       # odc
    torchrun --standalone --nproc-per-node=2 \\
        examples/recipes/megatron_fsdp_recipe.py train --out nccl.json      # NCCL (a GPU per rank)
    python examples/recipes/megatron_fsdp_recipe.py reference --world 2 --out single.json

``reference`` is one process without Megatron-FSDP or torch.distributed: the same model and
data, each step's loss the mean of the N ranks' batch losses, and Megatron-FSDP's optimizer
arrangement (fp32 main parameters copied into the model after each step; the step on zero
gradients ``fully_shard_optimizer`` makes first). Where ranks share one GPU (NCCL refuses
that) it is what odc can be compared with; on 2 ranks it should match bitwise (sums of two
are exact in any order). ``compare --work DIR`` runs odc, the reference(s) and compares
per-rank per-step losses: ``DIR/megatron_fsdp_result.json``.

Model: a small decoder-only transformer (fp32, the math SDPA kernel, deterministic
algorithms); data: learnable arithmetic progressions; both fixed by ``--seed``.
Megatron-FSDP shards every ``Block`` (``zero_dp_strategy=3``: parameters, gradients,
optimizer state), gathers parameters with coalesced ``all_gather_into_tensor`` and reduces
gradients with coalesced ``reduce_scatter_tensor`` of ``PREMUL_SUM(1/world)`` (its
``gradient_reduce_div_fusion`` default; gloo refuses PREMUL_SUM, NCCL and odc take it).

``--device cpu`` (compare) is for tests: Megatron-FSDP runs on CUDA only, so the ranks then
run with tests/integrations/megatron_fsdp_cpu_shim first on their PYTHONPATH, the switch is
``ODC_DEFAULT_BACKEND=cpu`` and ``train`` passes ``device=cpu`` to ``fully_shard_model``.
"""
from __future__ import annotations

import os

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}.items():
    os.environ.setdefault(_k, _v)  # before CUDA / NCCL start

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for tiny_lm
from tiny_lm import Block, TinyLM  # noqa: E402  (examples/tiny_lm.py)

STRIDES = (1, 2, 3, 5)
REPO = Path(__file__).resolve().parents[2]
CPU_SHIM = REPO / "tests" / "integrations" / "megatron_fsdp_cpu_shim"


def batch(a, rank: int, step: int, device) -> torch.Tensor:
    """Rank ``rank``'s batch of step ``step``: (batch, seq + 1) token ids."""
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 1009 + rank)
    start = torch.randint(0, a.vocab, (a.batch, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (a.batch, 1), generator=g)]
    return ((start + torch.arange(a.seq + 1).unsqueeze(0) * stride) % a.vocab).to(device)


def loss_of(model, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(a) -> TinyLM:
    torch.manual_seed(a.seed)
    return TinyLM(a.vocab, a.d_model, a.heads, a.layers, a.seq)


def make_optimizer(params, a):
    return torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01)


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())  # ranks may share a GPU
    return torch.device("cpu")


def train_megatron_fsdp(a) -> dict:
    import torch.distributed as dist
    from megatron_fsdp import fully_shard_model, fully_shard_optimizer

    device = device_for(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group()  # no backend named: PyTorch's defaults (+ ODC_DEFAULT_BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = {} if device.type == "cuda" else {"device": device}
    model = fully_shard_model(module=build_model(a), fsdp_unit_modules=[Block], zero_dp_strategy=3, **kw)
    optimizer = fully_shard_optimizer(optimizer=make_optimizer(model.parameters(), a))
    losses, t0 = [], time.time()
    for step in range(a.steps):
        loss = loss_of(model, batch(a, rank, step, device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    wall = time.time() - t0
    from odc_stats import group_report  # beside this file

    groups = group_report()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"losses": losses, "groups": groups, "wall_s": wall})
    result = None
    if rank == 0:
        default = next((g for g in groups if g["default"]), groups[0])
        result = {"mode": "megatron_fsdp", "world": world,
                  "odc_default_backend": os.environ.get("ODC_DEFAULT_BACKEND", ""),
                  "default_group_backends": {d: b["name"] for d, b in default["backends"].items()},
                  "losses_per_rank": [r["losses"] for r in per_rank],
                  "global_losses": [sum(r["losses"][s] for r in per_rank) / world for s in range(a.steps)],
                  "odc_counters_per_rank": [_odc_totals(r["groups"]) for r in per_rank],
                  "groups_rank0": groups, "train_wall_s": max(r["wall_s"] for r in per_rank)}
    dist.barrier()
    dist.destroy_process_group()
    return result


def _odc_totals(groups) -> dict:
    totals = {}
    for g in groups:
        for b in g["backends"].values():
            for k, v in b.get("stats", {}).items():
                totals[k] = totals.get(k, 0) + v
    return totals


def train_reference(a) -> dict:
    """One process, no torch.distributed: the mean of the ranks' losses, and Megatron-FSDP's
    optimizer arrangement: the optimizer updates fp32 main parameters, which are copied into
    the model's compute parameters after each ``optimizer.step()`` (install_optimized_model_
    weights); the step on zero gradients that ``fully_shard_optimizer`` makes to create the
    optimizer state updates the main parameters only (weight decay), not the model's."""
    world = a.world
    device = device_for(0)
    model = build_model(a).to(device)
    params = list(model.parameters())
    main = [p.detach().clone().requires_grad_(True) for p in params]
    optimizer = make_optimizer(main, a)
    for m in main:
        m.grad = torch.zeros_like(m)
    optimizer.step()
    optimizer.zero_grad()
    per_rank, t0 = [[] for _ in range(world)], time.time()
    for step in range(a.steps):
        losses = [loss_of(model, batch(a, r, step, device)) for r in range(world)]
        (sum(losses) / world).backward()
        for p, m in zip(params, main):
            m.grad, p.grad = p.grad, None
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, main):
                p.copy_(m)
        for r, loss in enumerate(losses):
            per_rank[r].append(loss.item())
    return {"mode": "single", "world": world, "losses_per_rank": per_rank,
            "global_losses": [sum(per_rank[r][s] for r in range(world)) / world for s in range(a.steps)],
            "train_wall_s": time.time() - t0}


def add_model_args(p) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)


MODEL_ARGS = ("steps", "seed", "layers", "d_model", "heads", "vocab", "seq", "batch", "lr")


def run_training(a) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):  # the same attention kernel in every run
        result = train_reference(a) if a.cmd == "reference" else train_megatron_fsdp(a)
    if result is not None:
        import importlib.metadata as md

        result.update({"args": {k: getattr(a, k) for k in MODEL_ARGS}, "torch": torch.__version__,
                       "megatron_fsdp": md.version("megatron-fsdp"),
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                       "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0})
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({k: result[k] for k in ("mode", "world", "global_losses")}), file=sys.stderr)


# ------------------------------------------------------------------------------ compare
def compare(a) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compare_util as cu  # beside this file
    import odc_entry_point

    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if a.device == "cuda" and gpus == 0:
        raise SystemExit("Megatron-FSDP runs on CUDA only (megatron_fsdp.py: device cuda:<current>, "
                         "torch.cuda.Stream); no GPU here")
    per_rank_device = a.device == "cpu" or gpus >= a.nproc
    references = [r for r in a.reference.split(",") if r]
    if references == ["auto"]:
        references = (["default", "single"] if per_rank_device and a.device == "cuda" else ["single"])
    if "default" in references and not per_rank_device:
        raise SystemExit(f"--reference default needs a GPU per rank ({a.nproc}); {gpus} here "
                         "(NCCL refuses ranks sharing a GPU): use --reference single")
    env = cu.base_env(work, CPU_SHIM if a.device == "cpu" else None)
    model = cu.as_argv(a, MODEL_ARGS)
    script = Path(__file__).resolve()
    runs = {"odc": cu.run(cu.torchrun(a.nproc, script, "train", "--out", str(work / "odc.json"), *model),
                          dict(env, ODC_DEFAULT_BACKEND=a.device), work / "odc.log", work / "odc.json",
                          a.timeout)}
    for ref in references:
        if ref == "default":
            name = {"cuda": "nccl", "cpu": "gloo"}[a.device]
            cmd = cu.torchrun(a.nproc, script, "train", "--out", str(work / f"{name}.json"), *model)
        else:
            name = "single"
            cmd = [sys.executable, str(script), "reference", "--world", str(a.nproc),
                   "--out", str(work / "single.json"), *model]
        runs[name] = cu.run(cmd, env, work / f"{name}.log", work / f"{name}.json", a.timeout)
    got = runs["odc"]
    result = {"device_type": a.device, "gpus": gpus, "nproc": a.nproc,
              "ranks_share_gpus": a.device == "cuda" and gpus < a.nproc,
              "entry_point": "installed" if odc_entry_point.installed() else "source-tree record (odc_entry_point/)",
              "runs": runs, "compare": {}}
    for name, ref in runs.items():
        if name == "odc":
            continue
        diffs = [abs(x - y) for xs, ys in zip(got["losses_per_rank"], ref["losses_per_rank"])
                 for x, y in zip(xs, ys)]
        result["compare"][f"odc_vs_{name}"] = {
            "steps": len(got["global_losses"]), "max_abs_loss_diff": max(diffs) if diffs else None,
            "losses_bitwise_equal": bool(diffs) and got["losses_per_rank"] == ref["losses_per_rank"]}
    (work / "megatron_fsdp_result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"result": str(work / "megatron_fsdp_result.json"), "global_losses_odc": got["global_losses"],
                      "default_group_backends": got["default_group_backends"],
                      "odc_counters_rank0": got["odc_counters_per_rank"][0], "compare": result["compare"]}, indent=1))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="under torchrun: Megatron-FSDP training (backend from the defaults)")
    p.add_argument("--out", required=True, help="result JSON (rank 0)")
    add_model_args(p)
    p = sub.add_parser("reference", help="single-process reference for --world ranks")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True)
    add_model_args(p)
    p = sub.add_parser("compare", help="odc (the switch) against the reference(s)")
    p.add_argument("--work", required=True, help="folder for results and logs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reference", default="auto", help="auto, or comma-separated: default, single")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: tests only, through tests/integrations/megatron_fsdp_cpu_shim")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    add_model_args(p)
    a = parser.parse_args(argv)
    if a.cmd == "compare":
        compare(a)
    else:
        run_training(a)


if __name__ == "__main__":
    main()
