"""The argument space of the simulator-vs-model machine (test_sim_vs_model.py): option values,
layer ranges, extension parameters, sizes, batch and block indices, shapes, data types, and the
faults it arms.  Mostly valid values, with the invalid and edge values SEMANTICS.md names mixed in.
"""

from __future__ import annotations

from hypothesis import strategies as st

import kvdd
from kvdd import KvCacheExtParam
from kvdd.sim import faults

__all__ = ["DEVICE_IDS", "LISTENS", "WAITS", "COMM_RES", "RETRIES", "STATUSES", "DTYPES_OK", "DTYPES_BAD",
           "KINDS", "options", "layer_range", "EXT", "SIZES", "BATCH", "HUGE_BLOCK", "BLOCKS", "shapes"]

DEVICE_IDS = ["0", "0", "0", "1", " 2", "+3", "", "-1", "abc", "0;", "0;1", "1x"]
LISTENS = ["127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:00", "127.0.0.1", "localhost:0", "1.1.1.1:-1",
           "127.0.0.1:x"]
WAITS = ["0", "1000", "abc", "+5", ""]
COMM_RES = ['{"version": "1.0"}', '{"version": "1.2"}', '{"version": "1.9"}', "mock"]
RETRIES = ["1", "5", "0", "101", "x"]
STATUSES = [kvdd.Status.LLM_TIMEOUT, kvdd.Status.LLM_LINK_FAILED, kvdd.Status.LLM_KV_CACHE_NOT_EXIST,
            kvdd.Status.LLM_FAILED, kvdd.Status.LLM_OUT_OF_MEMORY, kvdd.Status.LLM_UNLINK_FAILED]
DTYPES_OK = [3, 3, 3, 1, 2, 27, 9, 13, 29]  # INT32 x3, FLOAT16, INT8, BF16, INT64, STRING, INT4
DTYPES_BAD = [28, 5, 43, 200, -1]
KINDS = list(faults.CALL_KINDS)


def options(data: st.DataObject, backend: str, good: bool) -> dict[str, str]:
    """Initialize options: mostly valid for ``backend``; with ``good`` False anything goes."""
    opts: dict[str, str] = {}
    draw = data.draw
    if good:
        opts["llm.DeviceId"] = "0"
        if backend == "hixl" or draw(st.booleans()):
            opts["llm.ListenIpInfo"] = "127.0.0.1:0"
        if backend == "hixl":
            opts["llm.TransferBackend"] = "hixl"
        return opts
    if draw(st.integers(0, 9)) > 0:
        opts["llm.DeviceId"] = draw(st.sampled_from(DEVICE_IDS))
    if draw(st.booleans()):
        opts["llm.ListenIpInfo"] = draw(st.sampled_from(LISTENS))
    if backend == "hixl":
        opts["llm.TransferBackend"] = draw(st.sampled_from(["hixl", "hixl", "hixl", "foo"]))
    elif draw(st.integers(0, 5)) == 0:
        opts["llm.TransferBackend"] = draw(st.sampled_from(["foo", ""]))
    if draw(st.integers(0, 3)) == 0:
        opts["llm.SyncKvCacheWaitTime"] = draw(st.sampled_from(WAITS))
    if draw(st.integers(0, 3)) == 0:
        opts["llm.LocalCommRes"] = draw(st.sampled_from(COMM_RES))
    if draw(st.integers(0, 4)) == 0:
        opts["llm.LinkRetryCount"] = draw(st.sampled_from(RETRIES))
    return opts


def layer_range() -> st.SearchStrategy[tuple[int, int]]:
    return st.one_of(
        st.just((-1, -1)), st.just((-1, -1)),
        st.sampled_from([(0, 2**31 - 1), (3, 2**31 - 1), (-1, 2**31 - 1), (2**31 - 1, 2**31 - 1)]),
        st.tuples(st.integers(-1, 5), st.integers(-1, 5)).map(lambda r: (min(r), max(r))),
        st.tuples(st.integers(-3, 6), st.integers(-3, 6)),
    )


EXT = st.one_of(
    st.none(), st.none(), st.none(),
    st.builds(KvCacheExtParam, src_layer_range=layer_range(), dst_layer_range=layer_range(),
              tensor_num_per_layer=st.sampled_from([2, 2, 2, 1, 1, 3, 5, 0, 255])),
)
SIZES = st.sampled_from([-1] * 8 + [0, -2, 1, 16, 32, 64, 65, 128, 512, 2**40])
BATCH = st.one_of(st.integers(0, 1), st.integers(0, 1), st.integers(0, 8), st.just(2**32 - 1))
HUGE_BLOCK = 2**64 - 1  # the largest uint64 block index (once an engine OverflowError)
BLOCKS = st.one_of(
    st.lists(st.integers(0, 3), min_size=1, max_size=4),
    st.lists(st.one_of(st.integers(0, 9), st.just(HUGE_BLOCK)), min_size=0, max_size=6),
)


def shapes() -> st.SearchStrategy[tuple[int, ...]]:
    good = st.lists(st.integers(1, 8), min_size=1, max_size=3).map(tuple)
    bad = st.sampled_from([(), (0,), (4, 0), (-1, 16), (1,) * 32, (1,) * 31, (2**40, 2**40),
                           (2**31,), (2, 5), (16, 1), (3, 3)])
    return st.one_of(good, good, good, bad)
