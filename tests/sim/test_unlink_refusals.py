"""A non-force unlink the peer does not confirm (SEMANTICS.md §3.6): its status is the peer's
(LLM_FAILED when the peer hangs up without answering), and the error says which peer did not
confirm it, not the detail of an earlier call."""

from __future__ import annotations

import socket
import threading

import pytest

import kvdd
from kvdd import ClusterInfo, IpInfo, LLMError, LlmRole, Status

LOCALHOST = "127.0.0.1"


def test_an_unlink_the_peer_does_not_confirm_says_which_peer() -> None:
    server = socket.create_server((LOCALHOST, 0))  # accepts, then hangs up without a word
    server.settimeout(0.1)
    port = server.getsockname()[1]
    stop = threading.Event()

    def hang_up() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            conn.close()

    t = threading.Thread(target=hang_up, daemon=True)
    t.start()
    try:
        with kvdd.LlmDataDist(2, LlmRole.DECODER, backend="sim") as d:
            d.initialize({kvdd.OPTION_DEVICE_ID: "0"})
            info = ClusterInfo(remote_cluster_id=1, remote_ip_infos=[IpInfo(LOCALHOST, port)],
                               local_ip_infos=[IpInfo(LOCALHOST, 0)])
            with pytest.raises(LLMError) as first:  # an earlier failure with another detail
                d.link_llm_clusters([info], timeout_ms=2000)
            assert "did not confirm the unlink" not in str(first.value)
            with pytest.raises(LLMError) as exc:
                d.unlink_llm_clusters([info])
            assert exc.value.status == Status.LLM_FAILED and exc.value.rets == [Status.LLM_FAILED]
            assert str(exc.value).endswith(
                f"UnlinkLlmClusters: the peer at {LOCALHOST}:{port} did not confirm the unlink")
    finally:
        stop.set()
        t.join(5)
        server.close()
