"""An owner that exits in the middle of a mapped same-host copy.

The owner's cache lives in ``kvdd.empty`` memory, so the reader copies through a mapping that
outlives the owner.  The reader's destination is anonymous memory whose second half is registered
with a userfaultfd: the copy (8 MiB, two 4 MiB kernel calls) stops at the first byte of that half
until the test answers.  Meanwhile the owner is killed and reaped; the copy then resumes and ends.
``/proc/<pid>/mem`` would have failed the second half, so the call must too: LLM_TIMEOUT, on the
compiled path and on the Python path alike.
"""

from __future__ import annotations

import ctypes
import os
import select
import subprocess
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam,
                  LlmDataDist, LlmRole, LLMTimeoutError)
from kvdd.sim import _fastpath
from kvdd.sim.fabric import samehost
from shared_support import owner_pattern, shm_owner

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

M = 8 << 20  # bytes of the cache: two 4 MiB kernel calls of a mapped copy
OWNER = 1
ONE = KvCacheExtParam(tensor_num_per_layer=1)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.syscall.restype = ctypes.c_long
_UFFDIO_API, _UFFDIO_REGISTER = 0xc018aa3f, 0xc020aa00
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)


@pytest.fixture
def owner() -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    with shm_owner(M) as world:
        yield world


def _frozen_second_half() -> tuple[int, int]:
    """M bytes of anonymous memory, the first half present, the second behind a userfaultfd
    (missing pages): ``(address, uffd)``; skips where userfaultfd is refused."""
    if _SYS_USERFAULTFD is None:
        pytest.skip("userfaultfd number unknown on this machine")
    base = _libc.mmap(None, M, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    assert base not in (None, ctypes.c_void_p(-1).value)
    ctypes.memset(base, 0x21, M // 2)
    uffd = _libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
    api = (ctypes.c_uint64 * 3)(0xAA, 0, 0)
    reg = (ctypes.c_uint64 * 4)(base + M // 2, M // 2, 1, 0)  # UFFDIO_REGISTER_MODE_MISSING
    if uffd < 0 or _libc.ioctl(uffd, _UFFDIO_API, api) or _libc.ioctl(uffd, _UFFDIO_REGISTER, reg):
        err = ctypes.get_errno()
        _libc.munmap(base, M)
        pytest.skip(f"userfaultfd refused (errno {err}): needs CAP_SYS_PTRACE or "
                    "vm.unprivileged_userfaultfd=1")
    return base, uffd


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "python"])
def test_an_owner_exiting_mid_copy_fails_the_copy(owner: tuple[subprocess.Popen[str], int, int],
                                                   fast: bool) -> None:
    proc, port, cid = owner
    base, uffd = _frozen_second_half()
    dd = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    prev = _fastpath.set_enabled(fast)
    try:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "2", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0",
                       kvdd.OPTION_SYNC_CACHE_WAIT_TIME: "20000"})
        desc = CacheDesc(1, DataType.DT_UINT8, (1, M))
        mine = Cache(dd.register_kv_cache(desc, [base]), (), desc)
        dd.link_llm_clusters([ClusterInfo(remote_cluster_id=OWNER,
                                          remote_ip_infos=(IpInfo("127.0.0.1", port),))], 10_000)
        if dd.backend.link_data_path(OWNER) != "process_vm":  # type: ignore[attr-defined]
            pytest.skip("the link does not use the same-host path")
        reader = dd.backend.entities[OWNER].peer._path._reader  # type: ignore[attr-defined]
        assert reader.maps is not None  # the owner's memory is mapped here
        before = dd.backend.fast_transfers.taken  # type: ignore[attr-defined]
        outcome: list[BaseException | None] = []

        def pull() -> None:
            try:
                dd.pull_kv_cache(CacheIndex(OWNER, cid, 0), mine, 0, -1, ONE)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                outcome.append(exc)

        t = threading.Thread(target=pull, daemon=True)
        t.start()
        readable, _, _ = select.select([uffd], [], [], 20)
        assert readable, "the copy never reached the frozen half"
        got = np.ctypeslib.as_array((ctypes.c_uint8 * (M // 2)).from_address(base))
        # the first kernel call landed: the owner's pattern, before its exit
        assert np.array_equal(got, owner_pattern(M)[:M // 2])
        proc.kill()
        proc.wait(10)
        os.close(uffd)  # the faulting copy resumes (a zero page) and ends
        uffd = -1
        t.join(20)
        assert not t.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], LLMTimeoutError), outcome
        assert dd.backend.fast_transfers.taken == before  # type: ignore[attr-defined]
    finally:
        _fastpath.set_enabled(prev)
        dd.finalize()
        if uffd >= 0:
            os.close(uffd)
        _libc.munmap(base, M)
