#!/usr/bin/env bash
# Nsight Compute on the fused all-reduce kernel (tpk_all_reduce_*) on 8 virtual ranks: for each
# case below, every launch of the last of three calls (bench/all_reduce_kernel.py: one launch a
# stage a rank, the stages as phases, so ncu running one kernel at a time finds every flag a
# kernel waits for set), with the sections that say where a launch's time goes (speed of light,
# memory workload, occupancy, launch statistics, warp states). The answer to "why" for the decode
# all-reduce's latency (16 KiB, 64 KiB) and for the bandwidth of the large ones (4 MiB):
#
#   OUT=DIR bash bench/gpu_profile.sh       # a short call of its own, on a machine the suite used
#
# It builds the extension first when it does not import (as bench/gpu_suite.sh does) and writes,
# per case, ncu's report (ncu-<algorithm>-<bytes>.ncu-rep), its details page as CSV (.csv), its
# raw page (every metric, the stall reasons among them: -raw.csv) and the program's and ncu's
# messages (.log), with status.txt (a line a case: "NAME STATUS SECONDS"; 124: stopped at its
# limit, 125: not started), all in one tarball, $OUT/gpu-profile.tar.gz ($OUT: a new temporary
# folder when unset), written again after every case, so that a call stopped from outside still
# returns what ran. The clocks are left as they are (--clock-control none). The cases run in the
# order above, each under 90 s and all under the call's budget (TP_KERNELS_PROFILE_BUDGET_S, 240 s
# by default, the build included: what a 15-minute lease leaves after the machine's start and the
# suite's 540 s; bench/gpu_steps.sh), those the budget leaves no time for not started. Exit
# status: 0 when every case ran and its result was right, 2 when ncu or the GPU is missing, 1
# otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
work=$(mktemp -d)/gpu-profile
mkdir -p "$OUT" "$work"
SECONDS=0
budget_s=${TP_KERNELS_PROFILE_BUDGET_S:-240}
reserve_s=5
logs=$work
LOGS_ROOT=$(dirname "$work")
LOGS_TARBALL=gpu-profile.tar.gz
# shellcheck source=bench/gpu_steps.sh
. bench/gpu_steps.sh
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [ -z "$ncu" ]; then
  echo "ncu (Nsight Compute) is not installed here" >&2
  exit 2
fi
if ! "$PY" -c "import tp_kernels, sys; sys.exit(tp_kernels.extension_status()['built'] is not True)" 2>/dev/null; then
  major=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0])")
  if ! TP_KERNELS_CUDA_MAJOR=$major timeout "$(step_limit 300)" "$PY" -m pip install -v --no-build-isolation \
      --no-deps -e . >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log"
    echo "build failed" >&2
    exit 1
  fi
fi
status=0
for case in "one_shot 16384" "one_shot 65536" "two_shot 65536" "one_shot 4194304" "two_shot 4194304"; do
  read -r algorithm bytes <<<"$case"
  name=ncu-$algorithm-$bytes
  if [ "$(seconds_left)" -lt 5 ]; then  # recorded as not started (the budget is spent)
    step "$name" 0 true >/dev/null
    status=1
    continue
  fi
  args=(--p 8 --bytes "$bytes" --algorithm "$algorithm" --calls 3)
  if ! launches=$("$PY" bench/all_reduce_kernel.py "${args[@]}" --launches); then
    status=2
    break
  fi
  read -r skip count <<<"$launches"
  echo "== $name: launches $skip + $count"
  step "$name" 90 "$ncu" --clock-control none --kernel-name regex:tpk_all_reduce --launch-skip "$skip" \
    --launch-count "$count" --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats -f -o "$work/$name" \
    "$PY" bench/all_reduce_kernel.py "${args[@]}" >/dev/null
  read -r _ rc _ < <(tail -n 1 "$logs/status.txt")
  if [ "$rc" -eq "$NOT_STARTED" ]; then
    status=1
    continue
  fi
  if [ -f "$work/$name.ncu-rep" ]; then
    "$ncu" --import "$work/$name.ncu-rep" --csv --page details >"$work/$name.csv" 2>>"$work/$name.log"
    # every metric collected, each launch a row: the warp-state section's stall reasons
    # (smsp__average_warps_issue_stalled_*: membar, barrier, long_scoreboard, sleeping, ...),
    # which the details page gives only as its rules' sentences
    "$ncu" --import "$work/$name.ncu-rep" --csv --page raw >"$work/$name-raw.csv" 2>>"$work/$name.log"
    save_logs
  fi
  tail -n 3 "$work/$name.log"
  echo "$name: exit status $rc, $(cat "$work/$name.csv" 2>/dev/null | wc -l) lines of ncu's CSV"
  [ "$rc" -eq 0 ] || status=1
done
save_logs
echo "== done in $SECONDS s: $OUT/$LOGS_TARBALL"
exit $status
