"""The other side of the cross-process section of ``kvdd bench`` (:mod:`kvdd.bench.xproc`).

* :func:`xp_peer` spawns the peer process (:func:`peer_main`): a simulator instance with one
  registered pattern of ``row_bytes``, as a ``[1, row_bytes]`` cache (the row) and as a paged
  ``[row_bytes / 64 KiB, 64 KiB]`` cache (the block pool), and a raw loopback socket
  (:func:`serve_raw`) that sends the first N bytes of the same buffer on request;
* :class:`RawSocket` is the bench's side of that raw socket (the TCP limit);
* :func:`in_process_peer` is a small-call reference: the same pull from an instance in this
  process (the bare ``process_vm_readv`` through ctypes is :func:`kvdd.bench.xproc_small.pvm_ctypes`).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import (
    OPTION_DEVICE_ID,
    OPTION_LISTEN_IP_INFO,
    OPTION_SYNC_CACHE_WAIT_TIME,
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmDataDist,
    LlmRole,
    empty,
    tensor_addrs,
)
from ..backend import link_data_path
from .baselines import arena, fill_pattern
from .harness import KiB, peer_reporting
from .transfers import LOCALHOST

__all__ = ["ENV_XPROC", "XP_BLOCK_BYTES", "XP_LOCAL_ID", "XP_RAW_CHUNK", "XP_RAW_GATHER", "XP_RAW_LOWAT",
           "XP_SMALL", "XP_WAIT_MS", "RawSocket", "XPeer", "in_process_peer", "peer_main", "serve_raw",
           "xp_data_path", "xp_env", "xp_options", "xp_peer"]

XP_BLOCK_BYTES = 64 * KiB
XP_LOCAL_ID = 20
XP_PEER_IDS = {"process_vm": 21, "tcp": 22}
XP_WAIT_MS = 60_000  # llm.SyncKvCacheWaitTime of both sides: no slow transfer times out
ENV_XPROC = "KVDD_SIM_XPROC"  # "tcp": the simulator links other processes over TCP (docs/backends.md)
XP_START_TIMEOUT_S = 120.0  # the peer must be ready within this (spawn, import, fill, listen)
XP_RAW_CHUNK = 64 * KiB  # the raw socket limit receives in chunks of this
XP_RAW_GATHER = 4 << 20  # or this much per receive (as kvdd's caller: 64 views of 64 KiB)
XP_RAW_LOWAT = 1 << 20  # woken once this much is queued (kvdd.sim.fabric.streams.RCV_LOWAT)
XP_SMALL = 64  # bytes of the small-call latency pulls
XP_STOP = b"\0" * 8


def xp_options(device: int) -> dict[str, str]:
    return {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", OPTION_DEVICE_ID: str(device),
            OPTION_SYNC_CACHE_WAIT_TIME: str(XP_WAIT_MS)}


def serve_raw(server: socket.socket, buf: memoryview) -> None:
    """The raw loopback limit, peer side: for every 8-byte request N > 0, sendall N bytes of `buf`."""
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = bytearray(8)
        while True:
            got = 0
            try:
                while got < 8:
                    n = conn.recv_into(memoryview(req)[got:])
                    if n == 0:
                        return
                    got += n
                want = int.from_bytes(req, "little")
                if want == 0 or want > len(buf):
                    return
                conn.sendall(buf[:want])
            except OSError:
                return


def peer_main(conn: Any, row_bytes: int, cluster_id: int, tcp: bool) -> None:
    """Entry point of the spawned peer: register the pattern, report where it is, wait for `stop`
    (or the parent's death), finalize."""
    if tcp:
        os.environ[ENV_XPROC] = "tcp"
    parent = os.getppid()
    with peer_reporting(conn):
        mem = arena(row_bytes) if tcp else empty(row_bytes, np.uint8)  # the same-host path maps it
        fill_pattern(mem)
        server = socket.create_server((LOCALHOST, 0))
        with server, LlmDataDist(cluster_id, LlmRole.PROMPT, backend="sim") as dd:
            dd.initialize(xp_options(0))
            addrs = tensor_addrs([mem])
            row_id = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, row_bytes)), addrs)
            paged_id = dd.register_kv_cache(
                CacheDesc(1, DataType.DT_UINT8, (row_bytes // XP_BLOCK_BYTES, XP_BLOCK_BYTES)), addrs)
            raw = threading.Thread(target=serve_raw, args=(server, mem.data.cast("B")),
                                   name="kvdd-bench-raw", daemon=True)
            raw.start()
            conn.send(("ready", {"pid": os.getpid(), "port": dd.listen_port, "raw_port": server.getsockname()[1],
                                 "row_cache": row_id, "paged_cache": paged_id, "addr": int(mem.ctypes.data)}))
            while not conn.poll(0.5):
                if os.getppid() != parent:  # the bench died: do not linger
                    return
            conn.recv()
        t = os.times()
        conn.send(("cpu", t.user + t.system))


@dataclass
class XPeer:
    path: str
    pid: int
    cluster_id: int
    port: int
    raw_port: int
    row_cache: int
    paged_cache: int
    addr: int


@contextmanager
def xp_peer(path: str, row_bytes: int, cpu_out: list[float]) -> Iterator[XPeer]:
    """A spawned peer process (with ``KVDD_SIM_XPROC=tcp`` on the TCP path); stopped, or killed,
    on the way out, whatever happens.  Its CPU time is appended to `cpu_out` when it stops."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    cluster_id = XP_PEER_IDS[path]
    proc = ctx.Process(target=peer_main, args=(there, row_bytes, cluster_id, path == "tcp"),
                       name=f"kvdd-bench-peer-{path}", daemon=True)
    proc.start()
    there.close()
    try:
        deadline = time.monotonic() + XP_START_TIMEOUT_S
        while not here.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"the {path} peer process exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {path} peer process was not ready within {XP_START_TIMEOUT_S:.0f} s")
        try:
            kind, info = here.recv()
        except EOFError:
            raise RuntimeError(f"the {path} peer process exited without a word") from None
        if kind != "ready":
            raise RuntimeError(f"the {path} peer process failed: {info}")
        peer = XPeer(path, int(info["pid"]), cluster_id, int(info["port"]), int(info["raw_port"]),
                      int(info["row_cache"]), int(info["paged_cache"]), int(info["addr"]))
        yield peer
    finally:
        try:
            here.send("stop")
            if here.poll(10):
                kind, value = here.recv()
                if kind == "cpu":
                    cpu_out.append(float(value))
        except (OSError, EOFError, ValueError, TypeError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        here.close()


@contextmanager
def xp_env(path: str) -> Iterator[None]:
    """``KVDD_SIM_XPROC=tcp`` in this process too while the TCP link is made (the fabric chooses a
    link's data path when linking)."""
    old = os.environ.get(ENV_XPROC)
    if path == "tcp":
        os.environ[ENV_XPROC] = "tcp"
    try:
        yield
    finally:
        if path == "tcp":
            if old is None:
                os.environ.pop(ENV_XPROC, None)
            else:
                os.environ[ENV_XPROC] = old


def xp_data_path(dd: LlmDataDist, peer_cluster_id: int) -> str:
    """The data path the fabric chose for the link (``process_vm``, ``tcp``)."""
    path = link_data_path(dd.backend, peer_cluster_id)
    return path if path is not None else "unknown"


class RawSocket:
    """The raw loopback limit, bench side: ask for N bytes (a blocking request/response), then
    receive them into a preallocated buffer, in 64 KiB chunks (:meth:`pull`) or 4 MiB at a time
    woken per MiB queued (:meth:`pull_gathered`); the bench takes the faster of the two."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((LOCALHOST, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def pull(self, buf: memoryview, nbytes: int) -> None:
        self.sock.sendall(nbytes.to_bytes(8, "little"))
        recv_into = self.sock.recv_into
        got = 0
        while got < nbytes:
            n = recv_into(buf[got:min(nbytes, got + XP_RAW_CHUNK)])
            if n == 0:
                raise RuntimeError("the raw socket peer closed the connection")
            got += n

    def pull_gathered(self, buf: memoryview, nbytes: int) -> None:
        """:meth:`pull`, received up to :data:`XP_RAW_GATHER` bytes per ``recv_into``
        (``MSG_WAITALL``, the socket blocking: one system call each), the socket waking this thread
        once :data:`XP_RAW_LOWAT` bytes are queued (``SO_RCVLOWAT``) while at least that many
        follow the bytes asked for (the last ones with every arrival waking it, as they must:
        nothing follows them)."""
        sock = self.sock
        timeout = sock.gettimeout()
        sock.settimeout(None)
        raised = False
        try:
            sock.sendall(nbytes.to_bytes(8, "little"))
            got = 0
            while got < nbytes:
                end = min(nbytes, got + XP_RAW_GATHER)
                follow = nbytes - end >= XP_RAW_LOWAT
                if follow != raised:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, XP_RAW_LOWAT if follow else 1)
                    raised = follow
                n = sock.recv_into(buf[got:end], end - got, socket.MSG_WAITALL)
                if n == 0:
                    raise RuntimeError("the raw socket peer closed the connection")
                got += n
        finally:
            if raised:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            sock.settimeout(timeout)

    def close(self) -> None:
        try:
            self.sock.sendall(XP_STOP)
        except OSError:
            pass
        self.sock.close()


@contextmanager
def in_process_peer(local: LlmDataDist, nbytes: int,
                     ext: KvCacheExtParam) -> Iterator[tuple[CacheIndex, Callable[[], object]]]:
    """A second instance in this process (the in-process reference of the small-call latency):
    one ``[1, nbytes]`` cache holding a pattern, linked from ``local``; with the index of that
    cache, the same pull by a third instance whose compiled path is off (``python_pull``: the
    in-process pull through the engine's Python checks, as every cross-process call runs)."""
    mem, dst = arena(nbytes), arena(nbytes)
    fill_pattern(mem)
    desc = CacheDesc(1, DataType.DT_UINT8, (1, nbytes))
    with LlmDataDist(XP_LOCAL_ID + 10, LlmRole.PROMPT, backend="sim") as ref, \
            LlmDataDist(XP_LOCAL_ID + 11, LlmRole.DECODER, backend="sim") as py:
        ref.initialize(xp_options(2))
        py.initialize(xp_options(3))
        cid = ref.register_kv_cache(desc, tensor_addrs([mem]))
        py_cache = Cache(py.register_kv_cache(desc, tensor_addrs([dst])))
        info = ClusterInfo(remote_cluster_id=XP_LOCAL_ID + 10,
                           remote_ip_infos=(IpInfo(LOCALHOST, ref.listening_port),))
        local.link_llm_clusters([info], 10_000)
        py.link_llm_clusters([info], 10_000)
        fast = getattr(py.backend, "fast_transfers", None)
        if fast is not None:
            fast.enabled = False
        idx = CacheIndex(XP_LOCAL_ID + 10, cid, 0)
        try:
            yield idx, functools.partial(py.pull_kv_cache, idx, py_cache, 0, nbytes, ext)
        finally:
            local.unlink_llm_clusters([info], 10_000, force=True)
