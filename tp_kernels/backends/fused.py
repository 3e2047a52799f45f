"""The ``fused`` backend: overlap over peer memory, for a group inside one node.

Every rank of the group owns one buffer of a *symmetric workspace*, mapped into every other
rank (CUDA IPC handles exchanged over the torch group). The native ops (``csrc/fused.cpp``)
take a :class:`tp_kernels._C.PeerContext`, this rank's table of those buffers, and move data
between ranks by copy engine while cuBLASLt multiplies on all SMs:

* ``all_gather_matmul``: each rank publishes its shard; the peers' shards are pulled chunk by
  chunk (``num_chunks`` pieces per shard) while the chunks already there multiply.
* ``matmul_reduce_scatter``: the partial for each destination multiplies while the previous one
  is pushed into its destination's inbox; then the p partials are summed in rank order in fp32
  (deterministic). It goes by destination, so ``num_chunks`` does not apply.
* ``matmul_all_reduce``: one of :data:`ALL_REDUCE_ALGORITHMS`, chosen by message size
  (:func:`all_reduce_algorithm`): ``one_shot`` and ``two_shot`` kernels over peer memory for
  small messages, ``scatter_gather`` (the reduce-scatter above, then a copy-engine all-gather)
  for large ones. Deterministic too; ``num_chunks`` does not apply.

Readiness is signalled by flags in the workspace (see ``csrc/include/tp_kernels/peer.h``);
every device-side wait is bounded by :func:`tp_kernels.get_timeout`. A wait that times out
records the op and the peer, and the group's next fused call raises that error.

The workspace grows on demand (all ranks together: their shapes agree) and is freed with the
group (:func:`destroy_workspaces`, called by ``destroy_model_parallel``). The same per-rank code
runs with *virtual ranks* (:class:`VirtualRanks`): one process driving p ranks on one GPU, each
with its own buffers and streams, which is how the fused path is tested and measured on a
single GPU.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import List, Optional, Sequence

import torch

from .. import _comm, _native
from .._comm import Pending
from ..schedule import chunk_bounds
from .reference import bias_epilogue

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "VirtualRanks",
    "all_gather_matmul",
    "all_reduce_algorithm",
    "auto_enabled",
    "check_algorithm",
    "destroy_workspaces",
    "forced_all_reduce_algorithm",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "measured_key",
    "region_needs",
    "size_class",
    "unsupported_reason",
]

ALL_REDUCE_ALGORITHMS = ("one_shot", "two_shot", "scatter_gather")
_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

#: Size thresholds of :func:`all_reduce_algorithm`, in bytes of the all-reduced ``[m, n]``.
#: Provisional: they follow the usual shape of such curves (one-shot wins while latency
#: dominates, scatter-gather once bandwidth does) and are to be replaced by the crossovers that
#: ``python -m tp_kernels.bench.fused`` measures on the GPU (docs/benchmarks.md). A size class
#: that ``backend="auto"`` measured uses its winner instead (:data:`measured_algorithms`).
ONE_SHOT_MAX_BYTES = 256 * 1024
TWO_SHOT_MAX_BYTES = 8 * 2**20

#: The smallest size a workspace region grows to (regions grow to powers of two).
MIN_REGION_BYTES = 2**20

#: Whether ``backend="auto"`` may pick this path. Off until the GPU suite has measured that it
#: wins (``TP_KERNELS_AUTO_FUSED=1`` or ``0`` overrides).
AUTO_DEFAULT = False


def auto_enabled() -> bool:
    """Whether ``backend="auto"`` may run the fused path (see ``AUTO_DEFAULT``)."""
    return _native.env_switch("TP_KERNELS_AUTO_FUSED", AUTO_DEFAULT)


def forced_all_reduce_algorithm() -> Optional[str]:
    """The algorithm ``TP_KERNELS_FUSED_ALL_REDUCE`` forces, or None when it is unset."""
    forced = os.environ.get("TP_KERNELS_FUSED_ALL_REDUCE")
    if not forced:
        return None
    if forced not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"TP_KERNELS_FUSED_ALL_REDUCE: expected one of {ALL_REDUCE_ALGORITHMS}, got {forced!r}")
    return forced


#: :func:`measured_key` -> the algorithm ``backend="auto"`` measured fastest
#: (:mod:`tp_kernels.autotune`, which fills and clears it).
measured_algorithms: dict = {}


def size_class(m: int) -> int:
    """The power of two at or above ``m``: calls whose row counts share it share measurements."""
    return 1 << max(m - 1, 0).bit_length()


def measured_key(m: int, n: int, p: int, dtype: torch.dtype) -> tuple:
    """The key of :data:`measured_algorithms` for an ``[m, n]`` all-reduce on p ranks: the
    size class of ``m`` (so a size class is its own key's ``m``), n, p and the dtype."""
    return size_class(m), n, p, dtype


def all_reduce_algorithm(m: int, n: int, p: int, dtype: torch.dtype) -> str:
    """The all-reduce of fused ``matmul_all_reduce`` for an ``[m, n]`` output on p ranks.

    In order: ``TP_KERNELS_FUSED_ALL_REDUCE`` (one of :data:`ALL_REDUCE_ALGORITHMS`) forces
    one; else the algorithm ``backend="auto"`` measured fastest for this size class
    (:mod:`tp_kernels.autotune`); else the size thresholds. ``scatter_gather`` needs ``m >= p``
    and falls back to ``two_shot`` below that.
    """
    algo = forced_all_reduce_algorithm() or measured_algorithms.get(measured_key(m, n, p, dtype))
    if algo is None:
        nbytes = m * n * torch.empty((), dtype=dtype).element_size()
        algo = ("one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else
                "two_shot" if nbytes <= TWO_SHOT_MAX_BYTES else "scatter_gather")
    return "two_shot" if algo == "scatter_gather" and m < p else algo


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def region_needs(op: str, p: int, m: int, n: int, k: int, dtype: torch.dtype,
                 algorithm: Optional[str] = None) -> List[int]:
    """Bytes of the (export, inbox, export2) regions a fused call needs on each rank.

    ``m`` is the gathered rows for ``all_gather_matmul`` (``p`` shards of ``m/p``) and the rows of
    ``x`` for the reductions; the sizes are the native module's (``_C.fused_region_need``),
    rounded up to ``_C.REGION_ALIGNMENT``.
    """
    _native.require()
    C = _native._C
    algo = ALL_REDUCE_ALGORITHMS.index(algorithm) if algorithm is not None else 0
    return [
        _round_up(C.fused_region_need(_OPS.index(op), region, p, m, n, k, _native.DTYPE_CODES[dtype], algo),
                  C.REGION_ALIGNMENT)
        for region in range(len(C.REGIONS))
    ]


def _grown(have: Sequence[int], need: Sequence[int]) -> Optional[List[int]]:
    """The region sizes to grow to (powers of two, at least MIN_REGION_BYTES), or None if
    ``have`` already holds ``need``."""
    if all(n <= h for n, h in zip(need, have)):
        return None
    return [h if n <= h else max(MIN_REGION_BYTES, 1 << (n - 1).bit_length()) for n, h in zip(need, have)]


# --- the per-rank calls, shared by process groups and virtual ranks --------------------------------


def _rank_all_gather_matmul(ctx, x, weight, bias, num_chunks: int, stream):
    mp, k = x.shape
    with torch.cuda.stream(stream):
        gathered = x.new_empty((ctx.size * mp, k))
        out = x.new_empty((ctx.size * mp, weight.shape[0]))
    bounds = [0] + [b for _, b in chunk_bounds(mp, num_chunks)]
    _native.call_primitive(_native._C.fused_all_gather_matmul, ctx, x, weight, bias, out, gathered, bounds, stream)
    return out, gathered


def _rank_matmul_reduce_scatter(ctx, x, weight, stream):
    m = x.shape[0]
    with torch.cuda.stream(stream):
        out = x.new_empty((m // ctx.size, weight.shape[0]))
        partial = x.new_empty((m, weight.shape[0]))
    _native.call_primitive(_native._C.fused_matmul_reduce_scatter, ctx, x, weight, None, out, partial,
                           [0, m // ctx.size], stream)
    return out


def _rank_matmul_all_reduce(ctx, x, weight, algorithm: str, stream):
    m = x.shape[0]
    scatter_gather = algorithm == "scatter_gather"
    with torch.cuda.stream(stream):
        out = x.new_empty((m, weight.shape[0]))
        partial = x.new_empty((m, weight.shape[0])) if scatter_gather else None
    bounds = [0] + [b for _, b in chunk_bounds(m, ctx.size)] if scatter_gather else [0, m]
    _native.call_primitive(_native._C.fused_matmul_all_reduce, ctx, x, weight, None, out, partial, bounds, stream,
                           ALL_REDUCE_ALGORITHMS.index(algorithm))
    return out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _capture_growth_error(op: str, regions: Sequence[int]) -> RuntimeError:
    return RuntimeError(
        f"fused {op}: the group's workspace must grow to {list(regions)} bytes (export, inbox, export2), which "
        "cannot happen inside a CUDA graph capture: run the op once with these shapes before capturing")


# --- process groups ----------------------------------------------------------------------------------

#: (id(group), group name, device index) -> _GroupWorkspace
_workspaces: dict = {}
#: (id(group), group name, device index) -> (group, reason or None): whether the group can use peer memory
_topology: dict = {}


def _host_id() -> bytes:
    """16 bytes naming this host (its name and boot id): processes that share them share a node."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).digest()[:16]


def _topology_reason(group, device: torch.device) -> Optional[str]:
    """Why this group cannot use peer memory, or None. Decided once per group by two bounded
    all-gathers, so that every rank reaches the same answer."""
    key = _comm.group_key(group, device)
    if key in _topology:
        return _topology[key][1]
    if torch.compiler.is_compiling() or _capturing():
        return ("the group's peer access is checked by its first fused call, which cannot run inside "
                "torch.compile tracing or a CUDA graph capture: run the op once eagerly first")
    p = _comm.group_size(group)
    infos = _comm.all_gather_bytes(_host_id() + device.index.to_bytes(4, "little"), group, device)
    devices = [int.from_bytes(i[16:], "little") for i in infos]
    reason = None
    if len({i[:16] for i in infos}) > 1:
        reason = "the group spans several hosts (peer memory needs one node)"
    else:
        me = device.index
        ok = all(d == me or torch.cuda.can_device_access_peer(me, d) for d in devices)
        verdicts = _comm.all_gather_bytes(bytes([ok]), group, device)
        bad = [q for q in range(p) if verdicts[q] != b"\x01"]
        if bad:
            reason = f"rank {bad[0]} of the group cannot reach every peer's GPU by peer access"
    _topology[key] = (group, reason)
    return reason


class _GroupWorkspace:
    """This rank's buffer of a group's symmetric workspace, the peers' buffers mapped by CUDA IPC,
    and the PeerContext over them."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.p, self.rank = _comm.group_size(group), _comm.group_rank(group)
        self.regions = [0, 0, 0]
        self.base = None
        self.bases: List[int] = []
        self.ctx = None

    def context(self, op: str, need: Sequence[int]):
        grown = _grown(self.regions, need)
        if grown is not None:
            if _capturing():
                raise _capture_growth_error(op, grown)
            self._map(grown)
        timeout = _comm.get_timeout()
        if self.ctx.timeout_s != timeout:
            self.ctx.timeout_s = timeout
        return self.ctx

    def _map(self, regions: List[int]) -> None:
        C, dev = _native._C, self.device.index
        if self.base is not None:
            self.ctx.check()  # a failed workspace is not silently replaced
            self.release(barrier=True)
        base = C.workspace_alloc(C.CONTROL_BYTES + sum(regions), dev)
        try:
            C.workspace_init(base, dev)
            handles = _comm.all_gather_bytes(C.ipc_handle(base, dev), self.group, self.device)
            bases = [base if q == self.rank else C.ipc_open(h, dev) for q, h in enumerate(handles)]
        except BaseException:
            C.workspace_free(base, dev)
            raise
        self.base, self.bases, self.regions = base, bases, list(regions)
        self.ctx = C.PeerContext(self.rank, self.p, dev, bases, regions, _comm.get_timeout())

    def release(self, barrier: bool) -> None:
        """Unmap the peers' buffers and free this rank's, once no rank uses them any more: this
        device is synchronised and, with ``barrier``, every rank has got this far too."""
        if self.base is None:
            return
        C, dev = _native._C, self.device.index
        torch.cuda.synchronize(self.device)
        if barrier:
            _comm.all_gather_bytes(b"\x01", self.group, self.device)
        self.ctx = None
        for q, b in enumerate(self.bases):
            if q != self.rank:
                C.ipc_close(b, dev)
        C.workspace_free(self.base, dev)
        self.base, self.bases, self.regions = None, [], [0, 0, 0]


def _context(group, device: torch.device, op: str, need: Sequence[int]):
    key = _comm.group_key(group, device)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = _GroupWorkspace(group, device)
    return ws.context(op, need)


def destroy_workspaces(group=None) -> None:
    """Free the fused workspaces of ``group`` (of every group when None).

    Each rank synchronises its device and, while the group still works, waits for the others
    (bounded) before freeing, so no peer still reads its buffer; errors are not raised.
    """
    for key in [k for k, ws in _workspaces.items() if group is None or ws.group is group]:
        ws = _workspaces.pop(key)
        try:
            ws.release(barrier=True)
        except Exception:  # a dead peer or a failed context: free what is ours anyway
            try:
                ws.release(barrier=False)
            except Exception:
                pass
    for key in [k for k, (g, _) in _topology.items() if group is None or g is group]:
        del _topology[key]


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, group) -> Optional[str]:
    """Why the fused path cannot run this call, or None when it can.

    The first call of a group with several ranks checks, collectively, that the group is on one
    node with peer access; everything else depends only on what all ranks share.
    """
    reason = _native.unsupported_tensors_reason(x, weight)
    if reason is not None:
        return reason
    p = _comm.group_size(group)
    if p == 1:
        return None
    if p > _native._C.MAX_RANKS:
        return f"{p} ranks: the fused path supports at most {_native._C.MAX_RANKS}"
    if not _native._C.stream_memory_ops_available():
        return "the CUDA driver does not provide stream memory operations (cuStreamWriteValue32)"
    return _topology_reason(group, x.device)


def _check(x, weight, group) -> None:
    reason = unsupported_reason(x, weight, group)
    if reason is not None:
        raise ValueError(f"the fused backend cannot run this call: {reason}")


def all_gather_matmul(x, weight, bias, group, num_chunks):
    _check(x, weight, group)
    p = _comm.group_size(group)
    bias = None if bias is None else bias.contiguous()
    if p == 1:
        return _native.linear(x, weight, bias), x
    x = x.contiguous()
    mp, k = x.shape
    need = region_needs("all_gather_matmul", p, p * mp, weight.shape[0], k, x.dtype)
    with torch.cuda.device(x.device):
        ctx = _context(group, x.device, "all_gather_matmul", need)
        return _rank_all_gather_matmul(ctx, x, weight, bias, num_chunks, torch.cuda.current_stream())


def _reduction(op: str, what: str, x, weight, bias, group, algorithm: Optional[str] = None) -> Pending:
    """GEMM + reduce-scatter or all-reduce over the group's workspace; the bias is added after
    the reduction (num_chunks does not apply: the fused reductions go by destination)."""
    _check(x, weight, group)
    p = _comm.group_size(group)
    if p == 1:
        return Pending(_native.linear(x, weight, bias), what=what)
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if op == "matmul_all_reduce":
        algorithm = check_algorithm(algorithm, m, p) if algorithm is not None else all_reduce_algorithm(m, n, p, x.dtype)
    need = region_needs(op, p, m, n, k, x.dtype, algorithm)
    with torch.cuda.device(x.device):
        ctx = _context(group, x.device, op, need)
        stream = torch.cuda.current_stream()
        out = (_rank_matmul_all_reduce(ctx, x, weight, algorithm, stream) if algorithm is not None
               else _rank_matmul_reduce_scatter(ctx, x, weight, stream))
    return Pending(out, what=what, group=group, finish=bias_epilogue(bias))


def matmul_reduce_scatter(x, weight, bias, group, num_chunks) -> Pending:
    return _reduction("matmul_reduce_scatter", "fused matmul+reduce-scatter", x, weight, bias, group)


def matmul_all_reduce(x, weight, bias, group, num_chunks, algorithm: Optional[str] = None) -> Pending:
    """``algorithm``: one of :data:`ALL_REDUCE_ALGORITHMS`, or None for
    :func:`all_reduce_algorithm`'s choice."""
    return _reduction("matmul_all_reduce", "fused matmul+all-reduce", x, weight, bias, group, algorithm)


def check_algorithm(algorithm: str, m: int, p: int) -> str:
    """``algorithm`` if it can all-reduce ``m`` rows on p ranks, else a ``ValueError``."""
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALL_REDUCE_ALGORITHMS}, got {algorithm!r}")
    if algorithm == "scatter_gather" and m < p:
        raise ValueError(f"algorithm: scatter_gather needs at least p = {p} rows, got {m}")
    return algorithm


# --- virtual ranks -----------------------------------------------------------------------------------


class VirtualRanks:
    """p ranks driven by this process on one GPU, for tests and benchmarks of the fused path.

    Each rank has its own workspace buffer, PeerContext, stream and copy stream; the ops take one
    input per rank, enqueue every rank's work on its stream (the host never waits inside an op,
    so rank 0 can wait on the GPU for rank 1's data) and order the current stream after all of
    them. The kernels, flags and copies are those of a real group; only the buffers are in one
    process (and on one GPU, so the copies share its memory bandwidth instead of NVLink).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, p: int, device=None, timeout_s: Optional[float] = None):
        _native.require()
        C = _native._C
        if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= C.MAX_RANKS:
            raise ValueError(f"p: expected an int in [1, {C.MAX_RANKS}], got {p!r}")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number, got {timeout_s!r}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index)
        self.p = p
        self.timeout_s = timeout_s
        self.streams = [torch.cuda.Stream(self.device) for _ in range(p)]
        self.regions = [0, 0, 0]
        self.bases: List[int] = []
        self.contexts: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Free every rank's buffer (after the device has finished with them)."""
        if self.bases:
            torch.cuda.synchronize(self.device)
            self.contexts = []
            for b in self.bases:
                _native._C.workspace_free(b, self.device.index)
            self.bases, self.regions = [], [0, 0, 0]

    def check(self) -> None:
        """Raise the error a timed-out device wait of any rank recorded."""
        for ctx in self.contexts:
            ctx.check()

    def _ensure(self, op: str, need: Sequence[int]) -> None:
        grown = _grown(self.regions, need)
        if grown is not None:
            if _capturing():
                raise _capture_growth_error(op, grown)
            self.check()
            self.close()
            C, dev = _native._C, self.device.index
            for _ in range(self.p):
                self.bases.append(C.workspace_alloc(C.CONTROL_BYTES + sum(grown), dev))
                C.workspace_init(self.bases[-1], dev)
            self.regions = grown
            self.contexts = [C.PeerContext(q, self.p, dev, self.bases, grown, self._timeout()) for q in range(self.p)]
        for ctx in self.contexts:
            ctx.timeout_s = self._timeout()

    def _timeout(self) -> float:
        return self.timeout_s if self.timeout_s is not None else _comm.get_timeout()

    def _check_inputs(self, xs, weights, op: str):
        if len(xs) != self.p or len(weights) != self.p:
            raise ValueError(f"{op}: expected one x and one weight per rank ({self.p}), got {len(xs)} and {len(weights)}")
        for q, (x, w) in enumerate(zip(xs, weights)):
            if x.device != self.device or w.device != self.device:
                raise ValueError(f"xs[{q}]/weights[{q}]: expected tensors on {self.device}")
            if x.dim() != 2 or w.dim() != 2 or x.shape != xs[0].shape or w.shape != weights[0].shape:
                raise ValueError(f"xs[{q}]/weights[{q}]: expected 2-D tensors shaped like rank 0's "
                                 f"{tuple(xs[0].shape)}/{tuple(weights[0].shape)}")
            if x.dtype not in _native.DTYPE_CODES or x.dtype != w.dtype:
                raise ValueError(f"xs[{q}]: dtype {x.dtype} (weight {w.dtype}): expected one of float32, float16, "
                                 "bfloat16 for both")
            if x.shape[1] != w.shape[1]:
                raise ValueError(f"xs[{q}]: {x.shape[1]} columns do not match weights[{q}] {tuple(w.shape)}")

    def _launch(self, fn, inputs) -> list:
        """fn(q, stream) for every rank on its stream, ordered after the current stream's work
        and before what the current stream does next."""
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            s.wait_stream(current)
        results = []
        for q, s in enumerate(self.streams):
            for t in inputs[q]:
                if t is not None:
                    t.record_stream(s)
            with torch.cuda.stream(s):
                results.append(fn(q, s))
        for s in self.streams:
            current.wait_stream(s)
        for r in results:
            for t in (r if isinstance(r, tuple) else (r,)):
                t.record_stream(current)
        return results

    def all_gather_matmul(self, xs, weights, biases=None, num_chunks: int = 1):
        """Per rank q: ``(AG(xs) weights[q]ᵀ + biases[q], AG(xs))``."""
        self._check_inputs(xs, weights, "all_gather_matmul")
        biases = [None] * self.p if biases is None else [None if b is None else b.contiguous() for b in biases]
        xs = [x.contiguous() for x in xs]
        mp, k = xs[0].shape
        self._ensure("all_gather_matmul",
                     region_needs("all_gather_matmul", self.p, self.p * mp, weights[0].shape[0], k, xs[0].dtype))
        return self._launch(
            lambda q, s: _rank_all_gather_matmul(self.contexts[q], xs[q], weights[q], biases[q], num_chunks, s),
            [(xs[q], weights[q], biases[q]) for q in range(self.p)])

    def matmul_reduce_scatter(self, xs, weights):
        """Per rank q: block q of ``Σ_r xs[r] weights[r]ᵀ`` (rows split in p)."""
        self._check_inputs(xs, weights, "matmul_reduce_scatter")
        xs = [x.contiguous() for x in xs]
        m, k = xs[0].shape
        if m % self.p:
            raise ValueError(f"xs[0].shape[0]: {m} is not divisible by p = {self.p}")
        self._ensure("matmul_reduce_scatter",
                     region_needs("matmul_reduce_scatter", self.p, m, weights[0].shape[0], k, xs[0].dtype))
        return self._launch(lambda q, s: _rank_matmul_reduce_scatter(self.contexts[q], xs[q], weights[q], s),
                            [(xs[q], weights[q]) for q in range(self.p)])

    def matmul_all_reduce(self, xs, weights, algorithm: Optional[str] = None):
        """Per rank q: ``Σ_r xs[r] weights[r]ᵀ`` by ``algorithm`` (default: :func:`all_reduce_algorithm`)."""
        self._check_inputs(xs, weights, "matmul_all_reduce")
        xs = [x.contiguous() for x in xs]
        m, k = xs[0].shape
        n = weights[0].shape[0]
        algorithm = (all_reduce_algorithm(m, n, self.p, xs[0].dtype) if algorithm is None
                     else check_algorithm(algorithm, m, self.p))
        self._ensure("matmul_all_reduce", region_needs("matmul_all_reduce", self.p, m, n, k, xs[0].dtype, algorithm))
        return self._launch(lambda q, s: _rank_matmul_all_reduce(self.contexts[q], xs[q], weights[q], algorithm, s),
                            [(xs[q], weights[q]) for q in range(self.p)])
