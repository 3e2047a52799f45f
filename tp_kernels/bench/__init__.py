"""Benchmarks: the three ops and the two layers, every backend against the reference.

``python -m tp_kernels.bench`` (see :mod:`tp_kernels.bench.cli`) is the main job; ``pytest
bench/`` is the pytest-benchmark suite. Both take their cases from :mod:`.cases`; the report's
metrics are defined in :mod:`.report`, the timing method in :mod:`.measure`.
"""

from .cases import Case, model_cases  # noqa: F401
