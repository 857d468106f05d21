"""The one-GPU lab's CPU-checkable parts: benchmarks/lab.sh always stops its MPS daemon (a stub
nvidia-cuda-mps-control stands in for the real one), the collectives benchmark's floor and
summary fields on CPU, and the engine rule it derives from csrc (the GPU run is the lab itself,
docs/performance.md)."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAB = REPO / "benchmarks" / "lab.sh"
KiB, MiB = 1 << 10, 1 << 20

STUB = """#!/usr/bin/env bash
if [ "${1:-}" = "-d" ]; then : > "$CUDA_MPS_PIPE_DIRECTORY/control"; echo "up $CUDA_MPS_PIPE_DIRECTORY" >> "$STUB_LOG"; exit 0; fi
echo "$(cat) $CUDA_MPS_PIPE_DIRECTORY" >> "$STUB_LOG"; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""
# stands in for torchrun: records its arguments and the environment, exits with the code asked for
LAUNCHER = """import json, os, sys
json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in (
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY", "ODC_LAB_MPS", "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}}, open(os.environ["LAUNCH_LOG"], "w"))
sys.exit(int(sys.argv[-1]))
"""


@pytest.fixture
def stub(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ctl = bin_dir / "nvidia-cuda-mps-control"
    ctl.write_text(STUB)
    ctl.chmod(ctl.stat().st_mode | stat.S_IEXEC)
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               STUB_LOG=str(tmp_path / "stub.log"), LAUNCH_LOG=str(tmp_path / "launch.json"),
               TORCHRUN=f"{sys.executable} {launcher}", TMPDIR=str(tmp_path))
    return tmp_path, env


