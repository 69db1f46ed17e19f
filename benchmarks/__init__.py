"""kvdd benchmarks: measurements reported as ratios against a limit measured in the same run.

``benchmarks.harness`` holds the reusable timing / table / JSON helpers; ``benchmarks.kernels`` the
copy-kernel benchmark (``python -m benchmarks.kernels``).
"""
