"""tp_kernels.Communicator on gloo ranks, p in {1, 2, 4}: every method against torch.distributed
itself on odd shapes, every dim and several dtypes; bad inputs named on every rank before anything
moves; ranks that disagree raise together (fingerprints on); the custom ops under opcheck and
torch.compile (the calls that write into a tensor too); the module functions on the
tensor-parallel group. The GPU paths are test_gpu.py's.

The ``check_*`` functions run on every rank and take the device, so that the GPU suite runs them
on CUDA tensors too.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import tp_kernels
from helpers import assert_close, fingerprints_set, rank_world
from test_disagreement import DEADLINE_S, fingerprints
from tp_kernels import Communicator, autotune, dispatch, settings
from tp_kernels._collectives import group_name, resolve_group

SHAPE = (3, 5, 7)  # odd: nothing divisible by anything
DTYPES = [torch.float32, torch.float64, torch.int64, torch.complex64]  # complex: moved, not summed


def _data(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        wide = torch.complex128 if dtype.is_complex else torch.float64
        return torch.randn(shape, generator=g, dtype=wide).to(device, dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(device, dtype)


def _torch_all_gather(x, dim):
    p = dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _torch_sum(x):
    s = x.clone()
    dist.all_reduce(s)
    return s


def _same(name, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype} != {want.shape} " \
                                                                  f"{want.dtype}"
    assert got.device == want.device, f"{name}: on {got.device}, not {want.device}"
    assert torch.equal(got, want), f"{name}: differs from torch.distributed by {(got - want).abs().max().item()}"


def _sum_matches(name, got, x, want, exact, reduce=lambda t: t):
    """A sum over the ranks: the same bits as torch.distributed's ``want`` where ``exact`` (gloo
    against gloo) or for integers; else (another algorithm or library on the GPU) against the
    float64 sum of every rank's ``x`` (gathered exactly), ``reduce`` of it, within plain
    PyTorch's own error (helpers.assert_close)."""
    if exact or not got.dtype.is_floating_point:
        _same(name, got, want)
        return
    p = dist.get_world_size()
    terms = _torch_all_gather(x.unsqueeze(0), 0).double()
    assert_close(name, got, reduce(terms.sum(0)), want, terms=p, summed=reduce(terms.abs().sum(0)))


def check_against_torch_distributed(backend="auto", device="cpu", dtypes=DTYPES):
    """Every method, every dim, on each rank's own data, against torch.distributed: the same bits
    on the CPU; on the GPU the data moved bit for bit and the sums within their rounding."""
    r, p = rank_world()
    comm = Communicator(backend=backend, device=device)
    assert (comm.rank_in_group, comm.world_size) == (r, p)
    exact = device == "cpu"
    for dtype in dtypes:
        x = _data(SHAPE, dtype, device, seed=10 * r + 1)
        name = f"{dtype} p={p}"
        # the fused path sums the dtypes of _C.DTYPES only (backend="fused" raises for the others);
        # a complex tensor is moved, never summed (the sums reject it: test_bad_inputs_are_named_on_every_rank)
        sums = not dtype.is_complex and (backend != "fused" or dtype in (torch.float32, torch.float16, torch.bfloat16))
        if sums:
            y = comm.all_reduce(x)
            _sum_matches(f"all_reduce {name}", y, x, _torch_sum(x), exact)
            assert y.data_ptr() != x.data_ptr(), "all_reduce returned x's memory"  # (a new tensor, one rank too)
            out = torch.empty_like(x)
            assert comm.all_reduce(x, out=out) is out
            _sum_matches(f"all_reduce out= {name}", out, x, _torch_sum(x), exact)
            inplace = x.clone()
            assert comm.all_reduce(inplace, out=inplace) is inplace
            _sum_matches(f"all_reduce in place {name}", inplace, x, _torch_sum(x), exact)
            strided = x.transpose(0, 2)
            _sum_matches(f"all_reduce strided {name}", comm.all_reduce(strided), strided,
                         _torch_sum(strided.contiguous()), exact)
        for dim in range(-len(SHAPE), len(SHAPE)):
            want = _torch_all_gather(x, dim)
            _same(f"all_gather dim {dim} {name}", comm.all_gather(x, dim=dim), want)
            for dst in {0, p - 1}:
                got = comm.gather(x, dst=dst, dim=dim)
                if r == dst:
                    _same(f"gather dim {dim} to {dst} {name}", got, want)
                else:
                    assert got is None, f"gather: rank {r} is not the destination {dst}, got a tensor"
            if not sums:
                continue
            y = _data(SHAPE[:dim % 3] + (SHAPE[dim % 3] * p,) + SHAPE[dim % 3 + 1:], dtype, device, seed=r + 100)
            # torch's reduce-scatter of dim `dim`, as its functional reduce_scatter_tensor scatters
            # one: over the dim's blocks stacked first (gloo's ring sums each element in an order
            # that depends on where it lies in the buffer)
            want = _torch_sum(y.unflatten(dim, (p, -1)).movedim(dim % 3, 0).contiguous())[r]
            _sum_matches(f"reduce_scatter dim {dim} {name}", comm.reduce_scatter(y, dim=dim), y, want, exact,
                         lambda t, d=dim: t.chunk(p, dim=d)[r])
        for src in {0, p - 1}:
            b = x.clone()
            assert comm.broadcast(b, src=src) is b
            want = x.clone()
            dist.broadcast(want, src=src)
            _same(f"broadcast from {src} {name}", b, want)
            strided = x.clone().transpose(0, 1)  # a strided tensor is written in place too
            assert comm.broadcast(strided, src=src) is strided
            _same(f"broadcast strided from {src} {name}", strided, want.transpose(0, 1))
        if p > 1:  # a ring: each rank sends to the next and receives from the previous
            nxt, prv = (r + 1) % p, (r - 1) % p
            if r % 2 == 0:
                comm.send(x, nxt)
                got = comm.recv(SHAPE, dtype, prv)
            else:
                got = comm.recv(SHAPE, dtype, prv)
                comm.send(x, nxt)
            _same(f"recv from {prv} {name}", got, _data(SHAPE, dtype, device, seed=10 * prv + 1))


