"""Stub of kvdd/_native/_xproc.pyx: one-sided access to another process's memory on this host."""

from collections.abc import Sequence
from typing import Final

import numpy as np
from typing_extensions import disjoint_base

from kvdd._native._copy import Region

IOV_MAX: int
DEFAULT_CHUNK: int
__pyx_capi__: Final[dict[str, object]]

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
    pidfd: int = -1,
    leases: LeaseTable | None = None,
    slot: int = -1,
    mem_fd: int = -1,
) -> int: ...
def pvm_read_bytes(pid: int, addr: int, nbytes: int) -> bytes: ...
def mem_bench_runs(
    fd: int,
    local: Region,
    remote: int,
    local_off: np.ndarray,
    remote_off: np.ndarray,
    length: np.ndarray,
    write: bool,
) -> int: ...
def pvm_bench(pid: int, local: Region, remote: int, nbytes: int, write: bool) -> int: ...
def pvm_bench_runs(
    pid: int,
    local: Region,
    remote: int,
    local_off: np.ndarray,
    remote_off: np.ndarray,
    length: np.ndarray,
    write: bool,
) -> int: ...
def pidfd_open(pid: int) -> int: ...
def pidfd_alive(fd: int) -> bool: ...
def mem_open(pid: int, pidfd: int) -> int: ...
def peer_cred(fd: int) -> tuple[int, int, int]: ...

LEASE_HEADER: int
LEASE_SLOT: int
LEASE_MAGIC: int
LEASE_MAX_SLOTS: int
LEASE_ABORT: int

@disjoint_base
class LeaseTable:
    slots: int
    def __new__(cls, fd: int, slots: int, init: bool = False) -> LeaseTable: ...
    def close(self) -> None: ...
    def header(self) -> tuple[int, int, int]: ...
    def enter(self, slot: int) -> int: ...
    def leave(self, slot: int) -> None: ...
    def revoke(self, slot: int, state: int = 1) -> None: ...
    def state(self, slot: int) -> int: ...
    def inflight(self, slot: int) -> int: ...
    def compare_exchange(self, slot: int, word: int, expected: int, desired: int) -> bool: ...
    def load(self, slot: int, word: int) -> int: ...
    def store(self, slot: int, word: int, value: int) -> None: ...
    def wait_idle(self, slot: int | None, timeout_ms: int, pidfd: int = -1) -> int: ...

@disjoint_base
class SameHostMover:
    moved: int
    def __new__(
        cls,
        reader: object,
        table: LeaseTable,
        slot_of: dict[int, int],
        mem_fd: int,
        pidfd: int,
        pid: int,
        max_lease_ms: int,
        chunk: int,
    ) -> SameHostMover: ...
    def take_failure(self, slot: int) -> int: ...
    def begin(self) -> bool: ...
    def end(self) -> bool: ...
    def close(self) -> bool: ...
