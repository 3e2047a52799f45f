"""The oldest torch tp_kernels runs with, checked when the package is imported (this module is
the first it imports).

The floor is written once, in ``pyproject.toml``'s ``dependencies`` (``torch>=X.Y.0a0``: a
pre-release of that version is admitted, as NVIDIA's containers ship torch ``X.Y.0a0+...``), and
read here from the installed package's metadata. pip keeps to it when it installs tp_kernels; a
torch installed later, or beside ``--no-deps``, is caught here, with an error that says which
torch is needed, rather than by an ``ImportError`` deep in a call (CI runs the tests on that
oldest torch).
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Optional, Tuple

import torch

__all__ = ["oldest_release", "required_torch", "require_torch"]


def _release(version: str) -> Optional[Tuple[int, int]]:
    """(major, minor) of a version string (``"2.8.0a0+5228986c39.nv25.05"`` -> (2, 8)), or None."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def required_torch() -> Optional[str]:
    """The version in the installed tp_kernels' requirement ``torch>=...`` (``"2.11.0a0"``), or
    None where tp_kernels is not installed (a source tree on ``sys.path``) or requires none."""
    try:
        requirements = metadata.requires("tp_kernels") or []
    except metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        found = re.fullmatch(r"torch\s*>=\s*([0-9][^\s,;]*)", requirement.strip())
        if found:
            return found[1]
    return None


def oldest_release() -> Optional[str]:
    """The first final release that :func:`required_torch` admits (``"2.11.0"`` for ``2.11.0a0``): the
    torch CI installs to test the oldest, or None where none is required."""
    need = _release(required_torch() or "")
    return None if need is None else f"{need[0]}.{need[1]}.0"


def require_torch(version: Optional[str] = None) -> None:
    """Raise ``ImportError`` where torch ``version`` (the one imported by default) is older, by
    its major and minor release, than :func:`required_torch`."""
    version = torch.__version__ if version is None else version
    floor = required_torch()
    have, need = _release(str(version)), _release(floor or "")
    if have is not None and need is not None and have < need:
        raise ImportError(f"tp_kernels needs torch >= {need[0]}.{need[1]}, and this torch is {version}: install "
                          f"a newer torch first (pip install 'torch>={need[0]}.{need[1]}', the build you want), "
                          "then tp_kernels")


require_torch()
