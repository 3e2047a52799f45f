"""The Python/C++ boundary: every tensor crosses as a torch.Tensor read into a TensorRef in one place
(``arg`` in csrc/bindings.cpp, named after the native function's parameter; tests pass TensorRefs
made by hand) and is checked once, in C++ (csrc/boundary.cpp), with errors that name the argument,
before any CUDA call. So all of it runs here, without a GPU: the tensors are host memory
described as if on cuda:0 (nothing is dereferenced), and `linear_problem` / `primitive_problem`
return what the core would receive.
"""

from __future__ import annotations

import pytest
import torch

from tp_kernels import _extension, schedule

pytestmark = pytest.mark.skipif(_extension._C is None, reason="the native module is not built")
C = _extension._C


def ref(name, t, device=0):
    """``t`` (host memory) described as a tensor on cuda:``device``: checks only, never read."""
    return C.TensorRef(name, t.data_ptr(), list(t.shape), list(t.stride()), _extension.dtype_name(t.dtype), device)


def empty(name, shape, dtype="bfloat16", device=0):
    """A tensor with no elements and a null data pointer, as torch gives for empty tensors."""
    strides, s = [], 1
    for d in reversed(shape):
        strides.insert(0, s)
        s *= max(d, 1)
    return C.TensorRef(name, 0, list(shape), strides, dtype, device)



def workspace():
    return ref("workspace", torch.empty(64, dtype=torch.uint8))


def linear(x, w, bias=None, out=None, **refs):
    out = torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype) if out is None else out
    args = dict(x=ref("x", x), weight=ref("weight", w), bias=None if bias is None else ref("bias", bias),
                out=ref("out", out), workspace=workspace())
    args.update(refs)
    return C.linear_problem(**args)


def test_the_gemm_of_contiguous_operands():
    x, w, b = torch.randn(6, 40, dtype=torch.bfloat16), torch.randn(24, 40, dtype=torch.bfloat16), torch.randn(24)
    got = linear(x, w, b.bfloat16())
    assert {k: got[k] for k in ("m", "n", "k", "ldx", "ldw", "ldy", "w_col_major", "batch", "dtype", "has_bias")} == {
        "m": 6, "n": 24, "k": 40, "ldx": 40, "ldw": 40, "ldy": 24, "w_col_major": False, "batch": 1,
        "dtype": "bfloat16", "has_bias": True}
    assert got["workspace_bytes"] == 64


def test_timing_cublaslt_candidates_checks_its_arguments_before_any_cuda_call():
    """``gemm_candidates`` (the benchmarks' timing of cuBLASLt's algorithms for one problem): the
    tensors as ``linear`` checks them, then how many algorithms and runs and how long a wait, then a
    problem with work, each error naming its argument, before anything reaches CUDA (here, where
    there is none)."""
    x, w = torch.randn(6, 40, dtype=torch.bfloat16), torch.randn(24, 40, dtype=torch.bfloat16)
    good = dict(x=ref("x", x), weight=ref("weight", w), bias=None, out=ref("out", torch.empty(6, 24, dtype=x.dtype)),
                workspace=workspace(), stream=0, count=8, iters=5, timeout_s=30.0)
    with pytest.raises(ValueError, match=r"^weight: "):
        C.gemm_candidates(**dict(good, weight=ref("weight", torch.randn(24, 41, dtype=torch.bfloat16))))
    for bad, message in ((dict(count=0), r"^count: gemm_candidates takes 1 to 32 algorithms, got 0"),
                         (dict(count=33), r"^count: .* got 33"),
                         (dict(iters=0), r"^iters: gemm_candidates runs each algorithm at least once, got 0"),
                         (dict(timeout_s=0.0), r"^timeout_s: gemm_candidates waits for its GEMMs at most a positive "
                                               r"number of seconds, got 0"),
                         (dict(timeout_s=float("nan")), r"^timeout_s: .* got nan")):
        with pytest.raises(ValueError, match=message):
            C.gemm_candidates(**dict(good, **bad))
    with pytest.raises(ValueError, match=r"^x: gemm_candidates times a GEMM with work to do, got m=0"):
        C.gemm_candidates(**dict(good, x=empty("x", [0, 40]), out=empty("out", [0, 24])))


