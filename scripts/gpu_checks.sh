#!/usr/bin/env bash
# The checks that need GPUs, in parts, each under a time limit, each part's output
# saved as LOGDIR/<part>.log. Run it on the GPU machine from the repository root,
# with gpumagic importable there (on the lent machine: `source .whl/bootstrap.sh` first).
#
#     bash scripts/gpu_checks.sh onegpu                   # the one-GPU tests and the notebooks
#     bash scripts/gpu_checks.sh cluster fsdp frameworks  # two GPUs: tests, then benchmarks
#     bash scripts/gpu_checks.sh compile suite            # two GPUs: --compile floors, all GPU tests
#
# Parts (two GPUs unless said):
#   onegpu      pytest -m "gpu and not gpu2" tests; pytest examples         (one GPU is enough)
#   cluster     ipyparallel engines on both GPUs, NCCL, weights back
#   fsdp        --strategy fsdp tests, then benchmarks/fsdp.py
#   frameworks  framework launch-mode tests, then benchmarks/frameworks.py
#   compile     benchmarks/dataparallel.py --compile --cudagraphs (Transformer first, then MLP, ResNet-50);
#               also by model, one at a time: compile-transformer, compile-mlp, compile-resnet50
#   suite       pytest -m "gpu or gpu2" tests
#
# LOGDIR is $OUT where that is set (the lent machine brings it back), else artifacts/gpu.
# Benchmarks append to benchmarks/RESULTS.md; a copy of it, and the benchmark logs this run wrote,
# go to LOGDIR after every part, so that the numbers come back even when a later part runs out of time.
# GPU_CHECKS_SECONDS=N: the whole run has N seconds (a call that is cut off at 600 s: set it to what is
# left after the bootstrap, e.g. 540); each part's limit shrinks to fit, a part with no time left is not run.
# A part past its limit gets SIGINT (pytest then prints its summary and ends its pools), SIGKILL 20 s later.
# Exits non-zero if any part failed, ran out of time or was not run; the other parts still run.
set -uo pipefail
cd "$(dirname "$0")/.."

logdir="${OUT:-artifacts/gpu}"
mkdir -p "$logdir"
python="${PYTHON:-python3}"
status=0
stamp="$(mktemp)"   # benchmark logs newer than this are this run's
trap 'rm -f "$stamp"' EXIT

if [[ $# -eq 0 ]]; then
    sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi

deadline="${GPU_CHECKS_SECONDS:-}"
margin=30   # after a part's limit: the 20 s until SIGKILL, and copying the results

# fit LIMIT: LIMIT, or less where GPU_CHECKS_SECONDS leaves less (0: no time left for a part).
fit() {
    local limit="$1"
    if [[ -n "$deadline" ]]; then
        local left=$((deadline - SECONDS - margin))
        (( left < limit )) && limit=$left
        (( limit < 30 )) && limit=0
    fi
    echo "$limit"
}

# part NAME LIMIT_SECONDS COMMAND...: runs COMMAND with its output in LOGDIR/NAME.log.
part() {
    local name="$1" limit="$2"
    shift 2
    if [[ "$limit" -le 0 ]]; then
        echo "== $name: not run: no time left of GPU_CHECKS_SECONDS=$deadline" | tee -a "$logdir/$name.log"
        status=1
        return 0
    fi
    echo "== $name: $* (limit ${limit}s)" | tee -a "$logdir/$name.log"
    local start=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$logdir/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc after $((SECONDS - start))s" | tee -a "$logdir/$name.log"
    if command -v nvidia-smi >/dev/null; then   # a process left on a GPU would spoil the parts after this one
        local left_on_gpu
        left_on_gpu="$(nvidia-smi --query-compute-apps=pid,used_memory,name --format=csv,noheader 2>/dev/null)"
        [[ -z "$left_on_gpu" ]] || echo "== $name: still on the GPUs after it: $left_on_gpu" | tee -a "$logdir/$name.log"
    fi
    tail -n 4 "$logdir/$name.log" | head -n 3
    [[ $rc -eq 0 ]] || status=1
    cp benchmarks/RESULTS.md "$logdir/RESULTS.md"
    # only the logs this run wrote: the machine brings back a limited number of files
    find benchmarks/logs -type f -newer "$stamp" -exec cp {} "$logdir/" \; 2>/dev/null
    return 0
}

# -v: each test named as it starts (a part cut off by its limit shows which test it was in);
# --durations: what the time went on
pytest_=("$python" -m pytest -v --durations=15 -p no:cacheprovider)
# GPU tests skip where GPUs are missing; a proof that skipped proves nothing, so say so and fail.
gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
echo "gpu_checks: $gpus GPU(s) visible; logs in $logdir"
needs() {
    if [[ "$gpus" -lt "$1" ]]; then
        echo "== $2: needs $1 GPUs, $gpus visible: not run" | tee -a "$logdir/$2.log"
        status=1
        return 1
    fi
}

for name in "$@"; do
    case "$name" in
        onegpu)
            needs 1 onegpu || continue
            part onegpu-tests "$(fit 400)" "${pytest_[@]}" -m "gpu and not gpu2" tests
            part onegpu-examples "$(fit 300)" "${pytest_[@]}" examples ;;
        cluster)
            needs 2 cluster || continue
            part cluster-tests "$(fit 240)" "${pytest_[@]}" -m gpu2 tests/test_dataparallel_cluster_gpu.py ;;
        fsdp)
            needs 2 fsdp || continue
            part fsdp-tests "$(fit 300)" "${pytest_[@]}" -m gpu2 tests/test_dataparallel_fsdp_gpu.py tests/test_dataparallel_fsdp_frameworks.py
            # the benchmark's own --budget inside the part's limit, so that it records what it measured
            lim="$(fit 500)"
            part fsdp-bench "$lim" "$python" benchmarks/fsdp.py --budget $((lim > 100 ? lim - 40 : 60)) ;;
        frameworks)
            needs 2 frameworks || continue
            part frameworks-tests "$(fit 420)" "${pytest_[@]}" -m gpu2 tests/test_dataparallel_frameworks_gpu.py tests/test_magics_dataparallel_gpu.py
            # its three columns, each in a process with a deadline, inside the part's limit
            lim="$(fit 480)"
            part frameworks-bench "$lim" "$python" benchmarks/frameworks.py --timeout $((lim > 160 ? (lim - 40) / 3 : 40)) ;;
        compile|compile-transformer|compile-mlp|compile-resnet50)
            needs 2 "$name" || continue
            if [[ "$name" == compile || "$name" == compile-transformer ]]; then
                part compile-transformer "$(fit 540)" "$python" benchmarks/dataparallel.py --models transformer --compile --cudagraphs
            fi
            if [[ "$name" == compile || "$name" == compile-mlp ]]; then
                part compile-mlp "$(fit 420)" "$python" benchmarks/dataparallel.py --models mlp --compile --cudagraphs
            fi
            if [[ "$name" == compile || "$name" == compile-resnet50 ]]; then
                part compile-resnet50 "$(fit 540)" "$python" benchmarks/dataparallel.py --models resnet50 --compile
            fi ;;
        suite)
            needs 2 suite || continue
            part suite "$(fit 580)" "${pytest_[@]}" -m "gpu or gpu2" tests ;;
        *)
            echo "gpu_checks: unknown part '$name' (onegpu, cluster, fsdp, frameworks, compile, compile-transformer," \
                 "compile-mlp, compile-resnet50, suite)" >&2
            status=2 ;;
    esac
done
exit $status
