"""Fault injection for the simulator: make links, transfers and registrations fail on purpose.

Engines built on LLM-DataDist spend much of their code on retries and relinks after
``LLM_LINK_FAILED``, ``LLM_TIMEOUT`` and peer loss.  This module lets a test (or an unmodified
program, through :data:`ENV_VAR`) ask the simulator for exactly those failures, deterministically
(seeded) and scoped, so that the recovery code can be tested off hardware (SEMANTICS.md §10 rule 7).

Quick start::

    from kvdd.sim import faults

    with faults.inject("push_kv_blocks", status=kvdd.Status.LLM_TIMEOUT, count=1):
        ...  # the next PushKvBlocks of any instance in this process returns LLM_TIMEOUT

    with faults.lose_peer(peer=1, instance=2):
        ...  # instance 2 behaves as if cluster 1 had died

What a fault can do
-------------------
* **fail** the call with an LLM status (``status=``).  An injected failure moves no bytes and has
  upstream's consequences: after a transfer returns ``LLM_TIMEOUT`` the link is broken and every later
  transfer over it returns ``LLM_TIMEOUT`` at once until it is unlinked and linked again
  (SEMANTICS.md §10 rule 8).  Injected statuses return at once (they do not wait out a timeout); add
  ``delay_ms`` to make the failure take time.
* **slow** the call down: ``delay_ms`` (a fixed latency) and ``bandwidth`` (bytes per second; a
  transfer of ``n`` bytes takes ``n / bandwidth`` seconds more).  When a link or unlink is delayed
  beyond its ``timeout_ms``, or a transfer beyond ``llm.SyncKvCacheWaitTime``, the call waits that
  long and returns ``LLM_TIMEOUT`` without moving bytes (and a transfer breaks the link).
* **lose a peer** (:func:`lose_peer`): links to it fail ``LLM_LINK_FAILED`` (the port is closed),
  non-force unlinks ``LLM_UNLINK_FAILED``, transfers ``LLM_TIMEOUT`` (SEMANTICS.md §10 rule 2: the
  owner cannot be reached; the link is then broken).  Force unlinks and registrations are local and
  unaffected.

Scope
-----
Each injection matches calls by *kind* (:data:`CALL_KINDS`, or the groups ``"transfer"``,
``"pull"``, ``"push"``, ``"all"``), by *instance* (the cluster id of the instance that performs the
call; ``None`` = any) and by *peer* (the cluster id the caller names: ``ClusterInfo.remote_cluster_id``
for link/unlink, ``CacheIndex.cluster_id`` for transfers; ``None`` = any; registrations have no
peer, so an injection with a peer never matches them).  Among the matching calls it skips the first
``after``, then fires with ``probability`` (drawn from its own ``random.Random(seed)``, so a given
call sequence always gives the same outcome) until it has fired ``count`` times (``None`` = no
limit).  Injections are checked in the order they were made; delays of all firing injections add up,
the smallest bandwidth applies, and the first firing injection with a status (or peer loss) decides
the failure.

Where faults fire
-----------------
An injected fault replaces what the transport or the hardware would do, so every check the call
makes on its own arguments and state comes first and still wins:

``link``
    per cluster of ``LinkLlmClusters``, after the call's checks (not initialized, timeout, IPv4, empty
    list) and the cluster's own (``remote_ip_infos`` count, ``local_ip_infos`` rule, for ``hixl`` an
    existing connection to that ip:port → ``LLM_ALREADY_LINK``), in place of connecting: the peer is
    not contacted and no link entity is created on either side.  The default backend's handshake
    checks (``llm.LocalCommRes`` validity, ``LLM_ALREADY_LINK``) are part of what is replaced.
``unlink``
    per cluster of ``UnlinkLlmClusters``, after the same call checks and, for a non-force unlink, the
    ``remote_ip_infos`` count; in place of the teardown: on failure no entity is removed on either
    side, so the unlink can be retried.
``register``
    in ``RegisterKvCache`` after every argument check and after the cache id is consumed (§3.7 steps
    1-8), in place of registering the memory with the transport (step 9) — a failed registration
    burns an id as a real transport failure does.
``pull_kv_cache``, ``pull_kv_blocks``, ``push_kv_cache``, ``push_kv_blocks``
    after every validation step of SEMANTICS.md §3.10-§3.13 (including the remote cache lookup and
    kvdd's §10 bound checks), immediately before bytes would move, while the link is held.  A link
    that is already broken reports its own ``LLM_TIMEOUT`` first and consumes no injection.  A
    multi-layer push is one call with one decision, made before any of its layers is written (an
    injected failure writes no layer; a layer that fails its own checks still ends the call with
    the earlier layers written, §3.12 step 7); its delay is paid once, its bandwidth cap applies to
    every layer's bytes.

Processes
---------
Injections made with this API live in the process that makes them and apply to the calls that
process performs (the side that *performs* a call: the puller of a pull, the pusher of a push, the
initiator of a link).  Peers in other processes are reached through :data:`ENV_VAR`, which child
processes inherit: set it before starting them (``faults.env_value()`` renders the active
injections in that syntax).

An injection made with ``serve=True`` (``serve=1`` in the variable) works on the other side
instead: the process slows down what it *serves* to peers in other processes — ``delay_ms`` before
it grants each remote transfer (either data path), ``bandwidth`` on the bytes it sends or receives
over the TCP data path (the ``process_vm`` path moves bytes without the owner, so only the delay
applies there).  Its ``peer`` names the serving instance; it cannot filter by ``instance``, fail a
call or lose a peer, and it never applies to the calls the process performs itself, so the same
variable in both processes does not slow a link twice.  Its ``count``, ``after`` and
``probability`` count served transfers and govern the delay only.

Environment variable
--------------------
``KVDD_SIM_FAULTS`` holds injections separated by ``;``; each is a kind list (``,``-separated, or
``peer_loss``) followed by ``:key=value`` items::

    KVDD_SIM_FAULTS='push_kv_blocks:status=LLM_TIMEOUT:count=1;link:status=LLM_LINK_FAILED:probability=0.5:seed=3'
    KVDD_SIM_FAULTS='peer_loss:peer=1:instance=2:after=20'
    KVDD_SIM_FAULTS='transfer:delay_ms=5:bandwidth=100M'
    KVDD_SIM_FAULTS='pull:bandwidth=1Gi:serve=1'      # in the server's environment

Keys: ``status`` (a status name with or without ``LLM_``, or a number, e.g. ``0x5010B01A``),
``count``, ``after``, ``probability`` (or ``p``), ``seed``, ``instance``, ``peer``, ``delay_ms``,
``bandwidth`` (bytes/s; suffixes ``k M G`` = 10^3, 10^6, 10^9 and ``Ki Mi Gi`` = 2^10, 2^20,
2^30), ``serve`` (``0``/``1``).  The variable is read once, when this module is imported (the first time a simulator
instance is created); a malformed value raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol

from ..status import S_OK, TIMEOUT, Status, status_name

__all__ = [
    "ENV_VAR",
    "CALL_KINDS",
    "TRANSFER_KINDS",
    "KIND_GROUPS",
    "CallKind",
    "Injection",
    "inject",
    "lose_peer",
    "clear",
    "active",
    "paused",
    "parse",
    "load",
    "env_value",
]

#: The environment variable read at import (see the module docstring for its syntax).
ENV_VAR = "KVDD_SIM_FAULTS"

CallKind = Literal["link", "unlink", "register", "pull_kv_cache", "pull_kv_blocks",
                   "push_kv_cache", "push_kv_blocks"]

#: Every call kind an injection can match.
CALL_KINDS: tuple[str, ...] = ("link", "unlink", "register", "pull_kv_cache", "pull_kv_blocks",
                               "push_kv_cache", "push_kv_blocks")
#: The four transfer calls.
TRANSFER_KINDS: tuple[str, ...] = ("pull_kv_cache", "pull_kv_blocks", "push_kv_cache", "push_kv_blocks")
#: Names that stand for several kinds.
KIND_GROUPS: Mapping[str, tuple[str, ...]] = {
    "transfer": TRANSFER_KINDS,
    "pull": ("pull_kv_cache", "pull_kv_blocks"),
    "push": ("push_kv_cache", "push_kv_blocks"),
    "all": CALL_KINDS,
    "*": CALL_KINDS,
}
#: The kinds a lost peer affects (registration is local).
_NETWORK_KINDS: tuple[str, ...] = ("link", "unlink", *TRANSFER_KINDS)


def _peer_loss_status(kind: str) -> int:
    if kind == "link":
        return int(Status.LLM_LINK_FAILED)  # the dead peer's port refuses connections
    if kind == "unlink":
        return int(Status.LLM_UNLINK_FAILED)
    return TIMEOUT  # §10 rule 2: the owner cannot be reached


def _kinds(kinds: str | Iterable[str]) -> frozenset[str]:
    names = [kinds] if isinstance(kinds, str) else list(kinds)
    out: set[str] = set()
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"call kinds must be str, not {type(name).__name__}")
        key = name.strip()
        if key in KIND_GROUPS:
            out.update(KIND_GROUPS[key])
        elif key in CALL_KINDS:
            out.add(key)
        else:
            raise ValueError(f"unknown call kind {name!r}; use one of {', '.join(CALL_KINDS)} "
                             f"or a group ({', '.join(KIND_GROUPS)})")
    if not out:
        raise ValueError("no call kind given")
    return frozenset(out)


def _status(value: int | str) -> int:
    if isinstance(value, bool):
        raise TypeError("status must be an int or a status name, not bool")
    if isinstance(value, str):
        text = value.strip()
        name = text.upper()
        if not name.startswith("LLM_"):
            name = "LLM_" + name
        if name in Status.__members__:
            value = int(Status[name])
        else:
            try:
                value = int(text, 0)
            except ValueError:
                raise ValueError(f"unknown status {text!r}; use a kvdd.Status name such as "
                                 "LLM_TIMEOUT or a number") from None
    if not isinstance(value, int):
        raise TypeError(f"status must be an int or a status name, not {type(value).__name__}")
    value = int(value)
    if not 0 < value <= 0xFFFFFFFF:
        raise ValueError(f"status {value} is not a failure status (a uint32 other than LLM_SUCCESS)")
    return value


def _cluster(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a cluster id (int), not bool")
    if isinstance(value, int):
        cid = int(value)
    else:
        cid_attr = getattr(value, "cluster_id", None)  # an LlmDataDist or a SimBackend
        if not isinstance(cid_attr, int):
            raise TypeError(f"{what} must be a cluster id (int) or an instance with .cluster_id, "
                            f"not {type(value).__name__}")
        cid = cid_attr
    if not 0 <= cid < 2**64:
        raise ValueError(f"{what} {cid} is not a uint64 cluster id")
    return cid


class Injection:
    """One active fault (made by :func:`inject`, :func:`lose_peer` or :func:`load`).

    Use it as a context manager (leaving the block removes it) or call :meth:`remove`.  The
    attributes are read-only descriptions of the injection; :attr:`seen` and :attr:`fired` count
    the matching calls and the calls it acted on.
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
        """Calls that matched kind, instance and peer so far."""
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
            head = ",".join(k for k in CALL_KINDS if k in self.kinds)
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
        if self.peer_loss and set(self.kinds) != set(_NETWORK_KINDS):
            items.append("kinds=" + "+".join(k for k in CALL_KINDS if k in self.kinds))
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
_any = False  # fast path: read without the lock by every hook
_tls = threading.local()


