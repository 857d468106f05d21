#!/usr/bin/env bash
# The one-GPU lab: W ranks co-resident on one GPU under a private MPS daemon.
#
#   bash benchmarks/lab.sh --ranks 2 [--sm-share] [--timeout 500] -- \
#       benchmarks/collectives.py --reference odc-nocheck --sizes 4K,64K,1M,16M,256M
#
# What it does, in order:
#   * exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (NVLink
#     multicast off) and ODC_LAB_MPS=1 (the benchmarks then name their results
#     <benchmark>_<gpu>-mps-x<W>_<date>.json and record the lab's settings);
#   * starts a private MPS control daemon (nvidia-cuda-mps-control -d) whose pipe and log
#     directories are under a fresh mktemp -d, so it serves only this command;
#   * with --sm-share, exports CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / W)): every rank (an MPS
#     client) is held to 1/W of the SMs;
#   * runs torchrun --standalone --nproc-per-node=W <script> <args> (under `timeout` with
#     --timeout SECONDS);
#   * always stops the daemon (echo quit | nvidia-cuda-mps-control): a trap on EXIT, also when the
#     run fails, times out or the script gets INT / TERM / HUP. (Only SIGKILL of this script
#     skips it: keep --timeout below any outer limit.)
# It never changes the GPU's compute mode, clocks or any other GPU setting.
#
# Environment: TORCHRUN (default: torchrun on PATH, else "$PYTHON -m torch.distributed.run"),
# PYTHON (default python3), LAB_KEEP_LOGS=1 keeps the MPS logs directory.
set -u

usage() {
  sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

RANKS=2
SM_SHARE=0
TIMEOUT_S=0
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS="${2:-}"; shift 2 ;;
    --ranks=*) RANKS="${1#*=}"; shift ;;
    --sm-share) SM_SHARE=1; shift ;;
    --timeout) TIMEOUT_S="${2:-}"; shift 2 ;;
    --timeout=*) TIMEOUT_S="${1#*=}"; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) echo "lab.sh: unknown option '$1' (the script and its arguments go after --)" >&2; usage ;;
  esac
done
case "$RANKS" in ''|*[!0-9]*) echo "lab.sh: --ranks wants a positive integer, got '$RANKS'" >&2; exit 2 ;; esac
case "$TIMEOUT_S" in ''|*[!0-9]*) echo "lab.sh: --timeout wants seconds, got '$TIMEOUT_S'" >&2; exit 2 ;; esac
if [ "$RANKS" -lt 1 ] || [ "$RANKS" -gt 100 ]; then
  echo "lab.sh: --ranks must be 1..100, got $RANKS" >&2; exit 2
fi
if [ $# -eq 0 ]; then
  echo "lab.sh: no script given (put it after --)" >&2; usage
fi

log() { echo "[lab $(date -u +%H:%M:%S)] $*" >&2; }

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo "lab.sh: nvidia-cuda-mps-control not found on PATH: the lab needs the CUDA MPS control" \
       "daemon (it ships with the NVIDIA driver utilities). Without MPS, ranks sharing a GPU" \
       "time-slice and every collective takes one time slice (~2 ms): nothing to measure." >&2
  exit 3
fi

if [ -n "${TORCHRUN:-}" ]; then
  read -r -a LAUNCH <<< "$TORCHRUN"
elif command -v torchrun >/dev/null 2>&1; then
  LAUNCH=(torchrun)
else
  LAUNCH=("${PYTHON:-python3}" -m torch.distributed.run)
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ODC_LAB_MPS=1

LAB_DIR="$(mktemp -d "${TMPDIR:-/tmp}/odc-lab.XXXXXX")" || { echo "lab.sh: mktemp failed" >&2; exit 1; }
export CUDA_MPS_PIPE_DIRECTORY="$LAB_DIR/mps"
export CUDA_MPS_LOG_DIRECTORY="$LAB_DIR/mpslog"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"

DAEMON_UP=0
CHILD=""
RC=0

stop_daemon() {
  # Runs once, on EXIT (also after INT / TERM / HUP, which exit through it).
  trap - EXIT INT TERM HUP
  if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
    log "stopping the run (pid $CHILD)"
    kill -TERM "$CHILD" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$CHILD" 2>/dev/null || break; sleep 1; done
    kill -0 "$CHILD" 2>/dev/null && kill -KILL "$CHILD" 2>/dev/null
    wait "$CHILD" 2>/dev/null
  fi
  if [ "$DAEMON_UP" = 1 ]; then
    log "stopping the MPS daemon ($CUDA_MPS_PIPE_DIRECTORY)"
    if ! echo quit | timeout 60 nvidia-cuda-mps-control; then
      log "WARNING: 'echo quit | nvidia-cuda-mps-control' failed or timed out; the daemon may still" \
          "run: stop it with CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY; echo quit | nvidia-cuda-mps-control"
      [ "$RC" = 0 ] && RC=5
    else
      for _ in $(seq 1 10); do  # give the daemon a moment to go (it may remove its pipe)
        [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || break
        sleep 0.5
      done
    fi
  fi
  if [ "$RC" != 0 ] && [ -d "$CUDA_MPS_LOG_DIRECTORY" ]; then
    for f in "$CUDA_MPS_LOG_DIRECTORY"/control.log "$CUDA_MPS_LOG_DIRECTORY"/server.log; do
      [ -s "$f" ] && { log "tail of $f:"; tail -n 20 "$f" >&2; }
    done
  fi
  if [ "${LAB_KEEP_LOGS:-0}" = 1 ]; then
    log "MPS logs kept in $CUDA_MPS_LOG_DIRECTORY"
  else
    rm -rf "$LAB_DIR"
  fi
  log "exit $RC"
  exit "$RC"
}
trap stop_daemon EXIT
trap 'RC=130; exit 130' INT
trap 'RC=143; exit 143' TERM
trap 'RC=129; exit 129' HUP

if command -v nvidia-smi >/dev/null 2>&1; then  # read only: name, compute mode
  log "GPU: $(nvidia-smi --query-gpu=index,name,compute_mode --format=csv,noheader 2>/dev/null | tr '\n' ';')"
fi
log "starting a private MPS daemon: CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY"
if ! nvidia-cuda-mps-control -d; then
  RC=4
  log "ERROR: nvidia-cuda-mps-control -d failed"
  exit 4
fi
DAEMON_UP=1
sleep 1
if [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
  log "WARNING: no control pipe in $CUDA_MPS_PIPE_DIRECTORY yet"
fi

if [ "$SM_SHARE" = 1 ]; then
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / RANKS))
  log "each rank held to CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
else
  unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
fi

CMD=("${LAUNCH[@]}" --standalone --nproc-per-node="$RANKS" "$@")
if [ "$TIMEOUT_S" -gt 0 ]; then
  CMD=(timeout --signal=TERM --kill-after=30 "$TIMEOUT_S" "${CMD[@]}")
fi
log "running: ${CMD[*]}"
"${CMD[@]}" &
CHILD=$!
wait "$CHILD"
RC=$?
CHILD=""
if [ "$RC" = 124 ]; then
  log "the run hit --timeout ${TIMEOUT_S}s"
fi
exit "$RC"
