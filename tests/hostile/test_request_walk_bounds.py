"""A checked READ / WRITE request's work in one pool step is bounded by what it moves.

A request may name the same tensor many times (K up to ~1M in a 4 MiB request) with runs of
0 bytes: the owner moves nothing, so it must not walk the K tensors in one uninterrupted step (a
pool task cannot yield inside it: four such requests pin the fabric's pool for seconds each).
A READ of K tensors x one 1-byte run sends K DATA frames of 13 bytes: the sending task's share
counts its system calls, not only its bytes (else one share is ~320,000 calls). And planning a
request of many runs (stretches of short runs between long ones) is split into steps too.
"""

from __future__ import annotations

import socket
from collections.abc import Generator

import numpy as np
import pytest

from kvdd.sim.fabric import tx, wire
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.serving import PLAN_SHARE, RunPlan
from kvdd.sim.fabric.wire import STAGE_RUN_BYTES
from kvdd.sim.memory import Region

from hostile.rawpeer import MinimalOwner

K = 100_000


class CountingRegions:
    """The cache's tensors (one, named K times), counting each look-up by the plan."""

    def __init__(self) -> None:
        self.buf = np.zeros(8192, dtype=np.uint8)
        self.region = Region(int(self.buf.ctypes.data), self.buf.nbytes, self.buf)
        self.looked = 0

    def __getitem__(self, k: int) -> Region:
        self.looked += 1
        return self.region

    def __len__(self) -> int:
        return 1


def _zero_plan(regions: CountingRegions) -> RunPlan:
    return RunPlan(regions, np.zeros(K, dtype=np.int64),  # type: ignore[arg-type]
                   np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))


def test_read_of_zero_bytes_walks_no_tensor() -> None:
    regions = CountingRegions()
    assert list(_zero_plan(regions).send_steps(1)) == []
    assert regions.looked == 0


def test_write_of_zero_bytes_walks_no_tensor() -> None:
    regions = CountingRegions()
    steps = _zero_plan(regions).receive_steps(None, 1)  # type: ignore[arg-type]
    with pytest.raises(StopIteration):
        next(steps)
    assert regions.looked == 0


def _alternating_plan(n_runs: int) -> RunPlan:
    """A WRITE of one tensor whose runs alternate 1 byte and STAGE_RUN_BYTES (a stretch of
    short runs, then a long run, ...): as many stretches to plan as there are long runs."""
    tensor = np.zeros(n_runs * STAGE_RUN_BYTES, dtype=np.uint8)
    length = np.where(np.arange(n_runs) % 2 == 0, 1, STAGE_RUN_BYTES).astype(np.int64)
    off = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
    region = Region(int(tensor.ctypes.data), tensor.nbytes, tensor)
    return RunPlan([region], np.zeros(1, dtype=np.int64), off, length)


def test_planning_many_runs_is_split_into_steps() -> None:
    """Planning a request of 2 x 4,096 runs takes a pool task's step per PLAN_SHARE stretches
    (ticks before the first byte is asked for), and plans exactly what a blocking driver gets."""
    plan = _alternating_plan(8192)
    steps = plan.receive_steps(None, 1)  # type: ignore[arg-type]
    ticks = 0
    need = next(steps)
    while need == 0:
        ticks += 1
        need = steps.send(0)
    assert need == wire.HDR.size  # then the first DATA frame's header
    assert ticks == (4096 + 1) // PLAN_SHARE  # one tick per PLAN_SHARE stretches, none more
    assert len(plan.segments) == 8192  # each short run alone (a long run follows), each long one
    assert all(b - a == 1 for a, b, _ in plan.segments)


class _Reactor:
    def __init__(self) -> None:
        self.submitted: list[object] = []

    def submit(self, task: object) -> None:
        self.submitted.append(task)

    def submit_after(self, task: object) -> None:  # (a task queueing itself behind the others)
        self.submitted.append(task)

    def arm(self, *_args: object) -> None:
        raise AssertionError("the socket is not full")


@pytest.mark.parametrize("frames", ["tiny", "planning"])
def test_a_sending_task_stops_after_its_share_of_steps(frames: str) -> None:
    """A READ's answer of 13-byte DATA frames (one per tensor), or of steps that send nothing
    (planning): one pool task makes at most 52 system calls (a step and a call each count), or
    TX_SHARE / TX_STEP steps, then queues itself behind the other connections' work."""
    a, b = socket.socketpair()
    chan = Channel(a, MinimalOwner(), "share")  # type: ignore[arg-type]
    reactor = _Reactor()
    chan._reactor = reactor  # type: ignore[assignment]
    sends = 0
    real = chan._send_some

    def counting(share: int) -> tuple[int, bool]:
        nonlocal sends
        sends += 1
        return real(share)

    chan._send_some = counting  # type: ignore[method-assign]
    made = 0

    def answer() -> Generator[list[memoryview], None, None]:
        nonlocal made
        for _ in range(1_000_000):
            made += 1
            yield [memoryview(b"x" * 13)] if frames == "tiny" else []

    chan._tx_gen = answer()
    try:
        chan._tx_step()
        assert reactor.submitted == [chan._tx_run]  # queued again, not done
        if frames == "tiny":
            # each frame: a generator step and a system call (at least TX_CALL bytes each)
            assert sends == -(-tx.TX_SHARE // (tx.TX_STEP + tx.TX_CALL)) == 52
        else:
            assert sends == 0 and made == tx.TX_SHARE // tx.TX_STEP == 256
    finally:
        chan._tx_gen = None
        chan.kill()
        a.close()
        b.close()
