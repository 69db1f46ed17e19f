"""The owner's compiled serve of a one-run small READ (kvdd._native._small.serve_one_run).

It parses a peer's LEASE_READ payload in C and copies out of the owner's registered memory, so
it is compared, on every field a hostile reader controls (cache id, tensor index, offset and
length near 0 / 2**31 / 2**32 / 2**63 / SMALL_BYTES, payload sizes and run counts), with its
Python twin (:func:`kvdd.sim.fabric.small.serve_small_read`, which serves the same requests when
fault injections are armed): the same answer byte for byte, the same refusals (None = the generic
path decides, which raises ProtocolError there), the cache acquired and released exactly once
when granted, and not one byte read outside the checked run.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdd._native._small import serve_one_run
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.small import serve_small_read
from kvdd.sim.memory import Region
from kvdd.status import PARAM_INVALID, Status

NOT_EXIST = int(Status.LLM_KV_CACHE_NOT_EXIST)
ONE_RUN = struct.Struct("<QIIIqq")


class Owner:
    """What the serve functions need of an owner (no fault injection is armed)."""

    cluster_id = 7
    initialized = True


class Entry:
    """A served cache of ``n`` tensors of ``T`` bytes, each in a region of ``nbytes[k]`` bytes;
    counts its acquisitions and releases."""

    def __init__(self, T: int, nbytes: list[int], n: int | None = None) -> None:
        self.T = T
        self.n = len(nbytes) if n is None else n
        self.arenas = [np.frombuffer(bytes((i * 11 + k) & 0xFF for i in range(b)), dtype=np.uint8).copy()
                       for k, b in enumerate(nbytes)]
        self.regions = [Region(int(a.ctypes.data), len(a), a) for a in self.arenas]
        self.held = 0
        self.releases = 0

    def release(self) -> None:
        self.held -= 1
        self.releases += 1


Grant3 = Callable[[object, object, int], tuple[int, "Entry | None"]]
Grant1 = Callable[[int], tuple[int, "Entry | None"]]


def _grants(entry: Entry, status: int) -> tuple[Grant3, Grant1]:
    """The lease checks, for the compiled serve (owner, served, cache_id) and the Python one
    (cache_id): cache 1 is ``entry`` (granted when ``status`` is 0), any other does not exist."""
    def grant(cache_id: int) -> tuple[int, Entry | None]:
        if cache_id != 1:
            return NOT_EXIST, None
        if status:
            return status, None
        entry.held += 1
        return 0, entry

    def grant3(_owner: object, _served: object, cache_id: int) -> tuple[int, Entry | None]:
        return grant(cache_id)

    return grant3, grant


def _python(entry: Entry, status: int, req: int, payload: bytes) -> bytes | type[Exception]:
    try:
        return serve_small_read(Owner(), _grants(entry, status)[1], req, payload)  # type: ignore[arg-type]
    except (wire.ProtocolError, struct.error) as exc:
        return type(exc)


def _compiled(entry: Entry, status: int, req: int, payload: bytes) -> bytes | None:
    out = serve_one_run(payload, req, _grants(entry, status)[0], Owner(), {}, wire.SMALL_BYTES,
                        PARAM_INVALID, wire.MAGIC, wire.PROTOCOL_VERSION)
    assert out is None or isinstance(out, bytes)
    return out


EDGE = [0, 1, 63, 64, 65, 4095, 4096, wire.SMALL_BYTES - 1, wire.SMALL_BYTES, wire.SMALL_BYTES + 1,
        2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, -1, -64, -(2**31), -(2**63)]
i64 = st.one_of(st.sampled_from(EDGE), st.integers(-(2**63), 2**63 - 1), st.integers(-8, 5000))
u32 = st.one_of(st.sampled_from([0, 1, 2, 3, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([0, 1, 2, 2**32 + 1, 2**64 - 1]), u32, i64, i64, u32,
       st.sampled_from([0, 0, 0, int(Status.LLM_FAILED), NOT_EXIST]),
       st.sampled_from([(4096, [4096, 4096]), (4096, [100, 4096]), (70000, [70000]), (64, [64, 64, 64]),
                        (4096, [4096, 4096, 4096], 2), (0, [16])]))
def test_compiled_serve_matches_its_python_twin(cache_id: int, tensor: int, off: int, n: int,
                                                req: int, status: int,
                                                shape: tuple[int, list[int]] | tuple[int, list[int], int]) -> None:
    payload = ONE_RUN.pack(cache_id, 1, 1, tensor, off, n)
    e1 = Entry(*shape)
    e2 = Entry(*shape)
    want = _python(e1, status, req, payload)
    got = _compiled(e2, status, req, payload)
    if got is None:  # the generic path decides: it must refuse the request
        assert want is wire.ProtocolError
    else:
        assert got == want
    assert e1.held == e2.held == 0 and e1.releases == e2.releases <= 1
    if isinstance(got, bytes) and len(got) > 28:  # DATA + DONE: exactly the checked run
        k = tensor
        assert 0 <= off and off + n <= min(e2.T, e2.regions[k].nbytes)
        assert got[12:12 + n] == e2.arenas[k][off:off + n].tobytes()


@pytest.mark.parametrize("payload", [
    b"", b"\0" * 35, b"\0" * 37,
    ONE_RUN.pack(1, 2, 1, 0, 0, 8),  # two tensors: the general parse
    ONE_RUN.pack(1, 1, 2, 0, 0, 8),  # two runs (and a truncated payload for them)
    ONE_RUN.pack(1, 0, 1, 0, 0, 8),
    ONE_RUN.pack(1, 1, 0, 0, 0, 8),
])
def test_what_is_not_one_run_goes_to_the_generic_path(payload: bytes) -> None:
    e = Entry(4096, [4096])
    assert _compiled(e, 0, 5, payload) is None
    assert e.held == 0 and e.releases == 0  # nothing granted before the payload was understood


def test_a_release_runs_even_when_the_entry_is_broken() -> None:
    """An entry whose fields make the checks raise (a bug, not a peer's doing) is still released."""
    e = Entry(4096, [4096])
    e.T = 2**70  # does not fit int64 in the compiled comparison
    with pytest.raises(OverflowError):
        _compiled(e, 0, 5, ONE_RUN.pack(1, 1, 1, 0, 0, 8))
    assert e.held == 0 and e.releases == 1


# -- requests of several runs or tensors: the Python serve alone ---------------------------------

def _runs_payload(cache_id: int, tensors: list[int], off: list[int], length: list[int]) -> bytes:
    return (struct.pack("<QII", cache_id, len(tensors), len(length))
            + struct.pack(f"<{len(tensors)}I{len(off)}q{len(length)}q", *tensors, *off, *length))


def _done_frame(req: int, status: int) -> bytes:
    return wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_DONE, req, 4) + struct.pack(
        "<I", status)


