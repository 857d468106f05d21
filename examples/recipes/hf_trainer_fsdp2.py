#!/usr/bin/env python3
"""Hugging Face ``Trainer`` with FSDP2 (through accelerate) on odc: ``ddp_backend="odc"``.

The one change odc needs in a Trainer script is the backend argument::

    TrainingArguments(..., fsdp=True, fsdp_config={"fsdp_version": 2, ...}, ddp_backend="odc")

The Trainer hands ``ddp_backend`` to accelerate's ``PartialState`` (transformers
training_args.py, ``_setup_devices``), which passes it to ``init_process_group`` unchanged on
GPUs ("odc": odc for CPU and CUDA tensors; ``"cpu:gloo,cuda:odc"`` works too). Only the
command-line parser limits it: the field's ``choices`` (training_args.py, ``ddp_backend``) make
``HfArgumentParser`` refuse ``--ddp_backend odc``, so set it in code. The switch
``ODC_DEFAULT_BACKEND=cuda`` alone does NOT reach the Trainer: with no ``ddp_backend``,
accelerate names ``"nccl"`` itself (accelerate state.py, ``PartialState._prepare_backend``;
``"gloo"`` on CPU), so PyTorch's default-backend map is never consulted.

    torchrun --standalone --nproc-per-node=2 examples/recipes/hf_trainer_fsdp2.py train --out odc.json
    torchrun ... hf_trainer_fsdp2.py train --decoupled --out decoupled.json
    python examples/recipes/hf_trainer_fsdp2.py reference --world 2 --out single.json
    python examples/recipes/hf_trainer_fsdp2.py compare --work DIR     # all of them + verdict

Model: a 2-layer ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, seeded; no
download), eager attention. Data: synthetic documents of long-tailed random lengths
(arithmetic progressions modulo the vocabulary), ``--docs-per-step`` per optimizer step, in
order (``train_sampling_strategy="sequential"``); accelerate deals the Trainer's batches out
round-robin (accelerate data_loader.py, ``BatchSamplerShard._iter_with_no_split``), so rank r
trains on global batches r, r + W, ... Every rank records what its collator built, and
``train`` checks it against that expectation. The Trainer normalises the loss by the step's
label tokens over all ranks (``average_tokens_across_devices``), so every way of spreading a
step's documents gives the same gradient.

``--decoupled``: odc's decoupled mode hosted by the unmodified Trainer, through
``OdcDecoupledCallback`` and the LB-Mini sampler (``odc.balance.BalancedBatchSampler``):

* ``odc.decouple`` in ``on_train_begin`` (accelerate has applied ``fully_shard``; the optimizer
  exists); ``odc.sync`` in ``on_pre_optimizer_step``, the first callback after a step's last
  backward. The Trainer clips *before* that callback (trainer.py, ``_inner_training_loop``),
  so Trainer clipping is off (``max_grad_norm=0``) and the callback clips after the sync
  (the Trainer's own logged ``grad_norm`` is then taken before the sync and is meaningless;
  the callback records the real one).
* The Trainer draws exactly ``gradient_accumulation_steps`` batches per rank for every step
  (trainer.py, ``_inner_training_loop``: ``num_batches``), so ranks cannot run different
  numbers of microbatches, and the count is one number for the whole run. The LB-Mini plans
  (each rank's share balanced over the whole minibatch) are therefore padded with zero-weight
  one-token microbatches up to the largest count of any rank in any step. They cost little
  compute, but each still gets every layer's parameters and puts (zero) gradient rows.
* ``gradient_accumulation_kwargs={"sync_each_batch": True}``: every microbatch's gradient is
  put into the owners' accumulators (with accelerate's ``no_sync`` FSDP2 would keep whole
  unsharded gradients until the last microbatch).

``reference`` is one process without the Trainer and without torch.distributed that does
what the Trainer does for W ranks: the same model, batches and loss calls (the Trainer's
``num_items_in_batch`` and its loss scaling by W), each rank's gradients accumulated
separately and then averaged (FSDP2's reduce-scatter with AVG), the same clipping, AdamW and
constant learning rate; the logged loss is the mean over ranks of each rank's summed loss, as
the Trainer logs it. With 2 ranks the odc run should match it bitwise (a sum of two terms is
exact in any order).

``compare --work DIR`` runs (``--runs``, comma-separated): ``odc`` (``ddp_backend="odc"``, N
ranks), ``decoupled``, ``switch`` (``ODC_DEFAULT_BACKEND`` set, no ``ddp_backend``: records
which backend accelerate chose; N ranks where each has its own device, else 1), ``single``
(the reference), and writes ``DIR/hf_trainer_result.json``; the verdict: odc equal to the
reference (bitwise, or within ``--rtol`` relative), decoupled within ``--rtol``, the ranks
trained on the planned batches, odc carried FSDP's collectives. ``--device cpu`` is for tests:
accelerate runs FSDP only on GPU-type devices, so the ranks then run with
tests/integrations/hf_cpu_shim first on their PYTHONPATH.
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
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

STRIDES = (1, 2, 3, 5)
IGNORE = -100
PAD = 0
HERE = Path(__file__).resolve().parent
CPU_SHIM = HERE.parents[1] / "tests" / "integrations" / "hf_cpu_shim"


# --------------------------------------------------------------------------- model, data
def make_config(a):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                       max_position_embeddings=a.max_len, pad_token_id=PAD, bos_token_id=None,
                       eos_token_id=None, tie_word_embeddings=False, attn_implementation="eager")


def build_model(a):
    from transformers import LlamaForCausalLM

    torch.manual_seed(a.seed)  # the same initial weights on every rank and in every run
    return LlamaForCausalLM(make_config(a))


def make_documents(a) -> list[torch.Tensor]:
    """``steps * docs_per_step`` arithmetic progressions modulo the vocabulary (token 0 is
    padding), of long-tailed lengths: mostly short, the first of every step ``max_len``."""
    gen = torch.Generator().manual_seed(a.seed)
    n = a.steps * a.docs_per_step
    u = torch.rand(n, generator=gen)
    lengths = (a.min_len + ((a.max_len - a.min_len + 1) * u * u).floor().long()).clamp(max=a.max_len).tolist()
    lengths[::a.docs_per_step] = [a.max_len] * a.steps
    starts = torch.randint(1, a.vocab, (n,), generator=gen).tolist()
    strides = torch.randint(0, len(STRIDES), (n,), generator=gen).tolist()
    return [1 + (s - 1 + torch.arange(length) * STRIDES[k]) % (a.vocab - 1)
            for length, s, k in zip(lengths, starts, strides)]


def pad_batch(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Documents padded at the end; labels are the inputs (the model shifts them), -100 on
    padding. No document: a one-token microbatch without label (zero loss, zero gradient)."""
    if not docs:
        return {"input_ids": torch.full((1, 1), PAD, dtype=torch.long),
                "attention_mask": torch.ones(1, 1, dtype=torch.long),
                "labels": torch.full((1, 1), IGNORE, dtype=torch.long)}
    longest = max(len(d) for d in docs)
    out = {"input_ids": torch.full((len(docs), longest), PAD, dtype=torch.long),
           "attention_mask": torch.zeros(len(docs), longest, dtype=torch.long),
           "labels": torch.full((len(docs), longest), IGNORE, dtype=torch.long)}
    for i, d in enumerate(docs):
        out["input_ids"][i, :len(d)] = d
        out["attention_mask"][i, :len(d)] = 1
        out["labels"][i, :len(d)] = d
    return out


