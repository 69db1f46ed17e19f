"""The injections of this process: :class:`Injection`, the active set in the order they are
checked, and the decision each hook draws from it (see :mod:`kvdd.sim.faults`)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

from ...status import S_OK, Status
from .kinds import KNOWN_KINDS, NETWORK_KINDS, PACKAGE_TRANSFER_KINDS, TRANSFER_KINDS, peer_loss_status

__all__ = ["Injection", "Decision", "armed", "add", "clear", "active", "paused", "decide",
           "serve_delay_ms"]


class Injection:
    """One active fault (made by :func:`inject`, :func:`lose_peer` or :func:`load`).

    Use it as a context manager (leaving the block removes it) or call :meth:`remove`.  The
    attributes are read-only descriptions of the injection; :attr:`seen` and :attr:`fired` count
    the matching calls that reached it (not those an earlier injection failed) and the calls it
    acted on.
    """

    def __init__(self, kinds: frozenset[str], *, status: int | None, delay_ms: float,
                 bandwidth: float | None, peer_loss: bool, instance: int | None, peer: int | None,
                 count: int | None, after: int, probability: float, seed: int,
                 serve: bool = False) -> None:
        self.kinds = kinds
        self.serve = serve
        self.status = status
        self.delay_ms = delay_ms
        self.bandwidth = bandwidth
        self.peer_loss = peer_loss
        self.instance = instance
        self.peer = peer
        self.count = count
        self.after = after
        self.probability = probability
        self.seed = seed
        self._rng = random.Random(seed)
        self._seen = 0
        self._fired = 0
        self._active = False

    # -- state ----------------------------------------------------------------------------
    @property
    def seen(self) -> int:
        """Calls that matched kind, instance and peer and reached this injection so far (a call
        an earlier injection failed does not)."""
        return self._seen

    @property
    def fired(self) -> int:
        """Calls this injection acted on (failed, delayed or throttled) so far."""
        return self._fired

    @property
    def active(self) -> bool:
        """True until removed."""
        return self._active

    @property
    def exhausted(self) -> bool:
        """True once it has fired ``count`` times."""
        return self.count is not None and self._fired >= self.count

    def remove(self) -> None:
        """Stop injecting (idempotent)."""
        with _lock:
            if self._active:
                _injections.remove(self)
                self._active = False
                _refresh()

    def __enter__(self) -> Injection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()

    # -- description ------------------------------------------------------------------------
    def spec(self) -> str:
        """This injection in the :data:`ENV_VAR` syntax (``parse(inj.spec())`` recreates it)."""
        if self.peer_loss:
            head = "peer_loss"
        else:
            head = ",".join(k for k in KNOWN_KINDS if k in self.kinds)
        items = [head]
        if self.status is not None:
            known = Status(self.status)
            items.append(f"status={known.name}" if known.is_known else f"status=0x{self.status:X}")
        if self.delay_ms:
            items.append(f"delay_ms={self.delay_ms!r}")
        if self.bandwidth is not None:
            items.append(f"bandwidth={self.bandwidth!r}")
        if self.instance is not None:
            items.append(f"instance={self.instance}")
        if self.peer is not None:
            items.append(f"peer={self.peer}")
        if self.count is not None:
            items.append(f"count={self.count}")
        if self.after:
            items.append(f"after={self.after}")
        if self.probability != 1.0:
            items.append(f"probability={self.probability!r}")
        if self.seed:
            items.append(f"seed={self.seed}")
        if self.serve:
            items.append("serve=1")
        if self.peer_loss and set(self.kinds) != set(NETWORK_KINDS):
            items.append("kinds=" + "+".join(k for k in KNOWN_KINDS if k in self.kinds))
        return ":".join(items)

    def __repr__(self) -> str:
        state = "active" if self._active else "inactive"
        return f"<Injection {self.spec()!r} {state} seen={self._seen} fired={self._fired}>"

    # -- matching (called with _lock held) --------------------------------------------------
    def _matches(self, kind: str, instance: int, peer: int | None) -> bool:
        if kind not in self.kinds:
            return False
        if self.instance is not None and self.instance != instance:
            return False
        if self.peer is not None and self.peer != peer:
            return False
        return True

    def _fire(self) -> bool:
        self._seen += 1
        if self._seen <= self.after:
            return False
        if self.count is not None and self._fired >= self.count:
            return False
        if self.probability < 1.0 and self._rng.random() >= self.probability:
            return False
        self._fired += 1
        return True



_lock = threading.Lock()
_injections: list[Injection] = []
#: True while any injection is active: the hooks' fast path, read without the lock.
armed = False
_tls = threading.local()


def _refresh() -> None:
    global armed
    armed = bool(_injections)


def add(inj: Injection) -> Injection:
    """Activate ``inj`` (checked after those already active); returns it."""
    with _lock:
        _injections.append(inj)
        inj._active = True
        _refresh()
    return inj


def clear() -> None:
    """Remove every injection of this process (also those loaded from :data:`ENV_VAR`)."""
    with _lock:
        for inj in _injections:
            inj._active = False
        _injections.clear()
        _refresh()


def active() -> tuple[Injection, ...]:
    """The active injections, in the order they are checked."""
    with _lock:
        return tuple(_injections)


@contextmanager
def paused() -> Iterator[None]:
    """No injection fires for calls made by this thread inside the block (for test set-up)."""
    old = getattr(_tls, "on", False)
    _tls.on = True
    try:
        yield
    finally:
        _tls.on = old


@dataclass
class Decision:
    """What the firing injections of one call add up to (see the package docstring)."""

    status: int = S_OK
    delay_ms: float = 0.0
    bandwidth: float | None = None
    why: str = ""


def decide(kind: str, instance: int, peer: int | None, network: bool) -> Decision:
    """Draw the decision for one call of ``kind`` by ``instance`` naming ``peer`` (``network``:
    whether the call reaches the peer, so that peer loss applies)."""
    d = Decision()
    if getattr(_tls, "on", False):
        return d
    with _lock:
        for inj in _injections:
            if inj.serve or (inj.peer_loss and not network):
                continue
            if not inj._matches(kind, instance, peer) or not inj._fire():
                continue
            d.delay_ms += inj.delay_ms
            if inj.bandwidth is not None:
                d.bandwidth = inj.bandwidth if d.bandwidth is None else min(d.bandwidth, inj.bandwidth)
            if inj.peer_loss:
                d.status = peer_loss_status(kind)
                d.why = f"peer {peer} is lost (injected by kvdd.sim.faults: {inj.spec()})"
                break
            if inj.status is not None:
                d.status = inj.status
                d.why = f"injected by kvdd.sim.faults: {inj.spec()}"
                break
    return d


def serve_delay_ms(me: int, what: str, nbytes: int) -> float:
    """The time ``serve=True`` injections add to what instance ``me`` serves (see
    :func:`kvdd.sim.faults.on_serve`); counts ``count`` / ``after`` / ``probability`` on leases."""
    if getattr(_tls, "on", False):
        return 0.0
    kinds = frozenset({"lease": (*TRANSFER_KINDS, *PACKAGE_TRANSFER_KINDS),
                       "read": ("pull_kv_cache", "pull_kv_blocks", "pull_cache", "pull_blocks"),
                       "write": ("push_kv_cache", "push_kv_blocks", "push_cache", "push_blocks",
                                 "transfer_cache_async")}[what])
    spent = 0.0
    with _lock:
        for inj in _injections:
            if not inj.serve or (inj.peer is not None and inj.peer != me):
                continue
            if not inj.kinds & kinds:
                continue
            if what == "lease":
                if inj.delay_ms and inj._fire():
                    spent += inj.delay_ms
            elif inj.bandwidth is not None and nbytes > 0:
                spent += nbytes / inj.bandwidth * 1000.0
    return spent
