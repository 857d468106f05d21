"""verl's RL actor update (``ActorRolloutRefWorker.update_actor``: ``engine.train_batch`` with
``ppo_loss`` per minibatch) on the odc engine (``import torch_odc_backend.verl``) against verl's
own FSDP2 engine (examples/recipes/verl_actor_update.py compare), fed the same synthetic
rollouts, on CPU ranks through tests/integrations/verl_cpu_shim/sft_cpu.py's CPU platform:
equal per-optimizer-step losses, policy-gradient losses and gradient norms (within 1e-5), the
ranks of the odc run ran different numbers of microbatches, and odc carried the FSDP
collectives in decoupled mode. The same for verl's critic update (``--role critic``: the
critic's ``TrainingWorker.train_mini_batch`` with ``value_loss``, on odc's
``OdcFSDPEngineWithValueHead``), its value losses in place of the policy losses, where
flash-attn is installed: verl 0.9.1 loads the critic's model with flash_attention_2 whatever
the config says, and replacing its loader would patch verl.

verl runs in its own environment (tests/integrations/verl_env.py).
"""
from __future__ import annotations

import pytest

from verl_env import compare_on_cpu, needs_verl, run

STEPS, MINIBATCHES = 3, 2  # rollout batches, optimizer steps per batch

pytestmark = needs_verl


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    # 16 prompts x 4 responses of up to 32 + 448 tokens, 512 tokens a microbatch: the odc run's
    # ranks get 2 or 3 microbatches a minibatch, not always as many as each other
    return compare_on_cpu("verl_actor_update.py", "verl_actor_update_result.json",
                          tmp_path_factory.mktemp("verl_actor_cpu"), "--nproc", "2", "--steps", str(STEPS),
                          "--minibatches", str(MINIBATCHES), "--prompts", "16", "--rollout-n", "4",
                          "--max-prompt", "32", "--max-response", "448", "--max-tokens", "512", "--rtol", "1e-5")


def test_odc_actor_update_equals_verls(result):
    cmp = result["compare"]
    assert cmp["losses"]["steps"] == STEPS * MINIBATCHES and cmp["losses"]["equal"], cmp
    assert cmp["grad_norms"]["equal"], cmp
    assert cmp["pg_losses"]["equal"], cmp  # ppo_loss's own metric, aggregated over ranks by verl
    stock, odc = result["runs"]["stock"], result["runs"]["odc"]
    assert all(abs(x) > 1e-2 for x in stock["losses"]), stock["losses"]  # relative differences mean something
    assert all(c is None for c in stock["microbatches_per_rank"])  # the stock run is verl's engine
    assert not stock["odc_stats"], stock["odc_stats"]
    assert odc["tokens_per_s"] and stock["tokens_per_s"]


def test_ranks_ran_their_own_microbatch_counts(result):
    _check_counts(result)


def test_odc_carried_the_collectives_decoupled(result):
    _check_carried(result)


def _has_flash_attn() -> bool:
    try:
        return run(["-c", "import flash_attn"], timeout=120).returncode == 0
    except OSError:  # no verl environment: needs_verl skips
        return False


needs_flash_attn = pytest.mark.skipif(not _has_flash_attn(), reason=(
    "the verl environment has no flash-attn: verl 0.9.1 loads the critic's model with "
    "flash_attention_2 whatever the config says (load_valuehead_model)"))


@pytest.fixture(scope="module")
def critic_result(tmp_path_factory) -> dict:
    # the actor's rollouts and settings; the critic's microbatches come out as the actor's
    return compare_on_cpu("verl_actor_update.py", "verl_critic_update_result.json",
                          tmp_path_factory.mktemp("verl_critic_cpu"), "--role", "critic", "--nproc", "2",
                          "--steps", str(STEPS), "--minibatches", str(MINIBATCHES), "--prompts", "16",
                          "--rollout-n", "4", "--max-prompt", "32", "--max-response", "448", "--max-tokens", "512",
                          "--rtol", "1e-5")


@needs_flash_attn
def test_critic_update_equals_verls(critic_result):
    assert critic_result["role"] == "critic"
    cmp = critic_result["compare"]
    assert cmp["losses"]["steps"] == STEPS * MINIBATCHES and cmp["losses"]["equal"], cmp
    assert cmp["grad_norms"]["equal"], cmp
    assert cmp["vf_losses"]["equal"], cmp  # value_loss's own metric (critic/vf_loss)
    assert "pg_losses" not in cmp, cmp
    stock, odc = critic_result["runs"]["stock"], critic_result["runs"]["odc"]
    assert all(abs(x) > 1e-2 for x in stock["losses"]), stock["losses"]  # relative differences mean something
    assert len(stock["vf_losses"]) == STEPS * MINIBATCHES, stock["vf_losses"]
    assert all(c is None for c in stock["microbatches_per_rank"])  # the stock run is verl's engine
    assert not stock["odc_stats"], stock["odc_stats"]
    assert odc["tokens_per_s"] and stock["tokens_per_s"]


@needs_flash_attn
def test_critic_ranks_ran_their_own_microbatch_counts(critic_result):
    _check_counts(critic_result)


@needs_flash_attn
def test_critic_odc_carried_the_collectives_decoupled(critic_result):
    _check_carried(critic_result)


def _check_counts(result):
    counts = result["runs"]["odc"]["microbatches_per_rank"]
    assert len(counts) == STEPS * MINIBATCHES and all(len(step) == 2 for step in counts), counts
    assert any(len(set(step)) > 1 for step in counts), counts  # LB-Mini, not equal counts


def _check_carried(result):
    assert result["checks"]["odc carried the FSDP collectives"]["ok"], result["checks"]
    for rank in result["runs"]["odc"]["odc_stats"]:  # one odc group, not the default one: verl's
        groups = rank["groups"]                       # world group stays as verl made it
        assert len(groups) == 1 and not groups[0]["default"] and groups[0]["size"] == 2, groups
        assert groups[0]["stats"]["decoupled_syncs"] == STEPS * MINIBATCHES, groups  # one per optimizer step
