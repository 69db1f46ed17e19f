"""Stub of kvdd/_native/_small.pyx: the TCP fabric's frame reader and small-READ staging."""

import socket
from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import disjoint_base

__all__ = ["FrameReader", "Stage", "read_answer", "serve_one_run", "HEADER_SIZE", "F_DATA", "F_DONE", "F_LEASE_READ", "ONE_RUN_SIZE", "RECV_CHUNK"]

HEADER_SIZE: int
F_DATA: int
F_DONE: int
F_LEASE_READ: int
ONE_RUN_SIZE: int
RECV_CHUNK: int

@disjoint_base
class FrameReader:
    @property
    def sock(self) -> socket.socket: ...
    @property
    def error(self) -> type[Exception]: ...
    @property
    def interrupted(self) -> bool: ...
    def __init__(
        self,
        sock: socket.socket,
        limits: Mapping[int, int],
        magic: bytes,
        version: int,
        bad_header: Callable[[bytes], object],
        error: type[Exception],
        size: int = 65536,
    ) -> None: ...
    @property
    def buffered(self) -> int: ...
    def header(self) -> tuple[int, int, int]: ...
    def exact(self, n: int) -> bytes: ...
    def into(self, dst: bytearray | memoryview) -> None: ...
    def discard(self, n: int) -> None: ...
    def small_reply(self, req: int, stage: Stage) -> int: ...
    def serve_lease_read(
        self,
        grant: Callable[[Any, Any, int], tuple[int, Any]],
        owner: object,
        served: object,
        small_bytes: int,
        param_invalid: int,
    ) -> tuple[int, bytes] | None: ...

@disjoint_base
class Stage:
    @property
    def size(self) -> int: ...
    @property
    def left(self) -> int: ...
    def __new__(cls, size: int, limit: int) -> Stage: ...
    def recv(self, rx: FrameReader, n: int) -> None: ...
    def land(self, addr: int) -> None: ...

def read_answer(req: int, addr: int, n: int, magic: bytes, version: int) -> bytes: ...
def serve_one_run(
    payload: bytes,
    req: int,
    grant: Callable[[Any, Any, int], tuple[int, Any]],
    owner: object,
    served: object,
    small_bytes: int,
    param_invalid: int,
    magic: bytes,
    version: int,
) -> bytes | None: ...
