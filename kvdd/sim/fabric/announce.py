"""What an acceptor announces in its authentication answer, for the work a link can start before
its hello is answered (the same-host proof: :mod:`.samehost_link` registers the announcer).

The acceptor's answer (``AUTH_OK``) carries its MAC and, after it, the announcement of the one
registered :class:`Announcer` (b"" without one, or when it has nothing to offer); the acceptor's MAC
and the session transcript cover it (:mod:`.listener_auth`, :func:`.auth.answer_transcript`), so
it is exactly as authentic as the answer.  The announcer learns of every session it was announced
to (``expect``, before the answer leaves) and of each of them that will not become a link using it
(``abandon``: an unlink, a refused link, a connection dropped before its hello was served); on the
initiator's side, of each link hello sent (``sent``: what the announcement offers starts then,
while the acceptor serves the hello) and of each handshake that ended before the acceptor's reply
was accepted (``discard``).  Every callback is cheap and never waits for a peer: the listener's thread calls
the first ones.
"""

from __future__ import annotations

import logging
from typing import Protocol

from .auth import Session

logger = logging.getLogger(__name__)

__all__ = ["Announcer", "MAX_ANNOUNCEMENT", "set_announcer", "announcement", "expect", "abandon",
           "sent", "discard", "closed"]

MAX_ANNOUNCEMENT = 192  # bytes after the 32-byte MAC (an authentication frame is at most 256)


class Announcer(Protocol):
    """The extension that announces itself in authentication answers (at most one)."""

    def announcement(self) -> bytes: ...  # acceptor: what to announce now (b"": nothing)

    def expect(self, session: Session) -> bool: ...  # acceptor: the session it goes to

    def abandon(self, session: Session) -> None: ...  # acceptor: no link will use it

    def sent(self, session: Session, deadline: float) -> None: ...  # initiator: its hello left

    def discard(self, session: Session) -> None: ...  # initiator: the handshake ended early

    def closed(self, owner_id: int) -> None: ...  # acceptor: a listener of that instance closed


_announcer: Announcer | None = None


def set_announcer(announcer: Announcer | None) -> None:
    """Register (or, with None, remove) the announcer of this process."""
    global _announcer
    _announcer = announcer


def announcement() -> bytes:
    """The announcement for the next authentication answer (b"" without one)."""
    a = _announcer
    if a is None:
        return b""
    try:
        value = a.announcement()
    except Exception:
        logger.exception("kvdd fabric: the announcer failed")
        return b""
    return value if len(value) <= MAX_ANNOUNCEMENT else b""


def expect(session: Session) -> bool:
    """Tell the announcer of the session its announcement goes to; False: announce nothing."""
    a = _announcer
    if a is None:
        return False
    try:
        return a.expect(session)
    except Exception:
        logger.exception("kvdd fabric: the announcer failed")
        return False


def abandon(session: Session) -> None:
    """The acceptor's session ``session`` will not become a link that uses the announcement."""
    a = _announcer
    if a is not None and session.announced:
        try:
            a.abandon(session)
        except Exception:
            logger.exception("kvdd fabric: the announcer failed")


def sent(session: Session, deadline: float) -> None:
    """The initiator's link hello on ``session`` left; its link call ends by ``deadline``
    (``time.monotonic()``), and so does whatever the announcement started for it."""
    a = _announcer
    if a is not None and session.announced:
        try:
            a.sent(session, deadline)
        except Exception:
            logger.exception("kvdd fabric: the announcer failed")


def discard(session: Session) -> None:
    """The initiator's handshake of ``session`` ended before the acceptor's reply was accepted."""
    a = _announcer
    if a is not None and session.announced:
        try:
            a.discard(session)
        except Exception:
            logger.exception("kvdd fabric: the announcer failed")


def closed(owner_id: int) -> None:
    """A listener of the instance ``owner_id`` (its ``id()``) closed: what the announcer keeps for
    that instance's next links goes."""
    a = _announcer
    if a is not None:
        try:
            a.closed(owner_id)
        except Exception:
            logger.exception("kvdd fabric: the announcer failed")
