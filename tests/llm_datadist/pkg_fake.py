"""A recording stand-in for the engine behind kvdd.llm_datadist (the _seam.Wrapper protocol).

Every call is appended to ``calls`` as ``(name, args)``; ``status[name]`` makes a call return
that status (default 0); registrations return ids 1, 2, ...  ``use_fake()`` installs a fresh fake
for one test and finalizes any LLMDataDist left initialized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kvdd.llm_datadist import _engine
from kvdd.llm_datadist._seam import (
    BlockCfgTuple,
    CacheDescTuple,
    CacheKeyTuple,
    ClusterTuple,
    CopyParamTuple,
    MemInfoTuple,
    PullParamTuple,
    TransferCfgTuple,
    Wrapper,
)

PARAM_INVALID = 0x5010B005
FAILED = 0xFFFFFFFF


class RecordingWrapper:
    """Implements kvdd.llm_datadist._seam.Wrapper; records, never moves bytes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.status: dict[str, int] = {}
        self.next_id = 1
        self.next_comm_id = 1
        self.mem_status = 1
        self.detail: str | None = None
        self.rets: list[int] = []
        self.tensor_size = 64

    def _rec(self, name: str, *args: Any) -> int:
        self.calls.append((name, args))
        return self.status.get(name, 0)

    def names(self) -> list[str]:
        """Names of the engine calls so far (calc_tensor_size excluded)."""
        return [n for n, _ in self.calls if n != "calc_tensor_size"]

    def last(self, name: str) -> tuple[Any, ...]:
        """Arguments of the last call of ``name``."""
        return [a for n, a in self.calls if n == name][-1]

    def last_error_detail(self) -> str | None:
        return self.detail

    def calc_tensor_size(self, shape: Sequence[int], data_type: int) -> int:
        self.calls.append(("calc_tensor_size", (list(shape), data_type)))
        return -1 if any(d <= 0 for d in shape) else self.tensor_size

    def initialize_v2(self, cluster_id: int, options: Mapping[str, str]) -> int:
        return self._rec("initialize_v2", cluster_id, dict(options))

    def finalize_v2(self) -> None:
        self._rec("finalize_v2")

    def link(self, comm_name: str, cluster_rank_info: Sequence[tuple[int, int]],
             rank_table: str) -> tuple[int, int]:
        status = self._rec("link", comm_name, list(cluster_rank_info), rank_table)
        comm_id = self.next_comm_id
        if status == 0:
            self.next_comm_id += 1
        return status, comm_id

    def unlink(self, comm_id: int) -> int:
        return self._rec("unlink", comm_id)

    def query_register_mem_status(self, comm_id: int) -> tuple[int, int]:
        return self._rec("query_register_mem_status", comm_id), self.mem_status

    def link_clusters_v2(self, clusters: Sequence[ClusterTuple], timeout_ms: int) -> tuple[int, list[int]]:
        return self._rec("link_clusters_v2", [tuple(c) for c in clusters], timeout_ms), list(self.rets)

    def unlink_clusters_v2(self, clusters: Sequence[ClusterTuple], timeout_ms: int,
                           force: bool) -> tuple[int, list[int]]:
        return self._rec("unlink_clusters_v2", [tuple(c) for c in clusters], timeout_ms, force), list(self.rets)

    def switch_role_v2(self, role: str, options: Mapping[str, str]) -> int:
        return self._rec("switch_role_v2", role, dict(options))

    def register_cache(self, cache_desc: CacheDescTuple, addrs: Sequence[int],
                       cache_keys: Sequence[CacheKeyTuple],
                       remote_accessible: bool) -> tuple[int, tuple[int, list[list[int]]]]:
        status = self._rec("register_cache", cache_desc, list(addrs), list(cache_keys), remote_accessible)
        cache_id = self.next_id
        self.next_id += 1
        return status, (cache_id, [list(addrs)])

    def unregister_cache(self, cache_id: int) -> int:
        return self._rec("unregister_cache", cache_id)

    def allocate_cache_v2(self, cache_desc: CacheDescTuple,
                          cache_keys: Sequence[CacheKeyTuple]) -> tuple[int, tuple[int, list[list[int]]]]:
        status = self._rec("allocate_cache_v2", cache_desc, list(cache_keys))
        cache_id = self.next_id
        self.next_id += 1
        return status, (cache_id, [[0x1000 * (i + 1) for i in range(cache_desc[0])]])

    def deallocate_cache_v2(self, cache_id: int) -> int:
        return self._rec("deallocate_cache_v2", cache_id)

    def remove_cache_key_v2(self, cache_key: CacheKeyTuple) -> int:
        return self._rec("remove_cache_key_v2", cache_key)

    def pull_cache_v2(self, dst_cache_id: int, cache_key: CacheKeyTuple, param: PullParamTuple) -> int:
        return self._rec("pull_cache_v2", dst_cache_id, cache_key, param)

    def transfer_cache_v2(self, task_id: int, cfg: TransferCfgTuple, block_cfg: BlockCfgTuple) -> int:
        return self._rec("transfer_cache_v2", task_id, cfg, block_cfg)

    def copy_cache_v2(self, param: CopyParamTuple) -> int:
        return self._rec("copy_cache_v2", param)

    def copy_blocks_v2(self, cache_id: int, copy_block_info: Sequence[tuple[int, int]]) -> int:
        return self._rec("copy_blocks_v2", cache_id, list(copy_block_info))

    def swap_blocks_v2(self, src: tuple[int, Sequence[Sequence[int]]], dst: tuple[int, Sequence[Sequence[int]]],
                       block_size: int, swap_type: int, block_mapping: Sequence[tuple[int, int]]) -> int:
        return self._rec("swap_blocks_v2", src, dst, block_size, swap_type, list(block_mapping))

    def check_capacity_v2(self, size: int) -> int:
        return self._rec("check_capacity_v2", size)

    def remap_registered_memory(self, mem_infos: Sequence[MemInfoTuple]) -> int:
        return self._rec("remap_registered_memory", list(mem_infos))


