"""The symmetric workspace of the ``fused`` backend: one buffer per rank of a group, mapped into
every other rank by CUDA IPC, and whether a group can have one at all.

Every rank of a group owns one buffer (``cudaMalloc``: one IPC handle), laid out as
``[control block][export][inbox][export2]`` (``_C.REGIONS``; ``csrc/include/tp_kernels/peer.h``).
The handles are exchanged over the group's host route (its gloo twin where it has one:
:func:`tp_kernels._collectives.host_route`) and opened in every other rank; a
``_C.PeerContext`` is this rank's table of the p buffers, which the fused ops take.

* :func:`topology_reason`: whether the group is on one node with peer access, decided once per
  group by two bounded all-gathers, so that every rank reaches the same answer.
* :func:`context`: the group's PeerContext, its regions grown (to powers of two, at least
  :data:`MIN_REGION_BYTES`) to what a call needs, all ranks together: they first exchange what
  they are growing for, and unless every rank names the same call and sizes, all raise and keep
  the workspace they had. So the buffers stay alike on every rank, and a call that ranks disagree
  on cannot reach past a peer's buffer; the flags' call words (``peer.h``) catch the disagreements
  that need no growth.
* :func:`destroy_workspaces`: free a group's workspace (``destroy_model_parallel`` does).
* :func:`new_context`: where every ``PeerContext`` is made. Those still alive when the
  interpreter exits are kept, never destroyed: the end of the process frees them, and their
  destructor would wait for the device with no limit.

Growth cannot happen inside a CUDA graph capture: the op then raises, asking for an eager call
with those shapes first.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import socket
import weakref
from typing import Callable, List, Optional, Sequence

import torch

from .. import _collectives as coll
from .. import _extension, parallel_state, settings
from .._agreement import exchange_views
from .._timing import synchronize

__all__ = ["MIN_REGION_BYTES", "agree_on_growth", "all_reduce_needs", "capturing", "context", "destroy_workspaces",
           "grown", "new_context", "region_needs", "topology_reason"]

#: The smallest size a workspace region grows to (regions grow to powers of two).
MIN_REGION_BYTES = 2**20


def region_needs(op: str, p: int, m: int, n: int, k: int, dtype: torch.dtype,
                 algorithm: Optional[str] = None) -> List[int]:
    """Bytes of each region (``_C.REGIONS``) a fused call of ``op`` needs on each rank.

    ``m`` is the gathered rows for ``all_gather_matmul`` (``p`` shards of ``m/p``) and the rows of
    ``x`` for the reductions; the sizes are the native module's, rounded up to its
    ``REGION_ALIGNMENT``.
    """
    C = _extension.require()
    return list(C.fused_region_needs(op, p, m, n, k, _extension.dtype_name(dtype), algorithm))


def all_reduce_needs(p: int, numel: int, dtype: torch.dtype, algorithm: str) -> List[int]:
    """Bytes of each region a fused all-reduce of ``numel`` elements (the collective alone) needs
    on each rank."""
    C = _extension.require()
    return list(C.fused_all_reduce_needs(p, numel, _extension.dtype_name(dtype), algorithm))


def grown(have: Optional[Sequence[int]], need: Sequence[int]) -> Optional[List[int]]:
    """The region sizes to grow to (powers of two, at least MIN_REGION_BYTES; a region nothing
    needs stays empty), or None if ``have`` already holds ``need``. ``have`` None: no workspace
    yet, which a call needs for its flags even when it needs no region."""
    if have is not None and all(n <= h for n, h in zip(need, have)):
        return None
    have = [0] * len(need) if have is None else have
    return [h if n <= h else max(MIN_REGION_BYTES, 1 << (n - 1).bit_length()) for n, h in zip(need, have)]


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_growth_error(op: str, regions: Sequence[int]) -> RuntimeError:
    return RuntimeError(
        f"fused {op}: the group's workspace must grow to {list(regions)} bytes "
        f"({', '.join(_extension.require().REGIONS)}), which cannot happen inside a CUDA graph capture: run the "
        "op once with these shapes before capturing")


#: (id(group), device index) -> _GroupWorkspace
_workspaces: dict = {}
#: Workspaces :func:`destroy_workspaces` could not release (their device had not finished within
#: the timeout), and those of ``testing.VirtualRanks.close``: kept, so that neither their buffers
#: nor their contexts (a copy stream, an error word) are freed under work that may still use them.
_unreleased: list = []
#: Every PeerContext :func:`new_context` made and not yet destroyed
_contexts: weakref.WeakSet = weakref.WeakSet()
#: (id(group), device index) -> (group, reason or None, ranks on this GPU): whether the
#: group can use peer memory, and how many of its ranks share this rank's GPU
_topology: dict = {}


def new_context(rank: int, p: int, device: int, bases: Sequence[int], regions: Sequence[int], timeout_s: float,
                sharing: int):
    """A ``_C.PeerContext`` over the p buffers ``bases`` (rank ``rank``'s table; ``sharing``: the
    ranks on this GPU), registered to be kept at interpreter exit (:func:`_keep_contexts_at_exit`)."""
    ctx = _extension.require().PeerContext(rank, p, device, list(bases), list(regions), timeout_s, sharing)
    _contexts.add(ctx)
    return ctx


@atexit.register
def _keep_contexts_at_exit() -> None:
    """Keep every PeerContext still alive, so that the interpreter's teardown never destroys one.

    Its destructor synchronises its copy stream and frees its error word (``cudaFreeHost``, which
    waits for the whole device), neither with a limit: a device still busy, or stuck on a peer that
    is gone, would hang the exit. The process's end frees them instead. One added reference to a
    list of them: objects that something outside the collector refers to are never destroyed."""
    alive = list(_contexts)
    if alive:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(alive))


def host_id() -> bytes:
    """16 bytes naming this host (its name and boot id): processes that share them share a node."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).digest()[:16]


