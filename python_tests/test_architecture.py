"""The structure docs/architecture.md describes, held against the code.

* Imports flow one way: every module of tp_kernels belongs to one layer of :data:`LAYERS` and
  imports only from its own layer or lower ones, and no modules import each other in a circle.
* One decision per call: a layer's forward and backward resolve the implementation once, check
  what each fast path can run at most once, and run forward and backward on that implementation.
* One list per boundary: what the native module defines (ops, dtypes, all-reduce algorithms,
  workspace regions) is read from it, not written again in Python.
"""

from __future__ import annotations

import ast
import pathlib
from collections import Counter

import pytest
import torch

import tp_kernels
from helpers import rank_world
from tp_kernels import _extension, _op_table, schedule
from tp_kernels.backends import backward_name

PACKAGE = pathlib.Path(tp_kernels.__file__).parent

#: The layers, bottom up (docs/architecture.md draws them); a module name ending in ".*" stands for
#: every module of that package.
LAYERS = [
    ("settings, groups and tables", ["settings", "parallel_state", "_op_table", "_checks", "schedule",
                                     "_data_parallel", "_torch_version"]),
    ("collectives", ["_collectives", "_agreement", "_timing"]),
    ("extension loader", ["_extension"]),
    ("backends", ["backends", "backends.*"]),
    ("decision and custom ops", ["autotune", "dispatch", "_library"]),
    ("ops and mappings", ["ops", "mappings", "communicator"]),
    ("layers", ["layers", "embedding", "cross_entropy", "experts", "parallelize", "_torch_styles", "_sequence_plan",
                "grads", "checkpoints", "rng"]),
    ("tools", ["testing", "testing.*", "perf_model", "bench", "bench.*", "onnx", "onnx.*"]),
    ("package", [""]),
]


def _modules():
    """{dotted name relative to tp_kernels ("" for the package): path}."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if module == name or (name.endswith(".*") and module.startswith(name[:-1])):
                return i
    raise AssertionError(f"tp_kernels.{module} is in no layer of LAYERS: place it (and in docs/architecture.md)")


def _imports(module: str):
    """The tp_kernels modules ``module`` imports, anywhere in its body (function-level too)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tp_kernels."):
                    found.add(alias.name[len("tp_kernels."):])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("tp_kernels"):
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                target = ".".join(base + [alias.name])
                found.add(target if target in MODULES else ".".join(base))
    found.discard(module)
    return found


def test_every_module_has_a_layer():
    assert "backends.pipelined_native" in MODULES and "_op_table" in MODULES  # the walk sees the package
    for module in MODULES:
        _layer(module)


def test_imports_flow_one_way():
    upward = [f"tp_kernels.{m} ({LAYERS[_layer(m)][0]}) imports tp_kernels.{t} ({LAYERS[_layer(t)][0]})"
              for m in MODULES for t in _imports(m) if _layer(t) > _layer(m)]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = {m: sorted(_imports(m)) for m in MODULES}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == "open":
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(f"tp_kernels.{c}" for c in cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m)


def test_the_lower_layers_know_nothing_of_the_upper_ones():
    """The group teardown reaches the layers that made per-group state through hooks they
    register (parallel_state imports none of them)."""
    assert _imports("parallel_state") == {"settings"} and _imports("settings") == set()
    from tp_kernels import autotune, communicator, parallel_state
    from tp_kernels.backends import peer_memory, pipelined_native

    for teardown in (autotune.forget, peer_memory.destroy_workspaces, pipelined_native.destroy_communicators,
                     communicator._forget):
        assert teardown in parallel_state._TEARDOWNS


# --- one decision per call ------------------------------------------------------------------------


def check_one_decision_per_call(kind, sequence_parallel, backend):
    """Forward and backward of a layer: the implementation is resolved once, its options are not
    checked again, each fast path's capability is asked at most once, and every custom op of the
    call runs the implementation the forward resolved (an all-gather's or reduce-scatter's backward,
    the other primitive, in that primitive's own chunks: backends.backward_name)."""
    from tp_kernels import _library, dispatch, ops
    from tp_kernels.backends import fused, pipelined_native

    r, p = rank_world()
    counts, ran = Counter(), []
    originals = {}

    def wrap(owner, name, record):
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def wrapped(*args, **kwargs):
            record(args)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    wrap(ops, "resolve", lambda a: counts.update(["resolve"]))
    wrap(ops, "check_choice", lambda a: counts.update(["option checked"]))
    wrap(dispatch, "check_choice", lambda a: counts.update(["option checked"]))
    wrap(pipelined_native, "unsupported_reason", lambda a: counts.update(["native asked"]))
    wrap(fused, "unsupported_reason", lambda a: counts.update(["fused asked"]))
    wrap(_library, "run", lambda a: ran.append((a[0], a[1])))
    try:
        torch.manual_seed(0)
        cls = tp_kernels.ColumnParallelLinear if kind == "column" else tp_kernels.RowParallelLinear
        layer = cls(8, 6 * p, sequence_parallel=sequence_parallel, backend=backend)
        rows = 3 * p if kind == "row" and sequence_parallel else 3
        x = torch.randn(rows, 2, layer.in_features_per_partition if kind == "row" else 8, requires_grad=True)
        counts.clear()
        layer(x).square().sum().backward()
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    return dict(counts), ran


