"""Raw collectives (dim 0 gathered or scattered; broadcast, gather, point to point), with bounded waits.

Everything that talks to ``torch.distributed`` goes through here:

* group resolution (``group=None`` means the tensor-parallel group, or the default group when
  :func:`tp_kernels.initialize_model_parallel` was never called, or "this process alone" when
  ``torch.distributed`` is not initialized at all), and groups by name (the custom ops carry
  the name);
* the all-reduce, all-gather and reduce-scatter issued by the group's own methods
  (``_pg_*``), with one compatibility shim for the methods renamed in torch 2.13
  (``all_gather_single``/``reduce_scatter_single``, formerly ``_allgather_base``/``_reduce_scatter_base``);
* every collective is issued asynchronously and waited with :func:`wait`, which applies the
  library-wide timeout (:func:`tp_kernels.settings.get_timeout`) and turns a stuck collective
  into an error naming the operation.

The helpers take and return contiguous tensors and never touch autograd; the layout helpers
(:func:`blocks_first`, :func:`join_blocks`) are aten views and copies, which autograd
differentiates as it does any.
"""

from __future__ import annotations

import datetime
import functools
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import parallel_state, schedule
from .settings import fingerprints_enabled, get_timeout

__all__ = [
    "UNSAFE_VIEW",
    "Pending",
    "all_gather_bytes",
    "all_gather_dim0",
    "all_reduce",
    "blocks_first",
    "broadcast",
    "check_alive",
    "gather",
    "group_from_name",
    "group_key",
    "group_name",
    "group_rank",
    "group_size",
    "join_blocks",
    "join_stacked",
    "recv",
    "reduce_scatter_dim0",
    "resolve_group",
    "ring_exchange",
    "send",
    "split",
    "wait",
]

#: whether this torch has torch.distributed
_DISTRIBUTED = dist.is_available()
# torch's lookup of a group by its name (absent from builds without torch.distributed)
_resolve_process_group = dist.distributed_c10d._resolve_process_group if _DISTRIBUTED else None

# The hot collectives go to the group's own methods, as torch.distributed's functions do after
# their Python layer (measured on a fake group, 2-core VM: an all-reduce issued and waited 2.9 µs
# against 6.4 µs, an all-gather 3.6 µs against 5.4 µs). What that layer adds cannot apply here:
# the groups are this process's own (resolve_group), the tensors plain, contiguous and, for the
# reductions, real (a complex one is viewed as real for the all-gather, as torch does), and a
# collective waited for at once cannot be deferred by a coalescing manager. The options are made
# once: the group copies what it needs from them.
if _DISTRIBUTED:
    _PG = dist.ProcessGroup
    _PG_ALL_GATHER = getattr(_PG, "all_gather_single", None) or _PG._allgather_base
    _PG_REDUCE_SCATTER = getattr(_PG, "reduce_scatter_single", None) or _PG._reduce_scatter_base
    _ALL_GATHER_OPTIONS = dist.distributed_c10d.AllgatherOptions()
    _SUM = dist.ReduceOp.SUM
#: options type (for a sum), or (options type, ReduceOp) -> the options, made once
_reduce_options: dict = {}


def _options(kind, op):
    """The options of a reduction by ``op``; ``kind``: ``AllreduceOptions`` or
    ``ReduceScatterOptions``. A sum's are found by ``kind`` alone: hashing a ``ReduceOp`` costs
    about 0.2 µs."""
    key = kind if op is _SUM else (kind, op)
    opts = _reduce_options.get(key)
    if opts is None:
        opts = _reduce_options[key] = kind()
        opts.reduceOp = op
    return opts


