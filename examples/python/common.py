"""Helpers shared by kvdd's Python examples of CANN's ``llm_datadist`` package.

Each example is one program run as two (or more) processes on one host: ``prefill`` and
``decode``.  They use nothing but ``llm_datadist``, numpy and the standard library, so the same
files run against CANN's package on an Atlas node and against kvdd's simulator after
``source DEST/set_env.sh`` of a root made by ``kvdd cann-root DEST``.

* Memory: every cache is registered as ``Placement.DEVICE``.  Off hardware it is numpy memory
  (addresses from ``ndarray.ctypes.data``), which is what the simulator moves.  Where ``torch`` and
  ``torch_npu`` import (an Atlas node) it is NPU memory (``torch.empty(..., device="npu")``,
  ``data_ptr()``), written and read back through host copies; ``EXAMPLE_MEMORY=numpy`` forces numpy.
  (The NPU branch is written for Atlas nodes and has not been run off them.)
* Synchronisation: the processes exchange small JSON lines over a loopback TCP control socket
  (prefill or decode listens on ``PORT_BASE + 9``); the LLM-DataDist listener is ``PORT_BASE``
  (and ``PORT_BASE + i`` for the i-th of several prefills).  Lines are bounded and the socket is
  bound to 127.0.0.1 only: it carries cache ids and block tables, never memory.
* Verification: every source tensor holds a pattern that depends on (tag, tensor, element);
  the decode side recomputes what every byte of its memory must hold after each transfer, moved
  and untouched bytes alike, and exits 1 on the first mismatch (0 when all is right, 2 on bad
  arguments).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

import llm_datadist
from llm_datadist import LLMClusterInfo, LLMConfig, LLMException

PREFILL_CLUSTER = 1
DECODE_CLUSTER = 2
HOST = "127.0.0.1"
CONTROL_OFFSET = 9  # the control socket's port is PORT_BASE + 9
LINK_TIMEOUT_MS = 20000
SYNC_KV_TIMEOUT_MS = 20000
UNTOUCHED = 0xEEEE  # what destination memory holds before any transfer (as uint16 words)

# Geometry of the examples: 4 layers, K and V per layer (8 tensors), float16,
# a token = 2 heads x 16 dims (64 bytes); a block = 8 tokens (512 bytes per tensor).
LAYERS = 4
TENSORS = 2 * LAYERS
TOKEN_SHAPE = (2, 16)
BLOCK_TOKENS = 8
DTYPE = np.float16
MAX_LINE = 1 << 16


def _npu_torch() -> Any:
    """``torch`` when ``torch_npu`` imports too (an Atlas node), else None."""
    if os.environ.get("EXAMPLE_MEMORY", "auto") == "numpy":
        return None
    try:
        torch = importlib.import_module("torch")
        importlib.import_module("torch_npu")
    except ImportError:
        return None
    return torch


#: torch on an Atlas node (the caches are NPU memory), None elsewhere (numpy memory).
NPU_TORCH = _npu_torch()


def fail(message: str) -> NoReturn:
    """Print ``FAILED: message`` and exit 1."""
    print(f"FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def parse_args(prog: str, roles: Sequence[str] = ("prefill", "decode"),
               indexed: bool = False) -> tuple[str, int, int]:
    """``(role, port_base, index)`` from ``argv``: ``ROLE PORT_BASE [INDEX]``; exit 2 on misuse."""
    argv = sys.argv[1:]
    usage = f"usage: {prog} {'|'.join(roles)} PORT_BASE" + (" [INDEX]" if indexed else "")
    if len(argv) not in ((2, 3) if indexed else (2,)) or argv[0] not in roles or not argv[1].isdigit():
        print(usage, file=sys.stderr)
        sys.exit(2)
    port = int(argv[1])
    index = int(argv[2]) if len(argv) == 3 and argv[2].isdigit() else 0
    if not 1024 <= port <= 65500:
        print(f"{usage}\nPORT_BASE must lie in 1024..65500", file=sys.stderr)
        sys.exit(2)
    return argv[0], port, index


def config(device_id: int, listen_port: int | None = None) -> dict[str, str]:
    """``init`` options: cache-manager mode with remote-accessible caches, a listener when asked.
    On an Atlas node this process's NPU is ``device_id`` from here on."""
    if NPU_TORCH is not None:
        NPU_TORCH.npu.set_device(device_id)
    cfg = LLMConfig()
    cfg.device_id = device_id
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
    if listen_port is not None:
        cfg.listen_ip_info = f"{HOST}:{listen_port}"
    options: dict[str, str] = cfg.generate_options()
    return options


