"""Transfer benchmark of the simulator on real model geometries: the ``kvdd bench`` command.

The measuring code lives in the installed package (:mod:`kvdd.bench`), because ``kvdd bench`` must
work without this directory; this script only runs it from a source checkout::

    python -m benchmarks.transfers --quick          # well under a minute on 2 cores
    python -m benchmarks.transfers                  # 2048-token requests (about two minutes)
    python -m benchmarks.transfers --json > out.json
    python -m benchmarks.transfers --geometries llama-3.1-8b --kinds pull_blocks --repeats 50

Same options as ``kvdd bench --help``. Kernel-level numbers (random runs vs. memcpy without the
engine in between) are in :mod:`benchmarks.kernels`.
"""

from __future__ import annotations

import sys

from kvdd.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.transfers"))
