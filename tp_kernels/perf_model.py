"""A performance model of the tensor-parallel layers: naive against overlapped, *projected*.

What it predicts is always a projection, computed from stated inputs, never a measurement:

* **GEMM times**: measured ones (:class:`MeasuredGemm`, from our own benchmark runs) or a
  roofline of a named GPU with a stated efficiency (:class:`RooflineGemm`).
* **Collective times** on a named interconnect (:class:`Link`): the ring alpha-beta model

  - all-gather / reduce-scatter of ``S`` bytes in total: ``launch + (p-1) (step + S/p / (eff B))``
  - all-reduce: a reduce-scatter then an all-gather: ``launch + 2 (p-1) (step + S/p / (eff B))``
  - one ring step of the all-gather+GEMM ring (``s`` bytes to the next rank): ``launch + step + s / (eff B)``

  with ``B`` the per-GPU, per-direction link bandwidth and ``eff`` the fraction NCCL reaches.
  :meth:`Link.calibrated` instead fits ``launch + bytes / bw`` to measured collective times
  (that is how the model is checked against the CPU/gloo runs).
* **Schedules**: each op or layer becomes a small task graph on two resources, the compute
  stream and the link, in the order :mod:`tp_kernels.schedule` and the backends issue them
  (``naive``: every task one after the other; ``pipelined``: the chunked overlap).
  :func:`simulate` runs it; a GEMM that runs while communication is in flight is slowed by
  ``gemm_slowdown`` (NCCL's kernels and the copies take SMs and memory bandwidth).
* **The fused path on virtual ranks** (:func:`virtual_overlap_tasks`, :func:`predict_virtual_overlap`):
  the fused benchmark's case, p ranks on one GPU, as one such graph of its measured totals (every
  rank's GEMMs on the GPU's SMs, every copy on its memory), checked against that benchmark's
  measured time.

``python -m tp_kernels.perf_model`` prints the projection for a transformer layer (Llama-3 70B,
TP 8, 8xH100 NVLink by default) with every input listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .schedule import DEFAULT_NUM_CHUNKS, chunk_bounds

__all__ = [
    "GPUS",
    "LINKS",
    "MODELS",
    "GPU",
    "Link",
    "MeasuredGemm",
    "ModelShape",
    "OP_COLLECTIVE",
    "RooflineGemm",
    "Task",
    "layer_tasks",
    "op_tasks",
    "predict",
    "predict_virtual_overlap",
    "project_transformer_layer",
    "simulate",
    "slowdown_factor",
    "virtual_overlap_tasks",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------------------------
# Inputs: GPUs, links, models


@dataclasses.dataclass(frozen=True)
class GPU:
    """Datasheet figures of a GPU (dense, no sparsity)."""

    name: str
    tflops: Dict[str, float]  # peak tensor-core TFLOP/s per dtype (float32 means TF32)
    hbm_tbps: float  # memory bandwidth, TB/s
    source: str


GPUS = {
    "h100": GPU("H100 SXM5", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}, 3.35,
                "NVIDIA H100 datasheet (SXM5, dense)"),
    "h200": GPU("H200 SXM", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}, 4.8,
                "NVIDIA H200 datasheet (SXM, dense)"),
}


@dataclasses.dataclass(frozen=True)
class Link:
    """A tensor-parallel interconnect, per GPU and per direction.

    ``time(kind, nbytes, p)`` is the ring model of the module docstring. ``fits`` replaces it
    by per-kind ``(launch_s, s_per_byte)`` straight lines (see :meth:`calibrated`).
    """

    name: str
    bandwidth_gbps: float  # GB/s per GPU per direction, nominal
    efficiency: float  # fraction of it NCCL's ring reaches on large messages
    step_us: float  # per ring step latency
    launch_us: float  # per collective (kernel launch, protocol set-up)
    source: str = ""
    fits: Optional[Dict[str, Tuple[float, float]]] = None

    def time(self, kind: str, nbytes: float, p: int) -> float:
        """Seconds for collective ``kind`` over ``nbytes`` (total, see the module docstring)."""
        if p == 1:
            return 0.0
        if self.fits is not None:
            if kind == "ring_step" and "ring_step" not in self.fits:
                # one of the p-1 steps of a ring all-gather of p*nbytes
                launch, per_byte = self.fits["all_gather"]
                return launch / (p - 1) + per_byte * nbytes * p / (p - 1)
            launch, per_byte = self.fits[kind]
            return launch + per_byte * nbytes
        bw = self.bandwidth_gbps * 1e9 * self.efficiency
        step, launch = self.step_us * 1e-6, self.launch_us * 1e-6
        if kind == "ring_step":
            return launch + step + nbytes / bw
        steps = {"all_gather": p - 1, "reduce_scatter": p - 1, "all_reduce": 2 * (p - 1)}[kind]
        return launch + steps * (step + nbytes / p / bw)

    @classmethod
    def calibrated(cls, name: str, samples: Dict[str, Sequence[Tuple[float, float]]]) -> "Link":
        """A link fitted to measurements: ``samples[kind]`` = [(bytes, seconds), ...], >= 2 sizes.

        Each kind gets a least-squares line ``seconds = launch + bytes * s_per_byte`` (both
        clamped at >= 0).
        """
        fits = {}
        for kind, pts in samples.items():
            if len(pts) < 2:
                raise ValueError(f"samples[{kind!r}]: need at least two (bytes, seconds) points")
            xs, ys = [float(b) for b, _ in pts], [float(t) for _, t in pts]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
            fits[kind] = (max(0.0, my - slope * mx), slope)
        return cls(name, 0.0, 1.0, 0.0, 0.0, "fitted to measured collective times", fits)

    def describe(self) -> str:
        if self.fits is not None:
            return f"{self.name} ({self.source})"
        return (f"{self.name}: {self.bandwidth_gbps:g} GB/s per direction x NCCL efficiency {self.efficiency:g}, "
                f"{self.step_us:g} us per ring step, {self.launch_us:g} us per collective ({self.source})")


LINKS = {
    "nvlink4": Link("NVLink 4 (NVSwitch, 8 GPUs)", 450.0, 0.80, 1.0, 6.0,
                    "18 links x 25 GB/s per direction; NCCL ring ~80% of it"),
    "pcie5": Link("PCIe 5.0 x16", 64.0, 0.75, 3.0, 8.0, "~64 GB/s per direction; no NVLink"),
    "ib400": Link("InfiniBand NDR 400 Gb/s (one NIC per GPU, one GPU per node)", 50.0, 0.80, 5.0, 10.0,
                  "400 Gb/s = 50 GB/s per direction; every ring hop crosses the network"),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Hidden sizes of a transformer (its tensor-parallel linear layers)."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    gated_mlp: bool  # SwiGLU: gate and up projections fused into one column-parallel layer

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def linears(self) -> List[Tuple[str, str, int, int]]:
        """``(name, "column"|"row", in_features, out_features)`` of one layer."""
        up = 2 * self.ffn if self.gated_mlp else self.ffn
        return [("qkv", "column", self.hidden, self.qkv_out), ("out", "row", self.heads * self.head_dim, self.hidden),
                ("up", "column", self.hidden, up), ("down", "row", self.ffn, self.hidden)]


MODELS = {
    "llama3-8b": ModelShape("Llama-3 8B", 4096, 14336, 32, 8, 128, True),
    "llama3-70b": ModelShape("Llama-3 70B", 8192, 28672, 64, 8, 128, True),
    "gpt3-175b": ModelShape("GPT-3 175B", 12288, 49152, 96, 96, 128, False),
}


# ---------------------------------------------------------------------------------------------
# GEMM times


@dataclasses.dataclass(frozen=True)
class RooflineGemm:
    """``max(flops / (efficiency * peak), bytes / (hbm_efficiency * HBM)) + launch``: an assumption."""

    gpu: GPU
    efficiency: float = 0.70
    hbm_efficiency: float = 0.85
    launch_us: float = 4.0

    def __call__(self, m: int, n: int, k: int, dtype: str) -> float:
        if m == 0 or n == 0 or k == 0:
            return 0.0
        flops = 2.0 * m * n * k
        nbytes = DTYPE_BYTES[dtype] * (m * k + n * k + m * n)
        return max(flops / (self.efficiency * self.gpu.tflops[dtype] * 1e12),
                   nbytes / (self.hbm_efficiency * self.gpu.hbm_tbps * 1e12)) + self.launch_us * 1e-6

    def describe(self) -> str:
        return (f"roofline of {self.gpu.name} ({self.gpu.source}): {self.efficiency:.0%} of peak tensor TFLOP/s, "
                f"{self.hbm_efficiency:.0%} of {self.gpu.hbm_tbps:g} TB/s, +{self.launch_us:g} us per GEMM (assumed)")


class MeasuredGemm:
    """GEMM times looked up in measurements ``{(m, n, k, dtype): seconds}``.

    A shape that was not measured is scaled from the measured one with the same ``(n, k,
    dtype)`` and the nearest ``m`` (time proportional to m, plus the smallest measured time
    as a floor), else taken from ``fallback``.
    """

    def __init__(self, times: Dict[Tuple[int, int, int, str], float], fallback: Optional[Callable] = None,
                 source: str = "measured"):
        self.times = dict(times)
        self.fallback = fallback
        self.source = source

    def __call__(self, m: int, n: int, k: int, dtype: str) -> float:
        if m == 0:
            return 0.0
        key = (m, n, k, dtype)
        if key in self.times:
            return self.times[key]
        same = [(mm, t) for (mm, nn, kk, dd), t in self.times.items() if (nn, kk, dd) == (n, k, dtype)]
        if same:
            mm, t = min(same, key=lambda it: abs(math.log(it[0] / m)))
            return max(min(t for _, t in same), t * m / mm)
        if self.fallback is not None:
            return self.fallback(m, n, k, dtype)
        raise KeyError(f"no measured GEMM time for m={m}, n={n}, k={k}, {dtype}")

    def describe(self) -> str:
        return f"{self.source} ({len(self.times)} shapes)"


# ---------------------------------------------------------------------------------------------
# Schedules as task graphs


@dataclasses.dataclass
class Task:
    """One GEMM (``resource="compute"``) or one collective (``resource="link"``)."""

    name: str
    resource: str
    duration: float
    deps: Tuple[int, ...] = ()


def simulate(tasks: Sequence[Task], gemm_slowdown: float = 1.0) -> float:
    """Makespan (seconds) of ``tasks``; each resource runs its tasks one at a time, in list order.

    A task starts when its resource is free and its dependencies are done. Compute tasks that
    overlap any communication run ``gemm_slowdown`` times longer (found by simulating once at
    full speed, then again with those tasks slowed).
    """
    base = [t.duration for t in tasks]
    if gemm_slowdown == 1.0:
        return max(_schedule(tasks, base)[1], default=0.0)
    slowed = [d * gemm_slowdown if beside else d for d, beside in zip(base, _beside_comm(tasks))]
    return max(_schedule(tasks, slowed)[1], default=0.0)


def _schedule(tasks: Sequence[Task], durations: Sequence[float]) -> Tuple[List[float], List[float]]:
    """Each task's start and end (:func:`simulate`) with these durations."""
    free = {"compute": 0.0, "link": 0.0}
    start: List[float] = []
    end: List[float] = []
    for i, task in enumerate(tasks):
        if any(d >= i for d in task.deps):
            raise ValueError(f"task {i} ({task.name}) depends on a later task")
        s = max([free[task.resource]] + [end[d] for d in task.deps])
        start.append(s)
        end.append(s + durations[i])
        free[task.resource] = end[-1]
    return start, end


