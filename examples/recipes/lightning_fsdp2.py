#!/usr/bin/env python3
"""Lightning + FSDP2 on odc: ``ModelParallelStrategy(process_group_backend="cpu:gloo,cuda:odc")``.

The one change odc needs in a Lightning script is the strategy's process-group backend
(``"cpu:gloo,cuda:odc"`` on GPUs, ``"cpu:odc"`` for CPU tensors). Or none at all: with no
backend named, ``ModelParallelStrategy`` takes PyTorch's ``Backend.default_device_backend_map``
(lightning/fabric/utilities/distributed.py, ``_get_default_process_group_backend_for_device``),
so ``ODC_DEFAULT_BACKEND=cuda`` with the package installed runs an unmodified script on odc.
The model is sharded with unmodified ``fully_shard`` in ``configure_model`` over the
strategy's device mesh; exact mode trains with Lightning's automatic optimization
(``accumulate_grad_batches``, ``gradient_clip_val``)::

    torchrun --standalone --nproc-per-node=2 examples/recipes/lightning_fsdp2.py train --out odc.json
    torchrun ... lightning_fsdp2.py train --backend default --out switch.json   # + ODC_DEFAULT_BACKEND=cuda
    torchrun ... lightning_fsdp2.py train --decoupled --out decoupled.json
    python examples/recipes/lightning_fsdp2.py reference --world 2 --out single.json
    python examples/recipes/lightning_fsdp2.py compare --work DIR      # all of them + verdict

``--decoupled``: odc's decoupled mode with LB-Mini balancing, through manual optimization.
Automatic optimization cannot host it: Lightning runs a step's last forward/backward inside
``optimizer.step(closure)`` (lightning/pytorch/plugins/precision/precision.py,
``optimizer_step`` / ``_wrap_closure``), after the optimizer's step pre-hooks have run, so no
hook sits between the last backward and the step's pre-hooks (``on_before_optimizer_step``
comes after them, and odc's pre-hook refuses a step without ``odc.sync``); and it runs the
same ``accumulate_grad_batches`` on every rank. With manual optimization each Lightning batch
is this rank's LB-Mini share of a minibatch (the count of microbatches differs per rank, zero
included); ``training_step`` runs their forward/backward, ``odc.sync``, clipping and the step;
``odc.decouple`` runs in ``on_train_start`` (``configure_model`` has sharded the model and
``configure_optimizers`` made the optimizer).

Data: synthetic documents of long-tailed random lengths (arithmetic progressions modulo the
vocabulary), ``--docs-per-step`` per optimizer step, built in ``train_dataloader``. A step's
loss is the mean over the step's label tokens of all ranks (each microbatch's token-loss sum
divided by the step's global token count), so every way of spreading a step's documents over
ranks and microbatches gives the same gradient.

``reference`` is one process without Lightning and torch.distributed doing the N ranks' work
as Lightning + FSDP2 does it: per microbatch index, every rank's gradient of the same loss
expression, averaged over ranks (FSDP2's reduce-scatter: ``ModelParallelStrategy`` does not
block gradient sync while accumulating, lightning/pytorch/strategies/parallel.py,
``block_backward_sync``) and accumulated; then the same clipping and AdamW step. With 2 ranks
the odc run should match it bitwise. ``compare --work DIR`` runs (``--runs``): ``odc`` (named
backend), ``switch`` (``ODC_DEFAULT_BACKEND``, no backend named), ``decoupled``, ``default``
(no backend, no switch: gloo on CPU, NCCL on GPUs; only with a device per rank) and
``single``; it writes ``DIR/lightning_result.json`` and prints the verdict (exit status 1 on
a mismatch). Ranks may share a GPU (odc serves them; NCCL refuses): ``train`` then gives
the strategy each rank's device itself (rank r on GPU r % count).
"""
from __future__ import annotations

import os

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}.items():
    os.environ.setdefault(_k, _v)  # before CUDA / NCCL start

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for tiny_lm
from tiny_lm import TinyLM  # noqa: E402  (examples/tiny_lm.py)

try:  # the `lightning` package, or the standalone `pytorch-lightning`
    import lightning.pytorch as pl  # noqa: E402
    from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl  # noqa: E402
    from pytorch_lightning.strategies import ModelParallelStrategy  # noqa: E402

STRIDES = (1, 2, 3, 5)
IGNORE = -100
HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- model
def build_model(a) -> TinyLM:
    torch.manual_seed(a.seed)  # the same initial weights on every rank and in every run
    return TinyLM(a.vocab, a.d_model, a.heads, a.layers, a.max_len)


