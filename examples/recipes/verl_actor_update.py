#!/usr/bin/env python3
"""verl's RL actor (or critic) update on the odc engine against verl's own FSDP2 engine, fed
rollouts made beforehand (no rollout engine): the same model, rollouts and settings; the odc run
adds only ``import torch_odc_backend.verl`` (what ``model.external_lib=torch_odc_backend.verl`` does).

    python examples/recipes/verl_actor_update.py compare --work DIR [--device cuda] [--nproc 4]
        [--size 0.5b] [--steps 4] [--prompts 16] [--rollout-n 4] [--minibatches 1] [--role critic]
        [--log-probs]

Needs verl (docs/trainers.md gives the versions). ``compare`` writes a tokenizer and a Qwen2
model of random weights (``--size``, examples/recipes/verl_sft.py's) into DIR and runs this
file's ``worker`` under torchrun once per engine. Every rank builds the actor as verl's
``ActorRolloutRefWorker(role="actor").init_model()`` does, from verl's own PPO trainer config
(``ppo_trainer.yaml``, with the overrides of :func:`overrides`), then, for each of ``--steps``
rollout batches, does what verl's PPO trainer does with one (``RayPPOTrainer._balance_batch``,
``_update_actor``, the ``update_actor`` dispatch): reorder it over the data-parallel ranks,
convert it to verl's no-padding layout, chunk it over the ranks, and call the worker's
``update_actor`` (``TrainingWorker.train_mini_batch``: per minibatch ``engine.train_batch``
with ``ppo_loss``, one optimizer step). The rollouts are synthetic and the same on every rank
(seeded by ``--seed`` and the step): ``--prompts`` prompts of ``--rollout-n`` responses each, response
lengths long-tailed (Pareto), GRPO advantages (verl's ``compute_grpo_outcome_advantage``) of
outcome rewards of 1 for the longer half of each group, old log-probs near a random model's.

``--log-probs`` (actor): the old log-probs are the actor's own instead, computed before each
update as verl's PPO trainer computes them (``RayPPOTrainer._compute_old_log_prob``, GRPO's
default: the rollout correction's bypass mode off): the balanced batch in the no-padding layout,
chunked over the data-parallel ranks, the worker's ``compute_log_prob`` (``TrainingWorker.infer_batch``:
a forward-only pass under the engine's eval mode, whose entry loads and exit offloads the model
with ``param_offload``), the ranks' log-probs gathered and padded again, then the update. With
``--offload`` each step thus runs load, forward-only pass, offload, load, update, offload. The
result then holds each step's mean old log-prob (over response tokens) of both runs, compared.

``--role critic`` updates verl's critic instead, built as verl's PPO trainer builds it with the
engine workers (``RayPPOTrainer.init_workers``: a ``TrainingWorker`` of model type
``value_model`` from the config's ``critic`` section, its loss ``value_loss``), and does what
the trainer does with a batch (``_update_critic``: the worker's ``train_mini_batch``, one
optimizer step per minibatch), on the same rollouts with old values near zero and returns of
verl's GAE (``compute_gae_advantage_return``, ``gamma = lam = 1``: each response token's return
is the outcome reward). The loss metric compared beside ``loss`` is then ``critic/vf_loss``. verl 0.9.1 loads the critic's model with
``attn_implementation="flash_attention_2"`` whatever the config says
(``verl.utils.model.load_valuehead_model``), so ``--role critic`` needs flash-attn installed,
on GPUs and on CPU alike.

It writes ``DIR/verl_actor_update_result.json``: per optimizer step the loss (verl's ``loss``
metric: the sum of the microbatch losses, averaged over the data-parallel ranks) and gradient
norm of both runs, update times and tokens/s (after ``--warmup`` steps), the per-rank
microbatch counts of the odc run, what odc carried (``ODC_STATS_DIR``), and the checks (losses
and gradient norms equal within ``--rtol``, odc carried the data-parallel collectives, ranks'
microbatch counts differed), then a ``VERDICT`` line (the critic's: ``verl_critic_update_result.json``).

verl has no CPU engine: on CPU pass ``--entry tests/integrations/verl_cpu_shim/sft_cpu.py``;
every rank imports it first (it registers a CPU platform, chosen by ``VERL_PLATFORM=cpu``) and
registers verl's own FSDP engines for the CPU. On GPUs both runs attend with PyTorch's
variable-length flash attention (examples/recipes/verl_varlen_attention.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_sft import (GPU_ENV, SIZES, close, engine_checks, finish, launch, machine,  # noqa: E402
                      make_model, make_tokenizer, read_odc_stats, run_all, versions)

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RESULT = "verl_actor_update_result.json"
RESULTS = {"actor": RESULT, "critic": "verl_critic_update_result.json"}
# per role: the loss function's own metrics, as (result key, verl's metric)
ROLE_METRICS = {"actor": (("pg_losses", "actor/pg_loss"), ("pg_clipfracs", "actor/pg_clipfrac")),
                "critic": (("vf_losses", "critic/vf_loss"), ("vf_clipfracs", "critic/vf_clipfrac"))}


# ---- the rollouts, made beforehand

def rollouts(a, step: int, pad_id: int, vocab: int):
    """One step's rollout batch as verl's PPO trainer holds it before the actor update (padded:
    prompts left-padded, responses right-padded), the same on every rank: ``a.prompts`` prompts
    of ``a.rollout_n`` responses each (a GRPO group), response lengths long-tailed."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rng = random.Random(a.seed * 1000003 + step)
    gen = torch.Generator().manual_seed(a.seed * 1000003 + step)
    rows = a.prompts * a.rollout_n
    p_lens = [n for n in (rng.randint(4, a.max_prompt) for _ in range(a.prompts)) for _ in range(a.rollout_n)]
    r_lens = [min(a.max_response, int(rng.paretovariate(1.2) * a.max_response / 40) + 4) for _ in range(rows)]
    P, R = a.max_prompt, a.max_response
    prompts = torch.full((rows, P), pad_id, dtype=torch.long)
    responses = torch.full((rows, R), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, P + R, dtype=torch.long)
    for i in range(rows):
        ids = torch.randint(3, vocab, (p_lens[i] + r_lens[i],), generator=gen)
        if i % a.rollout_n == 0:  # the group shares its prompt
            prompt = ids[:p_lens[i]]
        prompts[i, P - p_lens[i]:] = prompt
        responses[i, :r_lens[i]] = ids[p_lens[i]:]
        mask[i, P - p_lens[i]:P + r_lens[i]] = 1
    response_mask = mask[:, P:]
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    # an outcome reward (on the last response token) of 1 for the longer half of each group: the
    # token-mean loss is then well away from 0 (relative differences mean something); old
    # log-probs near a random model's (-log V)
    rewards = torch.zeros(rows, R)
    medians = [sorted(r_lens[g:g + a.rollout_n])[(a.rollout_n - 1) // 2] for g in range(0, rows, a.rollout_n)]
    scores = torch.tensor([float(n > medians[i // a.rollout_n]) for i, n in enumerate(r_lens)])
    rewards[torch.arange(rows), torch.tensor(r_lens) - 1] = scores
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=response_mask,
        index=np.array([i // a.rollout_n for i in range(rows)], dtype=object))
    old_log_probs = (-math.log(vocab) + 0.1 * torch.randn(rows, R, generator=gen)) * response_mask.float()
    extra = {}
    if a.role == "critic":
        # old values near zero (a fresh value head's); returns and advantages of verl's GAE with
        # the trainer's defaults (algorithm.gamma = lam = 1): the outcome reward on every token
        from verl.trainer.ppo.core_algos import compute_gae_advantage_return

        values = 0.05 * torch.randn(rows, R, generator=gen) * response_mask.float()
        advantages, returns = compute_gae_advantage_return(
            token_level_rewards=rewards, values=values, response_mask=response_mask, gamma=1.0, lam=1.0)
        extra = {"values": values}
    return {**extra, "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask, "position_ids": position_ids, "response_mask": response_mask,
            "old_log_probs": old_log_probs, "advantages": advantages, "returns": returns,
            "token_level_rewards": rewards}


def balance(batch: dict, dp: int) -> dict:
    """``RayPPOTrainer._balance_batch`` (``trainer.balance_batch=True``, verl's default): reorder
    the batch so that each data-parallel rank's chunk has about the same workload."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    seqlens = batch["attention_mask"].sum(-1)
    workload = calculate_workload(seqlens)
    parts = get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
    for i, part in enumerate(parts):
        part.sort(key=lambda x: (workload[x], x))
        parts[i] = part[::2] + part[1::2][::-1]
    order = torch.tensor([j for part in parts for j in part])
    return {k: v[order] for k, v in batch.items()}


def update_batch(a, batch: dict, rank: int, dp: int):
    """This rank's part of the batch as ``RayPPOTrainer._update_actor`` (``_update_critic``)
    hands it to the workers: verl's no-padding layout with the trainer's settings, chunked over
    the data-parallel ranks as the ``update_actor`` (``train_mini_batch``) dispatch chunks it."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = TensorDict(dict(batch), batch_size=[batch["input_ids"].shape[0]])
    tu.assign_non_tensor(td, temperature=1.0, multi_turn=False)  # the trainer's meta_info
    td = left_right_2_no_padding(td)
    mini = a.prompts // a.minibatches * a.rollout_n  # ppo_mini_batch_size * rollout.n
    if a.role == "critic":  # _update_critic's (critic.data_loader_seed, .shuffle)
        tu.assign_non_tensor(td, global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=42,
                             dataloader_kwargs={"shuffle": False})
    else:
        tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=42,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True)
    return chunk_of(td, rank, dp)


def chunk_of(td, rank: int, dp: int):
    """This rank's chunk of ``td`` as the workers' dispatch (``make_nd_compute_dataproto_dispatch_fn``)
    chunks it over the data-parallel ranks."""
    from verl.protocol import BatchData

    # Ray hands each worker its chunk serialised: a copy of its own, not a (locked) view
    return pickle.loads(pickle.dumps(BatchData(td).chunk(chunks=dp)[rank]))


def actor_log_probs(actor, batch: dict, rank: int, dp: int):
    """The actor's log-probs of the batch's responses, padded, ``(rows, max_response)``, as
    ``RayPPOTrainer._compute_old_log_prob`` gets them: the batch in verl's no-padding layout with
    the trainer's meta_info, this rank's chunk through the worker's ``compute_log_prob`` (a
    forward-only pass, ``TrainingWorker.infer_batch``), the outputs of the data-parallel ranks
    (of each SP group's first rank) gathered in rank order, as the dispatch collects them."""
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    rows = batch["input_ids"].shape[0]
    td = TensorDict({k: v for k, v in batch.items() if k != "old_log_probs"}, batch_size=[rows])
    tu.assign_non_tensor(td, temperature=1.0, multi_turn=False,
                         global_token_num=batch["attention_mask"].sum(-1).tolist())
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    mine = chunk_of(td, rank, dp)
    out = actor.compute_log_prob(mine)
    part = None if out is None else no_padding_2_padding(tu.get(out, "log_probs"), mine).float()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rank, part))
    parts = {r: p for r, p in everyone if p is not None}
    log_probs = torch.cat([parts[r] for r in range(dp)])
    assert log_probs.shape == batch["response_mask"].shape, (log_probs.shape, batch["response_mask"].shape)
    return log_probs


# ---- one rank of one run

def overrides(a, work: Path) -> list[str]:
    """verl's PPO trainer config overrides (the same for both engines)."""
    cpu = a.device == "cpu"
    attention = attention_of(a)
    ar = "actor_rollout_ref"
    o = [f"{ar}.model.path={work / 'model'}", f"+{ar}.model.override_config.attn_implementation={attention}",
         f"{ar}.model.use_remove_padding=True", f"{ar}.model.enable_gradient_checkpointing={not cpu}",
         f"{ar}.actor.strategy=fsdp2", f"{ar}.actor.use_torch_compile=False",
         f"{ar}.actor.fsdp_config.use_torch_compile=False",
         f"{ar}.actor.optim.lr={a.lr}", f"{ar}.actor.optim.total_training_steps={a.steps * a.minibatches}",
         f"{ar}.actor.ppo_mini_batch_size={a.prompts // a.minibatches}", f"{ar}.rollout.n={a.rollout_n}",
         f"{ar}.actor.use_dynamic_bsz=True", f"{ar}.actor.ppo_max_token_len_per_gpu={a.max_tokens}",
         f"{ar}.rollout.log_prob_use_dynamic_bsz=True",
         f"{ar}.rollout.log_prob_max_token_len_per_gpu={a.max_tokens}",
         f"{ar}.actor.loss_agg_mode={a.loss_agg_mode}", f"{ar}.actor.fsdp_config.seed={a.seed}"]
    if cpu:  # fp32 throughout: the comparison is then reassociation alone
        o += [f"{ar}.actor.fsdp_config.model_dtype=fp32",
              *(f"+{ar}.actor.fsdp_config.mixed_precision.{k}_dtype=fp32" for k in ("param", "reduce", "buffer"))]
    o += feature_overrides(a, f"{ar}.model", f"{ar}.actor.fsdp_config")
    if a.sp > 1:  # the actor section's own copy of the setting, which the worker reads too
        o.append(f"{ar}.actor.ulysses_sequence_parallel_size={a.sp}")
    if a.role == "critic":
        o += critic_overrides(a, work)
    return o


def attention_of(a) -> str:
    """The attention implementation of both runs. GPUs: PyTorch's variable-length flash
    attention (verl_varlen_attention.py: no flash-attn needed), or with sequence parallelism
    flash-attn's, where verl puts its Ulysses all-to-alls. CPU: SDPA, or with sequence
    parallelism the CPU shim's Ulysses attention (verl's all-to-alls around SDPA)."""
    if a.device == "cpu":
        return "cpu_ulysses" if a.sp > 1 else "sdpa"
    return "flash_attention_2" if a.sp > 1 else "odc_varlen"


def feature_overrides(a, model: str, engine: str) -> list[str]:
    """LoRA, Ulysses sequence parallelism, parameter and optimizer offload and verl's
    no-sync gradient accumulation (``model``, ``engine``: the config sections)."""
    o = []
    if a.lora_rank:
        o += [f"{model}.lora_rank={a.lora_rank}", f"{model}.lora_alpha={a.lora_alpha or a.lora_rank}",
              f"{model}.target_modules=all-linear"]
    if a.sp > 1:
        o.append(f"{engine}.ulysses_sequence_parallel_size={a.sp}")
    if a.offload:
        o += [f"{engine}.param_offload=True", f"{engine}.optimizer_offload=True"]
    if a.use_no_sync is not None:
        o.append(f"{engine}.use_no_sync_for_gradient_accumulation={a.use_no_sync}")
    return o


def critic_overrides(a, work: Path) -> list[str]:
    """The ``critic`` section's overrides: the actor's settings, for the critic."""
    cpu = a.device == "cpu"
    attention = attention_of(a)
    o = [f"critic.model.path={work / 'model'}", f"+critic.model.override_config.attn_implementation={attention}",
         "critic.model.use_remove_padding=True", f"critic.model.enable_gradient_checkpointing={not cpu}",
         "critic.strategy=fsdp2", "critic.fsdp.use_torch_compile=False",
         f"critic.optim.lr={a.lr}", f"critic.optim.total_training_steps={a.steps * a.minibatches}",
         f"critic.ppo_mini_batch_size={a.prompts // a.minibatches}",
         "critic.use_dynamic_bsz=True", f"critic.ppo_max_token_len_per_gpu={a.max_tokens}", "critic.shuffle=False",
         f"critic.loss_agg_mode={a.loss_agg_mode}", f"critic.fsdp.seed={a.seed}"]
    if cpu:
        o += ["critic.fsdp.model_dtype=fp32",
              *(f"+critic.fsdp.mixed_precision.{k}_dtype=fp32" for k in ("param", "reduce", "buffer"))]
    return o


def load_cpu_shim(path: str):
    """Import the CPU shim (it registers verl's "cpu" platform) and register verl's own FSDP
    engines for the CPU with it; returns the shim."""
    import importlib.util

    os.environ.setdefault("VERL_PLATFORM", "cpu")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.register_verl_engines()
    return module


def build_critic(cfg):
    """verl's critic as ``RayPPOTrainer.init_workers`` builds it with the engine workers: a
    ``TrainingWorker`` of model type ``value_model`` from the ``critic`` section, reset (the
    engine initialised), its loss ``value_loss``."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import value_loss

    critic_cfg = omega_conf_to_dataclass(cfg.critic)
    engine_config = critic_cfg.engine
    engine_config.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    engine_config.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
    profiler = cfg.critic.get("profiler", {})
    critic = TrainingWorker(config=TrainingWorkerConfig(
        model_type="value_model", model_config=critic_cfg.model, engine_config=engine_config,
        optimizer_config=critic_cfg.optim, checkpoint_config=critic_cfg.checkpoint,
        profiler_config=omega_conf_to_dataclass(profiler) if profiler else None, extra_context={}))
    critic.reset()
    critic.set_loss_fn(partial(value_loss, config=critic_cfg))
    return critic


def worker(a) -> int:
    shim = load_cpu_shim(a.entry) if a.device == "cpu" else None
    import torch
    import torch.distributed as dist

    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend="cpu:gloo" if a.device == "cpu" else "cpu:gloo,cuda:nccl",
                            timeout=timedelta(seconds=600))
    if a.device == "cuda":
        import verl_varlen_attention  # noqa: F401  (registers the "odc_varlen" attention)
    if a.engine == "odc":
        import torch_odc_backend.verl  # noqa: F401  (registers the odc engines for verl's platform)
    if shim is not None and a.offload:
        # on the CPU an offload moves nothing: the shim's engines give the parameters and the
        # optimizer state new storage in every move instead, as a GPU offload does
        shim.register_storage_moving_engines(odc=a.engine == "odc")
        os.environ["VERL_ENGINE_VENDOR"] = shim.MOVES_STORAGE
    import verl
    from hydra import compose, initialize_config_dir
    from verl.workers.engine_workers import ActorRolloutRefWorker

    work = Path(a.work)
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides(a, work))
    # what the checkpoint lacks (the critic's value head ``score``, LoRA's A matrices) is
    # initialised from torch's global random state, which verl leaves unseeded (it differs
    # between runs); seeded, both runs start from the same model
    torch.manual_seed(a.seed)
    if a.role == "critic":
        trainer = build_critic(cfg)
        update, model_config = trainer.train_mini_batch, trainer.model_config
    else:
        actor = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
        actor.init_model()
        trainer, update, model_config = actor.actor, actor.update_actor, actor.actor.model_config
    rank, dp = trainer.engine.get_data_parallel_rank(), trainer.engine.get_data_parallel_size()
    tok = model_config.tokenizer
    vocab = min(len(tok), model_config.hf_config.vocab_size)

    steps = []
    for step in range(a.steps):
        batch = rollouts(a, step, tok.pad_token_id, vocab)
        tokens = int(batch["attention_mask"].sum())
        if a.balance_batch:
            batch = balance(batch, dp)
        extra = {}
        if a.log_probs:  # the trainer's old log-probs: the actor's own, a forward-only pass
            dist.barrier()
            t0 = time.perf_counter()
            batch["old_log_probs"] = actor_log_probs(actor, batch, rank, dp)
            mask = batch["response_mask"].float()
            extra = {"log_prob_s": time.perf_counter() - t0,
                     "old_log_prob_mean": float((batch["old_log_probs"] * mask).sum() / mask.sum())}
        data = update_batch(a, batch, rank, dp)
        dist.barrier()
        t0 = time.perf_counter()
        out = update(data)
        dist.barrier()
        dt = time.perf_counter() - t0
        if dist.get_rank() == 0:
            from verl.utils import tensordict_utils as tu

            m = tu.get(out, "metrics")
            steps.append({"step": step, "update_s": dt, "tokens": tokens, "engine": type(trainer.engine).__name__,
                          **extra, "metrics": {k: _plain(v) for k, v in m.items()}})
            print(f"step {step}: loss {m['loss']} grad_norm {m['grad_norm']} {dt:.2f}s", flush=True)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(steps, indent=1))
    dist.destroy_process_group()
    return 0


def _plain(v):
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if hasattr(v, "item"):
        return v.item()
    if hasattr(v, "value"):  # verl's Metric
        return _plain(v.value)
    return v


# ---- the comparison

def run_engine(a, work: Path, name: str) -> dict:
    tag = name if a.role == "actor" else f"{a.role}_{name}"
    out, stats = work / f"{tag}_steps.json", work / f"{tag}_odc_stats"
    out.unlink(missing_ok=True)
    env = dict(os.environ, **GPU_ENV, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", ODC_STATS_DIR=str(stats))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if a.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
        env["VERL_PLATFORM"] = "cpu"
    if name == "odc_dynamic":  # ranks (SP groups) claim microbatches as they become free
        env["ODC_VERL_BALANCE"] = "dynamic"
    args = ["worker", "--engine", "stock" if name == "stock" else "odc", "--out", str(out)]
    for k, v in vars(a).items():
        if k not in ("cmd", "engines", "rtol", "timeout", "warmup", "nproc") and v is not None:
            if isinstance(v, bool):
                args += [f"--{k.replace('_', '-')}"] if v else [f"--no-{k.replace('_', '-')}"]
            else:
                args += [f"--{k.replace('_', '-')}", str(Path(v).resolve()) if k in ("work", "entry") else str(v)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           str(Path(__file__).resolve()), *args]
    log = work / f"{tag}.log"
    t0 = time.time()
    returncode = launch(cmd, env, log, a.timeout)
    if returncode != 0 or not out.exists():
        raise RuntimeError(f"{name}: exited with {returncode}; log {log}:\n{log.read_text()[-6000:]}")
    steps = json.loads(out.read_text())
    timed = [s for s in steps if s["step"] >= a.warmup]
    run = {"losses": [x for s in steps for x in _list(s["metrics"]["loss"])],
           "grad_norms": [x for s in steps for x in _list(s["metrics"]["grad_norm"])],
           "microbatches_per_rank": [c for s in steps for c in _per_rank(s["metrics"].get("odc/microbatches"), a.nproc // a.sp)
                                     or [None] * len(_list(s["metrics"]["loss"]))],
           "update_s": [s["update_s"] for s in steps], "tokens": [s["tokens"] for s in steps],
           "tokens_per_s": (sum(s["tokens"] for s in timed) / sum(s["update_s"] for s in timed)) if timed else None,
           **{key: [x for s in steps for x in _list(s["metrics"].get(metric))] for key, metric in ROLE_METRICS[a.role]},
           "engine_class": steps[0].get("engine") if steps else None, "wall_s": time.time() - t0, "log": str(log)}
    if a.log_probs:
        run.update(old_log_prob_means=[s["old_log_prob_mean"] for s in steps],
                   ppo_kls=[x for s in steps for x in _list(s["metrics"].get("actor/ppo_kl"))],
                   log_prob_s=[s["log_prob_s"] for s in steps])
    return dict(run, **read_odc_stats(stats))


def _per_rank(counts, dp: int) -> list:
    """odc's per-rank microbatch counts of a step, per optimizer step: verl flattens them into
    one list (the data-parallel ranks' counts of the first minibatch, then of the second, ...;
    with sequence parallelism one per SP group)."""
    if counts is None:
        return []
    return [counts[i:i + dp] for i in range(0, len(counts), dp)]


def _list(v):
    """A per-step metric as a list over the step's minibatches (verl appends one per minibatch)."""
    return [None] if v is None else v if isinstance(v, list) else [v]


def compare(a) -> int:
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(work / "model")
    make_model(work / "model", a.size, tok)
    result = {"device": a.device, "nproc": a.nproc, "size": a.size, "role": a.role, "args": vars(a),
              **machine(a.device), "versions": versions()}
    runs, finished = run_all(lambda n: run_engine(a, work, n), a.engines.split(","), work / RESULTS[a.role],
                             result)
    checks = {"every run finished": finished}
    if {"stock", "odc"} <= runs.keys():
        stock, odc = runs["stock"], runs["odc"]
        own = ROLE_METRICS[a.role][0][0]  # the loss function's own loss metric (pg_losses, vf_losses)
        result["compare"] = {"losses": close(odc["losses"], stock["losses"], a.rtol),
                             "grad_norms": close(odc["grad_norms"], stock["grad_norms"], a.rtol),
                             own: close(odc[own], stock[own], a.rtol)}
        if stock["tokens_per_s"] and odc["tokens_per_s"]:
            result["summary"] = {"speedup_vs_stock": odc["tokens_per_s"] / stock["tokens_per_s"]}
        if a.log_probs:  # the actor's own old log-probs (the forward-only passes) agree too
            result["compare"]["old_log_prob_means"] = close(odc["old_log_prob_means"], stock["old_log_prob_means"],
                                                            a.rtol)
            checks["old log-probs equal"] = (result["compare"]["old_log_prob_means"]["equal"],
                                             str(result["compare"]["old_log_prob_means"]))
        counts = [c for c in odc["microbatches_per_rank"] if c]
        checks.update(engine_checks(result["compare"], odc, a.nproc, counts))
        checks[f"{'policy' if a.role == 'actor' else 'value'} losses equal"] = (
            result["compare"][own]["equal"], str(result["compare"][own]))
        if "odc_dynamic" in runs:
            dynamic = runs["odc_dynamic"]
            for key in ("losses", "grad_norms"):
                result["compare"][f"{key}_dynamic"] = close(dynamic[key], stock[key], a.rtol)
                checks[f"dynamic balancing: {key.replace('_', ' ')} equal"] = (
                    result["compare"][f"{key}_dynamic"]["equal"], str(result["compare"][f"{key}_dynamic"]))
    return finish(work / RESULTS[a.role], result, checks, runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="stock and odc runs of verl's actor (critic) update, compared")
    w = sub.add_parser("worker", help="one rank of one run (under torchrun; compare starts it)")
    for q in (c, w):
        q.add_argument("--work", required=True)
        q.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
        q.add_argument("--size", choices=sorted(SIZES), default="tiny")
        q.add_argument("--role", choices=("actor", "critic"), default="actor",
                       help="the update: verl's actor (update_actor) or critic (the critic's train_mini_batch)")
        q.add_argument("--steps", type=int, default=4, help="rollout batches (update calls)")
        q.add_argument("--prompts", type=int, default=16, help="prompts per rollout batch (all ranks)")
        q.add_argument("--rollout-n", type=int, default=4, help="responses per prompt (verl's rollout.n)")
        q.add_argument("--minibatches", type=int, default=1, help="optimizer steps per rollout batch")
        q.add_argument("--max-prompt", type=int, default=32, help="the longest prompt, in tokens")
        q.add_argument("--max-response", type=int, default=448, help="the longest response, in tokens")
        q.add_argument("--max-tokens", type=int, default=512, help="verl's ppo_max_token_len_per_gpu")
        q.add_argument("--loss-agg-mode", default="token-mean")
        q.add_argument("--balance-batch", action=argparse.BooleanOptionalAction, default=True,
                       help="verl's trainer.balance_batch (its default: on)")
        q.add_argument("--lora-rank", type=int, default=0, help="verl's model.lora_rank (0: no LoRA)")
        q.add_argument("--lora-alpha", type=int, default=0, help="verl's model.lora_alpha (0: the rank)")
        q.add_argument("--sp", type=int, default=1, help="verl's ulysses_sequence_parallel_size")
        q.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False,
                       help="verl's param_offload and optimizer_offload")
        q.add_argument("--log-probs", action=argparse.BooleanOptionalAction, default=False,
                       help="actor: old log-probs from the actor's compute_log_prob before each update "
                            "(verl's PPO trainer), not random ones")
        q.add_argument("--use-no-sync", action=argparse.BooleanOptionalAction, default=None,
                       help="verl's use_no_sync_for_gradient_accumulation (unset: verl's default)")
        q.add_argument("--lr", type=float, default=1e-4)
        q.add_argument("--seed", type=int, default=1)
        q.add_argument("--entry", default=None,
                       help="on CPU: the shim that registers verl's CPU platform (tests/integrations/verl_cpu_shim/sft_cpu.py)")
    c.add_argument("--nproc", type=int, default=2)
    c.add_argument("--engines", default="stock,odc",
                   help="runs: stock (verl's engine), odc (LB-Mini), odc_dynamic (ODC_VERL_BALANCE=dynamic)")
    c.add_argument("--warmup", type=int, default=1, help="steps left out of the timing")
    c.add_argument("--rtol", type=float, default=1e-5)
    c.add_argument("--timeout", type=float, default=1800)
    w.add_argument("--engine", choices=("stock", "odc"), required=True)
    w.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.prompts % a.minibatches:
        p.error("--prompts must be a multiple of --minibatches")
    if a.log_probs and a.role != "actor":
        p.error("--log-probs is the actor's (the critic's old values are made beforehand)")
    if a.device == "cpu" and not a.entry:
        p.error("--device cpu needs --entry (the CPU shim)")
    return compare(a) if a.cmd == "compare" else worker(a)


if __name__ == "__main__":
    sys.exit(main())
