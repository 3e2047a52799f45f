"""A group's communicator, for serving engines: the collectives they call, each on its fastest path.

Inference engines (vLLM, SGLang) call a communicator rather than layers: ``all_reduce`` after a
row-parallel projection, ``all_gather`` / ``gather`` of the logits, ``broadcast`` of a tensor
and ``broadcast_tensor_dict`` of the batch's inputs, ``send`` / ``recv`` between pipeline
stages, ``all_gatherv`` / ``reduce_scatterv`` of data-parallel ranks' different token counts.
:class:`Communicator` has those methods, with the dimension handling such engines expect
(any dim, any leading shape), over any process group, and the module functions
:func:`tensor_model_parallel_all_reduce`, ``..._all_gather``, ``..._gather``,
``..._reduce_scatter`` and :func:`broadcast_tensor_dict` use the tensor-parallel group's.

Each call runs on the path decided for it (:func:`tp_kernels.dispatch.resolve_collective`):

* on the CPU (gloo): ``torch.distributed``;
* on CUDA, where they are allowed (the backend, as for the ops): the all-reduce over peer memory
  (``fused``: one-shot, two-shot or scatter-gather kernels, for the small messages of decode),
  every collective on the group's own NCCL communicator (``native``, capturable in a CUDA
  graph), or ``torch.distributed``; ``backend="auto"`` measures them on the first call of each
  size class, alike on every rank (:mod:`tp_kernels.autotune`).

The fused all-reduce sums every element in rank order in fp32 whichever algorithm runs, so a
switch of algorithm between sizes never changes a result. The collectives are custom ops
(``torch.ops.tp_kernels.*``: ``torch.compile`` sees one node each); ``send`` and ``recv`` are
eager calls. Under a CUDA graph capture, prepare first with :meth:`Communicator.capture`.

Every argument is checked on every rank before anything moves (a ``ValueError`` naming it); with
fingerprints on (:func:`tp_kernels.settings.set_fingerprints`) ranks that disagree on a call
(shapes, dtypes, dims, roots) all raise instead of mismatching, and so do the two ends of a
``send`` and its ``recv``; every wait is bounded by :func:`tp_kernels.get_timeout`.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from . import _collectives as coll
from . import _library
from . import backends, dispatch, parallel_state
from ._agreement import agree, agree_pair, describe
from ._checks import check_choice, wants_grad
from .backends.fused import MAX_BYTES
from .settings import BACKEND_NAMES, deciding

__all__ = [
    "CAPTURE_BYTES",
    "Communicator",
    "broadcast_tensor_dict",
    "tensor_parallel_communicator",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter",
]

#: The largest all-reduce :meth:`Communicator.capture` prepares the fused path for by default.
CAPTURE_BYTES = MAX_BYTES["two_shot"]


def _default_device(group) -> torch.device:
    """This rank's GPU (the current device) for an NCCL group, or a lone process with a GPU; the
    CPU otherwise."""
    if group is None:
        nccl = torch.cuda.is_available()
    else:
        nccl = "nccl" in str(dist.get_backend(group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type != "cuda" or a.index == b.index)


#: Where each tensor of a broadcast dict starts in its device's buffer: a multiple of this many
#: bytes, so that every dtype can be viewed there.
_ALIGN = 16


def _pack(tensor_dict, device: torch.device) -> Tuple[bytes, Dict[str, List[torch.Tensor]]]:
    """What :meth:`Communicator.broadcast_tensor_dict`'s source sends: the pickled description
    (each key with its tensor's dtype, shape and device type, or its other value) and the tensors
    by device type ("cpu", or the communicator's device). Raises ``ValueError`` naming the entry
    it cannot send."""
    if not isinstance(tensor_dict, dict):
        raise ValueError(f"tensor_dict: expected a dict on the source rank, got {type(tensor_dict).__name__}")
    described: List[Tuple[Any, tuple]] = []
    tensors: Dict[str, List[torch.Tensor]] = {}
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu" and not _same_device(value.device, device):
                raise ValueError(f"tensor_dict[{key!r}]: expected a tensor on the CPU or on {device} (the "
                                 f"communicator's device), got one on {value.device}")
            if value.is_sparse or value.layout != torch.strided:
                raise ValueError(f"tensor_dict[{key!r}]: expected a dense (strided) tensor, got {value.layout}")
            described.append((key, ("tensor", value.dtype, tuple(value.shape), value.device.type)))
            tensors.setdefault(value.device.type, []).append(value)
        else:
            described.append((key, ("value", value)))
    try:
        return pickle.dumps(described), tensors
    except Exception as exc:  # whatever pickling raises for the value it cannot take
        bad = next((k for k, d in described if d[0] == "value" and not _picklable(d[1])), None)
        raise ValueError(f"tensor_dict[{bad!r}]: a value that is not a tensor travels pickled, and this one cannot "
                         f"be ({type(exc).__name__}: {exc})") from exc


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False


def _layout(shapes_dtypes) -> Tuple[List[int], int]:
    """The byte offset of each tensor in its device's buffer, and the buffer's size."""
    offsets, end = [], 0
    for shape, dtype in shapes_dtypes:
        offsets.append(-(-end // _ALIGN) * _ALIGN)
        end = offsets[-1] + torch.Size(shape).numel() * dtype.itemsize
    return offsets, end


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor: the same object, or eagerly the same memory (the
    same data pointer); while torch.compile traces, where pointers are unknown, only the same
    object."""
    if a is b:
        return True
    return not torch.compiler.is_compiling() and a.data_ptr() == b.data_ptr()


class Communicator:
    """The collectives of a process group for one device, each on its fastest path.

    Args:
        group: the process group (None: the tensor-parallel group, or the default group when
            :func:`tp_kernels.initialize_model_parallel` was not called, or this process alone
            when ``torch.distributed`` is not initialized).
        device: where this rank's tensors live (default: the current CUDA device for an NCCL
            group, else the CPU). Every tensor passed must be there.
        backend: ``"auto"`` (default: measured among the paths allowed, see the module doc),
            ``"reference"`` (``torch.distributed``), ``"pipelined"`` (the NCCL communicator where
            the native path runs, else ``torch.distributed``) or ``"fused"`` (the all-reduce over
            peer memory, the other collectives on the NCCL communicator; an error where those
            cannot run).

    Ranks are the group's ranks. Every rank of the group makes the same calls in the same order.
    """

    def __init__(self, group=None, *, device=None, backend: str = "auto"):
        check_choice("backend", backend, BACKEND_NAMES)
        self.group = coll.resolve_group(group)
        try:
            self.device = _default_device(self.group) if device is None else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch.device or a device string, got {device!r}") from exc
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend
        self.world_size = coll.group_size(self.group)
        self.rank_in_group = coll.group_rank(self.group)

    def __repr__(self) -> str:
        return (f"Communicator(group={coll.group_name(self.group)!r}, rank {self.rank_in_group} of "
                f"{self.world_size}, device={self.device}, backend={self.backend!r})")

    # --- the checks every method makes, on every rank, before anything moves ----------------------

    def _tensor(self, name: str, x, reduces: bool = False) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device and not _same_device(x.device, self.device):
            raise ValueError(f"{name}: expected a tensor on {self.device} (the communicator's device), got one on "
                             f"{x.device}")
        if reduces and (x.dtype == torch.bool or x.is_complex()):
            raise ValueError(f"{name}: expected a real number dtype to sum, got {x.dtype}")
        return x

    def _dim(self, x: torch.Tensor, dim) -> int:
        if x.dim() == 0:
            raise ValueError(f"x: expected a tensor with a dim to gather or scatter along, got a 0-d {x.dtype} tensor")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"dim: expected an int, got {dim!r}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim: expected a dim of x {list(x.shape)} (in [{-x.dim()}, {x.dim() - 1}]), got {dim}")
        return dim % x.dim()

    def _rank(self, name: str, rank, other: bool = False) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{name}: expected a rank of the group's {self.world_size}, got {rank!r}")
        if other and rank == self.rank_in_group:
            raise ValueError(f"{name}: expected another rank than this one ({rank})")
        return rank

    def _agree_sizes(self, call: str, x, sizes, dim, own: bool) -> int:
        """``x``'s dim ``dim`` of :meth:`all_gatherv` (``own``: ``sizes[r]`` is this rank's) or
        :meth:`reduce_scatterv` (their sum), checked with ``sizes``, a size per rank, and the call
        agreed with the group (``x``'s size along that dim differs from rank to rank in the first)."""
        def check():
            d = self._dim(self._tensor("x", x, reduces=not own), dim)
            if not (isinstance(sizes, (list, tuple)) and len(sizes) == self.world_size
                    and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)):
                raise ValueError(f"sizes: expected a list of {self.world_size} non-negative ints (one per rank of "
                                 f"the group), got {sizes!r}")
            r = self.rank_in_group
            if own and x.shape[d] != sizes[r]:
                raise ValueError(f"x: dim {d} of {list(x.shape)} is {x.shape[d]}, but sizes[{r}] (this rank's) is "
                                 f"{sizes[r]}")
            if not own and x.shape[d] != sum(sizes):
                raise ValueError(f"x: dim {d} of {list(x.shape)} is {x.shape[d]}, but sizes {list(sizes)} sum to "
                                 f"{sum(sizes)}")
            return d

        return self._agree(call, x, check, lambda d: f"x {_shape_but(x, d) if own else describe(x)} dim {d} "
                                                     f"sizes {list(sizes)}")

    def _path(self) -> str:
        """What decides the path of this communicator's calls, as their fingerprints show it: its
        backend and the settings that decide that backend's path (the ranks must take the same)."""
        return f"backend {self.backend}{deciding(self.backend)}"

    def _message(self, t: torch.Tensor) -> str:
        """A point-to-point message as both ends must see it: its shape and dtype, and its path."""
        return f"{list(t.shape)} {str(t.dtype).rpartition('.')[2]}, {self._path()}"

    def _agree(self, call: str, x, check, describe_call):
        """``check()`` agreed with the group (:func:`tp_kernels._agreement.agree`): its call as
        ``describe_call(check())`` says, and its path."""
        return agree(f"Communicator.{call}", self.group, check,
                     lambda checked: f"{describe_call(checked)}, {self._path()}", hint=x)

    def _alone(self, *tensors) -> bool:
        """Whether a call of these tensors has nothing to do but copy: the group is this rank
        alone, and none of them wants a gradient (such a call runs its op, whose backward refuses
        one, as with more ranks). Its result is then made here, without deciding a path or calling
        an op: a new contiguous tensor as the op makes, a write bumping the version counter as the
        op's does (what the op's layers cost a decode step's host: docs/api.md)."""
        return self.world_size == 1 and not wants_grad(tensors)

    def _impl(self, collective: str, x: torch.Tensor, peer: int = -1) -> str:
        return dispatch.resolve_collective(collective, self.backend, x, self.group, peer)

    # --- the collectives ------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks, of ``x``'s shape, the same on every rank.

        ``out`` (optional): where to write it (``x``'s shape, dtype and device, contiguous; may be
        ``x`` itself, for an in-place all-reduce, but no other view of its memory); returned.
        """
        def check():
            self._tensor("x", x, reduces=True)
            if out is not None:
                self._tensor("out", out)
                if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
                    raise ValueError(f"out: expected a contiguous {list(x.shape)} {x.dtype} tensor (the shape of x), "
                                     f"got {'a strided ' if not out.is_contiguous() else ''}{list(out.shape)} "
                                     f"{out.dtype}")
                # (eagerly: while torch.compile traces, pointers are unknown; docs/api.md)
                if (not torch.compiler.is_compiling() and out.numel() and x.numel() and not _same_memory(out, x)
                        and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()):
                    raise ValueError("out: shares memory with x without being x (pass x itself for an in-place "
                                     "all-reduce)")

        self._agree("all_reduce", x, check, lambda _: f"x {describe(x)} out {describe(out)}")
        if self._alone(x, out):
            if out is None:
                return x.clone(memory_format=torch.contiguous_format)
            if out is x:
                increment_version(out)
                return out
            return out.copy_(x)
        x_ = x.contiguous()
        impl, name = self._impl("all_reduce", x_), coll.group_name(self.group)
        if out is None:
            return _library.op("all_reduce")(x_, name, impl)
        if _same_memory(out, x_):  # in place: one tensor, which the op declares it writes
            _library.op("all_reduce_inplace")(out, name, impl)
        else:
            _library.op("all_reduce_out")(x_, out, name, impl)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order: ``[..., d, ...]`` ->
        ``[..., p*d, ...]``, the same on every rank."""
        d = self._agree("all_gather", x, lambda: self._dim(self._tensor("x", x), dim),
                        lambda d: f"x {describe(x)} dim {d}")
        if self._alone(x):
            return x.clone(memory_format=torch.contiguous_format)
        stacked = self._dim0("all_gather", x, d)
        return self._undo_dim0(stacked, d)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> Optional[torch.Tensor]:
        """:meth:`all_gather` on rank ``dst`` only; None on the other ranks."""
        def check():
            self._rank("dst", dst)
            return self._dim(self._tensor("x", x), dim)

        d = self._agree("gather", x, check, lambda d: f"x {describe(x)} dim {d} dst {dst}")
        if self._alone(x):
            return x.clone(memory_format=torch.contiguous_format)
        stacked = self._dim0("gather", x, d, dst)
        return self._undo_dim0(stacked, d) if self.rank_in_group == dst else None

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's block of dim ``dim`` of the sum of ``x`` over the ranks: ``[..., p*d, ...]``
        -> ``[..., d, ...]``, rank r keeping elements ``[r*d, (r+1)*d)`` of that dim."""
        def check():
            d = self._dim(self._tensor("x", x, reduces=True), dim)
            if x.shape[d] % self.world_size:
                raise ValueError(f"x: dim {d} of {list(x.shape)} ({x.shape[d]}) is not divisible by the group's "
                                 f"{self.world_size} ranks")
            return d

        d = self._agree("reduce_scatter", x, check, lambda d: f"x {describe(x)} dim {d}")
        if self._alone(x):
            return x.clone(memory_format=torch.contiguous_format)
        stacked = coll.blocks_first(x, d, self.world_size).contiguous()  # (dim d's blocks along dim 0)
        impl = self._impl("reduce_scatter", stacked)
        return _library.op("reduce_scatter")(stacked, coll.group_name(self.group), impl)

    def all_gatherv(self, x: torch.Tensor, sizes: Sequence[int], dim: int = 0) -> torch.Tensor:
        """:meth:`all_gather` of tensors whose ``dim`` differs from rank to rank, rank r's
        ``sizes[r]`` (vLLM's ``all_gatherv``: data-parallel ranks of different token counts):
        ``[..., sizes[r], ...]`` -> ``[..., sum(sizes), ...]``, rank-major, the same on every rank.
        ``sizes`` is the same list on every rank. It runs as the all-gather of ``x`` padded to
        ``max(sizes)`` along ``dim`` (on the path :meth:`all_gather` would take for that): a copy in,
        the padding on the wire, and the ranks' parts joined, a copy out."""
        d = self._agree_sizes("all_gatherv", x, sizes, dim, own=True)
        widest = max(sizes)
        if not widest or self._alone(x):  # (nothing to gather)
            return x.clone(memory_format=torch.contiguous_format)
        padded = x.new_zeros((*x.shape[:d], widest, *x.shape[d + 1:]))
        padded.narrow(d, 0, x.shape[d]).copy_(x)
        stacked = self._dim0("all_gather", padded, d)  # [p, ..., widest, ...]
        return torch.cat([stacked[r].narrow(d, 0, size) for r, size in enumerate(sizes)], d)

    def reduce_scatterv(self, x: torch.Tensor, sizes: Sequence[int], dim: int = 0) -> torch.Tensor:
        """:meth:`reduce_scatter` into blocks of different sizes: rank r keeps elements
        ``[sum(sizes[:r]), sum(sizes[:r + 1]))`` of ``dim`` of the sum of ``x`` over the ranks
        (vLLM's ``reduce_scatterv``): ``[..., sum(sizes), ...]`` -> ``[..., sizes[r], ...]``.
        ``sizes`` is the same list on every rank. It runs as the reduce-scatter of the blocks each
        padded to ``max(sizes)``: a copy in, the padding on the wire and in the sum."""
        d = self._agree_sizes("reduce_scatterv", x, sizes, dim, own=False)
        widest = max(sizes)
        if not widest or self._alone(x):  # (nothing to scatter)
            return x.clone(memory_format=torch.contiguous_format)
        stacked = x.new_zeros((self.world_size, *x.shape[:d], widest, *x.shape[d + 1:]))
        for r, block in enumerate(x.split(list(sizes), d)):
            stacked[r].narrow(d, 0, block.shape[d]).copy_(block)
        stacked = stacked.flatten(0, 1)  # (rank r's block, padded, at rows [r*b, (r+1)*b))
        impl = self._impl("reduce_scatter", stacked)
        out = _library.op("reduce_scatter")(stacked, coll.group_name(self.group), impl)
        return out.narrow(d, 0, sizes[self.rank_in_group]).contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` into ``x`` on every rank (in place); returns ``x``."""
        def check():
            self._rank("src", src)
            self._tensor("x", x)

        self._agree("broadcast", x, check, lambda _: f"x {describe(x)} src {src}")
        if self._alone(x):
            increment_version(x)
            return x
        if x.is_contiguous():
            _library.op("broadcast")(x, src, coll.group_name(self.group), self._impl("broadcast", x, src))
            return x
        buf = x.contiguous()
        _library.op("broadcast")(buf, src, coll.group_name(self.group), self._impl("broadcast", buf, src))
        return x.copy_(buf)

    def broadcast_tensor_dict(self, tensor_dict: Optional[dict] = None, src: int = 0) -> dict:
        """Rank ``src``'s ``tensor_dict`` on every rank, as vLLM's ``broadcast_tensor_dict`` gives it:
        a serving engine's driver handing its workers the batch's inputs.

        On ``src``, ``tensor_dict`` maps keys to tensors (on the CPU or the communicator's device)
        and to other values (pickled: ints, lists, dataclasses); it is returned as it is. The other
        ranks pass nothing (what they pass is not read) and get a new dict of the same keys, in the
        same order: the other values unpickled, and each tensor of the same dtype, shape and
        device type (the communicator's device for a GPU one), contiguous, a view of one buffer
        per device type. What moves: a header and the pickled description from ``src``, then one
        broadcast per device type for all the tensors' bytes. A ``tensor_dict`` ``src`` cannot
        send is its ``ValueError`` there and a ``RuntimeError`` carrying it on every other rank,
        before any tensor moves. Not inside a CUDA graph capture (the receivers read the
        description on the host).
        """
        self._rank("src", src)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("Communicator.broadcast_tensor_dict: not capturable in a CUDA graph (the receivers "
                               "read what is sent on the host); broadcast outside the captured region")
        self._agree("broadcast_tensor_dict", self.device, lambda: None, lambda _: f"src {src}")
        me = self.rank_in_group == src
        if self.world_size == 1:
            _pack(tensor_dict, self.device)  # the checks alone
            return tensor_dict
        route = coll.host_route(self.group, self.device)
        host = route[0] if route[1].type == "cpu" else None  # the group that carries host tensors, if any
        if me:
            try:
                description, tensors = _pack(tensor_dict, self.device)
                header = (0, description)
            except ValueError as exc:
                header = (1, str(exc).encode())
            self._send_bytes(header, src, *route)
            if header[0]:
                raise ValueError(header[1].decode())
        else:
            status, payload = self._receive_bytes(src, *route)
            if status:
                raise RuntimeError(f"Communicator.broadcast_tensor_dict: rank {src}, the source, could not send its "
                                   f"tensor_dict, so nothing moved ({payload.decode(errors='replace')})")
            described = pickle.loads(payload)
            tensors = {}
            for key, (kind, *rest) in described:
                if kind == "tensor":
                    tensors.setdefault(rest[2], []).append((rest[1], rest[0]))  # (shape, dtype) by device type
        out = {} if not me else tensor_dict
        received: Dict[str, List[torch.Tensor]] = {}
        for device_type in sorted(tensors):
            received[device_type] = self._broadcast_tensors(tensors[device_type], me, device_type, src, host)
        if me:
            return out
        arrived = {device_type: iter(ts) for device_type, ts in received.items()}
        for key, (kind, *rest) in described:
            out[key] = next(arrived[rest[2]]) if kind == "tensor" else rest[0]
        return out

    def _send_bytes(self, header: Tuple[int, bytes], src: int, group, device: torch.device) -> None:
        status, payload = header
        coll.broadcast(torch.tensor([status, len(payload)], dtype=torch.int64, device=device), src, group).wait()
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        coll.broadcast(data.to(device), src, group).wait()

    def _receive_bytes(self, src: int, group, device: torch.device) -> Tuple[int, bytes]:
        status, size = coll.broadcast(torch.empty(2, dtype=torch.int64, device=device), src, group).wait().tolist()
        payload = coll.broadcast(torch.empty(size, dtype=torch.uint8, device=device), src, group).wait()
        return status, payload.cpu().numpy().tobytes()

    def _broadcast_tensors(self, tensors, me: bool, device_type: str, src: int, host) -> List[torch.Tensor]:
        """All of one device type's tensors in one broadcast of their bytes: sent from ``src``
        (``tensors`` its tensors), received elsewhere (``tensors`` their (shape, dtype))."""
        shapes_dtypes = [(t.shape, t.dtype) for t in tensors] if me else tensors
        offsets, size = _layout(shapes_dtypes)
        on_host = device_type == "cpu" and host is not None
        group, device = (host, torch.device("cpu")) if on_host else (self.group, self.device)
        alone = me and len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].device == device
        if alone:  # sent as it is, no copy
            buffer = tensors[0].detach().reshape(-1).view(torch.uint8)
        else:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if me and not alone:
            for t, offset in zip(tensors, offsets):
                n = t.numel() * t.element_size()
                if n:
                    buffer[offset : offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        coll.broadcast(buffer, src, group).wait()
        if me:
            return list(tensors)
        if device_type == "cpu" and buffer.device.type != "cpu":
            buffer = buffer.cpu()
        return [buffer[offset : offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
                for (shape, dtype), offset in zip(shapes_dtypes, offsets)]

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to rank ``dst``, which calls :meth:`recv` with its shape and dtype. Bounded
        by the timeout; with fingerprints on, agreed with ``dst`` alone (two ranks take part)."""
        self._rank("dst", dst, other=True)
        x_ = agree_pair("Communicator.send", self.group, dst, "send", lambda: self._tensor("x", x), self._message,
                        hint=x).contiguous()
        impl = dispatch.resolve_collective("send", self.backend, x_, self.group, dst)
        backends.run_collective("send", impl, x_, None, dst, self.group)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        """A new tensor of ``shape`` and ``dtype`` on the communicator's device, received from rank
        ``src`` (which calls :meth:`send`). With fingerprints on, agreed with ``src`` first."""
        self._rank("src", src, other=True)

        def check() -> torch.Tensor:
            try:
                size = torch.Size(shape)
            except TypeError as exc:
                raise ValueError(f"shape: expected a sequence of ints, got {shape!r}") from exc
            if any(s < 0 for s in size):
                raise ValueError(f"shape: expected sizes >= 0, got {list(size)}")
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
            return torch.empty(size, dtype=dtype, device=self.device)

        out = agree_pair("Communicator.recv", self.group, src, "recv", check, self._message, hint=self.device)
        impl = dispatch.resolve_collective("recv", self.backend, out, self.group, src)
        return backends.run_collective("recv", impl, None, out, src, self.group)

    # --- CUDA graphs ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self, max_bytes: int = CAPTURE_BYTES):
        """Make, with every rank, what a CUDA graph capture of this communicator's calls needs and
        cannot make itself: the group's NCCL communicator and its peer-memory workspace, checked
        and grown to hold a fused all-reduce of up to ``max_bytes`` (where those paths may run).
        Then capture inside it, as with vLLM's ``capture()``::

            with comm.capture():
                with torch.cuda.graph(graph):
                    y = comm.all_reduce(x)

        The fused all-reduce copies its input into the workspace as a node of the graph, so no
        tensor needs registering. A size class ``"auto"`` has not measured yet runs its first
        candidate inside a capture (nothing is measured there): call each size once before
        capturing for the measured choice.
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes: expected a positive int, got {max_bytes!r}")
        if self.device.type == "cuda":
            paths = dispatch.capture_paths(self.backend, torch.empty(1, device=self.device), self.group)
            backends.prepare_capture(paths, self.group, self.device, max_bytes)
        yield self

    # --- helpers --------------------------------------------------------------------------------

    def _dim0(self, collective: str, x: torch.Tensor, d: int, peer: int = -1) -> torch.Tensor:
        """``collective`` over dim 0 of ``x`` with a leading dim of 1: ``[p, ...]``, rank-major."""
        stacked_in = x.unsqueeze(0).contiguous()
        impl = self._impl(collective, stacked_in, peer)
        name = coll.group_name(self.group)
        if collective == "gather":
            return _library.op("gather")(stacked_in, peer, name, impl)
        return _library.op("all_gather")(stacked_in, name, impl)

    def _undo_dim0(self, stacked: torch.Tensor, d: int) -> torch.Tensor:
        """``[p, *shape]`` (rank-major) as ``shape`` with dim ``d`` p times as long."""
        d %= stacked.dim() - 1
        return coll.join_stacked(stacked, d) if d else stacked.flatten(0, 1)


def _shape_but(x: torch.Tensor, d: int) -> str:
    """``x``'s shape with dim ``d`` as ``*`` (its size differs from rank to rank), and dtype."""
    return f"[{', '.join('*' if i == d else str(n) for i, n in enumerate(x.shape))}] " \
           f"{str(x.dtype).rpartition('.')[2]} {x.device.type}"


#: (group key) -> (group, Communicator) for the module functions
_tp_communicators: dict = {}


def tensor_parallel_communicator() -> Communicator:
    """The communicator of the tensor-parallel group (see :class:`Communicator`'s ``group=None``)
    on the current device, made on first use."""
    group = coll.resolve_group(None)
    device = _default_device(group)
    key = coll.group_key(group, device)  # (the entry keeps the group: its id is not reused meanwhile)
    entry = _tp_communicators.get(key)
    if entry is None:
        entry = _tp_communicators[key] = (group, Communicator(group, device=device))
    return entry[1]


@parallel_state.on_group_destroyed
def _forget(group) -> None:
    for key in [k for k, (g, _) in _tp_communicators.items() if g is group]:
        del _tp_communicators[key]


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """:meth:`Communicator.all_reduce` over the tensor-parallel group."""
    return tensor_parallel_communicator().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """:meth:`Communicator.all_gather` over the tensor-parallel group."""
    return tensor_parallel_communicator().all_gather(x, dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> Optional[torch.Tensor]:
    """:meth:`Communicator.gather` over the tensor-parallel group (None off ``dst``)."""
    return tensor_parallel_communicator().gather(x, dst, dim)


def tensor_model_parallel_reduce_scatter(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """:meth:`Communicator.reduce_scatter` over the tensor-parallel group, along the last dim by
    default, as vLLM's is."""
    return tensor_parallel_communicator().reduce_scatter(x, dim)


def broadcast_tensor_dict(tensor_dict: Optional[dict] = None, src: int = 0) -> dict:
    """:meth:`Communicator.broadcast_tensor_dict` over the tensor-parallel group."""
    return tensor_parallel_communicator().broadcast_tensor_dict(tensor_dict, src)