def check_vectors_scalars_and_empty_tensors(device="cpu"):
    r, p = rank_world()
    comm = Communicator(device=device)
    v = torch.arange(7.0, device=device) + r
    _same("all_reduce of a vector", comm.all_reduce(v), _torch_sum(v))
    s = torch.tensor(float(r + 1), device=device)
    _same("all_reduce of a 0-d tensor", comm.all_reduce(s), torch.tensor(p * (p + 1) / 2, device=device))
    _same("all_gather of a vector", comm.all_gather(v), _torch_all_gather(v, 0))
    for shape, dim in (((0, 3), 0), ((2, 0), -1), ((0, 4 * p), 1)):
        e = torch.empty(shape, device=device)
        assert comm.all_reduce(e).shape == e.shape
        assert comm.all_gather(e, dim=dim).shape == e.shape[:dim % 2] + (e.shape[dim % 2] * p,) + e.shape[dim % 2 + 1:]
    assert comm.reduce_scatter(torch.empty(0, 4 * p, device=device), dim=1).shape == (0, 4)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_every_method_matches_torch_distributed(world):
    world.run(check_against_torch_distributed, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("world", [1, 2], indirect=True)
@pytest.mark.parametrize("backend", ["reference", "pipelined"])
def test_every_method_matches_torch_distributed_on_named_backends(world, backend):
    world.run(check_against_torch_distributed, backend, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_vectors_scalars_and_empty_tensors(world):
    world.run(check_vectors_scalars_and_empty_tensors, deadline_s=DEADLINE_S)


def check_variable_sizes(device="cpu"):
    """``all_gatherv`` and ``reduce_scatterv`` along dims 0, 1 and -1, with sizes that differ from
    rank to rank (some 0; all 0 on one rank) and equal ones, in int64 and float64 (integer values:
    every sum exact): the gathered tensor is every rank's joined in rank order, and each rank's
    block of the sum is its ``sizes[r]`` elements, exactly, on every rank."""
    r, p = rank_world()
    comm = Communicator(device=device)
    for sizes in ([i % 3 for i in range(p)], [2] * p):
        for dim in (0, 1, -1):
            for dtype in (torch.int64, torch.float64):
                def data(rank, size):
                    shape = list(SHAPE)
                    shape[dim] = size
                    g = torch.Generator().manual_seed(100 * rank + size)
                    return torch.randint(-1000, 1000, shape, generator=g).to(device, dtype)

                what = f"sizes {sizes} dim {dim} {dtype}"
                got = comm.all_gatherv(data(r, sizes[r]), sizes, dim=dim)
                _same(f"all_gatherv {what}", got, torch.cat([data(q, n) for q, n in enumerate(sizes)], dim))
                got = comm.reduce_scatterv(data(r, sum(sizes)), sizes, dim=dim)
                total = sum(data(q, sum(sizes)) for q in range(p))
                _same(f"reduce_scatterv {what}", got, total.split(sizes, dim)[r].contiguous())
                assert got.is_contiguous(), what


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_variable_sizes(world):
    world.run(check_variable_sizes, deadline_s=DEADLINE_S)


# --- bad inputs: the same on every rank, so every rank raises its own ValueError ---------------------

#: (call on a communicator, the ValueError's message); every rank makes the same bad call
BAD_CALLS = [
    (lambda c, p: c.all_reduce(torch.ones(3, dtype=torch.bool)), r"x: expected a real number dtype to sum"),
    (lambda c, p: c.all_reduce(torch.ones(3, device="meta")), r"x: expected a tensor on cpu .* got one on meta"),
    (lambda c, p: c.all_reduce([1.0, 2.0]), r"x: expected a torch.Tensor, got list"),
    (lambda c, p: c.all_reduce(torch.ones(3), out=torch.ones(4)), r"out: expected a contiguous \[3\] torch.float32"),
    (lambda c, p: c.all_reduce(torch.ones(3), out=torch.ones(3, dtype=torch.float64)), r"out: expected .*float32 .*got \[3\] torch.float64"),
    (lambda c, p: c.all_reduce(torch.ones(2, 3), out=torch.ones(3, 2).t()), r"out: expected a contiguous .* strided"),
    (lambda c, p: (lambda t: c.all_reduce(t[:2], out=t[1:]))(torch.ones(3)), r"out: shares memory with x"),
    (lambda c, p: c.all_gather(torch.ones(2, 3), dim=2), r"dim: expected a dim of x \[2, 3\] \(in \[-2, 1\]\), got 2"),
    (lambda c, p: c.all_gather(torch.ones(2, 3), dim=-3),
     r"dim: expected a dim of x \[2, 3\] \(in \[-2, 1\]\), got -3"),
    (lambda c, p: c.all_gather(torch.ones(2, 3), dim=1.0), r"dim: expected an int, got 1.0"),
    (lambda c, p: c.all_gather(torch.ones(2, 3), dim=True), r"dim: expected an int, got True"),
    (lambda c, p: c.all_gather(torch.tensor(1.0)), r"x: expected a tensor with a dim .* got a 0-d"),
    (lambda c, p: c.gather(torch.ones(2), dst=p), r"dst: expected a rank of the group's \d+, got \d+"),
    (lambda c, p: c.gather(torch.ones(2), dst=-1), r"dst: expected a rank of the group's \d+, got -1"),
    (lambda c, p: c.reduce_scatter(torch.ones(2, 3 * p + 1), dim=1),
     r"x: dim 1 of \[2, \d+\] \(\d+\) is not divisible by the group's \d+ ranks"),
    (lambda c, p: c.reduce_scatter(torch.ones(2, dtype=torch.complex64)), r"x: expected a real number dtype"),
    (lambda c, p: c.all_gatherv(torch.ones(2, 3), [2] * (p + 1)), r"sizes: expected a list of \d+ non-negative ints"),
    (lambda c, p: c.all_gatherv(torch.ones(2, 3), [-1] + [2] * (p - 1)), r"sizes: expected a list of .*got \[-1"),
    (lambda c, p: c.all_gatherv(torch.ones(2, 3), [True] + [2] * (p - 1)), r"sizes: expected a list of .*got \[True"),
    (lambda c, p: c.all_gatherv(torch.ones(2, 3), [3] * p, dim=1.0), r"dim: expected an int, got 1.0"),
    (lambda c, p: c.all_gatherv(torch.ones(2, 3), [2] * p, dim=1),
     r"x: dim 1 of \[2, 3\] is 3, but sizes\[\d\] \(this rank's\) is 2"),
    (lambda c, p: c.reduce_scatterv(torch.ones(2, 3), [2] * p, dim=1), r"x: dim 1 of \[2, 3\] is 3, but sizes \[2.*\] sum to \d"),
    (lambda c, p: c.reduce_scatterv(torch.ones(p, dtype=torch.bool), [1] * p), r"x: expected a real number dtype"),
    (lambda c, p: c.broadcast(torch.ones(2), src=p), r"src: expected a rank of the group's \d+, got \d+"),
    (lambda c, p: c.broadcast(torch.ones(2), src=True), r"src: expected a rank of the group's \d+, got True"),
    (lambda c, p: c.send(torch.ones(2), dst=dist.get_rank()), r"dst: expected (another rank|a rank)"),
    (lambda c, p: c.recv((2,), torch.float32, src=dist.get_rank()), r"src: expected (another rank|a rank)"),
    (lambda c, p: c.recv((2, -1), torch.float32, src=(dist.get_rank() + 1) % p), r"shape: expected sizes >= 0|src:"),
    (lambda c, p: c.recv((2,), "float32", src=(dist.get_rank() + 1) % p), r"dtype: expected a torch.dtype|src:"),
]


class Batch:
    """A value that is not a tensor, as an engine's batch metadata is: sent pickled."""

    def __init__(self, lengths, prefill):
        self.lengths, self.prefill = lengths, prefill

    def __eq__(self, other):
        return isinstance(other, Batch) and (self.lengths, self.prefill) == (other.lengths, other.prefill)


def _tensor_dict(device, seed):
    """Every kind of entry: dtypes of every size (bool, complex, half), a strided view, a 0-d and
    an empty tensor, host tensors beside the device's, and values that are not tensors."""
    ids = _data((4, 6), torch.int64, device, seed)
    return {
        "ids": ids,
        "positions": ids[:, 1::2],  # strided
        "hidden": _data((3, 5), torch.bfloat16, device, seed + 1),
        "mask": _data((7,), torch.int64, device, seed + 2) > 0,
        "rotary": _data((2, 3), torch.complex64, device, seed + 3),
        "scale": _data((), torch.float64, device, seed + 4),
        "none_yet": torch.empty(0, 9, device=device),
        "lengths_on_host": _data((5,), torch.int32, "cpu", seed + 5),
        "batch": Batch([3, 1, 4], prefill=True),
        "step": 17,
        "nothing": None,
    }


def check_broadcast_tensor_dict(device="cpu"):
    """Rank src's dict on every rank: each tensor of its dtype, shape and device type, bit for bit,
    contiguous; the other values equal; the keys in order; the source's own dict returned as it is;
    one tensor alone (sent without a copy); an empty dict; the module function on the
    tensor-parallel group."""
    r, p = rank_world()
    comm = Communicator(device=device)
    for src in sorted({0, p - 1}):
        sent = _tensor_dict(comm.device, seed=10 * src)
        got = comm.broadcast_tensor_dict(sent if r == src else None, src=src)
        if r == src:
            assert got is sent
            continue
        assert list(got) == list(sent)
        for key, value in sent.items():
            if isinstance(value, torch.Tensor):
                assert got[key].is_contiguous() and got[key].device.type == value.device.type, key
                if value.device.type != "cpu":
                    assert got[key].device == comm.device, key
                _same(key, got[key], value)
            else:
                assert got[key] == value, key
    alone = _data((3, 4), torch.float32, comm.device, seed=7)
    got = comm.broadcast_tensor_dict({"x": alone} if r == 0 else {"x": torch.zeros(1)}, src=0)
    _same("a tensor alone", got["x"], alone)
    assert got["x"] is alone if r == 0 else got["x"].data_ptr() != alone.data_ptr()
    assert comm.broadcast_tensor_dict({} if r == 0 else None) == {}
    assert tp_kernels.communicator.broadcast_tensor_dict({"step": 3} if r == 0 else None) == {"step": 3}


@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_broadcast_tensor_dict(world):
    world.run(check_broadcast_tensor_dict)


def check_broadcast_tensor_dict_the_source_cannot_send(with_fingerprints: bool):
    """A dict the source cannot send (not a dict, a value that does not pickle, a sparse tensor, a
    tensor on another device than the CPU and the communicator's) is its ValueError naming the
    entry, and on every other rank a RuntimeError carrying it, before any tensor moves (on one
    rank, where nothing moves, the same ValueError); a src out of range is a ValueError
    everywhere; the group works after."""
    r, p = rank_world()
    comm = Communicator()
    with fingerprints_set(with_fingerprints):
        for bad, message in [([torch.ones(2)], "tensor_dict: expected a dict on the source rank, got list"),
                             ({"x": torch.ones(2), "f": lambda: 0}, "tensor_dict['f']: a value that is not a "
                                                                    "tensor travels pickled, and this one cannot be"),
                             ({"s": torch.eye(2).to_sparse()}, "tensor_dict['s']: expected a dense"),
                             ({"x": torch.ones(2), "m": torch.ones(2, device="meta")},
                              "tensor_dict['m']: expected a tensor on the CPU or on cpu (the communicator's device), "
                              "got one on meta")]:
            if r == 0:
                with pytest.raises(ValueError, match=re.escape(message)):
                    comm.broadcast_tensor_dict(bad)
            else:
                with pytest.raises(RuntimeError, match=re.escape("rank 0, the source, could not send its tensor_dict, "
                                                                 f"so nothing moved ({message}")):
                    comm.broadcast_tensor_dict()
            with pytest.raises(ValueError, match=f"src: expected a rank of the group's {p}, got {p}"):
                comm.broadcast_tensor_dict({}, src=p)
            assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(p)))


