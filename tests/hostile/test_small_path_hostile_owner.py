"""The compiled small TCP path over real links and Channels against a hostile owner (the reader
alone: test_small_reader.py; the owner's compiled serve: test_small_serve.py).

A caller pulls from a raw hostile owner (tests/hostile/rawpeer.py): a full-speed flood, random
answers of every kind split anywhere, a signal handler raising while the caller waits, and, on a
Channel directly, frames that follow a request's DONE.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvdd import Status
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.rx import Stage

from hostile import rawpeer
from hostile.test_small_path import Caller, caller  # noqa: F401  (the fixture)

S = int(Status.LLM_SUCCESS)


def _data(req: int, payload: bytes) -> bytes:
    return rawpeer.frame(wire.F_DATA, payload, req)


def _done(req: int, status: int = S) -> bytes:
    return rawpeer.frame(wire.F_DONE, struct.pack("<I", status), req)




def test_owner_flooding_empty_data_at_full_speed_is_cut_at_the_deadline(
        caller: Caller) -> None:  # noqa: F811
    """A raw owner answers the caller's LEASE_READ with zero-length DATA frames for it as fast
    as it can (no pause): the compiled loop consumes them with the GIL held between recvs, yet
    the caller returns LLM_TIMEOUT within its wait time (500 ms) + slack, memory unchanged."""
    port = caller.dd.listen_port
    assert port
    s, _snap = rawpeer.link(port, 9100, caches=1)
    s.settimeout(None)
    stop = threading.Event()

    def owner() -> None:
        with contextlib.suppress(OSError, AssertionError, struct.error):
            ftype, req, _body = rawpeer.read_frame(s)
            while ftype != wire.F_LEASE_READ:
                ftype, req, _body = rawpeer.read_frame(s)
            chunk = rawpeer.hdr(wire.F_DATA, 0, req) * 4096
            while not stop.is_set():
                s.sendall(chunk)

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    try:
        before = caller.arena.copy()
        t0 = time.monotonic()
        assert caller.pull() == Status.LLM_TIMEOUT
        assert time.monotonic() - t0 < 2.0
        assert (caller.arena == before).all()
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
        t.join(10)

PI = int(Status.LLM_PARAM_INVALID)
TIMEOUT = int(Status.LLM_TIMEOUT)
ANSWER = bytes((5 * i + 1) & 0xFF for i in range(64))


def _random_answer(rng: random.Random, req: int) -> tuple[list[bytes], int]:
    """A hostile owner's answer to LEASE_READ ``req`` (64 bytes asked): frames drawn from valid
    pieces and every kind of mistake, and the status the caller must get (TIMEOUT: the link
    is broken).  The rule: the first DONE(req) of 4 bytes decides, provided nothing before it
    broke the protocol (DATA of another request, more DATA than asked, a refused header, a
    malformed DONE of this request); success also needs every byte.  Nothing follows the frame
    that decides (frames after a DONE: test_the_first_done_decides)."""
    frames: list[bytes] = []
    want: int | None = None
    got = 0
    pieces = sorted(rng.sample(range(1, 64), rng.randint(0, 4)))
    chunks = [ANSWER[a:b] for a, b in zip([0, *pieces], [*pieces, 64])]
    for _ in range(rng.randint(1, 8)):
        if want is not None:  # decided: what a hostile owner sends after that: test_the_first_done_decides
            break
        kind = rng.choice(["data", "data", "data", "empty", "done", "done", "refuse", "other_data",
                           "other_done", "pong", "bad_header", "long_done", "extra"])
        if kind == "data" and chunks:
            chunk = chunks.pop(0)
            frames.append(_data(req, chunk))
            got += len(chunk)
        elif kind == "empty":
            frames.append(_data(req, b""))
        elif kind == "extra":
            n = rng.choice([1, 64, 65])
            frames.append(_data(req, b"\xee" * n))
            if want is None and got + n > 64:
                want = TIMEOUT
            got += n
        elif kind in ("done", "refuse"):
            status = S if kind == "done" else PI
            frames.append(_done(req, status))
            if want is None:
                want = PI if status == PI else (S if got == 64 else TIMEOUT)
        elif kind == "other_data":
            frames.append(_data(req + rng.choice([1, 2, 1 << 31]), b"\xdd" * rng.randint(0, 8)))
            want = TIMEOUT if want is None else want
        elif kind == "other_done":
            frames.append(_done(req ^ 0x100))  # no such request: ignored
        elif kind == "pong":
            frames.append(rawpeer.frame(wire.F_PONG, b"", req + 3))  # ignored
        elif kind == "bad_header":
            frames.append(rawpeer.hdr(wire.F_DATA, 8, req, magic=b"XY") + b"\0" * 8)
            want = TIMEOUT if want is None else want
        elif kind == "long_done":
            frames.append(rawpeer.frame(wire.F_DONE, b"\0" * 8, req))
            want = TIMEOUT if want is None else want
    if want is None:  # never decided: end with a DONE (a silent owner costs the whole wait)
        frames.append(_done(req))
        want = S if got == 64 else TIMEOUT
    return frames, want


def _show(f: bytes, req: int) -> str:
    """A frame, briefly (for failure messages)."""
    _m, _v, ftype, freq, n = rawpeer.HDR.unpack(f[:12])
    return f"{_m!r}:{ftype}:{'req' if freq == req else hex(freq)}:{n}" + (
        f"={struct.unpack('<I', f[12:16])[0]:#x}" if ftype == wire.F_DONE and n == 4 else "")


def _landing(frames: list[bytes], req: int) -> bytes:
    """The bytes of this request's DATA before its first DONE (what lands on success)."""
    body = b""
    for f in frames:
        _m, _v, ftype, freq, _n = rawpeer.HDR.unpack(f[:12])
        if freq == req and ftype == wire.F_DONE:
            break
        if freq == req and ftype == wire.F_DATA and _m == b"KV":
            body += f[12:]
    return body