def test_the_gemm_runs_on_its_inputs_device():
    """``linear`` makes x's device current for the call (csrc device_guard.h), whichever one the
    caller made current; the other tensors must be on it."""
    x, w = torch.randn(6, 40), torch.randn(24, 40)
    out = torch.empty(6, 24)
    for device in (0, 3):
        got = C.linear_problem(x=ref("x", x, device), weight=ref("weight", w, device), bias=None,
                               out=ref("out", out, device), workspace=ref("workspace", torch.empty(64, dtype=torch.uint8),
                                                                          device))
        assert got["device"] == device
    with pytest.raises(ValueError, match="weight: expected .*cuda:3"):
        C.linear_problem(x=ref("x", x, 3), weight=ref("weight", w, 0), bias=None, out=ref("out", out, 3),
                         workspace=ref("workspace", torch.empty(64, dtype=torch.uint8), 3))


def test_strided_rows_and_a_transposed_weight():
    wide = torch.randn(6, 45)
    x = wide[:, :40]  # rows 45 apart
    wt = torch.randn(40, 24).t()  # [24, 40], column-major: a backward pass's W^T
    buf = torch.empty(10, 30)
    got = linear(x, wt, out=buf[2:8, :24])  # rows of a larger buffer, 30 apart
    assert (got["ldx"], got["ldw"], got["w_col_major"], got["ldy"]) == (45, 24, True, 30)
    padded = torch.randn(24, 48)[:, :40]  # row-major, rows 48 apart
    assert (linear(x, padded)["ldw"], linear(x, padded)["w_col_major"]) == (48, False)


def test_a_batch_of_products_with_one_weight():
    """The reduce-scatter's chunk GEMM: rows [a, b) of each of p blocks of x, one W, into a
    destination-major [p, b - a, n] buffer."""
    p, mp, k, n, a, b = 4, 13, 24, 20, 3, 10
    x = torch.randn(p * mp, k)
    blocks = x.view(p, mp, k)[:, a:b]
    y = torch.empty(p, b - a, n)
    got = linear(blocks, torch.randn(n, k), out=y)
    assert (got["batch"], got["m"], got["ldx"], got["stride_x"], got["ldy"], got["stride_y"]) == (
        p, b - a, k, mp * k, n, (b - a) * n)
    with pytest.raises(ValueError, match="bias: a bias is not supported with a batch of products"):
        linear(blocks, torch.randn(n, k), torch.randn(n), out=y)


def test_empty_matrices_have_null_pointers_and_pass_the_checks():
    """m = 0 or n = 0 is no work and k = 0 an empty sum (the caller fills the bias): torch gives
    such tensors a null data pointer, which is no error."""
    w = ref("weight", torch.randn(8, 8).bfloat16())
    got = C.linear_problem(x=empty("x", [0, 8]), weight=w, bias=None, out=empty("out", [0, 8]), workspace=workspace())
    assert (got["m"], got["n"], got["k"]) == (0, 8, 8)
    got = C.linear_problem(x=ref("x", torch.randn(3, 8).bfloat16()), weight=empty("weight", [0, 8]), bias=None,
                           out=empty("out", [3, 0]), workspace=workspace())
    assert (got["m"], got["n"], got["k"]) == (3, 0, 8)
    got = C.linear_problem(x=empty("x", [5, 0]), weight=empty("weight", [3, 0]), bias=None,
                           out=ref("out", torch.empty(5, 3).bfloat16()), workspace=workspace())
    assert (got["m"], got["n"], got["k"]) == (5, 3, 0)
    with pytest.raises(ValueError, match="x: expected a non-null data pointer"):
        C.linear_problem(x=C.TensorRef("x", 0, [2, 8], [8, 1], "bfloat16", 0), weight=w, bias=None,
                         out=ref("out", torch.empty(2, 8).bfloat16()), workspace=workspace())


