"""Test-only: a Python process with this folder on its ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up) leaves its objects to the OS at exit instead of collecting them.
The recipes' CPU tests put it there for every process they start (tests/integrations/verl_env.py,
tests/integrations/recipe_compare.py): the recipe's ``compare``, torchrun's agents, the ranks.
The CPU shims that are a ``sitecustomize`` of their own (hf_cpu_shim, megatron_fsdp_cpu_shim,
torchtitan_cpu_shim), first on their ranks' ``PYTHONPATH``, do the same themselves.

At exit the interpreter's final garbage collections walk the whole object graph of what the
process imported: with verl, transformers and torch about 1.4 s of CPU a rank (torchtitan,
Lightning, the Hugging Face Trainer about 1 s, a torchrun agent 0.4 s), on CI's 2 cores 1.5 s
of a 2-rank run's wall time and 3.4 s of a 4-rank one's. ``gc.freeze()``, registered here before
anything else, runs after every other exit handler (atexit runs them last-in, first-out: odc's
ODC_STATS_DIR writer among them) and keeps those collections from walking the objects there
are then. Every exit handler still runs, ``sys.stdout`` / ``sys.stderr`` are still flushed (the
trainers' loggers and result files are closed or written unbuffered before), and odc leaves
nothing in /dev/shm to a destructor (its windows are unlinked once mapped): what the runs leave
behind is the same. It changes nothing in the trainers, the recipes or odc.
"""
import atexit
import gc

atexit.register(gc.freeze)