def loss_sum(model, micro) -> torch.Tensor:
    """Sum of the microbatch's token losses."""
    logits = model(micro["input_ids"]).float()
    return F.cross_entropy(logits.flatten(0, 1), micro["labels"].flatten(), ignore_index=IGNORE, reduction="sum")


# --------------------------------------------------------------------------- data
def make_documents(a) -> list[torch.Tensor]:
    """``steps * docs_per_step`` arithmetic progressions modulo the vocabulary, of
    long-tailed lengths: mostly short, the first of every step ``max_len``."""
    gen = torch.Generator().manual_seed(a.seed)
    n = a.steps * a.docs_per_step
    u = torch.rand(n, generator=gen)
    lengths = (a.min_len + ((a.max_len - a.min_len + 1) * u * u).floor().long()).clamp(max=a.max_len).tolist()
    lengths[::a.docs_per_step] = [a.max_len] * a.steps
    starts = torch.randint(0, a.vocab, (n,), generator=gen).tolist()
    strides = torch.randint(0, len(STRIDES), (n,), generator=gen).tolist()
    return [(s + torch.arange(length) * STRIDES[k]) % a.vocab for length, s, k in zip(lengths, starts, strides)]


def collate(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Documents padded at the end into a (len(docs), longest) batch; padding and each
    document's last position carry no label."""
    longest = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    labels = torch.full((len(docs), longest), IGNORE, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, :len(d)] = d
        labels[i, :len(d) - 1] = d[1:]
    return {"input_ids": ids, "labels": labels}


def label_tokens(docs: list[torch.Tensor]) -> int:
    return sum(len(d) - 1 for d in docs)


def exact_microbatches(a, world: int, rank: int, step: int) -> list[list[int]]:
    """Exact mode: rank ``rank``'s microbatches of ``step`` (document indices), ``accumulate``
    of ``micro_docs`` documents each, contiguous per rank."""
    accumulate = a.docs_per_step // (a.micro_docs * world)
    base = step * a.docs_per_step
    first = [base + (rank * accumulate + j) * a.micro_docs for j in range(accumulate)]
    return [list(range(f, f + a.micro_docs)) for f in first]


class ExactSteps(Dataset):
    """Automatic optimization: item i is microbatch i % accumulate of step i // accumulate."""

    def __init__(self, a, docs, world, rank):
        self.a, self.docs, self.world, self.rank = a, docs, world, rank
        self.accumulate = a.docs_per_step // (a.micro_docs * world)

    def __len__(self):
        return self.a.steps * self.accumulate

    def __getitem__(self, i):
        step, j = divmod(i, self.accumulate)
        ids = exact_microbatches(self.a, self.world, self.rank, step)[j]
        step_docs = self.docs[step * self.a.docs_per_step:(step + 1) * self.a.docs_per_step]
        return {**collate([self.docs[k] for k in ids]), "ids": ids, "step": step,
                "step_tokens": label_tokens(step_docs)}


class DecoupledSteps(Dataset):
    """Manual optimization: item ``step`` is this rank's LB-Mini share of the step (a list of
    microbatches, possibly empty); every rank plans every step from the same lengths."""

    def __init__(self, a, docs, world, rank, cost):
        self.a, self.docs, self.world, self.rank, self.cost = a, docs, world, rank, cost

    def __len__(self):
        return self.a.steps

    def __getitem__(self, step):
        import torch_odc_backend as odc

        base = step * self.a.docs_per_step
        step_docs = self.docs[base:base + self.a.docs_per_step]
        mine = odc.balance.microbatches([len(d) for d in step_docs], self.world, self.rank,
                                        self.a.max_tokens or self.a.max_len, self.cost)
        return {"micro": [collate([step_docs[j] for j in mb]) for mb in mine],
                "ids": [[base + j for j in mb] for mb in mine], "step": step,
                "step_tokens": label_tokens(step_docs)}


# --------------------------------------------------------------------------- Lightning
class LitLM(pl.LightningModule):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.automatic_optimization = not a.decoupled
        self.model = build_model(a)
        self.partial_losses: dict[int, float] = {}  # step -> this rank's share of the step's loss
        self.seen: dict[int, list[list[int]]] = {}  # step -> this rank's microbatches (document ids)

    def configure_model(self):
        # unmodified FSDP2 over the strategy's mesh: every block, then the root
        mesh = self.device_mesh["data_parallel"]
        for blk in self.model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def train_dataloader(self):
        a, world, rank = self.a, self.trainer.world_size, self.global_rank
        docs = make_documents(a)
        if a.decoupled:
            from torch_odc_backend.balance import TransformerCost

            cost = TransformerCost(hidden_size=a.d_model, num_layers=a.layers, intermediate_size=4 * a.d_model,
                                   num_heads=a.heads, vocab_size=a.vocab, gated_mlp=False)
            data = DecoupledSteps(a, docs, world, rank, cost)
        else:
            data = ExactSteps(a, docs, world, rank)
        return DataLoader(data, batch_size=1, shuffle=False, collate_fn=lambda items: items[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.a.lr, weight_decay=0.0)

    def on_train_start(self):
        if self.a.decoupled:
            import torch_odc_backend as odc

            odc.decouple(self.model, self.trainer.optimizers[0])  # once, on the sharded model

    def training_step(self, batch, batch_idx):
        step, n = int(batch["step"]), float(batch["step_tokens"])
        world = self.trainer.world_size
        if not self.a.decoupled:
            loss = loss_sum(self.model, batch)
            self.partial_losses[step] = self.partial_losses.get(step, 0.0) + loss.item() / n
            self.seen.setdefault(step, []).append(batch["ids"])
            # FSDP2 averages over ranks and Lightning divides by accumulate_grad_batches: the
            # step's gradient is that of (sum of its token losses) / (its label tokens)
            return loss * (world * self.trainer.accumulate_grad_batches / n)
        import torch_odc_backend as odc

        opt = self.optimizers()
        total = 0.0
        for micro in batch["micro"]:  # this rank's LB-Mini share: the count differs per rank
            loss = loss_sum(self.model, micro)
            self.manual_backward(loss * (world / n))
            total += loss.item() / n
        odc.sync(self.model)  # every rank's contributions have landed: .grad is final
        self.clip_gradients(opt, gradient_clip_val=self.a.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.partial_losses[step] = total
        self.seen[step] = batch["ids"]


class CollectResults(pl.Callback):
    def __init__(self, a, started):
        self.a, self.started = a, started

    def on_train_end(self, trainer, lm):
        import torch.distributed as dist
        from odc_stats import group_report  # beside this file

        group = next(lm.model.parameters()).device_mesh.get_group()
        backend = group._get_backend(torch.device(lm.device.type))
        mine = {"partial_losses": lm.partial_losses, "seen": lm.seen, "groups": group_report(),
                "mesh_group_backend": backend.name(),
                "mesh_odc_stats": {k: int(v) for k, v in dict(backend.stats()).items()}
                if backend.name() == "odc" else {}, "odc_metrics": None}
        if self.a.decoupled:
            import torch_odc_backend as odc

            mine["odc_metrics"] = odc.metrics(lm.model)
        everyone = [None] * trainer.world_size
        dist.all_gather_object(everyone, mine)
        if trainer.global_rank != 0:
            return
        world, steps = trainer.world_size, sorted(everyone[0]["partial_losses"])
        losses = [sum(r["partial_losses"][s] for r in everyone) for s in steps]
        if self.a.decoupled:
            expected = None  # the plan is whatever LB-Mini made; check it covers each step once
            ok = all(sorted(i for r in everyone for mb in r["seen"][s] for i in mb)
                     == list(range(s * self.a.docs_per_step, (s + 1) * self.a.docs_per_step)) for s in steps)
        else:
            expected = [[exact_microbatches(self.a, world, r, s) for s in steps] for r in range(world)]
            ok = [[r["seen"][s] for s in steps] for r in everyone] == expected
        default = [next((g for g in r["groups"] if g["default"]), r["groups"][0]) for r in everyone]
        result = {
            "trainer": "lightning", "lightning": pl.__version__, "lightning_package": pl.__name__.split(".")[0],
            "torch": torch.__version__,
            "mode": "decoupled" if self.a.decoupled else "exact", "backend_arg": self.a.backend,
            "odc_default_backend": os.environ.get("ODC_DEFAULT_BACKEND", ""),
            "pg_backend_string": str(dist.get_backend()), "device": str(lm.device), "world": world,
            "gpus": torch.cuda.device_count() if lm.device.type == "cuda" else 0,
            "losses": losses,
            "microbatches_per_rank": [[len(r["seen"][s]) for s in steps] for r in everyone],
            "ranks_trained_on_plan": ok,
            "mesh_group_backend": [r["mesh_group_backend"] for r in everyone],
            "mesh_group_ranks": dist.get_process_group_ranks(group),
            "default_group_backends": [{d: b["name"] for d, b in g["backends"].items()} for g in default],
            "odc_counters_per_rank": [r["mesh_odc_stats"] for r in everyone],
            "odc_metrics": [r["odc_metrics"] for r in everyone],
            "args": vars(self.a), "wall_s": round(time.perf_counter() - self.started, 1),
        }
        for s, loss in zip(steps, losses):
            print(f"step {s + 1:3d}  loss {loss:.7f}", flush=True)
        with open(self.a.out, "w") as f:
            json.dump(result, f, indent=1)


def train(a) -> None:
    started = time.perf_counter()
    torch.use_deterministic_algorithms(True, warn_only=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.docs_per_step % (a.micro_docs * world):
        sys.exit("--docs-per-step must be a multiple of --micro-docs x world size")
    if a.backend == "odc":
        backend = "cpu:gloo,cuda:odc" if use_cuda else "cpu:odc"  # the one line odc needs
    elif a.backend == "default":
        backend = None  # Lightning: Backend.default_device_backend_map (ODC_DEFAULT_BACKEND)
    else:
        backend = a.backend
    pl.seed_everything(a.seed, verbose=False)
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                     process_group_backend=backend)
    devices = local_world
    if use_cuda and torch.cuda.device_count() < local_world:
        # more ranks than GPUs (odc serves ranks that share a GPU; NCCL refuses them): give
        # the strategy each local rank's device, rank r on GPU r % count
        count = torch.cuda.device_count()
        strategy.parallel_devices = [torch.device("cuda", r % count) for r in range(local_world)]
        devices = 1  # Lightning checks `devices` against the GPUs it sees; the list above rules
    accumulate = 1 if a.decoupled else a.docs_per_step // (a.micro_docs * world)
    trainer = pl.Trainer(
        accelerator="cuda" if use_cuda else "cpu", devices=devices, num_nodes=world // local_world,
        strategy=strategy, max_steps=a.steps, max_epochs=1, accumulate_grad_batches=accumulate,
        gradient_clip_val=None if a.decoupled else (a.clip or None),  # manual optimization clips itself
        precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # each rank's loader yields that rank's own share
        callbacks=[CollectResults(a, started)],
    )
    trainer.fit(LitLM(a))
    # Lightning leaves the process group up: destroy it, as PyTorch asks. FSDP2's modules keep
    # their ProcessGroup objects, so free them too while the interpreter is alive: a gloo group
    # (odc's inner one too) torn down at interpreter shutdown aborts the process now and then
    # ("terminate called without an active exception"; cf. pytorch/pytorch#190489).
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    del trainer, strategy
    gc.collect()


# --------------------------------------------------------------------------- reference
def reference(a) -> None:
    """One process, W ranks' work, as Lightning + FSDP2 does it (module docstring)."""
    started = time.perf_counter()
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    model = build_model(a).to(device)
    docs = make_documents(a)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    world = a.world
    accumulate = a.docs_per_step // (a.micro_docs * world)
    losses = []
    for step in range(a.steps):
        n = float(label_tokens(docs[step * a.docs_per_step:(step + 1) * a.docs_per_step]))
        partial = [0.0] * world
        plans = [exact_microbatches(a, world, r, step) for r in range(world)]
        accumulated = [None] * len(params)
        for j in range(accumulate):
            grads = []
            for r in range(world):
                micro = {k: v.to(device) for k, v in collate([docs[i] for i in plans[r][j]]).items()}
                loss = loss_sum(model, micro)
                partial[r] += loss.item() / n
                ((loss * (world * accumulate / n)) / accumulate).backward()  # Lightning divides by accumulate
                grads.append([p.grad for p in params])
                for p in params:
                    p.grad = None
            for i in range(len(params)):  # this microbatch's reduce-scatter (AVG), accumulated
                total = grads[0][i].clone()
                for g in grads[1:]:
                    total += g[i]
                avg = total / world
                accumulated[i] = avg if j == 0 else accumulated[i] + avg
        for p, g in zip(params, accumulated):
            p.grad = g
        if a.clip:
            torch.nn.utils.clip_grad_norm_(params, a.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(partial))
    result = {"mode": "single", "world": world, "torch": torch.__version__, "device": str(device),
              "losses": losses, "args": vars(a), "wall_s": round(time.perf_counter() - started, 1)}
    for s, loss in enumerate(losses):
        print(f"step {s + 1:3d}  loss {loss:.7f}", flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


# --------------------------------------------------------------------------- compare
def compare(a) -> int:
    import compare_util as cu  # beside this file

    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if a.device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda: no GPU here")
    per_rank_device = a.device == "cpu" or gpus >= a.nproc
    env = cu.base_env(work)
    model_args = ["--device", a.device, *cu.as_argv(a, cu.WORKLOAD_ARGS + ("d_model",))]
    script = Path(__file__).resolve()
    runs: dict = {}
    result = {"device_type": a.device, "gpus": gpus, "nproc": a.nproc,
              "ranks_share_gpus": a.device == "cuda" and not per_rank_device, "runs": runs}
    names = [r for r in a.runs.split(",") if r]
    if "default" in names and not per_rank_device:
        print(f"skip default: {a.nproc} ranks on {gpus} GPU(s) (NCCL refuses ranks sharing a GPU)")
        names.remove("default")
    for name in names:
        out, log = work / f"{name}.json", work / f"{name}.log"
        if name == "single":
            cmd = [sys.executable, str(script), "reference", "--world", str(a.nproc), "--out", str(out), *model_args]
            runs[name] = cu.run(cmd, env, log, out, a.timeout)
            continue
        extra = {"odc": ["--backend", "odc"], "switch": ["--backend", "default"],
                 "decoupled": ["--backend", "odc", "--decoupled"], "default": ["--backend", "default"]}.get(name)
        if extra is None:
            raise SystemExit(f"unknown run {name!r} (odc, switch, decoupled, default, single)")
        cmd = cu.torchrun(a.nproc, script, "train", *extra, "--out", str(out), *model_args)
        runs[name] = cu.run(cmd, dict(env, ODC_DEFAULT_BACKEND=a.device) if name == "switch" else env,
                            log, out, a.timeout)

    checks, cmp = {}, result.setdefault("compare", {})
    ref = runs.get("single")
    for name, got in runs.items():
        if name == "single":
            continue
        backends = got["mesh_group_backend"]
        if name == "default":
            checks["default: the platform's backend"] = (backends[0] in ("gloo", "nccl"), f"mesh group {backends}")
        else:
            checks[f"{name}: odc carried FSDP's collectives"] = cu.carried_check(name, got)
        checks[f"{name}: ranks trained on the planned batches"] = (
            got["ranks_trained_on_plan"], f"microbatches per rank and step {got['microbatches_per_rank']}")
        if ref is not None:
            c = cmp[f"{name}_vs_single"] = cu.compare_losses(got["losses"], ref["losses"], a.rtol)
            checks[f"{name} vs single-process reference"] = cu.reference_check(c, a.rtol)
    if "odc" in runs and "default" in runs:
        cmp["odc_vs_default"] = cu.compare_losses(runs["odc"]["losses"], runs["default"]["losses"], a.rtol)
    cu.write_result(work / "lightning_result.json", result, checks, runs)
    return cu.verdict(checks)


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    sys.path.insert(0, str(HERE))  # odc_stats, compare_util, odc_entry_point
    import compare_util as cu
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="under torchrun: Lightning ModelParallelStrategy + FSDP2")
    p.add_argument("--out", required=True, help="result JSON (rank 0)")
    p.add_argument("--backend", default="odc",
                   help="odc (cpu:odc on CPU, cpu:gloo,cuda:odc on GPUs); 'default' (none named: "
                        "Lightning takes torch's default backend map, which ODC_DEFAULT_BACKEND sets); "
                        "or any init_process_group backend string")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--decoupled", action="store_true", help="odc decoupled mode + LB-Mini (manual optimization)")
    cu.add_workload_args(p, "d_model")
    p = sub.add_parser("reference", help="one process doing the work of --world ranks")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", required=True)
    cu.add_workload_args(p, "d_model")
    p = sub.add_parser("compare", help="odc runs against the reference(s); verdict and exit status")
    p.add_argument("--work", required=True, help="folder for results and logs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--runs", default="odc,switch,decoupled,default,single",
                   help="comma-separated: odc, switch, decoupled, default, single")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative loss tolerance where not bitwise")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    cu.add_workload_args(p, "d_model")
    a = parser.parse_args(argv)
    if a.cmd != "compare" and a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.cmd == "compare":
        return compare(a)
    if a.cmd == "reference":
        reference(a)
    else:
        train(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
