"""Shared fixtures: worlds of gloo processes, spawned once per size and reused.

A test asks for ``world2``/``world4``/``world8`` or for ``world`` parametrized over sizes
(``@pytest.mark.parametrize("world", [1, 2, 4], indirect=True)``), then calls
``world.run(check_fn, ...)`` with a module-level function that runs on every rank and asserts.
A world that failed is closed and replaced by the next test that needs one.
"""

from __future__ import annotations

import os

import pytest

from tp_kernels.testing import World

_WORLDS = {}


def reused_world(worlds: dict, key, make) -> World:
    """The world ``worlds[key]``, made by ``make()`` when there is none yet or a failed test closed
    it: spawned once and reused, and one failure fails one test (test_gpu's NCCL worlds too)."""
    world = worlds.get(key)
    if world is None or not world.alive:
        world = worlds[key] = make()
    return world


def get_world(size: int) -> World:
    return reused_world(_WORLDS, size, lambda: World(size, backend="gloo", timeout_s=60.0))


@pytest.fixture(autouse=True)
def _resolved_anew():
    """What ``"auto"`` resolved earlier calls to (``dispatch._resolved``) dropped before each test:
    tests replace what a decision depends on (a path's ``unsupported_reason``) between calls like
    one another, which nothing outside a test does."""
    from tp_kernels import dispatch

    dispatch._resolved.clear()


@pytest.fixture
def world(request):
    return get_world(request.param)


@pytest.fixture
def world2():
    return get_world(2)


@pytest.fixture
def world4():
    return get_world(4)


@pytest.fixture
def world8():
    return get_world(8)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N interleaved parts of the selected tests (every N-th, from the I-th): "
                          "the GPU suite in several runs, bench/gpu_suite.sh tests --shard 1/2")
    parser.addoption("--select-from", default=None, metavar="FILE",
                     help="run only the tests FILE lists, one node id a line (python_tests/test_gpu.py::test_a[x]): "
                          "a GPU run's failed and unreached tests again, from python bench/gpu_summary.py rerun RECORD")


def shard(count: int, spec: str) -> range:
    """The indices of the tests of part ``spec`` (``"I/N"``: the I-th of N, from 1) of ``count``
    selected tests, every N-th from the I-th (interleaved: a slow test's parametrizations, side by
    side, fall into every part), or a ValueError naming ``--shard``."""
    part, _, parts = spec.partition("/")
    if not (part.isdigit() and parts.isdigit() and 1 <= int(part) <= int(parts)):
        raise ValueError(f"--shard: expected I/N with 1 <= I <= N, got {spec!r}")
    return range(int(part) - 1, count, int(parts))


def listed(path: str) -> list:
    """The node ids ``path`` lists, one a line (blank lines passed over), or a ValueError naming
    ``--select-from``."""
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError as exc:
        raise ValueError(f"--select-from: cannot read {path!r}: {exc.strerror}") from None


@pytest.hookimpl(trylast=True)  # (after -m and -k have deselected theirs: a part of what they select)
def pytest_collection_modifyitems(config, items):
    path, spec = config.getoption("--select-from"), config.getoption("--shard")
    try:
        if path is not None:
            wanted = set(listed(path))
            missing = sorted(wanted - {item.nodeid for item in items})
            if missing:
                raise ValueError(f"--select-from: {len(missing)} of the tests {path!r} lists are not among those "
                                 f"selected: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
            _keep(config, items, {i for i, item in enumerate(items) if item.nodeid in wanted})
        if spec is not None:
            _keep(config, items, set(shard(len(items), spec)))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _keep(config, items, keep) -> None:
    """Keep the ``items`` at the indices ``keep``, the rest deselected."""
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i not in keep])
    items[:] = [item for i, item in enumerate(items) if i in keep]


def pytest_collection_finish(session):
    """With ``TP_KERNELS_COLLECTED_FILE`` set (bench/gpu_suite.sh sets it), the ids of the tests
    selected, one a line: the suite's record names those a stopped run never reached. Under
    pytest-xdist every worker collects them all (the controller none): the first worker writes."""
    path = os.environ.get("TP_KERNELS_COLLECTED_FILE")
    if path and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
        with open(path, "w") as f:
            f.writelines(item.nodeid + "\n" for item in session.items)


def pytest_sessionfinish(session, exitstatus):
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()