def topology_reason(group, device: torch.device) -> Optional[str]:
    """Why this group cannot use peer memory, or None. Decided once per group by two bounded
    all-gathers, so that every rank reaches the same answer."""
    key = coll.group_key(group, device)
    if key in _topology:
        return _topology[key][1]
    if torch.compiler.is_compiling() or capturing():
        return ("the group's peer access is checked by its first fused call, which cannot run inside "
                "torch.compile tracing or a CUDA graph capture: run the op once eagerly first")
    p = coll.group_size(group)
    route = coll.host_route(group, device)
    infos = coll.all_gather_bytes(host_id() + device.index.to_bytes(4, "little"), *route)
    devices = [int.from_bytes(i[16:], "little") for i in infos]
    reason, sharing = None, p
    if len({i[:16] for i in infos}) > 1:
        reason = "the group spans several hosts (peer memory needs one node)"
    else:
        me = device.index
        sharing = devices.count(me)
        ok = all(d == me or torch.cuda.can_device_access_peer(me, d) for d in devices)
        verdicts = coll.all_gather_bytes(bytes([ok]), *route)
        bad = [q for q in range(p) if verdicts[q] != b"\x01"]
        if bad:
            reason = f"rank {bad[0]} of the group cannot reach every peer's GPU by peer access"
    _topology[key] = (group, reason, sharing)
    return reason


def ranks_on_device(group, device: torch.device) -> int:
    """How many of ``group``'s ranks run on ``device`` (this one included), by the device indices
    its topology check gathered (:func:`topology_reason`): the ranks whose fused all-reduce kernels
    must fit on this GPU side by side. All of them when the check cannot run here."""
    topology_reason(group, device)
    entry = _topology.get(coll.group_key(group, device))
    return coll.group_size(group) if entry is None else entry[2]


def agree_on_growth(op: str, regions: Sequence[int], call: str, group, device: torch.device) -> None:
    """Return when every rank of ``group`` grows its workspace to the same ``regions`` for the
    same ``call``; else raise the same ``RuntimeError`` on every rank, listing each rank's call. One
    bounded all-gather, so it is also a barrier."""
    views = exchange_views(f"{call}, growing the regions to {list(regions)}", *coll.host_route(group, device))
    if len(set(views)) > 1:
        listing = "; ".join(f"rank {q}: {v}" for q, v in enumerate(views))
        raise RuntimeError(
            f"tp_kernels: fused {op}: the ranks of group {group.group_name!r} disagree on this call, so none of it "
            f"ran and the group keeps its fused workspace ({listing}). Every rank of a group must make the same "
            "calls in the same order, with tensors of the same shapes and dtypes")