def cluster(remote_cluster_id: int, remote_port: int) -> LLMClusterInfo:
    """One peer to ``link_clusters``: it listens on 127.0.0.1:``remote_port``."""
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_local_ip_info(HOST, 0)
    info.append_remote_ip_info(HOST, remote_port)
    return info


def link(engine: llm_datadist.LLMDataDist, clusters: Sequence[LLMClusterInfo]) -> None:
    """``link_clusters``; exit 1 unless the call and every cluster report LLM_SUCCESS."""
    ret, rets = engine.link_clusters(list(clusters), timeout=LINK_TIMEOUT_MS)
    if ret != llm_datadist.LLMStatusCode.LLM_SUCCESS or any(
            r != llm_datadist.LLMStatusCode.LLM_SUCCESS for r in rets):
        fail(f"link_clusters returned {ret} {rets}")


def unlink(engine: llm_datadist.LLMDataDist, clusters: Sequence[LLMClusterInfo]) -> None:
    ret, rets = engine.unlink_clusters(list(clusters), timeout=LINK_TIMEOUT_MS)
    if ret != llm_datadist.LLMStatusCode.LLM_SUCCESS:
        fail(f"unlink_clusters returned {ret} {rets}")


def pattern(tag: int, tensor: int, count: int, start: int = 0) -> np.ndarray[Any, np.dtype[np.uint16]]:
    """The uint16 words ``start .. start + count`` of tensor ``tensor`` of a source tagged ``tag``.

    A hash of (tag, tensor, word), never equal to :data:`UNTOUCHED`: a word from the wrong tensor,
    block, row or source is caught (a block of 256 words matches another by chance with
    probability about 60000**-256).
    """
    i = np.arange(start, start + count, dtype=np.uint64)
    x = (i + (np.uint64(tensor) << np.uint64(20)) + (np.uint64(tag) << np.uint64(28))) * np.uint64(0x9E3779B1)
    x &= np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(15)
    words: np.ndarray[Any, np.dtype[np.uint16]] = (x % np.uint64(0xEEEC) + np.uint64(1)).astype(np.uint16)
    return words


class Tensors:
    """``n`` tensors of ``shape`` float16, each its own allocation (one address per tensor), and the
    uint16 words every one must hold."""

    def __init__(self, n: int, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)
        self.words_per_tensor = int(np.prod(self.shape)) * np.dtype(DTYPE).itemsize // 2
        self.arrays = [allocate(self.shape) for _ in range(n)]
        # What every tensor must hold: one uint16 array per tensor, updated as transfers land.
        self.expected = [np.full(self.words_per_tensor, UNTOUCHED, np.uint16) for _ in range(n)]
        for t in range(n):
            self.write(t, self.expected[t])

    @property
    def addrs(self) -> list[int]:
        if NPU_TORCH is not None:
            return [int(a.data_ptr()) for a in self.arrays]
        return [int(a.ctypes.data) for a in self.arrays]

    def write(self, t: int, words: np.ndarray[Any, np.dtype[np.uint16]]) -> None:
        """Tensor ``t`` := ``words`` (host to device on an Atlas node)."""
        if NPU_TORCH is not None:
            self.arrays[t].copy_(NPU_TORCH.from_numpy(words.view(np.int16).copy()))
        else:
            self.arrays[t].view(np.uint16).reshape(-1)[:] = words

    def fill(self, tag: int) -> None:
        """Source data: tensor ``t`` holds ``pattern(tag, t, ...)``."""
        for t in range(len(self.arrays)):
            words = pattern(tag, t, self.words_per_tensor)
            self.write(t, words)
            self.expected[t] = words.copy()

    def read(self, t: int) -> np.ndarray[Any, np.dtype[np.uint16]]:
        """Tensor ``t`` as uint16 words (device to host on an Atlas node)."""
        if NPU_TORCH is not None:
            host: np.ndarray[Any, np.dtype[np.uint16]] = self.arrays[t].cpu().numpy().view(np.uint16)
            return host
        return np.asarray(self.arrays[t].view(np.uint16).reshape(-1))

    def verify(self, what: str) -> None:
        """Every word of every tensor against :attr:`expected`; exit 1 naming the first mismatch."""
        for t in range(len(self.arrays)):
            got = self.read(t)
            bad = np.flatnonzero(got != self.expected[t])
            if bad.size:
                w = int(bad[0])
                fail(f"{what}: tensor {t} (layer {t // 2} {'KV'[t % 2]}) word {w} (byte {2 * w}) is "
                     f"{int(got[w]):#06x}, expected {int(self.expected[t][w]):#06x} "
                     f"({bad.size} of {got.size} words differ)")
        print(f"{what:<52} ok ({len(self.arrays) * self.words_per_tensor * 2} bytes checked)", flush=True)


