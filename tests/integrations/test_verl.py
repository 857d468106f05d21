"""verl's SFT trainer on the odc engine (``model.external_lib=torch_odc_backend.verl``) against
verl's own FSDP2 engine (examples/recipes/verl_sft.py compare), on CPU ranks through
tests/integrations/verl_cpu_shim/sft_cpu.py: equal per-step losses and gradient norms
(within 1e-5), odc carried the FSDP collectives in decoupled mode, the ranks ran different
numbers of microbatches, also with dynamic balancing (``ODC_VERL_BALANCE=dynamic``); with ``ODC_VERL_ROLES=none`` the same setting leaves verl's engine
in place (bitwise the stock run). Plus the engine's input checks.

verl runs in its own environment (tests/integrations/verl_env.py).
"""
from __future__ import annotations

import json
import re

import pytest

from verl_env import compare_on_cpu, needs_verl, run

pytestmark = needs_verl


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return compare_on_cpu("verl_sft.py", "verl_sft_result.json", tmp_path_factory.mktemp("verl_cpu"),
                          "--engines", "stock,odc,odc_dynamic,odc_off", "--steps", "4", "--batch", "8",
                          "--rows", "64", "--max-words", "150", "--max-tokens", "256")


@pytest.fixture(scope="module")
def hsdp_result(tmp_path_factory) -> dict:
    """4 ranks, verl's engine.fsdp_size=2: a (replicate 2, shard 2) mesh."""
    return compare_on_cpu("verl_sft.py", "verl_sft_result.json", tmp_path_factory.mktemp("verl_hsdp"),
                          "--nproc", "4", "--fsdp-size", "2", "--steps", "3", "--batch", "16", "--rows", "64",
                          "--max-words", "150", "--max-tokens", "256")


def test_hsdp_odc_engine_equals_verls_engine(hsdp_result):
    """With HSDP the odc mesh is 2-D (a replicate and a shard group of odc per rank); decoupled
    mode all-reduces over the replicas in odc.sync; the losses equal verl's engine's."""
    cmp = hsdp_result["compare"]
    assert cmp["losses"]["steps"] == 3 and cmp["losses"]["equal"] and cmp["grad_norms"]["equal"], cmp
    for rank in hsdp_result["runs"]["odc"]["odc_stats"]:
        sizes = sorted(g["size"] for g in rank["groups"])
        assert sizes == [2, 2], rank["groups"]
        shard = [g for g in rank["groups"] if g["stats"].get("decoupled_syncs")]
        assert len(shard) == 1 and shard[0]["stats"]["decoupled_syncs"] == 3, rank["groups"]
    assert hsdp_result["checks"]["ranks ran their own microbatch counts"]["ok"], hsdp_result["checks"]
    # each rank announced its last microbatch: the replicate all-reduces started in its backward
    early = hsdp_result["runs"]["odc"]["early_all_reduces_per_rank"][-1]  # over steps 1-2
    assert early and all((x[0] if isinstance(x, list) else x) > 0 for x in early), early


def test_odc_engine_equals_verls_engine(result):
    cmp = result["compare"]
    assert cmp["losses"]["steps"] == 4 and cmp["losses"]["equal"], cmp
    assert cmp["grad_norms"]["equal"], cmp
    stock, odc = result["runs"]["stock"], result["runs"]["odc"]
    assert odc["losses"][-1] < odc["losses"][0], odc["losses"]  # it trains
    assert all(c is None for c in stock["microbatches_per_rank"])  # the stock run is verl's engine


def test_odc_carried_the_collectives_decoupled(result):
    assert result["checks"]["odc carried the FSDP collectives"]["ok"], result["checks"]
    for rank in result["runs"]["odc"]["odc_stats"]:  # one odc group, not the default one: verl's
        groups = rank["groups"]                       # world group stays as verl made it
        assert len(groups) == 1 and not groups[0]["default"] and groups[0]["size"] == 2, groups


