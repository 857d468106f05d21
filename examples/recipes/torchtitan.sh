#!/usr/bin/env bash
# torchtitan's llama3 debug model on odc with no code change: ODC_DEFAULT_BACKEND=cuda alone.
#
#   bash examples/recipes/torchtitan.sh [NPROC] [torchtitan overrides...]
#   e.g. bash examples/recipes/torchtitan.sh 2 --training.steps 20
#
# Needs torchtitan 0.2.x (pip install torchtitan==0.2.2) and CUDA (torchtitan trains on
# accelerators only; ranks may share a GPU: odc serves them, NCCL would refuse). The job
# config and the small tokenizer / data set it reads are written to $WORK (default
# /tmp/odc_torchtitan) by torchtitan_debug.py prepare; `torchtitan_debug.py compare` checks
# the losses against a reference. Everything after NPROC goes to torchtitan.train.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
NPROC=${1:-2}
shift $(( $# > 0 ? 1 : 0 ))
WORK=${WORK:-/tmp/odc_torchtitan}
PY=${PYTHON:-python3}

# NVLink multicast stays off on the machines this was tested on (see the README)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the data set is local: nothing is fetched from a hub
export HF_HOME="$WORK/hf_home" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

"$PY" examples/recipes/torchtitan_debug.py prepare --work "$WORK" --nproc "$NPROC"
# The switch acts through the installed package's torch.backends entry point; a checkout
# used through PYTHONPATH gets the same record in $WORK/odc_entry_point.
ENTRY=$("$PY" examples/recipes/odc_entry_point.py "$WORK/odc_entry_point")
export PYTHONPATH="$PWD${ENTRY:+:$ENTRY}${PYTHONPATH:+:$PYTHONPATH}"

set -x
ODC_DEFAULT_BACKEND=cuda "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
    -m torchtitan.train --job.config_file "$WORK/debug_model.toml" "$@"
