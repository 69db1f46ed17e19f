# decode.py PORT CACHE_ID: links to prefill in the other process and pulls two blocks
import sys, numpy as np, kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo
from kvdd.secret import SecretError, load_secret

if len(sys.argv) != 3:
    sys.exit("usage: python examples/decode.py PORT CACHE_ID  (both printed by examples/prefill.py)")
port, remote_id = int(sys.argv[1]), int(sys.argv[2])
try:  # the link proves the fabric secret prefill holds: check this side's first
    load_secret()
except SecretError as exc:
    sys.exit(f"examples/decode.py: FAILED: no usable fabric secret: {exc}")
with kvdd.LlmDataDist(cluster_id=2, role=kvdd.LlmRole.DECODER, backend="sim") as dd:
    dd.initialize({kvdd.OPTION_DEVICE_ID: "1"})
    kv = [kvdd.empty((8, 1024), np.uint8) for _ in range(4)]        # zero-filled, shareable memory
    local_id = dd.register_kv_cache(CacheDesc(4, DataType.DT_UINT8, (8, 1024)), kvdd.tensor_addrs(kv))
    prefill = ClusterInfo(remote_cluster_id=1, local_ip_infos=[IpInfo("127.0.0.1")],
                          remote_ip_infos=[IpInfo("127.0.0.1", port)])
    try:
        dd.link_llm_clusters([prefill])
    except kvdd.LLMLinkFailedError as exc:  # e.g. another secret, or no prefill on that port
        sys.exit(f"examples/decode.py: FAILED: cannot link to prefill at 127.0.0.1:{port}: {exc}")
    dd.pull_kv_blocks(CacheIndex(1, remote_id), Cache(local_id), src_blocks=[5, 2], dst_blocks=[0, 1])
    assert all((kv[k][:2] == k).all() and (kv[k][2:] == 0).all() for k in range(4))
    dd.unlink_llm_clusters([prefill])
    print("pulled 2 blocks x 4 tensors from the prefill process, bytes verified")