def test_an_empty_tensors_strides_are_any():
    """torch calls a tensor with no elements contiguous whatever its strides (``contiguous()`` keeps
    them), so the checks take any: nothing is stored. The leading dimensions are a row-major
    tensor's; the same strides on a tensor with elements are refused."""
    def odd(name, shape, strides):
        return C.TensorRef(name, 0, shape, strides, "bfloat16", 0)

    got = C.linear_problem(x=odd("x", [0, 8], [0, 0]), weight=odd("weight", [0, 8], [0, 0]), bias=odd("bias", [0], [0]),
                           out=odd("out", [0, 0], [3, 7]), workspace=workspace())
    assert (got["m"], got["n"], got["k"], got["ldx"], got["ldw"], got["w_col_major"], got["ldy"]) == (
        0, 0, 8, 8, 8, False, 1)
    got = C.linear_problem(x=odd("x", [5, 0], [0, 3]), weight=odd("weight", [3, 0], [2, 9]), bias=None,
                           out=ref("out", torch.empty(5, 3).bfloat16()), workspace=workspace())
    assert (got["k"], got["ldx"], got["ldw"], got["w_col_major"], got["ldy"]) == (0, 1, 1, False, 3)
    got = C.linear_problem(x=odd("x", [2, 0, 8], [0, 0, 0]), weight=ref("weight", torch.randn(4, 8).bfloat16()),
                           bias=None, out=odd("out", [2, 0, 4], [0, 1, 0]), workspace=workspace())
    assert (got["batch"], got["m"], got["ldx"], got["stride_x"], got["ldy"], got["stride_y"]) == (2, 0, 8, 0, 4, 0)
    assert collective("all_gather", rows=0, x=odd("x", [0, 6], [0, 0]), dtype=torch.bfloat16,
                      out=odd("out", [0, 6], [5, 2]))["count"] == 0
    with pytest.raises(ValueError, match=r"^x: expected a contiguous last dim \(strides \[0, 0\]\)"):
        C.linear_problem(x=C.TensorRef("x", 64, [1, 8], [0, 0], "bfloat16", 0), weight=odd("weight", [0, 8], [0, 0]),
                         bias=None, out=odd("out", [1, 0], [0, 0]), workspace=workspace())
    with pytest.raises(ValueError, match=r"^x: expected a contiguous tensor \(strides \[0, 0\]\)"):
        collective("all_reduce", rows=1, x=C.TensorRef("x", 64, [1, 6], [0, 0], "float32", 0))