def _refresh() -> None:
    global _any
    _any = bool(_injections)


def _add(inj: Injection) -> Injection:
    with _lock:
        _injections.append(inj)
        inj._active = True
        _refresh()
    return inj


def _make(kinds: str | Iterable[str], *, status: int | str | None = None, delay_ms: float = 0.0,
          bandwidth: float | None = None, peer_loss: bool = False, instance: object = None,
          peer: object = None, count: int | None = None, after: int = 0, probability: float = 1.0,
          seed: int = 0, serve: bool = False) -> Injection:
    ks = _kinds(kinds)
    st = None if status is None else _status(status)
    if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)):
        raise TypeError("delay_ms must be a number of milliseconds")
    if not delay_ms >= 0 or delay_ms == float("inf"):
        raise ValueError(f"delay_ms {delay_ms} must be finite and >= 0")
    if bandwidth is not None:
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)):
            raise TypeError("bandwidth must be a number of bytes per second")
        if not bandwidth > 0:
            raise ValueError(f"bandwidth {bandwidth} must be > 0 bytes per second")
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError("count must be an int or None")
        if count < 0:
            raise ValueError(f"count {count} must be >= 0")
    if isinstance(after, bool) or not isinstance(after, int):
        raise TypeError("after must be an int")
    if after < 0:
        raise ValueError(f"after {after} must be >= 0")
    if isinstance(probability, bool) or not isinstance(probability, (int, float)):
        raise TypeError("probability must be a number")
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"probability {probability} must be in [0, 1]")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError("seed must be an int")
    if st is None and not peer_loss and delay_ms == 0 and bandwidth is None:
        raise ValueError("an injection needs a status, a delay_ms, a bandwidth or peer loss")
    if not isinstance(serve, bool):
        raise TypeError("serve must be bool")
    if serve:
        if st is not None or peer_loss:
            raise ValueError("serve=True injections slow down what this process serves; they take "
                             "delay_ms and bandwidth only (a status is injected by the caller's side)")
        if instance is not None:
            raise ValueError("serve=True injections cannot filter by instance (the serving side "
                             "does not know the caller); use peer= for the serving instance")
        if not ks & frozenset(TRANSFER_KINDS):
            raise ValueError("serve=True injections apply to transfer kinds only")
    return Injection(ks, status=st, delay_ms=float(delay_ms),
                     bandwidth=None if bandwidth is None else float(bandwidth), peer_loss=peer_loss,
                     instance=_cluster(instance, "instance"), peer=_cluster(peer, "peer"),
                     count=count, after=after, probability=float(probability), seed=seed,
                     serve=serve)