def lab(env, *args):
    return subprocess.run(["bash", str(LAB), *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code", [0, 3])
def test_lab_stops_its_daemon_whatever_the_run_ends_with(stub, code):
    tmp, env = stub
    proc = lab(env, "--ranks", "4", "--sm-share", "--", "script.py", "--x", str(code))
    assert proc.returncode == code, proc.stderr
    up, quit_ = (tmp / "stub.log").read_text().splitlines()
    assert up.startswith("up ") and quit_.startswith("quit ")
    assert up.split()[1] == quit_.split()[1]  # the same private pipe directory
    launched = json.loads((tmp / "launch.json").read_text())
    assert launched["argv"] == ["--standalone", "--nproc-per-node=4", "script.py", "--x", str(code)]
    e = launched["env"]
    assert e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and e["ODC_LAB_MPS"] == "1"
    assert e["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(tmp))
    assert (e["NCCL_NVLS_ENABLE"], e["TORCH_SYMM_MEM_DISABLE_MULTICAST"], e["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")
    assert not list(tmp.glob("odc-lab.*"))  # its temporary directory is gone


def test_lab_without_sm_share_leaves_the_sms_shared(stub):
    tmp, env = stub
    proc = lab(dict(env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="10"), "--ranks", "2", "--", "s.py", "0")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp / "launch.json").read_text())["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] is None


def test_lab_refuses_clearly_without_mps(stub):
    _, env = stub
    proc = lab(dict(env, PATH="/usr/bin:/bin"), "--ranks", "2", "--", "s.py", "0")
    assert proc.returncode == 3 and "nvidia-cuda-mps-control not found" in proc.stderr


def test_lab_rejects_bad_arguments(stub):
    _, env = stub
    assert lab(env, "--ranks", "two", "--", "s.py").returncode == 2
    assert lab(env, "--ranks", "2").returncode == 2


def test_engine_from_stats():
    """The benchmark names odc's engine and SMs per size from the backend's own counters."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from collectives import engine_from_stats
        from collectives_util import guesses_from_stats
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    before = {"fused_ops": 3, "fused_blocks": 6, "all_gather_ops": 3}
    assert engine_from_stats(before, {"fused_ops": 4, "fused_blocks": 39}) == {"engine": "fused-kernel", "sms": 33}
    assert engine_from_stats(before, dict(before, copy_engine_ops=1, copy_engine_blocks=17)) == {
        "engine": "copy-engine", "sms": 17}
    both = engine_from_stats({}, {"fused_ops": 1, "fused_blocks": 2, "copy_engine_ops": 1, "copy_engine_blocks": 4})
    assert both == {"engine": "mixed", "sms": 3}
    assert engine_from_stats(before, before) == {"engine": "none", "sms": 0}  # a host transport
    # pushed all-gathers: the timed calls' pushes to guessed places, and those confirmed
    pushed = {"guessed_pushes": 10, "guessed_push_hits": 7}
    assert guesses_from_stats(pushed, {"guessed_pushes": 40, "guessed_push_hits": 36}) == {
        "guessed_pushes": 30, "guessed_push_hits": 29}
    assert guesses_from_stats(pushed, pushed) == {} and guesses_from_stats({}, {"direct_ops": 3}) == {}


def test_collectives_cpu_floor_and_summary(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "benchmarks" / "collectives.py"), "--device", "cpu", "--sizes", "64K",
         "--trials", "2", "--warmup", "1", "--registered", "--staged-push", "--out-dir", str(tmp_path)],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (path,) = tmp_path.glob("collectives_cpu-x2_*.json")
    doc = json.loads(path.read_text())
    s = doc["summary"]
    assert s["all_checks_passed"] and doc["complete"]
    for key in ("latency_us", "floor_us", "ratio_to_floor", "host_us", "floor_engine"):
        for op in ("all_gather", "reduce_scatter"):
            assert set(s[key][op]) == {"64KiB"}, (key, op)
    assert s["floor_engine"]["all_gather"]["64KiB"] in ("floor_ce", "floor_sm")
    assert s["ratio_to_floor"]["all_gather"]["64KiB"] == pytest.approx(
        s["latency_us"]["all_gather"]["64KiB"] / s["floor_us"]["all_gather"]["64KiB"])
    assert {r["backend"] for r in doc["rows"] if r["op"] == "reduce_scatter"} >= {
        "odc", "odc_staged_push", "odc_registered", "floor", "floor_ce", "floor_sm"}
    assert set(s["busbw_ratio_odc_staged_push_vs_gloo"]["all_gather"]) == {"64KiB"}
    # the per-size keys describe the zero-copy path; the staged path's beside them
    assert s["odc_path"] == "registered (zero-copy)"
    assert set(s["odc_staged"]["ratio_to_floor"]["all_gather"]) == {"64KiB"}
    by = {(r["op"], r["backend"]): r for r in doc["rows"] if "latency_us" in r}
    assert s["latency_us"]["all_gather"]["64KiB"] == by[("all_gather", "odc_registered")]["latency_us"]
    assert doc["odc_backend_stats"].get("registered_ops", 0) > 0, doc["odc_backend_stats"]
    assert not any(k.startswith("nccl") or "nccl_best" in k for k in s)  # no NCCL: none of its keys


def test_collectives_summary_against_the_best_nccl(tmp_path, capsys):
    """--nccl-best's report: per op and size odc against the NCCL variant of the highest busbw,
    which the summary names; the table and the PNG take the variants."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import collectives
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    busbw = {"odc": (100, 150), "odc_registered": (120, 160), "nccl": (80, 140), "nccl_registered": (90, 145),
             "nccl_symmetric": (110, 130), "nccl_ce": (50, 200)}  # at 1 MiB, 64 MiB
    rows = [{"op": op, "backend": b, "size_bytes": sz, "size": label, "latency_us": 10.0, "busbw_GBps": bw[i]}
            for op in ("all_gather", "reduce_scatter") for b, bw in busbw.items()
            for i, (sz, label) in enumerate(((MiB, "1MiB"), (64 * MiB, "64MiB")))]
    order = list(busbw)
    s = collectives.summarize(rows, [], order, "nccl", cuda=True)
    assert s["nccl_best_backend"]["all_gather"] == {"1MiB": "nccl_symmetric", "64MiB": "nccl_ce"}
    assert s["busbw_ratio_odc_vs_nccl_best"]["all_gather"] == {"1MiB": 100 / 110, "64MiB": 150 / 200}
    assert s["busbw_ratio_odc_registered_vs_nccl_best"]["reduce_scatter"]["64MiB"] == 160 / 200
    assert s["busbw_ratio_nccl_ce_vs_nccl"]["all_gather"]["64MiB"] == 200 / 140
    args = collectives.parse_args(["--nccl-best", "--nccl-debug-log"])
    assert args.nccl_best and args.nccl_debug_log
    assert not any(vars(collectives.parse_args([])).get(k) for k in ("nccl_best", "nccl_debug_log"))
    ctx = type("Ctx", (), dict(rank=0, rows=rows, errors=[], order=order, ref="nccl", cuda=True))()
    collectives.print_table(ctx)
    table = capsys.readouterr().out
    assert "nccl_ce busbw" in table and "odc/nccl_best" in table
    path = tmp_path / "collectives_x.json"
    path.write_text(json.dumps({"reference_backend": "nccl", "rows": rows}))
    pytest.importorskip("matplotlib")
    assert collectives.plot_results(path).exists()


# ---------------------------------------------------------------- the lab on a GPU
def _have_mps():
    import shutil

    import torch
    return torch.cuda.is_available() and shutil.which("nvidia-cuda-mps-control") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _have_mps(), reason="needs a CUDA GPU and nvidia-cuda-mps-control")
@pytest.mark.parametrize("ranks", [4, 8])
def test_ranks_under_mps_run(tmp_path, ranks):
    """W ranks on one GPU under MPS (a client gets few hardware queues there): the staged and
    zero-copy collectives, fused and on the copy engines, finish and are bitwise right."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    proc = subprocess.run(
        ["bash", str(LAB), "--ranks", str(ranks), "--timeout", "150", "--",
         str(REPO / "benchmarks" / "collectives.py"), "--reference", "odc-nocheck", "--registered",
         "--no-gemm", "--sizes", "1M,64M", "--trials", "2", "--warmup", "1", "--pg-timeout", "60",
         "--out-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (path,) = tmp_path.glob(f"collectives_*-mps-x{ranks}_*.json")
    doc = json.loads(path.read_text())
    assert doc["complete"] and doc["summary"]["all_checks_passed"] and not doc["errors"], doc["errors"]


def test_result_kind_names_the_lab(monkeypatch):
    """Every benchmark names its result file alike: the GPU short of its memory suffix, -mps in
    the lab (ODC_LAB_MPS=1, set by lab.sh), which also records the lab's settings."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import _meta
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import torch

    monkeypatch.delenv("ODC_BENCH_KIND", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("ODC_LAB_MPS", raising=False)
    assert _meta.machine_kind(gpu, 2) == "nvidia-h100-x2" and _meta.lab_info(gpu, 2) is None
    monkeypatch.setenv("ODC_LAB_MPS", "1")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert _meta.machine_kind(gpu, 2) == "nvidia-h100-mps-x2"
    assert _meta.lab_info(gpu, 2) == {"mps": True, "ranks_per_gpu": 2, "active_thread_percentage": "50"}
    assert _meta.machine_kind(cpu, 2) == "cpu-x2" and _meta.lab_info(cpu, 2) is None
    monkeypatch.setenv("ODC_BENCH_KIND", "custom")
    assert _meta.machine_kind(gpu, 2) == "custom"
