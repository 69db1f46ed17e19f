"""The listening socket of one instance (``llm.ListenIpInfo``, SEMANTICS.md §10 rule 6).

A real TCP socket, registered for in-process lookup, with a server thread that accepts link and
unlink handshakes from other processes and hosts (see :mod:`.handshake`).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

from .handshake import serve_link, serve_unlink
from .protocol import LinkOwner
from .registry import norm_ip, register, unregister
from .watchdog import WATCHDOG
from .wire import (F_HELLO_LINK, F_HELLO_UNLINK, HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKES,
                   ProtocolError, read_header, recv_exact)

logger = logging.getLogger(__name__)

__all__ = ["Listener"]


class Listener:
    """A real listening TCP socket for one instance, registered for in-process lookup, with a
    server thread answering link and unlink handshakes from other processes and hosts."""

    def __init__(self, owner: LinkOwner, ip: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port & 0xFFFF))  # upstream accepts ports up to 2**32-1; htons keeps 16 bits
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.ip = norm_ip(ip)
        self.port: int = sock.getsockname()[1]
        self.owner = owner
        self._closed = False
        self._handshakes = 0
        self._hs_lock = threading.Lock()
        register(self.ip, self.port, owner)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvdd-sim-listen {self.ip}:{self.port}")
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (links already made stay until unlink / finalize)."""
        unregister(self.ip, self.port, self.owner)
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _addr = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE and friends: do not spin
                continue
            with self._hs_lock:
                busy = self._handshakes >= MAX_HANDSHAKES
                if not busy:
                    self._handshakes += 1
            if busy:
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn,), daemon=True,
                             name="kvdd-sim-handshake").start()

    def _handshake(self, conn: socket.socket) -> None:
        keep = False
        # The whole first frame must arrive within HANDSHAKE_TIMEOUT_S (a peer dripping bytes
        # cannot hold one of the MAX_HANDSHAKES slots longer).
        gate = threading.Lock()
        reading = [True]

        def too_slow() -> None:
            with gate:
                if reading[0]:
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        timer = WATCHDOG.schedule(HANDSHAKE_TIMEOUT_S, too_slow)
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                ftype, _req, length = read_header(conn)
                payload = recv_exact(conn, length)
            finally:
                with gate:
                    reading[0] = False
                WATCHDOG.cancel(timer)
            if ftype == F_HELLO_LINK:
                keep = serve_link(self.owner, conn, payload)
            elif ftype == F_HELLO_UNLINK:
                serve_unlink(self.owner, conn, payload)
        except (OSError, ProtocolError, struct.error) as exc:  # malformed, truncated, too slow
            logger.debug("kvdd fabric: handshake refused: %s", exc)
        except Exception:  # a bug: log it; the connection closes
            logger.exception("kvdd fabric: handshake failed")
        finally:
            with self._hs_lock:
                self._handshakes -= 1
            if not keep:
                try:
                    conn.close()
                except OSError:
                    pass

