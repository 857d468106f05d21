"""Run a training script as if each block of G local ranks were a host of its own.

Multi-host code (HSDP across hosts, odc inside a host and NCCL between hosts) then runs on
one machine. Under torchrun, this sets before the script starts:

- ``NCCL_HOSTID=odc-emulated-host<LOCAL_RANK // G>``: NCCL takes ranks with different host
  ids for different hosts and connects them through its network transport (sockets where
  the machine has no RDMA NIC) instead of NVLink or shared memory;
- ``ODC_HOST_SIZE=G``: odc puts global ranks g and h on one host iff g // G == h // G, and
  its transports (CUDA IPC, host shared memory) serve only the ranks of one host.

::

    torchrun --standalone --nproc-per-node=4 -m torch_odc_backend.emulate_hosts 2 train.py ARGS
    torchrun --standalone --nproc-per-node=4 -m torch_odc_backend.emulate_hosts 2 -m MODULE ARGS

It changes no GPU or system setting, only these two variables of the script's process. On
CPU (gloo, odc's shared memory) the same works: gloo's traffic is TCP anyway, and odc leaves
the collectives of groups spanning the emulated hosts to gloo. It composes with
``torch_odc_backend.share_gpus`` (``... emulate_hosts 2 -m torch_odc_backend.share_gpus
train.py``). One machine only: ranks are numbered host by host from 0 (torchrun
--standalone). docs/multi_host.md says what has run this way.
"""
from __future__ import annotations

import os
import sys

from . import _script, config

USAGE = ("usage: python -m torch_odc_backend.emulate_hosts RANKS_PER_HOST (SCRIPT | -m MODULE) "
         "[ARGS...]")


def host_env(ranks_per_host: int, local_rank: int, global_rank: int) -> dict[str, str]:
    """The variables that put this rank on emulated host ``local_rank // ranks_per_host``."""
    if ranks_per_host < 1:
        raise ValueError(f"emulate_hosts: RANKS_PER_HOST must be at least 1, got {ranks_per_host}")
    if global_rank != local_rank:
        raise ValueError(f"emulate_hosts: rank {global_rank} is local rank {local_rank}: emulated "
                         "hosts split one machine's ranks (torchrun --standalone), not a multi-node job")
    return {"NCCL_HOSTID": f"odc-emulated-host{local_rank // ranks_per_host}",
            config.HOST_SIZE: str(ranks_per_host)}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or not argv[0].isdigit() or not _script.is_target(argv[1:]):
        raise SystemExit(USAGE)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    env = host_env(int(argv[0]), local_rank, int(os.environ.get("RANK", local_rank)))
    set_before = config.host_size_as_set()
    if set_before not in ("", env[config.HOST_SIZE]):
        raise SystemExit(f"torch_odc_backend.emulate_hosts: {config.HOST_SIZE}={set_before} is set and "
                         f"differs from RANKS_PER_HOST={argv[0]}")
    os.environ.update(env)
    _script.run(argv[1:])


if __name__ == "__main__":
    main()
