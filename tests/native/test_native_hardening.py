"""The binding declares only what the real ``llm_datadist.h`` has and value-initializes its structs.

Two defects that a permissive CI double cannot see (VENDOR.md): declaring a status constant that the
real header lacks breaks the first real build that uses it, and a struct filled without
value-initialization carries stack garbage in its reserved bytes on hardware (the real header gives
them no initializer).  These checks read the binding's sources, so they fail on any backend the
moment either regresses; the run against the simulated CANN root in strict mode
(``KVDD_CANN_STRICT_RESERVED=1``, whose library refuses non-zero reserved bytes) checks the same
at run time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .native_support import skip_unless_test_double

_NATIVE = Path(__file__).resolve().parents[2] / "kvdd" / "_native"
PXD = _NATIVE / "_cdatadist.pxd"
PYX = _NATIVE / "_datadist.pyx"
#: The binding's sources: the module and the files it includes.
BINDING = (PYX, *sorted(_NATIVE.glob("_datadist_*.pxi")))

#: VENDOR.md: the status constants of namespace llm_datadist in llm_datadist.h.
HEADER_STATUSES = {
    f"LLM_{name}" for name in (
        "SUCCESS", "FAILED", "WAIT_PROC_TIMEOUT", "KV_CACHE_NOT_EXIST", "PARAM_INVALID",
        "NOT_YET_LINK", "ALREADY_LINK", "LINK_FAILED", "UNLINK_FAILED",
        "NOTIFY_PROMPT_UNLINK_FAILED", "CLUSTER_NUM_EXCEED_LIMIT", "PROCESSING_LINK",
        "DEVICE_OUT_OF_MEMORY", "EXIST_LINK", "FEATURE_NOT_ENABLED", "TIMEOUT", "LINK_BUSY",
        "OUT_OF_MEMORY",
    )
}

#: Every llm_datadist struct the binding may fill (all end in reserved bytes upstream).
STRUCTS = ("IpInfo", "ClusterInfo", "CacheIndex", "CacheDesc", "Cache", "KvCacheExtParam",
           "RegisterCfg")

pytestmark = pytest.mark.skipif(not PYX.is_file(), reason="needs kvdd's source tree")


def _code(*paths: Path) -> str:
    """The files without comments and docstrings (declarations only)."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in paths)
    text = re.sub(r'"""(?:.|\n)*?"""', "", text)
    return re.sub(r"#[^\n]*", "", text)


def test_pxd_declares_only_the_18_header_statuses() -> None:
    declared = set(re.findall(r"\bconst\s+Status\s+(\w+)", _code(PXD)))
    assert len(HEADER_STATUSES) == 18
    assert declared == HEADER_STATUSES, (
        f"not in llm_datadist.h: {sorted(declared - HEADER_STATUSES)}; "
        f"missing: {sorted(HEADER_STATUSES - declared)}")


def test_binding_uses_only_declared_statuses() -> None:
    used = set(re.findall(r"\bLLM_[A-Z_]+\b", _code(*BINDING)))
    assert used <= HEADER_STATUSES, sorted(used - HEADER_STATUSES)


def _struct_locals(code: str) -> list[tuple[str, str, str | None]]:
    pattern = re.compile(
        r"\bcdef\s+(" + "|".join(STRUCTS) + r")\s+(\w+)\s*(?:=\s*(\w+)\s*\(\s*\))?\s*$",
        re.MULTILINE)
    return [(m.group(1), m.group(2), m.group(3)) for m in pattern.finditer(code)]


def test_every_struct_the_binding_fills_is_value_initialized() -> None:
    code = _code(*BINDING)
    found = _struct_locals(code)
    # The binding fills at least one of each kind it passes by value or reference.
    assert {t for t, _, _ in found} >= {"IpInfo", "CacheIndex", "CacheDesc", "Cache",
                                         "KvCacheExtParam", "RegisterCfg"}, found
    bad = [f"cdef {t} {name}" for t, name, init in found if init != t]
    assert not bad, f"default-initialized (reserved bytes = stack garbage on hardware): {bad}"
    # Structs created inside containers are value-initialized temporaries too.
    for m in re.finditer(r"push_back\(\s*(" + "|".join(STRUCTS) + r")\b(.)", code):
        assert m.group(2) == "(", f"push_back of a {m.group(1)} that is not T(): {m.group(0)}"