def _beside_comm(tasks: Sequence[Task]) -> List[bool]:
    """Whether each task is a GEMM that overlaps communication, nothing slowed."""
    start, end = _schedule(tasks, [t.duration for t in tasks])
    comm = [(start[i], end[i]) for i, t in enumerate(tasks) if t.resource == "link" and end[i] > start[i]]
    return [t.resource == "compute" and any(a < end[i] and start[i] < b for a, b in comm) for i, t in enumerate(tasks)]


def _serial(tasks: List[Task]) -> List[Task]:
    """The naive schedule: each task waits for the previous one."""
    return [dataclasses.replace(t, deps=(i - 1,) if i else ()) for i, t in enumerate(tasks)]


class _Graph:
    def __init__(self):
        self.tasks: List[Task] = []

    def add(self, name, resource, duration, deps=()) -> int:
        self.tasks.append(Task(name, resource, duration, tuple(d for d in deps if d is not None)))
        return len(self.tasks) - 1


def _chunks_run(p: int, chunks: int) -> int:
    """The chunks a pipelined call of p ranks splits its GEMM into: with one rank none, whatever
    it was asked (every backend runs the whole GEMM there: nothing to overlap it with)."""
    return 1 if p == 1 else chunks


def _ag_gemm(g: _Graph, gemm, link, m, k, n_local, p, dtype, chunks, after=None) -> List[int]:
    """The all-gather+GEMM ring: (m/p, k) shards; returns the GEMM task ids."""
    eb = DTYPE_BYTES[dtype]
    mp = m // p
    pieces = chunk_bounds(mp, _chunks_run(p, chunks))
    arrived = {(0, j): after for j in range(len(pieces))}
    gemms = []
    for step in range(p):
        for j, (a, b) in enumerate(pieces):
            if step < p - 1:
                arrived[(step + 1, j)] = g.add(f"ring step {step} piece {j}", "link",
                                               link.time("ring_step", (b - a) * k * eb, p),
                                               deps=(arrived[(step, j)],))
            gemms.append(g.add(f"gemm shard {step} piece {j}", "compute", gemm(b - a, n_local, k, dtype),
                               deps=(arrived[(step, j)],)))
    return gemms


