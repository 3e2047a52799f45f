"""Tensor-, pipeline- and data-parallel process groups with Megatron's rank layout.

With ``W`` ranks, tensor-parallel size ``t`` and pipeline size ``q`` (data-parallel size
``d = W / (t*q)``):

* tensor-parallel groups are runs of ``t`` consecutive ranks;
* pipeline groups are ranks ``i, i + W/q, i + 2W/q, ...`` for ``i < W/q``;
* data-parallel groups take, inside each pipeline stage's block of ``W/q`` ranks, every
  ``t``-th rank.

Example, 8 ranks, t=2, q=2: TP [0,1] [2,3] [4,5] [6,7]; PP [0,4] [1,5] [2,6] [3,7];
DP [0,2] [1,3] [4,6] [5,7].

A group whose backend moves only device tensors (NCCL) gets a *host twin* here, a gloo group of
the same ranks (:func:`host_group`), for the small host-side exchanges of its calls (their
fingerprints, :mod:`tp_kernels._agreement`): over the twin they never wait for the GPU, as
PyTorch's own collective fingerprinting (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) uses a gloo helper.

This module sits at the bottom of tp_kernels and imports none of it but its settings. What the
layers above make per group (NCCL communicators, peer-memory workspaces, measured choices) they register a
teardown for with :func:`on_group_destroyed`; :func:`destroy_model_parallel` calls those before
destroying each group.
"""

from __future__ import annotations

import datetime
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from .settings import fingerprints_enabled, get_timeout

__all__ = [
    "destroy_model_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "host_group",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "on_group_destroyed",
    "rank_layout",
    "tensor_model_parallel_group_or_none",
]

_TENSOR_MODEL_PARALLEL_GROUP = None
_PIPELINE_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None
_ALL_GROUPS: List = []
_TEARDOWNS: List[Callable[[object], None]] = []
#: id(group) -> (group, its host twin): made by initialize_model_parallel for the tensor-parallel
#: groups, or by host_group for the default group (the group is kept, so its id is not reused)
_HOST_TWINS: Dict[int, tuple] = {}


def on_group_destroyed(teardown: Callable[[object], None]) -> Callable[[object], None]:
    """Register ``teardown(group)``, called (in registration order) for each group that
    :func:`destroy_model_parallel` destroys, before torch destroys it. A teardown frees what its
    module made for the group and must not raise. Returns ``teardown`` (usable as a decorator)."""
    _TEARDOWNS.append(teardown)
    return teardown


def host_backend(group=None) -> str:
    """The backend ``group`` (default: the world) moves host tensors with: ``"gloo"`` for gloo or
    the host side of ``"cpu:gloo,cuda:nccl"``; ``""`` where it has none (NCCL)."""
    if hasattr(dist, "get_backend_config"):
        for entry in dist.get_backend_config(group).split(","):
            device, _, backend = entry.partition(":")
            if device == "cpu":
                return backend
        return ""
    backend = str(dist.get_backend(group))
    return backend if backend in ("gloo", "mpi", "ucc") else ""


def carries_host_tensors(group=None) -> bool:
    """Whether ``group`` (default: the world) has a backend for host tensors (:func:`host_backend`);
    an NCCL group has not."""
    return host_backend(group) != ""


def _new_group(ranks: List[int], backend=None, pg_options=None):
    """``dist.new_group(ranks, backend, pg_options)``, made by every rank of the world (as
    ``new_group`` requires), with :func:`tp_kernels.get_timeout` as the group's own timeout: the
    bound NCCL's watchdog puts on its collectives (``new_group`` would give it torch's default
    instead, 10 minutes for NCCL and 30 for gloo, whatever the world's). Every group tp_kernels
    makes is made here."""
    return dist.new_group(ranks, backend=backend, pg_options=pg_options,
                          timeout=datetime.timedelta(seconds=get_timeout()))