def test_the_check_catches_a_default_initialized_struct() -> None:
    # The checker itself must fail on the defect it looks for.
    sample = "    cdef CacheDesc desc\n    cdef Cache cache = Cache()\n    cdef Cache other = CacheDesc()\n"
    found = _struct_locals(sample)
    assert [(t, n, i) for t, n, i in found if i != t] == [("CacheDesc", "desc", None),
                                                         ("Cache", "other", "CacheDesc")]


# ---- run time: the simulated CANN root refuses non-zero reserved bytes in strict mode ----------

def _strict_calls() -> list[tuple[str, Callable[[Any, Any], object]]]:
    from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, RegisterCfg

    desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(4, 16))
    far = ClusterInfo(remote_cluster_id=9, remote_ip_infos=(IpInfo("127.0.0.1", 1),),
                      local_ip_infos=(IpInfo("127.0.0.1", 0),))
    index = CacheIndex(9, 1, 0)
    return [
        ("RegisterKvCache", lambda nb, a: nb.register_kv_cache(desc, [a], RegisterCfg())),
        ("LinkLlmClusters", lambda nb, a: nb.link_llm_clusters([far], 100)),
        ("UnlinkLlmClusters", lambda nb, a: nb.unlink_llm_clusters([far], 100, True)),
        ("AllocateCache", lambda nb, a: nb.allocate_cache(desc)),
        ("PullKvCache", lambda nb, a: nb.pull_kv_cache(index, Cache(1, (a,), desc), 0, -1, None)),
        ("PullKvBlocks", lambda nb, a: nb.pull_kv_blocks(index, Cache(1, (a,), desc), [0], [0],
                                                         None)),
        ("PushKvCache", lambda nb, a: nb.push_kv_cache(Cache(1, (a,), desc), index, 0, -1, None)),
        ("PushKvBlocks", lambda nb, a: nb.push_kv_blocks(Cache(1, (a,), desc), index, [0], [0],
                                                         None)),
        ("CopyKvCache", lambda nb, a: nb.copy_kv_cache(Cache(1), Cache(1), 0, 0, 0, -1)),
        ("CopyKvBlocks", lambda nb, a: nb.copy_kv_blocks(Cache(1), Cache(1), [0], [[0]])),
    ]


@pytest.mark.parametrize(("method", "call"), _strict_calls(), ids=[m for m, _ in _strict_calls()])
def test_strict_reserved_mode_accepts_every_struct_the_binding_passes(
        method: str, call: Callable[[Any, Any], object], monkeypatch: pytest.MonkeyPatch) -> None:
    # KVDD_CANN_STRICT_RESERVED=1: the simulated root returns LLM_FAILED, saying so, for a struct
    # argument with a non-zero reserved byte (what a default-initialized struct carries on CANN).
    skip_unless_test_double()
    from kvdd import OPTION_DEVICE_ID, Status
    from kvdd._native._datadist import NativeBackend

    monkeypatch.setenv("KVDD_CANN_STRICT_RESERVED", "1")
    memory = np.zeros(64, dtype=np.uint8)
    nb = NativeBackend(5, 2)
    try:
        assert nb.initialize({OPTION_DEVICE_ID: "0"}) == Status.LLM_SUCCESS
        result = call(nb, int(memory.ctypes.data))
        status = result[0] if isinstance(result, tuple) else result
        detail = nb.last_error_detail() or ""
        assert "reserved" not in detail, detail
        assert status != Status.LLM_FAILED, detail  # refused before the simulator saw it
    finally:
        nb.finalize()
