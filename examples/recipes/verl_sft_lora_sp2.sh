#!/usr/bin/env bash
# verl's SFT trainer with the settings of verl's gsm8k SFT examples for Qwen3-8B
# (examples/sft/gsm8k in verl: sft_trainer, dynamic batch size, 32 sequences a step) and of its
# LoRA + Ulysses example (run_qwen_05_peft_sp2: LoRA rank 32, alpha 16, all linear layers,
# ulysses_sequence_parallel_size=2), on a Qwen2-style model of random weights with
# long-tailed answers: verl's FSDP2 engine, then the same run with the one setting
# model.external_lib=torch_odc_backend.verl, compared (examples/recipes/verl_sft.py compare).
#
#   bash examples/recipes/verl_sft_lora_sp2.sh [NPROC] [verl_sft.py compare options...]
#   e.g. bash examples/recipes/verl_sft_lora_sp2.sh 8 --size 1.5b --steps 20
#   DEVICE=cpu bash examples/recipes/verl_sft_lora_sp2.sh 4     # CPU ranks, fp32 (CI's check)
#
# Needs verl 0.9.1 (docs/trainers.md); on GPUs flash-attn, where verl's Ulysses all-to-alls
# are. NPROC must be a multiple of 2 (the SP size); with 4 or more there are several SP groups
# to balance. The result and logs go to $WORK (default /tmp/odc_verl_sft_lora_sp2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
NPROC=${1:-4}
shift $(( $# > 0 ? 1 : 0 ))
WORK=${WORK:-/tmp/odc_verl_sft_lora_sp2}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}

FEATURES=(--lora-rank 32 --lora-alpha 16 --sp 2)
if [ "$DEVICE" = cpu ]; then
    # verl has no CPU engine or Ulysses attention without flash-attn: the CPU shim adds both;
    # short sequences and a small token budget, so that SP groups run different microbatch counts
    SETTINGS=(--device cpu --entry tests/integrations/verl_cpu_shim/sft_cpu.py --steps 4 --batch 16 --rows 64
              --max-words 150 --max-tokens 256 --lr 1e-3 --rtol 1e-6)
else
    # the examples' batch (32 sequences) and learning rate; a token budget per GPU that leaves
    # several microbatches a step on these short sequences (the examples' 8192 fits a step in one)
    SETTINGS=(--device cuda --steps 8 --batch 32 --rows 512 --max-tokens 1024 --lr 1e-5)
fi
set -x
"$PY" examples/recipes/verl_sft.py compare --work "$WORK" --nproc "$NPROC" "${SETTINGS[@]}" "${FEATURES[@]}" "$@"
