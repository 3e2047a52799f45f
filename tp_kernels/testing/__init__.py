"""Harnesses for testing and measuring tp_kernels without a multi-GPU machine.

* :class:`World` (:mod:`.world`): local processes with ``torch.distributed`` initialized,
  spawned once and reused across many checks; a failure or a silent rank ends it with every
  rank's traceback instead of a hang.
* :class:`VirtualRanks` (:mod:`.virtual_ranks`): p ranks of the fused path driven by one process
  on one GPU.
"""

from .virtual_ranks import VirtualRanks, phase_order
from .world import World, WorkerError, default_backend, join_torchrun, launched_by_torchrun

__all__ = ["VirtualRanks", "World", "WorkerError", "default_backend", "join_torchrun", "launched_by_torchrun",
           "phase_order"]
