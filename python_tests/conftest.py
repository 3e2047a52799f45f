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


def get_world(size: int) -> World:
    world = _WORLDS.get(size)
    if world is None or not world.alive:
        world = _WORLDS[size] = World(size, backend="gloo", timeout_s=60.0)
    return world


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


def pytest_collection_finish(session):
    """With ``TP_KERNELS_COLLECTED_FILE`` set (bench/gpu_suite.sh sets it), the ids of the tests
    selected, one a line: the suite's record names those a stopped run never reached."""
    path = os.environ.get("TP_KERNELS_COLLECTED_FILE")
    if path:
        with open(path, "w") as f:
            f.writelines(item.nodeid + "\n" for item in session.items)


def pytest_sessionfinish(session, exitstatus):
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()