def _pg_all_reduce(x: torch.Tensor, group, op):
    """Start ``dist.all_reduce(x, op, group, async_op=True)``, on the group itself."""
    return group.allreduce([x], _options(dist.AllreduceOptions, op))


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor viewed as real (``[..., 2]``), as the backends move it; others as they are."""
    return torch.view_as_real(t) if t.is_complex() else t


def _pg_all_gather(out: torch.Tensor, x: torch.Tensor, group):
    """Start ``dist.all_gather_into_tensor(out, x, group, async_op=True)``, on the group itself."""
    if x.is_complex():  # (out has x's dtype: one test for both)
        out, x = torch.view_as_real(out), torch.view_as_real(x)
    return _PG_ALL_GATHER(group, out, x, _ALL_GATHER_OPTIONS)


def _pg_reduce_scatter(out: torch.Tensor, x: torch.Tensor, group):
    """Start ``dist.reduce_scatter_tensor(out, x, SUM, group, async_op=True)``, on the group itself."""
    return _PG_REDUCE_SCATTER(group, out, x, _options(dist.distributed_c10d.ReduceScatterOptions, dist.ReduceOp.SUM))


def resolve_group(group):
    """The process group an API call runs on, or ``None`` for "this process alone". ``group`` may
    be a one-dim ``DeviceMesh`` (torch's tensor-parallel mesh, ``mesh["tp"]``): its group."""
    if group is not None:
        if isinstance(group, _PG):  # (a good call's one test)
            return group
        if type(group).__name__ == "DeviceMesh":
            if group.ndim != 1:
                raise ValueError(f"group: a DeviceMesh of {group.ndim} dims ({group.mesh_dim_names}); pass its "
                                 "tensor-parallel dim, mesh['tp']")
            group = group.get_group()
        # A ProcessGroup object exists only in its members (torch gives the others a sentinel).
        if not isinstance(group, _PG) and dist.get_rank(group) < 0:
            raise ValueError(
                f"group: this process (global rank {dist.get_rank()}) is not a member of the group it was given"
            )
        return group
    tp = parallel_state.tensor_model_parallel_group_or_none()
    if tp is not None:
        return tp
    # the default group, None before init_process_group: dist.group.WORLD asked once, where
    # dist.is_initialized() asks it too (five function calls to two, ~0.3 µs of a call's host time)
    return dist.group.WORLD if _DISTRIBUTED else None


def group_name(group) -> str:
    """The name a custom op carries for ``group`` (``""``: this process alone)."""
    return "" if group is None else group.group_name


def group_from_name(name: str):
    """The group :func:`group_name` named."""
    return _resolve_process_group(name) if name else None


#: Groups destroy_model_parallel destroyed (kept, so that their ids are not reused meanwhile).
_destroyed: list = []


@parallel_state.on_group_destroyed
def _forget_group(group) -> None:
    _destroyed.append(group)


def check_alive(group) -> None:
    """Raise a ``RuntimeError`` saying what to do when ``group`` was destroyed (a layer kept past
    ``destroy_model_parallel``), instead of torch's "not registered"."""
    if _destroyed and group is not None and any(g is group for g in _destroyed):
        raise RuntimeError(
            f"group: the process group {group.group_name!r} of this call was destroyed by "
            "tp_kernels.destroy_model_parallel(); make the layer again (or pass a live group) after "
            "tp_kernels.initialize_model_parallel()")


def group_key(group, device: torch.device):
    """A key for per-group, per-device state (communicators, workspaces, ``auto``'s decisions): the
    caller keeps the group alive with the entry, so that its id cannot be reused by another group
    meanwhile (the group's name is not read: ~0.15 µs of each call's host time). Under
    torch.compile, a constant of the trace (below)."""
    return (id(group), device.index)


# What torch.compiler.assume_constant_result does to a function, without its import of
# torch._dynamo (1.5 s more for `import tp_kernels`): dynamo calls group_key while it traces and
# takes the result as a constant, sound as it guards on the group's identity and the tensor's
# device. Torch 2.11's dynamo cannot trace id() of a process group: a call of backend="auto" with
# several candidates failed to compile whole there.
group_key._dynamo_marked_constant = True


def group_size(group) -> int:
    """The number of ranks of ``group`` (one of this process's groups, :func:`resolve_group`)."""
    return 1 if group is None else group.size()  # not dist.get_world_size: ~0.5 µs less a call


def group_rank(group) -> int:
    """This process's rank in ``group`` (one of its groups, :func:`resolve_group`)."""
    return 0 if group is None else group.rank()


#: What a collective is, for its error messages: the description, or a callable that makes it only
#: when an error needs it (formatting a shape and a dtype costs ~0.7 µs of a call's host time).
What = Union[str, Callable[[], str]]


def _about(kind: str, t: torch.Tensor, *tail) -> Callable[[], str]:
    """The :data:`What` of collective ``kind`` of ``t``, e.g. ``"all-reduce of (16, 64)
    torch.float32"``, ``tail`` appended (``"from rank", 0``)."""
    return lambda: " ".join([f"{kind} of {tuple(t.shape)} {t.dtype}", *map(str, tail)])


class Pending:
    """Communication in flight: ``wait()`` completes it and returns the output.

    ``wait()`` first waits for ``deps`` (other :class:`Pending`, e.g. one per chunk), then for
    ``works``, then applies ``finish(tensor)`` once: a local epilogue that must follow the
    communication, such as adding a bias once after a reduction.
    """

    __slots__ = ("tensor", "works", "what", "group", "finish", "deps")

    def __init__(self, tensor: torch.Tensor, works=(), what: What = "", group=None, finish=None, deps=()):
        self.tensor = tensor
        self.works = works  # sequences the caller hands over (not copied: ~0.1 µs a call each)
        self.what = what
        self.group = group
        self.finish = finish
        self.deps = deps

    def then(self, finish) -> "Pending":
        """This pending result, with ``finish(tensor)`` applied after its own epilogue (None:
        nothing more)."""
        if finish is not None:
            first = self.finish
            self.finish = finish if first is None else (lambda t: (first(t), finish(t)))
        return self

    def wait(self) -> torch.Tensor:
        if self.deps:
            for dep in self.deps:
                dep.wait()
            self.deps = ()
        if self.works:
            cuda = self.tensor.is_cuda
            for work in self.works:
                wait(work, self.what, self.group, cuda=cuda)
            self.works = ()
        if self.finish is not None:
            self.finish(self.tensor)
            self.finish = None
        return self.tensor


def _dead_peer_error(what: What, group, timeout: float, exc: BaseException) -> RuntimeError:
    # (with fingerprints off, ranks that made different calls meet here: say how to have them named)
    hint = "" if fingerprints_enabled() else (
        " To have calls that differ between ranks named before they run, set TP_KERNELS_FINGERPRINTS=1.")
    return RuntimeError(
        f"tp_kernels: {what() if callable(what) else what} did not complete on global rank {dist.get_rank()} "
        f"(group of {group_size(group)} ranks, timeout {timeout:g} s): {exc}. A peer rank may have died, "
        "diverged, or called a different collective. The limit is set with "
        f"tp_kernels.set_timeout() or TP_KERNELS_TIMEOUT_S.{hint}"
    )


#: The dtypes gloo moves (its ``GENERATE_ALL_TYPES``): it takes a host tensor of another one (int16,
#: the unsigned ints, float8) and fails only when the work runs ("Invalid scalar type"), as a dead
#: peer would. Complex tensors travel as their real views.
GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})