@pytest.mark.parametrize("with_fingerprints", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)
def test_broadcast_tensor_dict_the_source_cannot_send(world, with_fingerprints):
    world.run(check_broadcast_tensor_dict_the_source_cannot_send, with_fingerprints, deadline_s=DEADLINE_S)


def test_a_cuda_device_without_an_index_is_the_current_one(monkeypatch):
    """``device="cuda"`` is the current CUDA device (the communicator compares the tensors'
    devices with it, and a tensor's CUDA device always has an index)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert Communicator(device="cuda").device == torch.device("cuda", 3)
    assert Communicator(device="cuda:1").device == torch.device("cuda", 1)


def check_bad_calls(with_fingerprints: bool):
    r, p = rank_world()
    comm = Communicator()
    with fingerprints_set(with_fingerprints):
        for i, (call, message) in enumerate(BAD_CALLS):
            if p == 1 and "divisible" in message:
                continue  # every size divides among one rank
            with pytest.raises(ValueError, match=message):
                call(comm, p)
            y = comm.all_reduce(torch.full((2,), float(r)))  # the group still works, and right
            assert torch.equal(y, torch.full((2,), p * (p - 1) / 2)), f"after bad call {i}"


@pytest.mark.parametrize("with_fingerprints", [False, True])
@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_bad_inputs_are_named_on_every_rank(world, with_fingerprints):
    world.run(check_bad_calls, with_fingerprints, deadline_s=DEADLINE_S)


def check_dtypes_gloo_does_not_carry():
    """A host tensor of a dtype gloo does not move (int16, the unsigned ints, float8), which gloo
    takes and fails only when the work runs, as a dead peer would, is a ValueError on every rank
    before anything is sent, for every collective, a mapping and send/recv; the group works after."""
    r, p = rank_world()
    comm = Communicator()
    calls = {
        "all_reduce": lambda t: comm.all_reduce(t),
        "all_gather": lambda t: comm.all_gather(t),
        "gather": lambda t: comm.gather(t),
        "reduce_scatter": lambda t: comm.reduce_scatter(t),
        "broadcast": lambda t: comm.broadcast(t),
        "mapping": lambda t: tp_kernels.mappings.gather_from_tensor_model_parallel_region(t),
        "send/recv": lambda t: comm.send(t, 1) if r == 0 else comm.recv(t.shape, t.dtype, 0) if r == 1 else None,
    }
    for dtype in (torch.int16, torch.uint16, torch.float8_e4m3fn):
        for name, call in calls.items():
            if name == "send/recv" and r > 1:
                continue
            with pytest.raises(ValueError, match=f"gloo, the group's backend for host tensors, does not carry {dtype}"):
                call(torch.zeros(2 * p, 3).to(dtype))
                pytest.fail(f"{name} of {dtype} did not raise")
    assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(p)))


@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_dtypes_gloo_does_not_carry_are_refused_before_anything_moves(world):
    world.run(check_dtypes_gloo_does_not_carry)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"backend: expected one of .*'auto'.*got 'nccl'"):
        Communicator(backend="nccl")
    with pytest.raises(ValueError, match=r"device: expected a torch.device or a device string, got 'gpu0'"):
        Communicator(device="gpu0")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=rf"max_bytes: expected a positive int, got {bad}"):
            with Communicator().capture(max_bytes=bad):
                pass


# --- ranks that disagree (fingerprints on): every rank raises, nothing hangs ------------------------

#: what rank 1 does differently: (its call, the error other ranks get)
DISAGREEMENTS = {
    "shape": lambda c, r: c.all_reduce(torch.ones(3 if r == 1 else 4)),
    "dtype": lambda c, r: c.all_gather(torch.ones(4, dtype=torch.float64 if r == 1 else torch.float32)),
    "dim": lambda c, r: c.all_gather(torch.ones(2, 2), dim=0 if r == 1 else 1),
    "root": lambda c, r: c.broadcast(torch.ones(2), src=1 if r == 1 else 0),
    "collective": lambda c, r: c.all_reduce(torch.ones(2)) if r == 1 else c.broadcast(torch.ones(2)),
    "bad on one rank": lambda c, r: c.reduce_scatter(torch.ones(5 if r == 1 else 4 * dist.get_world_size())),
    "sizes": lambda c, r: c.all_gatherv(torch.ones(1, 2), [2 if q != r and r == 1 else 1
                                                           for q in range(dist.get_world_size())]),
    "dict root": lambda c, r: c.broadcast_tensor_dict({"x": torch.ones(2)}, src=1 if r == 1 else 0),
    # the path: another backend, or auto with other candidates (which would measure while the others ran)
    "backend": lambda c, r: (Communicator(backend="reference") if r == 1 else c).all_reduce(torch.ones(2)),
    "auto settings": lambda c, r: _apart(r, lambda: c.all_gather(torch.ones(4))),
}


def _apart(r, call):
    """``call()``, on rank 1 with "auto" choosing among other candidates than the others'."""
    with settings.overriding(**({"auto_candidates": ("pipelined", "reference")} if r == 1 else {})):
        return call()


