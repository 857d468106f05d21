#!/usr/bin/env bash
# GPU suite for a GPU machine (1, 2 or 4 GPUs; needs no package registry).
#
#   bash benchmarks/gpu_suite.sh                 # stages build tests bench example
#   bash benchmarks/gpu_suite.sh build bench     # only those stages, in the order given
#   OUT=/some/dir bash benchmarks/gpu_suite.sh   # logs and results go to $OUT (default ./out)
#
# Set ODC_COMMIT=<hash> when the tree was copied to the GPU machine without an up-to-date
# .git: results record ODC_COMMIT.
#
# Stages (a failing stage is reported; later stages still run; exit status is
# nonzero when any stage failed):
#   build    MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e .  (the README's
#            install; fetches nothing: the GPU machines have no package registry, and their python
#            has torch, setuptools, wheel, pybind11 and ninja), then import torch_odc_backend
#   tests    the GPU tests (-m gpu in tests/test_{collectives,fsdp2,decoupled,callers}.py and
#            tests/integrations/test_zero_code_change.py) on 2
#            GPUs, then on 4 (there only the tests that use every GPU); on a one-GPU machine once,
#            with the tests' ranks sharing the GPU (TEST_MAX_S, TEST_ARGS: extra pytest arguments)
#   device_id  the GPU suites again with ODC_TEST_DEVICE_ID=1 (init_process_group(device_id=...))
#   check_cost benchmarks/collectives.py --reference odc-nocheck on 2 ranks (the descriptor
#            check's cost; on one GPU its ranks share it, so timings include the GPU's time-slicing)
#   bench    benchmarks/collectives.py under torchrun on 2 GPUs (0,1), then on 4
#   train    benchmarks/train_imbalanced.py on all GPUs: a 2-layer smoke run, then the 1.5B
#            long-tailed run and the balanced control (TRAIN_ARGS adds arguments to both),
#            with timeline plots (benchmarks/plot_timeline.py)
#   nvshmem  reinstall (the build stage's command) with ODC_WITH_NVSHMEM=1, then
#            tests/test_nvshmem.py on all GPUs (runtime, collectives and decoupled mode with
#            every peer over NVSHMEM, and with 4 GPUs as 2 hosts x 2), the GPU suites of the
#            tests stage with every peer over NVSHMEM (ODC_TEST_NVSHMEM=1
#            ODC_TRANSPORT=nvshmem; on 2 and 4 GPUs) and with 4 GPUs as two hosts
#            (ODC_HOST_SIZE=2), benchmarks/collectives.py --odc-nvshmem on all GPUs (odc over CUDA IPC, odc
#            over NVSHMEM and NCCL in one run) and, on 4+ GPUs, with ODC_HOST_SIZE splitting
#            them into two hosts. Run it last: it replaces the built extension.
#   example  examples/train_fsdp2.py on all GPUs: odc, odc --hsdp, odc --decoupled (unless
#            EXAMPLE_DECOUPLED=0), reference (NCCL)
#   suite_a, suite_b, suite_c
#            the whole GPU suite (`pytest -m gpu tests`) on all GPUs, in three parts that together
#            hold every test file with GPU tests (tests/test_structure.py keeps the lists whole),
#            each under its own limit of 480 s (SUITE_PART_S) and so one per call of a machine
#            that allows 10 minutes: `SUITE_BUDGET_S=590 bash benchmarks/gpu_suite.sh build suite_a`
#
# Every stage runs under a timeout clamped to what is left of SUITE_BUDGET_S
# (default 450 s), so the whole suite stays well under 9 minutes. TEST_GPUS / BENCH_GPUS
# (default "2 4") choose the GPU counts the tests / benchmark run on.
# Outputs in $OUT: <stage>.log, gpu_tests_<n>gpu.log, env.log, summary.txt,
# benchmarks/results/collectives_*.{json,png} and gpu_tests_<kind>_<date>.log (record their
# pass/fail lines in docs/performance.md's verification matrix), packed into
# $OUT/suite.tar.gz beside summary.txt unless SUITE_PACK=0.
set -uo pipefail
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
mkdir -p "$OUT/benchmarks/results" "$OUT/tests"

