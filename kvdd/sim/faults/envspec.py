"""The :data:`ENV_VAR` syntax: parsing it into injections and rendering active ones back
(see "Environment variable" in :mod:`kvdd.sim.faults`)."""

from __future__ import annotations

import os
import threading

from .injections import Injection, active, add
from .kinds import NETWORK_KINDS, parse_kinds
from .making import make

__all__ = ["ENV_VAR", "FaultSpecError", "check_env", "env_value", "load", "load_env", "parse"]

#: The environment variable read when the first simulator instance is created (its syntax: the
#: :mod:`kvdd.sim.faults` docstring).
ENV_VAR = "KVDD_SIM_FAULTS"

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
        kinds = kw["kinds"].split("+") if "kinds" in kw else list(NETWORK_KINDS)
        ks = parse_kinds(kinds) & frozenset(NETWORK_KINDS)
        if not ks:
            raise ValueError("peer loss affects only link, unlink and transfer calls")
        return make(ks, peer_loss=True, instance=instance, peer=peer, count=count, after=after,
                     probability=probability, seed=seed)
    if "kinds" in kw:
        raise ValueError("kinds= is only for peer_loss; list the kinds before the first ':'")
    return make(head.split(","), status=kw.get("status"), delay_ms=delay_ms, bandwidth=bandwidth,
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
    return [add(inj) for inj in parse(text)]


class FaultSpecError(ValueError):
    """:data:`ENV_VAR` is malformed: the message names the variable, its value and the mistake."""


_env_loaded = False
_env_lock = threading.Lock()


def load_env() -> None:
    """Activate the injections of :data:`ENV_VAR`, if set: once per process, when the first
    simulator instance is created (:class:`kvdd.sim.SimBackend`); later calls do nothing.

    Raises
    ------
    FaultSpecError
        The variable is malformed (it stays unread: the next instance raises the same).
    """
    global _env_loaded
    with _env_lock:
        if _env_loaded:
            return
        text = os.environ.get(ENV_VAR)
        if text:
            try:
                injections = parse(text)
            except ValueError as exc:
                raise FaultSpecError(f"{ENV_VAR}={text!r}: {exc} (see docs/faults.md for the syntax)") from None
            for inj in injections:
                add(inj)
        _env_loaded = True


def check_env() -> str | None:
    """The :class:`FaultSpecError` message when :data:`ENV_VAR` is set and malformed, else None
    (parses only; activates nothing)."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return None
    try:
        parse(text)
    except ValueError as exc:
        return f"{ENV_VAR}={text!r}: {exc} (see docs/faults.md for the syntax)"
    return None


def env_value() -> str:
    """The active injections in :data:`ENV_VAR` syntax, e.g. to pass them to a child process."""
    return ";".join(inj.spec() for inj in active())