@fingerprints
def check_disagreement(what):
    r, p = rank_world()
    comm = Communicator()
    try:
        DISAGREEMENTS[what](comm, r)
    except (ValueError, RuntimeError) as exc:
        kind, message = type(exc).__name__, str(exc)
    else:
        raise AssertionError(f"rank {r}: no error, though rank 1 disagreed on the {what}")
    if what == "bad on one rank":
        if r == 1:
            assert kind == "ValueError" and "not divisible" in message, message
        else:
            assert kind == "RuntimeError" and "rank 1: x: dim 0" in message, message
    else:
        assert kind == "RuntimeError" and "disagree on this call" in message and "rank 1" in message, message
    y = comm.all_reduce(torch.ones(2))  # the group still works, and right
    assert torch.equal(y, torch.full((2,), float(p)))
    return message if what != "bad on one rank" else None


@pytest.mark.parametrize("what", sorted(DISAGREEMENTS))
@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_ranks_that_disagree_all_raise(world, what):
    messages = world.run(check_disagreement, what, deadline_s=DEADLINE_S)
    if what != "bad on one rank":
        assert len(set(messages)) == 1, messages  # the same message on every rank


#: what ranks 0 (sends) and 1 (receives) do, disagreeing: (rank 0's call, rank 1's call)
P2P_DISAGREEMENTS = {
    "more sent": (lambda c: c.send(_ones(c, 5), dst=1), lambda c: c.recv((4,), torch.float32, src=0)),
    "less sent": (lambda c: c.send(_ones(c, 4), dst=1), lambda c: c.recv((5,), torch.float32, src=0)),
    "dtype": (lambda c: c.send(_ones(c, 4), dst=1), lambda c: c.recv((4,), torch.int32, src=0)),
    "shape": (lambda c: c.send(_ones(c, 2, 3), dst=1), lambda c: c.recv((3, 2), torch.float32, src=0)),
    "both send": (lambda c: c.send(_ones(c, 4), dst=1), lambda c: c.send(_ones(c, 4), dst=0)),
    "bad at one end": (lambda c: c.send(_ones(c, 4), dst=1), lambda c: c.recv((-4,), torch.float32, src=0)),
    "backend": (lambda c: c.send(_ones(c, 4), dst=1),
                lambda c: Communicator(backend="reference").recv((4,), torch.float32, src=0)),
}


