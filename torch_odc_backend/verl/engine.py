"""verl's FSDP2 engines on odc groups, in decoupled mode with LB-Mini microbatches.

Subclasses of verl's ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` that override five
of their methods and nothing else of verl: ``_init_device_mesh`` (odc groups),
``_build_fsdp_module`` (registered memory on GPUs), ``forward_backward_batch`` (this rank's
LB-Mini share of the minibatch, decoupled; with Ulysses SP its SP group's share),
``optimizer_step`` (``odc.sync`` first) and ``to`` (verl's offload and load: odc follows the
parameters' moves).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

import torch_odc_backend as odc

from ..balance import DynamicBalancer, TransformerCost
from ..config import verl_balance, verl_roles
from .minibatch import claimed_microbatches, odc_mesh_like, share_of_minibatch

__all__ = ["OdcFSDPEngineWithLMHead", "OdcFSDPEngineWithValueHead", "register"]


class _OdcEngine:
    """What the odc engines add to verl's FSDP engine (a mixin: it comes first in the bases)."""

    def _init_device_mesh(self):
        super()._init_device_mesh()
        self.odc_role = ("critic" if isinstance(self, FSDPEngineWithValueHead)
                         else "reference" if self.engine_config.forward_only else "actor")
        self.odc_enabled = self.odc_role in verl_roles()
        self._odc_decoupled = False
        self._odc_unsynced = False
        self._odc_cost = None  # LB-Mini's cost model, from the model's config at first use
        self._odc_balancer = None  # ODC_VERL_BALANCE=dynamic: made at the first minibatch
        self._odc_sp_leaders = None  # dynamic balancing with Ulysses SP: the SP groups' first ranks
        if self.odc_enabled:
            self.odc_balance = verl_balance()
            self._refuse_unsupported()
            self.device_mesh = odc_mesh_like(self.device_mesh)
            if self.odc_balance == "dynamic" and self.ulysses_sequence_parallel_size > 1:
                # one rank per SP group claims microbatches (the SP groups share the minibatch);
                # made here, where every rank makes its groups in the same order
                leaders = self.ulysses_device_mesh.mesh[:, 0].tolist()
                self._odc_sp_leaders = (leaders, dist.new_group(
                    ranks=leaders, backend=f"{self.device_mesh.device_type}:odc"))

    def _refuse_unsupported(self) -> None:
        """A ValueError naming each setting the odc engine cannot run with, and the way out."""
        cfg = self.engine_config
        way_out = f"or set ODC_VERL_ROLES to leave the {self.odc_role} on verl's engine (docs/trainers.md)"
        unsupported = {
            f"engine.strategy={cfg.strategy}: odc serves FSDP2 only; set engine.strategy=fsdp2 "
            f"(actor_rollout_ref.actor.strategy / critic.strategy in verl's PPO trainer) {way_out}":
                cfg.strategy != "fsdp2",
            "ODC_VERL_BALANCE=dynamic with engine.fsdp_size below the data-parallel size (HSDP): "
            "dynamic balancing needs a 1-D mesh; unset ODC_VERL_BALANCE (LB-Mini balances HSDP), "
            f"set engine.fsdp_size=-1, {way_out}":
                self.odc_balance == "dynamic" and self.device_mesh.ndim > 1,
        }
        found = [what for what, on in unsupported.items() if on]
        if found:
            raise ValueError(f"torch_odc_backend.verl ({self.odc_role}): not supported: " + "; ".join(found))

    def _build_fsdp_module(self, module):
        module = super()._build_fsdp_module(module)
        if self.odc_enabled and self.device_mesh.device_type == "cuda":
            odc.use_registered_memory(module)  # zero-copy collectives before decoupling
        return module

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if forward_only or not self.odc_enabled:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        if not self._odc_decoupled:  # at the first minibatch: after verl loaded any checkpoint
            odc.decouple(self.module, self.optimizer)
            self._odc_decoupled = True
        if tu.get_non_tensor_data(data=data, key="return_model_output", default=False):
            raise ValueError("torch_odc_backend.verl: return_model_output is not supported (a rank "
                             "trains other ranks' samples: their outputs are not its own)")
        # Ulysses SP: the ranks of an SP group hold the same samples and train the same
        # microbatches in the same order (their all-to-alls stay on verl's SP group); the
        # data-parallel group, over which the minibatch is balanced, has one rank per SP group
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        # the loss is normalised by the minibatch's tokens over every rank, as verl does
        tokens = data["loss_mask"].sum().to(get_device_id())
        dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.get_data_parallel_size())

        scaler = getattr(self, "scaler", None)
        outputs = []
        micro_batches = self._microbatches(data)
        # HSDP: the largest microbatch last, announced, so the cross-replica all-reduce of each
        # gradient shard starts during its backward instead of in odc.sync (LB-Mini lists a
        # rank's microbatches most expensive first)
        announce = self.device_mesh.ndim > 1 and isinstance(micro_batches, list)
        if announce:
            micro_batches = micro_batches[::-1]
        for i, micro_batch in enumerate(micro_batches):
            if announce and i == len(micro_batches) - 1:
                odc.last_microbatch(self.module)
            with torch.profiler.record_function(f"micro_batch{i}"):
                loss, meta = self.forward_step(micro_batch, loss_function=loss_function, forward_only=False)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                meta.pop("model_output", None)
            outputs.append(meta)
        self._odc_unsynced = True
        out = postprocess_batch_func(output_lst=outputs, indices=None, data=data)
        _one_value_per_rank(out["metrics"], self.get_data_parallel_group())
        out["metrics"]["odc/microbatches"] = [len(outputs)]  # this rank's count (verl gathers them)
        # groups whose cross-replica all-reduce started early, over the minibatches before this one
        out["metrics"]["odc/early_all_reduces"] = [odc.metrics(self.module)["early_all_reduces"]]
        return out

    def _microbatches(self, data):
        """This rank's microbatches of the minibatch: with verl's dynamic batch size (token
        budget ``max_token_len_per_gpu``), its LB-Mini share of every rank's samples, or the
        ones it claims as it goes (``ODC_VERL_BALANCE=dynamic``); with a fixed microbatch
        size, its own samples, chunked as verl chunks them."""
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            return prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=False)[0]
        if self._odc_cost is None:
            self._odc_cost = TransformerCost.from_hf_config(self.model_config.hf_config)
        # an SP group's microbatch holds max_token_len_per_gpu tokens per rank, as in verl
        sp = self.ulysses_sequence_parallel_size
        how = dict(max_tokens=int(data["max_token_len_per_gpu"]) * sp, cost=self._odc_cost,
                   group=self.get_data_parallel_group())
        if self.odc_balance == "dynamic":
            if self._odc_sp_leaders is None:
                if self._odc_balancer is None:  # claims through the odc group's store
                    self._odc_balancer = DynamicBalancer(self.device_mesh.get_group(), name=f"verl_{self.odc_role}")
                return claimed_microbatches(data, balancer=self._odc_balancer, **how)
            leaders, group = self._odc_sp_leaders
            leader = leaders[self.get_data_parallel_rank()]
            if self._odc_balancer is None and dist.get_rank() == leader:
                self._odc_balancer = DynamicBalancer(group, name=f"verl_{self.odc_role}")
            return claimed_microbatches(data, balancer=self._odc_balancer, sp_group=self.ulysses_parallel_group,
                                        sp_leader=leader, **how)
        return share_of_minibatch(data, **how)

    def optimizer_step(self):
        if self._odc_unsynced:  # the one synchronisation of the minibatch; .grad is final after it
            odc.sync(self.module)
            self._odc_unsynced = False
        return super().optimizer_step()

    def to(self, device, model=True, optimizer=True, grad=True):
        """verl's offload and load between phases (``param_offload`` / ``optimizer_offload``, and
        any other call), always between minibatches: odc gives back what decoupled mode holds
        on the device (``odc.release``: its arena, and its references to the parameters'
        shards, which would keep offloaded storage on the GPU) before the parameters move, and
        takes it again once they are on the mesh's device (``odc.restore``: a new arena, the
        moved shards published), so it never reads storage a move left behind."""
        moving = model and self.odc_enabled and self._odc_decoupled
        if moving:
            odc.release(self.module)
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if moving and _on_mesh_device(self.module):
            odc.restore(self.module)


