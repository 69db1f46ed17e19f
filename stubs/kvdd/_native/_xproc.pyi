"""Stub of kvdd/_native/_xproc.pyx: one-sided access to another process's memory on this host."""

from collections.abc import Sequence

import numpy as np

from kvdd._native._copy import Region

IOV_MAX: int
DEFAULT_CHUNK: int

def pvm_copy(
    pid: int,
    local: Sequence[Region],
    remote: Sequence[int],
    remote_nbytes: int,
    local_off: np.ndarray,
    remote_off: np.ndarray,
    length: np.ndarray,
    write: bool,
    *,
    timeout_ms: int = -1,
    chunk: int = ...,
) -> int: ...
def pvm_read_bytes(pid: int, addr: int, nbytes: int) -> bytes: ...
def pvm_bench(pid: int, local: Region, remote: int, nbytes: int, write: bool) -> int: ...