def exact_plan(a, world: int) -> list[list[list[list[int]]]]:
    """plan[step][rank] = that rank's microbatches (document indices) in exact mode: the
    Trainer batches the documents in order, ``micro_docs`` at a time, and accelerate deals
    batch k to rank k % world; a step takes ``accumulate`` batches per rank."""
    accumulate = a.docs_per_step // (a.micro_docs * world)
    plan = []
    for step in range(a.steps):
        per_rank = []
        for rank in range(world):
            micro = []
            for j in range(accumulate):
                k = (step * accumulate + j) * world + rank
                micro.append(list(range(k * a.micro_docs, (k + 1) * a.micro_docs)))
            per_rank.append(micro)
        plan.append(per_rank)
    return plan


def lbmini_plan(a, world: int, docs, config) -> list[list[list[list[int]]]]:
    """plan[step][rank] in decoupled mode: the LB-Mini sampler's plan of each minibatch
    (every rank's share; counts may differ), in document order (no shuffle)."""
    from torch_odc_backend.balance import BalancedBatchSampler, TransformerCost

    sampler = BalancedBatchSampler([len(d) for d in docs], world, 0, max_tokens=a.max_tokens or a.max_len,
                                   minibatch_size=a.docs_per_step, cost=TransformerCost.from_hf_config(config),
                                   mode="lb_mini", shuffle=False, drop_last=True)
    return [sampler.plan(step) for step in range(a.steps)]


class Documents(Dataset):
    """Exact mode: one item per document; the Trainer batches ``micro_docs`` of them."""

    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"docs": [i]}


