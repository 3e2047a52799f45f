"""Host time of one eager call: what tp_kernels' Python adds over plain PyTorch doing the same
work, at p ranks, with the communication itself taken out.

    python -m tp_kernels.bench.host [--ranks 1,2,8] [--device cpu|cuda] [--peers] [--samples N] [--profile CALLS]
                                    [--out-dir DIR] [--tag T]

For each p this process joins a one-process *fake* world of p ranks (torch's ``fake`` backend,
``torch.testing._internal.distributed.fake_pg``: every collective completes at once and moves
nothing), so the figure is the host time of the call's path alone (the checks, the decision,
the custom op, the collective's issue and wait), at the group size a user runs, not only at
p = 1 where every collective is skipped. It times, at the decode size of
:mod:`tp_kernels.bench.extension` on a GPU (m = 16, k = 3584, n = 8192, bf16; on the CPU m = 16,
k = n = 64, float32, one thread):

* ``plain``: what a hand-written row-parallel layer does: ``F.linear``, then (p > 1)
  ``dist.all_reduce`` of the result, issued asynchronously and waited for;
* ``matmul_all_reduce/<backend>``: :func:`tp_kernels.matmul_all_reduce` on each backend that can
  run on a fake group (the reference and the portable pipelined schedule; ``auto``, whose one
  candidate there is the reference, :data:`FAKE_GROUP_AUTO`; the native and fused paths need real
  peers and are skipped, saying so); on NCCL ranks also
  ``matmul_all_reduce/pipelined:nonblocking``, the native pipelined path with its communicator in
  NCCL's nonblocking mode (:func:`tp_kernels.settings.set_nccl_blocking`, a communicator of its
  own; the default is blocking where the NCCL loaded can revoke a call), and
  ``matmul_all_reduce/pipelined:two_streams``, the native path with its chunks' GEMMs alternating
  between two streams (:func:`tp_kernels.settings.set_gemm_streams`: two events more a call);
* ``matmul_all_reduce/auto:measured``: ``"auto"`` choosing among every backend timed above (named
  with :func:`tp_kernels.settings.set_auto_candidates`), its shape class measured by the first,
  untimed call: the host time of a call ``"auto"`` has decided (the record's ``"auto_decisions"``
  lists what it measured and chose);
* ``plain_layer`` and ``RowParallelLinear/auto``: a hand-written row-parallel ``nn.Module`` with a
  bias (:class:`PlainRowParallel`, Megatron's: ``F.linear`` without the bias, the all-reduce,
  then the bias added once), and tp_kernels' layer, under ``torch.no_grad()`` (the serving case);
* ``plain_column`` and ``ColumnParallelLinear/auto``, ``plain_head`` and
  ``ColumnParallelLinear/gather_output``, ``plain_embedding`` and ``VocabParallelEmbedding``: the
  other layers of a decode step, under ``torch.no_grad()``, each against what a hand-written one
  does: a column layer's ``nn.Linear`` of this rank's rows, with a bias (nothing communicated: its
  backward all-reduces); an output layer's, without, and the all-gather of its ``[m, n]`` blocks
  along the last dim (as ``plain_all_gather``); the lookup of this rank's rows of a ``[p·n, k]``
  table, the other ids masked, and the all-reduce (Megatron's); tp_kernels' embedding also checks
  the ids against the vocabulary (``TP_KERNELS_CHECK_IDS``: on a GPU, a host sync), and
  ``VocabParallelEmbedding/unchecked`` is the same call unchecked (``set_ids_checked(False)``, no
  host sync: an id out of range fails the lookup instead, four small ops more);
* ``plain_all_reduce`` and ``Communicator.all_reduce``: a serving engine's all-reduce of the
  ``[m, n]`` output, into a new tensor (``dist.all_reduce`` of a clone, issued and waited for),
  and ``plain_all_reduce_inplace`` and ``Communicator.all_reduce/in_place`` (``out=`` the input);
  on NCCL ranks also ``plain_all_reduce_inplace/nonblocking``, the same call on a second group
  whose communicator is in NCCL's nonblocking mode, as the native path's is (there NCCL starts a
  thread for each call's launch and returns at once, and the call is polled until it is
  launched): what that mode costs a call over the blocking one;
* ``plain_all_gather`` and ``Communicator.all_gather``: its all-gather of ``[m, n]`` blocks along
  the last dim (the logits' vocabulary), as vLLM's ``all_gather`` does it (into ``[p, m, n]``,
  issued and waited for, then moved to ``[m, p*n]``).

With ``--peers`` the calls run instead on p processes of a real group (each p >= 2 of
``--ranks``), on a GPU p NCCL ranks sharing it (:data:`tp_kernels.testing.ONE_GPU_RANKS_ENV`), so
that the native and fused paths run too, with ``fused`` among the backends: there, the host never
waits for the communication, and a figure is still the host time of issuing a call (rank 0's; every
rank's ``added_us`` is in the record). A sample is then 20 calls, which stay under the launch
queue's depth with their chunks' kernels and events. On a GPU the record also holds, per rank,
what the pipelined path's NCCL calls cost the host (``nccl_progress``: the calls a
``matmul_all_reduce`` makes on the communicator of the default mode, how many return in progress,
and the µs spent polling them; ``nccl_progress_nonblocking`` the same on a nonblocking one, where
every call may return in progress). On the CPU the ranks are gloo processes whose waits include the
transfer itself: a check of the tool, not a figure.

Each figure is the fastest of ``--samples`` samples, each the mean host time of 200 calls, the
calls timed in turns, the order rotated each round (on a GPU the device is synchronised between
samples only, so issuing never waits for it; 200 calls stay under CUDA's launch queue depth).
The fastest, not the median: what disturbs a host's timing (other processes, interrupts, a shared
VM's neighbours) only adds to it, so the fastest sample is the call's own cost (the median is in
the record too).
``added_us`` is a call's figure minus its plain counterpart's. ``function_calls`` counts the
functions, Python and builtin, one call goes through (:func:`function_calls`), and
``added_function_calls`` what it counts over the plain counterpart: the host work as a number
that a machine's load does not move (on a fake group the same in every run of a commit), where
the times of a shared VM vary by a fifth from run to run. With ``--profile CALLS`` each
call also runs CALLS times under cProfile, and the record lists, per call, the functions its host
time goes to (:func:`profiled`: their own and cumulative µs a call, inflated alike by the
profiler). The
target (``tp_kernels.bench.targets``: ``host_overhead_us``) is read against the GPU host's
figures. Fingerprints are off here: on a fake group they would compare garbage, and
``python -m tp_kernels.bench.fingerprints`` measures their cost. Writes ``host-<device>[-<tag>].json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from typing import Callable, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import autotune, dispatch, ops, parallel_state, settings
from .._timing import synchronize, turns
from ..communicator import Communicator
from ..embedding import VocabParallelEmbedding
from ..layers import ColumnParallelLinear, RowParallelLinear
from .records import commit, default_out_dir, device_name, save_record
from .targets import TARGETS

CALLS_PER_SAMPLE = 200
#: calls per sample with real peers (--peers): with their kernels, events and NCCL launches, they
#: stay under CUDA's launch queue depth
PEER_CALLS_PER_SAMPLE = 20
#: the row of ``matmul_all_reduce`` by ``"auto"`` choosing among every backend that runs here (its
#: class measured on the first call, as a deployment's first step does)
MEASURED_AUTO = "matmul_all_reduce/auto:measured"
#: the name of the in-place all-reduce on an NCCL communicator in nonblocking mode (NCCL groups only)
NONBLOCKING_ALL_REDUCE = "plain_all_reduce_inplace/nonblocking"
#: the native pipelined ``matmul_all_reduce`` on a communicator in NCCL's nonblocking mode (NCCL groups only)
NONBLOCKING_PIPELINED = "matmul_all_reduce/pipelined:nonblocking"
#: the native pipelined ``matmul_all_reduce`` with its GEMMs on two streams (NCCL groups only)
TWO_STREAMS_PIPELINED = "matmul_all_reduce/pipelined:two_streams"
#: the native path's other modes timed on NCCL groups: name -> the settings its calls run under
#: (nonblocking mode: a communicator of its own, made in that mode by its first call)
NATIVE_MODES = {NONBLOCKING_PIPELINED: {"nccl_blocking": False}, TWO_STREAMS_PIPELINED: {"gemm_streams": 2}}
#: the name of the embedding's call without its ids' check (``set_ids_checked(False)``)
UNCHECKED_EMBEDDING = "VocabParallelEmbedding/unchecked"
#: the functions :func:`profiled` lists a call
PROFILE_TOP = 12
#: the calls :func:`function_calls` counts over
FUNCTION_COUNT_CALLS = 20
#: (m, k, n) of the timed GEMM: the decode GEMM of tp_kernels.bench.extension on a GPU, a tiny one on the CPU
SHAPES = {"cuda": (16, 28672 // 8, 8192), "cpu": (16, 64, 64)}


def fake_world(p: int) -> None:
    """Make this process the one member of a fake world of ``p`` ranks (rank 0), in place of any
    default group it had."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)