def _as_wrapper(fake: RecordingWrapper) -> Wrapper:
    return fake  # type-checks that the fake implements the protocol


@contextmanager
def use_fake() -> Iterator[RecordingWrapper]:
    """A fresh fake engine for the block; any LLMDataDist still initialized is finalized after."""
    from kvdd.llm_datadist import LLMDataDist

    leftover = LLMDataDist.llm_engine_instance
    if leftover is not None:  # an earlier test's instance: one engine per process
        leftover.finalize()
    fake = RecordingWrapper()
    with _engine.use_wrapper(_as_wrapper(fake)):
        try:
            yield fake
        finally:
            instance = LLMDataDist.llm_engine_instance
            if instance is not None:
                instance.finalize()
            LLMDataDist.llm_engine_instance = None


# -- shared fixtures and helpers of the test_pkg_* modules ------------------------------------

import pytest  # noqa: E402

from kvdd.llm_datadist import (  # noqa: E402
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from kvdd.llm_datadist.v2.cache_manager import CacheManager  # noqa: E402


@pytest.fixture
def fake() -> Iterator[RecordingWrapper]:
    """A fresh recording engine for one test."""
    with use_fake() as engine:
        yield engine


CM_OPTIONS = {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1"}


def started(options: Mapping[str, str] | None = None, role: LLMRole = LLMRole.DECODER,
            cluster_id: int = 2) -> LLMDataDist:
    """An LLMDataDist initialized over the current engine (cache-manager, remote-accessible)."""
    dd = LLMDataDist(role, cluster_id)
    dd.init(dict(CM_OPTIONS if options is None else options))
    return dd


def desc(num_tensors: int = 4, shape: Sequence[int] = (8, 16), **kw: Any) -> CacheDesc:
    """A float16 CacheDesc."""
    return CacheDesc(num_tensors, list(shape), DataType.DT_FLOAT16, **kw)


def param_invalid(exc: pytest.ExceptionInfo[LLMException]) -> bool:
    """The raised LLMException carries LLM_PARAM_INVALID."""
    return exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def raised(call: Callable[[], Any], *also: type[BaseException]) -> Any:
    """What ``call`` raised: an LLMException's status code, else the type of the TypeError or
    ValueError (or of one of ``also``); pytest fails the test when it raised nothing else."""
    with pytest.raises((TypeError, ValueError, *also, LLMException)) as exc:
        call()
    value = exc.value
    return value.status_code if isinstance(value, LLMException) else type(value)


def outcome(fake: RecordingWrapper, call: Callable[[], Any]) -> Any:
    """The raised error (status for LLMException, else the type), asserting no engine call."""
    before = len(fake.names())
    value = raised(call)
    assert len(fake.names()) == before, "a Python-level error reached the engine"
    return value


def blocks(mgr: CacheManager, n: int = 4) -> Cache:
    """``n`` tensors registered as a blocks cache (addresses 0x1000, 0x2000, ...; key cluster 2)."""
    return mgr.register_blocks_cache(desc(n), [0x1000 * (i + 1) for i in range(n)], BlocksCacheKey(2, 0))


def contiguous(mgr: CacheManager, n: int = 4) -> Cache:
    """``n`` tensors registered as a contiguous cache (addresses 0x1000, 0x2000, ...)."""
    return mgr.register_cache(desc(n), [0x1000 * (i + 1) for i in range(n)])