class _GroupWorkspace:
    """This rank's buffer of a group's symmetric workspace, the peers' buffers mapped by CUDA IPC,
    and the PeerContext over them."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.p, self.rank = coll.group_size(group), coll.group_rank(group)
        self.regions: Optional[List[int]] = None
        self.base = None
        self.bases: List[int] = []
        self.ctx = None

    def context(self, op: str, need: Sequence[int], call: Callable[[], str]):
        regions = grown(self.regions, need)
        if regions is not None:
            if capturing():
                raise capture_growth_error(op, regions)
            with torch.cuda.device(self.device):
                self._map(op, regions, call())
        timeout = settings.get_timeout()
        if self.ctx.timeout_s != timeout:
            self.ctx.timeout_s = timeout
        return self.ctx

    def _map(self, op: str, regions: List[int], call: str) -> None:
        C, dev = _extension.require(), self.device.index
        if self.base is not None:
            synchronize(f"{op}: this rank's work on the workspace it outgrew", self.device)  # done with its buffers ...
            self.ctx.check()  # ... and a failed workspace is not silently replaced
        agree_on_growth(op, regions, call, self.group, self.device)  # a barrier too: the old buffers are free
        self.release(barrier=False)
        base = C.workspace_alloc(C.CONTROL_BYTES + sum(regions), dev)
        try:
            C.workspace_init(base, dev)
            synchronize(f"{op}: the new peer workspace's control block", self.device)  # written before a peer maps it
            handles = coll.all_gather_bytes(C.ipc_handle(base, dev), *coll.host_route(self.group, self.device))
            bases = [base if q == self.rank else C.ipc_open(h, dev) for q, h in enumerate(handles)]
        except BaseException:
            C.workspace_free(base, dev)
            raise
        self.base, self.bases, self.regions = base, bases, list(regions)
        self.ctx = new_context(self.rank, self.p, dev, bases, regions, settings.get_timeout(),
                               ranks_on_device(self.group, self.device))

    def release(self, barrier: bool) -> None:
        """Unmap the peers' buffers and free this rank's, once no rank uses them any more: this
        device is synchronised and, with ``barrier``, every rank has got this far too."""
        if self.base is None:
            return
        C, dev = _extension.require(), self.device.index
        synchronize("the peer workspace's release: this rank's work on its buffers", self.device)
        if barrier:
            coll.all_gather_bytes(b"\x01", *coll.host_route(self.group, self.device))
        self.ctx = None
        for q, b in enumerate(self.bases):
            if q != self.rank:
                C.ipc_close(b, dev)
        C.workspace_free(self.base, dev)
        self.base, self.bases, self.regions = None, [], None


def context(group, device: torch.device, op: str, need: Sequence[int], call: Callable[[], str]):
    """The group's PeerContext on ``device``, its workspace grown to ``need`` (made on first use,
    with every rank of the group). ``call()`` describes the call, for the ranks to compare when
    they grow (only then: it costs host time)."""
    key = coll.group_key(group, device)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = _GroupWorkspace(group, device)
    return ws.context(op, need, call)


@parallel_state.on_group_destroyed
def destroy_workspaces(group=None) -> None:
    """Free the fused workspaces of ``group`` (of every group when None).

    Each rank synchronises its device and, while the group still works, waits for the others
    (bounded) before freeing, so no peer still reads its buffer; errors are not raised. A device
    that does not finish its work within :func:`tp_kernels.get_timeout` keeps its workspace, the
    buffers and the context (in ``_unreleased``: not freed under work that may still use them).
    """
    for key in [k for k, ws in _workspaces.items() if group is None or ws.group is group]:
        ws = _workspaces.pop(key)
        try:
            ws.release(barrier=True)
        except Exception:  # a dead peer or a failed context: free what is ours anyway
            try:
                ws.release(barrier=False)
            except Exception:
                _unreleased.append(ws)
    for key in [k for k, (g, *_) in _topology.items() if group is None or g is group]:
        del _topology[key]