def host_times_us(fns: Dict[str, Callable[[], object]], samples: int, cuda: bool,
                  calls: int = CALLS_PER_SAMPLE,
                  around: Optional[Dict[str, Callable[[], ContextManager]]] = None) -> Dict[str, Dict[str, float]]:
    """For each of ``fns``, the median and the fastest of ``samples`` mean host times of a call
    (µs). The samples are taken in turns, one of each function per round, the order rotated each
    round (:func:`tp_kernels._timing.turns`, as the GPU figures are), so that a machine's drift, and
    what one function leaves behind for the next (a cache, a collection due), weigh on all of them
    alike. ``around[name]()``: a context a function's calls run in, entered outside its timed loop
    (settings it needs)."""
    around = around or {}
    for name, fn in fns.items():
        with around.get(name, contextlib.nullcontext)():
            for _ in range(3):
                fn()
    if cuda:
        synchronize("host_times_us: the warm-up calls")
    times: Dict[str, List[float]] = {name: [] for name in fns}
    names = list(fns)
    for _, j in turns(len(names), samples):
        name, fn = names[j], fns[names[j]]
        with around.get(name, contextlib.nullcontext)():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            synchronize(f"host_times_us: {name}'s timed calls")
    return {name: {"median_us": statistics.median(t), "min_us": min(t)} for name, t in times.items()}


