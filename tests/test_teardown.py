"""Teardown: destroy_process_group stops the inner (delegation) backends (the README's main
job, the FSDP2 example under torchrun, is checked to exit cleanly in tests/test_readme.py).

Before odc forwarded shutdown to its inner gloo group, that group's worker threads lived
until the interpreter finalized and could release a work's tensors then (taking the GIL
from a finalizing interpreter: std::terminate), aborting about a third of example runs."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed


def _destroy_then_delegate(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.ones(1)
    dist.all_reduce(t)  # creates the inner gloo backend
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="shut down"):
        backend.inner("cpu")  # released by shutdown; a shut-down group takes no new work
    return float(t.item())


def test_destroy_process_group_shuts_down_inner_backends():
    assert run_distributed(_destroy_then_delegate, 2) == {0: 2.0, 1: 2.0}