@pytest.mark.parametrize("case,message", [
    ("x_1d", r"^x: expected a 2-D tensor \[m, k\], or a 3-D \[batch, m, k\], got \[40\] float32 on cuda:0"),
    ("x_host", r"^x: expected a CUDA tensor, got \[6, 40\] float32 on the host"),
    ("x_uint8", r"^x: expected dtype float32, float16, bfloat16, got \[6, 40\] uint8"),
    ("x_last_dim_strided", r"^x: expected a contiguous last dim"),
    ("x_overlapping_rows", r"^x: expected rows that do not overlap"),
    ("weight_width", r"^weight: expected \[n, 40\] to match x \[6, 40\], got \[24, 39\]"),
    ("weight_dtype", r"^weight: expected float32 on the device of x"),
    ("weight_device", r"^weight: expected float32 on the device of x .*on cuda:1"),
    ("weight_layout", r"^weight: expected a row-major or column-major weight \(strides \[192, 2\]\)"),
    ("bias_shape", r"^bias: expected \[24\], got \[23\]"),
    ("bias_strided", r"^bias: expected a contiguous tensor"),
    ("out_shape", r"^out: expected \[6, 24\] \(x \[6, 40\] times weight \[24, 40\] transposed\), got \[5, 24\]"),
    ("out_dtype", r"^out: expected float32 on the device of x"),
    ("workspace_dtype", r"^workspace: expected uint8 bytes on the device of x"),
])
def test_bad_gemm_arguments_are_named(case, message):
    x, w, b, out = torch.randn(6, 40), torch.randn(24, 40), torch.randn(24), torch.empty(6, 24)
    args = dict(x=ref("x", x), weight=ref("weight", w), bias=ref("bias", b), out=ref("out", out),
                workspace=workspace())
    args.update({
        "x_1d": lambda: {"x": ref("x", torch.randn(40))},
        "x_host": lambda: {"x": ref("x", x, device=-1)},
        "x_uint8": lambda: {"x": ref("x", torch.zeros(6, 40, dtype=torch.uint8))},
        "x_last_dim_strided": lambda: {"x": ref("x", torch.randn(40, 6).t())},
        "x_overlapping_rows": lambda: {"x": C.TensorRef("x", x.data_ptr(), [6, 40], [20, 1], "float32", 0)},
        "weight_width": lambda: {"weight": ref("weight", torch.randn(24, 39))},
        "weight_dtype": lambda: {"weight": ref("weight", w.half())},
        "weight_device": lambda: {"weight": ref("weight", w, device=1)},
        "weight_layout": lambda: {"weight": ref("weight", torch.randn(48, 96)[::2, ::2][:, :40])},
        "bias_shape": lambda: {"bias": ref("bias", torch.randn(23))},
        "bias_strided": lambda: {"bias": ref("bias", torch.randn(48)[::2])},
        "out_shape": lambda: {"out": ref("out", torch.empty(5, 24))},
        "out_dtype": lambda: {"out": ref("out", out.bfloat16())},
        "workspace_dtype": lambda: {"workspace": ref("workspace", torch.empty(8))},
    }[case]())
    with pytest.raises(ValueError, match=message):
        C.linear_problem(**args)


