#!/usr/bin/env python3
"""verl's SFT trainer (``verl.trainer.sft_trainer``) with the odc engine against verl's own FSDP2
engine: the same model, data and settings; the odc run adds only
``model.external_lib=torch_odc_backend.verl``.

    python examples/recipes/verl_sft.py compare --work DIR [--device cuda] [--nproc 4]
        [--size 0.5b] [--steps 8] [--straggler 3:1.3]

Needs verl (docs/trainers.md gives the versions). ``compare`` writes a tokenizer, a Qwen2
model of random weights (``--size``) and a chat data set whose answer lengths are long-tailed
(Pareto) into DIR, trains each engine for ``--steps`` optimizer steps under torchrun, and
writes ``DIR/verl_sft_result.json``: per-step losses and gradient norms of both runs, their
step times and tokens/s (after ``--warmup`` steps), the per-rank microbatch counts of the odc
run, what odc carried (``ODC_STATS_DIR``), and the checks (losses and gradient norms equal
within ``--rtol``, odc carried the data-parallel collectives, ranks' microbatch counts
differed; with ``--straggler``, a difference no larger than between verl's engine's own two runs,
whose arithmetic is the same, also counts as equal: flash-attn's backward adds with atomics, so
bf16 runs of one engine differ too). Step times come from when each step's metrics line reached
verl's file logger; ``summary`` gives the speed-ups, memory ratios and verl's own MFU
(``mfu_stock``, ``mfu_odc``: the mean over the timed steps).

On GPUs both runs attend with flash-attn's ``flash_attention_2`` where flash-attn is installed
(then verl also takes its log-probabilities from flash-attn's fused cross-entropy), otherwise with
PyTorch's variable-length flash attention (examples/recipes/verl_varlen_attention.py; sequence
parallelism needs flash-attn: verl puts its Ulysses all-to-alls around it). verl has no CPU
engine: on CPU, pass ``--entry tests/integrations/verl_cpu_shim/sft_cpu.py``
(it registers a CPU platform and verl's own engine for it, then runs verl's trainer).
``--straggler RANK:FACTOR`` runs every engine a second time (``<engine>_straggler``) with rank
RANK about FACTOR times slower (examples/recipes/verl_straggler.py, loaded through
``VERL_USE_EXTERNAL_MODULES``): its GPU, or with ``RANK:FACTOR:host`` its host (where verl's
steps wait on the host, as without flash-attn). ``--engines`` may name ``stock_nosync``: verl's
engine with ``use_no_sync_for_gradient_accumulation`` true (the other runs use ``--use-no-sync``,
unset: verl's default, false). On GPUs every rank's device memory is sampled
(examples/recipes/verl_memory_probe.py): the result gives each run's peak and, with
``--offload``, the least each rank held between the timed steps, while verl had offloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from odc_stats import read_stats_dir, summed_counters  # beside this file

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RESULT = "verl_sft_result.json"
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Qwen2-style shapes (random weights): hidden, layers, heads, kv heads, MLP, vocab
SIZES = {"tiny": (64, 2, 4, 2, 128, 320), "0.5b": (896, 24, 14, 2, 4864, 32768),
         "1.5b": (1536, 28, 12, 2, 8960, 32768), "3b": (2048, 36, 16, 2, 11008, 32768),
         "7b": (3584, 28, 28, 4, 18944, 32768)}
WORDS = ("the a cat dog sat on mat what is two plus three answer five ok yes no number add sum of "
         "and river stone light green across under over quick slow bright").split()


# ---- assets: tokenizer, model, data

def make_tokenizer(path: Path):
    """A byte-level BPE over the data's words, with a ChatML chat template (verl's SFT data set
    tokenises conversations with it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(200)] + ["user assistant system"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=template)
    hf.save_pretrained(path)
    return hf


def make_model(path: Path, size: str, tokenizer) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, mlp, vocab = SIZES[size]
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      max_position_embeddings=32768, tie_word_embeddings=False,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def make_data(path: Path, rows: int, max_words: int, seed: int) -> list[int]:
    """Conversations whose answers have long-tailed lengths (Pareto, capped); returns them."""
    import pandas as pd

    rng = random.Random(seed)
    lengths = [min(max_words, int(rng.paretovariate(1.2) * max_words / 40) + 8) for _ in range(rows)]
    talk = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))},
             {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(n))}] for n in lengths]
    pd.DataFrame({"messages": talk}).to_parquet(path)
    return lengths


