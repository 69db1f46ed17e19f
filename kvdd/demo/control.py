"""The demo's control channel: one TCP connection, one JSON object per line (see the package
docstring for the messages), and where a ready prefill side can be reached."""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass

from .errors import DemoError, Json
from .options import Address
from .text import Progress

__all__ = ["Control", "ReadyInfo", "connect_control", "send_error"]

_log = logging.getLogger(__name__)

class Control:
    """One line-delimited JSON connection between the two sides."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        sock.settimeout(timeout)
        self._r = sock.makefile("rb")

    def send(self, msg: Json) -> None:
        try:
            self.sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        except OSError as exc:
            raise DemoError(f"lost the control connection to the {self.peer} side ({exc})") from None

    def recv(self, *expected: str) -> Json:
        try:
            line = self._r.readline()
        except socket.timeout:
            raise DemoError(f"the {self.peer} side did not answer within {self.timeout:g} s "
                            "(control channel)") from None
        except OSError as exc:
            raise DemoError(f"lost the control connection to the {self.peer} side ({exc})") from None
        if not line:
            raise DemoError(f"the {self.peer} side closed the control connection unexpectedly "
                            "(see its output for why)")
        try:
            msg = json.loads(line)
        except ValueError:
            raise DemoError(f"the {self.peer} side sent a malformed control message: {line[:80]!r}") from None
        if not isinstance(msg, dict):
            raise DemoError(f"the {self.peer} side sent a malformed control message: {line[:80]!r}")
        kind = msg.get("type")
        if kind == "error":
            raise DemoError(f"{self.peer} side failed: {msg.get('message')}")
        if kind not in expected:
            raise DemoError(f"control protocol: expected {' or '.join(expected)} from the {self.peer} "
                            f"side, got {kind!r}")
        return msg

    def close(self) -> None:
        try:
            self._r.close()
            self.sock.close()
        except OSError as exc:  # closing a connection the peer reset
            _log.debug("closing the control connection: %s", exc)


def send_error(ctl: Control | None, exc: BaseException) -> None:
    """Tell the other side (when connected) why this side gives up."""
    if ctl is None:
        return
    try:
        ctl.send({"type": "error", "message": str(exc)})
    except DemoError as lost:  # the other side has gone already
        _log.debug("could not report %r to the %s side: %s", exc, ctl.peer, lost.message)


@dataclass(frozen=True)
class ReadyInfo:
    """Where a running prefill side can be reached."""

    listen: Address
    control: Address

    def to_json(self) -> Json:
        return {"listen": f"{self.listen[0]}:{self.listen[1]}", "control": f"{self.control[0]}:{self.control[1]}"}


#: Seconds a refused connection to the control channel is retried (nothing listens there; the
#: prefill side may be a moment away from listening).
REFUSED_RETRY_S = 5.0


def connect_control(address: Address, timeout: float, log: Progress | None = None,
                    refused_retry: float = REFUSED_RETRY_S) -> Control:
    """Connect to the prefill's control channel, retrying while it is not up yet.

    Parameters
    ----------
    address : (str, int)
        The prefill's control channel.
    timeout : float
        Seconds to keep trying while connections go unanswered (and the timeout of every later
        receive).
    log : Progress, optional
        Gets one line when the first attempt is refused, saying how long it retries.
    refused_retry : float
        Seconds to keep retrying while connections are refused (nothing listens there).

    Returns
    -------
    Control
        The connected channel.

    Raises
    ------
    DemoError
        When nothing accepted the connection in time, naming the address and what to check.
    """
    start = time.monotonic()
    deadline = start + timeout
    refused_deadline = start + min(refused_retry, timeout)
    where = f"{address[0]}:{address[1]}"
    last: OSError | None = None
    announced = False
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            return Control(sock, "prefill", timeout)
        except OSError as exc:
            last = exc
        refused = isinstance(last, ConnectionRefusedError)
        if refused and not announced:
            announced = True
            message = (f"the prefill's control channel at {where} refused the connection; retrying for "
                       f"{min(refused_retry, timeout):g} s")
            if log is not None:
                log(message)  # which also logs it
            else:
                _log.info(message)
        if time.monotonic() >= (refused_deadline if refused else deadline):
            waited = min(refused_retry, timeout) if refused else timeout
            raise DemoError(f"cannot reach the prefill's control channel at {where} within {waited:g} s "
                            f"({last}); is `kvdd demo --role prefill` running there? Use the decode "
                            "command it prints: with --listen ...:0 its control port is not PORT+1, pass "
                            "--control-port")
        time.sleep(0.1)