@pytest.mark.parametrize("seed", range(4))
def test_random_hostile_answers_split_anywhere(caller: Caller, seed: int) -> None:  # noqa: F811
    """Random answers of a hostile owner (valid pieces, empty, extra and misrouted DATA, DONE
    before or after the data, refusals, malformed frames), every byte stream cut at random
    points (single bytes included), the caller leading or not: each pull gets exactly the
    status the protocol gives, returns at once (no wait time spent: every answer decides), and
    the caller's memory changes only on success, to exactly the answer."""
    rng = random.Random(seed)
    port = caller.dd.listen_port
    assert port
    for _case in range(10):
        s, _snap = rawpeer.link(port, 9100, caches=1)
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        outcome: list[int] = []
        shown: list[str] = []
        landed: list[bytes] = []
        # cold: the receiver thread leads the idle link, so it reads the answer (generic path,
        # Stage.recv); warm: a pull just before, so this one leads as it registers (small_reply)
        warm = rng.random() < 0.5
        warmed: list[int] = []

        def owner() -> None:
            with contextlib.suppress(OSError, AssertionError, struct.error):
                while True:
                    ftype, req, _body = rawpeer.read_frame(s)
                    if ftype != wire.F_LEASE_READ:
                        continue
                    if warm and not warmed:  # the first pull of a warm case: a valid answer
                        warmed.append(req)
                        s.sendall(_data(req, ANSWER) + _done(req))
                        continue
                    frames, want = _random_answer(rng, req)
                    outcome.append(want)
                    landed.append(_landing(frames, req))
                    shown.extend(_show(f, req) for f in frames)
                    data = b"".join(frames)
                    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1,
                                                                      rng.randint(0, 12))))
                    for a, b in zip([0, *cuts], [*cuts, len(data)]):
                        s.sendall(data[a:b])
                        if rng.random() < 0.3:
                            time.sleep(0.001)

        t = threading.Thread(target=owner, daemon=True)
        t.start()
        try:
            if warm:
                assert caller.pull() == Status.LLM_SUCCESS
            caller.arena[:] = 0x5A
            t0 = time.monotonic()
            got = int(caller.pull())
            took = time.monotonic() - t0
            assert len(outcome) == 1
            assert got == outcome[0], (seed, _case, hex(got), hex(outcome[0]), shown)
            assert took < 0.4, took
            expected = np.full_like(caller.arena, 0x5A)
            if got == S:
                expected[4096:4096 + 64] = np.frombuffer(landed[0], dtype=np.uint8)
            changed = np.flatnonzero(caller.arena != expected)
            assert changed.size == 0, changed[:8]
        finally:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
            t.join(10)


