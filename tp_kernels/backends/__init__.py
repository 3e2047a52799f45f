"""Implementations of the three primitives behind one interface.

Each backend module provides, on 2-D contiguous-or-not tensors and without autograd:

* ``all_gather_matmul(x, weight, bias, group, num_chunks) -> (out, gathered_x)``
  ``(m/p, k) -(AG)-> (m, k) x (k, n/p) -> (m, n/p)``; ``gathered_x`` is ``AG(x)``.
* ``matmul_reduce_scatter(x, weight, bias, group, num_chunks) -> Pending``
  ``(m, k/p) x (k/p, n) -(RS)-> (m/p, n)``, bias added once after the reduction.
* ``matmul_all_reduce(x, weight, bias, group, num_chunks) -> Pending``
  ``(m, k/p) x (k/p, n) -(AR)-> (m, n)``, bias added once after the reduction.

``weight`` is ``(n_out, k)`` as in ``F.linear`` and may be a transposed view. The reductions
return a :class:`tp_kernels._comm.Pending` so that callers can overlap unrelated work (the
weight gradient) with the tail of the communication before calling ``wait()``.

``fused`` (:mod:`.fused`) runs on CUDA tensors of a group inside one node only, over peer
memory. The user-facing names are ``BACKENDS``. ``IMPLEMENTATIONS`` adds ``"native"``: the
``pipelined`` schedule in the native extension, which :func:`tp_kernels.ops.select_backend`
picks for CUDA tensors (it is not a name users pass).
"""

from . import fused, native, pipelined, reference

BACKENDS = {"reference": reference, "pipelined": pipelined, "fused": fused}
IMPLEMENTATIONS = {**BACKENDS, "native": native}
