"""Stub of kvdd/_native/_runs.pyx: compiled helpers for long lists of block indices."""

import numpy as np
import numpy.typing as npt

def ints_within(seq: object, lo: int, hi: int) -> bool: ...
def block_runs(
    src: object, dst: object
) -> (
    tuple[
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.int64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64],
        int,
        tuple[int, int, int, int, int],
    ]
    | None
): ...
def byte_runs(
    s0: object, d0: object, ln: object, block: int, tail: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], int, int, int]: ...
def sum_int64(a: object) -> int: ...