def profiled(fn: Callable[[], object], calls: int, cuda: bool, top: int = PROFILE_TOP) -> List[list]:
    """The ``top`` functions by their own time over ``calls`` calls of ``fn`` under cProfile, as
    ``[function, its calls a call, own µs a call, cumulative µs a call]``: where a call's host time
    goes. (cProfile's own cost inflates every function's time: the rows rank the path's parts,
    the timings above time it.)"""
    import cProfile
    import gc
    import pstats

    fn()
    if cuda:
        synchronize("profiled: the first call")
    prof = cProfile.Profile()
    collecting = gc.isenabled()
    gc.disable()  # (a collection's pause is no part of a call's path; it would land on whichever ran)
    try:
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    finally:
        if collecting:
            gc.enable()
    if cuda:
        synchronize("profiled: the profiled calls")
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda item: -item[1][2])[:top]
    return [[f"{'/'.join(path.replace(chr(92), '/').split('/')[-2:])}:{line}({name})", count / calls,
             own / calls * 1e6, cumulative / calls * 1e6]
            for (path, line, name), (_, count, own, cumulative, _) in rows]


def function_calls(fn: Callable[[], object], calls: int = FUNCTION_COUNT_CALLS) -> float:
    """The function calls one call of ``fn`` makes, Python functions and builtins alike (cProfile
    counts them; the mean over ``calls`` calls, after one): the host work of a call as a count, which
    a shared machine's load does not change, where its time varies by a fifth from run to run. (Not
    a time: a builtin that launches a GEMM counts one, as a check of a tensor's dim does.)"""
    import cProfile
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return (pstats.Stats(prof).total_calls - 1) / calls  # (less the profiler's own disable())


