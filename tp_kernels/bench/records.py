"""Where the benchmarks' records go and what each says of its run: device, commit, date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from typing import Dict, Optional

import torch

from .. import _extension

__all__ = ["commit", "default_out_dir", "device_name", "gpu_record", "save_record", "slug"]


def default_out_dir() -> str:
    """Where the benchmarks write when not told: a folder of this user's (``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``tp_kernels/bench``), never the source tree."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tp_kernels", "bench")


def commit() -> str:
    """``TP_KERNELS_COMMIT``, else the git commit of this source tree."""
    if os.environ.get("TP_KERNELS_COMMIT"):
        return os.environ["TP_KERNELS_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(backend: str) -> str:
    if backend == "nccl":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def slug(device: str) -> str:
    if device.startswith("CPU"):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def gpu_record(prog: str) -> Optional[Dict]:
    """The start of a GPU benchmark's record (device, commit, date, versions), or None after
    saying on stderr why it cannot run here (no CUDA device, no native module)."""
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA device; none is visible", file=sys.stderr)
        return None
    reason = _extension.unavailable()
    if reason is not None:
        print(f"{prog}: {reason}", file=sys.stderr)
        return None
    return {"device": torch.cuda.get_device_name(), "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "native": _extension.require().runtime_info()}


def save_record(record: Dict, out_dir: str, stem: str, tag: str) -> str:
    """Write ``record`` as ``<out_dir>/<stem>-<device>[-<tag>].json``; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}-{slug(record['device'])}{'-' + tag if tag else ''}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")
    return path
