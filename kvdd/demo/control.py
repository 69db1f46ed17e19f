"""The demo's control channel: one TCP connection, one JSON object per line (see the package
docstring for the messages), and where a ready prefill side can be reached.

Nothing that listens trusts the network (docs/security.md): before any line is read, both sides
run the fabric's mutual challenge-response with the fabric secret
(:func:`kvdd.secret.authenticate_socket`, ``KVDD_FABRIC_AUTH=off`` honoured as there), within
:data:`AUTH_TIMEOUT_S`; the prefill side authenticates one connection at a time and refuses (and
logs) any that fails, then keeps waiting for the real decode side until its own deadline.  Every
line is bounded by :data:`MAX_LINE` bytes."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..secret import AuthError, Secret, SecretError, authenticate_socket, load_secret
from .errors import DemoError, Json
from .options import Address
from .text import Progress

__all__ = ["AUTH_TIMEOUT_S", "MAX_LINE", "Control", "ReadyInfo", "accept_control", "connect_control",
           "control_secret", "send_error"]

_log = logging.getLogger(__name__)

#: The longest control line either side reads or sends (bytes, newline included).
MAX_LINE = 1 << 20
#: Seconds a connection has to complete the challenge-response.
AUTH_TIMEOUT_S = 5.0
#: What the challenge-response authenticates (domain separation from the link handshake).
CONTEXT = b"kvdd-demo-control/1"
#: Refused connections the prefill side reports one by one (later ones are only counted).
_REPORTED_REFUSALS = 5


def control_secret() -> Secret:
    """The fabric secret the control channel proves (:func:`kvdd.secret.load_secret`).

    Raises
    ------
    DemoError
        When no usable secret is set, saying what to set (never the secret).
    """
    try:
        return load_secret()
    except SecretError as exc:
        raise DemoError(f"no usable secret for the control channel: {exc}") from None


class Control:
    """One line-delimited JSON connection between the two sides."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        sock.settimeout(timeout)
        self._r = sock.makefile("rb")

    def send(self, msg: Json) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
        if len(data) > MAX_LINE:
            raise DemoError(f"a control message for the {self.peer} side is {len(data)} bytes, more than "
                            f"the {MAX_LINE}-byte limit (lower --requests or --tokens)")
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise DemoError(f"lost the control connection to the {self.peer} side ({exc})") from None

    def recv(self, *expected: str) -> Json:
        try:
            line = self._r.readline(MAX_LINE + 1)
        except socket.timeout:
            raise DemoError(f"the {self.peer} side did not answer within {self.timeout:g} s "
                            "(control channel)") from None
        except OSError as exc:
            raise DemoError(f"lost the control connection to the {self.peer} side ({exc})") from None
        if not line:
            raise DemoError(f"the {self.peer} side closed the control connection unexpectedly "
                            "(see its output for why)")
        if len(line) > MAX_LINE or not line.endswith(b"\n"):
            self.close()
            if len(line) > MAX_LINE:
                raise DemoError(f"the {self.peer} side sent a control line longer than {MAX_LINE} bytes; "
                                "connection closed")
            raise DemoError(f"the {self.peer} side closed the control connection in the middle of a line")
        try:
            msg = json.loads(line)
        except ValueError:
            raise DemoError(f"the {self.peer} side sent a malformed control message: {line[:80]!r}") from None
        if not isinstance(msg, dict):
            raise DemoError(f"the {self.peer} side sent a malformed control message: {line[:80]!r}")
        kind = msg.get("type")
        if kind == "error":
            if msg.get("refused"):  # the other side goes on (waiting for a matching peer)
                raise DemoError(f"the {self.peer} side refused this one: {msg.get('message')}")
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
    secret = control_secret()
    start = time.monotonic()
    deadline = start + timeout
    refused_deadline = start + min(refused_retry, timeout)
    where = f"{address[0]}:{address[1]}"
    last: OSError | None = None
    announced = False
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except OSError as exc:
            last = exc
        else:
            return _authenticated(sock, where, secret, max(AUTH_TIMEOUT_S, deadline - time.monotonic()), timeout)
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


def _authenticated(sock: socket.socket, where: str, secret: Secret, wait: float, timeout: float) -> Control:
    """The decode side's half of the challenge-response, then the channel (closed on failure)."""
    try:
        # The prefill may be busy refusing another connection (AUTH_TIMEOUT_S each): ``wait``.
        authenticate_socket(sock, initiator=True, context=CONTEXT, timeout=AUTH_TIMEOUT_S, wait=wait,
                            secret=secret)
    except AuthError as exc:
        sock.close()
        raise DemoError(f"authentication with the prefill's control channel at {where} failed: {exc}") from None
    except OSError as exc:
        sock.close()
        raise DemoError(f"lost the control connection to {where} during authentication ({exc})") from None
    return Control(sock, "prefill", timeout)


def accept_control(server: socket.socket, timeout: float, secret: Secret, log: Callable[[str], None],
                   cancel: threading.Event | None = None) -> tuple[Control, Any, int]:
    """Accept the decode side on the prefill's control socket: the first peer that authenticates.

    Connections are authenticated one at a time, each within :data:`AUTH_TIMEOUT_S`; one that fails
    is closed and logged (the first few), and the wait goes on until ``timeout``.

    Parameters
    ----------
    server : socket.socket
        Listening.
    timeout : float
        Seconds to wait for an authenticated decode side (also every later receive's timeout).
    secret : Secret
        From :func:`control_secret`.
    log : Callable[[str], None]
        Gets one line per refused connection (the first few).
    cancel : threading.Event, optional
        Set to stop waiting.

    Returns
    -------
    (Control, address, int)
        The channel, the peer's address, and how many connections were refused before it.

    Raises
    ------
    DemoError
        Nothing authenticated in time, or ``cancel`` was set.
    """
    deadline = time.monotonic() + timeout
    server.settimeout(0.2)
    refused = 0
    while True:
        conn: socket.socket | None
        try:
            conn, addr = server.accept()
        except socket.timeout:  # a poll: look at cancel and the deadline, then wait again
            conn = None
        if conn is not None:
            budget = min(AUTH_TIMEOUT_S, max(0.5, deadline - time.monotonic()))
            try:
                authenticate_socket(conn, initiator=False, context=CONTEXT, timeout=budget, secret=secret)
                return Control(conn, "decode", timeout), addr, refused
            except (AuthError, OSError) as exc:
                conn.close()
                refused += 1
                if refused <= _REPORTED_REFUSALS:
                    more = "" if refused < _REPORTED_REFUSALS else " (further refusals are only counted)"
                    log(f"refused a control connection from {addr[0]}: {exc}; still waiting for decode{more}")
        if cancel is not None and cancel.is_set():
            raise DemoError("the decode side gave up before connecting")
        if time.monotonic() >= deadline:
            extra = f" ({refused} connections failed authentication)" if refused else ""
            raise DemoError(f"no decode side connected within {timeout:g} s{extra}")