# -- signals and frames after a DONE -------------------------------------------------------------

@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_a_signal_handlers_exception_comes_out_of_the_pull(caller: Caller) -> None:  # noqa: F811
    port = caller.dd.listen_port
    assert port
    s, _snap = rawpeer.link(port, 9100, caches=1)
    s.settimeout(None)

    reads = [0]

    def owner() -> None:
        with contextlib.suppress(OSError, AssertionError, struct.error):
            while True:
                ftype, req, _body = rawpeer.read_frame(s)
                if ftype == wire.F_LEASE_READ:
                    reads[0] += 1
                    if reads[0] > 1:
                        time.sleep(0.3)  # the caller waits in recv meanwhile
                    s.sendall(_data(req, b"\x01" * 64) + _done(req))

    class Alarm(Exception):
        pass

    def on_alarm(_sig: int, _frame: object) -> None:
        raise Alarm()

    t = threading.Thread(target=owner, daemon=True)
    t.start()
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        # a first pull, then at once the second: the caller leads the receive side (the receiver
        # thread only takes it after IDLE_S without callers), so it waits in the compiled recv
        assert caller.pull() == Status.LLM_SUCCESS
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            caller.pull()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
        t.join(10)


class MinimalOwner:
    """The least a Channel needs of its instance (it serves nothing here)."""

    cluster_id = 1
    transfer_backend = "comm"
    comm_res_text: str | None = None
    sync_wait_ms = 2000
    initialized = True


def test_the_first_done_decides() -> None:
    """Two requests on one Channel (its contract: a caller whose reply another leader reads is
    woken by it): the first caller leads (a PING never answered); the owner refuses the second,
    a small READ, with DONE(LLM_PARAM_INVALID), then sends it 64 bytes and DONE(LLM_SUCCESS)
    anyway.  The leader reads the three frames in one go while the second caller wakes: it must
    get the refusal, and nothing may reach its stage after it."""
    mine, theirs = socket.socketpair()
    theirs.settimeout(5)
    chan = Channel(mine, MinimalOwner(), "first-done")  # type: ignore[arg-type]
    chan.start()
    stage = Stage(64, 1 << 16)
    try:
        deadline = time.monotonic() + 2.0
        first = threading.Thread(target=chan.request, args=(wire.F_PING, b"", deadline), daemon=True)
        first.start()  # never answered: this caller reads the socket
        assert rawpeer.read_frame(theirs)[0] == wire.F_PING
        # the receiver thread leads an idle connection (waiting in recv); a frame it ignores makes
        # it hand the lead to the waiting caller
        time.sleep(0.02)
        theirs.sendall(rawpeer.frame(wire.F_PONG, b"", 0xFFFF))
        time.sleep(0.02)
        out: list[int | None] = []
        second = threading.Thread(target=lambda: out.append(
            chan.read_small(1, 0, 0, stage, deadline)), daemon=True)
        second.start()
        ftype, req, _ = rawpeer.read_frame(theirs)
        assert ftype == wire.F_LEASE_READ
        theirs.sendall(_done(req, PI) + _data(req, b"\xbb" * 64) + _done(req))
        second.join(5)
        assert out == [PI], [hex(x) if x is not None else x for x in out]
        assert stage.left == 64
    finally:
        chan.kill()
        theirs.close()
