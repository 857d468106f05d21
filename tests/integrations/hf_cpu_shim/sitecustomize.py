"""Test-only: lets the Hugging Face Trainer run FSDP2 on CPU through accelerate, so that CI,
which has no GPU, can run examples/recipes/hf_trainer_fsdp2.py (exact and decoupled mode)
on odc.

Put this folder first on the ranks' PYTHONPATH (Python imports ``sitecustomize`` at
start-up). It changes nothing in transformers or in the recipe. It sets
``ACCELERATE_USE_CPU=1`` (what ``TrainingArguments(use_cpu=True)`` would do: the Trainer
reads it in ``_setup_devices``) and, when ``accelerate.state`` is imported, lifts the two
restrictions of accelerate 1.15 that keep FSDP and odc off CPUs:
- ``PartialState._prepare_backend`` replaces every CPU backend but mpi by "gloo" (state.py,
  the ``cpu`` branch), and ``PartialState.__init__`` then refuses a ``ddp_backend`` that it
  replaced ("Your assigned backend ... is not available"): a backend the Trainer names
  (e.g. "odc") is kept; with none named, accelerate's own choice (gloo) stays;
- ``AcceleratorState.__init__`` turns FSDP on only for GPU-type distributed types
  (MULTI_GPU, MULTI_XPU, ...; on MULTI_CPU the Trainer would silently wrap the model in DDP):
  with an FSDP plugin on MULTI_CPU the state becomes FSDP as on GPUs.
"""
import atexit
import gc
import importlib.abc
import importlib.machinery
import os
import sys

atexit.register(gc.freeze)  # as tests/integrations/fast_exit/sitecustomize.py, which this one shadows

os.environ.setdefault("ACCELERATE_USE_CPU", "1")


def _patch(state) -> None:
    from accelerate.utils import DistributedType

    prepare_backend = state.PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = prepare_backend(self, cpu, sagemaker_dp, backend)
        if cpu and backend is not None and distributed_type == DistributedType.MULTI_CPU:
            chosen = backend  # e.g. "odc": accelerate would force "gloo"
        return chosen, distributed_type

    accelerator_state_init = state.AcceleratorState.__init__

    def _accelerator_state_init(self, *args, fsdp_plugin=None, **kwargs):
        accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    state.PartialState._prepare_backend = _prepare_backend
    state.AcceleratorState.__init__ = _accelerator_state_init


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches accelerate.state right after it is imported (not before: most processes that
    see this folder, e.g. torchrun's launcher, never import accelerate)."""

    NAME = "accelerate.state"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


sys.meta_path.insert(0, _PatchAfterImport())