def _ones(comm, *shape):
    return torch.ones(shape, device=comm.device)


@fingerprints
def check_p2p_disagreement(what):
    """A send and a recv that disagree (gloo killed the receiver of the larger message; a larger
    or otherwise typed receive read garbage): both ends raise before the payload moves, the
    same message where they disagree, and the group goes on. Other ranks take no part."""
    r, p = rank_world()
    comm = Communicator()
    message = None
    if r < 2:
        try:
            P2P_DISAGREEMENTS[what][r](comm)
        except (ValueError, RuntimeError) as exc:
            kind, message = type(exc).__name__, str(exc)
        else:
            raise AssertionError(f"rank {r}: no error, though the ends disagreed ({what})")
        if what == "bad at one end":
            want = ("RuntimeError", "rank 1, its peer, rejected its arguments") if r == 0 else ("ValueError", "shape")
            assert kind == want[0] and want[1] in message, message
            message = None
        else:
            assert kind == "RuntimeError" and "disagree on a message, so nothing moved" in message, message
    y = comm.all_reduce(_ones(comm, 2))  # the group still works, and right
    assert torch.equal(y, torch.full((2,), float(p), device=comm.device))
    if r < 2:  # and a good pair goes through
        sent = torch.arange(6.0, device=comm.device)
        got = comm.send(sent, dst=1) if r == 0 else comm.recv((6,), torch.float32, src=0)
        assert r == 0 or torch.equal(got, sent)
    return message


@pytest.mark.parametrize("what", sorted(P2P_DISAGREEMENTS))
@pytest.mark.parametrize("world", [2, 4], indirect=True)
def test_send_and_recv_that_disagree_both_raise(world, what):
    messages = world.run(check_p2p_disagreement, what, deadline_s=DEADLINE_S)
    if what != "bad at one end":
        assert messages[0] == messages[1] and all(m is None for m in messages[2:]), messages

# --- the module functions, on the tensor-parallel group -------------------------------------------