def inject(kinds: str | Iterable[str], *, status: int | str | None = None, delay_ms: float = 0.0,
           bandwidth: float | None = None, instance: object = None, peer: object = None,
           count: int | None = None, after: int = 0, probability: float = 1.0,
           seed: int = 0, serve: bool = False) -> Injection:
    """Inject a failure, a delay or a bandwidth cap into calls of ``kinds``; active at once.

    Parameters
    ----------
    kinds : str or iterable of str
        Call kinds (:data:`CALL_KINDS`) or groups (``"transfer"``, ``"pull"``, ``"push"``,
        ``"all"``).
    status : int or str, optional
        The status the call returns (a :class:`kvdd.Status`, its name, or a raw number as hardware
        can return).  ``LLM_TIMEOUT`` on a transfer breaks the link (SEMANTICS.md §10 rule 8).
    delay_ms : float
        Added latency in milliseconds (before the failure, or before the bytes move).
    bandwidth : float, optional
        Bytes per second the transfer may move (transfers only).
    instance, peer : int or object with ``.cluster_id``, optional
        The cluster id of the calling instance / of the peer it names (None = any).
    count : int, optional
        Fire at most this many times (None = unlimited).
    after : int
        Let this many matching calls through first.
    probability, seed : float, int
        Fire each eligible call with this probability, drawn from ``random.Random(seed)``.
    serve : bool
        Apply on the *serving* side instead: this process slows down what it serves to peers in
        other processes (``delay_ms`` per transfer, ``bandwidth`` on the TCP data path); ``peer``
        then names the serving instance (see "Processes" in the module docstring).

    Returns
    -------
    Injection
        Active until :meth:`Injection.remove` or the end of its ``with`` block.

    Raises
    ------
    TypeError, ValueError
        For an unknown kind or status, or out-of-range numbers.
    """
    return _add(_make(kinds, status=status, delay_ms=delay_ms, bandwidth=bandwidth,
                      instance=instance, peer=peer, count=count, after=after,
                      probability=probability, seed=seed, serve=serve))


