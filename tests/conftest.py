"""Make `from dist_utils import ...` work from any cwd and report skipped GPU tests loudly."""
import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: in the GPU suite (benchmarks/gpu_suite.sh runs -m gpu): the CUDA "
                            "tests (dist_utils.needs_gpus) and CPU tests that matter where a GPU is visible")


def _is_gpu_test(report):
    return ("gpu" in getattr(report, "keywords", {}) or "test_gpu" in report.nodeid
            or "cuda" in report.nodeid.lower())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if _is_gpu_test(r)]
    if not skipped:
        return
    reasons = {}
    for r in skipped:
        reason = (r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)).removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    import torch

    why = "no CUDA device" if not torch.cuda.is_available() else f"{torch.cuda.device_count()} CUDA device(s)"
    bar = "!" * 72
    terminalreporter.write_line(bar, red=True, bold=True)
    terminalreporter.write_line(f"GPU TESTS SKIPPED: {len(skipped)} test(s) did not run ({why})", red=True, bold=True)
    for reason, n in sorted(reasons.items()):
        terminalreporter.write_line(f"    {n:4d} x {reason}", red=True)
    terminalreporter.write_line(bar, red=True, bold=True)
