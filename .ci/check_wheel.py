"""Check a built wheel in the environment of the Python that runs this (CI makes a fresh one with a
CPU torch and the NVIDIA CUDA runtime, NCCL and cuBLAS wheels a CUDA torch of the wheel's major
depends on):

1. the wheel says its CUDA major (``0.1.0+cu13``) and holds the extension and its build record;
   the extension names its sources relative to the project (``csrc/comm.cpp``), not by the folder
   it was built in;
2. installing it changes no file another package installed under ``site-packages/nvidia`` (a hash
   of every file before and after), and ``pip check`` is content;
3. it imports, from outside the source tree, with the extension loaded;
4. with a torch of the other CUDA major, it imports with the pure-PyTorch backends and says which
   build to install.

    python .ci/check_wheel.py dist/tp_kernels-0.1.0+cu13-cp311-cp311-linux_x86_64.whl
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile


def nvidia_tree() -> dict:
    root = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
    digests = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digests[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def status(prelude: str = "") -> dict:
    code = prelude + "import json, tp_kernels\nprint(json.dumps(tp_kernels.extension_status()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tempfile.gettempdir())  # not the source tree: the installed package
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(wheel: str) -> int:
    name = os.path.basename(wheel)
    found = re.match(r"tp_kernels-[\d.]+\+cu(\d+)-", name)
    assert found, f"{name}: the wheel's version does not say its CUDA major (0.1.0+cu13)"
    major = int(found.group(1))
    listing = zipfile.ZipFile(wheel).namelist()
    extension = [f for f in listing if re.match(r"tp_kernels/_C\..*\.so$", f)]
    assert extension, f"{name} has no tp_kernels._C"
    assert "tp_kernels/_C_build.json" in listing, f"{name} has no build record"
    built_in = re.search(rb"/[^\0\s]*/csrc/[\w/]+\.(cpp|h)", zipfile.ZipFile(wheel).read(extension[0]))
    assert not built_in, f"{name}: the extension names a source by the folder it was built in: {built_in.group()}"

    before = nvidia_tree()
    assert before, "no NVIDIA wheels in this environment: install those a CUDA torch of the wheel's major brings"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", wheel], check=True)
    after = nvidia_tree()
    changed = sorted(set(before.items()) ^ set(after.items()))
    assert not changed, f"installing {name} changed files under site-packages/nvidia: {changed[:5]}"
    subprocess.run([sys.executable, "-m", "pip", "check"], check=True)

    mine = status()
    assert mine["built"] and mine["build"]["cuda_major"] == major, mine
    other = 12 if major == 13 else 13
    theirs = status(f"import torch\ntorch.version.cuda = '{other}.8'\n")
    assert not theirs["built"] and f"Install the CUDA {other} build" in theirs["reason"], theirs
    print(f"{name}: CUDA {major} build ({mine['build']['cuda']}, archs {mine['build']['cuda_archs']}, NCCL "
          f"{mine['build']['nccl']}, cuBLAS {mine['build']['cublas']}); installed beside {len(before)} files of the "
          f"NVIDIA wheels, none changed; loads; with a CUDA {other} torch: {theirs['reason'][:90]}...")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
