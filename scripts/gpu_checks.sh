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
#   compile     benchmarks/dataparallel.py --compile --cudagraphs (Transformer first, then MLP, ResNet-50)
#   suite       pytest -m "gpu or gpu2" tests
#
# LOGDIR is $OUT where that is set (the lent machine brings it back), else artifacts/gpu.
# Benchmarks append to benchmarks/RESULTS.md; a copy of it, and the benchmark logs this run wrote,
# go to LOGDIR after every part, so that the numbers come back even when a later part runs out of time.
# Exits non-zero if any part failed or ran out of time; the other parts still run.
set -uo pipefail
cd "$(dirname "$0")/.."

logdir="${OUT:-artifacts/gpu}"
mkdir -p "$logdir"
python="${PYTHON:-python3}"
status=0
stamp="$(mktemp)"   # benchmark logs newer than this are this run's
trap 'rm -f "$stamp"' EXIT

if [[ $# -eq 0 ]]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi

# part NAME LIMIT_SECONDS COMMAND...: runs COMMAND with its output in LOGDIR/NAME.log.
part() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $* (limit ${limit}s)" | tee -a "$logdir/$name.log"
    local start=$SECONDS
    timeout --kill-after=20 "$limit" "$@" >>"$logdir/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc after $((SECONDS - start))s" | tee -a "$logdir/$name.log"
    tail -n 4 "$logdir/$name.log" | head -n 3
    [[ $rc -eq 0 ]] || status=1
    cp benchmarks/RESULTS.md "$logdir/RESULTS.md"
    # only the logs this run wrote: the machine brings back a limited number of files
    find benchmarks/logs -type f -newer "$stamp" -exec cp {} "$logdir/" \; 2>/dev/null
    return 0
}

pytest_=("$python" -m pytest -q -p no:cacheprovider)
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
            part onegpu-tests 400 "${pytest_[@]}" -m "gpu and not gpu2" tests
            part onegpu-examples 300 "${pytest_[@]}" examples ;;
        cluster)
            needs 2 cluster || continue
            part cluster-tests 240 "${pytest_[@]}" -m gpu2 tests/test_dataparallel_cluster_gpu.py ;;
        fsdp)
            needs 2 fsdp || continue
            part fsdp-tests 300 "${pytest_[@]}" -m gpu2 tests/test_dataparallel_fsdp_gpu.py tests/test_dataparallel_fsdp_frameworks.py
            part fsdp-bench 420 "$python" benchmarks/fsdp.py ;;
        frameworks)
            needs 2 frameworks || continue
            part frameworks-tests 420 "${pytest_[@]}" -m gpu2 tests/test_dataparallel_frameworks_gpu.py tests/test_magics_dataparallel_gpu.py
            part frameworks-bench 480 "$python" benchmarks/frameworks.py ;;
        compile)
            needs 2 compile || continue
            part compile-transformer 540 "$python" benchmarks/dataparallel.py --models transformer --compile --cudagraphs
            part compile-mlp 420 "$python" benchmarks/dataparallel.py --models mlp --compile --cudagraphs
            part compile-resnet50 540 "$python" benchmarks/dataparallel.py --models resnet50 --compile ;;
        suite)
            needs 2 suite || continue
            part suite 580 "${pytest_[@]}" -m "gpu or gpu2" tests ;;
        *)
            echo "gpu_checks: unknown part '$name' (onegpu, cluster, fsdp, frameworks, compile, suite)" >&2
            status=2 ;;
    esac
done
exit $status