@pytest.mark.parametrize("backend", ["auto", "pipelined", "reference"])
def test_a_layer_call_is_decided_once(world2, backend):
    for kind in ("column", "row"):
        for sp in (False, True):
            per_rank = world2.run(check_one_decision_per_call, kind, sp, backend)
            assert per_rank[0] == per_rank[1]
            counts, ran = per_rank[0]
            case = f"{kind} sequence_parallel={sp} backend={backend}"
            assert counts.get("resolve") == 1 and "option checked" not in counts, (case, counts)
            assert counts.get("native asked", 0) <= 1 and counts.get("fused asked", 0) <= 1, (case, counts)
            forward = ("reference" if backend != "pipelined" else
                       f"pipelined:{schedule.DEFAULT_NUM_CHUNKS[_forward_primitive(kind, sp)]}")
            assert ran and ran[0] == (_forward_primitive(kind, sp), forward), (case, ran)
            # forward and backward: the one implementation, each primitive in its own default chunks
            assert all(name == backward_name(forward, primitive) for primitive, name in ran), (case, ran)


def _forward_primitive(kind, sequence_parallel):
    if kind == "column":
        return "all_gather_matmul" if sequence_parallel else "matmul_all_reduce"  # the latter: in backward
    return "matmul_reduce_scatter" if sequence_parallel else "matmul_all_reduce"


# --- one list per boundary --------------------------------------------------------------------------

built = pytest.mark.skipif(_extension._C is None, reason="the native module is not built")


@built
def test_pythons_view_of_the_native_lists():
    C = _extension._C
    assert C.OPS == _op_table.PRIMITIVES == tuple(schedule.DEFAULT_NUM_CHUNKS)
    assert C.COLLECTIVES == _op_table.COLLECTIVES
    assert set(_op_table.REDUCTIONS) < set(C.COLLECTIVES) and set(_op_table.POINT_TO_POINT) < set(C.COLLECTIVES)
    assert all(getattr(torch, name).is_floating_point for name in C.DTYPES)
    from tp_kernels.backends import fused

    assert tuple(fused.algorithms()) == C.ALL_REDUCE_ALGORITHMS and set(fused.MAX_BYTES) < set(C.ALL_REDUCE_ALGORITHMS)
    assert fused.kernel_algorithms() == ("one_shot", "two_shot")  # (the kernel's; scatter-gather runs copy engines)
    picked = {fused.all_reduce_algorithm(m, 4096, 8, torch.bfloat16) for m in (1, 64, 4096, 65536)}
    assert picked == set(C.ALL_REDUCE_ALGORITHMS)  # every algorithm is reachable by size, and only those
    assert len(C.REGIONS) == 3 and C.MAX_RANKS == 8


def _string_collections(path):
    """Every list, tuple or set literal of two or more strings in ``path`` (``__all__`` aside: it
    names the module's functions), as a set of strings."""
    tree = ast.parse(path.read_text())
    exports = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and id(node) not in exports:
            strings = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if len(strings) >= 2:
                yield node.lineno, strings


@built
def test_no_list_is_written_on_both_sides_of_the_boundary():
    """A module that talks to the native module reads its lists from it: none writes two or more
    names of a list the native module defines (nor does any module write two op names). The op
    and collective lists have one Python definition each, in the table of the public ops, which
    the test above holds equal to the native ones."""
    C = _extension._C
    native_lists = {"ops": C.OPS, "dtypes": C.DTYPES, "all-reduce algorithms": C.ALL_REDUCE_ALGORITHMS,
                    "regions": C.REGIONS, "collectives": C.COLLECTIVES}
    found = []
    for module, path in MODULES.items():
        talks_to_native = "_extension" in _imports(module) or module == "_extension"
        for line, strings in _string_collections(path):
            for what, names in native_lists.items():
                if len(strings & set(names)) < 2:
                    continue
                if what in ("ops", "collectives") and module == "_op_table":
                    continue
                if what == "ops" or talks_to_native:
                    found.append(f"tp_kernels/{path.relative_to(PACKAGE)}:{line} writes {what}: {sorted(strings)}")
    assert not found, "\n".join(found)