def _check_carried(what: What, x: torch.Tensor, group) -> None:
    """A ``ValueError`` where ``x`` is a host tensor of a dtype gloo, ``group``'s host backend, does
    not move (:data:`GLOO_DTYPES`): raised on every rank alike, before anything is sent."""
    if x.dtype in GLOO_DTYPES or x.is_cuda or x.is_complex() or parallel_state.host_backend(group) != "gloo":
        return
    carried = ", ".join(sorted(str(d).rpartition(".")[2] for d in GLOO_DTYPES))
    raise ValueError(f"tp_kernels: {what() if callable(what) else what}: gloo, the group's backend for host "
                     f"tensors, does not carry {x.dtype} (it carries {carried}, and complex): convert the tensor "
                     "first")


def _issue(what: What, group, x: torch.Tensor, start, *args):
    """``start(*args)``: a collective's start, moving ``x`` (its dtype checked first,
    :func:`_check_carried`), whose failure (a peer's connection gone, say) is raised as :func:`wait`
    raises a failed wait."""
    _check_carried(what, x, group)
    try:
        return start(*args)
    except RuntimeError as exc:  # RuntimeError or DistBackendError from the backend
        raise _dead_peer_error(what, group, get_timeout(), exc) from exc


def wait(work, what: What, group=None, *, cuda: bool = False) -> None:
    """Wait for ``work`` at most :func:`get_timeout` seconds; raise a readable error otherwise.

    The host never blocks on CUDA work (``cuda=True``): ``work.wait()`` only orders the current
    stream after it, and NCCL's watchdog enforces the group's timeout. Host (gloo) work is
    bounded by our own timeout, not the group's (``new_group`` defaults to 30 minutes), through
    ``work.wait(timeout)``: a collective still running then raises. (Every host collective here
    runs asynchronously, so the bound applies; gloo's reduce-scatter, which would run inside
    ``wait()`` itself, is not used: :func:`reduce_scatter_dim0`.)
    """
    if cuda:
        work.wait()
        return
    timeout = get_timeout()
    try:
        work.wait(_timedelta(timeout))  # raises the backend's error, if any (positional: ~0.2 µs less)
    except Exception as exc:  # RuntimeError ("Operation timed out!") or DistBackendError from the backend
        raise _dead_peer_error(what, group, timeout, exc) from exc