def lose_peer(peer: object = None, *, instance: object = None, after: int = 0,
              count: int | None = None, probability: float = 1.0, seed: int = 0,
              kinds: str | Iterable[str] = _NETWORK_KINDS) -> Injection:
    """Make ``peer`` (None = every peer) unreachable for ``instance`` (None = every instance).

    Links fail ``LLM_LINK_FAILED``, non-force unlinks ``LLM_UNLINK_FAILED`` and transfers
    ``LLM_TIMEOUT`` (breaking the link, §10 rules 2 and 8), until the injection is removed.  The
    peer itself is untouched: to kill it for real, finalize it or end its process.
    """
    ks = _kinds(kinds) & frozenset(_NETWORK_KINDS)
    if not ks:
        raise ValueError("peer loss affects only link, unlink and transfer calls")
    return _add(_make(ks, peer_loss=True, instance=instance, peer=peer, count=count, after=after,
                      probability=probability, seed=seed))


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


def env_value() -> str:
    """The active injections in :data:`ENV_VAR` syntax, e.g. to pass them to a child process."""
    return ";".join(inj.spec() for inj in active())


# ---- the environment variable -------------------------------------------------------------

_SUFFIX = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _number(text: str) -> float:
    t = text.strip()
    for suffix in ("Ki", "Mi", "Gi", "k", "K", "M", "G"):
        if t.endswith(suffix):
            return float(t[:-len(suffix)]) * _SUFFIX[suffix]
    return float(t)


