"""Build script for tp_kernels.

The Python package installs on any machine (``pip install -e .``) without building anything
native. The CUDA extension ``tp_kernels._C`` (``CMakeLists.txt``, ``csrc/``) is not part of
this release; ``tp_kernels.extension_status()`` reports that at run time.
"""

from setuptools import setup

setup()
