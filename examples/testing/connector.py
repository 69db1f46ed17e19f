"""A small KV-transfer connector of the kind a serving engine has, written against kvdd's API.

It is what ``test_connector.py`` tests with kvdd's pytest plugin: the decode side pulls a
request's KV blocks from prefill, and on ``LLM_TIMEOUT`` (after which LLM-DataDist treats the link
as broken) it relinks and retries, up to ``retries`` times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import kvdd


@dataclass
class DecodeConnector:
    """Pulls KV blocks for the decode instance ``dd`` from the prefill ``cluster``.

    Parameters
    ----------
    dd : kvdd.LlmDataDist
        The decode instance (initialized).
    cluster : kvdd.ClusterInfo
        The prefill instance to link to.
    retries : int
        Pull attempts after the first that may follow a timeout.
    """

    dd: kvdd.LlmDataDist
    cluster: kvdd.ClusterInfo
    retries: int = 2
    relinks: int = 0

    def connect(self) -> None:
        self.dd.link_llm_clusters([self.cluster], timeout_ms=5000)

    def close(self) -> None:
        self.dd.unlink_llm_clusters([self.cluster], force=True)

    def pull_request(self, remote_cache: kvdd.CacheIndex, local_cache: kvdd.Cache,
                     remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> None:
        """Pull ``remote_blocks`` into ``local_blocks`` (PullKvBlocks), relinking after a timeout.

        Raises
        ------
        kvdd.LLMTimeoutError
            The last attempt timed out too.
        kvdd.LLMError
            Any other status, at once (retrying would not help).
        """
        for attempt in range(self.retries + 1):
            try:
                self.dd.pull_kv_blocks(remote_cache, local_cache, remote_blocks, local_blocks)
                return
            except kvdd.LLMTimeoutError:
                if attempt == self.retries:
                    raise
                self.close()
                self.connect()
                self.relinks += 1