def check_tensor_model_parallel_functions():
    r, p = rank_world()
    tp_kernels.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tp = tp_kernels.get_tensor_model_parallel_group()
        tr = tp_kernels.get_tensor_model_parallel_rank()
        x = torch.full((2, 3), float(r))
        peer = r + 1 if tr == 0 else r - 1  # the other rank of this rank's tensor-parallel pair
        _same("tensor_model_parallel_all_reduce", tp_kernels.tensor_model_parallel_all_reduce(x),
              torch.full((2, 3), float(r + peer)))
        pair = [x, torch.full((2, 3), float(peer))] if tr == 0 else [torch.full((2, 3), float(peer)), x]
        _same("tensor_model_parallel_all_gather", tp_kernels.tensor_model_parallel_all_gather(x),
              torch.cat(pair, dim=-1))
        got = tp_kernels.tensor_model_parallel_gather(x, dst=1, dim=0)
        assert (got is None) == (tr != 1)
        if got is not None:
            _same("tensor_model_parallel_gather", got, torch.cat(pair, dim=0))
        wide = torch.arange(12.0).view(3, 4) * (r + 1)
        pair_sum = torch.arange(12.0).view(3, 4) * (r + 1 + peer + 1)
        _same("tensor_model_parallel_reduce_scatter", tp_kernels.tensor_model_parallel_reduce_scatter(wide),
              pair_sum[:, 2 * tr : 2 * tr + 2])  # the last dim by default, as vLLM's
        sent = tp_kernels.broadcast_tensor_dict({"x": x, "n": 1} if tr == 1 else None, src=1)
        _same("broadcast_tensor_dict", sent["x"], x if tr == 1 else torch.full((2, 3), float(peer)))
        comm = tp_kernels.communicator.tensor_parallel_communicator()
        assert comm.group is tp and comm is tp_kernels.communicator.tensor_parallel_communicator()
    finally:
        tp_kernels.destroy_model_parallel()
    # forgotten with the groups (the default group's, another test's, stays)
    assert all(group is not tp for group, _ in tp_kernels.communicator._tp_communicators.values())


def test_tensor_model_parallel_functions(world4):
    world4.run(check_tensor_model_parallel_functions, deadline_s=DEADLINE_S)


# --- the decision: torch.distributed on the CPU; what "fused" says there; measuring ----------------


def check_decisions_on_the_cpu():
    r, p = rank_world()
    group = resolve_group(None)
    x = torch.ones(8)
    for collective in ("all_reduce", "all_gather", "broadcast"):
        for backend in ("auto", "reference", "pipelined"):
            assert dispatch.resolve_collective(collective, backend, x, group) == "reference"
        kinds, why = dispatch.collective_candidates(collective, x, group)
        assert kinds == ["reference"] and (p == 1 or why), (kinds, why)
        # "pipelined" named: a lone collective has no portable schedule to stand in for NCCL's
        with settings.overriding(auto_candidates=("pipelined", "reference")):
            kinds, why = dispatch.collective_candidates(collective, x, group)
        assert kinds == ["reference"] and (p == 1 or any(w.startswith("pipelined: ") for w in why)), (kinds, why)
    if p > 1:
        with pytest.raises(ValueError, match=r"backend: 'fused' cannot run all_reduce .*not on a CUDA device"):
            dispatch.resolve_collective("all_reduce", "fused", x, group)
        with pytest.raises(ValueError, match=r"backend: 'fused' cannot run all_reduce"):
            Communicator(backend="fused").all_reduce(x)
    assert dispatch.capture_paths("auto", x, group) == []


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_decisions_on_the_cpu(world):
    world.run(check_decisions_on_the_cpu, deadline_s=DEADLINE_S)


def check_measured_collective():
    """choose_collective measures its variants on scratch tensors, alike on every rank, and keeps
    the decision for the size class (two reference variants stand in for the GPU's paths)."""
    r, p = rank_world()
    group = resolve_group(None)
    autotune.forget()
    x = torch.full((100,), float(r))
    before = x.clone()
    choice = autotune.choose_collective("all_reduce", ["reference", "reference"], x, group)
    assert choice == "reference" and torch.equal(x, before)  # measuring does not touch the call's tensors
    (d,) = autotune.decisions()
    assert (d.op, d.m_class, d.n, d.k, d.p, len(d.times_s)) == ("all_reduce", 128, 0, 0, p, 2)
    assert all(t > 0 for t in d.times_s)
    assert autotune.choose_collective("all_reduce", ["reference", "reference"], torch.ones(128), group) == choice
    assert len(autotune.decisions()) == 1  # the same size class: measured once
    # a broadcast is measured on a scratch output, so its input stays
    autotune.choose_collective("broadcast", ["reference", "reference"], x, group, 0)
    assert torch.equal(x, before)
    times = autotune.decisions()[-1].times_s
    # a broadcast from another root is another class, measured again; a gather is measured into a
    # scratch output on its root alone (the other ranks receive nothing)
    autotune.choose_collective("broadcast", ["reference", "reference"], x, group, 1)
    autotune.choose_collective("gather", ["reference", "reference"], x, group, 0)
    assert [(d.op, d.m_class) for d in autotune.decisions()] == [("all_reduce", 128), ("broadcast", 128),
                                                                 ("broadcast", 128), ("gather", 128)]
    assert torch.equal(x, before)
    # under a torch.func transform nothing is measured (its tensors are the transform's wrappers,
    # of no storage a native path could read): the first variant, unremembered
    autotune.forget()
    chosen = []
    torch.func.vmap(lambda t: chosen.append(autotune.choose_collective("all_reduce", ["reference", "native:1"], t,
                                                                       group)) or t)(torch.ones(2, 64))
    assert chosen == ["reference"] and autotune.decisions() == []
    autotune.forget()
    return times


def test_measured_collective(world2):
    per_rank = world2.run(check_measured_collective, deadline_s=DEADLINE_S)
    assert per_rank[0] == per_rank[1]  # the slowest rank's figures, on every rank


# --- custom ops: opcheck and torch.compile ----------------------------------------------------------


