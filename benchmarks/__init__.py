"""kvdd benchmarks: measurements reported as ratios against a limit measured in the same run.

``benchmarks.harness`` holds the reusable timing / table / JSON helpers; ``benchmarks.kernels`` the
copy-kernel benchmark (``python -m benchmarks.kernels``).  They run from the clone's root, so they
need kvdd installed in editable mode (pip install --no-build-isolation -e '.[test]'); ``kvdd bench``
runs anywhere.
"""

try:
    import kvdd  # noqa: F401  (the one-line error of a source checkout without compiled modules)
except ImportError as _exc:
    raise SystemExit(f"benchmarks: {_exc}") from None