def test_ranks_ran_their_own_microbatch_counts(result):
    counts = result["runs"]["odc"]["microbatches_per_rank"]
    assert len(counts) == 4 and all(len(step) == 2 for step in counts), counts
    assert any(len({tuple(c) for c in step}) > 1 for step in counts), counts  # LB-Mini, not equal counts
    # every step trained every sample once: the loss normalisation saw the whole minibatch
    assert result["checks"]["losses equal"]["ok"]


def test_dynamic_balancing_equals_verls_engine(result):
    """ODC_VERL_BALANCE=dynamic: ranks claim the minibatch's microbatches as they become free;
    every sample is still trained once, so the losses equal verl's engine's."""
    assert result["compare"]["losses_dynamic"]["equal"], result["compare"]
    dyn = result["runs"]["odc_dynamic"]
    assert all(c is not None for c in dyn["microbatches_per_rank"]), dyn["microbatches_per_rank"]
    assert all(c.get("decoupled_syncs", 0) > 0 for c in dyn["odc_counters_per_rank"]), dyn["odc_stats"]


def test_roles_none_leaves_verls_engine(result):
    off, stock = result["runs"]["odc_off"], result["runs"]["stock"]
    assert off["losses"] == stock["losses"] and off["grad_norms"] == stock["grad_norms"]
    assert all(c is None for c in off["microbatches_per_rank"])
    assert not off["odc_stats"], off["odc_stats"]  # no odc group was made


CHECKS = r"""
import json, os
import torch_odc_backend.verl as ov
from torch_odc_backend.verl.minibatch import split_by_owner
from torch_odc_backend.config import verl_roles
out = {"split": split_by_owner([4, 0, 2, 3], [2, 0, 3])}
for what, fn in {"device": lambda: ov.register(device="npu", vendor="x"),
                 "index": lambda: split_by_owner([5], [2, 3])}.items():
    try:
        fn()
        out[what] = None
    except (ValueError, IndexError) as e:
        out[what] = str(e)
from torch_odc_backend.config import verl_balance
from torch_odc_backend.verl.engine import fill_rank_metrics
ranks = [{"pg_loss": ("sum", 1.5), "clip": ("mean", 0.2), "lo": ("min", -1.0)},
         {"pg_loss": ("sum", 0.5), "clip": ("mean", 0.4), "lo": ("min", -3.0)}, {}]
out["filled"] = [fill_rank_metrics(ranks, r) for r in range(3)]
for raw in ("", "dynamic", "greedy"):
    os.environ["ODC_VERL_BALANCE"] = raw
    try:
        out["balance:" + raw] = verl_balance()
    except ValueError as e:
        out["balance:" + raw] = str(e)
for raw in ("", "none", "actor,reference", "actor,policy"):
    os.environ["ODC_VERL_ROLES"] = raw
    try:
        out["roles:" + raw] = sorted(verl_roles())
    except ValueError as e:
        out["roles:" + raw] = str(e)
from types import SimpleNamespace
from torch_odc_backend.verl.engine import _OdcEngine
for what, strategy, balance, ndim in (("fsdp1", "fsdp", "lb_mini", 1), ("dynamic_hsdp", "fsdp2", "dynamic", 2),
                                      ("fine", "fsdp2", "dynamic", 1)):
    engine = SimpleNamespace(engine_config=SimpleNamespace(strategy=strategy), odc_role="actor",
                             odc_balance=balance, device_mesh=SimpleNamespace(ndim=ndim))
    try:
        _OdcEngine._refuse_unsupported(engine)
        out["refuse:" + what] = None
    except ValueError as e:
        out["refuse:" + what] = str(e)
print(json.dumps(out))
"""


