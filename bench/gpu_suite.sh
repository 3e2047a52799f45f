#!/usr/bin/env bash
# The GPU suite, built to fit the time a GPU machine is lent: all of it in one call (`all`, under 9
# minutes on one H100, so that a 15-minute lease holds the machine's start, that call and a short
# second one on the still-warm machine), or one part a call (each under 8 minutes). It builds the
# extension first and writes a record per part (device, commit, date; bench/gpu_summary.py) under
# bench/results/. Every step runs under its own time limit and under the call's budget
# (TP_KERNELS_SUITE_BUDGET_S, 540 s by default, build included; bench/gpu_steps.sh), so a call
# always ends with its records, naming what did not run:
#
#   TP_KERNELS_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_suite.sh all
#       the three parts below in one call, correctness first: the tests (at most 320 s), the
#       sanitizers (60 s each), then the benchmarks in what is left (the main job --quick, with
#       20 samples a figure, then the fused path's sweeps, its timeline and the host times)
#   ... bash bench/gpu_suite.sh tests [PYTEST_ARGS...]
#       the GPU tests (python_tests -m gpu) on TP_KERNELS_SUITE_WORKERS pytest-xdist workers
#       sharing the GPU (4 by default; 0, or without pytest-xdist: one process), a per-test
#       timeout so a hang costs seconds, the tracebacks and the slowest tests in the log:
#       gpu-tests-<commit>.json. PYTEST_ARGS select some of them (e.g. -k native_linear); the
#       record then says which ("selection"). With --select-from LIST, those LIST names (node ids,
#       one a line): a first run's failed and unreached tests, from
#       `python3 bench/gpu_summary.py rerun bench/results/gpu-tests-<commit>.json > LIST`, run again
#       on the machine still held, recorded in gpu-tests-<commit>-rerun.json. With --shard I/N
#       (python_tests/conftest.py: every N-th selected test from the I-th), the I-th of N runs that
#       together run them all, each recorded in gpu-tests-<commit>-IofN.json
#   ... bash bench/gpu_suite.sh bench
#       the main job (on one GPU with the per-rank costs, the fused path on virtual ranks and the
#       calibrated projection), the fused path's sweeps and timeline, the pytest-benchmark suite and the host
#       time of a call at 1, 2 and 8 ranks of a fake group and on 2 NCCL ranks sharing the GPU,
#       each under its own time limit: gpu-bench-<commit>.json,
#       and the main job's JSON/CSV/PNG and the other benchmarks' JSON next to it
#   ... bash bench/gpu_suite.sh sanitize
#       compute-sanitizer memcheck and racecheck on the fused ops: gpu-sanitize-<commit>.json
#
# The machine needs what the build needs already installed (no network is assumed): CMake, ninja,
# pybind11, a CUDA torch with the NVIDIA wheels it brings (runtime, NVRTC, NCCL, cuBLAS), the
# runtime headers' crt/ and nv/target (nvidia-cuda-crt and nvidia-cuda-cccl, or a CUDA toolkit of
# torch's major), pytest, pytest-timeout, hypothesis (pytest-xdist: optional). The extension is
# built for torch's CUDA major. TP_KERNELS_COMMIT names the commit when the tree there has no git
# history. When $OUT is set (a folder whose contents are fetched back), the records and a tarball
# of the logs (a folder per part) go there too, the logs after every step.
# Exit status: 0 when every part run is green.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/gpu_suite.sh {all|tests [PYTEST_ARGS...]|bench|sanitize}"
part=${1:-}
shift || true
case "$part" in
  tests) parts=(tests) ;;
  bench|sanitize) [ $# -eq 0 ] || { echo "bench/gpu_suite.sh $part takes no arguments" >&2; exit 2; }; parts=("$part") ;;
  all) [ $# -eq 0 ] || { echo "bench/gpu_suite.sh all takes no arguments" >&2; exit 2; }; parts=(tests sanitize bench) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
results=bench/results
root=$(mktemp -d)
logs=$root  # each part's steps log to a folder of their own below (bench/gpu_steps.sh)
mkdir -p "$results"
commit=${TP_KERNELS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export TP_KERNELS_COMMIT=$commit
# Let backend="auto" pick the native path too, so that the suite checks and measures it.
export TP_KERNELS_AUTO_NATIVE=1
SECONDS=0
budget_s=${TP_KERNELS_SUITE_BUDGET_S:-540}
reserve_s=20
LOGS_ROOT=$root
LOGS_TARBALL=gpu-$part-$commit-logs.tar.gz
# shellcheck source=bench/gpu_steps.sh
. bench/gpu_steps.sh

# The steps' own limits: one part a call gives each part the whole budget; `all` shares it out.
if [ "$part" = all ]; then
  tests_s=320; sanitizer_s=60; bench_main_s=120; bench_main_args=(--quick --iters 20); pytest_bench=false
  host_peers_args=(--samples 10 --profile 10)  # (20 and 20 took 82 s on an H200: more than `all` leaves)
else
  tests_s=480; sanitizer_s=180; bench_main_s=280; bench_main_args=(); pytest_bench=true
  host_peers_args=(--samples 20 --profile 20)
fi

echo "== build (commit $commit; the call's budget ${budget_s} s)"
major=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0])")
build_limit=$(step_limit 300)
if ! TP_KERNELS_CUDA_MAJOR=$major timeout "$build_limit" "$PY" -m pip install -v --no-build-isolation --no-deps -e . \
    >"$root/build.log" 2>&1; then
  tail -n 60 "$root/build.log"
  echo "build failed" >&2
  save_logs
  exit 1
