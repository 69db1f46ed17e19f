"""Per-call time of a small PullKvBlocks: C++ through the simulated CANN root vs kvdd's Python API.

Both pull one 64-byte block of a one-tensor ``[4, 64]`` uint8 cache between two instances in one
process, on the simulator. Run after ``source DEST/set_env.sh`` with the C++ side built::

    g++ -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=0 -O2 -I$ASCEND_HOME_PATH/include \\
        examples/cpp/pull_overhead.cpp -L$ASCEND_HOME_PATH/lib64 -lllm_datadist -lmetadef \\
        -lascendcl -lpthread -o pull_overhead
    python examples/cpp/pull_overhead.py ./pull_overhead [ROUNDS]

The two are measured alternately (ROUNDS times each, default 3) so that load on the machine hits
both alike; it prints each side's median and their ratio (C++ / Python).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmRole

CALLS, BATCHES = 2000, 7


def python_ns_per_call(port: int) -> float:
    with kvdd.LlmDataDist(1, LlmRole.PROMPT, backend="sim") as prompt, \
            kvdd.LlmDataDist(2, LlmRole.DECODER, backend="sim") as decoder:
        prompt.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"127.0.0.1:{port}"})
        decoder.initialize({kvdd.OPTION_DEVICE_ID: "1"})
        desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(4, 64))
        src = [np.full((4, 64), 0x5A, np.uint8)]
        dst = [np.zeros((4, 64), np.uint8)]
        src_id = prompt.register_kv_cache(desc, kvdd.tensor_addrs(src))
        dst_id = decoder.register_kv_cache(desc, kvdd.tensor_addrs(dst))
        peer = ClusterInfo(remote_cluster_id=1, local_ip_infos=[IpInfo("127.0.0.1")],
                           remote_ip_infos=[IpInfo("127.0.0.1", port)])
        decoder.link_llm_clusters([peer])
        index, cache = CacheIndex(cluster_id=1, cache_id=src_id), Cache(cache_id=dst_id)
        per_call = []
        for _ in range(BATCHES):
            start = time.perf_counter()
            for _ in range(CALLS):
                decoder.pull_kv_blocks(index, cache, [2], [1])
            per_call.append((time.perf_counter() - start) / CALLS * 1e9)
        if not (dst[0][1] == 0x5A).all():
            raise RuntimeError("the pull moved the wrong bytes")
        decoder.unlink_llm_clusters([peer])
    return statistics.median(per_call)


def cpp_ns_per_call(binary: str) -> float:
    out = subprocess.run([binary, str(CALLS), str(BATCHES)], capture_output=True, text=True,
                         check=True).stdout
    match = re.search(r"ns_per_call=(\d+)", out)
    if match is None:
        raise RuntimeError(f"unexpected output of {binary}: {out!r}")
    return float(match.group(1))


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    cpp, py = [], []
    for r in range(rounds):
        cpp.append(cpp_ns_per_call(sys.argv[1]))
        py.append(python_ns_per_call(26800 + (os.getpid() + r) % 90))
        print(f"round {r + 1}: C++ {cpp[-1] / 1000:.1f} us/call, Python {py[-1] / 1000:.1f} us/call")
    c, p = statistics.median(cpp), statistics.median(py)
    print(f"PullKvBlocks (64 bytes): C++ through the simulated root {c / 1000:.1f} us/call, "
          f"Python API {p / 1000:.1f} us/call, ratio C++/Python {c / p:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
