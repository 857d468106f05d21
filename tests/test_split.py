"""Group splitting on CPU: what ``init_process_group(device_id=...)`` turns on.

With a bound device, DeviceMesh and ``dist.split_group`` create sub-groups through
``ProcessGroup.split_group``, which asks each backend to ``split`` itself, and
``new_group`` calls ``perform_nocolor_split`` on the ranks outside the new group. A CPU
build of PyTorch refuses ``device_id`` (it must be an accelerator), so these tests drive
``ProcessGroup.split_group`` directly, as ``dist.split_group`` does; the GPU suite runs the
whole path with ``device_id`` (tests/test_fsdp2.py, on CUDA). Groups made without ``device_id``
(``new_group``, ``init_device_mesh``) are covered here too."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dist_utils import run_distributed

CPU = torch.device("cpu")


def _collectives(pg, tag: float):
    """All-gather, reduce-scatter (odc) and all-reduce (delegated) on a ProcessGroup object."""
    r, n = pg.rank(), pg.size()
    ag = torch.empty(3 * n)
    pg._allgather_base(ag, torch.full((3,), tag + r)).wait()
    rs = torch.empty(2)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg._reduce_scatter_base(rs, torch.arange(2 * n, dtype=torch.float32) + tag, opts).wait()
    ar = torch.full((2,), tag + r)
    pg.allreduce([ar]).wait()
    return {"ag": ag.tolist(), "rs": rs.tolist(), "ar": ar.tolist()}


def _split_worker(rank, world):
    from torch_odc_backend import OdcBackend, backend_stats

    world_backend = dist.group.WORLD._get_backend(CPU)
    out = {"supports": world_backend.supports_splitting}
    opts = copy.deepcopy(world_backend.options)  # what dist.split_group hands to split
    out["opts"] = (type(opts).__name__, opts.backend, list(opts.global_ranks_in_group))
    groups = {}
    # a 2 x 2 mesh's two dimensions: rows [0, 1] [2, 3] and columns [0, 2] [1, 3]
    for dim, layout in (("row", [[0, 1], [2, 3]]), ("col", [[0, 2], [1, 3]])):
        mine = next(g for g in layout if rank in g)
        groups[dim] = dist.group.WORLD.split_group(mine, opts=copy.deepcopy(opts),
                                                   group_name=f"test_split_{dim}_{mine}")
    # ranks outside a split get None; only rank 3 is in [3]
    lonely = dist.group.WORLD.split_group([3], opts=copy.deepcopy(opts), group_name="test_split_3")
    out["lonely"] = None if lonely is None else lonely.size()
    for dim, pg in groups.items():
        b = pg._get_backend(CPU)
        out[dim] = {"rank": pg.rank(), "size": pg.size(), "odc": isinstance(b, OdcBackend),
                    "global": b.global_ranks(), "name": b.options.group_name,
                    **_collectives(pg, 100.0 if dim == "row" else 200.0)}
        out[dim]["stats"] = backend_stats(pg)
    # a split of a split: the columns' second rank alone, keeping its global rank
    col = groups["col"]
    inner = col.split_group([1], opts=copy.deepcopy(col._get_backend(CPU).options),
                            group_name=f"test_split_inner_{rank}")
    out["nested"] = None if inner is None else inner._get_backend(CPU).global_ranks()
    # what new_group calls on the ranks outside a group split from a bound default group
    world_backend.perform_nocolor_split(CPU)
    # eager connect (init_process_group with device_id): the transport is set up at once
    world_backend.eager_connect_single_device(CPU)
    y = torch.empty(world)
    dist.all_gather_into_tensor(y, torch.tensor([float(rank)]))
    out["world_after"] = y.tolist()
    return out


def test_split_groups_are_odc_groups_that_work():
    world = 4
    res = run_distributed(_split_worker, world, backend="cpu:odc", deadline_s=120)
    for rank, out in res.items():
        assert out["supports"]
        assert out["opts"] == ("Options", "odc", [0, 1, 2, 3]), out["opts"]
        assert out["lonely"] == (1 if rank == 3 else None), (rank, out["lonely"])
        for dim, tag in (("row", 100.0), ("col", 200.0)):
            members = [[0, 1], [2, 3]] if dim == "row" else [[0, 2], [1, 3]]
            mine = next(g for g in members if rank in g)
            got = out[dim]
            assert got["odc"] and got["size"] == 2 and got["rank"] == mine.index(rank), (rank, got)
            assert got["global"] == mine, (rank, dim, got["global"])
            assert got["name"] == f"test_split_{dim}_{mine}", got["name"]
            assert got["ag"] == [tag + 0] * 3 + [tag + 1] * 3, (rank, dim, got["ag"])
            r = mine.index(rank)
            assert got["rs"] == [2 * (tag + 2 * r + i) for i in range(2)], (rank, dim, got["rs"])
            assert got["ar"] == [2 * tag + 1] * 2, (rank, dim, got["ar"])
            assert got["stats"]["all_gather_ops"] == 1 and got["stats"]["reduce_scatter_ops"] == 1
            assert got["stats"]["delegated_ops"] == 1, got["stats"]
        in_second_col = rank in (2, 3)
        assert out["nested"] == ([rank] if in_second_col else None), (rank, out["nested"])
        assert out["world_after"] == [0.0, 1.0, 2.0, 3.0]


def _new_group_worker(rank, world):
    """Without device_id: new_group and a 2-D init_device_mesh create odc groups anew."""
    from torch.distributed.device_mesh import init_device_mesh

    from torch_odc_backend import OdcBackend

    pair = dist.new_group([0, 1])
    out = {}
    if rank in (0, 1):
        y = torch.empty(2)
        dist.all_gather_into_tensor(y, torch.tensor([float(rank)]), group=pair)
        out["pair"] = y.tolist()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for dim in ("replicate", "shard"):
        g = mesh.get_group(dim)
        y = torch.empty(2)
        dist.all_gather_into_tensor(y, torch.tensor([float(rank)]), group=g)
        out[dim] = (isinstance(g._get_backend(CPU), OdcBackend), y.tolist())
    return out


def test_new_group_and_device_mesh_without_device_id():
    res = run_distributed(_new_group_worker, 4, backend="cpu:odc", deadline_s=120)
    for rank, out in res.items():
        if rank in (0, 1):
            assert out["pair"] == [0.0, 1.0]
        row, col = divmod(rank, 2)
        assert out["shard"] == (True, [2.0 * row, 2.0 * row + 1]), (rank, out["shard"])
        assert out["replicate"] == (True, [float(col), col + 2.0]), (rank, out["replicate"])
