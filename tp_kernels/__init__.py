"""tp_kernels: tensor-parallel linear layers for PyTorch with communication overlapped.

Public API (see docs/api.md):

* process groups: :func:`initialize_model_parallel` and the ``get_*`` accessors;
* :mod:`tp_kernels.settings`: every ``TP_KERNELS_*`` switch; here :func:`set_timeout` (every
  collective) and :func:`set_comm_stream_priority` (the native backend's communication
  stream); :func:`extension_status`;
* :mod:`tp_kernels.autotune`: what ``backend="auto"`` chooses among, and its measurements;
* :mod:`tp_kernels.mappings`: Megatron's communication mappings;
* :mod:`tp_kernels.ops`: :func:`all_gather_matmul`, :func:`matmul_reduce_scatter`,
  :func:`matmul_all_reduce` on any backend;
* :class:`Communicator` (:mod:`tp_kernels.communicator`): the plain collectives serving engines
  call, each on its fastest path, and :func:`tensor_model_parallel_all_reduce` & co. and
  :func:`broadcast_tensor_dict`;
* layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy`,
  :func:`vocab_parallel_entropy`, :func:`vocab_parallel_argmax`, :func:`vocab_parallel_topk`,
  :func:`vocab_parallel_sample`, :func:`parallelize` (a Hugging Face model's ``tp_plan`` too;
  a mixture's expert weights by :func:`tp_kernels.experts.shard_experts`; under sequence
  parallelism by :func:`sequence_parallel_plan`),
  and for training :func:`allreduce_sequence_parallel_grads`, :func:`clip_grad_norm_`,
  :func:`full_state_dict`, :func:`load_full_state_dict`, :func:`sharded_state_dict` and the
  optimizer's (:func:`sharded_optimizer_state_dict`, :func:`load_sharded_optimizer_state_dict`),
  and :func:`dense_state_dict` to read such a checkpoint as the dense model's;
* :mod:`tp_kernels.rng`: dropout alike on every rank where they hold the same activations and
  each rank's own where they hold their own (:func:`model_parallel_manual_seed`,
  :func:`get_rng_tracker`), and ``rng.checkpoint``, activation checkpointing that replays it;
* :mod:`tp_kernels.testing`: the harnesses that test and measure it on one machine.

docs/architecture.md draws the layers of the package and follows a call through them.
"""

from . import _torch_version  # noqa: F401  (first: an ImportError where the torch is older than required)
from . import autotune, communicator, experts, mappings, ops, rng, schedule, settings
from ._extension import extension_status
from .settings import get_timeout, set_comm_stream_priority, set_timeout
from .cross_entropy import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_sample,
    vocab_parallel_topk,
)
from .communicator import (
    Communicator,
    broadcast_tensor_dict,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
    tensor_model_parallel_reduce_scatter,
)
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .ops import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from .parallel_state import (
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from .checkpoints import (
    dense_state_dict,
    full_state_dict,
    load_full_state_dict,
    load_sharded_optimizer_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)
from .grads import allreduce_sequence_parallel_grads, clip_grad_norm_
from ._sequence_plan import sequence_parallel_plan
from .parallelize import parallelize
from .rng import get_rng_tracker, model_parallel_manual_seed

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinear",
    "Communicator",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_matmul",
    "allreduce_sequence_parallel_grads",
    "autotune",
    "broadcast_tensor_dict",
    "clip_grad_norm_",
    "communicator",
    "dense_state_dict",
    "destroy_model_parallel",
    "experts",
    "extension_status",
    "full_state_dict",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_rng_tracker",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_timeout",
    "initialize_model_parallel",
    "load_full_state_dict",
    "load_sharded_optimizer_state_dict",
    "mappings",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "model_parallel_is_initialized",
    "model_parallel_manual_seed",
    "ops",
    "parallelize",
    "rng",
    "schedule",
    "sequence_parallel_plan",
    "set_comm_stream_priority",
    "set_timeout",
    "settings",
    "sharded_optimizer_state_dict",
    "sharded_state_dict",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_sample",
    "vocab_parallel_topk",
]
