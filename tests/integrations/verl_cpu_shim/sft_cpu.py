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
