"""Quick GPU check under torchrun: odc vs NCCL correctness on a size sweep, then
median latency of bf16 all-gather / reduce-scatter for both, side by side.

    torchrun --nproc-per-node=N benchmarks/quickcheck.py [--json out.json]
"""
import argparse
import json
import os

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

import torch
import torch.distributed as dist

import torch_odc_backend  # noqa: F401


def check(odc, nccl, rank, world, dev):
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    bad = []
    x = torch.arange(4, device=dev, dtype=torch.float32) + 10 * rank
    a = torch.zeros(4 * world, device=dev)
    print(f"[{rank}] first AG enqueue", flush=True)
    dist.all_gather_into_tensor(a, x, group=odc)
    print(f"[{rank}] enqueued", flush=True)
    torch.cuda.synchronize()
    print(f"[{rank}] first AG done: {a.tolist()}", flush=True)
    for numel in [1, 7, 1000, 65537, 1 << 20, (33 << 20) // 2 + 3, 80 << 20]:
        for dtype in [torch.bfloat16, torch.float32, torch.uint8]:
            if dtype == torch.uint8:
                x = torch.randint(0, 255, (numel,), device=dev, dtype=dtype, generator=g)
            else:
                x = torch.randn(numel, device=dev, dtype=dtype, generator=g)
            a = torch.full((numel * world,), 7, device=dev, dtype=dtype)
            b = torch.zeros_like(a)
            if rank == 0 and numel < 100:
                print(f"[0] AG {numel} {dtype}", flush=True)
            dist.all_gather_into_tensor(a, x, group=odc)
            dist.all_gather_into_tensor(b, x, group=nccl)
            if not torch.equal(a, b):
                bad.append(f"AG {numel} {dtype}")
            if dtype == torch.uint8:
                continue
            big = torch.randn(numel * world, device=dev, dtype=dtype, generator=g)
            for op in [dist.ReduceOp.SUM, dist.ReduceOp.AVG]:
                ra = torch.full((numel,), float("nan"), device=dev, dtype=dtype)
                rb = torch.empty_like(ra)
                if rank == 0 and numel < 100:
                    print(f"[0] RS {op} {numel} {dtype}", flush=True)
                dist.reduce_scatter_tensor(ra, big, op=op, group=odc)
                dist.reduce_scatter_tensor(rb, big, op=op, group=nccl)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                if not torch.allclose(ra.float(), rb.float(), rtol=tol, atol=tol * 4):
                    err = (ra.float() - rb.float()).abs().max().item()
                    bad.append(f"RS {op} {numel} {dtype} maxerr={err}")
    # async op on a side stream, consumed after wait()
    x = torch.randn(1 << 20, device=dev)
    out = torch.empty(world << 20, device=dev)
    w = dist.all_gather_into_tensor(out, x, group=odc, async_op=True)
    w.wait()
    ref = torch.empty_like(out)
    dist.all_gather_into_tensor(ref, x, group=nccl)
    if not torch.equal(out, ref):
        bad.append("async AG")
    torch.cuda.synchronize()
    return bad


def timeit(fn, iters=10, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def probe(odc, nccl, rank, world, dev, mib=1):
    """Where a small operation's time goes: host time to enqueue one op, GPU time per op
    in a loop of back-to-back ops, and (rank 0) the profiler's device-side breakdown."""
    import time
    total = (mib << 20) // 2
    x = torch.randn(total // world, device=dev, dtype=torch.bfloat16)
    out = torch.empty(total, device=dev, dtype=torch.bfloat16)
    big = torch.randn(total, device=dev, dtype=torch.bfloat16)
    r = torch.empty(total // world, device=dev, dtype=torch.bfloat16)
    res, n = {}, 50
    for name, grp in [("odc", odc), ("nccl", nccl)]:
        for op, fn in [("ag", lambda: dist.all_gather_into_tensor(out, x, group=grp)),
                       ("rs", lambda: dist.reduce_scatter_tensor(r, big, group=grp))]:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            dist.barrier(group=nccl)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            s.record()
            for _ in range(n):
                fn()
            e.record()
            host = (time.perf_counter() - t0) / n * 1e6
            e.synchronize()
            res[f"{op}_{name}"] = {"host_enqueue_us": host, "gpu_loop_us": s.elapsed_time(e) * 1e3 / n}
    if rank == 0:
        for k, v in res.items():
            print(f"PROBE {mib} MiB {k}: host enqueue {v['host_enqueue_us']:.1f} us/op, "
                  f"GPU {v['gpu_loop_us']:.1f} us/op in a loop of {n}", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            dist.all_gather_into_tensor(out, x, group=odc)
        for _ in range(10):
            dist.reduce_scatter_tensor(r, big, group=odc)
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    p.add_argument("--sizes-mib", default="1,4,16,64,256,512")
    p.add_argument("--probe", action="store_true", help="also break down 1 MiB op latency")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    import datetime, faulthandler
    faulthandler.enable()
    faulthandler.dump_traceback_later(int(os.environ.get("QC_DUMP_S", "100")), exit=False)
    dist.init_process_group("cpu:gloo,cuda:odc",
                            timeout=datetime.timedelta(seconds=int(os.environ.get("QC_TIMEOUT_S", "600"))))
    world = dist.get_world_size()
    dev = torch.device("cuda", local)
    odc = dist.group.WORLD
    nccl = dist.new_group(backend="nccl")
    bad = check(odc, nccl, rank, world, dev)
    probed = probe(odc, nccl, rank, world, dev) if args.probe else None
    rows = []
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        total = (mib << 20) // 2
        shard = total // world
        x = torch.randn(shard, device=dev, dtype=torch.bfloat16)
        out = torch.empty(shard * world, device=dev, dtype=torch.bfloat16)
        big = torch.randn(shard * world, device=dev, dtype=torch.bfloat16)
        r = torch.empty(shard, device=dev, dtype=torch.bfloat16)
        row = {"mib": mib}
        for name, grp in [("odc", odc), ("nccl", nccl)]:
            dist.barrier(group=nccl)
            row[f"ag_{name}_us"] = timeit(lambda: dist.all_gather_into_tensor(out, x, group=grp))
            dist.barrier(group=nccl)
            row[f"rs_{name}_us"] = timeit(lambda: dist.reduce_scatter_tensor(r, big, group=grp))
        for op in ["ag", "rs"]:
            row[f"{op}_odc_busbw"] = (mib << 20) * (world - 1) / world / row[f"{op}_odc_us"] / 1e3
            row[f"{op}_nccl_busbw"] = (mib << 20) * (world - 1) / world / row[f"{op}_nccl_us"] / 1e3
        rows.append(row)
    if rank == 0:
        print("CORRECTNESS:", "OK" if not bad else bad, flush=True)
        print(f"{'MiB':>5} {'AG odc us':>10} {'AG nccl':>10} {'AGbw odc':>9} {'AGbw nccl':>9} "
              f"{'RS odc us':>10} {'RS nccl':>10} {'RSbw odc':>9} {'RSbw nccl':>9}")
        for r in rows:
            print(f"{r['mib']:>5} {r['ag_odc_us']:>10.1f} {r['ag_nccl_us']:>10.1f} "
                  f"{r['ag_odc_busbw']:>9.1f} {r['ag_nccl_busbw']:>9.1f} {r['rs_odc_us']:>10.1f} "
                  f"{r['rs_nccl_us']:>10.1f} {r['rs_odc_busbw']:>9.1f} {r['rs_nccl_busbw']:>9.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "bad": bad, "rows": rows, "probe": probed,
                           "env": {k: v for k, v in os.environ.items() if k.startswith("ODC_")}}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
