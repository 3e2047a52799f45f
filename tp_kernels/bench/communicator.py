"""The ``communicator`` target of the main job: all-reduce latency against message size, per path.

For each message size (512 B to 64 MiB: doubling, or quadrupling with ``--quick``), every path the
plain all-reduce of :class:`tp_kernels.Communicator` can take here is timed on the collective
alone: ``torch.distributed`` (``reference``) everywhere; on CUDA the group's NCCL communicator
(``native:1``) and each fused algorithm (``fused:one_shot``, ...) where the group can use peer
memory. Each figure is the median over the samples of the slowest rank's time (CUDA events on
the GPU, the stream held until the call is enqueued: the GPU's time; the host clock on the CPU),
on one input buffer (a decode step's activations are in cache too). Then ``backend="auto"``, with
every path allowed, chooses for each size; the crossovers are the sizes where its choice changes.
``"auto"`` measures eagerly, the host's time to make a call with the GPU's, so where it chooses
other than the fastest path here, the host's time decided.

On a single GPU the main job runs one rank, so there is nothing to communicate; the fused
algorithms' latencies there come from ``python -m tp_kernels.bench.fused`` (virtual ranks).
"""

from __future__ import annotations

from typing import List

import torch

from .. import _collectives as coll
from .. import autotune, backends, dispatch, settings
from .._timing import Timer

__all__ = ["SIZES", "QUICK_SIZES", "crossovers", "format_table", "sweep"]

#: message sizes in bytes: 512 B to 64 MiB
SIZES = tuple(512 * 2**i for i in range(18))
QUICK_SIZES = tuple(512 * 4**i for i in range(9)) + (64 * 2**20,)


def _paths(x: torch.Tensor, group) -> List[str]:
    """Every implementation the all-reduce of tensors like ``x`` can run here, fused first."""
    p = coll.group_size(group)
    kinds, _ = dispatch.collective_candidates("all_reduce", x, group)
    return [v for kind in kinds for v in dispatch.collective_variants(kind, "all_reduce", x, p)]


def sweep(dtype: torch.dtype, device: torch.device, group, timer: Timer, quick: bool = False) -> dict:
    """Time every path at every size on this rank (all ranks call it); every rank returns the
    same figures: ``{"dtype", "p", "paths", "rows": [{"bytes", "numel", "times_s": {path: s},
    "auto"}], "crossovers"}``."""
    p = coll.group_size(group)
    element = dtype.itemsize
    previous = settings.get_auto_candidates()
    settings.set_auto_candidates(settings.AUTO_CHOICES)  # every path a candidate of "auto"
    try:
        paths = _paths(torch.empty(1, dtype=dtype, device=device), group)
        rows = []
        for nbytes in QUICK_SIZES if quick else SIZES:
            numel = nbytes // element
            x = torch.randn(numel, device=device).to(dtype)
            out = torch.empty_like(x)
            times = {path: timer(lambda i, path=path: backends.run_collective("all_reduce", path, x, out, -1, group))
                     for path in paths}
            chosen = dispatch.resolve_collective("all_reduce", "auto", x, group)
            rows.append({"bytes": nbytes, "numel": numel, "times_s": times, "auto": chosen})
    finally:
        settings.set_auto_candidates(previous)
        autotune.forget(group)
    return {"dtype": str(dtype).rpartition(".")[2], "p": p, "paths": paths, "rows": rows,
            "crossovers": crossovers(rows)}


def crossovers(rows: List[dict]) -> List[dict]:
    """The sizes at which ``auto``'s choice changes: ``{"bytes", "from", "to"}``."""
    return [{"bytes": b["bytes"], "from": a["auto"], "to": b["auto"]}
            for a, b in zip(rows, rows[1:]) if a["auto"] != b["auto"]]


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def format_table(result: dict) -> str:
    """The sweep as a table: µs per path and size, the fastest marked ``*``, ``auto``'s choice."""
    paths = result["paths"]
    width = max(10, *(len(q) for q in paths))
    head = f"{'bytes':>9} " + " ".join(f"{q:>{width}}" for q in paths) + "  auto"
    lines = [f"# communicator all_reduce, {result['dtype']}, p={result['p']}: microseconds (median, slowest rank)",
             head, "-" * len(head)]
    for row in result["rows"]:
        best = min(row["times_s"], key=row["times_s"].get)
        cells = " ".join(f"{row['times_s'][q] * 1e6:>{width - 1}.1f}{'*' if q == best else ' '}" for q in paths)
        lines.append(f"{_size(row['bytes']):>9} {cells}  {row['auto']}")
    if result["crossovers"]:
        lines.append("# auto's crossovers: " + "; ".join(f"{c['from']} -> {c['to']} at {_size(c['bytes'])}"
                                                        for c in result["crossovers"]))
    else:
        lines.append(f"# auto's choice: {result['rows'][0]['auto'] if result['rows'] else '-'} at every size")
    return "\n".join(lines)
