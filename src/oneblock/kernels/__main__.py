"""``python -m oneblock.kernels``: build (or find) the C++ kernels and say which path this machine runs.

Prints the backend, the CPU's model name and vector extensions, where the library is cached and how long loading
it took. Exits 1 if the kernels fell back to the PyTorch path (unless ``ONEBLOCK_KERNELS=torch`` asked for it).
"""

from __future__ import annotations

import os
import sys
import time

from oneblock.kernels import backend, cpu
from oneblock.kernels.build import build_directory
from oneblock.kernels.ops import ENV


def main() -> int:
    start = time.perf_counter()
    chosen = backend()
    seconds = time.perf_counter() - start
    print(f"backend: {chosen}")
    print(f"cpu: {cpu.model_name()}")
    print(f"vector extensions: {' '.join(cpu.vector_extensions()) or 'none listed'}")
    print(f"library: {build_directory()}")
    print(f"ready in {seconds * 1000:.0f} ms")
    return 0 if chosen != "torch" or os.environ.get(ENV, "").strip().lower() == "torch" else 1


if __name__ == "__main__":
    sys.exit(main())