# ---- one run of verl's trainer

def overrides(a, work: Path, name: str) -> list[str]:
    """verl's Hydra overrides of one run (the same for both engines but the output places)."""
    engine = name.removesuffix("_straggler")
    cpu = a.device == "cpu"
    attention = attention_of(a)
    o = [f"model.path={work / 'model'}", f"+model.override_config.attn_implementation={attention}",
         "model.use_remove_padding=True", f"model.enable_gradient_checkpointing={not cpu}",
         "engine=fsdp", "engine.strategy=fsdp2", "engine.use_torch_compile=False",
         f"optim.lr={a.lr}", f"data.train_files={work / 'train.parquet'}",
         f"data.train_batch_size={a.batch}", "data.micro_batch_size_per_gpu=1",
         "data.use_dynamic_bsz=True", f"data.max_token_len_per_gpu={a.max_tokens}",
         "data.pad_mode=no_padding", f"data.max_length={a.max_tokens}", "data.truncation=right",
         f"data.num_workers={0 if cpu else 2}", f"trainer.device={a.device}",
         f"trainer.total_training_steps={a.steps}", "trainer.total_epochs=100",
         "trainer.logger=[console,file]", "trainer.save_freq=-1", "trainer.test_freq=-1",
         "trainer.resume_mode=disable", f"trainer.default_local_dir={work / ('ckpt_' + name)}",
         "trainer.project_name=odc_verl_sft", f"trainer.experiment_name={name}", f"trainer.seed={a.seed}",
         f"hydra.run.dir={work / ('hydra_' + name)}",  # Hydra's own output folder: not the cwd
         "checkpoint.save_contents=[]",  # verl saves at the last step: not the model and optimizer
         f"engine.fsdp_size={a.fsdp_size}"]
    if a.lora_rank:
        # LoRA's A matrices are initialised from torch's global random state, which verl's SFT
        # trainer leaves unseeded (it differs between runs); verl's full_determinism seeds it
        # (engine.seed) before the model is built, so both runs start from the same adapters
        o += [f"model.lora_rank={a.lora_rank}", f"model.lora_alpha={a.lora_alpha or a.lora_rank}",
              "model.target_modules=all-linear", "engine.full_determinism=True", f"engine.seed={a.seed}"]
    if a.sp > 1:
        o.append(f"engine.ulysses_sequence_parallel_size={a.sp}")
    if a.offload:
        o += ["engine.param_offload=True", "engine.optimizer_offload=True"]
    no_sync = True if engine == "stock_nosync" else a.use_no_sync
    if no_sync is not None:
        o.append(f"engine.use_no_sync_for_gradient_accumulation={no_sync}")
    if cpu:  # fp32 throughout: the comparison is then reassociation alone
        o += ["engine.model_dtype=fp32", "+engine.mixed_precision.param_dtype=fp32",
              "+engine.mixed_precision.reduce_dtype=fp32", "+engine.mixed_precision.buffer_dtype=fp32"]
    if engine in ("odc", "odc_off", "odc_dynamic"):
        o.append("model.external_lib=torch_odc_backend.verl")
    return o


def attention_of(a) -> str:
    """The attention both engines run: on CPU SDPA (with sequence parallelism the CPU shim's
    Ulysses attention); on GPUs flash-attn's where it is installed (sequence parallelism needs it),
    else PyTorch's variable-length flash attention (verl_varlen_attention.py)."""
    import importlib.util

    if a.device == "cpu":
        return "cpu_ulysses" if a.sp > 1 else "sdpa"
    return "flash_attention_2" if a.sp > 1 or importlib.util.find_spec("flash_attn") else "odc_varlen"


def follow(path: Path, times: dict, stop: threading.Event) -> None:
    """Record when each step's line reaches verl's file logger (a step's end, on rank 0)."""
    seen = 0
    while not stop.is_set():
        if path.exists():
            lines = path.read_text().splitlines()
            for line in lines[seen:]:
                try:
                    times[json.loads(line)["step"]] = time.time()
                except (ValueError, KeyError):
                    break
                seen += 1
        time.sleep(0.02)