@functools.lru_cache(maxsize=8)
def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _local(x: torch.Tensor, out: Optional[torch.Tensor], what: What) -> Pending:
    """A one-rank collective: ``x`` itself, or copied into ``out``."""
    if out is not None:
        x = out.copy_(x)
    return Pending(x, (), what)


def all_gather_dim0(x: torch.Tensor, group, *, out: Optional[torch.Tensor] = None) -> Pending:
    """Start ``[m/p, ...] -(AG)-> [m, ...]``, rank-major along dim 0."""
    p = group_size(group)
    x = x.contiguous()
    if p == 1:
        return _local(x, out, "all-gather")
    if out is None:
        out = x.new_empty((x.shape[0] * p,) + tuple(x.shape[1:]))
    what = _about("all-gather", x)
    work = _issue(what, group, x, _pg_all_gather, out, x, group)
    return Pending(out, (work,), what, group)


def exchange_device(group, device: torch.device) -> torch.device:
    """Where small tensors exchanged over ``group`` live: the CPU when the group carries host
    tensors (:func:`tp_kernels.parallel_state.carries_host_tensors`: gloo, or
    ``cpu:gloo,cuda:nccl``), else ``device`` (an NCCL group)."""
    return torch.device("cpu") if parallel_state.carries_host_tensors(group) else device


def host_route(group, hint=None) -> Tuple[object, torch.device]:
    """Over which group and on which device a small exchange of ``group``'s ranks (a fingerprint, a
    description) travels: the host, over the group or its host twin
    (:func:`tp_kernels.parallel_state.host_group`), so it never waits for the GPU; for another
    NCCL group, this rank's GPU (the tensor read back waits for its stream): ``hint``'s (a tensor of
    the call, or a device), else the current one."""
    host = parallel_state.host_group(group)
    if host is not None:
        return host, torch.device("cpu")
    device = hint.device if isinstance(hint, torch.Tensor) else hint
    if isinstance(device, torch.device) and device.type == "cuda":
        return group, device
    return group, torch.device("cuda", torch.cuda.current_device())


def barrier(group, device: torch.device) -> None:
    """Return once every rank of ``group`` has called it: a one-element all-reduce on
    :func:`exchange_device`, finished on the host, bounded like every collective here (unlike
    ``dist.barrier``, it needs no guess of the rank's GPU)."""
    if group_size(group) > 1:
        all_reduce(torch.zeros(1, device=exchange_device(group, device)), group, inplace=True).wait().item()


def all_gather_bytes(payload: bytes, group, device: torch.device) -> List[bytes]:
    """Every rank's ``payload`` (of one length on all ranks, at least 1 byte), in group rank order.

    Bounded like every collective here. The bytes travel in a tensor on
    :func:`exchange_device`: the CPU when the group carries host tensors, else ``device``.
    """
    if not payload:
        raise ValueError("payload: expected at least one byte")
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(exchange_device(group, device))
    gathered = all_gather_dim0(mine, group).wait().cpu().tolist()
    n = len(payload)
    return [bytes(gathered[q * n:(q + 1) * n]) for q in range(group_size(group))]


