"""Stub of kvdd/_native/_gather.pyx: a READ of long runs sent by gathering sendmsg calls."""

import socket
from collections.abc import Iterator, Sequence

from typing_extensions import disjoint_base

__all__ = ["GatherSender", "MAX_BUFFERS"]

MAX_BUFFERS: int

@disjoint_base
class GatherSender:
    @property
    def total(self) -> int: ...
    @property
    def blocked(self) -> bool: ...
    def __init__(
        self,
        addrs: Sequence[int],
        nbytes: Sequence[int],
        off: Sequence[int],
        length: Sequence[int],
        header: bytes,
        max_data: int,
        gather_bytes: int,
        buffers: int,
        keep: object = None,
        tensors: object = None,
        trailer: bytes = b"",
    ) -> None: ...
    @property
    def done(self) -> bool: ...
    @property
    def left(self) -> int: ...
    def send(self, sock: socket.socket, budget: int) -> int: ...
    def lists(self) -> Iterator[list[memoryview]]: ...
