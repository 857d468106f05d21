"""The one place that reads FSDP2 private state (decoupled mode needs the mixed-precision
policy and the gradient divide factor, which FSDP2 exposes no getter for, and which
Parameter and storage FSDP2 gathers each sharded parameter from;
``ODC_FSDP_REGISTERED_MEMORY`` needs the process groups a module communicates on).

Checked against torch 2.11, 2.13, 2.14 and 2.15 (tests/test_decoupled.py exercises it); other
versions are refused with a message rather than read blindly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_TORCH = ("2.11", "2.12", "2.13", "2.14", "2.15")


@dataclass(frozen=True)
class GroupPolicy:
    param_dtype: torch.dtype | None  # None: the parameters' own dtype
    reduce_dtype: torch.dtype | None  # None: the param dtype
    gradient_divide_factor: float | None  # None: FSDP2's default (data-parallel size)
    force_sum_reduction: bool
    params: tuple  # the group's sharded parameters (DTensor nn.Parameters), in all-gather order
    padded_shard_sizes: tuple  # torch.Size of each parameter's zero-padded shard


def _check_version(full_version: str | None = None) -> None:
    full_version = full_version or torch.__version__
    version = ".".join(full_version.split(".")[:2])
    if version not in SUPPORTED_TORCH:
        raise RuntimeError(
            f"odc decoupled mode reads FSDP2 internals that were checked on torch "
            f"{', '.join(SUPPORTED_TORCH)}; this is torch {full_version}")


def _param_groups(module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # 2.13: a list
    if groups is None:
        group = state._fsdp_param_group  # 2.11: one or None
        groups = [] if group is None else [group]
    return list(groups)


def group_policy(module) -> GroupPolicy | None:
    """The policy of ``module``'s FSDP parameter group, or None when it manages no parameters."""
    _check_version()
    groups = _param_groups(module)
    if not groups:
        return None
    if len(groups) > 1:
        raise ValueError("odc decoupled mode supports one FSDP parameter group per module "
                         "(do not pass shard_placement_fn groups)")
    g = groups[0]
    param_dtype, reduce_dtype = _group_dtypes(g)
    return GroupPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                       gradient_divide_factor=getattr(g, "gradient_divide_factor", None),
                       force_sum_reduction=bool(getattr(g, "force_sum_reduction_for_comms", False)),
                       params=tuple(fp.sharded_param for fp in g.fsdp_params),
                       padded_shard_sizes=tuple(fp.padded_sharded_param_size for fp in g.fsdp_params))


def _group_dtypes(g) -> tuple:
    """(param_dtype, reduce_dtype) of a parameter group, as GroupPolicy documents them."""
    mp = getattr(g, "mp_policy", None)
    if mp is not None:  # torch <= 2.14: one policy per group
        return mp.param_dtype, mp.reduce_dtype
    # torch 2.15: a policy per parameter (MixedPrecisionPolicy.param_dtype_override_fn), and
    # reduce_dtype=None reduces in the gradient's dtype (the parameter's own unless grad_dtype
    # was set), no longer in param_dtype
    policies = {(fp.mp_policy.param_dtype, fp.mp_policy.reduce_dtype) for fp in g.fsdp_params}
    if len(policies) != 1:
        raise ValueError("odc decoupled mode supports one mixed-precision policy per FSDP module "
                         "(no param_dtype_override_fn that changes it)")
    param_dtype, reduce_dtype = policies.pop()
    if reduce_dtype is None:
        if any(getattr(fp, "_has_sharded_grad_dtype_override", False) for fp in g.fsdp_params):
            raise ValueError("odc decoupled mode: set MixedPrecisionPolicy.reduce_dtype when "
                             "parameters have a grad_dtype of their own")
        reduce_dtype = g.fsdp_params[0].sharded_param.dtype
    return param_dtype, reduce_dtype


@dataclass(frozen=True)
class ShardBinding:
    """What FSDP2 holds now for one sharded parameter of a module's group."""
    param: object  # the sharded parameter FSDP2 gathers and reduces into (nn.Parameter(DTensor))
    module: torch.nn.Module  # the module it is an attribute of
    attr: str  # its attribute name there
    # what ``module.<attr>`` is now while FSDP2 has the sharded parameter registered there
    # (sharded state); None while the module holds an unsharded one (inside forward/backward)
    registered: object | None
    all_gather_input: torch.Tensor  # FSDP2's all-gather input: this rank's padded shard, flat


def shard_bindings(module) -> list[ShardBinding]:
    """Per sharded parameter of ``module``'s FSDP group (all-gather order): the Parameter
    FSDP2 uses, where it is registered and the storage FSDP2 all-gathers it from.
    ``load_state_dict(assign=True)`` makes FSDP2 take the new Parameter (its post-load hook,
    ``reset_sharded_param``); an attribute assignment FSDP2 does not see until it restores
    its own at the next reshard; ``nn.Module._apply`` (``model.to()``) keeps the Parameter
    and gives it a new local shard, which FSDP2 re-pads into a new all-gather input."""
    _check_version()
    out = []
    for g in _param_groups(module):
        for fp in g.fsdp_params:
            info = fp._module_info
            sharded = getattr(fp.sharded_state, "name", None) == "SHARDED"
            registered = getattr(info.module, info.param_name, None) if sharded else None
            out.append(ShardBinding(param=fp.sharded_param, module=info.module,
                                    attr=info.param_name, registered=registered,
                                    all_gather_input=fp._sharded_param_data))
    return out


def default_comms_on(module, backend_type: type,
                     device_types: tuple[str, ...] = ("cpu", "cuda")) -> bool:
    """Whether ``module`` has FSDP parameter groups and each, on a device of ``device_types``,
    all-gathers and reduce-scatters on a process group whose backend for its device is a
    ``backend_type``, with FSDP2's default communication (no custom all-gather /
    reduce-scatter, no symmetric memory)."""
    _check_version()
    groups = _param_groups(module)
    for g in groups:
        if g.device.type not in device_types:
            return False
        if (type(g._all_gather_comm).__name__ != "DefaultAllGather"
                or type(g._reduce_scatter_comm).__name__ != "DefaultReduceScatter"):
            return False
        for pg in (g._all_gather_process_group, g._reduce_scatter_process_group):
            if not isinstance(pg._get_backend(g.device), backend_type):
                return False
    return bool(groups)