def _on_mesh_device(module) -> bool:
    """Whether ``module``'s parameters are on its mesh's device (loaded), not offloaded."""
    p = next(module.parameters())
    return p.device.type == p.device_mesh.device_type


def _one_value_per_rank(metrics: dict, group) -> None:
    """verl's losses report ``Metric`` values, one per microbatch, and verl aggregates them
    over the data-parallel ranks position by position (``Metric.aggregate_dp``), which needs
    the same count from every rank. Here counts differ, so each rank's values become one
    (their sum, mean, min or max): see :func:`fill_rank_metrics`. Collective over ``group``."""
    mine = {k: (v.aggregation.value, float(Metric._aggregate(v.values, v.aggregation)))
            for k, v in metrics.items() if isinstance(v, Metric) and v.values}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for key, (aggregation, value) in fill_rank_metrics(everyone, dist.get_rank(group)).items():
        metrics[key] = Metric(AggregationType(aggregation), value)


def fill_rank_metrics(everyone: list[dict], rank: int) -> dict:
    """Rank ``rank``'s one value per metric, from every rank's ``{key: (aggregation, value)}``.
    A rank that has no value of a metric the others have (it ran no microbatch) reports what
    leaves verl's aggregate (the mean over ranks of each rank's value, or the min / max)
    unchanged: 0 for a sum, the others' mean for a mean, their min or max."""
    out = {}
    for key in sorted({k for r in everyone for k in r}):
        if key in everyone[rank]:
            out[key] = everyone[rank][key]
            continue
        aggregation = next(r[key][0] for r in everyone if key in r)
        values = [r[key][1] for r in everyone if key in r]
        if aggregation == "sum":
            out[key] = (aggregation, 0.0)
        else:
            out[key] = (aggregation, float(Metric._aggregate(values, AggregationType(aggregation))))
    return out


class OdcFSDPEngineWithLMHead(_OdcEngine, FSDPEngineWithLMHead):
    """verl's language-model FSDP2 engine (actor, SFT, reference) on odc."""


class OdcFSDPEngineWithValueHead(_OdcEngine, FSDPEngineWithValueHead):
    """verl's value-model FSDP2 engine (critic) on odc."""


def register(device: str | None = None, vendor: str | None = None) -> None:
    """Register both engines for verl's ``fsdp2`` strategy on ``(device, vendor)``, by default
    the platform verl runs on (NVIDIA GPUs: ``("cuda", "nvidia")``): verl's ``EngineRegistry``
    looks that key up before its own device-wide FSDP engines."""
    from verl.utils.device import get_device_name, get_vendor

    device = device or get_device_name()
    vendor = vendor or get_vendor()
    if device not in ("cuda", "cpu"):
        raise ValueError(f"torch_odc_backend.verl: odc runs on CUDA GPUs and CPUs, not on {device!r}")
    for model_type, engine in (("language_model", OdcFSDPEngineWithLMHead),
                               ("value_model", OdcFSDPEngineWithValueHead)):
        EngineRegistry.register(model_type=model_type, backend="fsdp2", device=device, vendor=vendor)(engine)
