#!/usr/bin/env python3
"""torchtitan's llama3 debug model, unmodified, on odc through ODC_DEFAULT_BACKEND alone.

torchtitan takes its backend from PyTorch's ``Backend.default_device_backend_map``
(``torchtitan/distributed/utils.py``, ``_get_distributed_backend``: "nccl" unless the map
names another backend for the device; it has no backend option), so with torch_odc_backend
installed, ``ODC_DEFAULT_BACKEND=cuda`` makes it create its groups, and so its FSDP2 mesh,
on odc. It trains on accelerators only (device type: the available accelerator, else
"cuda": ``torchtitan/tools/utils.py``). This recipe is for torchtitan 0.2.x (0.2.2 runs on
torch 2.11 and 2.13; TOML job configs). torchtitan 0.3.0 derives its backend the same way
but needs torch >= 2.12 (it imports ``torch.distributed.fsdp.DataParallelMeshDims``) and
configures jobs in Python (``--module llama3 --config llama3_debugmodel``).

    python examples/recipes/torchtitan_debug.py prepare --work DIR       # assets + config
    ODC_DEFAULT_BACKEND=cuda torchrun --standalone --nproc-per-node=2 \\
        -m torchtitan.train --job.config_file DIR/debug_model.toml      # the run itself

``prepare`` writes what torchtitan's debug config reads from its source tree (which the
wheel does not ship), made here: a word-level tokenizer (tokenizer.json +
tokenizer_config.json) and a small learnable text data set (JSON lines for the "c4_test"
loader), plus ``debug_model.toml``: torchtitan's llama3 ``debugmodel`` flavour (dim 256,
6 layers, 16 heads, vocab 2048) with torchtitan's debug settings, shorter sequences.

``compare`` checks the run: it trains the same steps from the same seed checkpoint (made
by torchtitan's ``--checkpoint.create_seed_checkpoint``) on odc (switch alone, N ranks)
and on a reference, then compares torchtitan's logged per-step losses (its TensorBoard
scalars, fp32) and records, through ``ODC_STATS_DIR``, which backend every
group used and odc's counters. References (``--reference``, comma-separated):

- ``default``: the same N-rank run without the switch, i.e. on torchtitan's default backend
  for the device (NCCL on CUDA; needs a GPU per rank, as NCCL refuses ranks sharing a GPU).
- ``single``: one rank (no FSDP) with gradient accumulation over N microbatches that are
  exactly the N ranks' batches (a reordered copy of the data set), so every step sees the
  same samples as the N-rank run. Where ranks share one GPU this is what can be compared.

``auto`` picks ``default`` when there is a GPU per rank, else ``single``. For an exact
comparison ``compare`` trains with fp32 parameters (``--training.mixed_precision_param
float32``: torchtitan's FSDP default is bf16 and its single-rank path autocasts instead)
and with a ``--training.max_norm`` so large that clipping multiplies by exactly 1 (the norm
itself is summed in a different order across shards). Results:
``WORK/torchtitan_result.json``, logs ``WORK/<run>.log``.

``--device cpu`` is for tests: torchtitan has no CPU support, so the ranks then run with
tests/integrations/torchtitan_cpu_shim first on their PYTHONPATH (it shows torchtitan a
"cpu" device; torchtitan's code is unchanged) and the switch is ``ODC_DEFAULT_BACKEND=cpu``.
``default`` would be gloo there, which cannot train torchtitan's FSDP setup: torchtitan sets a
gradient divide factor, so FSDP2 reduce-scatters with PREMUL_SUM, which gloo refuses.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import odc_entry_point  # beside this file
from odc_stats import read_stats_dir, summed_counters

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CPU_SHIM = REPO / "tests" / "integrations" / "torchtitan_cpu_shim"
LOSS_TAG, GRAD_NORM_TAG = "loss_metrics/global_avg_loss", "grad_norm"

WORDS = 1000  # tokenizer vocabulary: WORDS words + 3 special tokens (< 2048, the model's)
BOS, EOS, UNK = "<|bos|>", "<|eos|>", "<|unk|>"
STRIDES = (1, 2, 3, 5, 7)


# ------------------------------------------------------------------------------ prepare
def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer: "w0".."w999" and BOS/EOS/UNK, whitespace-split."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {BOS: 0, EOS: 1, UNK: 2}
    vocab.update({f"w{i}": i + 3 for i in range(WORDS)})
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True,
         "add_eos_token": True}, indent=1))


def make_documents(count: int, words: int, seed: int = 0) -> list[str]:
    """Learnable documents: arithmetic progressions of word ids modulo WORDS with a random
    start and stride, ``words`` words each (BOS + words + EOS = seq_len + 1 tokens: one
    document per sample, none split across samples)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        x0, stride = rng.randrange(WORDS), rng.choice(STRIDES)
        docs.append(" ".join(f"w{(x0 + t * stride) % WORDS}" for t in range(words)))
    return docs


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")