def run_engine(a, work: Path, name: str) -> dict:
    metrics, stats, memory = work / f"{name}_metrics.jsonl", work / f"{name}_odc_stats", work / f"{name}_memory"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, **GPU_ENV, VERL_FILE_LOGGER_PATH=str(metrics), WANDB_MODE="disabled",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", ODC_STATS_DIR=str(stats))
    paths = [str(REPO)] + ([str(Path(a.entry).resolve().parent)] if a.entry else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if a.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    if name.startswith("odc_off"):  # the setting with the engine turned off: verl's own engine runs
        env["ODC_VERL_ROLES"] = "none"
    if name.startswith("odc_dynamic"):  # ranks claim microbatches as they become free
        env["ODC_VERL_BALANCE"] = "dynamic"
    extra = [] if a.device == "cpu" else ["verl_varlen_attention", "verl_memory_probe"]
    if a.device == "cuda":
        env["ODC_RECIPE_MEMORY_DIR"] = str(memory)
    if name.endswith("_straggler"):
        extra.append("verl_straggler")
        env["ODC_RECIPE_STRAGGLER"] = a.straggler
    if extra:  # imported by `import verl`, in every rank, before the model is built
        env["VERL_USE_EXTERNAL_MODULES"] = ",".join(extra)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    entry = [str(Path(a.entry).resolve())] if a.entry else ["-m", "verl.trainer.sft_trainer"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           *entry, *overrides(a, work, name)]
    times: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=follow, args=(metrics, times, stop), daemon=True)
    watcher.start()
    log = work / f"{name}.log"
    t0 = time.time()
    returncode = launch(cmd, env, log, a.timeout)
    time.sleep(0.1)
    stop.set()
    watcher.join()
    if returncode != 0 or not metrics.exists():
        raise RuntimeError(f"{name}: exited with {returncode}; log {log}:\n{log.read_text()[-6000:]}")
    return summarise([json.loads(x) for x in metrics.read_text().splitlines()], times, stats, a,
                     memory=memory, wall_s=time.time() - t0, log=str(log))


def launch(cmd: list[str], env: dict, log: Path, timeout: float) -> int:
    """Run ``cmd`` with its output (after the command line) in ``log``; its exit status."""
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode


def summarise(lines: list[dict], times: dict, stats: Path, a, memory: Path | None = None, **extra) -> dict:
    steps = [x["step"] for x in lines]
    data = [x["data"] for x in lines]
    timed = [s for s in steps if s > a.warmup and s - 1 in times and s in times]
    step_s = [times[s] - times[s - 1] for s in timed]
    tokens = {x["step"]: x["data"].get("train/global_tokens", 0) for x in lines}
    out = {"steps": steps, "losses": [d["train/loss"] for d in data],
           "grad_norms": [d.get("train/grad_norm") for d in data],
           "step_s": step_s, "tokens_per_s": sum(tokens[s] for s in timed) / sum(step_s) if step_s else None,
           "microbatches_per_rank": [d.get("odc/microbatches") for d in data],
           "early_all_reduces_per_rank": [d.get("odc/early_all_reduces") for d in data],
           "peak_memory_gb": [d.get("perf/max_memory_allocated_gb") for d in data],
           "mfu": [d.get("train/mfu") for d in data],
           "mfu_timed_mean": _mean([data[steps.index(s)].get("train/mfu") for s in timed]), **extra}
    if memory is not None and timed:  # the GPU memory probe: between the first and last timed step's ends
        from verl_memory_probe import read

        out["device_memory"] = read(memory, times[timed[0] - 1], times[timed[-1]])
    return dict(out, **read_odc_stats(stats))


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ---- the comparison

def close(got, ref, rtol: float) -> dict:
    n = min(len(got), len(ref))
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(got[:n], ref[:n])]
    return {"steps": n, "max_rel_diff": max(rel) if rel else None, "rtol": rtol,
            "equal": n > 0 and len(got) == len(ref) and max(rel) <= rtol}


def _peak(run: dict) -> float:
    """The largest peak allocated memory (GB) verl reported over the steps (rank 0's)."""
    return max((x for x in run["peak_memory_gb"] if x is not None), default=0.0)


