"""verl's SFT trainer on CPU ranks, for the CPU tests (tests/integrations/test_verl.py).

verl has no CPU platform and no CPU engine, and its process-group set-up names
``cpu:gloo,<device>:<backend>``, which torch refuses when the device is the CPU. This entry
point adds what is missing through verl's public registries and runs verl's own trainer:
a "cpu" platform (``PlatformRegistry``; chosen with ``VERL_PLATFORM=cpu``), verl's own FSDP
engine registered for the CPU (``EngineRegistry``), and a ``cpu:gloo`` process group made
before the trainer, which then keeps it. Run under torchrun with the trainer's Hydra
overrides. The odc engine registers itself for the platform verl runs on when
``model.external_lib=torch_odc_backend.verl`` is given, as on GPUs.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch

os.environ.setdefault("VERL_PLATFORM", "cpu")
from verl.plugin.platform import PlatformBase, PlatformRegistry  # noqa: E402


class _CpuDeviceModule:
    """What verl calls on ``get_torch_device()``, for the CPU (no memory statistics)."""

    Stream = torch.cpu.Stream
    current_stream = staticmethod(torch.cpu.current_stream)
    stream = staticmethod(torch.cpu.stream)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def get_device_name(*_a, **_k):
        return "cpu"

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(*_a, **_k):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *_a, **_k):
        torch.set_rng_state(state)

    @staticmethod
    def mem_get_info(*_a, **_k):
        return (0, 0)

    @staticmethod
    def is_bf16_supported(*_a, **_k):
        return True

    @staticmethod
    def _zero(*_a, **_k):
        return 0

    memory_allocated = memory_reserved = max_memory_allocated = max_memory_reserved = _zero
    set_device = synchronize = empty_cache = reset_peak_memory_stats = ipc_collect = _zero
    set_per_process_memory_fraction = _zero


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CpuDeviceModule

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return False  # chosen by VERL_PLATFORM only

    def current_device(self):
        return "cpu"  # verl moves batches with .to(get_device_id())

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def ray_resource_options(self, num_gpus):
        return {"num_cpus": num_gpus}

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def register_verl_engines() -> None:
    """verl's own FSDP engines (language model and value model) for the CPU platform."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)


ULYSSES_ATTENTION = "cpu_ulysses"  # attn_implementation of the CPU runs with sequence parallelism


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      position_ids=None, **kwargs):
    """verl's Ulysses attention (``_ulysses_flash_attention_forward``) with PyTorch's SDPA, one
    call per packed sequence, in place of flash-attn's variable-length kernel. verl puts its
    all-to-alls into transformers' flash-attention path, which loads flash-attn on GPUs only;
    this does what verl's function does around that kernel, with verl's own all-to-alls: from
    (1, tokens / sp, heads) to (1, tokens, heads / sp) before attending, back after.
    ``query`` (1, heads, tokens / sp, dim), ``key``/``value`` (1, kv heads, tokens / sp, dim)."""
    import torch.distributed as dist
    from verl.utils.ulysses import (gather_heads_scatter_seq, gather_seq_scatter_heads,
                                    get_ulysses_sequence_parallel_group,
                                    get_ulysses_sequence_parallel_world_size)

    if query.shape[0] != 1 or position_ids is None:
        raise ValueError(f"{ULYSSES_ATTENTION}: expects one packed row with position_ids (use_remove_padding=True)")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (1, tokens / sp, heads, dim)
    sp = get_ulysses_sequence_parallel_world_size()
    if sp > 1:
        repeats = max(sp // k.size(2), 1)  # kv heads repeated up to the SP size, as verl does
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        q, k, v = (gather_seq_scatter_heads(t, seq_dim=1, head_dim=2) for t in (q, k, v))
        parts = [torch.empty_like(position_ids) for _ in range(sp)]
        dist.all_gather(parts, position_ids.contiguous(), group=get_ulysses_sequence_parallel_group())
        position_ids = torch.cat(parts, dim=-1)
    starts = torch.nonzero(position_ids.reshape(-1) == 0).flatten().tolist() + [q.shape[1]]
    groups = q.shape[2] // k.shape[2]
    out = torch.empty_like(q)
    for a, b in zip(starts[:-1], starts[1:]):
        qs, ks, vs = (t[0, a:b].transpose(0, 1) for t in (q, k, v))  # (heads, length, dim)
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=0), vs.repeat_interleave(groups, dim=0)
        out[0, a:b] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scaling).transpose(0, 1)
    if sp > 1:
        out = gather_heads_scatter_seq(out, seq_dim=1, head_dim=2)
    return out, None


def register_ulysses_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, lambda *args, **kwargs: None)


register_ulysses_attention()


class MovesStorage:
    """What an offload does on a GPU, on the CPU (a mixin, before verl's FSDP engine in the
    bases). verl's ``to("cpu")`` and ``to(<device>)`` move nothing when the device is the CPU,
    so that parameter and optimizer offload would be no-ops here; with this mixin every
    ``to(..., model=True)`` also gives each parameter (and buffer) new storage holding the same
    values, as a round trip to another device does (``Module._apply``, which ``Module.to``
    runs), and ``optimizer=True`` each optimizer state tensor."""

    def to(self, device, model=True, optimizer=True, grad=True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if self.engine_config.forward_only:
            return
        with torch.no_grad():
            if model:
                self.module._apply(lambda t: t.clone())
            if optimizer and self.optimizer is not None:
                for state in self.optimizer.state.values():
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            state[key] = value.clone()


MOVES_STORAGE = "moves_storage"  # the vendor name of the engines below (VERL_ENGINE_VENDOR)


def register_storage_moving_engines(odc: bool) -> None:
    """verl's FSDP engines (``odc``: odc's) with :class:`MovesStorage`, for the CPU platform
    under the vendor ``moves_storage``: runs with ``VERL_ENGINE_VENDOR=moves_storage`` get them.
    Call after ``import torch_odc_backend.verl`` for odc's."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, base in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        bases = (MovesStorage, base)
        if odc:
            from torch_odc_backend.verl.engine import _OdcEngine

            bases = (_OdcEngine, *bases)
        engine = type(f"StorageMoving{'Odc' if odc else ''}{base.__name__}", bases, {})
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu",
                                vendor=MOVES_STORAGE)(engine)


def main() -> None:
    import hydra
    import torch.distributed as dist
    import verl.trainer.sft_trainer as sft
    from verl.utils.device import auto_set_device

    register_verl_engines()

    @hydra.main(config_path=os.path.join(os.path.dirname(sft.__file__), "config"),
                config_name="sft_trainer_engine", version_base=None)
    def run(config):
        auto_set_device(config)
        dist.init_process_group(backend="cpu:gloo", timeout=timedelta(seconds=300))
        sft.SFTTrainer(config=config).fit()
        sft.destroy_global_process_group()

    run()


if __name__ == "__main__":
    sys.exit(main())
