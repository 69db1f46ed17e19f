# prefill.py: listens, registers a cache, waits for decode to pull, then exits
import sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType
from kvdd.secret import SecretError, load_secret

try:  # the secret decode's link must prove: check it now, not when decode connects
    load_secret()
except SecretError as exc:
    sys.exit(f"examples/prefill.py: FAILED: no usable fabric secret: {exc}")
with kvdd.LlmDataDist(cluster_id=1, role=kvdd.LlmRole.PROMPT, backend="sim") as dd:
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    kv = [kvdd.empty((8, 1024), np.uint8) for _ in range(4)]  # 4 tensors, 8 blocks of 1 KiB, memory
    for k, t in enumerate(kv):                                # a same-host peer maps (kvdd.empty)
        t.fill(k)
    cache_id = dd.register_kv_cache(CacheDesc(4, DataType.DT_UINT8, (8, 1024)), kvdd.tensor_addrs(kv))
    print(dd.listen_port, cache_id, flush=True)                          # tell decode where to look
    print("run examples/decode.py with these two numbers, then press Enter here", file=sys.stderr)
    sys.stdin.readline()                                                  # wait until decode is done
