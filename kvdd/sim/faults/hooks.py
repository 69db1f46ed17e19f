"""The hooks the simulator calls at each injection point (see "Where faults fire" in
:mod:`kvdd.sim.faults`): they draw the decision, spend the injected time and return the status."""

from __future__ import annotations

import threading
import time
from typing import Literal, Protocol

from ...status import S_OK, TIMEOUT
from . import injections as _registry
from .injections import Decision, decide, serve_delay_ms

__all__ = ["FaultTarget", "LinkState", "Server", "on_link", "on_unlink", "on_register",
           "on_transfer", "on_serve", "on_call"]

_layers = threading.local()  # the bandwidth cap of the current multi-layer push, per thread


class FaultTarget(Protocol):
    """What the hooks need of the calling instance (a :class:`kvdd.sim.engine.SimBackend`)."""

    cluster_id: int
    sync_wait_ms: int

    def note_failure(self, status: int, detail: str) -> int:
        """Record ``detail`` as why this thread's call fails with ``status``; returns ``status``."""
        ...


class LinkState(Protocol):
    """The link entity a transfer runs over (a :class:`kvdd.sim.entries.Entity`)."""

    broken: bool


class Server(Protocol):
    """What :func:`on_serve` needs of the serving instance (a fabric ``LinkOwner``)."""

    cluster_id: int


def _sleep_ms(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000.0)


def _timed(owner: FaultTarget, d: Decision, nbytes: int, budget_ms: float, what: str) -> int:
    """Spend the injected time; LLM_TIMEOUT when it exceeds ``budget_ms``; then the failure."""
    spent = d.delay_ms
    if d.bandwidth is not None and nbytes > 0:
        spent += nbytes / d.bandwidth * 1000.0
    if spent > budget_ms:
        _sleep_ms(budget_ms)
        return owner.note_failure(TIMEOUT, f"{what} took longer than {budget_ms:g} ms "
                           f"(slowed down by kvdd.sim.faults: {spent:.1f} ms)")
    _sleep_ms(spent)
    if d.status != S_OK:
        return owner.note_failure(d.status, f"{what}: {d.why}")  # the status heads the message
    return S_OK


def on_link(owner: FaultTarget, peer: int, timeout_ms: int) -> int:
    """Hook: one cluster of LinkLlmClusters, after its checks, before connecting."""
    if not _registry.armed:
        return S_OK
    d = decide("link", owner.cluster_id, peer, True)
    return _timed(owner, d, 0, timeout_ms, f"link to cluster {peer}")


def on_unlink(owner: FaultTarget, peer: int, timeout_ms: int, force: bool) -> int:
    """Hook: one cluster of UnlinkLlmClusters, after its checks, before the teardown.

    ``force`` (or the hixl backend) means no network traffic: peer loss does not apply and the
    timeout does not bound injected delays."""
    if not _registry.armed:
        return S_OK
    d = decide("unlink", owner.cluster_id, peer, not force)
    return _timed(owner, d, 0, float("inf") if force else timeout_ms, f"unlink of cluster {peer}")


def on_register(owner: FaultTarget) -> int:
    """Hook: RegisterKvCache after the id is consumed, before registering memory (§3.7 step 9)."""
    if not _registry.armed:
        return S_OK
    d = decide("register", owner.cluster_id, None, False)
    return _timed(owner, d, 0, float("inf"), "memory registration")


def on_call(owner: FaultTarget, kind: str, peer: int | None = None,
            budget_ms: float = float("inf"), network: bool = False) -> int:
    """Hook for the calls of CANN's Python package that are not transfers (``register_cache``,
    ``register_blocks_cache``, ``query_register_mem_status``, rank-table ``link`` / ``unlink``):
    after the call's own checks, in place of what the transport would do.  ``budget_ms`` bounds
    an injected delay (then LLM_TIMEOUT); ``network``: whether peer loss applies."""
    if not _registry.armed:
        return S_OK
    d = decide(kind, owner.cluster_id, peer, network)
    what = kind.replace("_", " ") if peer is None else f"{kind} of cluster {peer}"
    return _timed(owner, d, 0, budget_ms, what)


def on_transfer(owner: FaultTarget, kind: str, peer: int, link: LinkState, nbytes: int,
                first: bool = True) -> int:
    """Hook: a transfer after all its checks, just before bytes move (link lock held).

    ``nbytes`` is what this step moves (for the bandwidth cap); ``first`` is False for the later
    layers of a multi-layer push: they pay the first layer's bandwidth cap for their own bytes
    but no new decision is drawn (the delay is paid once per call).  An injected or simulated
    ``LLM_TIMEOUT`` marks ``link`` broken (§10 rule 8)."""
    if not _registry.armed or link.broken:
        return S_OK
    if first:
        d = decide(kind, owner.cluster_id, peer, True)
        _layers.layer = (id(owner), kind, d.bandwidth)
    else:  # a later layer of the same push: only the first layer's bandwidth cap applies
        prev = getattr(_layers, "layer", None)
        bw = prev[2] if prev is not None and prev[:2] == (id(owner), kind) else None
        d = Decision(bandwidth=bw)
    status = _timed(owner, d, nbytes, owner.sync_wait_ms, f"{kind} from/to cluster {peer}")
    if status == TIMEOUT:
        link.broken = True
    return status


def on_serve(owner: Server, what: Literal["lease", "read", "write"], nbytes: int = 0) -> None:
    """Hook for the fabric's server side: slow down what ``owner`` serves to another process.

    Only ``serve=True`` injections apply, matched by their ``peer`` (= the serving instance; None =
    any).  ``"lease"`` (once per remote transfer, before anything is granted) pays ``delay_ms`` and
    counts ``count`` / ``after`` / ``probability``; ``"read"`` / ``"write"`` (TCP data path, before
    the bytes are gathered or received) pay ``nbytes / bandwidth`` for injections with a pull /
    push kind.  Sleeping here delays the reply; a caller whose deadline passes gets LLM_TIMEOUT
    and closes the connection, so nothing is written late."""
    if not _registry.armed:
        return
    _sleep_ms(serve_delay_ms(owner.cluster_id, what, nbytes))