PY=${PYTHON:-python3}
SUITE_BUDGET_S=${SUITE_BUDGET_S:-450}
DATE=$(date -u +%Y%m%d)
SUITE_START=$SECONDS

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NGPU=${NGPU:-0}
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
GPU_SLUG=$(printf '%s' "${GPU_NAME:-unknown}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
kind_for() { echo "${GPU_SLUG}-x$1"; }   # what the run measured: <gpu>-x<gpus used>

if [ "$#" -gt 0 ]; then STAGES=("$@"); else STAGES=(build tests bench example); fi  # train, nvshmem: ask for them

declare -a SUM_NAME SUM_STATUS SUM_SECS SUM_LOG
FAILED=0

remaining() { echo $(( SUITE_BUDGET_S - (SECONDS - SUITE_START) )); }

# run_step NAME MAX_SECONDS LOGFILE CMD...: run CMD with a timeout, tee to LOGFILE, record it.
run_step() {
    local name=$1 max=$2 log=$3; shift 3
    local left; left=$(remaining)
    local limit=$(( max < left - 5 ? max : left - 5 ))
    local t0=$SECONDS status rc
    if [ "$limit" -lt 10 ]; then
        status="SKIP(budget)"; rc=0
        echo "=== $name: skipped, suite budget spent" | tee "$log"
    else
        echo "=== $name (timeout ${limit}s): $*" | tee "$log"
        timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        if [ "$rc" -eq 0 ]; then status=PASS
        elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT"
        else status="FAIL(rc=$rc)"; fi
        echo "=== $name: $status in $(( SECONDS - t0 ))s" | tee -a "$log"
    fi
    [ "$status" = PASS ] || FAILED=1   # a stage skipped for lack of time is a missing result too
    SUM_NAME+=("$name"); SUM_STATUS+=("$status"); SUM_SECS+=("$(( SECONDS - t0 ))"); SUM_LOG+=("${log#"$OUT"/}")
    return 0
}

skip_step() {  # NAME REASON
    echo "=== $1: SKIP ($2)"
    SUM_NAME+=("$1"); SUM_STATUS+=("SKIP($2)"); SUM_SECS+=(0); SUM_LOG+=("-")
}

{
    echo "date: $(date -u +%FT%TZ)"; echo "repo: $REPO"; echo "stages: ${STAGES[*]}"
    echo "commit: ${ODC_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
    git status --porcelain --untracked-files=no 2>/dev/null | head -n 20
    echo "gpus: $NGPU x ${GPU_NAME:-none}"
    nvidia-smi 2>&1 | head -n 30
    nvidia-smi topo -m 2>&1 | head -n 12
    $PY -m pip --version 2>&1; $PY -c 'import setuptools; print("setuptools", setuptools.__version__)' 2>&1
    $PY -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' 2>&1
    env | grep -E '^(NCCL_|TORCH_SYMM|NVSHMEM_|ODC_|CUDA_VISIBLE)' | sort
} > "$OUT/env.log" 2>&1
echo "GPU suite: stages [${STAGES[*]}], $NGPU GPU(s) ${GPU_NAME:+($GPU_NAME)}, OUT=$OUT, budget ${SUITE_BUDGET_S}s"

gpu_list() { seq -s, 0 $(( $1 - 1 )); }

stage_build() {
    run_step build 300 "$OUT/build.log" \
        env MAX_JOBS=${MAX_JOBS:-16} $PY -m pip install --no-build-isolation --no-deps -e .
    run_step import 60 "$OUT/import.log" \
        $PY -c 'import torch, torch_odc_backend; print("torch_odc_backend imported from", torch_odc_backend.__file__)'
}

# The files hold CPU and GPU tests: -m gpu selects the GPU ones (marker set by tests/dist_utils.py)
GPU_TESTS=(-m gpu tests/test_collectives.py tests/test_fsdp2.py tests/test_decoupled.py
           tests/test_callers.py tests/integrations/test_zero_code_change.py)
GPU_SUITES=(-m gpu tests/test_collectives.py tests/test_fsdp2.py tests/test_decoupled.py)
# The whole GPU suite in parts (stages suite_a/b/c), about 25 tests each (11-15 s a test)
SUITE_A=(tests/test_collectives.py tests/test_shared_gpus.py tests/test_zero_copy.py tests/test_lab.py)
SUITE_B=(tests/test_registered.py tests/test_fsdp2.py tests/test_dynamic_balance.py
         tests/test_skipped_modules.py tests/test_hosts.py)
SUITE_C=(tests/test_decoupled.py tests/test_decoupled_release.py tests/test_callers.py tests/integrations/test_zero_code_change.py)

stage_suite() {  # PART FILES...: one part of `pytest -m gpu tests` on all GPUs
    local part=$1; shift
    run_step "suite_$part" "${SUITE_PART_S:-480}" "$OUT/gpu_suite_$part.log" $PY -m pytest -q -rA -m gpu "$@"
    cp -f "$OUT/gpu_suite_$part.log" "$OUT/tests/gpu_suite_${part}_$(kind_for "$NGPU")_${DATE}.log"
}

stage_tests() {
    local n
    if [ "$NGPU" -eq 1 ] && [ -z "${TEST_GPUS:-}" ]; then
        # one GPU: the tests run their ranks on it (odc runs so; NCCL does not, so the tests
        # compare with references instead), the whole suite, then again with device_id passed
        run_step tests_1gpu_shared "${TEST_MAX_S:-420}" "$OUT/gpu_tests_1gpu_shared.log" \
            $PY -m pytest -q -rA "${GPU_TESTS[@]}" ${TEST_ARGS:-}
        cp -f "$OUT/gpu_tests_1gpu_shared.log" "$OUT/tests/gpu_tests_$(kind_for 1)-shared_${DATE}.log"
        return
    fi
    for n in ${TEST_GPUS:-2 4}; do
        if [ "$NGPU" -lt "$n" ]; then skip_step "tests_${n}gpu" "only $NGPU GPUs"; continue; fi
        local log="$OUT/gpu_tests_${n}gpu.log" sel=()
        [ "$n" -gt 2 ] && sel=(-k "test_matches_reference_and_nccl[$n or fsdp2 or decoupled")
        run_step "tests_${n}gpu" 220 "$log" \
            env CUDA_VISIBLE_DEVICES="$(gpu_list "$n")" \
            $PY -m pytest -q -rA "${GPU_TESTS[@]}" "${sel[@]}"
        cp -f "$log" "$OUT/tests/gpu_tests_$(kind_for "$n")_${DATE}.log"
    done
}

stage_device_id() {  # the GPU suite again, every worker passing device_id to init_process_group
    local n=${TEST_GPUS:-$NGPU}
    run_step device_id "${TEST_MAX_S:-420}" "$OUT/gpu_tests_device_id.log" \
        env ODC_TEST_DEVICE_ID=1 CUDA_VISIBLE_DEVICES="$(gpu_list "$NGPU")" \
        $PY -m pytest -q -rA "${GPU_SUITES[@]}" ${TEST_ARGS:-}
    cp -f "$OUT/gpu_tests_device_id.log" \
        "$OUT/tests/gpu_tests_$(kind_for "$NGPU")$([ "$NGPU" -eq 1 ] && echo -shared)-device-id_${DATE}.log"
}

stage_check_cost() {  # the cross-rank descriptor check's cost: odc vs odc with ODC_MATCH_CHECK=0
    local n=2
    run_step check_cost 200 "$OUT/check_cost.log" \
        torchrun --standalone --nproc-per-node="$n" benchmarks/collectives.py --reference odc-nocheck \
            --kind "$(kind_for "$NGPU")-${n}ranks" --out-dir "$OUT/benchmarks/results" --no-gemm ${CHECK_ARGS:-}
}

stage_bench() {
    local n
    for n in ${BENCH_GPUS:-2 4}; do
        if [ "$NGPU" -lt "$n" ]; then skip_step "bench_${n}gpu" "only $NGPU GPUs"; continue; fi
        run_step "bench_${n}gpu" 150 "$OUT/bench_${n}gpu.log" \
            env CUDA_VISIBLE_DEVICES="$(gpu_list "$n")" \
            torchrun --standalone --nproc-per-node="$n" benchmarks/collectives.py \
                --kind "$(kind_for "$n")" --out-dir "$OUT/benchmarks/results" ${BENCH_ARGS:-}
    done  # the JSON is rewritten after every size: a failed run still leaves what it measured
}

stage_example() {
    local n=$NGPU
    if [ "$n" -lt 1 ]; then skip_step example "no GPU"; return; fi
    local hsdp=()
    [ $(( n % 2 )) -eq 0 ] && [ "$n" -ge 4 ] && [ "${EXAMPLE_ODC_ONLY:-0}" != 1 ] && hsdp=(--hsdp)
    run_step example_odc 90 "$OUT/example_odc.log" \
        torchrun --standalone --nproc-per-node="$n" examples/train_fsdp2.py --steps ${EXAMPLE_STEPS:-100} --grad-accum 2
    if [ "${#hsdp[@]}" -gt 0 ]; then
        run_step example_odc_hsdp 90 "$OUT/example_odc_hsdp.log" \
            torchrun --standalone --nproc-per-node="$n" examples/train_fsdp2.py --steps ${EXAMPLE_STEPS:-100} "${hsdp[@]}"
    fi
    if [ "${EXAMPLE_DECOUPLED:-1}" = 1 ]; then
        run_step example_odc_decoupled 90 "$OUT/example_odc_decoupled.log" \
            torchrun --standalone --nproc-per-node="$n" examples/train_fsdp2.py --steps ${EXAMPLE_STEPS:-100} --grad-accum 2 \
                --decoupled
    fi
    [ "${EXAMPLE_ODC_ONLY:-0}" = 1 ] && return  # only the odc run (short device budget)
    run_step example_reference 90 "$OUT/example_reference.log" \
        torchrun --standalone --nproc-per-node="$n" examples/train_fsdp2.py --steps ${EXAMPLE_STEPS:-100} --grad-accum 2 \
            --backend reference
}

stage_train() {
    local n=$NGPU res="$OUT/benchmarks/results"
    if [ "$n" -lt 2 ]; then skip_step train "only $NGPU GPUs"; return; fi
    run_step train_smoke 150 "$OUT/train_smoke.log" \
        torchrun --standalone --nproc-per-node="$n" benchmarks/train_imbalanced.py \
            --layers 2 --steps 2 --docs-per-step $(( 2 * n )) --out-dir "$OUT/smoke"
    rm -rf "$OUT/smoke"
    run_step train_imbalanced ${TRAIN_MAX_S:-300} "$OUT/train_imbalanced.log" \
        torchrun --standalone --nproc-per-node="$n" benchmarks/train_imbalanced.py --out-dir "$res" ${TRAIN_ARGS:-}
    if [ "${TRAIN_BALANCED:-1}" = 1 ]; then
        run_step train_balanced ${TRAIN_MAX_S:-300} "$OUT/train_balanced.log" \
            torchrun --standalone --nproc-per-node="$n" benchmarks/train_imbalanced.py --balanced \
                --out-dir "$res" ${TRAIN_ARGS:-}
    fi
    for f in "$res"/train_imbalanced_*.json; do
        [ -e "$f" ] && $PY benchmarks/plot_timeline.py "$f" --steps 3 || true
    done
}

stage_nvshmem() {
    if [ "$NGPU" -lt 2 ]; then skip_step nvshmem "only $NGPU GPUs"; return; fi
    run_step nvshmem_build 300 "$OUT/nvshmem_build.log" \
        env ODC_WITH_NVSHMEM=1 MAX_JOBS=${MAX_JOBS:-16} $PY -m pip install --no-build-isolation --no-deps -e .
    run_step nvshmem_tests 240 "$OUT/nvshmem_tests.log" \
        $PY -m pytest -q -rA tests/test_nvshmem.py
    # the GPU suites with their peers routed through NVSHMEM: all of them (forced), and on 4+
    # GPUs the tests that use every GPU with the GPUs split into two "hosts"
    local n sel
    for n in ${TEST_GPUS:-2 4}; do
        if [ "$NGPU" -lt "$n" ]; then skip_step "nvshmem_suite_${n}gpu" "only $NGPU GPUs"; continue; fi
        sel=()
        [ "$n" -gt 2 ] && sel=(-k "test_matches_reference_and_nccl[$n or fsdp2 or decoupled")
        run_step "nvshmem_suite_forced_${n}gpu" 240 "$OUT/nvshmem_suite_forced_${n}gpu.log" \
            env CUDA_VISIBLE_DEVICES="$(gpu_list "$n")" ODC_TEST_NVSHMEM=1 ODC_TRANSPORT=nvshmem \
            $PY -m pytest -q -rA "${GPU_SUITES[@]}" "${sel[@]}"
        if [ "$n" -ge 4 ]; then
            run_step "nvshmem_suite_2hosts_${n}gpu" 240 "$OUT/nvshmem_suite_2hosts_${n}gpu.log" \
                env CUDA_VISIBLE_DEVICES="$(gpu_list "$n")" ODC_TEST_NVSHMEM=1 ODC_HOST_SIZE=$(( n / 2 )) \
                $PY -m pytest -q -rA "${GPU_SUITES[@]}" "${sel[@]}"
        fi
    done
    # odc over CUDA IPC, odc with every peer over NVSHMEM, and NCCL, side by side
    run_step nvshmem_bench 200 "$OUT/nvshmem_bench.log" \
        torchrun --standalone --nproc-per-node="$NGPU" benchmarks/collectives.py \
            --kind "$(kind_for "$NGPU")-ipc-nvshmem" --odc-nvshmem --out-dir "$OUT/benchmarks/results" \
            ${BENCH_ARGS:-}
    if [ "$NGPU" -ge 4 ]; then  # two "hosts": peer-to-peer within, NVSHMEM across
        run_step nvshmem_bench_2hosts 150 "$OUT/nvshmem_bench_2hosts.log" \
            env ODC_HOST_SIZE=$(( NGPU / 2 )) torchrun --standalone --nproc-per-node="$NGPU" \
                benchmarks/collectives.py --kind "$(kind_for "$NGPU")-2hosts" --nvshmem-init \
                --out-dir "$OUT/benchmarks/results" ${BENCH_ARGS:-}
    fi
}

for stage in "${STAGES[@]}"; do
    case "$stage" in
        build|tests|device_id|check_cost|bench|example|train|nvshmem) "stage_$stage" ;;
        suite_a) stage_suite a "${SUITE_A[@]}" ;;
        suite_b) stage_suite b "${SUITE_B[@]}" ;;
        suite_c) stage_suite c "${SUITE_C[@]}" ;;
        *) echo "unknown stage '$stage' (choose from: build tests device_id check_cost bench example train nvshmem suite_a suite_b suite_c)"; skip_step "$stage" unknown; FAILED=1 ;;
    esac
