"""Tests of ``connector.py`` as a user writes them with kvdd's pytest plugin (docs/testing.md).

Run them here with ``pytest`` (the simulator, peers in this process), with
``pytest --kvdd-peer process`` (prefill in another process), and on an Atlas node with
``pytest --kvdd-backend native`` (tests that inject faults are skipped there: fault injection is
the simulator's).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import kvdd
from kvdd import CacheDesc, DataType, Status
from kvdd.testing.peers import PeerCache, RegisteredCache
from kvdd.testing.pytest_plugin import Faults, PrefillDecodePair

from connector import DecodeConnector

DESC = CacheDesc(num_tensors=4, data_type=DataType.DT_BF16, shape=(16, 128))  # 4 x 16 blocks
CacheFactory = Callable[..., RegisteredCache]


def _block(data: bytes, i: int) -> bytes:
    size = DESC.stride_nbytes
    return data[i * size:(i + 1) * size]


def _connected(pair: PrefillDecodePair, cache: CacheFactory) -> tuple[DecodeConnector, PeerCache, RegisteredCache]:
    src = pair.prefill.register_cache(DESC, fill=1)  # before linking: a link sees what existed
    dst = cache(pair.decode, DESC)
    conn = DecodeConnector(pair.decode, pair.cluster)
    conn.connect()
    pair.linked = True  # the connector linked: let the fixture unlink at tear-down
    return conn, src, dst


def test_pull_moves_exactly_the_requested_blocks(kvdd_pair: PrefillDecodePair, kvdd_cache: CacheFactory) -> None:
    conn, src, dst = _connected(kvdd_pair, kvdd_cache)
    conn.pull_request(src.index(), dst.cache, [3, 4, 9], [0, 1, 15])
    for k in range(DESC.num_tensors):
        theirs = kvdd_pair.prefill.read(src, k)
        mine = dst.read(k)
        for s, d in ((3, 0), (4, 1), (9, 15)):
            assert _block(mine, d) == _block(theirs, s)
        untouched = [i for i in range(16) if i not in (0, 1, 15)]
        assert all(_block(mine, i) == bytes(DESC.stride_nbytes) for i in untouched)


def test_one_timeout_is_retried_after_a_relink(kvdd_pair: PrefillDecodePair, kvdd_cache: CacheFactory,
                                               kvdd_faults: Faults) -> None:
    conn, src, dst = _connected(kvdd_pair, kvdd_cache)
    injection = kvdd_faults.inject("pull_kv_blocks", status=Status.LLM_TIMEOUT, count=1)
    conn.pull_request(src.index(), dst.cache, [0], [0])
    assert injection.fired == 1 and conn.relinks == 1
    assert dst.read(0)[:DESC.stride_nbytes] != bytes(DESC.stride_nbytes)


def test_timeouts_past_the_retries_reach_the_caller(kvdd_pair: PrefillDecodePair, kvdd_cache: CacheFactory,
                                                    kvdd_faults: Faults) -> None:
    conn, src, dst = _connected(kvdd_pair, kvdd_cache)
    kvdd_faults.inject("pull_kv_blocks", status="LLM_TIMEOUT")
    with pytest.raises(kvdd.LLMTimeoutError):
        conn.pull_request(src.index(), dst.cache, [0], [0])
    assert conn.relinks == conn.retries
    assert all(dst.read(k) == bytes(DESC.tensor_nbytes) for k in range(DESC.num_tensors))


def test_other_errors_are_not_retried(kvdd_pair: PrefillDecodePair, kvdd_cache: CacheFactory) -> None:
    conn, src, dst = _connected(kvdd_pair, kvdd_cache)
    with pytest.raises(kvdd.LLMParamInvalidError):  # block 16 is past the 16-block cache
        conn.pull_request(src.index(), dst.cache, [0], [16])
    assert conn.relinks == 0