fi
echo "build: ${SECONDS} s"
"$PY" -c "import tp_kernels, json; print(json.dumps(tp_kernels.extension_status()))" | tee "$root/extension-status.json"

run_tests() {
  # pytest-timeout: a per-test timeout (a hang costs 120 s, not the part), and (2.3 and later) a
  # session timeout that stops between tests before the step's limit, so pytest ends as usual
  local tests_limit
  tests_limit=$(step_limit "$tests_s")
  local flags=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    flags=(--timeout 120)
    if "$PY" -m pytest --help 2>/dev/null | grep -c -- --session-timeout >/dev/null; then  # -c: reads it all (pipefail)
      # 30 s before the step's limit (half of it when that is short)
      flags+=(--session-timeout $((tests_limit > 60 ? tests_limit - 30 : (tests_limit > 1 ? tests_limit / 2 : 1))))
    fi
  else
    echo "pytest-timeout is not installed: no per-test timeout" >&2
  fi
  # Workers sharing the GPU (each spawns its own worlds of NCCL ranks; the GPU time-slices between
  # their processes), each given tests as it finishes others
  local workers=${TP_KERNELS_SUITE_WORKERS:-4}
  if [ "$workers" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
    flags+=(-n "$workers" --dist load -p no:benchmark)  # (pytest-benchmark: off under xdist anyway, with a warning)
  elif [ "$workers" -gt 0 ]; then
    echo "pytest-xdist is not installed: the tests run in one process" >&2
  fi
  # The tests selected, so that the record names those never reached (python_tests/conftest.py),
  # and the arguments that selected some of them
  export TP_KERNELS_COLLECTED_FILE=$logs/gpu-tests-collected.txt
  [ $# -gt 0 ] && printf '%s\n' "$@" >"$logs/gpu-tests-selection.txt"
  # -rfE: every failure's and error's summary; --tb=short: their tracebacks, kept in the log
  step gpu-tests "$tests_limit" "$PY" -m pytest python_tests -m gpu -q -p no:cacheprovider "${flags[@]}" \
    -rfE --tb=short --durations=40 --junitxml="$logs/gpu-tests.xml" "$@"
}

run_sanitize() {
  local san tool
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    # exit status: 0 clean, 9 errors found, 3 a device wait timed out, 1 a wrong result
    step "$tool" "$sanitizer_s" "$san" --tool "$tool" --error-exitcode 9 "$PY" bench/fused_sanitize.py
    [ -f "$logs/$tool.log" ] && mv "$logs/$tool.log" "$logs/sanitize-$tool.log"  # none when not started
  done
}

run_bench() {
  # On one GPU the main job also measures the extension's costs, the fused path on 8 virtual ranks
  # and the projection's GEMMs (tp_kernels.bench.one_gpu); the fused benchmark adds the sweeps.
  step bench "$bench_main_s" "$PY" -m tp_kernels.bench "${bench_main_args[@]}" --out-dir "$logs/bench" --tag "$commit"
  step fused 100 "$PY" -m tp_kernels.bench.fused --out-dir "$logs/fused" --tag "$commit"
  # one fused call of each overlap op on 8 virtual ranks under torch.profiler (where its time went), and
  # the kernels that F.linear and the native GEMM run for section 1's GEMMs
  step timeline 60 "$PY" -m tp_kernels.bench.timeline --out-dir "$logs/fused" --tag "$commit"
  if $pytest_bench; then
    step pytest-bench 60 "$PY" -m pytest bench -q -p no:cacheprovider --tp-m 16,8192 --tp-rounds 5 \
      --benchmark-json="$logs/pytest-bench.json"
  fi
  # The host time of a call at 1, 2 and 8 ranks of a fake group (no communication): the reference,
  # and auto on the reference, which is what a fake group can run (bench.host.FAKE_GROUP_AUTO).
  step host 30 "$PY" -m tp_kernels.bench.host --samples 20 --profile 50 \
    --out-dir "$logs/host" --tag "$commit"
  # The same on two NCCL ranks sharing the GPU, where the native and fused paths run (and auto
  # may choose them): the host time of issuing a call with real peers.
  step host-peers 90 env TP_KERNELS_AUTO_NATIVE=1 TP_KERNELS_AUTO_FUSED=1 "$PY" -m tp_kernels.bench.host --peers \
    --ranks 2 "${host_peers_args[@]}" --out-dir "$logs/host" --tag "$commit"
  cp "$logs"/bench/* "$logs"/fused/*.json "$logs"/host/*.json "$results/" 2>/dev/null
}

status=0
for p in "${parts[@]}"; do
  logs=$root/$p
  mkdir -p "$logs"
  "run_$p" "$@"
  "$PY" bench/gpu_summary.py "$p" "$logs" "$results" "$commit" ${OUT:+"$OUT"} || status=1
done
echo "== $part done in $SECONDS s; its logs are in $root"
save_logs
exit $status
