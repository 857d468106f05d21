"""verl's RL actor update (``ActorRolloutRefWorker.update_actor``: ``engine.train_batch`` with
``ppo_loss`` per minibatch) on the odc engine (``import torch_odc_backend.verl``) against verl's
own FSDP2 engine (examples/recipes/verl_actor_update.py compare), fed the same synthetic
rollouts, on CPU ranks through tests/integrations/verl_cpu_shim/sft_cpu.py's CPU platform:
equal per-optimizer-step losses, policy-gradient losses and gradient norms (within 1e-5), the
ranks of the odc run ran different numbers of microbatches, and odc carried the FSDP
collectives in decoupled mode.

verl runs in its own environment (tests/integrations/verl_env.py).
"""
from __future__ import annotations

import pytest

from verl_env import compare_on_cpu, needs_verl

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
    counts = result["runs"]["odc"]["microbatches_per_rank"]
    assert len(counts) == STEPS * MINIBATCHES and all(len(step) == 2 for step in counts), counts
    assert any(len(set(step)) > 1 for step in counts), counts  # LB-Mini, not equal counts


def test_odc_carried_the_collectives_decoupled(result):
    assert result["checks"]["odc carried the FSDP collectives"]["ok"], result["checks"]
    for rank in result["runs"]["odc"]["odc_stats"]:  # one odc group, not the default one: verl's
        groups = rank["groups"]                       # world group stays as verl made it
        assert len(groups) == 1 and not groups[0]["default"] and groups[0]["size"] == 2, groups
        assert groups[0]["stats"]["decoupled_syncs"] == STEPS * MINIBATCHES, groups  # one per optimizer step
