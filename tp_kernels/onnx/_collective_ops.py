"""The collective nodes of tp_kernels' per-rank ONNX models: ONNX Runtime's, defined once.

ONNX Runtime's distributed (NCCL) builds run ``AllReduce`` and ``AllGather`` in the
``com.microsoft`` domain (``onnxruntime/core/graph/contrib_ops/collective_defs.cc``):
``AllReduce`` sums over the runtime's ranks and has no attribute; ``AllGather`` concatenates
along ``axis`` and says how many ranks take part in ``group_size``. ``ReduceScatter`` (the sum,
keeping this rank's block of ``axis``) has the same attributes as ``AllGather``; ONNX Runtime's
inference builds have no kernel for it (its training builds had one of another name), so a model
that contains one runs where a runtime provides it, e.g. :func:`tp_kernels.onnx.cpu_session`.

A per-rank model made by :func:`tp_kernels.onnx.export` or :func:`tp_kernels.onnx.shard` for a
group of several ranks also says, in its ``metadata_props`` (which runtimes ignore), the size of
the group (:data:`GROUP_SIZE_KEY`) and its rank there (:data:`RANK_KEY`): the nodes cannot say
which rank's shards they hold, and an ``AllReduce`` not even over how many ranks. (A model for one
rank has no collectives and no shards, and says nothing.)
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import onnx

__all__ = ["DOMAIN", "GROUP_SIZE_KEY", "OPS", "RANK_KEY", "VERSION", "made_for", "stamp"]

DOMAIN = "com.microsoft"
VERSION = 1
#: op type -> its attributes (all ints), in the order ONNX Runtime's schema lists them
OPS: Dict[str, Tuple[str, ...]] = {
    "AllReduce": (),
    "AllGather": ("group_size", "axis"),
    "ReduceScatter": ("group_size", "axis"),
}

#: The metadata keys of a per-rank model: the size of the group it was made for, its rank there.
GROUP_SIZE_KEY, RANK_KEY = "tp_kernels.group_size", "tp_kernels.rank"


def stamp(model: onnx.ModelProto, group_size: int, rank: int) -> None:
    """Write into ``model``'s metadata that it is rank ``rank``'s model of a group of ``group_size``
    (replacing what it said before)."""
    given = {GROUP_SIZE_KEY: str(group_size), RANK_KEY: str(rank)}
    kept = [(p.key, p.value) for p in model.metadata_props if p.key not in given]
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, dict(kept, **given))


def made_for(model: onnx.ModelProto) -> Optional[Tuple[int, int]]:
    """``(group_size, rank)`` as :func:`stamp` wrote them in ``model``, or None where it says
    neither; a ``ValueError`` naming the key where one is missing or not a rank of the group."""
    props = {p.key: p.value for p in model.metadata_props}
    if GROUP_SIZE_KEY not in props and RANK_KEY not in props:
        return None
    values = []
    for key in (GROUP_SIZE_KEY, RANK_KEY):
        try:
            values.append(int(props[key]))
        except (KeyError, ValueError):
            raise ValueError(f"model: its metadata {key!r} is {props.get(key)!r}, not an int (a per-rank model "
                             f"says both {GROUP_SIZE_KEY!r} and {RANK_KEY!r})") from None
    size, rank = values
    if not 0 <= rank < size:
        raise ValueError(f"model: its metadata says rank {rank} of a group of {size} ({RANK_KEY!r}, "
                         f"{GROUP_SIZE_KEY!r}), which is no rank of it")
    return size, rank
