"""Run a function on N local processes with a real process group, collect results.

Every worker is a fresh process (forked from a server that imported torch once, or spawned
with ODC_TEST_SPAWN=1) with the caller's environment; a worker that raises, hangs past the
deadline or dies makes the whole call fail with every rank's traceback.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

# Every GPU run keeps NVLink multicast off (the GPU machines require it)
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def needs_gpus(n: int = 1) -> list:
    """Marks of a CUDA test: `gpu` (what benchmarks/gpu_suite.sh selects with -m gpu) and a
    skip, with the reason in the summary (conftest.py), where fewer than n GPUs are visible."""
    import pytest

    have = torch.cuda.device_count()
    return [pytest.mark.gpu,
            pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPU{'s' if n > 1 else ''}, found {have}")]


def gpu_test(n: int = 1):
    """Decorator of a CUDA-only test (see needs_gpus)."""
    def apply(fn):
        for mark in needs_gpus(n):
            fn = mark(fn)
        return fn

    return apply


def cuda_case(*values, gpus: int = 1, id: str | None = None):
    """One CUDA case of a test parametrized over the device (see needs_gpus)."""
    import pytest

    return pytest.param(*values, marks=needs_gpus(gpus), id=id)


def ranks_share_gpus(world: int) -> bool:
    """Whether `world` ranks must share GPUs here (rank r uses GPU r % count): odc runs so,
    NCCL refuses it, so comparisons with NCCL need a GPU per rank."""
    return torch.cuda.device_count() < world

# ODC_TEST_NVSHMEM=1 (with ODC_TRANSPORT=nvshmem or ODC_HOST_SIZE, in an ODC_WITH_NVSHMEM=1
# build): every CUDA odc worker initialises NVSHMEM first, so the GPU suites run with their
# peers routed through NVSHMEM (benchmarks/gpu_suite.sh, stage nvshmem)
NVSHMEM_SUITE = os.environ.get("ODC_TEST_NVSHMEM") == "1"
# ODC_TEST_DEVICE_ID=1: every CUDA worker passes device_id to init_process_group (DeviceMesh
# and dist.split_group then split groups from the default one), as PyTorch recommends
DEVICE_ID_SUITE = os.environ.get("ODC_TEST_DEVICE_ID") == "1"


def _context():
    """A forkserver that imported torch once: a rank then starts in about 0.1 s instead of the
    1.5-3 s of importing torch, most of a test's time on CPU and much of it on GPUs. The server
    never touches CUDA (importing torch does not initialise it), so each worker initialises
    CUDA itself, after it took the caller's environment (CUDA_VISIBLE_DEVICES and the like),
    as a spawned one would. What `import torch` itself reads (ODC_DEFAULT_BACKEND through the
    autoload entry point, TORCH_DEVICE_BACKEND_AUTOLOAD) is then the server's: tests of those
    run a subprocess of their own (test_knob_errors.py). ODC_TEST_SPAWN=1 spawns every worker
    afresh instead."""
    if os.environ.get("ODC_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _worker(rank, world_size, store_path, backend, timeout_s, fn, args, env, queue, device_id,
            caller_env):
    try:
        # SIGUSR1 writes every thread's Python stack to a file the caller reads when this rank
        # misses the deadline (run_distributed): a hang then says where it is
        stacks = open(_stack_file(store_path, rank), "w")  # noqa: SIM115 (open for the process' life)
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        # the caller's environment now, as a spawned process gets it (a forked one has the
        # server's, from when it started)
        os.environ.clear()
        os.environ.update(caller_env)
        os.environ.update(env or {})
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        import torch.distributed as dist
        import torch_odc_backend  # noqa: F401  (registers "odc")

        bound = None
        if torch.cuda.is_available() and "cuda" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            if device_id or DEVICE_ID_SUITE:
                bound = torch.device("cuda", torch.cuda.current_device())
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s), device_id=bound,
        )
        if NVSHMEM_SUITE and "cuda:odc" in backend:
            from torch_odc_backend import nvshmem as odc_nvshmem

            # room for the windows of every group a test makes (HSDP: three) and small arenas
            odc_nvshmem.init(slab_bytes=4 * odc_nvshmem.default_slab_bytes(world_size))
        try:
            result = fn(rank, world_size, *args)
        finally:
            # A failing test must not leave peers blocked in a collective.
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        # Plain pickle copies tensors by value: torch's queue would share them through file
        # descriptors of this process, which are gone once it exits.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including KeyboardInterrupt
        queue.put((rank, "err", traceback.format_exc()))


def _stack_file(store_path: str, rank: int) -> str:
    return os.path.join(os.path.dirname(store_path), f"stacks_rank{rank}.txt")


def _stacks_of_hung(procs, store_path: str) -> dict[int, str]:
    """The Python stacks of the workers still alive (SIGUSR1: see _worker)."""
    alive = {r: p for r, p in enumerate(procs) if p.is_alive()}
    if not alive:
        return {}
    for p in alive.values():
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)  # the handler writes from the interpreter's next check
    out = {}
    for r in alive:
        try:
            with open(_stack_file(store_path, r)) as f:
                out[r] = f.read()[-6000:] or "(nothing written: stuck outside the interpreter?)"
        except OSError as e:
            out[r] = f"(no stack: {e})"
    return out


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "cpu:odc",
    timeout_s: float = 60.0,
    deadline_s: float = 300.0,
    env: dict[str, str] | None = None,
    expect_failure_ranks: set[int] | None = None,
    device_id: bool = False,
) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes.

    Returns {rank: return value}. ``fn`` and its results must be picklable.
    ``timeout_s`` is the process-group timeout; ``deadline_s`` bounds the whole run.
    With ``expect_failure_ranks``, those ranks' tracebacks are returned (as str)
    instead of raising. ``device_id``: CUDA workers pass their GPU to init_process_group.
    """
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store_path, backend, timeout_s, fn, args, env, queue, device_id,
                  dict(os.environ)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[str, Any]] = {}
        end = time.monotonic() + deadline_s
        while len(results) < world_size and time.monotonic() < end:
            try:
                rank, status, payload = queue.get(timeout=0.5)
                results[rank] = (status, payload)
            except Exception:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
        hung = {} if len(results) == world_size else _stacks_of_hung(procs, store_path)
        for p in procs:
            p.join(timeout=max(0.1, end - time.monotonic()) if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    expect_failure_ranks = expect_failure_ranks or set()
    missing = [r for r in range(world_size) if r not in results]
    # A worker that reported but then crashed on the way out (teardown) is a failure too.
    crashed = {r: p.exitcode for r, p in enumerate(procs)
               if r in results and results[r][0] == "ok" and p.exitcode not in (0, None)}
    for r, code in crashed.items():
        results[r] = ("err", f"exited with code {code} after returning its result")
    errors = {r: payload for r, (s, payload) in results.items() if s == "err"}
    unexpected = {r: e for r, e in errors.items() if r not in expect_failure_ranks}
    if missing or unexpected:
        msg = [f"distributed run failed: missing ranks {missing} (hung or died)"]
        for r, tb in sorted(unexpected.items()):
            msg.append(f"--- rank {r} ---\n{tb}")
        for r, stack in sorted(hung.items()):
            msg.append(f"--- rank {r}, still running at the deadline: its Python stacks ---\n{stack}")
        raise AssertionError("\n".join(msg))
    return {r: pickle.loads(payload) if s == "ok" else payload for r, (s, payload) in results.items()}


def run_once(launch: Callable[..., dict[int, Any]]) -> Callable[..., dict[int, Any]]:
    """Memoize a distributed job per argument tuple, failures included: tests sharing one
    spawned job (spawning is slow on CI) each get its result, or its AssertionError."""
    runs: dict[tuple, Any] = {}

    def get(*key):
        if key not in runs:
            try:
                runs[key] = launch(*key)
            except AssertionError as e:
                runs[key] = e
        if isinstance(runs[key], Exception):
            raise runs[key]
        return runs[key]

    return get
