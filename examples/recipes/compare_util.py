"""Shared by the recipes' ``compare`` commands (hf_trainer_fsdp2.py, lightning_fsdp2.py,
megatron_fsdp_recipe.py): the environment of the runs, launching them with a log each,
passing the model's arguments on, comparing per-step losses, and the verdict (printed; the
exit status is non-zero when a check fails). Also the command-line arguments of the HF and
Lightning recipes' common workload."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import odc_entry_point  # beside this file

REPO = Path(__file__).resolve().parents[2]
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def base_env(work: Path, shim: Path | None = None) -> dict:
    """The environment of every run: no ODC_DEFAULT_BACKEND (a run that wants the switch sets
    it), one CPU thread per process (the same CPU kernels in every run), this checkout first
    on PYTHONPATH with the entry-point record a source checkout lacks (odc_entry_point.py),
    and the test-only CPU shim before it where one is given."""
    env = {k: v for k, v in os.environ.items() if k != "ODC_DEFAULT_BACKEND"}
    env.update(GPU_ENV, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    path = [str(shim)] if shim else []
    path.append(str(REPO))
    record = odc_entry_point.ensure(work / "odc_entry_point")
    if record:
        path.append(str(record))
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *args]


def run(cmd: list[str], env: dict, log: Path, out: Path, timeout: float) -> dict:
    """Run ``cmd`` with its output in ``log``; return the JSON it wrote to ``out`` with the
    wall time. A failed run raises with the log's tail (so ``compare`` exits non-zero)."""
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)}\nexited with {proc.returncode}; log {log}:\n{log.read_text()[-6000:]}")
    return dict(json.loads(out.read_text()), wall_s=round(time.time() - t0, 1), log=str(log))


# The long-tailed workload and tiny model of the HF and Lightning recipes; each names its
# model-width flag (--hidden, --d-model).
WORKLOAD_ARGS = ("steps", "seed", "docs_per_step", "micro_docs", "max_tokens", "min_len", "max_len",
                 "layers", "heads", "vocab", "lr", "clip")


def add_workload_args(p, width: str) -> None:
    """Add the workload's arguments to parser ``p``; ``width`` is the width flag's attribute."""
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs-per-step", type=int, default=16, help="documents per optimizer step (all ranks)")
    p.add_argument("--micro-docs", type=int, default=4, help="documents per microbatch (exact mode)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token cap of an LB-Mini microbatch (decoupled mode; default --max-len)")
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(f"--{width.replace('_', '-')}", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")


def as_argv(a, names) -> list[str]:
    """The values of ``names`` in the parsed arguments ``a`` as flags, to pass them on to a
    run (unset ones left out)."""
    argv = []
    for k in names:
        v = getattr(a, k)
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def compare_losses(got: list[float], ref: list[float], rtol: float) -> dict:
    """Per-step losses: bitwise equal, or within ``rtol`` relative to the reference."""
    n = min(len(got), len(ref))
    abs_diff = [abs(x - y) for x, y in zip(got, ref)]
    rel_diff = [d / abs(y) if y else d for d, y in zip(abs_diff, ref)]
    return {"steps": len(got), "steps_reference": len(ref),
            "losses_bitwise_equal": len(got) == len(ref) and got == ref,
            "max_abs_loss_diff": max(abs_diff) if n else None,
            "max_rel_loss_diff": max(rel_diff) if n else None, "rtol": rtol,
            "equal": len(got) == len(ref) and n > 0 and max(rel_diff) <= rtol}


def carried_check(name: str, got: dict) -> tuple[bool, str]:
    """Whether odc carried a run's FSDP collectives: every mesh group on odc and, on every rank,
    its counters moved (decoupled mode's gets, adds and syncs; else all-gathers and
    reduce-scatters)."""
    backends = got["mesh_group_backend"]
    counters = got["odc_counters_per_rank"]
    keys = (("decoupled_gets", "decoupled_accumulates", "decoupled_syncs") if name == "decoupled"
            else ("all_gather_ops", "reduce_scatter_ops"))
    carried = backends == ["odc"] * got["world"] and all(c.get(k, 0) > 0 for c in counters for k in keys)
    via = f" (init_process_group backend {got['pg_backend_string']!r})" if "pg_backend_string" in got else ""
    return carried, (f"mesh group backends {backends}{via}; {', '.join(keys)} on rank 0: "
                     f"{[counters[0].get(k, 0) for k in keys]}")


def reference_check(c: dict, rtol: float) -> tuple[bool, str]:
    """A ``compare_losses`` result as a check against the single-process reference."""
    return c["equal"], (f"{'bitwise equal' if c['losses_bitwise_equal'] else 'not bitwise equal'}, "
                        f"max rel diff {c['max_rel_loss_diff']:.3g} (rtol {rtol:g}) over {c['steps']} steps")


def write_result(path: Path, result: dict, checks: dict, runs: dict, **printed) -> None:
    """Write the recipe's result (with its checks) to ``path`` and print its summary."""
    result["checks"] = {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()}
    path.write_text(json.dumps(result, indent=1))
    summary = {name: {"losses": r["losses"], "wall_s": r["wall_s"]} for name, r in runs.items()}
    print(json.dumps({"result": str(path), "runs": summary, "compare": result.get("compare", {}), **printed},
                     indent=1))


def verdict(checks: dict[str, tuple[bool, str]]) -> int:
    """Print one line per check and the verdict; return the exit status."""
    for name, (ok, detail) in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    passed = all(ok for ok, _ in checks.values())
    print(f"VERDICT: {'PASS' if passed else 'FAIL'} ({sum(ok for ok, _ in checks.values())}/{len(checks)} checks)")
    return 0 if passed else 1