def _gemm_coll(g: _Graph, gemm, link, kind, m, k_local, n, p, dtype, chunks, after=None) -> List[int]:
    """GEMM + reduce-scatter / all-reduce in chunks; returns the collective task ids."""
    eb = DTYPE_BYTES[dtype]
    rows = m // p if kind == "reduce_scatter" else m
    colls = []
    for j, (a, b) in enumerate(chunk_bounds(rows, _chunks_run(p, chunks))):
        mm = (b - a) * (p if kind == "reduce_scatter" else 1)
        t = g.add(f"gemm chunk {j}", "compute", gemm(mm, n, k_local, dtype), deps=(after,))
        colls.append(g.add(f"{kind} chunk {j}", "link", link.time(kind, mm * n * eb, p), deps=(t,)))
    return colls


#: the collective each op communicates
OP_COLLECTIVE = {"all_gather_matmul": "all_gather", "matmul_reduce_scatter": "reduce_scatter",
                 "matmul_all_reduce": "all_reduce"}


def op_tasks(op: str, m: int, k: int, n: int, p: int, dtype: str, gemm, link: Link,
             num_chunks: Optional[int] = None) -> List[Task]:
    """The pipelined schedule of one op; ``m, k, n`` are the *full* sizes (x ``[m, k]``, W ``[n, k]``)."""
    g = _Graph()
    c = num_chunks or DEFAULT_NUM_CHUNKS[op]
    if op == "all_gather_matmul":
        _ag_gemm(g, gemm, link, m, k, n // p, p, dtype, c)
    else:
        _gemm_coll(g, gemm, link, OP_COLLECTIVE[op], m, k // p, n, p, dtype, c)
    return g.tasks


def naive_op_tasks(op: str, m: int, k: int, n: int, p: int, dtype: str, gemm, link: Link) -> List[Task]:
    """Collective, then GEMM (or the reverse), nothing overlapped."""
    eb = DTYPE_BYTES[dtype]
    if op == "all_gather_matmul":
        return _serial([Task("all-gather", "link", link.time("all_gather", m * k * eb, p)),
                        Task("gemm", "compute", gemm(m, n // p, k, dtype))])
    return _serial([Task("gemm", "compute", gemm(m, n, k // p, dtype)),
                    Task(OP_COLLECTIVE[op], "link", link.time(OP_COLLECTIVE[op], m * n * eb, p))])


def layer_tasks(kind: str, sp: bool, m: int, k: int, n: int, p: int, dtype: str, gemm, link: Link,
                schedule: str = "pipelined", num_chunks: Optional[int] = None) -> List[Task]:
    """Forward + backward of a column/row-parallel linear (``k`` in, ``n`` out, ``m`` tokens).

    Pipelined, as the backends run them: column+SP forward is the all-gather+GEMM ring; its
    backward re-gathers x while dgrad multiplies, reduce-scatters dgrad in chunks, then runs
    wgrad. Row+SP forward is GEMM+reduce-scatter; its backward is the ring (dgrad) then
    wgrad. Without SP: column backward is dgrad+all-reduce in chunks then wgrad; row forward
    is GEMM+all-reduce. ``schedule="naive"`` runs the same GEMMs and collectives one after the
    other, unchunked. ``num_chunks`` (None: the defaults) is the chunks of each call's own
    primitive, which a user names; the backward of an all-gather or reduce-scatter runs the other
    primitive in its own default chunks, as the library does (``backends.backward_name``).
    """
    eb = DTYPE_BYTES[dtype]
    g = _Graph()
    if schedule == "naive":
        comm = lambda kind_, nbytes: g.add(kind_, "link", link.time(kind_, nbytes, p))  # noqa: E731
        mm = lambda name, a, b, c: g.add(name, "compute", gemm(a, b, c, dtype))  # noqa: E731
        if kind == "column":
            nl = n // p
            if sp:
                comm("all_gather", m * k * eb)
            mm("fwd", m, nl, k)
            if sp:
                comm("all_gather", m * k * eb)  # x re-gathered for wgrad
            mm("dgrad", m, k, nl)
            comm("reduce_scatter" if sp else "all_reduce", m * k * eb)
            mm("wgrad", nl, k, m)
        else:
            kl = k // p
            mm("fwd", m, n, kl)
            comm("reduce_scatter" if sp else "all_reduce", m * n * eb)
            if sp:
                comm("all_gather", m * n * eb)
            mm("dgrad", m, kl, n)
            mm("wgrad", n, kl, m)
        return _serial(g.tasks)
    if kind == "column":
        nl = n // p
        if sp:
            fwd = _ag_gemm(g, gemm, link, m, k, nl, p, dtype, num_chunks or DEFAULT_NUM_CHUNKS["all_gather_matmul"])
            regather = g.add("all-gather x", "link", link.time("all_gather", m * k * eb, p), deps=(fwd[-1],))
            # backward: dgrad and its reduce-scatter in the reduce-scatter's own chunks (backends.backward_name)
            _gemm_coll(g, gemm, link, "reduce_scatter", m, nl, k, p, dtype, DEFAULT_NUM_CHUNKS["matmul_reduce_scatter"],
                       after=fwd[-1])
            g.add("wgrad", "compute", gemm(nl, k, m, dtype), deps=(regather,))
        else:
            fwd = g.add("fwd", "compute", gemm(m, nl, k, dtype))
            c_ar = num_chunks or DEFAULT_NUM_CHUNKS["matmul_all_reduce"]  # (the op's own all-reduce, in backward)
            _gemm_coll(g, gemm, link, "all_reduce", m, nl, k, p, dtype, c_ar, after=fwd)
            g.add("wgrad", "compute", gemm(nl, k, m, dtype))
        return g.tasks
    kl = k // p
    if sp:
        c = num_chunks or DEFAULT_NUM_CHUNKS["matmul_reduce_scatter"]
        colls = _gemm_coll(g, gemm, link, "reduce_scatter", m, kl, n, p, dtype, c)
        # backward: the ring on dy (m/p, n) in the all-gather's own chunks (backends.backward_name), then wgrad
        bwd = _ag_gemm(g, gemm, link, m, n, kl, p, dtype, DEFAULT_NUM_CHUNKS["all_gather_matmul"], after=colls[-1])
        g.add("wgrad", "compute", gemm(n, kl, m, dtype), deps=(bwd[-1],))
    else:
        c = num_chunks or DEFAULT_NUM_CHUNKS["matmul_all_reduce"]
        colls = _gemm_coll(g, gemm, link, "all_reduce", m, kl, n, p, dtype, c)
        g.add("dgrad", "compute", gemm(m, kl, n, dtype), deps=(colls[-1],))
        g.add("wgrad", "compute", gemm(n, kl, m, dtype), deps=(colls[-1],))
    return g.tasks


def virtual_overlap_tasks(op: str, p: int, t_gemm: float, t_comm: float) -> List[Task]:
    """The fused ``all_gather_matmul`` or ``matmul_reduce_scatter`` of ``p`` virtual ranks on one
    GPU (:mod:`tp_kernels.bench.fused`'s overlap case: whole shards, phases in rounds) as one task
    graph of the case's measured totals: every rank's GEMMs on the GPU's one ``"compute"`` resource
    (``t_gemm`` in all, p per rank), every copy between the ranks' buffers on one ``"link"``, its
    memory (``t_comm`` in all, shared by the bytes each moves), in the order the ranks issue them.

    * ``all_gather_matmul``: each rank publishes its shard and copies it to its own rows (two shard
      copies, on its stream, before its first GEMM); once every rank has published, each pulls the
      p - 1 peers' shards; its GEMM of a shard waits for that shard. ``t_comm`` is the p (p - 1)
      pulls, so a shard copy takes ``t_comm / (p (p - 1))``.
    * ``matmul_reduce_scatter``: each rank multiplies the destinations' blocks in the order
      r + 1, ..., r and pushes each remote product into its destination's inbox; each destination
      then sums its p slots, a kernel on its stream (on ``"compute"``) once every push to it has
      landed. ``t_comm`` is the p (p - 1) pushes and the p sums, shared by the bytes each reads and
      writes (a push 2 blocks, a sum p + 1).
    """
    g = _Graph()
    gemm = t_gemm / (p * p)
    if op == "all_gather_matmul":
        shard = t_comm / (p * (p - 1)) if p > 1 else 0.0
        published = [g.add(f"rank {q}: publish its shard, copy it to its rows", "link", 2 * shard) for q in range(p)]
        pulled = {(q, s): g.add(f"rank {q}: pull shard {s}", "link", shard, deps=published)
                  for s in range(1, p) for q in range(p)}
        for s in range(p):
            for q in range(p):
                g.add(f"rank {q}: GEMM of shard {s}", "compute", gemm, deps=(published[q] if s == 0 else pulled[q, s],))
    elif op == "matmul_reduce_scatter":
        units = 2 * p * (p - 1) + p * (p + 1)
        pushes: Dict[int, List[int]] = {d: [] for d in range(p)}
        for s in range(1, p + 1):
            for r in range(p):
                d = (r + s) % p
                mm = g.add(f"rank {r}: GEMM of block {d}", "compute", gemm)
                if d != r:
                    pushes[d].append(g.add(f"rank {r}: push block {d}", "link", 2 * t_comm / units, deps=(mm,)))
        for d in range(p):
            g.add(f"rank {d}: sum its {p} slots", "compute", (p + 1) * t_comm / units, deps=pushes[d])
    else:
        raise ValueError(f"op: {op!r} is not all_gather_matmul or matmul_reduce_scatter")
    return g.tasks


def slowdown_factor(tasks: Sequence[Task], slowdown: float, t_gemm: float) -> float:
    """:func:`simulate`'s ``gemm_slowdown`` for GEMMs of ``t_gemm`` in all that lose ``slowdown``
    of it to the copies beside them (as :mod:`tp_kernels.bench.fused` measures it: the GEMMs with
    every copy issued beside them, over the GEMMs alone, minus 1), that loss spread over the
    compute tasks that overlap a copy when nothing is slowed."""
    beside = sum(t.duration for t, b in zip(tasks, _beside_comm(tasks)) if b)
    return 1.0 + slowdown * t_gemm / beside if beside > 0 else 1.0


def predict_virtual_overlap(op: str, p: int, t_gemm: float, t_comm: float, gemm_slowdown: float) -> float:
    """The fused ``op``'s time on ``p`` virtual ranks (:func:`virtual_overlap_tasks`) from its case's
    GEMMs alone, copies alone and the GEMMs' slowdown beside the copies (any one unit of time)."""
    tasks = virtual_overlap_tasks(op, p, t_gemm, t_comm)
    return simulate(tasks, slowdown_factor(tasks, gemm_slowdown, t_gemm))


def predict(tasks: Sequence[Task], gemm_slowdown: float = 1.0) -> Dict[str, float]:
    """Makespan plus the busy time of each resource (``gemm``, ``comm``), in seconds."""
    return {
        "time": simulate(tasks, gemm_slowdown),
        "gemm": sum(t.duration for t in tasks if t.resource == "compute"),
        "comm": sum(t.duration for t in tasks if t.resource == "link"),
    }


# ---------------------------------------------------------------------------------------------
# The transformer-layer projection


def _attention_time(model: ModelShape, m: int, seq: int, p: int, gpu: GPU, dtype: str, efficiency: float) -> float:
    """Causal attention core, forward + backward (3.5x the forward's FLOPs), this rank's heads."""
    heads = model.heads // p
    fwd_flops = 2.0 * m * seq * heads * model.head_dim  # QK^T and PV, causal half of 4*m*s*h*d
    return 3.5 * fwd_flops / (efficiency * gpu.tflops[dtype] * 1e12)


def project_transformer_layer(model: ModelShape, p: int, m: int, seq: int, gpu: GPU, link: Link,
                              dtype: str = "bfloat16", gemm=None, gemm_slowdown: float = 1.05,
                              attention_efficiency: float = 0.5, num_chunks: Optional[int] = None) -> dict:
    """Naive vs pipelined forward+backward of one layer with sequence parallelism: a projection."""
    gemm = gemm or RooflineGemm(gpu)
    rows = []
    for name, kind, k, n in model.linears():
        naive = predict(layer_tasks(kind, True, m, k, n, p, dtype, gemm, link, "naive"))
        over = predict(layer_tasks(kind, True, m, k, n, p, dtype, gemm, link, "pipelined", num_chunks), gemm_slowdown)
        rows.append({"linear": name, "kind": kind, "in": k, "out": n, "naive_ms": naive["time"] * 1e3,
                     "overlapped_ms": over["time"] * 1e3, "gemm_ms": naive["gemm"] * 1e3, "comm_ms": naive["comm"] * 1e3})
    attn = _attention_time(model, m, seq, p, gpu, dtype, attention_efficiency)
    naive = sum(r["naive_ms"] for r in rows) + attn * 1e3
    over = sum(r["overlapped_ms"] for r in rows) + attn * 1e3
    return {
        "label": "PROJECTION (model output, not a measurement)",
        "inputs": {
            "model": dataclasses.asdict(model), "tp": p, "tokens_m": m, "sequence_length": seq, "dtype": dtype,
            "gpu": gpu.name, "link": link.describe(), "gemm_times": gemm.describe(),
            "gemm_slowdown_under_overlap": gemm_slowdown,
            "attention": f"causal attention core at {attention_efficiency:.0%} of peak (assumed), fwd+bwd = 3.5x fwd FLOPs",
            "not modelled": "layer norms, activations, residual adds, optimizer",
            "num_chunks": num_chunks or dict(DEFAULT_NUM_CHUNKS),
        },
        "linears": rows,
        "attention_ms": attn * 1e3,
        "naive_ms": naive,
        "overlapped_ms": over,
        "speedup": naive / over if over else float("nan"),
    }


def format_projection(proj: dict) -> str:
    lines = [f"# {proj['label']}"]
    for key, value in proj["inputs"].items():
        lines.append(f"#   {key}: {value}")
    lines.append(f"{'linear':<6} {'kind':<6} {'in':>6} {'out':>6} {'GEMM ms':>8} {'comm ms':>8} "
                 f"{'naive ms':>9} {'overlap ms':>10} {'speedup':>8}")
    for r in proj["linears"]:
        lines.append(f"{r['linear']:<6} {r['kind']:<6} {r['in']:>6} {r['out']:>6} {r['gemm_ms']:>8.3f} "
                     f"{r['comm_ms']:>8.3f} {r['naive_ms']:>9.3f} {r['overlapped_ms']:>10.3f} "
                     f"{r['naive_ms'] / r['overlapped_ms']:>7.2f}x")
    lines.append(f"{'attention core (compute only)':<46}{proj['attention_ms']:>9.3f} {proj['attention_ms']:>10.3f}")
    lines.append(f"{'layer forward+backward':<46}{proj['naive_ms']:>9.3f} {proj['overlapped_ms']:>10.3f} "
                 f"{proj['speedup']:>7.2f}x  (projected)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp_kernels.perf_model",
                                 description="Project naive vs overlapped time of a transformer layer (a model, not a measurement).")
    ap.add_argument("--model", default="llama3-70b", choices=sorted(MODELS))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="m = sequence length x micro-batch")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: --tokens)")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--link", default="nvlink4", choices=sorted(LINKS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--gemm-efficiency", type=float, default=0.70, help="assumed fraction of peak TFLOP/s")
    ap.add_argument("--gemm-slowdown", type=float, default=1.05, help="GEMM slowdown while NCCL runs (assumed)")
    ap.add_argument("--num-chunks", type=int, default=None)
    args = ap.parse_args(argv)
    model = MODELS[args.model]
    for what, size in (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn", model.ffn), ("hidden", model.hidden)):
        if size % args.tp:
            ap.error(f"--tp: {args.model} has {what} = {size}, not divisible by {args.tp}")
    if args.tokens % args.tp:
        ap.error(f"--tokens: {args.tokens} is not divisible by --tp {args.tp}")
    gpu = GPUS[args.gpu]
    proj = project_transformer_layer(model, args.tp, args.tokens, args.seq or args.tokens, gpu, LINKS[args.link],
                                     args.dtype, RooflineGemm(gpu, args.gemm_efficiency), args.gemm_slowdown,
                                     num_chunks=args.num_chunks)
    print(format_projection(proj))
    return 0


if __name__ == "__main__":
    sys.exit(main())
