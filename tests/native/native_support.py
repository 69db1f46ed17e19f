"""Helpers of the native-binding tests (``kvdd._native._datadist``); conftest.py registers the
fixture.

These tests are specific to the binding; the behaviour of every call is covered by the conformance
suite run with ``KVDD_BACKEND=native``.  They are skipped, with the reason, when this installation
has no native backend; tests that need kvdd's CI test double (which forwards every C++ call to the
simulator engine, see testdouble/) are skipped on a real CANN install.

``recorders`` replaces ``kvdd.sim.engine.SimBackend`` by :class:`Recorder` for one test: the test
double constructs its engine from that module attribute, so every ``NativeBackend`` created in the
test talks to a Recorder, which logs the arguments that reached the engine and its results (and can
override a result), while still running the real simulator.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, ClassVar, NamedTuple

import pytest

from kvdd.types import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, RegisterCfg


def build_config() -> ModuleType | None:
    try:
        return importlib.import_module("kvdd._build_config")
    except ImportError:
        return None


_CFG = build_config()
NATIVE_BUILT: bool = bool(_CFG is not None and _CFG.NATIVE_BUILT)
NATIVE_TEST_DOUBLE: bool = bool(_CFG is not None and _CFG.NATIVE_TEST_DOUBLE)
NOT_BUILT_REASON = (
    "the native backend is not built in this installation "
    f"({'no _build_config' if _CFG is None else _CFG.NATIVE_REASON})"
)
NEEDS_DOUBLE_REASON = "needs kvdd's CI test double (the native build is against a real CANN install)"


def skip_unless_native() -> None:
    """Skip the calling test module when there is no native backend."""
    if not NATIVE_BUILT:
        pytest.skip(NOT_BUILT_REASON, allow_module_level=True)


def skip_unless_test_double() -> None:
    """Skip the calling test module unless the native backend was built against the test double."""
    skip_unless_native()
    if not NATIVE_TEST_DOUBLE:
        pytest.skip(NEEDS_DOUBLE_REASON, allow_module_level=True)


class Call(NamedTuple):
    name: str
    args: tuple[Any, ...]
    result: Any


def _recorder_class() -> type[Any]:
    from kvdd.sim.engine import SimBackend

    class Recorder(SimBackend):
        """A SimBackend that logs what reaches it through the test double."""

        instances: ClassVar[list[Recorder]] = []

        def __init__(self, cluster_id: int, role: int) -> None:
            super().__init__(cluster_id, role)
            self.ctor_args = (cluster_id, role)
            self.calls: list[Call] = []
            self.overrides: dict[str, Callable[..., Any]] = {}
            Recorder.instances.append(self)

        def _call(self, name: str, *args: Any) -> Any:
            override = self.overrides.get(name)
            result = override(*args) if override is not None else getattr(super(), name)(*args)
            self.calls.append(Call(name, args, result))
            return result

        def last(self, name: str) -> Call:
            matching = [c for c in self.calls if c.name == name]
            assert matching, f"{name} never reached the engine; calls: {self.calls}"
            return matching[-1]

        def initialize(self, options: Mapping[str, str]) -> int:
            result: int = self._call("initialize", options)
            return result

        def finalize(self) -> None:
            self._call("finalize")

        def set_role(self, role: int, options: Mapping[str, str]) -> int:
            result: int = self._call("set_role", role, options)
            return result

        def link_llm_clusters(self, clusters: Sequence[ClusterInfo],
                              timeout_ms: int) -> tuple[int, list[int]]:
            result: tuple[int, list[int]] = self._call("link_llm_clusters", clusters, timeout_ms)
            return result

        def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int,
                                force: bool) -> tuple[int, list[int]]:
            result: tuple[int, list[int]] = self._call("unlink_llm_clusters", clusters,
                                                       timeout_ms, force)
            return result

        def register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[int],
                              cfg: RegisterCfg) -> tuple[int, int]:
            result: tuple[int, int] = self._call("register_kv_cache", cache_desc, addrs, cfg)
            return result

        def unregister_kv_cache(self, cache_id: int) -> int:
            result: int = self._call("unregister_kv_cache", cache_id)
            return result

        def allocate_cache(self, cache_desc: CacheDesc) -> tuple[int, Cache | None]:
            result: tuple[int, Cache | None] = self._call("allocate_cache", cache_desc)
            return result

        def deallocate_cache(self, cache_id: int) -> int:
            result: int = self._call("deallocate_cache", cache_id)
            return result

        def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int,
                          size: int, ext_param: KvCacheExtParam) -> int:
            result: int = self._call("pull_kv_cache", src_cache_index, dst_cache, batch_index,
                                     size, ext_param)
            return result

        def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache,
                           src_blocks: Sequence[int], dst_blocks: Sequence[int],
                           ext_param: KvCacheExtParam) -> int:
            result: int = self._call("pull_kv_blocks", src_cache_index, dst_cache, src_blocks,
                                     dst_blocks, ext_param)
            return result

        def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex,
                          src_batch_index: int, size: int, ext_param: KvCacheExtParam) -> int:
            result: int = self._call("push_kv_cache", src_cache, dst_cache_index,
                                     src_batch_index, size, ext_param)
            return result

        def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex,
                           src_blocks: Sequence[int], dst_blocks: Sequence[int],
                           ext_param: KvCacheExtParam) -> int:
            result: int = self._call("push_kv_blocks", src_cache, dst_cache_index, src_blocks,
                                     dst_blocks, ext_param)
            return result

        def copy_kv_cache(self, src_cache: Cache, dst_cache: Cache, src_batch_index: int,
                          dst_batch_index: int, offset: int, size: int) -> int:
            result: int = self._call("copy_kv_cache", src_cache, dst_cache, src_batch_index,
                                     dst_batch_index, offset, size)
            return result

        def copy_kv_blocks(self, src_cache: Cache, dst_cache: Cache, src_blocks: Sequence[int],
                           dst_blocks_list: Sequence[Sequence[int]]) -> int:
            result: int = self._call("copy_kv_blocks", src_cache, dst_cache, src_blocks,
                                     dst_blocks_list)
            return result

    return Recorder


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The Recorders (engines) created by the test double during one test, in creation order."""
    import kvdd.sim.engine as engine

    recorder = _recorder_class()
    recorder.instances = []
    monkeypatch.setattr(engine, "SimBackend", recorder)
    made: list[Any] = recorder.instances
    yield made
