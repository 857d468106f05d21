"""benchmarks/trace_gaps.py on a synthetic Chrome trace: it finds the compute stream, its
idle gaps and the host calls before the launch that ended the longest one."""
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_gaps  # noqa: E402


def _k(tid, ts, dur, name="k", corr=None):
    e = {"ph": "X", "cat": "kernel", "tid": tid, "ts": ts, "dur": dur, "name": name}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_gaps_and_the_host_calls_before_them(tmp_path):
    events = [_k(7, 0, 100), _k(7, 100, 100), _k(7, 5200, 100, "memset", corr=9),  # 5 ms gap
              _k(7, 5300, 100), _k(12, 300, 50),  # another stream, less busy
              {"ph": "X", "cat": "cuda_runtime", "tid": 1, "ts": 150, "dur": 5, "name": "cudaRuntimeGetVersion"},
              {"ph": "X", "cat": "cuda_runtime", "tid": 1, "ts": 5190, "dur": 2, "name": "cudaMemsetAsync",
               "args": {"correlation": 9}}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    r = trace_gaps.analyse(trace_gaps.load(path), min_gap_us=2000, top=3)
    assert r["compute_stream"] == 7 and r["kernels"] == 4
    assert r["busy_ms"] == 0.4 and r["span_ms"] == 5.4 and r["gaps"] == 1
    gap = r["longest"][0]
    assert gap["gap_ms"] == 5.0 and gap["ended_by_launch"] == "cudaMemsetAsync"
    assert gap["host_calls_before"][-1]["call"] == "cudaRuntimeGetVersion"
    out = tmp_path / "gaps.json"
    assert trace_gaps.main([str(path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["t.json.gz"]["gaps"] == 1
    assert trace_gaps.analyse([], 2000, 3)["compute_stream"] is None  # no GPU events: no crash