def single_rank_order(docs: list[str], nproc: int, local_batch: int, steps: int) -> list[str]:
    """The documents in the order one rank with ``nproc`` accumulation microbatches of
    ``local_batch`` reads what ``nproc`` ranks read in the same steps. The data set is split
    between ranks in contiguous blocks (datasets' split_dataset_by_node on a map-style data
    set); rank r's step s batch is its block's rows [s*B, (s+1)*B)."""
    block = len(docs) // nproc
    out = []
    for s in range(steps):
        for r in range(nproc):
            out += docs[r * block + s * local_batch: r * block + (s + 1) * local_batch]
    return out


def write_config(path: Path, work: Path, a) -> None:
    """torchtitan 0.2.x job config: its debug model and debug settings, our assets."""
    path.write_text(f"""\
# torchtitan llama3 debug model (written by examples/recipes/torchtitan_debug.py prepare)
[job]
dump_folder = "{work / 'outputs'}"
description = "llama3 debug model, odc recipe"

[metrics]
log_freq = 1
enable_tensorboard = true
save_tb_folder = "tb"
disable_color_printing = true

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "{work / 'assets' / 'tokenizer'}"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = {a.local_batch}
seq_len = {a.seq_len}
max_norm = 1.0
steps = {a.steps}
dataset = "c4_test"
dataset_path = "{work / 'assets' / 'data'}"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"

[checkpoint]
enable = false

[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"

[compile]
enable = false

[validation]
enable = false

[debug]
seed = 42
""")


def prepare(a) -> Path:
    work = Path(a.work).resolve()
    assets = work / "assets"
    if assets.exists():
        shutil.rmtree(assets)
    write_tokenizer(assets / "tokenizer")
    docs = make_documents(a.nproc * a.local_batch * a.steps, a.seq_len - 1)
    write_jsonl(assets / "data" / "train.jsonl", docs)
    write_jsonl(assets / "data_single_rank" / "train.jsonl",
                single_rank_order(docs, a.nproc, a.local_batch, a.steps))
    write_config(work / "debug_model.toml", work, a)
    (work / "prepare.json").write_text(json.dumps(vars(a), indent=1))
    return work