def allocate(shape: Sequence[int]) -> Any:
    """The memory of one tensor: NPU memory on an Atlas node (a flat int16 tensor), else numpy."""
    if NPU_TORCH is not None:
        words = int(np.prod(tuple(shape))) * np.dtype(DTYPE).itemsize // 2
        return NPU_TORCH.empty(words, dtype=NPU_TORCH.int16, device="npu")
    return np.zeros(tuple(shape), DTYPE)


def block_shape(blocks: int) -> list[int]:
    """A paged cache's tensor shape: ``[blocks, BLOCK_TOKENS, *TOKEN_SHAPE]``."""
    return [blocks, BLOCK_TOKENS, *TOKEN_SHAPE]


def block_words() -> int:
    return BLOCK_TOKENS * int(np.prod(TOKEN_SHAPE)) * np.dtype(DTYPE).itemsize // 2


class Control:
    """One loopback control connection: JSON objects, one per line, bounded."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file = sock.makefile("rb")

    @classmethod
    def listen(cls, port: int, peers: int = 1, timeout: float = 120.0) -> list[Control]:
        """Accept ``peers`` connections on 127.0.0.1:``port`` + CONTROL_OFFSET."""
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((HOST, port + CONTROL_OFFSET))
        server.listen(peers)
        server.settimeout(timeout)
        out = []
        try:
            for _ in range(peers):
                conn, _addr = server.accept()
                conn.settimeout(timeout)
                out.append(cls(conn))
        except socket.timeout:
            fail(f"control socket: nobody connected to port {port + CONTROL_OFFSET} in {timeout:.0f} s")
        finally:
            server.close()
        return out

    @classmethod
    def connect(cls, port: int, timeout: float = 120.0) -> Control:
        """Connect to 127.0.0.1:``port`` + CONTROL_OFFSET, retrying while the peer starts."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = socket.create_connection((HOST, port + CONTROL_OFFSET), timeout=timeout)
                conn.settimeout(timeout)
                return cls(conn)
            except OSError:
                if time.monotonic() > deadline:
                    fail(f"control socket: nobody listens on port {port + CONTROL_OFFSET}")
                time.sleep(0.02)

    def send(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"type": kind, **fields}).encode() + b"\n"
        if len(line) > MAX_LINE:
            fail(f"control socket: message {kind!r} is too long")
        self.sock.sendall(line)

    def recv(self, kind: str) -> dict[str, Any]:
        """The next message, which must be of type ``kind`` (exit 1 otherwise or if the peer left)."""
        try:
            line = self.file.readline(MAX_LINE + 1)
        except OSError as exc:
            fail(f"control socket: waiting for {kind!r}: {exc}")
        if not line.endswith(b"\n"):
            fail(f"control socket: the peer closed the connection (it failed) while we waited for {kind!r}")
        msg = json.loads(line)
        if not isinstance(msg, dict) or msg.get("type") != kind:
            fail(f"control socket: expected {kind!r}, got {msg!r}")
        return msg

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def expect_exception(code: llm_datadist.LLMStatusCode, call: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """Call ``fn`` and exit 1 unless it raises ``LLMException`` with ``code``."""
    try:
        fn(*args, **kwargs)
    except LLMException as exc:
        if exc.status_code != code:
            fail(f"{call}: expected {code}, got {exc.status_code}: {exc}")
        print(f"{call:<52} ok (raised {code.name})", flush=True)
        return
    fail(f"{call}: expected LLMException({code}), it succeeded")