def test_tensor_refs_are_checked_when_made():
    with pytest.raises(ValueError, match="x: 2 sizes but 1 strides"):
        C.TensorRef("x", 0, [2, 3], [3], "float32", 0)
    with pytest.raises(ValueError, match="x: negative size"):
        C.TensorRef("x", 0, [-2, 3], [3, 1], "float32", 0)
    with pytest.raises(ValueError, match="x: unknown dtype 'float64' \\(known: float32, float16, bfloat16, uint8\\)"):
        _extension.tensor_ref("x", torch.randn(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="x: expected a torch.Tensor, got list"):
        _extension.tensor_ref("x", [1.0])
    t = _extension.tensor_ref("weight", torch.randn(8, 6).t())
    assert (t.name, t.shape, t.strides, t.dtype, t.device) == ("weight", [6, 8], [1, 6], "float32", -1)


def test_a_tensor_reads_as_its_tensor_ref():
    """What every native function reads from a tensor argument (``_C.tensor_ref`` shows the one
    reader): data pointer, shape, strides in elements, dtype and device, for views, empty and 0-dim
    tensors and parameters alike; a TensorRef is taken as it is."""
    base = torch.randn(8, 6)
    for t in (base, base.t(), base[1:, 2:], base[::2], torch.randn(()), torch.empty(0, 5),
              torch.nn.Parameter(torch.randn(3, 4)), torch.randn(2, 3, 4).to(torch.bfloat16).transpose(0, 2),
              torch.zeros(5, dtype=torch.float16), torch.zeros(4, dtype=torch.uint8)):
        r = _extension.tensor_ref("x", t)
        assert (r.name, r.data, r.shape, r.strides, r.dtype, r.device) == (
            "x", t.data_ptr(), list(t.shape), list(t.stride()), str(t.dtype).rpartition(".")[2], -1)
    kept = C.TensorRef("kept", 4096, [2, 3], [3, 1], "bfloat16", 1)
    r = _extension.tensor_ref("x", kept)
    assert (r.name, r.data, r.shape, r.strides, r.dtype, r.device) == ("kept", 4096, [2, 3], [3, 1], "bfloat16", 1)


def test_the_native_side_names_every_tensor_argument_after_its_parameter():
    seen = {}

    def fake(*context, **kwargs):
        seen.update(context=context, **kwargs)

    x, xs = torch.randn(2, 3), [torch.randn(3), torch.randn(3)]
    _extension.call(fake, "ctx", stream=None, x=x, inputs=xs, bias=None, bounds=[0, 2])
    assert seen["context"] == ("ctx",) and seen["x"] is x and seen["inputs"] is xs and seen["bias"] is None
    assert seen["bounds"] == [0, 2] and seen["stream"] == 0
    assert seen["workspace"].dtype == torch.uint8 and seen["workspace"].numel() == 0
    seen.clear()
    _extension.call(fake, stream=None, gemm=False, out=torch.randn(2))
    assert "workspace" not in seen
    good = dict(x=ref("x", torch.randn(4, 6)), weight=ref("weight", torch.randn(5, 6)), bias=None,
                out=ref("out", torch.empty(4, 5)), workspace=workspace())
    C.linear_problem(**good)
    for name in ("x", "weight", "bias", "out", "workspace"):
        with pytest.raises(ValueError, match=f"^{name}: expected a torch.Tensor, got str$"):
            C.linear_problem(**{**good, name: "no"})
    with pytest.raises(ValueError, match=r"^inputs\[1\]: expected a torch.Tensor, got int$"):
        C.reduce_partials(inputs=[torch.randn(3), 7], out=torch.randn(3), stream=0)
    with pytest.raises(ValueError, match=r"^inputs: expected a list of torch.Tensor, got NoneType$"):
        C.reduce_partials(inputs=None, out=torch.randn(3), stream=0)
    # a host tensor passed as it is: read, then refused by the checks, by its parameter's name
    with pytest.raises(ValueError, match=r"^x: expected a CUDA tensor, got \[4, 6\] float32 on the host"):
        C.linear_problem(**{**good, "x": torch.randn(4, 6)})


# --- the primitives: what every native and fused op checks, per op -----------------------------


def primitive(op, p=4, rank=1, device=0, mp=5, k=16, n=12, bias=False, chunks=2, **refs):
    """A well-formed call of ``op`` on rank ``rank`` of ``p``, with ``refs`` replacing arguments."""
    f = torch.float32
    rows = mp if op == "all_gather_matmul" else p * mp
    out_rows = p * mp if op == "all_gather_matmul" else mp if op == "matmul_reduce_scatter" else rows
    scratch = (torch.empty(p * mp, k) if op == "all_gather_matmul" else torch.empty(rows, n)
               if op == "matmul_reduce_scatter" else None)
    chunked = rows if op == "matmul_all_reduce" else mp
    order = schedule.ring(rank, p)
    args = dict(op=op, rank=rank, size=p, device=device, x=ref("x", torch.randn(rows, k, dtype=f)),
                weight=ref("weight", torch.randn(n, k, dtype=f)),
                bias=ref("bias", torch.randn(n, dtype=f)) if bias else None,
                out=ref("out", torch.empty(out_rows, n, dtype=f)),
                scratch=None if scratch is None else ref("gathered" if op == "all_gather_matmul" else "partial",
                                                         scratch),
                bounds=schedule.boundaries(chunked, chunks), workspace=workspace())
    if op == "all_gather_matmul":
        args.update(ring=order.sources, ring_next=order.next, ring_prev=order.prev)
    args.update(refs)
    return C.primitive_problem(**args)


def test_well_formed_primitive_calls():
    ag = primitive("all_gather_matmul", bias=True)
    assert (ag["n"], ag["k"], ag["bounds"], ag["has_bias"], ag["has_scratch"]) == (12, 16, [0, 3, 5], True, True)
    assert (ag["ring"], ag["ring_next"], ag["ring_prev"]) == ([1, 0, 3, 2], 2, 0)
    assert primitive("matmul_reduce_scatter", chunks=5)["bounds"] == [0, 1, 2, 3, 4, 5]
    assert primitive("matmul_all_reduce", chunks=4)["bounds"] == list(schedule.boundaries(20, 4))
    assert primitive("matmul_all_reduce", bounds=[])["bounds"] == [0, 20]  # one chunk: the fused one-/two-shot


#: two workspaces' memory, alive while the tests read their addresses (one of a temporary
#: tensor could be handed out again, and seem to share bytes with the next)
_BYTES = torch.empty(2, 64, dtype=torch.uint8)


def workspaces(side_bytes=32, side_device=0):
    """A call's workspace and a side stream's, apart."""
    return dict(workspace=ref("workspace", _BYTES[0]),
                side_workspace=ref("side_workspace", _BYTES[1, :side_bytes], side_device))


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_a_second_gemm_stream_with_its_own_workspace(op):
    """The pipelined primitives' GEMMs may alternate with a side stream, which takes a cuBLASLt
    workspace of its own; without one, nothing of it reaches the core."""
    got = primitive(op, stream=7, side_stream=9, **workspaces(48))
    assert (got["side_stream"], got["side_workspace_bytes"]) == (True, 48)
    got = primitive(op, stream=7)
    assert (got["side_stream"], got["side_workspace_bytes"]) == (False, 0)


def test_bad_second_gemm_streams_are_named():
    shared = _BYTES.view(-1)
    float_bytes = torch.empty(8)
    for refs, message in [
        ({"side_stream": 9}, r"^side_workspace: a side_stream needs a cuBLASLt workspace of its own, got None$"),
        (workspaces(), r"^side_workspace: given without a side_stream$"),
        ({"side_stream": 7, **workspaces()}, r"^side_stream: expected a stream other than `stream`, got the same one$"),
        ({"side_stream": 9, **workspaces(side_device=1)},
         r"^side_workspace: expected uint8 bytes on cuda:0, got \[32\] uint8 on cuda:1"),
        ({"side_stream": 9, "side_workspace": ref("side_workspace", float_bytes)},
         r"^side_workspace: expected uint8 bytes on cuda:0, got \[8\] float32"),
        ({"side_stream": 9, "workspace": ref("workspace", shared[:40]), "side_workspace": ref("side_workspace",
                                                                                              shared[32:])},
         r"^side_workspace: expected bytes of its own \(it shares some with workspace\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            primitive("matmul_all_reduce", stream=7, **refs)
    got = primitive("matmul_all_reduce", stream=7, side_stream=9, workspace=ref("workspace", shared[:32]),
                    side_workspace=ref("side_workspace", shared[32:64]))  # adjacent, not shared
    assert got["side_workspace_bytes"] == 32


@pytest.mark.parametrize("p", range(1, 9))
def test_the_schedules_ring_is_what_the_native_side_accepts(p):
    for rank in range(p):
        got = primitive("all_gather_matmul", p=p, rank=rank)
        assert got["ring"] == [schedule.ring_source(rank, s, p) for s in range(p)]


@pytest.mark.parametrize("op,refs,message", [
    ("all_gather_matmul", {"out": "wrong"}, r"^out: expected \[20, 12\] \(the output of all_gather_matmul on 4 "
                                            r"ranks\), got \[5, 12\]"),
    ("all_gather_matmul", {"scratch": None}, r"^gathered: all_gather_matmul needs its buffer \[20, 16\]"),
    ("matmul_reduce_scatter", {"scratch": None}, r"^partial: matmul_reduce_scatter needs its buffer \[20, 12\]"),
    ("matmul_reduce_scatter", {"bias": "bias"}, r"^bias: matmul_reduce_scatter adds no bias"),
    ("matmul_all_reduce", {"bias": "bias"}, r"^bias: matmul_all_reduce adds no bias"),
    ("matmul_reduce_scatter", {"x": "odd_rows"}, r"^x: expected rows divisible by the group's 4 ranks"),
    ("matmul_all_reduce", {"x": "strided"}, r"^x: expected a contiguous tensor"),
    ("matmul_all_reduce", {"x": "cuda1"}, r"^x: expected a tensor on cuda:0, got \[20, 16\] float32 on cuda:1"),
    ("all_gather_matmul", {"bounds": [0, 3]}, r"^bounds: got \[0, 3\], expected boundaries 0 < \.\.\. < 5 "
                                              r"\(over m/p\)"),
    ("matmul_all_reduce", {"bounds": [0, 5, 5, 20]}, r"^bounds: got \[0, 5, 5, 20\], expected them strictly increasing"),
    ("all_gather_matmul", {"ring": [0, 1, 2, 3]}, r"^ring: expected every rank of 4 once, rank 1 first"),
    ("all_gather_matmul", {"ring": [1, 1, 2, 3]}, r"^ring: expected every rank of 4 once"),
    ("all_gather_matmul", {"ring_next": 1}, r"^ring_next, ring_prev: expected other ranks of 4, got 1 and 0"),
    ("matmul_all_reduce", {"x": "no_rows", "out": "no_rows_out"},
     r"^x, weight: matmul_all_reduce takes no empty dimension \(the plain GEMM does\), got x \[0, 16\]"),
])
def test_bad_primitive_arguments_are_named(op, refs, message):
    values = {"wrong": ref("out", torch.empty(5, 12)), "bias": ref("bias", torch.randn(12)),
              "odd_rows": ref("x", torch.randn(21, 16)), "strided": ref("x", torch.randn(20, 32)[:, :16]),
              "cuda1": ref("x", torch.randn(20, 16), device=1), "no_rows": empty("x", [0, 16], "float32"),
              "no_rows_out": empty("out", [0, 12], "float32")}
    refs = {k: values.get(v, v) if isinstance(v, str) else v for k, v in refs.items()}
    with pytest.raises(ValueError, match=message):
        primitive(op, **refs)


# --- the plain collectives (tp_kernels.Communicator): nccl_collective and fused_all_reduce --------


def collective(name, p=4, rank=1, peer=-1, device=0, x=None, out=None, dtype=torch.float32, rows=8, **refs):
    """A call of collective ``name`` on rank ``rank`` of ``p``: x ``[rows, 6]`` and the output
    its shape needs, ``refs`` replacing them (``x=False`` / ``out=False``: none)."""
    shape = {"all_gather": (p * rows, 6), "gather": (p * rows, 6), "reduce_scatter": (rows // p, 6)}.get(name, (rows, 6))
    xr = None if x is False else x if x is not None else ref("x", torch.randn(rows, 6).to(dtype), device)
    outr = None if out is False else out if out is not None else ref("out", torch.empty(shape, dtype=dtype), device)
    return C.collective_problem(collective=name, rank=rank, size=p, device=device, x=xr, out=outr, peer=peer)


def test_well_formed_collective_calls():
    assert collective("all_reduce") == {"count": 48, "dtype": "float32", "peer": -1, "has_x": True, "has_out": True}
    assert collective("all_gather", dtype=torch.uint8)["count"] == 48  # any dtype moves: counted per rank
    assert collective("reduce_scatter", dtype=torch.bfloat16)["count"] == 12  # the output's block
    assert collective("broadcast", peer=3)["peer"] == 3
    assert collective("gather", peer=1)["has_out"] and not collective("gather", peer=0, out=False)["has_out"]
    assert collective("send", peer=0, out=False) == {"count": 48, "dtype": "float32", "peer": 0, "has_x": True,
                                                     "has_out": False}
    assert collective("recv", peer=2, x=False)["count"] == 48
    assert collective("all_reduce", peer=3)["peer"] == -1  # the symmetric collectives have no root
    assert collective("all_gather", rows=0, x=empty("x", [0, 6], "float32"),
                      out=empty("out", [0, 6], "float32"))["count"] == 0


@pytest.mark.parametrize("name,refs,message", [
    ("all_reduce", {"dtype": torch.uint8}, r"^x: expected dtype float32, float16, bfloat16, got \[8, 6\] uint8"),
    ("reduce_scatter", {"rows": 6}, r"^x: expected dim 0 divisible by the group's 4 ranks"),
    ("all_reduce", {"out": "small"}, r"^out: expected \[8, 6\] \(the output of all_reduce of x \[8, 6\] on 4 ranks\), "
                                     r"got \[4, 6\]"),
    ("all_gather", {"out": "small"}, r"^out: expected \[32, 6\] \(the output of all_gather"),
    ("all_gather", {"out": "half"}, r"^out: expected float32 on the device of x"),
    ("all_gather", {"x": "scalar", "out": "scalar_out"}, r"^x: expected at least one dimension \(dim 0 is gathered\)"),
    ("all_reduce", {"x": "host"}, r"^x: expected a CUDA tensor, got \[8, 6\] float32 on the host"),
    ("all_reduce", {"x": "cuda1"}, r"^x: expected a tensor on cuda:0, got \[8, 6\] float32 on cuda:1"),
    ("all_reduce", {"x": "strided"}, r"^x: expected a contiguous tensor"),
    ("broadcast", {"peer": 4}, r"^src: expected a rank of the group's 4 \(this is rank 1\), got 4"),
    ("send", {"peer": 1, "out": False}, r"^dst: expected another rank of the group's 4 \(this is rank 1\), got 1"),
    ("recv", {"peer": -1, "x": False}, r"^src: expected another rank of the group's 4"),
    ("gather", {"peer": 0}, r"^out: gather takes none on rank 1 \(only the root, rank 0, receives\)"),
    ("gather", {"peer": 1, "out": False}, r"^out: gather needs it on rank 1"),
    ("all_reduce", {"x": False}, r"^x: all_reduce needs it on rank 1"),
    ("send", {"peer": 0}, r"^out: send takes none on rank 1"),
    ("scatter", {}, r"^collective: expected one of all_reduce, all_gather, reduce_scatter, broadcast, gather, send, "
                    r"recv, got 'scatter'"),
])
def test_bad_collective_arguments_are_named(name, refs, message):
    values = {"small": ref("out", torch.empty(4, 6)), "half": ref("out", torch.empty(32, 6, dtype=torch.float16)),
              "scalar": ref("x", torch.tensor(1.0)), "scalar_out": ref("out", torch.tensor(1.0)),
              "host": ref("x", torch.randn(8, 6), device=-1), "cuda1": ref("x", torch.randn(8, 6), device=1),
              "strided": ref("x", torch.randn(8, 12)[:, :6])}
    refs = {k: values.get(v, v) if isinstance(v, str) else v for k, v in refs.items()}
    with pytest.raises(ValueError, match=message):
        collective(name, **refs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_all_reduce_layout_and_its_workspace(dtype):
    """The all-reduce alone views `count` elements as rows of 16 bytes where it can (else of one
    element); its workspace needs are those of the matmul all-reduce of that view, for any count."""
    per_row = 16 // torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for count in (1, 7, per_row, 3 * per_row, 1000 * per_row + 1, 2**20):
        rows, cols = C.all_reduce_layout(count, dtype)
        assert rows * cols == count and cols == (per_row if count % per_row == 0 else 1)
        for algo in C.ALL_REDUCE_ALGORITHMS:
            for p in (2, 8):
                assert C.fused_all_reduce_needs(p, count, dtype, algo) == \
                    C.fused_region_needs("matmul_all_reduce", p, rows, cols, cols, dtype, algo)
    with pytest.raises(ValueError, match=r"algorithm: expected one of one_shot, two_shot, scatter_gather"):
        C.fused_all_reduce_needs(2, 8, dtype, "ring")
