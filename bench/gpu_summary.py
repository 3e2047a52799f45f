"""The record of one part of the GPU suite (bench/gpu_suite.sh), written as JSON with the device,
the commit and the date:

    python bench/gpu_summary.py tests    LOGS RESULTS COMMIT [COPY_TO]  # LOGS/gpu-tests.xml (junit), LOGS/gpu-tests-{collected,selection}.txt
    python bench/gpu_summary.py bench    LOGS RESULTS COMMIT [COPY_TO]  # LOGS/{bench,extension,fused,host}/*.json, LOGS/status.txt
    python bench/gpu_summary.py sanitize LOGS RESULTS COMMIT [COPY_TO]  # LOGS/status.txt, LOGS/sanitize-*.log

It writes ``RESULTS/gpu-<part>-<COMMIT>.json`` (the tests of ``--shard I/N``:
``gpu-tests-<COMMIT>-IofN.json``, of ``--select-from``: ``gpu-tests-<COMMIT>-rerun.json``, each run's
its own), a copy of it in the folder COPY_TO when one is given (the suite's ``$OUT``), and prints
one line saying what it holds. ``LOGS/status.txt`` has a line a step, ``NAME STATUS SECONDS``
(bench/gpu_steps.sh); the record keeps both. Exit status: 0 when the part is green (every test
selected ran and passed, and none was skipped for lack of something this machine has; every step
finished; the sanitizers found nothing), 1 otherwise.

    python bench/gpu_summary.py rerun RECORD... > LIST

prints the node ids of the tests that failed, erred or were never reached in the tests records
given, one a line, for a second run of those alone on the machine still held:
``bash bench/gpu_suite.sh tests --select-from LIST``.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from typing import Dict, List

#: Skips that are fine on a GPU machine: none. A GPU test skipped there lacks something it has.
ALLOWED_SKIPS: List[str] = []


def _machine() -> Dict:
    try:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    except ImportError:  # the summary itself needs no torch
        device, versions = "unknown (torch not importable)", {}
    return {"device": device, **versions}


def _status_lines(logs: str) -> List[List[str]]:
    path = os.path.join(logs, "status.txt")
    return [line.split() for line in open(path) if line.strip()] if os.path.exists(path) else []


def _steps(logs: str) -> Dict[str, int]:
    """``LOGS/status.txt``: each step's exit status, by name."""
    return {fields[0]: int(fields[1]) for fields in _status_lines(logs)}


def _step_seconds(logs: str) -> Dict[str, int]:
    """``LOGS/status.txt``: the seconds each step took (0: not started), by name."""
    return {fields[0]: int(fields[2]) for fields in _status_lines(logs) if len(fields) > 2}


def _junit_name(nodeid: str) -> str:
    """A pytest node id as this record names the test (junit's ``classname::name``, as pytest's
    junitxml makes them): ``python_tests/test_gpu.py::test_a[x]`` -> ``python_tests.test_gpu::test_a[x]``."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    return ".".join(names[:-1]) + "::" + names[-1] + bracket + params


def tests(logs: str) -> Dict:
    """Counts, the failed and skipped tests with their first line of message, every test's
    duration, from pytest's junit XML; the tests selected that never ran (a run stopped by its
    time limit), from ``LOGS/gpu-tests-collected.txt`` (python_tests/conftest.py writes it); the
    pytest step's exit status; and the arguments that selected some of the GPU tests
    (``LOGS/gpu-tests-selection.txt``, one a line; None: all of them). Without the XML (pytest was
    killed), nothing counts as run."""
    xml = os.path.join(logs, "gpu-tests.xml")
    cases = []
    if os.path.exists(xml):
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        cases = [c for s in suites for c in s.iter("testcase")]
    failed, errors, skipped, durations = [], [], [], {}
    for c in cases:
        name = f"{c.get('classname')}::{c.get('name')}"
        durations[name] = round(float(c.get("time", 0.0)), 3)
        for tag, sink in (("failure", failed), ("error", errors), ("skipped", skipped)):
            node = c.find(tag)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                sink.append({"test": name, "message": message[0][:300] if message else ""})
    collected_path = os.path.join(logs, "gpu-tests-collected.txt")
    not_reached = None  # unknown without the list of the tests selected
    if os.path.exists(collected_path):
        collected = [_junit_name(line.strip()) for line in open(collected_path) if line.strip()]
        not_reached = [name for name in collected if name not in durations]
    counts = {"tests": len(cases), "failed": len(failed), "errors": len(errors), "skipped": len(skipped)}
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    counts["not_reached"] = None if not_reached is None else len(not_reached)
    exit_status = _steps(logs).get("gpu-tests")
    slowest = dict(sorted(durations.items(), key=lambda kv: -kv[1])[:30])
    green = (counts["tests"] > 0 and not failed and not errors and not not_reached and exit_status in (None, 0)
             and all(s["test"] in ALLOWED_SKIPS for s in skipped))
    selection_path = os.path.join(logs, "gpu-tests-selection.txt")
    selection = open(selection_path).read().splitlines() if os.path.exists(selection_path) else None
    return {"counts": counts, "selection": selection, "exit_status": exit_status,
            "wall_seconds": _step_seconds(logs).get("gpu-tests"), "junit_xml": os.path.exists(xml),
            "failed": failed, "errors": errors, "skipped": skipped, "not_reached": not_reached or [],
            "seconds": round(sum(durations.values()), 1), "slowest": slowest, "durations": durations, "green": green}


def bench(logs: str) -> Dict:
    """Every step's exit status (124: stopped at its limit; 125: not started, the part's budget
    spent), the records the benchmarks wrote (the main job's without its raw measurements, which
    stay in its own JSON next to this record) and, by record, the count of GPU samples whose host
    outlasted the stream's hold (``"holds"``)."""
    records = {}
    for part in ("bench", "extension", "fused", "host"):
        for path in sorted(glob.glob(os.path.join(logs, part, "*.json"))):
            record = json.load(open(path))
            record.pop("measurements", None)
            records[f"{part}/{os.path.basename(path)}"] = record
    steps = _steps(logs)
    # each record's GPU samples and those whose host outlasted the stream's hold (their figure then
    # holds the host's time too: docs/benchmarks.md, Method)
    holds = {name: r["hold"] for name, r in records.items() if isinstance(r.get("hold"), dict)}
    return {"steps": steps, "step_seconds": _step_seconds(logs), "records": records, "holds": holds,
            "green": bool(steps) and not any(steps.values())}