@pytest.mark.parametrize("tensors, off, length", [
    ([0], [0, 8], [16, -1]),  # a negative length after a valid run
    ([0], [8, 0], [-1, 16]),  # ... before it
    ([0], [64, 0], [-1, 16]),  # at the tensor's end
    ([0], [0, 0], [16, -(2**63)]),  # the most negative length
    ([0, 1], [0, 0], [16, -64]),  # two tensors
    ([1], [0, 0, 0], [-1, -1, -1]),  # nothing positive: zero bytes announced
])
def test_a_negative_length_in_a_request_of_several_runs_is_refused(tensors: list[int],
                                                                   off: list[int],
                                                                   length: list[int]) -> None:
    """A LEASE_READ of several runs where one length is negative: the answer is exactly
    DONE(LLM_PARAM_INVALID), with no DATA (not one byte of the owner's memory is read), and the
    cache is released once."""
    e = Entry(64, [64, 64])
    assert _python(e, 0, 9, _runs_payload(1, tensors, off, length)) == _done_frame(9, PARAM_INVALID)
    assert e.held == 0 and e.releases == 1


def test_the_same_runs_without_the_negative_length_are_served_exactly() -> None:
    """The valid counterpart: two runs of tensor 0 and 1 answered with exactly their bytes."""
    e = Entry(64, [64, 64])
    got = _python(e, 0, 9, _runs_payload(1, [0, 1], [0, 40], [16, 24]))
    want = [e.arenas[k][o:o + n].tobytes() for k in (0, 1) for o, n in ((0, 16), (40, 24))]
    assert got == (wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_DATA, 9, 80)
                   + b"".join(want) + _done_frame(9, 0))
    assert e.held == 0 and e.releases == 1


HALF = wire.SMALL_BYTES // 2


@pytest.mark.parametrize("tensors, length, served", [
    ([0], [HALF, HALF], True),  # exactly SMALL_BYTES in two runs
    ([0], [HALF, HALF + 1], False),  # one byte more
    ([0, 0], [HALF // 2, HALF // 2], True),  # exactly SMALL_BYTES in two tensors x two runs
    ([0, 0], [HALF // 2, HALF // 2 + 1], False),  # two bytes more (one per tensor)
    ([0], [HALF, -5, HALF], True),  # a negative length adds nothing to the total (then refused)
])
def test_a_small_request_of_several_runs_is_bounded_by_small_bytes(tensors: list[int],
                                                                   length: list[int],
                                                                   served: bool) -> None:
    """SMALL_BYTES bounds the bytes of a LEASE_READ of several runs or tensors: at the bound it
    is served (every byte, from the checked runs); one byte past it is a ProtocolError before
    the cache is granted (a correct peer sends it as LEASE + READ)."""
    e = Entry(70000, [70000])
    off = [0] * len(length)
    got = _python(e, 0, 3, _runs_payload(1, tensors, off, length))
    if not served:
        assert got is wire.ProtocolError
        assert e.held == 0 and e.releases == 0
        return
    assert e.held == 0 and e.releases == 1
    if any(n < 0 for n in length):
        assert got == _done_frame(3, PARAM_INVALID)
        return
    run = [e.arenas[0][:n].tobytes() for n in length]
    assert got == (wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_DATA, 3, wire.SMALL_BYTES)
                   + b"".join(run) * len(tensors) + _done_frame(3, 0))