def check_opcheck_collectives():
    r, p = rank_world()
    group = group_name(dist.group.WORLD)
    ops = torch.ops.tp_kernels
    x = torch.randn(2 * p, 3, generator=torch.Generator().manual_seed(r))
    cases = [
        (ops.all_reduce, (x, group, "reference")),
        (ops.all_reduce_out, (x, torch.empty_like(x), group, "reference")),
        (ops.all_reduce_inplace, (x.clone(), group, "reference")),
        (ops.all_gather, (x, group, "reference")),
        (ops.reduce_scatter, (x, group, "reference")),
        (ops.gather, (x, 0, group, "reference")),
        (ops.broadcast, (x.clone(), 0, group, "reference")),
    ]
    # a strided input: each op's output is a new contiguous tensor, its fake's too
    strided = torch.randn(3, 2 * p, generator=torch.Generator().manual_seed(r)).t()
    cases += [(op, (strided, group, "reference")) for op in (ops.all_reduce, ops.all_gather, ops.reduce_scatter)]
    for op, args in cases:
        torch.library.opcheck(op, args)
    # an op writing a strided tensor is refused (its values would stay as they were), eagerly and
    # while torch.compile traces it
    writes = [("out", lambda t: ops.all_reduce_out(x, t, group, "reference")),
              ("x", lambda t: ops.all_reduce_inplace(t, group, "reference")),
              ("x", lambda t: ops.broadcast(t, 0, group, "reference"))]
    for name, call in writes:
        for run in (call, torch.compile(call, backend="aot_eager", fullgraph=True)):
            kept = strided.clone()
            with pytest.raises(Exception, match=rf"{name}: the tensor the op writes must be contiguous, got shape "
                                                rf"\[{2 * p}, 3\] with strides \[1, {2 * p}\]"):
                run(kept)
            assert torch.equal(kept, strided)
        torch._dynamo.reset()


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_opcheck_collectives(world):
    world.run(check_opcheck_collectives, deadline_s=DEADLINE_S)


def check_compiled_communicator(device="cpu"):
    r, p = rank_world()
    comm = Communicator(device=device)

    def step(x):
        y = comm.all_reduce(x * 2)
        comm.all_reduce(y, out=y)  # in place: an op that writes into its argument
        out = torch.empty_like(y)
        comm.all_reduce(y - 1, out=out)  # into another tensor
        z = comm.all_gather(y + out, dim=-1)
        sizes = [q % 2 + 1 for q in range(p)]  # (rows that differ from rank to rank)
        v = comm.reduce_scatterv(comm.all_gatherv(y[:sizes[r]], sizes) * 3, sizes)
        return comm.reduce_scatter(z.relu(), dim=-1) + 1, v

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(r)).to(device)
    eager = step(x)
    torch._dynamo.reset()
    targets = []

    def record(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(step, backend=record, fullgraph=True)(x)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    ops = torch.ops.tp_kernels
    if p == 1:  # nothing to communicate: no op of ours in the graph (Communicator._alone)
        assert not any("tp_kernels" in str(t) for t in targets), targets
        return
    assert {ops.all_reduce, ops.all_gather, ops.reduce_scatter} <= set(targets), targets  # one node each
    assert all(any(name in str(t) for t in targets) for name in ("all_reduce_inplace", "all_reduce_out")), targets


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_compiled_communicator_matches_eager(world):
    world.run(check_compiled_communicator, deadline_s=600)


def check_compiled_collectives_run_on_every_rank(requires_grad: bool):
    """A compiled collective whose result one rank does not use still runs there (its peers wait
    for it): Communicator.gather off the root, and results kept on one rank only, were dropped from
    the compiled graph as dead code, and the root waited until the timeout."""
    r, p = rank_world()
    comm = Communicator()
    x = torch.randn(2 * p, 3, generator=torch.Generator().manual_seed(r)).requires_grad_(requires_grad)

    def kept_on_rank_0(result, t):  # every rank called the collective; rank 0 alone uses its result
        return result if r == 0 else t + 1

    calls = [
        lambda t: comm.gather(t, dst=p - 1, dim=0),
        lambda t: kept_on_rank_0(comm.all_reduce(t), t),
        lambda t: kept_on_rank_0(comm.all_gather(t, dim=0)[:1], t),
        lambda t: kept_on_rank_0(comm.reduce_scatter(t, dim=0), t),
        lambda t: (lambda u: (comm.all_reduce(u, out=u), t)[1])(t * 2),  # writes into a temporary
    ]
    for i, call in enumerate(calls):
        torch._dynamo.reset()
        want, got = call(x), torch.compile(call, fullgraph=True)(x)
        assert (got is None and want is None) or torch.equal(got, want), i
    assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(p)))  # in step


@pytest.mark.parametrize("requires_grad", [False, True])
def test_compiled_collectives_run_on_every_rank(world2, requires_grad):
    world2.run(check_compiled_collectives_run_on_every_rank, requires_grad, deadline_s=600)


