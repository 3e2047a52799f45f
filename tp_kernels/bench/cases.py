"""What the benchmarks run: the three ops and the two layers at real models' shapes.

A :class:`Case` names a target (an op, or a layer with or without sequence parallelism) and
the *full* sizes ``x [m, k]``, ``W [n, k]``; each rank holds its share (see :meth:`Case.local`).
The op cases use a model's MLP: ``all_gather_matmul`` is the up projection (hidden -> FFN,
column-parallel), ``matmul_reduce_scatter`` and ``matmul_all_reduce`` the down projection
(FFN -> hidden, row-parallel); the layers are the same two projections, forward+backward.

On the CPU the models' feature sizes are divided by ``scale`` (default 64) so that a run
takes minutes; the labels say so (``llama3-70b/64``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .._op_table import PRIMITIVES as OPS
from .. import perf_model

__all__ = ["Case", "DECODE_M", "OPS", "LAYERS", "SWEEPS", "TARGETS", "model_cases", "custom_cases"]

#: layer targets: (name, kind, sequence_parallel)
LAYERS = {"column": ("column", False), "column_sp": ("column", True), "row": ("row", False), "row_sp": ("row", True)}
TARGETS = OPS + tuple(LAYERS)
#: targets that are sweeps of their own rather than cases: the communicator's all-reduce latency
#: against message size (tp_kernels.bench.communicator)
SWEEPS = ("communicator",)
DECODE_M = (1, 16, 64, 256)
TRAIN_M = {"cuda": (4096, 8192, 16384), "cpu": (1024, 4096)}


@dataclasses.dataclass(frozen=True)
class Case:
    target: str  # an op of OPS or a layer of LAYERS
    model: str  # e.g. "llama3-70b/64" ("custom" for --shape)
    m: int
    k: int  # in_features (full)
    n: int  # out_features (full)

    @property
    def is_layer(self) -> bool:
        return self.target in LAYERS

    @property
    def kind(self) -> str:
        """``"column"`` or ``"row"``: how the weight is split."""
        if self.is_layer:
            return LAYERS[self.target][0]
        return "column" if self.target == "all_gather_matmul" else "row"

    @property
    def sequence_parallel(self) -> bool:
        if self.is_layer:
            return LAYERS[self.target][1]
        return self.target != "matmul_all_reduce"

    def valid(self, p: int) -> Optional[str]:
        """None when the case runs on ``p`` ranks, else why not."""
        if self.sequence_parallel and self.m % p:
            return f"m={self.m} not divisible by p={p}"
        split = self.n if self.kind == "column" else self.k
        if split % p:
            return f"{'out' if self.kind == 'column' else 'in'}_features={split} not divisible by p={p}"
        return None

    def local(self, p: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """This rank's ``(x shape, W shape)``."""
        if self.kind == "column":  # (its input's rows gathered under sequence parallelism)
            return (self.m // p if self.sequence_parallel else self.m, self.k), (self.n // p, self.k)
        return (self.m, self.k // p), (self.n, self.k // p)

    def gemm_flops(self, p: int) -> float:
        """FLOPs of this rank's GEMMs: one forward GEMM, or three for a layer's forward+backward."""
        fwd = 2.0 * self.m * self.n * self.k / p
        return 3 * fwd if self.is_layer else fwd

    def tasks(self, p: int, dtype: str, gemm, link, schedule: str, num_chunks: Optional[int] = None) -> list:
        """The performance model's task graph of this case on ``p`` ranks in ``schedule``
        (``"naive"``: the reference's; ``"pipelined"``, in ``num_chunks``, None: the defaults), with
        GEMM times from ``gemm`` and collective times from ``link``
        (:mod:`tp_kernels.perf_model`)."""
        args = (self.m, self.k, self.n, p, dtype, gemm, link)
        if self.is_layer:
            return perf_model.layer_tasks(self.kind, self.sequence_parallel, *args, schedule, num_chunks)
        if schedule == "naive":
            return perf_model.naive_op_tasks(self.target, *args)
        return perf_model.op_tasks(self.target, *args, num_chunks)

    def as_dict(self) -> dict:
        return {"target": self.target, "model": self.model, "m": self.m, "in": self.k, "out": self.n,
                "sequence_parallel": self.sequence_parallel}

    def label(self) -> str:
        return f"{self.target} {self.model} m={self.m} in={self.k} out={self.n}"


def _projections(model: str, scale: int) -> Dict[str, Tuple[int, int]]:
    shape = perf_model.MODELS[model]
    up = (shape.hidden // scale, shape.ffn // scale)
    down = (shape.ffn // scale, shape.hidden // scale)
    return {"all_gather_matmul": up, "column": up, "column_sp": up,
            "matmul_reduce_scatter": down, "matmul_all_reduce": down, "row": down, "row_sp": down}


def model_cases(models: Iterable[str], ms: Sequence[int], targets: Iterable[str], p: int,
                scale: int = 1) -> List[Case]:
    """Every (model, m, target) that runs on ``p`` ranks, feature sizes divided by ``scale``."""
    targets = list(targets)
    cases = []
    for model in models:
        label = model if scale == 1 else f"{model}/{scale}"
        proj = _projections(model, scale)
        for m in ms:
            for target in targets:
                k, n = proj[target]
                case = Case(target, label, m, k, n)
                if case.valid(p) is None:
                    cases.append(case)
    return cases


def custom_cases(shapes: Iterable[Tuple[int, int, int]], targets: Iterable[str], p: int) -> List[Case]:
    """``(m, in, out)`` shapes for every target that runs on ``p`` ranks."""
    targets = list(targets)
    return [c for m, k, n in shapes for t in targets for c in [Case(t, "custom", m, k, n)] if c.valid(p) is None]