done

{
    echo
    echo "GPU suite summary ($NGPU x ${GPU_NAME:-no GPU}, $(( SECONDS - SUITE_START ))s total, OUT=$OUT)"
    printf '%-20s %-20s %6s  %s\n' stage status secs log
    for i in "${!SUM_NAME[@]}"; do
        printf '%-20s %-20s %6s  %s\n' "${SUM_NAME[$i]}" "${SUM_STATUS[$i]}" "${SUM_SECS[$i]}" "${SUM_LOG[$i]}"
    done
    for f in "$OUT"/benchmarks/results/collectives_*.json; do
        [ -e "$f" ] || continue
        $PY - "$f" <<'EOF' 2>/dev/null || true
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("summary", {})
ref = d.get("reference_backend", "nccl")
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: complete={d.get('complete')} checks={s.get('all_checks_passed')} "
      f"min_busbw_ratio_ge_4MiB={s.get('min_busbw_ratio_ge_4MiB')} "
      f"gemm_slowdown_ratio_odc_vs_{ref}={s.get(f'gemm_slowdown_ratio_odc_vs_{ref}')}")
EOF
    done
    for f in "$OUT"/benchmarks/results/train_imbalanced_*.json; do
        [ -e "$f" ] || continue
        $PY - "$f" <<'EOF' 2>/dev/null || true
import json, sys
d = json.load(open(sys.argv[1]))
r = {n: round(v["tokens_per_s"]) for n, v in d["results"].items()}
s = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d["summary"].items() if k != "microbatch_time_fit"}
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: tokens/s {r} {s}")
EOF
    done
    [ "$FAILED" -eq 0 ] && echo "RESULT: all stages passed" || echo "RESULT: some stages FAILED"
} | tee "$OUT/summary.txt"

# Pack everything but the summary into one archive (one file to copy back).
if [ "${SUITE_PACK:-1}" = 1 ]; then
    (cd "$OUT" && find . -type f ! -name summary.txt ! -name suite.tar.gz -print0 |
        tar czf suite.tar.gz --null -T - && find . -type f ! -name summary.txt ! -name suite.tar.gz -delete
     find . -mindepth 1 -type d -empty -delete)
    echo "packed the logs and results into $OUT/suite.tar.gz"
fi
exit "$FAILED"
