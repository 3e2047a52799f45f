#!/usr/bin/env bash
# On a GPU machine, in one go: build tp_kernels._C, run the GPU test suite and the benchmarks,
# and write the results under bench/results/ (JSON with device, commit, date and figures).
#
#   TP_KERNELS_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_suite.sh
#
# The machine needs what the build needs already installed (no network is assumed): nvcc, CMake,
# ninja, pybind11, nvidia-nccl-cu13, nvidia-cublas, torch, pytest, hypothesis. TP_KERNELS_COMMIT
# names the commit when the tree there has no git history. When $OUT is set (a folder whose
# contents are fetched back), the results and logs are copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
results=bench/results
logs=$(mktemp -d)
mkdir -p "$results"
commit=${TP_KERNELS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export TP_KERNELS_COMMIT=$commit
# Let backend="auto" pick the native path too, so that the suite checks and measures it.
export TP_KERNELS_AUTO_NATIVE=1

echo "== build (commit $commit)"
if ! "$PY" -m pip install --no-build-isolation --no-deps -e . >"$logs/build.log" 2>&1; then
  tail -n 60 "$logs/build.log"
  echo "build failed" >&2
  exit 1
fi
"$PY" -c "import tp_kernels, json; print(json.dumps(tp_kernels.extension_status()))"

echo "== GPU tests"
"$PY" -m pytest python_tests -m gpu -q -p no:cacheprovider --junitxml="$logs/gpu-tests.xml" 2>&1 | tee "$logs/gpu-tests.log"

echo "== benchmark (the main job: every model shape, decode and training m)"
"$PY" -m tp_kernels.bench --out-dir "$logs/bench" --tag "$commit" 2>&1 | tee "$logs/bench.log"

echo "== extension costs (GEMM vs F.linear, host overhead, chunking)"
"$PY" -m tp_kernels.bench.extension --out-dir "$logs/extension" --tag "$commit" 2>&1 | tee "$logs/extension.log"
cp "$logs"/extension/*.json "$results/" 2>/dev/null

echo "== fused path on virtual ranks (overlap, all-reduce latency, crossovers)"
"$PY" -m tp_kernels.bench.fused --out-dir "$logs/fused" --tag "$commit" 2>&1 | tee "$logs/fused.log"
cp "$logs"/fused/*.json "$results/" 2>/dev/null

echo "== compute-sanitizer on the fused ops (memcheck, racecheck)"
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
  timeout 900 "$san" --tool "$tool" --error-exitcode 9 "$PY" bench/fused_sanitize.py >"$logs/sanitize-$tool.log" 2>&1
  echo "$tool $?" >>"$logs/sanitize.txt"
  tail -n 3 "$logs/sanitize-$tool.log"
done

echo "== pytest-benchmark suite (two m per model)"
"$PY" -m pytest bench -q -p no:cacheprovider --tp-m 16,8192 --tp-rounds 5 \
  --benchmark-json="$logs/pytest-bench.json" 2>&1 | tail -n 5 | tee "$logs/pytest-bench.log"

"$PY" - "$logs" "$results" "$commit" <<'PYEOF'
import datetime, json, os, sys, xml.etree.ElementTree as ET
import torch, tp_kernels
logs, results, commit = sys.argv[1:4]
suite = ET.parse(os.path.join(logs, "gpu-tests.xml")).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
          if c.find("failure") is not None or c.find("error") is not None]
import glob, shutil
bench = None
for path in glob.glob(os.path.join(logs, "bench", "*.json")):
    bench = json.load(open(path))
    bench.pop("measurements", None)  # the full record (with them) is copied next to this file
    for ext in (".json", ".csv", ".png"):
        if os.path.exists(path[:-5] + ext):
            shutil.copy(path[:-5] + ext, results)
record = {
    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
    "commit": commit,
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "torch": torch.__version__,
    "extension_status": tp_kernels.extension_status(),
    "gpu_tests": {**count, "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
                  "failed": failed},
    "benchmark": bench,
    "extension": next((json.load(open(p)) for p in glob.glob(os.path.join(logs, "extension", "*.json"))), None),
    "fused": next((json.load(open(p)) for p in glob.glob(os.path.join(logs, "fused", "*.json"))), None),
    # exit status per tool: 0 clean, 9 errors found, 3 a device wait timed out, 1 a wrong result
    "sanitizer": {line.split()[0]: int(line.split()[1])
                  for line in open(os.path.join(logs, "sanitize.txt"))} if os.path.exists(
                      os.path.join(logs, "sanitize.txt")) else None,
}
name = os.path.join(results, f"gpu-suite-{commit}.json")
json.dump(record, open(name, "w"), indent=1)
print(f"wrote {name}: {record['gpu_tests']['passed']} passed, {len(failed)} failed, {count['skipped']} skipped")
PYEOF
status=$?

if [ -n "${OUT:-}" ]; then
  cp "$results/gpu-suite-$commit.json" "$logs/gpu-tests.log" "$logs/bench.log" "$logs/build.log" \
     "$logs/pytest-bench.json" "$logs/pytest-bench.log" "$logs/extension.log" "$logs"/bench/* \
     "$logs"/extension/* "$logs/fused.log" "$logs"/fused/* "$logs"/sanitize-*.log "$OUT/" 2>/dev/null
fi
exit $status
