#!/usr/bin/env bash
# The network peers' path on one machine: NVSHMEM configurations tried in turn with 2 ranks
# (sharing the GPU where there is one), each through benchmarks/nvshmem_remote_probe.py, then
# tests/test_nvshmem.py's routed collectives + decoupled test under the first remote
# configuration that worked (ODC_TEST_NVSHMEM_REMOTE=1) and, where NVSHMEM maps the peers,
# with every routed copy staged (ODC_TEST_NVSHMEM_SHARED_GPU=1).
#
#   OUT=/some/dir bash benchmarks/nvshmem_remote.sh     # builds with ODC_WITH_NVSHMEM=1 first
#
# PROBES (default: all) picks configurations by name: p2p p2p_staged ucx_default ucx_sm ucx_tcp
# ucx_tcp_only libfabric ibrc. UCX: a libucx-cu13 wheel in .ucx/ (NVSHMEM's UCX transport dlopens libucp.so.0) is unpacked
# to /tmp/ucx and put on LD_LIBRARY_PATH. Outputs in $OUT: build.log, <config>.{log,json},
# pytest_*.log, summary.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(pwd)/benchmarks:$(pwd)/tests${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-./out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
NPROC=${NPROC:-2}
echo "commit ${ODC_COMMIT:-unknown}  $(date -u +%FT%TZ)  $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" > "$OUT/summary.txt"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  ODC_WITH_NVSHMEM=1 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { echo "build failed" >> "$OUT/summary.txt"; tail -30 "$OUT/build.log"; exit 1; }
fi
UCX_ENV=()
if ls .ucx/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ucx .ucx/*.whl > /dev/null 2>&1
  UCX_ENV=(LD_LIBRARY_PATH="/tmp/ucx/libucx/lib:${LD_LIBRARY_PATH:-}")
  ls /tmp/ucx/libucx/lib >> "$OUT/summary.txt"
fi
{ echo "== what a remote transport would need here"
  ls -l /dev/gdrdrv /dev/infiniband 2>&1; ls /sys/class/infiniband 2>&1
  ldconfig -p | grep -E "libibverbs|libfabric|libgdrapi|libmlx5" || echo "no libibverbs / libfabric / libgdrapi / libmlx5 in ldconfig"
  nvidia-smi -q | grep -i -E "compute mode|mps" ; } >> "$OUT/summary.txt" 2>&1
NVL=$(python3 -c "import nvidia.nvshmem, os; print(os.path.join(nvidia.nvshmem.__path__[0], 'lib'))")
echo "nvshmem lib: $(ls $NVL | tr '\n' ' ')" >> "$OUT/summary.txt"
PROBES=${PROBES:-p2p p2p_staged ucx_default ucx_sm ucx_tcp ucx_tcp_only libfabric ibrc}
probe() {  # name, env assignments...
  local name=$1; shift
  case " $PROBES " in *" $name "*) ;; *) return 1 ;; esac
  timeout -k 5 ${PROBE_S:-75} env ODC_TRANSPORT=nvshmem "$@" torchrun --standalone --nproc-per-node=$NPROC \
      benchmarks/nvshmem_remote_probe.py --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "probe $name rc=$rc  ($*)" | tee -a "$OUT/summary.txt"
  return $rc
}
REMOTE=()
probe p2p || true
probe p2p_staged ODC_NVSHMEM_STAGE=always || true
for cfg in "ucx_default:" "ucx_sm:UCX_TLS=sm,self,cuda_copy,cuda_ipc" "ucx_tcp:UCX_TLS=tcp,self,cuda_copy" \
           "ucx_tcp_only:UCX_TLS=tcp,self"; do
  name=${cfg%%:*}; tls=${cfg#*:}
  e=("${UCX_ENV[@]}" NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx NVSHMEM_DEBUG=INFO)
  [ -n "$tls" ] && e+=("$tls")
  if probe "$name" "${e[@]}" && [ ${#REMOTE[@]} -eq 0 ]; then REMOTE=("${e[@]}"); fi
done
probe libfabric NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=libfabric NVSHMEM_DEBUG=INFO || true
probe ibrc NVSHMEM_DISABLE_P2P=1 NVSHMEM_DEBUG=INFO || true
T="tests/test_nvshmem.py::test_gpu_collectives_and_decoupled_over_nvshmem"
timeout -k 5 200 env ODC_TEST_NVSHMEM_SHARED_GPU=1 python3 -m pytest -q -rA "$T" -k "all_peers" \
    > "$OUT/pytest_shared_gpu.log" 2>&1
echo "pytest shared-GPU (P2P and staged) rc=$?" | tee -a "$OUT/summary.txt"
if [ ${#REMOTE[@]} -gt 0 ]; then
  timeout -k 5 200 env "${REMOTE[@]}" NVSHMEM_DEBUG=WARN ODC_TEST_NVSHMEM_REMOTE=1 python3 -m pytest -q -rA "$T" \
      -k "all_peers_nvshmem" > "$OUT/pytest_remote.log" 2>&1
  echo "pytest remote (${REMOTE[*]}) rc=$?" | tee -a "$OUT/summary.txt"
else
  echo "pytest remote: no remote configuration worked" | tee -a "$OUT/summary.txt"
fi
if [ -n "${EXTRA_TESTS:-}" ]; then  # e.g. the GPU tests the change could touch
  timeout -k 5 ${EXTRA_TESTS_S:-280} python3 -m pytest -q -rA $EXTRA_TESTS > "$OUT/pytest_extra.log" 2>&1
  echo "pytest $EXTRA_TESTS rc=$? ($(tail -1 "$OUT/pytest_extra.log"))" | tee -a "$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
