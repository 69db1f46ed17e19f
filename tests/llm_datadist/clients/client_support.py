"""What the client-shaped harnesses share: cache memory with verifiable contents, a loopback
control channel standing in for the serving stack's own metadata channel, and the result line.

The harnesses (``vllm_cmgr.py``, ``omni_infer.py``, ``mindie.py``, ``vllm_hixl.py``,
``omni_npu.py``) are scripts: each holds a class shaped like one real client's transfer code
(PYPKG.md §7.1: its call sequence, keyword names, error handling and retry sets, written here from
that inventory) and a driver that runs it as the ``prefill`` or ``decode`` process.  They import
``llm_datadist`` exactly as the clients do; the tests start them with kvdd's simulator installed as
that module (:mod:`client_launch`).  This module uses nothing but numpy and the standard library.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
from numpy.typing import NDArray

HOST = "127.0.0.1"
CONTROL_OFFSET = 9  # the control channel listens on PORT_BASE + 9
MAX_LINE = 1 << 16
UNTOUCHED = 0xA5  # what destination memory holds before a transfer
ALIGN = 2 << 20  # vllm-ascend asserts 2 MiB-aligned cache addresses

#: Wait on the control channel (seconds).
CONTROL_TIMEOUT_S = 60.0


def fail(message: str) -> NoReturn:
    print(f"FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def result(**fields: Any) -> None:
    """One ``RESULT {json}`` line on stdout: what the test asserts."""
    print("RESULT " + json.dumps(fields), flush=True)


def args() -> tuple[str, int, list[str]]:
    """``(role, port_base, extra)`` from ``ROLE PORT_BASE [EXTRA...]``."""
    if len(sys.argv) < 3 or not sys.argv[2].isdigit():
        print(f"usage: {sys.argv[0]} ROLE PORT_BASE [SCENARIO...]", file=sys.stderr)
        sys.exit(2)
    return sys.argv[1], int(sys.argv[2]), sys.argv[3:]


def pattern(tag: int, tensor: int, nbytes: int, start: int = 0) -> NDArray[np.uint8]:
    """Bytes ``start .. start + nbytes`` of tensor ``tensor`` of a source tagged ``tag`` (a hash of
    (tag, tensor, byte), never :data:`UNTOUCHED`)."""
    i = np.arange(start, start + nbytes, dtype=np.uint64)
    x = (i + (np.uint64(tensor) << np.uint64(24)) + (np.uint64(tag) << np.uint64(36))) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(29)
    v = (x % np.uint64(255)).astype(np.uint8)
    out: NDArray[np.uint8] = np.where(v >= UNTOUCHED, v + 1, v).astype(np.uint8)
    return out


class Memory:
    """``n`` tensors of ``nbytes`` each, every one 2 MiB-aligned (as NPU allocations are), and the
    bytes each must hold."""

    def __init__(self, n: int, nbytes: int, tag: int | None = None) -> None:
        self.nbytes = nbytes
        self._raw = [np.empty(nbytes + ALIGN, np.uint8) for _ in range(n)]
        self.tensors: list[NDArray[np.uint8]] = []
        for raw in self._raw:
            skip = (-int(raw.ctypes.data)) % ALIGN
            self.tensors.append(raw[skip:skip + nbytes])
        self.expected = [np.full(nbytes, UNTOUCHED, np.uint8) for _ in range(n)]
        for t in self.tensors:
            t[:] = UNTOUCHED
        if tag is not None:
            self.fill(tag)

    @property
    def addrs(self) -> list[int]:
        return [int(t.ctypes.data) for t in self.tensors]

    def fill(self, tag: int, tensor_tags: Sequence[int] | None = None) -> None:
        """Tensor ``t`` holds ``pattern(tag, tensor_tags[t] or t)``."""
        for t, arr in enumerate(self.tensors):
            arr[:] = pattern(tag, tensor_tags[t] if tensor_tags else t, self.nbytes)
            self.expected[t] = arr.copy()

    def expect_blocks(self, tensor: int, src_tag: int, src_tensor: int, block_bytes: int,
                      src: Sequence[int], dst: Sequence[int]) -> None:
        for s, d in zip(src, dst):
            self.expected[tensor][d * block_bytes:(d + 1) * block_bytes] = pattern(
                src_tag, src_tensor, block_bytes, s * block_bytes)

    def mismatch(self) -> str | None:
        """None when every byte is as expected, else where the first wrong one is."""
        for t, (got, want) in enumerate(zip(self.tensors, self.expected)):
            bad = np.flatnonzero(got != want)
            if bad.size:
                b = int(bad[0])
                return (f"tensor {t} byte {b}: {int(got[b]):#04x}, expected {int(want[b]):#04x} "
                        f"({bad.size} of {got.size} bytes differ)")
        return None

    def verify(self, what: str) -> int:
        """Exit 1 on the first wrong byte; the bytes checked."""
        where = self.mismatch()
        if where is not None:
            fail(f"{what}: {where}")
        return len(self.tensors) * self.nbytes


class Control:
    """The serving stack's metadata channel, reduced to JSON lines over loopback TCP."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file = sock.makefile("rb")

    @classmethod
    def listen(cls, port: int, peers: int = 1) -> list[Control]:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((HOST, port + CONTROL_OFFSET))
        server.listen(peers)
        server.settimeout(CONTROL_TIMEOUT_S)
        out = []
        try:
            for _ in range(peers):
                conn, _ = server.accept()
                conn.settimeout(CONTROL_TIMEOUT_S)
                out.append(cls(conn))
        except socket.timeout:
            fail("control channel: the peer never connected")
        finally:
            server.close()
        return out

    @classmethod
    def connect(cls, port: int) -> Control:
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while True:
            try:
                conn = socket.create_connection((HOST, port + CONTROL_OFFSET), timeout=CONTROL_TIMEOUT_S)
                conn.settimeout(CONTROL_TIMEOUT_S)
                return cls(conn)
            except OSError:
                if time.monotonic() > deadline:
                    fail("control channel: nobody listens")
                time.sleep(0.02)

    def send(self, kind: str, **fields: Any) -> None:
        self.sock.sendall(json.dumps({"type": kind, **fields}).encode() + b"\n")

    def recv(self, kind: str) -> dict[str, Any]:
        try:
            line = self.file.readline(MAX_LINE + 1)
        except OSError as exc:
            fail(f"control channel: waiting for {kind!r}: {exc}")
        if not line.endswith(b"\n"):
            fail(f"control channel: the peer left (it failed) while we waited for {kind!r}")
        msg = json.loads(line)
        if not isinstance(msg, dict) or msg.get("type") != kind:
            fail(f"control channel: expected {kind!r}, got {msg!r}")
        return msg