class PlannedMicrobatches(Dataset):
    """Decoupled mode: item k is one microbatch (``per_device_train_batch_size=1``). Batch k
    goes to rank k % W as its microbatch k // W (accelerate's round-robin); with ``slots``
    microbatches per rank and step, that is slot (k // W) % slots of step (k // W) // slots:
    the rank's LB-Mini microbatch there, or an empty one (padding) where it has fewer."""

    def __init__(self, plan, world):
        self.plan, self.world = plan, world
        self.slots = max(len(rank_plan) for step in plan for rank_plan in step)

    def __len__(self):
        return len(self.plan) * self.slots * self.world

    def __getitem__(self, k):
        rank, j = k % self.world, k // self.world
        step, slot = divmod(j, self.slots)
        mine = self.plan[step][rank]
        return {"docs": mine[slot] if slot < len(mine) else []}


class RecordingCollator:
    """Pads the items' documents into one microbatch and records which documents it held."""

    def __init__(self, docs):
        self.docs = docs
        self.seen: list[list[int]] = []

    def __call__(self, items: list[dict]) -> dict:
        ids = [i for item in items for i in item["docs"]]
        self.seen.append(ids)
        return pad_batch([self.docs[i] for i in ids])


# --------------------------------------------------------------------------- callbacks
class RecordLosses(TrainerCallback):
    """The Trainer's logged per-step loss (a token mean over all ranks) and grad norm."""

    def __init__(self):
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.grad_norms.append(float(logs.get("grad_norm", float("nan"))))


class OdcDecoupledCallback(TrainerCallback):
    """odc decoupled mode in an unmodified Trainer: decouple once, sync after each step's last
    backward, then clip (use with ``max_grad_norm=0`` in TrainingArguments)."""

    def __init__(self, max_grad_norm: float = 1.0):
        self.max_grad_norm = max_grad_norm
        self.grad_norms: list[float] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import torch_odc_backend as odc

        # accelerate's prepare() has run fully_shard; its optimizer wraps the torch one,
        # which is where odc's step hooks go
        odc.decouple(model, getattr(optimizer, "optimizer", optimizer))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        import torch_odc_backend as odc

        odc.sync(model)  # every rank's contributions have landed: .grad is final
        if self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
            self.grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))


