#!/usr/bin/env python3
"""What torch_odc_backend adds to ``import torch`` through its ``torch.backends`` entry point.

Two measurements, written to benchmarks/results/import_time_<kind>_<date>.json:
  * in one process with autoload off: the time of what the entry point does (import
    ``_torch_odc_backend_autoload`` and call ``autoload()``), repeated in fresh processes;
  * whole ``python -c "import torch"`` runs with TORCH_DEVICE_BACKEND_AUTOLOAD=1 and =0,
    interleaved, medians and their difference (noisier: the whole interpreter start).
Also records what the autoload did not do: import the package or its compiled core.

    python benchmarks/import_time.py [--trials 30] [--kind NAME]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _meta import machine_kind, result_path, stamp  # noqa: E402

HOOK = """
import os, sys, time
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
import torch
t0 = time.perf_counter()
import _torch_odc_backend_autoload as a
a.autoload()
t1 = time.perf_counter()
print((t1 - t0) * 1e3, "ODC" in torch.distributed.Backend._plugins)
"""
WHOLE = """
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import sys
print((t1 - t0) * 1e3, "torch_odc_backend" in sys.modules, "torch_odc_backend._C" in sys.modules,
      "ODC" in torch.distributed.Backend._plugins)
"""


def run(code: str, autoload: str) -> list[str]:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return out.stdout.split()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--kind", default=None, help="machine kind for the file name (default: cpu or the GPU)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()

    hook_ms, registered = [], True
    for _ in range(args.trials):
        ms, reg = run(HOOK, "0")
        hook_ms.append(float(ms))
        registered = registered and reg == "True"
    whole = {"1": [], "0": []}
    package_imported = core_loaded = False
    for i in range(args.trials):
        for flag in (("1", "0") if i % 2 == 0 else ("0", "1")):
            ms, pkg, core, reg = run(WHOLE, flag)
            whole[flag].append(float(ms))
            if flag == "1":
                package_imported |= pkg == "True"
                core_loaded |= core == "True"
                registered = registered and reg == "True"
    med = {k: statistics.median(v) for k, v in whole.items()}
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = args.kind or machine_kind(device, 1)
    result = {
        "benchmark": "import_time",
        "kind": kind,
        **stamp(device),
        "python": sys.version.split()[0],
        "trials": args.trials,
        "autoload_hook_ms": hook_ms,
        "import_torch_ms_autoload_on": whole["1"],
        "import_torch_ms_autoload_off": whole["0"],
        "summary": {
            "autoload_hook_ms_median": statistics.median(hook_ms),
            "autoload_hook_ms_max": max(hook_ms),
            "import_torch_ms_median_autoload_on": med["1"],
            "import_torch_ms_median_autoload_off": med["0"],
            "import_torch_added_ms_median_difference": med["1"] - med["0"],
            "odc_registered_by_import_torch": registered,
            "package_imported_by_import_torch": package_imported,
            "compiled_core_loaded_by_import_torch": core_loaded,
        },
    }
    path = result_path(args.out_dir, "import_time", kind)
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
