"""A simulator peer in its own process, for the peer-kill stress test (run as a script).

``python peer_child.py CLUSTER_ID NUM_TENSORS ROWS ROW_BYTES SEED`` initializes a listening
instance, registers a source cache (deterministic pattern from SEED) and a zeroed destination
cache, prints ``ready PORT SRC_ID DST_ID`` and then answers commands on stdin, one per line:
``digest`` (sha256 of the destination cache's bytes) and ``exit``.  It is meant to be killed.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

import kvdd


def main() -> None:
    cid, n, rows, row_bytes, seed = (int(a) for a in sys.argv[1:6])
    dd = kvdd.LlmDataDist(cid, kvdd.LlmRole.PROMPT, backend="sim")
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    desc = kvdd.CacheDesc(num_tensors=n, data_type=kvdd.DataType.DT_UINT8, shape=(rows, row_bytes))
    rng = np.random.default_rng(seed)
    src = [rng.integers(0, 256, rows * row_bytes, dtype=np.uint8) for _ in range(n)]
    dst = [np.zeros(rows * row_bytes, np.uint8) for _ in range(n)]
    src_id = dd.register_kv_cache(desc, kvdd.tensor_addrs(src))
    dst_id = dd.register_kv_cache(desc, kvdd.tensor_addrs(dst))
    print("ready", dd.listen_port, src_id, dst_id, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "digest":
            h = hashlib.sha256()
            for d in dst:
                h.update(d.tobytes())
            print(h.hexdigest(), flush=True)
        elif cmd == "exit":
            break
    dd.finalize()


if __name__ == "__main__":
    main()