# ------------------------------------------------------------------------------ launching
def base_env(work: Path, device: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ODC_DEFAULT_BACKEND"}
    env.update(GPU_ENV)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                # the data set is local; nothing may be fetched (there may be no network)
                "HF_HOME": str(work / "hf_home"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    path = [str(CPU_SHIM)] if device == "cpu" else []
    path += [str(REPO)] + ([str(d)] if (d := odc_entry_point.ensure(work / "odc_entry_point")) else [])
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def launch(work: Path, name: str, nproc: int, overrides: list[str], *, odc: bool, device: str,
           timeout: float) -> dict:
    """torchrun N ranks of ``torchtitan.train`` (odc's counters through ODC_STATS_DIR) with the config and
    ``overrides``; ``odc``: with ODC_DEFAULT_BACKEND=<device>. Returns the run's record."""
    out = work / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = base_env(work, device)
    env["ODC_STATS_DIR"] = str(out / "odc_stats")  # odc's groups and counters, written at exit
    launcher = []
    if odc:
        env["ODC_DEFAULT_BACKEND"] = device
        import torch

        if device == "cuda" and torch.cuda.device_count() < nproc:
            # torchtitan takes cuda:LOCAL_RANK; ranks sharing GPUs need it folded onto them
            launcher = ["-m", "torch_odc_backend.share_gpus"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *launcher, "-m", "torchtitan.train",
           "--job.config_file", str(work / "debug_model.toml"), "--job.dump_folder", str(out), *overrides]
    t0 = time.time()
    log = work / f"{name}.log"
    with open(log, "w") as f:
        f.write((f"ODC_DEFAULT_BACKEND={device} " if odc else "") + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, cwd=work, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    record = {"name": name, "nproc": nproc, "odc_default_backend": device if odc else "",
              "returncode": proc.returncode, "wall_s": round(time.time() - t0, 1), "log": str(log)}
    if proc.returncode != 0:
        tail = log.read_text()[-6000:]
        raise RuntimeError(f"torchtitan run {name!r} exited with {proc.returncode}; log {log}:\n{tail}")
    record.update(read_scalars(out))
    record["groups"] = read_stats_dir(out / "odc_stats")
    return record


def read_scalars(out: Path) -> dict:
    """Per-step loss and grad norm from torchtitan's TensorBoard files (rank 0's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(str(out / "tb" / "**" / "events.out.tfevents.*"), recursive=True))
    if not files:
        raise RuntimeError(f"no TensorBoard events under {out / 'tb'}")
    scalars = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in (LOSS_TAG, GRAD_NORM_TAG):
            if tag in acc.Tags().get("scalars", []):
                scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    loss = scalars.get(LOSS_TAG, {})
    norm = scalars.get(GRAD_NORM_TAG, {})
    return {"steps": sorted(loss), "losses": [loss[s] for s in sorted(loss)],
            "grad_norms": [norm.get(s) for s in sorted(loss)]}


def odc_summary(groups_per_rank: list[dict]) -> dict:
    """Per rank: whether the default group was odc's, and odc's counters summed over groups."""
    ranks = [{"rank": rec["rank"], "default_group_on_odc": any(g["default"] for g in rec["groups"]),
              "odc_groups": len(rec["groups"]), "odc_counters": summed_counters(rec)} for rec in groups_per_rank]
    return {"ranks": ranks}


def loss_comparison(got: dict, ref: dict) -> dict:
    diffs = [abs(x - y) for x, y in zip(got["losses"], ref["losses"])]
    return {"steps": len(got["losses"]), "steps_reference": len(ref["losses"]),
            "max_abs_loss_diff": max(diffs) if diffs else None,
            "max_rel_loss_diff": max(d / abs(y) for d, y in zip(diffs, ref["losses"])) if diffs else None,
            "losses_bitwise_equal": bool(diffs) and got["losses"] == ref["losses"]}


def compare(a) -> dict:
    import torch

    work = prepare(a)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if a.device == "cuda" and gpus == 0:
        raise SystemExit("torchtitan trains on CUDA only (torchtitan/tools/utils.py: device type "
                         "is the available accelerator, else 'cuda'); no GPU here")
    per_rank_device = a.device == "cpu" or gpus >= a.nproc
    references = [r for r in a.reference.split(",") if r]
    if references == ["auto"]:
        references = ["default" if per_rank_device else "single"]
    if "default" in references and not per_rank_device:
        raise SystemExit(f"--reference default on CUDA needs a GPU per rank ({a.nproc}); {gpus} here "
                         "(NCCL refuses ranks sharing a GPU): use --reference single")
    exact = ["--training.mixed_precision_param", "float32", "--training.max_norm", "1e9",
             "--debug.deterministic", "--debug.seed", "42"]
    default_backend = {"cuda": "nccl", "cpu": "gloo"}[a.device]
    result = {"torchtitan": md.version("torchtitan"), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
              "device": torch.cuda.get_device_name(0) if gpus else "cpu (tests/integrations/torchtitan_cpu_shim)",
              "device_type": a.device, "gpus": gpus, "nproc": a.nproc,
              "ranks_share_gpus": a.device == "cuda" and gpus < a.nproc, "steps": a.steps,
              "seq_len": a.seq_len, "local_batch": a.local_batch,
              "entry_point": "installed" if odc_entry_point.installed() else "source-tree record (odc_entry_point/)",
              "exact_settings": exact, "runs": {}, "compare": {}}
    run = dict(device=a.device, timeout=a.timeout)
    # 1. the seed checkpoint: one rank, full model, saved before any step (torchtitan's own way
    #    to start differently parallelised runs from the same weights)
    seed = launch(work, "seed", 1, ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                                    "--parallelism.data_parallel_shard_degree", "1", *exact], odc=False, **run)
    result["runs"]["seed"] = {k: seed[k] for k in ("returncode", "wall_s", "log")}
    load = ["--checkpoint.enable", "--checkpoint.load_only",
            "--checkpoint.initial_load_path", str(work / "seed" / "checkpoint" / "step-0"), *exact]
    # 2. odc: the switch alone
    got = result["runs"]["odc"] = launch(work, "odc", a.nproc, load, odc=True, **run)
    result["odc"] = odc_summary(got["groups"])
    # 3. the references
    for ref in references:
        if ref == "default":
            name = default_backend
            rec = launch(work, name, a.nproc, load, odc=False, **run)
        else:
            name = "single"
            rec = launch(work, name, 1, load + ["--training.global_batch_size", str(a.nproc * a.local_batch),
                                                "--training.dataset_path", str(work / "assets" / "data_single_rank")],
                         odc=False, **run)
        rec["backends"] = odc_summary(rec["groups"])
        result["runs"][name] = rec
        result["compare"][f"odc_vs_{name}"] = loss_comparison(got, rec)
    out = work / "torchtitan_result.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"result": str(out), "losses_odc": got["losses"], "compare": result["compare"],
                      "odc_rank0": result["odc"]["ranks"][0] if result["odc"]["ranks"] else None}, indent=1))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "compare"):
        p = sub.add_parser(name)
        p.add_argument("--work", required=True, help="folder for assets, config, runs and results")
        p.add_argument("--nproc", type=int, default=2, help="ranks (the data set holds their batches)")
        p.add_argument("--steps", type=int, default=10)
        p.add_argument("--seq-len", type=int, default=256)
        p.add_argument("--local-batch", type=int, default=8)
        if name == "compare":
            p.add_argument("--reference", default="auto",
                           help="auto, or a comma-separated list of: default, single")
            p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                           help="cpu: tests only, through tests/integrations/torchtitan_cpu_shim")
            p.add_argument("--timeout", type=float, default=900, help="seconds per torchtitan run")
    a = parser.parse_args(argv)
    if a.cmd == "prepare":
        work = prepare(a)
        print(f"wrote {work / 'debug_model.toml'}; run:\n  ODC_DEFAULT_BACKEND=cuda torchrun --standalone "
              f"--nproc-per-node={a.nproc} -m torchtitan.train --job.config_file {work / 'debug_model.toml'}")
    else:
        compare(a)


if __name__ == "__main__":
    main()