def _twin(ranks: List[int]):
    """A gloo group of ``ranks`` (:func:`_new_group`)."""
    return _new_group(ranks, backend="gloo")


def host_group(group):
    """The group over which ``group``'s ranks exchange small host tensors without waiting for
    their GPUs: ``group`` itself when it carries host tensors (:func:`carries_host_tensors`),
    else its host twin, a gloo group of the same ranks: made by :func:`initialize_model_parallel`
    for the tensor-parallel groups when fingerprints are on then, or here, on the first call, for
    the default group (every rank of the world is in that call). None for another group without a
    host backend: its exchanges run on this rank's GPU."""
    if carries_host_tensors(group):
        return group
    entry = _HOST_TWINS.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    if group is dist.group.WORLD:
        _HOST_TWINS[id(group)] = (group, _twin(list(range(dist.get_world_size()))))
        return _HOST_TWINS[id(group)][1]
    return None


def rank_layout(world_size: int, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1):
    """The rank lists of every TP, PP and DP group, as ``(tp, pp, dp)`` lists of lists.

    Pure function (no communication); :func:`initialize_model_parallel` creates these groups.
    """
    t, q, w = tensor_model_parallel_size, pipeline_model_parallel_size, world_size
    for name, v in (
        ("world_size", w),
        ("tensor_model_parallel_size", t),
        ("pipeline_model_parallel_size", q),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if w % (t * q):
        raise ValueError(
            f"tensor_model_parallel_size ({t}) x pipeline_model_parallel_size ({q}) = {t * q} "
            f"does not divide the world size {w}"
        )
    stage = w // q  # ranks per pipeline stage
    tp = [list(range(i * t, (i + 1) * t)) for i in range(w // t)]
    pp = [list(range(i, w, stage)) for i in range(stage)]
    dp = [list(range(s * stage + j, (s + 1) * stage, t)) for s in range(q) for j in range(t)]
    return tp, pp, dp


#: How many times this process has asked for an agreed layout (the store keys of each time).
_agreements = 0


def _agree_on_layout(world: int, rank: int, view: str, error: Optional[Exception]) -> None:
    """Every rank of the world posts the layout it asks for (or its error) to the default group's
    store, and waits for all the others' within :func:`tp_kernels.get_timeout`: no collective, so
    this is bounded whatever the backend. Raises on every rank unless they all ask for the same."""
    from torch.distributed import distributed_c10d

    global _agreements
    _agreements += 1
    store = distributed_c10d._get_default_store()
    keys = [f"tp_kernels/initialize_model_parallel/{_agreements}/{q}" for q in range(world)]
    store.set(keys[rank], f"error: {error}" if error is not None else view)
    timeout = get_timeout()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # the store's timeout error, whatever its type in this torch
        missing = [q for q, key in enumerate(keys) if not store.check([key])]
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
        raise RuntimeError(
            f"initialize_model_parallel: {who} did not arrive within {timeout:g} s; every rank of the "
            "world must call it (the limit is tp_kernels.set_timeout() or TP_KERNELS_TIMEOUT_S)") from exc
    views = [store.get(key).decode() for key in keys]
    if error is not None:
        raise error
    failed = [(q, v) for q, v in enumerate(views) if v.startswith("error: ")]
    if failed:
        listing = "; ".join(f"rank {q}: {v[len('error: '):]}" for q, v in failed)
        raise RuntimeError(f"initialize_model_parallel: a rank rejected its arguments, so no group was made ({listing})")
    if len(set(views)) > 1:
        listing = "; ".join(f"rank {q}: {v}" for q, v in enumerate(views))
        raise RuntimeError(f"initialize_model_parallel: the ranks disagree on the layout, so no group was made "
                           f"({listing})")


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Create the TP, PP and DP groups (Megatron layout, see the module docstring).

    Call on every rank after ``torch.distributed.init_process_group``. The ranks first agree on
    the sizes, bounded by :func:`tp_kernels.get_timeout`: sizes that differ between ranks, a size
    wrong on one rank, or a rank that does not arrive raise ``RuntimeError`` on every rank that
    did, saying which. Afterwards every tp_kernels API given ``group=None`` runs on this rank's
    tensor-parallel group. Each group's own timeout (the bound NCCL's watchdog puts on its
    collectives) is :func:`tp_kernels.get_timeout` at this call.
    """
    global _TENSOR_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "initialize_model_parallel: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first"
        )
    if model_parallel_is_initialized():
        raise RuntimeError("initialize_model_parallel: already initialized; call destroy_model_parallel() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    error = layouts = None
    try:
        layouts = rank_layout(world, tensor_model_parallel_size, pipeline_model_parallel_size)
    except ValueError as exc:
        error = exc
    _agree_on_layout(world, rank, f"tensor_model_parallel_size={tensor_model_parallel_size}, "
                                  f"pipeline_model_parallel_size={pipeline_model_parallel_size}", error)
    mine = []
    # Twins only where fingerprints will use them (the setting and the world's backend are the
    # same on every rank): a gloo group costs its connections, and a network gloo cannot use.
    twins = fingerprints_enabled() and not carries_host_tensors()
    # Every rank creates every group, in the same order, as new_group requires.
    for kind, ranks_lists in enumerate(layouts):
        own = None
        for ranks in ranks_lists:
            g = _new_group(ranks)
            twin = _twin(ranks) if twins and kind == 0 and len(ranks) > 1 else None
            if rank in ranks:
                own = g
                _ALL_GROUPS.append(g)
                if twin is not None:
                    _HOST_TWINS[id(g)] = (g, twin)
        mine.append(own)
    _TENSOR_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP = mine


def model_parallel_is_initialized() -> bool:
    return _TENSOR_MODEL_PARALLEL_GROUP is not None


def destroy_model_parallel() -> None:
    """Destroy the groups made by :func:`initialize_model_parallel` (no-op if there are none)."""
    global _TENSOR_MODEL_PARALLEL_GROUP, _PIPELINE_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    groups = list(_ALL_GROUPS)
    _ALL_GROUPS.clear()
    _TENSOR_MODEL_PARALLEL_GROUP = _PIPELINE_MODEL_PARALLEL_GROUP = _DATA_PARALLEL_GROUP = None
    for g in groups:
        for teardown in _TEARDOWNS:
            teardown(g)
    twins = [_HOST_TWINS.pop(id(g))[1] for g in groups if id(g) in _HOST_TWINS]
    if dist.is_available() and dist.is_initialized():
        for g in twins + groups:
            dist.destroy_process_group(g)


def _require(group, kind: str):
    if group is None:
        raise RuntimeError(f"the {kind} group is not set: call initialize_model_parallel() first")
    return group


def tensor_model_parallel_group_or_none():
    """The tensor-parallel group of :func:`initialize_model_parallel`, or None before it."""
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_tensor_model_parallel_group():
    """This rank's TP group; the default group if :func:`initialize_model_parallel` was never called."""
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _TENSOR_MODEL_PARALLEL_GROUP
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    raise RuntimeError("torch.distributed is not initialized: there is no tensor-parallel group")


def get_pipeline_model_parallel_group():
    return _require(_PIPELINE_MODEL_PARALLEL_GROUP, "pipeline-parallel")


def get_data_parallel_group():
    return _require(_DATA_PARALLEL_GROUP, "data-parallel")


def _size(group: Optional[object]) -> int:
    return dist.get_world_size(group)


def get_tensor_model_parallel_world_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return _size(get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(get_tensor_model_parallel_group())


def get_pipeline_model_parallel_world_size() -> int:
    return _size(get_pipeline_model_parallel_group())


def get_pipeline_model_parallel_rank() -> int:
    return dist.get_rank(get_pipeline_model_parallel_group())


def get_data_parallel_world_size() -> int:
    return _size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(get_data_parallel_group())
