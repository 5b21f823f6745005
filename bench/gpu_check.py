"""`make gpu-check`: on one CUDA GPU, within 10 minutes, the tests marked `gpu` (tests/gpu) and
bench/bench_gpu.py's table. Without CUDA it says so and exits 0, claiming nothing.

GPU machines in clusters often reach no package index: `make gpu-wheels` fills gpu-wheels/ (under
64 MiB) with what a machine with CUDA torch, transformers and sentencepiece already installed
still lacks (deepspeed, nltk and what they need); when that folder is there, this installs from
it with no network first. The project's C++ helpers are then built in place when they do not
import (setup.py build_ext --inplace: the machine's Python need not be this one's)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(REPO, "gpu-wheels")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing was run or claimed")
        return 0
    if os.path.isdir(WHEELS):
        names = sorted(os.listdir(WHEELS))
        print(f"gpu-check: installing {len(names)} files from {WHEELS} (no network)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                        "--find-links",
                        WHEELS, "--no-build-isolation",
                        *[os.path.join(WHEELS, n) for n in names]], check=True)
    helpers = subprocess.run([sys.executable, "-c", "import megatron.data._helpers, "
                              "megatron.model._moe_helpers"], cwd=REPO)
    if helpers.returncode:
        print("gpu-check: building the C++ helpers in place")
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=REPO,
                       check=True)
    tests = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q",
                            "-p", "no:cacheprovider"], cwd=REPO, timeout=420)
    bench = subprocess.run([sys.executable, "bench/bench_gpu.py"], cwd=REPO, timeout=240)
    return tests.returncode or bench.returncode


if __name__ == "__main__":
    sys.exit(main())