# --------------------------------------------------------------------------- train (torchrun)
def train(a) -> None:
    import torch.distributed as dist
    import transformers
    from transformers import Trainer, TrainingArguments

    started = time.perf_counter()
    torch.use_deterministic_algorithms(True, warn_only=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.docs_per_step % (a.micro_docs * world):
        sys.exit("--docs-per-step must be a multiple of --micro-docs x world size")
    model = build_model(a)
    docs = make_documents(a)
    collator = RecordingCollator(docs)
    callbacks = [RecordLosses()]
    if a.decoupled:
        plan = lbmini_plan(a, world, docs, model.config)
        data = PlannedMicrobatches(plan, world)
        batch, accumulate = 1, data.slots
        callbacks.append(OdcDecoupledCallback(a.clip))
    else:
        plan = exact_plan(a, world)
        data = Documents(docs)
        batch, accumulate = a.micro_docs, a.docs_per_step // (a.micro_docs * world)

    ddp_backend = None if a.ddp_backend in ("", "none", "unset") else a.ddp_backend
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_trainer_odc_"), max_steps=a.steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
        learning_rate=a.lr, lr_scheduler_type="constant", weight_decay=0.0, optim="adamw_torch",
        seed=a.seed, max_grad_norm=0.0 if a.decoupled else a.clip,  # decoupled: the callback clips
        train_sampling_strategy="sequential", remove_unused_columns=False, dataloader_num_workers=0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                "reshard_after_forward": True},
        ddp_backend=ddp_backend,  # "odc": the one line odc needs
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}} if a.decoupled else None,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collator, callbacks=callbacks)
    trainer.train()

    from odc_stats import group_report  # beside this file

    rank = dist.get_rank()
    fsdp_model = trainer.model
    mesh_group = next(fsdp_model.parameters()).device_mesh.get_group()
    device = targs.device
    backend = mesh_group._get_backend(torch.device(device.type))
    mine = {"seen": collator.seen, "groups": group_report(), "mesh_group_backend": backend.name(),
            "mesh_odc_stats": {k: int(v) for k, v in dict(backend.stats()).items()} if backend.name() == "odc" else {},
            "odc_metrics": None}
    if a.decoupled:
        import torch_odc_backend as odc

        mine["odc_metrics"] = odc.metrics(fsdp_model)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        rec = callbacks[0]
        expected = [[mb for step in plan for mb in pad_slots(step[r], accumulate if a.decoupled else 0)]
                    for r in range(world)]
        seen = [r["seen"] for r in everyone]
        default = [next((g for g in r["groups"] if g["default"]), r["groups"][0]) for r in everyone]
        result = {
            "trainer": "transformers.Trainer", "transformers": transformers.__version__,
            "accelerate": __import__("accelerate").__version__, "torch": torch.__version__,
            "mode": "decoupled" if a.decoupled else "exact", "ddp_backend": ddp_backend,
            "odc_default_backend": os.environ.get("ODC_DEFAULT_BACKEND", ""),
            "pg_backend_string": str(dist.get_backend()), "device": str(device), "world": world,
            "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
            "gradient_accumulation_steps": accumulate, "per_device_train_batch_size": batch,
            "losses": rec.losses, "trainer_grad_norms": rec.grad_norms,
            "callback_grad_norms": callbacks[1].grad_norms if a.decoupled else None,
            "planned_microbatches_per_rank": [[len(step[r]) for step in plan] for r in range(world)],
            # the collator may build batches ahead; what training consumed is the prefix
            "ranks_trained_on_plan": all(s[:len(e)] == e for s, e in zip(seen, expected)),
            "mesh_group_backend": [r["mesh_group_backend"] for r in everyone],
            "default_group_backends": [{d: b["name"] for d, b in g["backends"].items()} for g in default],
            "mesh_group_ranks": dist.get_process_group_ranks(mesh_group),
            "odc_counters_per_rank": [r["mesh_odc_stats"] for r in everyone],  # the FSDP mesh's group
            "groups_rank0": everyone[0]["groups"],
            "odc_metrics": [r["odc_metrics"] for r in everyone],
            "args": vars(a), "wall_s": round(time.perf_counter() - started, 1),
        }
        for s, loss in enumerate(rec.losses):
            print(f"step {s + 1:3d}  loss {loss:.7f}", flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    # The Trainer leaves the process group up: destroy it, as PyTorch asks. FSDP2's modules keep
    # their ProcessGroup objects, so free them too while the interpreter is alive: a gloo group
    # (odc's inner one too) torn down at interpreter shutdown aborts the process now and then
    # ("terminate called without an active exception"; cf. pytorch/pytorch#190489).
    dist.destroy_process_group()
    del trainer, fsdp_model, model, mesh_group, backend
    gc.collect()


def pad_slots(micro: list[list[int]], slots: int) -> list[list[int]]:
    return micro + [[] for _ in range(slots - len(micro))] if slots else micro


# --------------------------------------------------------------------------- reference
def reference(a) -> None:
    """One process, W ranks' work: see the module docstring."""
    started = time.perf_counter()
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    model = build_model(a).to(device)
    model.train()
    docs = make_documents(a)
    plan = exact_plan(a, a.world)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses, grad_norms = [], []
    for step in plan:
        batches = [[{k: v.to(device) for k, v in pad_batch([docs[i] for i in mb]).items()} for mb in rank_plan]
                   for rank_plan in step]
        # the Trainer's num_items_in_batch: label tokens after the shift, summed over all ranks
        n_items = sum(b["labels"][..., 1:].ne(IGNORE).sum() for rank_b in batches for b in rank_b).to(device)
        rank_grads, rank_losses = [], []
        for rank_b in batches:
            tr_loss = torch.tensor(0.0, device=device)
            for b in rank_b:
                loss = model(**b, num_items_in_batch=n_items).loss
                loss *= a.world  # the Trainer: loss scaled by the number of processes
                loss.backward()
                tr_loss += loss.detach()
            rank_losses.append(tr_loss)
            rank_grads.append([p.grad for p in params])
            for p in params:
                p.grad = None
        for i, p in enumerate(params):  # FSDP2's reduce-scatter: the average over ranks
            total = rank_grads[0][i].clone()
            for g in rank_grads[1:]:
                total += g[i]
            p.grad = total / a.world
        if a.clip > 0:
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, a.clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(torch.stack(rank_losses).mean().item())  # the Trainer's logged loss
    import transformers

    result = {"mode": "single", "world": a.world, "transformers": transformers.__version__,
              "torch": torch.__version__, "device": str(device), "losses": losses, "grad_norms": grad_norms,
              "args": vars(a), "wall_s": round(time.perf_counter() - started, 1)}
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
        raise SystemExit("--device cuda: no GPU here (accelerate runs FSDP only on GPU-type devices; "
                         "--device cpu runs the test-only CPU shim)")
    per_rank_device = a.device == "cpu" or gpus >= a.nproc
    env = cu.base_env(work, CPU_SHIM if a.device == "cpu" else None)
    model_args = cu.as_argv(a, cu.WORKLOAD_ARGS + ("hidden",))
    script = Path(__file__).resolve()
    runs: dict = {}
    result = {"device_type": a.device, "gpus": gpus, "nproc": a.nproc,
              "ranks_share_gpus": a.device == "cuda" and not per_rank_device, "runs": runs}
    for name in [r for r in a.runs.split(",") if r]:
        out, log = work / f"{name}.json", work / f"{name}.log"
        if name == "odc":
            cmd = cu.torchrun(a.nproc, script, "train", "--ddp-backend", "odc", "--out", str(out), *model_args)
            runs[name] = cu.run(cmd, env, log, out, a.timeout)
        elif name == "decoupled":
            cmd = cu.torchrun(a.nproc, script, "train", "--ddp-backend", "odc", "--decoupled",
                              "--out", str(out), *model_args)
            runs[name] = cu.run(cmd, env, log, out, a.timeout)
        elif name == "switch":  # the switch, no ddp_backend: what does accelerate choose?
            nproc = a.nproc if per_rank_device else 1  # NCCL refuses ranks sharing a GPU
            cmd = cu.torchrun(nproc, script, "train", "--ddp-backend", "unset", "--out", str(out), *model_args)
            runs[name] = cu.run(cmd, dict(env, ODC_DEFAULT_BACKEND=a.device), log, out, a.timeout)
        elif name == "single":
            cmd = [sys.executable, str(script), "reference", "--world", str(a.nproc), "--device", a.device,
                   "--out", str(out), *model_args]
            runs[name] = cu.run(cmd, env, log, out, a.timeout)
        else:
            raise SystemExit(f"unknown run {name!r} (odc, decoupled, switch, single)")

    checks, cmp = {}, result.setdefault("compare", {})
    ref = runs.get("single")
    for name in ("odc", "decoupled", "switch"):
        got = runs.get(name)
        if got is None:
            continue
        if name != "switch":
            checks[f"{name}: odc carried FSDP's collectives"] = cu.carried_check(name, got)
            checks[f"{name}: ranks trained on the planned batches"] = (
                got["ranks_trained_on_plan"], f"microbatches per rank and step {got['planned_microbatches_per_rank']}"
                f", gradient_accumulation_steps {got['gradient_accumulation_steps']}")
        else:
            result["switch"] = {"odc_default_backend": a.device, "world": got["world"],
                                "mesh_group_backend": got["mesh_group_backend"],
                                "reached_odc": got["mesh_group_backend"] == ["odc"] * got["world"]}
        if ref is not None and got["world"] == a.nproc:
            c = cmp[f"{name}_vs_single"] = cu.compare_losses(got["losses"], ref["losses"], a.rtol)
            if name != "switch":
                checks[f"{name} vs single-process reference"] = cu.reference_check(c, a.rtol)
    cu.write_result(work / "hf_trainer_result.json", result, checks, runs, switch=result.get("switch"))
    if "switch" in result:
        s = result["switch"]
        print(f"note switch: ODC_DEFAULT_BACKEND={a.device} without ddp_backend -> mesh group backend "
              f"{s['mesh_group_backend']} ({'odc' if s['reached_odc'] else 'the switch did not reach the Trainer'})")
    return cu.verdict(checks)


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    sys.path.insert(0, str(HERE))  # odc_stats, compare_util, odc_entry_point
    import compare_util as cu
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train", help="under torchrun: the Trainer with FSDP2")
    p.add_argument("--out", required=True, help="result JSON (rank 0)")
    p.add_argument("--ddp-backend", default="odc",
                   help="TrainingArguments.ddp_backend: odc (default), cpu:gloo,cuda:odc, nccl, ... or "
                        "'unset' (accelerate chooses)")
    p.add_argument("--decoupled", action="store_true", help="odc decoupled mode + LB-Mini (a callback)")
    cu.add_workload_args(p, "hidden")
    p = sub.add_parser("reference", help="one process doing the work of --world ranks")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    cu.add_workload_args(p, "hidden")
    p = sub.add_parser("compare", help="odc runs against the reference; verdict and exit status")
    p.add_argument("--work", required=True, help="folder for results and logs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: tests only, through tests/integrations/hf_cpu_shim")
    p.add_argument("--runs", default="odc,decoupled,switch,single",
                   help="comma-separated: odc, decoupled, switch, single")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative loss tolerance where not bitwise")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    cu.add_workload_args(p, "hidden")
    a = parser.parse_args(argv)
    if a.cmd == "compare":
        return compare(a)
    if a.cmd == "reference":
        reference(a)
    else:
        train(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
