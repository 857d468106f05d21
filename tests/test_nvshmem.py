"""NVSHMEM runtime (groundwork for the NVSHMEM transport): a build without it says how to
get it; with >= 2 GPUs and an ODC_WITH_NVSHMEM=1 build, initialisation over the default
group and a checked put-with-signal between neighbours (skipped, loudly, otherwise)."""
import pytest
import torch

from torch_odc_backend import nvshmem as odc_nvshmem
from dist_utils import run_distributed

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_build_without_nvshmem_says_how_to_enable_it():
    if odc_nvshmem.available():
        pytest.skip("this build has the NVSHMEM runtime")
    for call in (odc_nvshmem.init, odc_nvshmem.status, lambda: odc_nvshmem.ring_selftest(8)):
        with pytest.raises(RuntimeError, match="ODC_WITH_NVSHMEM=1"):
            call()


def _worker(rank, world):
    torch.cuda.set_device(rank)
    fresh = odc_nvshmem.init(heap_bytes=256 << 20)
    again = odc_nvshmem.init()  # once per process: the second call joins
    st = odc_nvshmem.status()
    tests = {n: odc_nvshmem.ring_selftest(n) for n in (8, 4096 + 3, 8 << 20)}
    return fresh, again, st, tests


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not odc_nvshmem.available(),
                    reason="needs >= 2 CUDA GPUs and an ODC_WITH_NVSHMEM=1 build")
def test_gpu_nvshmem_init_once_and_put_with_signal():
    results = run_distributed(_worker, 2, backend="cpu:gloo,cuda:nccl", env=ENV, deadline_s=240)
    for rank, (fresh, again, st, tests) in results.items():
        assert fresh is True and again is False, rank
        assert st["init_status"] >= 2 and st["my_pe"] == rank and st["n_pes"] == 2
        for n, r in tests.items():
            assert r["mismatched_bytes"] == 0, (rank, n, r)
            assert r["next_pe_is_p2p"], (rank, n, r)  # GPUs of one host