def _parse_one(text: str) -> Injection:
    parts = [p.strip() for p in text.split(":")]
    head, rest = parts[0], parts[1:]
    kw: dict[str, str] = {}
    for item in rest:
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"{item!r} is not key=value")
        if key == "p":
            key = "probability"
        if key in kw:
            raise ValueError(f"{key} given twice")
        kw[key] = value.strip()
    allowed = {"status", "count", "after", "probability", "seed", "instance", "peer", "delay_ms",
               "bandwidth", "kinds", "serve"}
    unknown = set(kw) - allowed
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}; use {', '.join(sorted(allowed))}")
    try:
        count = int(kw["count"]) if "count" in kw else None
        after = int(kw.get("after", "0"))
        probability = float(kw.get("probability", "1"))
        seed = int(kw.get("seed", "0"), 0)
        instance = int(kw["instance"], 0) if "instance" in kw else None
        peer = int(kw["peer"], 0) if "peer" in kw else None
        delay_ms = float(kw.get("delay_ms", "0"))
        bandwidth = _number(kw["bandwidth"]) if "bandwidth" in kw else None
        serve = {"1": True, "true": True, "0": False, "false": False}[kw.get("serve", "0").lower()]
    except KeyError:
        raise ValueError("serve must be 0 or 1") from None
    except ValueError as exc:
        raise ValueError(f"bad number: {exc}") from None
    if head == "peer_loss":
        if "status" in kw or "delay_ms" in kw or "bandwidth" in kw:
            raise ValueError("peer_loss takes no status, delay_ms or bandwidth")
        kinds = kw["kinds"].split("+") if "kinds" in kw else list(_NETWORK_KINDS)
        ks = _kinds(kinds) & frozenset(_NETWORK_KINDS)
        if not ks:
            raise ValueError("peer loss affects only link, unlink and transfer calls")
        return _make(ks, peer_loss=True, instance=instance, peer=peer, count=count, after=after,
                     probability=probability, seed=seed)
    if "kinds" in kw:
        raise ValueError("kinds= is only for peer_loss; list the kinds before the first ':'")
    return _make(head.split(","), status=kw.get("status"), delay_ms=delay_ms, bandwidth=bandwidth,
                 instance=instance, peer=peer, count=count, after=after, probability=probability,
                 seed=seed, serve=serve)


def parse(text: str) -> list[Injection]:
    """Parse :data:`ENV_VAR` syntax into (inactive) injections; ``ValueError`` on any mistake."""
    if not isinstance(text, str):
        raise TypeError("fault specification must be a str")
    out: list[Injection] = []
    for i, chunk in enumerate(text.split(";")):
        if not chunk.strip():
            continue
        try:
            out.append(_parse_one(chunk))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"fault #{i + 1} {chunk.strip()!r}: {exc}") from None
    return out


def load(text: str) -> list[Injection]:
    """Parse ``text`` (:data:`ENV_VAR` syntax) and activate the injections; returns them."""
    return [_add(inj) for inj in parse(text)]


def _load_env() -> None:
    text = os.environ.get(ENV_VAR)
    if not text:
        return
    try:
        load(text)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}={text!r}: {exc} (see kvdd.sim.faults for the syntax)") from None


# ---- hooks called by the engine (kvdd.sim.engine) -------------------------------------------


class _Instance(Protocol):
    """What the hooks need of a :class:`kvdd.sim.engine.SimBackend`."""

    cluster_id: int
    sync_wait_ms: int

    def _fail(self, status: int, detail: str) -> int: ...


class _Link(Protocol):
    broken: bool


class _Server(Protocol):
    """What :func:`on_serve` needs of the serving instance (a fabric ``LinkOwner``)."""

    cluster_id: int


@dataclass
class _Decision:
    status: int = S_OK
    delay_ms: float = 0.0
    bandwidth: float | None = None
    why: str = ""


def _decide(kind: str, instance: int, peer: int | None, network: bool) -> _Decision:
    d = _Decision()
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
                d.status = _peer_loss_status(kind)
                d.why = f"peer {peer} is lost (injected by kvdd.sim.faults: {inj.spec()})"
                break
            if inj.status is not None:
                d.status = inj.status
                d.why = f"injected by kvdd.sim.faults: {inj.spec()}"
                break
    return d


def _sleep_ms(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000.0)


