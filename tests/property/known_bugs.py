"""Engine bugs the property suite found, detected by probing the engine under test.

Each probe runs the smallest call that shows the bug and returns True while it is there.  The
property generator avoids a bug's trigger only while its probe fires, and
``test_known_engine_bugs.py`` (which states the expected behaviour and the SEMANTICS.md clause)
xfails only then, so a fix needs no edit here: the probe turns False and everything runs in full.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam

__all__ = ["KNOWN_ENGINE_BUGS", "DESCRIPTIONS"]

DESC = CacheDesc(num_tensors=4, data_type=DataType.DT_INT32, shape=(4, 16))

DESCRIPTIONS = {
    "push_kv_blocks_huge_block_index":
        "PushKvBlocks with a block index >= 2**63 (a valid uint64) raises OverflowError instead of "
        "returning a status (SEMANTICS.md §3.13 step 8)",
    "push_layer_plan_eager":
        "PushKvCache/PushKvBlocks materialize the whole layer plan before the first layer, so a plan "
        "of 2**31 layers (ext range (0, 2**31-1), or num_tensors 2**32-1) runs out of memory instead "
        "of failing at the first bad layer (SEMANTICS.md §3.12 step 7)",
}


def _huge_block_index() -> bool:
    with kvdd.LlmDataDist(1, kvdd.LlmRole.MIX, backend="sim") as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        try:
            dd.push_kv_blocks(Cache(cache_id=5, cache_desc=DESC), CacheIndex(2, 1), [0], [2**64 - 1])
        except kvdd.LLMError:
            return False
        except OverflowError:
            return True
    return False


def _eager_plan() -> bool:
    """A 2**20-layer plan: an eager engine allocates tens of MB before failing; a lazy one ~0."""
    with kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT, backend="sim") as p, \
            kvdd.LlmDataDist(2, kvdd.LlmRole.DECODER, backend="sim") as d:
        p.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        d.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        pm = [np.zeros(256, np.uint8) for _ in range(4)]
        dm = [np.zeros(256, np.uint8) for _ in range(4)]
        pid = p.register_kv_cache(DESC, kvdd.tensor_addrs(pm))
        did = d.register_kv_cache(DESC, kvdd.tensor_addrs(dm))
        port = p.listen_port
        assert port is not None
        d.link_llm_clusters([ClusterInfo(remote_cluster_id=1, local_ip_infos=(IpInfo("127.0.0.1"),),
                                         remote_ip_infos=(IpInfo("127.0.0.1", port),))])
        ext = KvCacheExtParam((0, 2**20), (0, 2**20), 2)
        tracemalloc.start()
        try:
            d.push_kv_cache(Cache(cache_id=did, cache_desc=DESC), CacheIndex(1, pid), ext_param=ext)
        except kvdd.LLMError:
            pass
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        return peak > 16 << 20


_PROBES = {"push_kv_blocks_huge_block_index": _huge_block_index, "push_layer_plan_eager": _eager_plan}

#: The bugs present in the engine under test (probed once, at import).
KNOWN_ENGINE_BUGS: frozenset[str] = frozenset(name for name, probe in _PROBES.items() if probe())