def swap_bytes(payload: bytes, peer: int, group, device: torch.device) -> bytes:
    """``payload`` sent to group rank ``peer``, and what ``peer`` sent this rank (of the same
    length: ``peer`` calls this with this rank as its ``peer``). One send and one receive, issued
    as one batch (see :func:`ring_exchange`), bounded like every collective here, on
    :func:`exchange_device`."""
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(exchange_device(group, device))
    theirs = torch.empty_like(mine)
    other = dist.get_global_rank(group, peer)
    what = _about("exchange", mine, "with rank", peer)
    works = _issue(what, group, mine, lambda: dist.batch_isend_irecv([
        dist.P2POp(dist.isend, mine, other, group=group),
        dist.P2POp(dist.irecv, theirs, other, group=group),
    ]))
    for work in works:
        wait(work, what, group, cuda=theirs.is_cuda)
    return bytes(theirs.cpu().tolist())


def reduce_scatter_dim0(x: torch.Tensor, group, *, out: Optional[torch.Tensor] = None,
                        scratch: bool = False) -> Pending:
    """Start ``[m, ...] -(RS, sum)-> [m/p, ...]``; rank r keeps rows ``[r*m/p, (r+1)*m/p)``.

    ``scratch=True`` lets the collective overwrite ``x``. Host tensors go through an
    asynchronous all-reduce and keep this rank's block: gloo's reduce-scatter runs
    synchronously inside ``wait()``, so it could neither overlap nor be bounded by a timeout.
    """
    p = group_size(group)
    x = x.contiguous()
    if p == 1:
        return _local(x, out, "reduce-scatter")
    if x.shape[0] % p:
        raise ValueError(f"reduce-scatter: dim 0 ({x.shape[0]}) is not divisible by the group size {p}")
    mp = x.shape[0] // p
    what = _about("reduce-scatter", x)
    if out is None:
        out = x.new_empty((mp,) + tuple(x.shape[1:]))
    if not x.is_cuda:
        summed = all_reduce(x, group, inplace=scratch)
        r = group_rank(group)
        return Pending(out, deps=(summed,), what=what, group=group,
                       finish=lambda o: o.copy_(summed.tensor[r * mp : (r + 1) * mp]))
    work = _issue(what, group, x, _pg_reduce_scatter, out, x, group)
    return Pending(out, (work,), what, group)


def all_reduce(x: torch.Tensor, group, *, op=dist.ReduceOp.SUM, inplace: bool = False) -> Pending:
    """Start a sum (or ``op``) all-reduce; on a copy of ``x`` unless ``inplace``.

    With one rank nothing is copied: the result is ``x`` itself.
    """
    if group_size(group) == 1:
        return _local(x, None, "all-reduce")
    if not (inplace and x.is_contiguous()):
        x = x.contiguous() if inplace else x.clone(memory_format=torch.contiguous_format)
    what = _about("all-reduce", x)
    work = _issue(what, group, x, _pg_all_reduce, x, group, op)
    return Pending(x, (work,), what, group)


def broadcast(x: torch.Tensor, src: int, group) -> Pending:
    """Start broadcasting contiguous ``x`` from group rank ``src`` into ``x`` on every rank."""
    if group_size(group) == 1:
        return _local(x, None, "broadcast")
    what = _about("broadcast", x, "from rank", src)
    root = dist.get_global_rank(group, src)
    work = _issue(what, group, x, lambda: dist.broadcast(x, src=root, group=group, async_op=True))
    return Pending(x, (work,), what, group)


def gather(x: torch.Tensor, out: Optional[torch.Tensor], dst: int, group) -> Pending:
    """Start gathering contiguous ``x`` ``[d, ...]`` of every rank into ``out`` ``[p*d, ...]``
    (rank-major) on group rank ``dst``; ``out`` is None on the other ranks."""
    p = group_size(group)
    if p == 1:
        return _local(x, out, "gather")
    what = _about("gather", x, "to rank", dst)
    # complex tensors viewed as real: torch's gather, unlike its other collectives, does not
    blocks = [_as_real(b) for b in out.chunk(p)] if out is not None else None
    root = dist.get_global_rank(group, dst)
    work = _issue(what, group, x, lambda: dist.gather(_as_real(x), blocks, dst=root, group=group, async_op=True))
    return Pending(x if out is None else out, (work,), what, group)


