"""Host identity for choosing the same-host data path (process_vm).

This is the pre-authentication check of protocol version 1 (boot id + a nonce read at an announced
address); it is replaced by a kernel-attested identity proof.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
from types import ModuleType
from dataclasses import dataclass

from .wire import Reader, Writer

xproc: ModuleType | None
try:  # always built on Linux; absent elsewhere → TCP only
    from ..._native import _xproc as xproc
except ImportError:  # pragma: no cover
    xproc = None

#: Environment variable selecting the same-host data path: ``auto`` (default) or ``tcp``.
ENV_XPROC = "KVDD_SIM_XPROC"

def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# This process's identity for choosing the data path; the probe nonce lives at PROBE_ADDR.
BOOT_ID = boot_id()
PROBE = ctypes.create_string_buffer(secrets.token_bytes(16), 16)
PROBE_ADDR = ctypes.addressof(PROBE)


@dataclass(frozen=True)
class Host:
    pid: int
    boot_id: str
    hostname: str
    probe_addr: int
    nonce: bytes


def my_host() -> Host:
    return Host(os.getpid(), BOOT_ID, socket.gethostname(), PROBE_ADDR, bytes(PROBE.raw))


def encode_host(w: Writer, host: Host) -> None:
    w.pack("IQ", host.pid, host.probe_addr).raw(host.nonce).text(host.boot_id).text(host.hostname)


def decode_host(r: Reader) -> Host:
    pid, addr = r.unpack("IQ")
    nonce = bytes(r.take(16))
    return Host(pid, r.text() or "", r.text() or "", addr, nonce)


def xproc_mode() -> str:
    return os.environ.get(ENV_XPROC, "auto").strip().lower() or "auto"


def pvm_usable(peer: Host) -> bool:
    """True when process_vm_readv on the peer reaches the process that sent ``peer``."""
    if xproc is None or xproc_mode() == "tcp":
        return False
    if peer.pid == os.getpid() or not peer.boot_id or peer.boot_id != BOOT_ID:
        return False
    try:
        return bool(xproc.pvm_read_bytes(peer.pid, peer.probe_addr, 16) == peer.nonce)
    except (OSError, ValueError):
        return False


# ---- a watchdog for deadlines --------------------------------------------------------------------