def _timed(owner: _Instance, d: _Decision, nbytes: int, budget_ms: float, what: str) -> int:
    """Spend the injected time; LLM_TIMEOUT when it exceeds ``budget_ms``; then the failure."""
    spent = d.delay_ms
    if d.bandwidth is not None and nbytes > 0:
        spent += nbytes / d.bandwidth * 1000.0
    if spent > budget_ms:
        _sleep_ms(budget_ms)
        return owner._fail(TIMEOUT, f"{what} took longer than {budget_ms:g} ms "
                           f"(slowed down by kvdd.sim.faults: {spent:.1f} ms)")
    _sleep_ms(spent)
    if d.status != S_OK:
        return owner._fail(d.status, f"{what} failed with {status_name(d.status)}: {d.why}")
    return S_OK


def on_link(owner: _Instance, peer: int, timeout_ms: int) -> int:
    """Hook: one cluster of LinkLlmClusters, after its checks, before connecting."""
    if not _any:
        return S_OK
    d = _decide("link", owner.cluster_id, peer, True)
    return _timed(owner, d, 0, timeout_ms, f"link to cluster {peer}")


def on_unlink(owner: _Instance, peer: int, timeout_ms: int, force: bool) -> int:
    """Hook: one cluster of UnlinkLlmClusters, after its checks, before the teardown.

    ``force`` (or the hixl backend) means no network traffic: peer loss does not apply and the
    timeout does not bound injected delays."""
    if not _any:
        return S_OK
    d = _decide("unlink", owner.cluster_id, peer, not force)
    return _timed(owner, d, 0, float("inf") if force else timeout_ms, f"unlink of cluster {peer}")


def on_register(owner: _Instance) -> int:
    """Hook: RegisterKvCache after the id is consumed, before registering memory (§3.7 step 9)."""
    if not _any:
        return S_OK
    d = _decide("register", owner.cluster_id, None, False)
    return _timed(owner, d, 0, float("inf"), "memory registration")


def on_transfer(owner: _Instance, kind: str, peer: int, link: _Link, nbytes: int,
                first: bool = True) -> int:
    """Hook: a transfer after all its checks, just before bytes move (link lock held).

    ``nbytes`` is what this step moves (for the bandwidth cap); ``first`` is False for the later
    layers of a multi-layer push: they pay the first layer's bandwidth cap for their own bytes
    but no new decision is drawn (the delay is paid once per call).  An injected or simulated
    ``LLM_TIMEOUT`` marks ``link`` broken (§10 rule 8)."""
    if not _any or link.broken:
        return S_OK
    if first:
        d = _decide(kind, owner.cluster_id, peer, True)
        _tls.layer = (id(owner), kind, d.bandwidth)
    else:  # a later layer of the same push: only the first layer's bandwidth cap applies
        prev = getattr(_tls, "layer", None)
        bw = prev[2] if prev is not None and prev[:2] == (id(owner), kind) else None
        d = _Decision(bandwidth=bw)
    status = _timed(owner, d, nbytes, owner.sync_wait_ms, f"{kind} from/to cluster {peer}")
    if status == TIMEOUT:
        link.broken = True
    return status


_load_env()


def on_serve(owner: _Server, what: Literal["lease", "read", "write"], nbytes: int = 0) -> None:
    """Hook for the fabric's server side: slow down what ``owner`` serves to another process.

    Only ``serve=True`` injections apply, matched by their ``peer`` (= the serving instance; None =
    any).  ``"lease"`` (once per remote transfer, before anything is granted) pays ``delay_ms`` and
    counts ``count`` / ``after`` / ``probability``; ``"read"`` / ``"write"`` (TCP data path, before
    the bytes are gathered or received) pay ``nbytes / bandwidth`` for injections with a pull /
    push kind.  Sleeping here delays the reply; a caller whose deadline passes gets LLM_TIMEOUT
    and closes the connection, so nothing is written late."""
    if not _any or getattr(_tls, "on", False):
        return
    me = owner.cluster_id
    kinds = {"lease": TRANSFER_KINDS, "read": ("pull_kv_cache", "pull_kv_blocks"),
             "write": ("push_kv_cache", "push_kv_blocks")}[what]
    spent = 0.0
    with _lock:
        for inj in _injections:
            if not inj.serve or (inj.peer is not None and inj.peer != me):
                continue
            if not inj.kinds & frozenset(kinds):
                continue
            if what == "lease":
                if inj.delay_ms and inj._fire():
                    spent += inj.delay_ms
            elif inj.bandwidth is not None and nbytes > 0:
                spent += nbytes / inj.bandwidth * 1000.0
    _sleep_ms(spent)