def send(x: torch.Tensor, dst: int, group) -> Pending:
    """Start sending contiguous ``x`` to group rank ``dst``."""
    what = _about("send", x, "to rank", dst)
    work = _issue(what, group, x, lambda: dist.isend(x, dst=dist.get_global_rank(group, dst), group=group))
    return Pending(x, (work,), what, group)


def recv(out: torch.Tensor, src: int, group) -> Pending:
    """Start receiving contiguous ``out`` from group rank ``src``."""
    what = _about("recv", out, "from rank", src)
    work = _issue(what, group, out, lambda: dist.irecv(out, src=dist.get_global_rank(group, src), group=group))
    return Pending(out, (work,), what, group)


#: a reshape that autograd does not track as a view (aten's, with which torch.matmul ends)
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def blocks_first(x: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """``x`` with its ``dim`` cut into ``p`` blocks and the blocks stacked along dim 0, rank-major:
    ``[b, s, h] -> [p*b, s/p, h]`` for 1, block r at rows ``[r*b, (r+1)*b)``. What a collective or
    op along dim 0 then scatters as the blocks of ``dim`` (the inverse of :func:`join_blocks`). A
    contiguous copy unless ``dim`` is 0 or the dims before it are all 1 (then a view); ``x`` itself
    for 0."""
    if not dim:
        return x
    return x.unflatten(dim, (p, -1)).movedim(dim, 0).flatten(0, 1).contiguous()


def join_blocks(x: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """``x``'s dim 0 holding ``p`` blocks rank-major, the blocks joined along ``dim`` of one
    (``[p*b, s/p, h] -> [b, s, h]`` for 1; negative counts from the end): what a collective or op
    along dim 0 gathered gives back as a gather of ``dim``. Contiguous: a copy unless the dims
    before ``dim`` are all 1, and then not a view of a contiguous ``x`` (FSDP2 warns of a module
    whose output is a view, as a language model's head's is); ``x`` itself for 0 or one block."""
    dim %= x.dim()
    if not dim or p == 1:
        return x
    return join_stacked(x.unflatten(0, (p, -1)), dim)


def join_stacked(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``stacked``, ``[p, *shape]`` (rank-major: what an all-gather into a leading dim gives), as
    ``shape`` with dim ``dim`` (of ``shape``, not 0) p times as long: :func:`join_blocks` of the
    blocks already apart, without the views that would flatten and cut them again."""
    shape = list(stacked.shape[1:])
    shape[dim] *= stacked.shape[0]
    if stacked.shape[1:dim + 1].numel() == 1 and stacked.is_contiguous():  # (the dims before dim all 1: the
        return UNSAFE_VIEW(stacked, shape)  # blocks side by side already)
    joined = stacked.movedim(0, dim).reshape(shape)  # ([b, p, s/p, h] -> [b, s, h]: a copy, but
    return joined if joined.is_contiguous() else joined.contiguous()  # a strided view where s/p is 1)


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's block of ``dim`` (e.g. ``[..., d] -> [..., d/p]``), as a contiguous copy."""
    p = group_size(group)
    if p == 1:
        return x
    size = x.shape[dim] // p
    return x.narrow(dim, group_rank(group) * size, size).contiguous()


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group, tag: int, what: What):
    """Start sending ``send`` to the next rank of the ring and receiving ``recv`` from the previous.

    The ring is :func:`tp_kernels.schedule.ring`'s, in group ranks. Returns
    ``(send_work, recv_pending)``. The pair is issued as one batch: with NCCL a lone send may wait
    for its receiver, and every rank sending first would deadlock.
    """
    order = schedule.ring(group_rank(group), group_size(group))
    nxt = dist.get_global_rank(group, order.next)
    prv = dist.get_global_rank(group, order.prev)
    works = _issue(what, group, send, lambda: dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, nxt, group=group, tag=tag),
        dist.P2POp(dist.irecv, recv, prv, group=group, tag=tag),
    ]))
    if len(works) == 2:
        return works[0], Pending(recv, (works[1],), what, group)
    # NCCL coalesces the batch into one work: it completes both
    return None, Pending(recv, works, what, group)
