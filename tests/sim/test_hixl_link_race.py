"""Two threads linking one HIXL address at once (SEMANTICS.md §3.5, hixl: one connection per
remote address): the one that connects second gets LLM_ALREADY_LINK, also when both passed the
"already connected" check before either connected (an injected link delay holds them there)."""

from __future__ import annotations

import threading

import kvdd
from kvdd import ClusterInfo, IpInfo, LLMError, LlmRole, Status
from kvdd.sim import faults

LOCALHOST = "127.0.0.1"


def test_the_second_of_two_concurrent_links_to_one_address_is_already_link() -> None:
    with kvdd.LlmDataDist(1, LlmRole.PROMPT, backend="sim") as p, \
            kvdd.LlmDataDist(2, LlmRole.DECODER, backend="sim") as d:
        p.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0",
                      kvdd.OPTION_TRANSFER_BACKEND: "hixl"})
        d.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0",
                      kvdd.OPTION_TRANSFER_BACKEND: "hixl"})
        port = p.listening_port
        statuses: dict[int, int] = {}
        start = threading.Barrier(2)

        def link(remote_id: int) -> None:
            info = ClusterInfo(remote_cluster_id=remote_id, remote_ip_infos=[IpInfo(LOCALHOST, port)],
                               local_ip_infos=[IpInfo(LOCALHOST, 0)])
            start.wait()
            try:
                statuses[remote_id] = d.link_llm_clusters([info], timeout_ms=5000)[0]
            except LLMError as exc:
                statuses[remote_id] = (exc.rets or [-1])[0]

        # both threads pass the check of hixl's connected addresses, then wait 0.3 s each
        with faults.inject("link", delay_ms=300, instance=2):
            threads = [threading.Thread(target=link, args=(i,)) for i in (7, 8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
        assert sorted(statuses.values()) == [Status.LLM_SUCCESS, Status.LLM_ALREADY_LINK], statuses
