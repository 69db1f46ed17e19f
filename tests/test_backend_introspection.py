"""``kvdd.backend.link_data_path``: the documented way to ask how a link moves bytes."""

from __future__ import annotations

import numpy as np

import kvdd
from kvdd import OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO, ClusterInfo, IpInfo, LlmRole
from kvdd.backend import link_data_path


def test_in_process_link_and_no_link() -> None:
    with kvdd.LlmDataDist(1, LlmRole.PROMPT, backend="sim") as p, \
            kvdd.LlmDataDist(2, LlmRole.DECODER, backend="sim") as d:
        p.initialize({OPTION_DEVICE_ID: "0", OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        d.initialize({OPTION_DEVICE_ID: "1"})
        kv = [np.zeros((2, 64), np.uint8)]
        p.register_kv_cache(kvdd.CacheDesc(1, kvdd.DataType.DT_UINT8, (2, 64)), kvdd.tensor_addrs(kv))
        assert link_data_path(d.backend, 1) is None  # not linked yet
        c = ClusterInfo(remote_cluster_id=1, local_ip_infos=[IpInfo("127.0.0.1")],
                        remote_ip_infos=[IpInfo("127.0.0.1", p.listening_port)])
        d.link_llm_clusters([c])
        assert link_data_path(d.backend, 1) == "in_process"
        assert link_data_path(d.backend, 3) is None
        d.unlink_llm_clusters([c])
        assert link_data_path(d.backend, 1) is None


def test_a_backend_that_does_not_say() -> None:
    class Quiet:
        pass

    class Odd:
        def link_data_path(self, cluster: int) -> object:
            return 42

    assert link_data_path(Quiet(), 1) is None  # type: ignore[arg-type]
    assert link_data_path(Odd(), 1) is None  # type: ignore[arg-type]
