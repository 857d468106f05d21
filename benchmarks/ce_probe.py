#!/usr/bin/env python3
"""Copy-engine all-gather probe: how fast can N GPUs of one host pull (or push) their
peers' shards with cudaMemcpyAsync, depending on streams per peer and chunking?

One process drives every GPU through cudaMemcpyAsync (cuda-python), each copy on a
stream of the GPU whose copy engine should run it: the reader's for a pull, the
writer's for a push (torch's cross-device copy_ would pick the source's stream). Every GPU gathers
(world - 1) shards of --shard-mib MiB at the same time; the figure is the inbound
bandwidth per GPU, and "busbw" (as nccl-tests counts an all-gather of
world * shard bytes) for comparison with benchmarks/collectives.py.

    python benchmarks/ce_probe.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from cuda.bindings import runtime as cudart


def _ok(ret, what):
    err = ret[0]
    if err != cudart.cudaError_t.cudaSuccess and err != cudart.cudaError_t.cudaErrorPeerAccessAlreadyEnabled:
        raise RuntimeError(f"{what}: {err}")


def run(world, shards, outs, mode, streams_per_peer, chunk, iters=5):
    """All GPUs gather concurrently; returns seconds per gather (median)."""
    streams = {(d, p, s): torch.cuda.Stream(device=d)
               for d in range(world) for p in range(world) if p != d for s in range(streams_per_peer)}
    nbytes = shards[0].numel() * shards[0].element_size()

    def one():
        for d in range(world):
            for i in range(1, world):
                p = (d + i) % world  # the same peer order as the backend's lanes
                # pull: d reads p's shard; push: d writes its shard into p's output
                src, dst = (shards[p], outs[d][p]) if mode == "pull" else (shards[d], outs[p][d])
                _ok(cudart.cudaSetDevice(d), "cudaSetDevice")
                for c, off in enumerate(range(0, nbytes, chunk)):
                    s = streams[(d, p, c % streams_per_peer)]
                    _ok(cudart.cudaMemcpyAsync(dst.data_ptr() + off, src.data_ptr() + off, min(chunk, nbytes - off),
                                               cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, s.cuda_stream),
                        "cudaMemcpyAsync")

    times = []
    for it in range(iters + 2):
        for d in range(world):
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        one()
        for d in range(world):
            torch.cuda.synchronize(d)
        if it >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], nbytes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shard-mib", type=int, default=128)
    p.add_argument("--json", default="")
    args = p.parse_args()
    world = torch.cuda.device_count()
    numel = (args.shard_mib << 20) // 2
    shards = [torch.randn(numel, device=d).to(torch.bfloat16) for d in range(world)]
    outs = [[torch.empty(numel, device=d, dtype=torch.bfloat16) for _ in range(world)] for d in range(world)]
    for d in range(world):
        _ok(cudart.cudaSetDevice(d), "cudaSetDevice")
        for q in range(world):
            if q != d:
                _ok(cudart.cudaDeviceEnablePeerAccess(q, 0), "cudaDeviceEnablePeerAccess")
    rows = []
    for mode in ("pull", "push"):
        for spp in (1, 2, 4):
            for chunk_mib in (32, 8):
                t, nbytes = run(world, shards, outs, mode, spp, chunk_mib << 20)
                inbound = nbytes * (world - 1) / t / 1e9
                row = dict(mode=mode, streams_per_peer=spp, chunk_mib=chunk_mib, seconds=t,
                           inbound_GBps=inbound, busbw_GBps=inbound)  # busbw = inbound for AG
                rows.append(row)
                print(f"{mode} streams/peer={spp} chunk={chunk_mib}MiB: {t * 1e6:8.1f} us, "
                      f"inbound per GPU {inbound:6.1f} GB/s", flush=True)
    ok = all(torch.equal(outs[d][q].cpu(), shards[q].cpu()) for d in range(world) for q in range(world) if q != d)
    print("copies correct:", ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "shard_mib": args.shard_mib, "device": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "rows": rows, "copies_correct": ok}, f, indent=1)


if __name__ == "__main__":
    main()