#: compute-sanitizer's last line: memcheck's (and initcheck's, synccheck's) "========= ERROR SUMMARY:
#: 0 errors", racecheck's "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error")


def sanitize(logs: str) -> Dict:
    """Per tool: the exit status (0 clean, 9 errors found, 3 a device wait timed out, 1 a wrong
    result, 124 out of time, 125 not started: bench/gpu_steps.sh) and the error count of its
    summary line."""
    seconds = _step_seconds(logs)
    tools = {}
    for tool, status in _steps(logs).items():
        path = os.path.join(logs, f"sanitize-{tool}.log")
        found = _SUMMARY.findall(open(path, errors="replace").read()) if os.path.exists(path) else []
        tools[tool] = {"exit_status": status, "errors": int("".join(found[-1])) if found else None,
                       "seconds": seconds.get(tool)}
    green = bool(tools) and all(t["exit_status"] == 0 and t["errors"] == 0 for t in tools.values())
    return {"tools": tools, "green": green}


PARTS = {"tests": tests, "bench": bench, "sanitize": sanitize}


def _option(selection, name: str):
    """The value of the pytest option ``name`` among the arguments ``selection`` (``--name V`` or
    ``--name=V``), or None."""
    selection = list(selection or ())
    for i, arg in enumerate(selection):
        if arg.startswith(f"{name}="):
            return arg.partition("=")[2]
        if arg == name and i + 1 < len(selection):
            return selection[i + 1]
    return None


def _part_name(selection) -> str:
    """What names the record of tests selected by ``selection`` (python_tests/conftest.py), each
    run its own: ``"rerun"`` with ``--select-from``, ``"1of2"`` with ``--shard 1/2`` (both:
    ``"rerun-1of2"``), else ``""``."""
    shard = _option(selection, "--shard")
    names = ["rerun"] if _option(selection, "--select-from") is not None else []
    return "-".join(names + ([shard.replace("/", "of")] if shard else []))


def _node_id(name: str) -> str:
    """A test as the record names it (junit's ``classname::name``) as pytest's node id, for
    ``--select-from``: ``python_tests.test_gpu::test_a[x]`` -> ``python_tests/test_gpu.py::test_a[x]``
    (a class: the parts of the class name after the first that names a file here)."""
    classname, _, test = name.partition("::")
    parts = classname.split(".")
    for k in range(1, len(parts) + 1):
        if os.path.exists(os.path.join(*parts[:k]) + ".py"):
            break
    return "::".join(["/".join(parts[:k]) + ".py", *parts[k:], test])


def rerun(records: List[str]) -> List[str]:
    """The node ids of the tests that failed, erred or were never reached in the tests ``records``
    (each a ``gpu-tests-*.json``), for ``pytest --select-from``."""
    ids = []
    for path in records:
        record = json.load(open(path))
        names = [t["test"] for t in record["failed"] + record["errors"]] + list(record["not_reached"])
        ids += [_node_id(name) for name in names]
    return list(dict.fromkeys(ids))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rerun"] and len(argv) > 1:
        print("\n".join(rerun(argv[1:])))
        return 0
    if len(argv) not in (4, 5) or argv[0] not in PARTS:
        print(f"usage: python bench/gpu_summary.py {{{','.join(PARTS)}}} LOGS RESULTS COMMIT [COPY_TO]\n"
              "       python bench/gpu_summary.py rerun RECORD...", file=sys.stderr)
        return 2
    part, logs, results, commit = argv[:4]
    record = {**_machine(), "part": part, "commit": commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **PARTS[part](logs)}
    os.makedirs(results, exist_ok=True)
    part_of = _part_name(record.get("selection"))
    path = os.path.join(results, f"gpu-{part}-{commit}{f'-{part_of}' if part_of else ''}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    if len(argv) == 5:
        shutil.copy(path, argv[4])
    summary = {"tests": lambda r: f"{r['counts']}" + (f", selected by {r['selection']}" if r["selection"] else ""),
               "bench": lambda r: f"steps {r['steps']}" + "".join(
                   f"; {name}: {h['exposed']} of {h['samples']} samples past the hold"
                   for name, h in r["holds"].items()),
               "sanitize": lambda r: f"{r['tools']}"}[part](record)
    print(f"wrote {path}: {'green' if record['green'] else 'NOT green'}; {summary}")
    return 0 if record["green"] else 1


if __name__ == "__main__":
    sys.exit(main())
