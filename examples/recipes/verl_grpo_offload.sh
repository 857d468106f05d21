#!/usr/bin/env bash
# verl's GRPO actor update with parameter and optimizer offload, with the actor settings of
# verl's GRPO examples (examples/grpo_trainer in verl, e.g. run_qwen2-7b_seq_balance.sh: GRPO
# advantages, 5 responses a prompt, dynamic batch size, remove-padding) and
# actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload on, on a Qwen2-style
# model of random weights: verl's FSDP2 engine, then the same update with the one setting
# (import torch_odc_backend.verl, what model.external_lib=torch_odc_backend.verl does),
# compared (examples/recipes/verl_actor_update.py compare: rollouts made beforehand, no
# rollout engine). Between two updates verl offloads the model and the optimizer state to
# the host and loads them back, as in a PPO step.
#
#   bash examples/recipes/verl_grpo_offload.sh [NPROC] [verl_actor_update.py compare options...]
#   e.g. bash examples/recipes/verl_grpo_offload.sh 8 --size 1.5b --steps 6
#   DEVICE=cpu bash examples/recipes/verl_grpo_offload.sh 2     # CPU ranks, fp32 (CI's check)
#
# Needs verl 0.9.1 (docs/trainers.md). The examples' KL loss (use_kl_loss) is left out: it needs
# the reference model's log-probabilities, which these rollouts do not carry. The result and
# logs go to $WORK (default /tmp/odc_verl_grpo_offload).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
NPROC=${1:-4}
shift $(( $# > 0 ? 1 : 0 ))
WORK=${WORK:-/tmp/odc_verl_grpo_offload}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}

FEATURES=(--offload --rollout-n 5 --prompts 16 --minibatches 2)
if [ "$DEVICE" = cpu ]; then
    # on the CPU an offload moves nothing: the CPU shim's engines move every parameter and
    # optimizer state to new storage in each offload and load instead, as a GPU offload does
    SETTINGS=(--device cpu --entry tests/integrations/verl_cpu_shim/sft_cpu.py --steps 2 --max-prompt 32
              --max-response 448 --max-tokens 640 --rtol 1e-6)
else
    SETTINGS=(--device cuda --steps 4 --max-prompt 512 --max-response 1024 --max-tokens 4096)
fi
set -x
"$PY" examples/recipes/verl_actor_update.py compare --work "$WORK" --nproc "$NPROC" "${SETTINGS[@]}" "${FEATURES[@]}" "$@"
