"""odc in verl: FSDP2 engines whose data-parallel groups are odc's, in decoupled mode.

Load it the way verl loads any extension, with no change to verl::

    model.external_lib=torch_odc_backend.verl

Importing this module registers :class:`OdcFSDPEngineWithLMHead` (actor, SFT, reference) and
:class:`OdcFSDPEngineWithValueHead` (critic) in verl's ``EngineRegistry`` for NVIDIA GPUs, where
verl looks them up before its own FSDP engines. Each engine keeps verl's behaviour (model
building, ``fully_shard``, mixed precision, loss, clipping, checkpoints) and changes three
things, for the roles ``ODC_VERL_ROLES`` names (actor and critic unless set; ``none``: off):

* the FSDP mesh is made of odc groups (NCCL's world group, which verl uses for everything
  else, is untouched);
* a training minibatch is spread over the data-parallel ranks by LB-Mini
  (:mod:`torch_odc_backend.balance`) from the samples' lengths, so ranks run different numbers
  of microbatches, and no rank pads to another's count;
* the model runs in decoupled mode (:func:`torch_odc_backend.decouple`): no rank waits for
  another between two optimizer steps; ``odc.sync`` runs before verl clips the gradients.

With Ulysses sequence parallelism the minibatch is balanced over the SP groups (an SP group's
ranks train the same microbatches, in the same order); LoRA and parameter / optimizer offload
run as in verl's engine.

Details, limits and measurements: docs/trainers.md (verl).
"""
from __future__ import annotations

from .engine import OdcFSDPEngineWithLMHead, OdcFSDPEngineWithValueHead, register

__all__ = ["OdcFSDPEngineWithLMHead", "OdcFSDPEngineWithValueHead", "register"]

register()
