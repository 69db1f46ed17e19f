"""Stub of the compiled native backend (kvdd/_native/_datadist.pyx)."""

from collections.abc import Mapping, Sequence

from typing_extensions import disjoint_base

from kvdd.types import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, RegisterCfg

__all__ = ["NativeBackend", "build_info", "header_constants"]

def header_constants() -> dict[str, str | int]: ...
def build_info() -> dict[str, object]: ...

@disjoint_base
class _Instance:
    """The C++ instance and its life-cycle calls (the base of :class:`NativeBackend`)."""

    def __init__(self, cluster_id: int, role: int) -> None: ...
    @property
    def listen_port(self) -> int | None: ...
    def initialize(self, options: Mapping[str, str]) -> int: ...
    def finalize(self) -> None: ...
    def last_error_detail(self) -> str | None: ...
    def set_role(self, role: int, options: Mapping[str, str]) -> int: ...

class NativeBackend(_Instance):
    def link_llm_clusters(
        self, clusters: Sequence[ClusterInfo], timeout_ms: int
    ) -> tuple[int, list[int]]: ...
    def unlink_llm_clusters(
        self, clusters: Sequence[ClusterInfo], timeout_ms: int, force: bool
    ) -> tuple[int, list[int]]: ...
    def register_kv_cache(
        self, cache_desc: CacheDesc, addrs: Sequence[int], cfg: RegisterCfg
    ) -> tuple[int, int]: ...
    def unregister_kv_cache(self, cache_id: int) -> int: ...
    def allocate_cache(self, cache_desc: CacheDesc) -> tuple[int, Cache | None]: ...
    def deallocate_cache(self, cache_id: int) -> int: ...
    def pull_kv_cache(
        self,
        src_cache_index: CacheIndex,
        dst_cache: Cache,
        batch_index: int,
        size: int,
        ext_param: KvCacheExtParam | None,
    ) -> int: ...
    def pull_kv_blocks(
        self,
        src_cache_index: CacheIndex,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None,
    ) -> int: ...
    def push_kv_cache(
        self,
        src_cache: Cache,
        dst_cache_index: CacheIndex,
        src_batch_index: int,
        size: int,
        ext_param: KvCacheExtParam | None,
    ) -> int: ...
    def push_kv_blocks(
        self,
        src_cache: Cache,
        dst_cache_index: CacheIndex,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None,
    ) -> int: ...
    def copy_kv_cache(
        self,
        src_cache: Cache,
        dst_cache: Cache,
        src_batch_index: int,
        dst_batch_index: int,
        offset: int,
        size: int,
    ) -> int: ...
    def copy_kv_blocks(
        self,
        src_cache: Cache,
        dst_cache: Cache,
        src_blocks: Sequence[int],
        dst_blocks_list: Sequence[Sequence[int]],
    ) -> int: ...
