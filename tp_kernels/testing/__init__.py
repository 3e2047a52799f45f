"""Harnesses for testing and measuring tp_kernels without a multi-GPU machine.

* :class:`World` (:mod:`.world`): local processes with ``torch.distributed`` initialized,
  spawned once and reused across many checks; a failure or a silent rank ends it with every
  rank's traceback instead of a hang. Several NCCL ranks share one GPU with
  ``env=ONE_GPU_RANKS_ENV, cuda_device=0``.
* :class:`VirtualRanks` (:mod:`.virtual_ranks`): p ranks of the fused path driven by one process
  on one GPU.
"""

from .virtual_ranks import VirtualRanks, forked, phase_order, rank_order_sum
from .world import ONE_GPU_RANKS_ENV, World, WorkerError, default_backend, join_torchrun, launched_by_torchrun

__all__ = ["ONE_GPU_RANKS_ENV", "VirtualRanks", "World", "WorkerError", "default_backend", "forked",
           "join_torchrun", "launched_by_torchrun", "phase_order", "rank_order_sum"]