def test_engine_input_checks():
    proc = run(["-c", CHECKS], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["split"] == [[0, [0]], [2, [2, 0, 1]]]
    assert "not on 'npu'" in out["device"]
    assert "sample 5 of a minibatch of 5" in out["index"]
    assert out["roles:"] == ["actor", "critic"] and out["roles:none"] == []
    assert out["roles:actor,reference"] == ["actor", "reference"]
    assert "ODC_VERL_ROLES" in out["roles:actor,policy"] and "policy" in out["roles:actor,policy"]
    assert out["balance:"] == "lb_mini" and out["balance:dynamic"] == "dynamic"
    # a rank with no microbatch: 0 for a sum, the others' mean / min for a mean / min
    assert out["filled"][2] == {"clip": ["mean", 0.30000000000000004], "lo": ["min", -3.0], "pg_loss": ["sum", 0.0]}
    assert out["filled"][0]["pg_loss"] == ["sum", 1.5] and out["filled"][1]["lo"] == ["min", -3.0]
    assert "ODC_VERL_BALANCE" in out["balance:greedy"] and "greedy" in out["balance:greedy"]
    # what the engine cannot run with: named, with the way out
    assert "engine.strategy=fsdp:" in out["refuse:fsdp1"] and "set engine.strategy=fsdp2" in out["refuse:fsdp1"]
    assert "ODC_VERL_ROLES" in out["refuse:fsdp1"]
    assert "ODC_VERL_BALANCE=dynamic" in out["refuse:dynamic_hsdp"] and "fsdp_size" in out["refuse:dynamic_hsdp"]
    assert out["refuse:fine"] is None


EXCHANGE = r"""
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from verl.utils import tensordict_utils as tu
from torch_odc_backend.balance import TransformerCost
from torch_odc_backend.verl.minibatch import gather_minibatch, microbatch_of, share_of_minibatch
from torch_odc_backend.balance import lb_mini

def part(rank):  # rank r loads samples whose token ids say (rank, sample, position)
    lens = [[5, 40, 7, 22, 3], [31, 2, 18]][rank]
    ids = [torch.arange(n) + 1000 * (10 * rank + i) for i, n in enumerate(lens)]
    return tu.get_tensordict({"input_ids": tu.nested_tensor_from_tensor_list(ids),
                              "score": torch.tensor([float(10 * rank + i) for i in range(len(lens))])},
                             non_tensor_dict={"max_token_len_per_gpu": 64})

def run(rank, world, path):
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world)
    cost = TransformerCost(hidden_size=8, num_layers=1, intermediate_size=16, num_heads=2, vocab_size=16)
    got = share_of_minibatch(part(rank), max_tokens=64, cost=cost, group=dist.group.WORLD)
    everyone, counts, flat = gather_minibatch(part(rank), dist.group.WORLD)
    want = [microbatch_of(everyone, counts, mb) for mb in lb_mini(flat, world, 64, cost)[rank]]
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        assert [t.tolist() for t in g["input_ids"].unbind()] == [t.tolist() for t in w["input_ids"].unbind()]
        assert g["score"].tolist() == w["score"].tolist()
    moved = sum(1 for g in got for s in g["score"].tolist() if int(s) // 10 != rank)
    print(f"rank {rank}: {len(got)} microbatches, {moved} samples from the other rank", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "store")
    # forked: the ranks start with the imports above (spawned, each would import verl again)
    mp.start_processes(run, args=(2, path), nprocs=2, start_method="fork")
    print("EXCHANGE OK")
"""


def test_lb_mini_exchange_moves_each_sample_to_its_rank(tmp_path):
    """share_of_minibatch (lengths gathered, samples sent once, all-to-all) builds the same
    microbatches as gathering every sample everywhere, and samples do cross ranks."""
    script = tmp_path / "exchange.py"
    script.write_text(EXCHANGE)
    proc = run([str(script)], timeout=300)
    assert proc.returncode == 0 and "EXCHANGE OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the two ranks print at once: their lines may run together
    moved = {int(r): int(n) for r, n in re.findall(r"rank (\d+): \d+ microbatches, (\d+) samples from", proc.stdout)}
    assert sorted(moved) == [0, 1] and sum(moved.values()) > 0, proc.stdout