def within_own_spread(compared: dict, checks: dict, stock: dict, stock_again: dict, rtol: float) -> dict:
    """verl's engine against itself (``stock_again``: the same arithmetic, a slow rank only
    waits; yet flash-attn's backward adds with atomics, so bf16 runs differ): records the spread
    in ``compared["stock_against_itself"]`` and returns the losses / gradient norms checks that
    failed ``rtol`` but whose difference is no larger than that spread, passed and saying so."""
    spread = {k: close(stock_again[k], stock[k], rtol) for k in ("losses", "grad_norms")}
    compared["stock_against_itself"] = spread
    out = {}
    for check, key in (("losses equal", "losses"), ("gradient norms equal", "grad_norms")):
        ours, theirs = compared[key]["max_rel_diff"], spread[key]["max_rel_diff"]
        ok, detail = checks[check]
        if not ok and ours is not None and theirs is not None and ours <= theirs:
            out[check] = (True, f"{detail}; within verl's engine against itself ({theirs:.3g})")
    return out


def memory_summary(stock: dict, odc: dict, tag: str) -> dict:
    """From the GPU memory probe (verl_memory_probe.py): the ratio of the two runs' peak device
    memory (the largest rank's), and with offload the most any rank held between the timed steps
    in each run and odc's extra over verl's engine, in MiB."""
    s_mem, o_mem = stock.get("device_memory") or {}, odc.get("device_memory") or {}
    if not s_mem or not o_mem:
        return {}
    out = {"peak_device_memory_ratio" + tag: max(o_mem["peak_used_gb"]) / max(s_mem["peak_used_gb"])}
    s_held = [x for x in s_mem["least_used_between_steps_gb"] if x is not None]
    o_held = [x for x in o_mem["least_used_between_steps_gb"] if x is not None]
    if s_held and o_held:
        out["held_between_steps_gb_stock" + tag] = max(s_held)
        out["held_between_steps_gb_odc" + tag] = max(o_held)
        out["held_between_steps_extra_mib" + tag] = (max(o_held) - max(s_held)) * 1024
    return out


def read_odc_stats(folder: Path) -> dict:
    """What ``ODC_STATS_DIR=folder`` left: ``odc_stats``, each rank's groups and their counters
    (none when no odc group was made), and ``odc_counters_per_rank``, summed over its groups."""
    stats = read_stats_dir(folder)
    return {"odc_stats": stats, "odc_counters_per_rank": [summed_counters(rank) for rank in stats]}


def compare(a) -> int:
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(work / "model")
    make_model(work / "model", a.size, tok)
    lengths = make_data(work / "train.parquet", a.rows, a.max_words, a.seed)
    names = a.engines.split(",")
    if a.straggler:  # every run again with the slow rank
        names += [f"{n}_straggler" for n in names if n != "stock_nosync"]
    result = {"device": a.device, "nproc": a.nproc, "size": a.size, "args": vars(a), **machine(a.device),
              "answer_words": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
              "versions": versions(), "attention": attention_of(a),
              "use_no_sync_for_gradient_accumulation": False if a.use_no_sync is None else a.use_no_sync}
    runs, finished = run_all(lambda n: run_engine(a, work, n), names, work / RESULT, result)
    checks: dict = {"every run finished": finished}
    if {"stock", "odc"} <= runs.keys():
        stock, odc = runs["stock"], runs["odc"]
        result["compare"] = {"losses": close(odc["losses"], stock["losses"], a.rtol),
                             "grad_norms": close(odc["grad_norms"], stock["grad_norms"], a.rtol)}
        if {"stock_straggler", "odc_straggler"} <= runs.keys():
            result["compare"]["losses_straggler"] = close(runs["odc_straggler"]["losses"],
                                                          runs["stock_straggler"]["losses"], a.rtol)
        if "odc_dynamic" in runs:
            result["compare"]["losses_dynamic"] = close(runs["odc_dynamic"]["losses"], stock["losses"], a.rtol)
        result["summary"] = {}
        for engine, suffix in (("odc", ""), ("odc_dynamic", "_dynamic")):
            for tag in ("", "_straggler"):
                s_run, o_run = runs.get("stock" + tag), runs.get(engine + tag)
                if s_run and o_run and s_run["tokens_per_s"] and o_run["tokens_per_s"]:
                    result["summary"]["speedup_vs_stock" + suffix + tag] = o_run["tokens_per_s"] / s_run["tokens_per_s"]
                    result["summary"]["peak_memory_ratio" + suffix + tag] = (
                        _peak(o_run) / _peak(s_run) if _peak(s_run) else None)
                    result["summary"].update(memory_summary(s_run, o_run, suffix + tag))
        result["summary"]["mfu_stock"] = stock.get("mfu_timed_mean")
        result["summary"]["mfu_odc"] = odc.get("mfu_timed_mean")
        if "stock_nosync" in runs and odc["tokens_per_s"] and runs["stock_nosync"]["tokens_per_s"]:
            result["summary"]["speedup_vs_stock_nosync"] = odc["tokens_per_s"] / runs["stock_nosync"]["tokens_per_s"]
        counts = [[x[0] if isinstance(x, list) else x for x in step] for step in odc["microbatches_per_rank"] if step]
        checks.update(engine_checks(result["compare"], odc, a.nproc, counts))
        if "stock_straggler" in runs:
            checks.update(within_own_spread(result["compare"], checks, stock, runs["stock_straggler"], a.rtol))
        if "losses_straggler" in result["compare"]:
            checks["losses equal with the straggler"] = (result["compare"]["losses_straggler"]["equal"],
                                                         str(result["compare"]["losses_straggler"]))
    return finish(work / RESULT, result, checks, runs)


