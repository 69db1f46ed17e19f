"""The compiled path of in-process transfers (compiled: kvdd/sim/_fastpath.pyx)."""

from typing import Final, final

__all__ = ["ENV_VAR", "FastTransfers", "MAX_PAIRS", "set_enabled"]

ENV_VAR: Final[str]
MAX_PAIRS: Final[int]

def set_enabled(on: bool) -> bool: ...

@final
class FastTransfers:
    """The compiled transfer path of one simulator instance: True = done, False = declined."""

    enabled: bool
    def __new__(cls, backend: object) -> FastTransfers: ...
    @property
    def taken(self) -> int: ...
    @property
    def declined(self) -> int: ...
    def pull_kv_cache(self, src_cache_index: object, dst_cache: object, batch_index: object = 0,
                      size: object = -1, ext_param: object = None) -> bool: ...
    def pull_kv_blocks(self, src_cache_index: object, dst_cache: object, src_blocks: object,
                       dst_blocks: object, ext_param: object = None) -> bool: ...
    def push_kv_cache(self, src_cache: object, dst_cache_index: object, src_batch_index: object = 0,
                      size: object = -1, ext_param: object = None) -> bool: ...
    def push_kv_blocks(self, src_cache: object, dst_cache_index: object, src_blocks: object,
                       dst_blocks: object, ext_param: object = None) -> bool: ...