def profile_text(rows: List[list], top: int = 5) -> str:
    """The first ``top`` of :func:`profiled`'s rows as a report shows them."""
    return "the functions by own time a call (us, under cProfile): " + "; ".join(
        f"{where} {own:.2f}" for where, _, own, _ in rows[:top])


def _nonblocking_nccl_group(p: int):
    """A new NCCL group of the world's ``p`` ranks whose communicator is made in NCCL's
    nonblocking mode (``config.blocking = 0``, as the native path's ``Communicator``), with
    :func:`tp_kernels.get_timeout` as its own timeout (``parallel_state._new_group``, as the
    groups of ``initialize_model_parallel``), or why this torch cannot make one."""
    try:
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = 0
        return parallel_state._new_group(list(range(p)), backend="nccl", pg_options=options)
    except (AttributeError, TypeError, RuntimeError) as exc:  # (every rank alike)
        return f"torch {torch.__version__} made no group in NCCL's nonblocking mode: {exc}"


def _all_reduced(y: torch.Tensor, group) -> torch.Tensor:
    """``y`` summed over ``group`` as plain PyTorch sums it: ``dist.all_reduce`` issued
    asynchronously and waited for (nothing with one rank)."""
    if group.size() > 1:
        dist.all_reduce(y, group=group, async_op=True).wait()
    return y


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gathered(y: torch.Tensor, group) -> torch.Tensor:
    """``[m, n]`` blocks of ``group``'s ranks joined along the last dim as a serving engine joins
    them (vLLM's ``all_gather``): gathered rank-major into ``[p, m, n]``, issued asynchronously and
    waited for, then moved to ``[m, p*n]`` (``y`` itself with one rank)."""
    p = group.size()
    if p == 1:
        return y
    m, n = y.shape
    out = torch.empty((p * m, n), device=y.device, dtype=y.dtype)  # [p, m, n] flat along dim 0, as gloo wants it
    _all_gather_single(out, y, group=group, async_op=True).wait()
    return out.view(p, m, n).movedim(0, -2).reshape(m, p * n)


class PlainVocabParallelEmbedding(torch.nn.Module):
    """A vocabulary-parallel embedding as written by hand (Megatron's): this rank's rows of the
    table, the ids outside them masked, looked up, their rows zeroed and summed over the group (with
    one rank, the lookup alone)."""

    def __init__(self, rows: int, dim: int, group, device, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, dim, device=device, dtype=dtype))
        self.start, self.group = group.rank() * rows, group

    def forward(self, ids):
        if self.group.size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return _all_reduced(out, self.group)


class PlainRowParallel(torch.nn.Module):
    """A row-parallel layer as written by hand (Megatron's): the GEMM without the bias, the
    all-reduce (with more than one rank), the bias added once."""

    def __init__(self, in_features: int, out_features: int, group, device, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.randn(out_features, device=device, dtype=dtype))
        self.group = group

    def forward(self, x):
        if self.group.size() == 1:
            return F.linear(x, self.weight, self.bias)
        return _all_reduced(F.linear(x, self.weight), self.group).add_(self.bias)


def _runs_on_a_fake_group(impl: str) -> Optional[str]:
    """Why implementation ``impl`` cannot run on a fake group (None: it can)."""
    if impl == "reference" or impl.startswith("pipelined:"):
        return None
    return f"runs {impl}, which needs real peers"