def check_writes_are_seen_by_autograd():
    """A Communicator call that writes into a tensor (``out``, in place, ``broadcast``) bumps its
    version counter, as torch's in-place ops do, whether it runs through the dispatcher or not:
    autograd then refuses a backward that would read the overwritten values."""
    r, p = rank_world()
    comm = Communicator()
    x, out = torch.ones(2, 3), torch.empty(2, 3)
    for name, call, written in [("out", lambda: comm.all_reduce(x, out=out), out),
                                ("in place", lambda: comm.all_reduce(x, out=x), x),
                                ("broadcast", lambda: comm.broadcast(x, src=0), x)]:
        version = written._version
        call()
        assert written._version > version, name
    w = torch.ones(3, requires_grad=True)
    saved = torch.full((3,), 2.0)
    loss = (w * saved).sum()  # saves `saved` for w's gradient
    comm.all_reduce(saved, out=saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.inference_mode():  # inference tensors have no version counter
        t = torch.ones(2)
        comm.all_reduce(t, out=t)
    assert torch.equal(t, torch.full((2,), float(p)))


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_writes_are_seen_by_autograd(world):
    world.run(check_writes_are_seen_by_autograd, deadline_s=DEADLINE_S)


def check_collectives_refuse_gradients(compiled: bool):
    """Every Communicator call on a tensor that wants a gradient (inference without
    ``torch.no_grad()``) returns what it returns without one, eagerly and compiled; a backward
    through it raises on every rank, naming the call, where one that wrote (``out``, in place,
    ``broadcast``) was silently the identity and ``all_gather``'s failed inside the collective (and,
    compiled on torch 2.11 and 2.12, what a call wrote kept its history: the identity again, or no
    gradient at all for ``out``). An ``out`` that records a gradient, written with the sum of an
    ``x`` that records none, gives its overwritten values none, as ``out.copy_`` would."""
    r, p = rank_world()
    comm = Communicator()
    calls = {
        "all_reduce": lambda t: comm.all_reduce(t),
        "all_reduce into out": lambda t: comm.all_reduce(t, out=torch.empty_like(t)),
        "all_reduce in place": lambda t: (lambda u: comm.all_reduce(u, out=u))(t * 1),
        "all_gather": lambda t: comm.all_gather(t, dim=-1),
        "gather": lambda t: comm.gather(t, dst=p - 1, dim=0),
        "reduce_scatter": lambda t: comm.reduce_scatter(t, dim=0),
        "broadcast": lambda t: comm.broadcast(t * 1, src=0),
        "broadcast of a strided tensor": lambda t: comm.broadcast((t * 1).t(), src=0),
        "tensor_model_parallel_all_reduce": lambda t: tp_kernels.tensor_model_parallel_all_reduce(t),
    }
    for name, call in calls.items():
        leaf = torch.randn(2 * p, 3, generator=torch.Generator().manual_seed(r)).requires_grad_()
        with torch.no_grad():
            want = call(leaf * 2)
        if compiled:
            torch._dynamo.reset()
            call = torch.compile(call, fullgraph=True)
        got = call(leaf * 2)
        if got is None:  # gather off the root
            assert want is None, name
            continue
        assert torch.equal(got.detach(), want), name
        assert got.requires_grad, name  # not detached: a loss over it would lose its gradient silently
        called = name.split(" ")[0].replace("tensor_model_parallel_all_reduce", "all_reduce")
        with pytest.raises(RuntimeError, match=f"Communicator.{called} has no gradient"):
            got.sum().backward()
        assert leaf.grad is None, name
    x = torch.full((2 * p, 3), float(r + 1))
    write = (lambda t: comm.all_reduce(x, out=t * 1))
    leaf = torch.randn(2 * p, 3, generator=torch.Generator().manual_seed(r)).requires_grad_()
    got = (torch.compile(write, fullgraph=True) if compiled else write)(leaf)
    assert got.requires_grad and torch.equal(got.detach(), torch.full_like(x, p * (p + 1) / 2))
    got.sum().backward()
    assert torch.equal(leaf.grad, torch.zeros_like(leaf))  # overwritten: not the identity's ones
    assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(p)))  # the group goes on


@pytest.mark.parametrize("world", [1, 2], indirect=True)
@pytest.mark.parametrize("compiled", [
    pytest.param(False, id="eager"),
    pytest.param(True, id="compiled"),
])
def test_collectives_refuse_gradients(world, compiled):
    world.run(check_collectives_refuse_gradients, compiled, deadline_s=600)


def check_one_decision_per_call():
    """Each call resolves its implementation once, and its custom op runs that one; with one rank,
    a call without a gradient neither decides nor runs an op (Communicator._alone), one with a
    gradient wanted runs its op (whose backward refuses it)."""
    from tp_kernels import _library

    r, p = rank_world()
    comm = Communicator()
    resolved, ran = [], []
    original_resolve, original_run = dispatch.resolve_collective, _library.run_collective

    def resolve(*args, **kwargs):
        resolved.append(original_resolve(*args, **kwargs))
        return resolved[-1]

    def run(collective, impl, *args):
        ran.append(impl)
        return original_run(collective, impl, *args)

    dispatch.resolve_collective, _library.run_collective = resolve, run
    try:
        x = torch.ones(2 * p, 3)
        calls = [lambda: comm.all_reduce(x), lambda: comm.all_reduce(x, out=torch.empty_like(x)),
                 lambda: comm.all_reduce(x.clone(), out=None), lambda: (lambda y: comm.all_reduce(y, out=y))(x.clone()),
                 lambda: comm.all_gather(x, dim=1), lambda: comm.gather(x, dst=0, dim=0),
                 lambda: comm.reduce_scatter(x, dim=0), lambda: comm.broadcast(x.clone(), src=0)]
        for i, call in enumerate(calls):
            resolved.clear(), ran.clear()
            call()
            assert (len(resolved) == 1 and ran == resolved) if p > 1 else not (resolved or ran), (i, resolved, ran)
        resolved.clear(), ran.clear()
        comm.all_reduce(x.clone().requires_grad_())
        assert len(resolved) == 1 and ran == resolved, (resolved, ran)
    finally:
        dispatch.resolve_collective, _library.run_collective = original_resolve, original_run


@pytest.mark.parametrize("world", [1, 2], indirect=True)
def test_a_communicator_call_is_decided_once(world):
    world.run(check_one_decision_per_call, deadline_s=DEADLINE_S)
