"""Making injections: the public :func:`inject` and :func:`lose_peer`, and the argument checks
they share with the :data:`kvdd.sim.faults.ENV_VAR` parser (see :mod:`kvdd.sim.faults`)."""

from __future__ import annotations

from collections.abc import Iterable

from ...status import Status
from .injections import Injection, add
from .kinds import NETWORK_KINDS, PACKAGE_TRANSFER_KINDS, TRANSFER_KINDS, parse_kinds

__all__ = ["make", "inject", "lose_peer"]


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


def make(kinds: str | Iterable[str], *, status: int | str | None = None, delay_ms: float = 0.0,
          bandwidth: float | None = None, peer_loss: bool = False, instance: object = None,
          peer: object = None, count: int | None = None, after: int = 0, probability: float = 1.0,
          seed: int = 0, serve: bool = False) -> Injection:
    """An inactive :class:`Injection` from checked arguments (see :func:`inject`)."""
    ks = parse_kinds(kinds)
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
        if not ks & frozenset((*TRANSFER_KINDS, *PACKAGE_TRANSFER_KINDS)):
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
    return add(make(kinds, status=status, delay_ms=delay_ms, bandwidth=bandwidth,
                      instance=instance, peer=peer, count=count, after=after,
                      probability=probability, seed=seed, serve=serve))


def lose_peer(peer: object = None, *, instance: object = None, after: int = 0,
              count: int | None = None, probability: float = 1.0, seed: int = 0,
              kinds: str | Iterable[str] = NETWORK_KINDS) -> Injection:
    """Make ``peer`` (None = every peer) unreachable for ``instance`` (None = every instance).

    Links fail ``LLM_LINK_FAILED``, non-force unlinks ``LLM_UNLINK_FAILED`` and transfers
    ``LLM_TIMEOUT`` (breaking the link, §10 rules 2 and 8), until the injection is removed.  The
    peer itself is untouched: to kill it for real, finalize it or end its process.
    """
    ks = parse_kinds(kinds) & frozenset(NETWORK_KINDS)
    if not ks:
        raise ValueError("peer loss affects only link, unlink and transfer calls")
    return add(make(ks, peer_loss=True, instance=instance, peer=peer, count=count, after=after,
                      probability=probability, seed=seed))