def _operands(device: torch.device, dtype: torch.dtype):
    """The timed GEMM's input and weight (:data:`SHAPES`), ``[m, k]`` and ``[n, k]``."""
    m, k, n = SHAPES[device.type]
    return torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)


def _calls(p: int, device: torch.device, dtype: torch.dtype, backends=("reference", "pipelined", "auto"),
           why_not: Callable[[str], Optional[str]] = _runs_on_a_fake_group):
    """The timed calls at ``p`` ranks: name -> (function, its plain counterpart's name[, the context
    its calls run in]), and the
    skipped ones: name -> why (``why_not(impl)``, or why ``backend`` cannot run here at all)."""
    group = dist.group.WORLD
    m, k, n = SHAPES[device.type]
    x, w = _operands(device, dtype)
    plain = PlainRowParallel(k, n, group, device, dtype)
    row = RowParallelLinear(k * p, n, group=group, device=device, dtype=dtype).requires_grad_(False)

    calls = {"plain": (lambda: _all_reduced(F.linear(x, w), group), None)}
    skipped = {}
    for backend in backends:
        try:
            impl = dispatch.select_backend("matmul_all_reduce", backend, x, p, group, w)
        except ValueError as exc:  # "fused" where it cannot run
            skipped[f"matmul_all_reduce/{backend}"] = str(exc)
            continue
        why = why_not(impl)
        if why is not None:
            skipped[f"matmul_all_reduce/{backend}"] = why
            continue
        calls[f"matmul_all_reduce/{backend}"] = (
            lambda backend=backend: ops.matmul_all_reduce(x, w, group=group, backend=backend), "plain")
    if "matmul_all_reduce/pipelined" in calls and p > 1 and dist.get_backend(group) == "nccl":
        for name, mode in NATIVE_MODES.items():
            calls[name] = (calls["matmul_all_reduce/pipelined"][0], "plain",
                           lambda mode=mode: settings.overriding(**mode))
    # "auto" choosing among every backend that runs here, its shape class measured by the first call
    named = tuple(b for b in backends if b != "auto" and f"matmul_all_reduce/{b}" in calls)
    if len(named) > 1:
        calls[MEASURED_AUTO] = (lambda: ops.matmul_all_reduce(x, w, group=group, backend="auto"), "plain",
                                lambda: settings.overriding(auto_candidates=named))
    else:
        skipped[MEASURED_AUTO] = f"one backend runs here ({', '.join(named)}): nothing to choose among"

    calls["plain_layer"] = (_without_grad(lambda: plain(x)), None)
    # the other layers of a decode step, without a gradient
    column = ColumnParallelLinear(k, n * p, group=group, device=device, dtype=dtype).requires_grad_(False)
    head = ColumnParallelLinear(k, n * p, bias=False, gather_output=True, group=group, device=device,
                                dtype=dtype).requires_grad_(False)
    embedding = VocabParallelEmbedding(n * p, k, group=group, device=device, dtype=dtype).requires_grad_(False)
    plain_embedding = PlainVocabParallelEmbedding(n, k, group, device, dtype)
    ids = torch.randint(0, n * p, (m,), device=device)
    # (a hand-written column layer without a gradient: nn.Linear on this rank's rows)
    plain_column = torch.nn.Linear(k, n, device=device, dtype=dtype)
    plain_head = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    for name, fn, plain_name, plain_fn in (
            ("ColumnParallelLinear/auto", lambda: column(x), "plain_column", lambda: plain_column(x)),
            ("ColumnParallelLinear/gather_output", lambda: head(x), "plain_head",
             lambda: _all_gathered(plain_head(x), group)),
            ("VocabParallelEmbedding", lambda: embedding(ids), "plain_embedding", lambda: plain_embedding(ids))):
        calls[plain_name] = (_without_grad(plain_fn), None)
        calls[name] = (_without_grad(fn), plain_name)
    # and without its ids' check (no host sync)
    calls[UNCHECKED_EMBEDDING] = (_without_grad(lambda: embedding(ids)), "plain_embedding",
                                  lambda: settings.overriding(ids_checked=False))
    impl = dispatch.select_backend("matmul_all_reduce", "auto", x, p, group, row.weight)
    why = why_not(impl)
    if why is None:
        calls["RowParallelLinear/auto"] = (_without_grad(lambda: row(x)), "plain_layer")
    else:
        skipped["RowParallelLinear/auto"] = f"auto {why}"

    # a serving engine's all-reduce of a row-parallel output [m, n]: into a new tensor, and in place
    y, comm = torch.randn(m, n, device=device, dtype=dtype), Communicator(group, device=device)
    calls["plain_all_reduce"] = (lambda: _all_reduced(y.clone(), group), None)
    calls["plain_all_reduce_inplace"] = (lambda: _all_reduced(y, group), None)
    if p > 1 and dist.get_backend(group) == "nccl":  # (the same on a communicator in NCCL's nonblocking mode)
        nonblocking = _nonblocking_nccl_group(p)
        if isinstance(nonblocking, str):
            skipped[NONBLOCKING_ALL_REDUCE] = nonblocking
        else:
            calls[NONBLOCKING_ALL_REDUCE] = (lambda: _all_reduced(y, nonblocking), "plain_all_reduce_inplace")
    why = why_not(dispatch.resolve_collective("all_reduce", comm.backend, y, group))
    if why is None:
        calls["Communicator.all_reduce"] = (lambda: comm.all_reduce(y), "plain_all_reduce")
        calls["Communicator.all_reduce/in_place"] = (lambda: comm.all_reduce(y, out=y), "plain_all_reduce_inplace")
    else:
        skipped["Communicator.all_reduce"] = skipped["Communicator.all_reduce/in_place"] = f"auto {why}"
    # and its all-gather of the [m, n/p] blocks of the logits along the last dim
    calls["plain_all_gather"] = (lambda: _all_gathered(y, group), None)
    why = why_not(dispatch.resolve_collective("all_gather", comm.backend, y.unsqueeze(0), group))
    if why is None:
        calls["Communicator.all_gather"] = (lambda: comm.all_gather(y, dim=-1), "plain_all_gather")
    else:
        skipped["Communicator.all_gather"] = f"auto {why}"
    return calls, skipped