def engine_checks(compared: dict, odc: dict, nproc: int, counts: list[list[int]]) -> dict:
    """The checks of a stock-vs-odc comparison (verl_sft.py, verl_actor_update.py): losses and
    gradient norms equal, odc carried the FSDP collectives in decoupled mode on every rank, and
    in some step the ranks ran different numbers of microbatches (``counts``: per step, per rank)."""
    per_rank = odc["odc_counters_per_rank"]
    return {
        "losses equal": (compared["losses"]["equal"], str(compared["losses"])),
        "gradient norms equal": (compared["grad_norms"]["equal"], str(compared["grad_norms"])),
        "odc carried the FSDP collectives": (
            len(per_rank) == nproc and all(c.get("decoupled_gets", 0) > 0 and c.get("decoupled_syncs", 0) > 0
                                           for c in per_rank),
            f"decoupled gets / syncs per rank: {[(c.get('decoupled_gets'), c.get('decoupled_syncs')) for c in per_rank]}"),
        "ranks ran their own microbatch counts": (
            any(len(set(step)) > 1 for step in counts), f"microbatches per rank per step: {counts}"),
    }


def run_all(run, names: list[str], path: Path, result: dict) -> tuple[dict, tuple[bool, str]]:
    """``run(name)`` for every engine in turn; a run that fails is recorded with its error and
    the next one still runs. What has run so far is written to ``path`` after each run
    (``"partial": true``), so a comparison cut short still leaves its finished runs. Sets
    ``result["runs"]`` (every run); returns the runs that finished and the check that all did."""
    runs: dict = {}
    for name in names:
        try:
            runs[name] = run(name)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            runs[name] = {"error": str(e)[-3000:]}
            print(f"{name}: failed: {str(e)[-500:]}", file=sys.stderr)
        path.write_text(dumps(dict(result, runs=runs, partial=True)))
    result["runs"] = runs
    bad = sorted(n for n, r in runs.items() if "error" in r)
    return {n: r for n, r in runs.items() if n not in bad}, (not bad, f"failed: {bad}" if bad else "all")