def _without_grad(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` called under ``torch.no_grad()`` (a serving engine's forward)."""
    def call():
        with torch.no_grad():
            return fn()
    return call


def _timed(p: int, device: torch.device, samples: int, calls_per_sample: int, profile: int = 0, **which) -> Dict:
    """Every call of :func:`_calls` (``which``: its backends and ``why_not``) timed on this
    process's group, and what each adds over its plain counterpart; with ``profile``, each call's
    :func:`profiled` rows over that many calls."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    calls, skipped = _calls(p, device, dtype, **which)
    around = {name: call[2] for name, call in calls.items() if len(call) > 2}
    before = len(autotune.decisions())
    times = host_times_us({name: call[0] for name, call in calls.items()}, samples, cuda, calls_per_sample, around)
    added = {name: times[name]["min_us"] - times[call[1]]["min_us"]
             for name, call in calls.items() if call[1] is not None}
    counts = {}
    for name, call in calls.items():
        with around.get(name, contextlib.nullcontext)():
            counts[name] = function_calls(call[0])
    run = {"p": p, "times": times, "added_us": added, "skipped": skipped, "function_calls": counts,
           "added_function_calls": {name: counts[name] - counts[call[1]]
                                    for name, call in calls.items() if call[1] is not None},
           # what "auto" measured and chose on the way (the first calls of the rows that measure)
           "auto_decisions": [{"op": d.op, "variants": list(d.variants), "times_s": list(d.times_s), "choice": d.choice}
                              for d in autotune.decisions()[before:]]}
    if profile:
        run["profile"] = {}
        for name, call in calls.items():
            with around.get(name, contextlib.nullcontext)():
                run["profile"][name] = profiled(call[0], profile, cuda)
    return run


#: What ``"auto"`` chooses among on a fake group, whatever ``TP_KERNELS_AUTO_*`` say: the native and
#: fused paths exchange NCCL ids and memory handles through the group, which a fake group does not
#: move (``auto:measured`` still names the portable schedule beside it).
FAKE_GROUP_AUTO = ("reference",)


def measure(p: int, device: torch.device, samples: int, profile: int = 0) -> Dict:
    """Every call's host time at ``p`` ranks (a fake world of this process; ``"auto"`` there
    choosing among :data:`FAKE_GROUP_AUTO`), and what each adds over its plain counterpart."""
    fake_world(p)
    with settings.overriding(auto_candidates=FAKE_GROUP_AUTO):
        return _timed(p, device, samples, CALLS_PER_SAMPLE, profile)


def nccl_progress(device: torch.device, calls: int = 10 * PEER_CALLS_PER_SAMPLE) -> Dict[str, float]:
    """Per call of the native pipelined ``matmul_all_reduce`` at the timed shape, on this
    process's group (real peers, CUDA): what its NCCL calls cost the host on the group's
    communicator in the NCCL mode set (``Communicator.progress``): the NCCL calls the op made, how many of
    them returned ``ncclInProgress``, their polls, and the µs spent polling them; the device
    synchronised every :data:`PEER_CALLS_PER_SAMPLE` calls, as the timed samples are."""
    from ..backends import pipelined_native

    group = dist.group.WORLD
    x, w = _operands(device, torch.bfloat16)
    ops.matmul_all_reduce(x, w, group=group, backend="pipelined")  # (the communicator made, the path warm)
    synchronize("nccl_progress: the first call", device)
    comm = pipelined_native.communicator(group, device)
    before = comm.progress()
    for i in range(calls):
        ops.matmul_all_reduce(x, w, group=group, backend="pipelined")
        if i % PEER_CALLS_PER_SAMPLE == PEER_CALLS_PER_SAMPLE - 1:
            synchronize(f"nccl_progress: calls {i + 1 - PEER_CALLS_PER_SAMPLE}-{i}", device)
    synchronize("nccl_progress: the last calls", device)
    after = comm.progress()
    return {key: (after[key] - before[key]) / calls for key in after}


def _peer_rank(p: int, device_type: str, samples: int, profile: int = 0) -> Dict:
    """:func:`_timed` on one rank of a :class:`~tp_kernels.testing.World` (every rank the same
    calls in the same order), with the fused path among the backends; on a GPU also the pipelined
    path's :func:`nccl_progress`."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(1)
    settings.set_fingerprints(False)
    run = _timed(p, device, samples, PEER_CALLS_PER_SAMPLE, profile, why_not=lambda impl: None,
                 backends=("reference", "pipelined", "fused", "auto") if device_type == "cuda" else
                 ("reference", "pipelined", "auto"))
    if device_type == "cuda":
        run["nccl_progress"] = nccl_progress(device)
        with settings.overriding(nccl_blocking=False):
            run["nccl_progress_nonblocking"] = nccl_progress(device)
    return run


def measure_with_peers(p: int, device: torch.device, samples: int, profile: int = 0) -> Dict:
    """Every call's host time on rank 0 of ``p`` processes of a real group (NCCL ranks sharing
    ``device``, or gloo ranks on the CPU), and what each adds over its plain counterpart on every
    rank (``per_rank_added_us``)."""
    from ..testing import ONE_GPU_RANKS_ENV, World

    cuda = device.type == "cuda"
    with World(p, backend="nccl" if cuda else "gloo", timeout_s=120.0, threads=1,
               env=ONE_GPU_RANKS_ENV if cuda else None, cuda_device=device.index if cuda else None) as world:
        runs = world.run(_peer_rank, p, device.type, samples, profile, deadline_s=300.0)
    return {**runs[0], "per_rank_added_us": [run["added_us"] for run in runs]}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tp_kernels.bench.host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,8", help="group sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peers", action="store_true",
                    help="time the calls on p processes of a real group (each p >= 2 of --ranks; on a GPU, NCCL "
                         "ranks sharing it), where the native and fused paths run too")
    ap.add_argument("--samples", type=int, default=50, help="timed samples per figure (default: %(default)s)")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="also profile each call over CALLS calls (cProfile): the functions its host time goes to "
                         "(default: %(default)s, none)")
    ap.add_argument("--out-dir", default=default_out_dir(), help="default: %(default)s")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    try:
        ranks = [int(v) for v in args.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks: expected comma-separated ints, got {args.ranks!r}")
    if not ranks or min(ranks) < 1:
        ap.error(f"--ranks: expected group sizes >= 1, got {args.ranks!r}")
    if args.samples < 1:
        ap.error(f"--samples: expected at least 1, got {args.samples}")
    if args.profile < 0:
        ap.error(f"--profile: expected a number of calls >= 0, got {args.profile}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("python -m tp_kernels.bench.host: --device cuda, but no CUDA device is visible", file=sys.stderr)
        return 2
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a tiny GEMM: no thread pool's wake-up in the figure
    if args.peers:
        ranks = [p for p in ranks if p >= 2]
        if not ranks:
            ap.error(f"--peers: expected a group size >= 2 in --ranks, got {args.ranks!r}")
    settings.set_fingerprints(False)
    try:
        runs = [measure_with_peers(p, device, args.samples, args.profile) if args.peers else
                measure(p, device, args.samples, args.profile) for p in ranks]
    finally:
        settings.set_fingerprints(None)
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    m, k, n = SHAPES[device.type]
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device_name("gloo"),
              "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "python": sys.version.split()[0],
              "shape": [m, k, n], "dtype": "bfloat16" if device.type == "cuda" else "float32",
              "world": ("processes of a real group" + (", NCCL ranks sharing the GPU" if device.type == "cuda" else
                                                         ", gloo (waits include the transfer)")
                        if args.peers else "one process of a fake group"),
              "calls_per_sample": PEER_CALLS_PER_SAMPLE if args.peers else CALLS_PER_SAMPLE,
              "samples": args.samples, "runs": runs,
              "target_us": TARGETS["host_overhead_us"][0]}
    for run in runs:
        print(f"p = {run['p']}: " + ", ".join(f"{name} {t['min_us']:.2f} us" for name, t in run["times"].items()))
        print("  added: " + ", ".join(f"{name} {v:+.2f} us ({run['added_function_calls'][name]:+.0f} function calls)"
                                      for name, v in run["added_us"].items()))
        for name, why in run["skipped"].items():
            print(f"  skipped {name}: {why}")
        for d in run["auto_decisions"]:
            print(f"  auto measured {d['op']}: " + ", ".join(f"{v} {t * 1e6:.1f} us" for v, t in
                                                          zip(d["variants"], d["times_s"])) + f"; chose {d['choice']}")
        for key, mode in (("nccl_progress", "the default mode"), ("nccl_progress_nonblocking", "nonblocking")):
            if key in run:
                print(f"  matmul_all_reduce/pipelined, its NCCL calls a call ({mode}): " +
                      ", ".join(f"{name} {v:.1f}" for name, v in run[key].items()))
        for name, rows in run.get("profile", {}).items():
            print(f"  {name}, {profile_text(rows)}")
    save_record(record, args.out_dir, "host-peers" if args.peers else "host", args.tag)
    print(json.dumps({run["p"]: run["added_us"] for run in runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