def machine(device: str) -> dict:
    """Where and from what the comparison ran: GPU name and count, date, the project's commit
    (the benchmarks' ``git_commit``: ``ODC_COMMIT`` where the tree has no .git)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _meta import git_commit

    commit, dirty = git_commit()
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit, "commit_dirty": dirty}
    if device == "cuda":  # from nvidia-smi: a CUDA context here would take memory on the first GPU
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            out["gpu"], out["gpus"] = (names[0] if names else None), len(names)
        except (OSError, subprocess.SubprocessError):
            out["gpu"] = out["gpus"] = None
    return out


def dumps(result: dict) -> str:
    """JSON indented by one space, each list of plain values on one line (per-step series)."""
    import re

    text = json.dumps(result, indent=1)
    return re.sub(r"\[\n\s*([^\[\]{}]*?)\n\s*\]",
                  lambda m: "[" + " ".join(x.strip() for x in m.group(1).split("\n")) + "]", text)


def finish(path: Path, result: dict, checks: dict, runs: dict) -> int:
    """Write the result with its checks, print them, the runs' losses and tokens/s and the
    verdict; the exit status (0: every check passed)."""
    result["checks"] = {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()}
    path.write_text(dumps(result))
    for k, (ok, d) in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {k}: {d}")
    print(json.dumps({"runs": {n: {"losses": r["losses"], "tokens_per_s": r["tokens_per_s"]} for n, r in runs.items()},
                      "summary": result.get("summary")}, indent=1))
    passed = bool(checks) and all(ok for ok, _ in checks.values())
    print(f"VERDICT: {'PASS' if passed else 'FAIL'} ({sum(ok for ok, _ in checks.values())}/{len(checks)} checks)")
    return 0 if passed else 1


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "verl", "transformers", "tensordict"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="stock and odc runs of verl's SFT trainer, compared")
    c.add_argument("--work", required=True)
    c.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    c.add_argument("--nproc", type=int, default=2)
    c.add_argument("--size", choices=sorted(SIZES), default="tiny")
    c.add_argument("--engines", default="stock,odc",
                   help="runs: stock (verl's engine), odc (LB-Mini), odc_dynamic (ODC_VERL_BALANCE=dynamic), "
                        "odc_off (odc's setting, ODC_VERL_ROLES=none)")
    c.add_argument("--steps", type=int, default=5)
    c.add_argument("--warmup", type=int, default=1, help="steps left out of the timing")
    c.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (all ranks)")
    c.add_argument("--rows", type=int, default=256, help="conversations in the data set")
    c.add_argument("--max-words", type=int, default=200, help="the longest answer, in words")
    c.add_argument("--max-tokens", type=int, default=512, help="verl's max_token_len_per_gpu (and max_length)")
    c.add_argument("--lora-rank", type=int, default=0, help="verl's model.lora_rank (0: no LoRA)")
    c.add_argument("--lora-alpha", type=int, default=0, help="verl's model.lora_alpha (0: the rank)")
    c.add_argument("--sp", type=int, default=1, help="verl's engine.ulysses_sequence_parallel_size")
    c.add_argument("--offload", action="store_true", help="verl's engine.param_offload and optimizer_offload")
    c.add_argument("--use-no-sync", action=argparse.BooleanOptionalAction, default=None,
                   help="verl's engine.use_no_sync_for_gradient_accumulation (unset: verl's default, false)")
    c.add_argument("--fsdp-size", type=int, default=-1,
                   help="verl's engine.fsdp_size: ranks per shard group (HSDP below --nproc; -1: all)")
    c.add_argument("--lr", type=float, default=1e-3)
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--rtol", type=float, default=1e-5)
    c.add_argument("--straggler", default=None,
                   help="RANK:FACTOR (e.g. 3:1.3: that rank's decoder layers' GPU time) or RANK:FACTOR:host "
                        "(its host: for steps bound by the host)")
    c.add_argument("--entry", default=None, help="a torchrun entry point instead of verl's module (CPU)")
    c.add_argument("--timeout", type=float, default=1800)
    g = sub.add_parser("plot", help="draw a result (this recipe's or verl_actor_update.py's) as a PNG beside it")
    g.add_argument("result")
    a = p.parse_args(argv)
    return plot(Path(a.result)) if a.cmd == "plot" else compare(a)


def plot(path: Path) -> int:
    """Tokens/s of each run and its losses per step, in ``path`` with the suffix .png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    runs = {n: r for n, r in result["runs"].items() if "error" not in r}
    fig, (speed, loss) = plt.subplots(1, 2, figsize=(11, 4))
    speed.barh(list(runs), [r["tokens_per_s"] or 0 for r in runs.values()], color="tab:blue")
    speed.set_xlabel("tokens/s (timed steps)")
    for name, run in runs.items():
        loss.plot(range(1, len(run["losses"]) + 1), run["losses"], marker=".", label=name)
    loss.set_xlabel("step")
    loss.set_ylabel("loss")
    loss.legend()
    where = f"{result.get('gpus') or result['nproc']} x {result.get('gpu') or result['device']}"
    fig.suptitle(f"{path.stem}: {where}, {result['size']}, commit {str(result.get('commit'))[:10]}, "
                 f"{str(result.get('date'))[:10]}", fontsize=9)
    fig.tight_layout()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _png import save_png  # 64 colours: the results folder stays small

    save_png(fig, path.with_suffix(".png"), dpi=60)
    print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
