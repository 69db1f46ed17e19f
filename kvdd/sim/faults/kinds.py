"""The call kinds an injection matches, their groups, and what a lost peer makes each return."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from ...status import TIMEOUT, Status

__all__ = ["CallKind", "CALL_KINDS", "TRANSFER_KINDS", "KIND_GROUPS", "NETWORK_KINDS",
           "PACKAGE_KINDS", "PACKAGE_TRANSFER_KINDS", "KNOWN_KINDS", "parse_kinds",
           "peer_loss_status"]

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
#: The transfers of CANN's Python package (kvdd.llm_datadist), by its method names; a layer of
#: ``transfer_cache_async`` counts as ``push_blocks`` / ``push_cache`` by its config's key, as
#: ``transfer_cache_async`` for raw destination addresses.
PACKAGE_TRANSFER_KINDS: tuple[str, ...] = ("pull_cache", "pull_blocks", "push_cache", "push_blocks",
                                           "transfer_cache_async")
#: The calls of CANN's Python package that have kinds of their own.  Its ``link_clusters`` /
#: ``unlink_clusters`` (per cluster) and rank-table ``link`` / ``unlink`` are ``link`` /
#: ``unlink`` calls, as LinkLlmClusters / UnlinkLlmClusters are.
PACKAGE_KINDS: tuple[str, ...] = (*PACKAGE_TRANSFER_KINDS, "register_cache", "register_blocks_cache",
                                  "query_register_mem_status")
#: Every kind name an injection may hold, in the order :meth:`Injection.spec` lists them.
KNOWN_KINDS: tuple[str, ...] = (*CALL_KINDS, *PACKAGE_KINDS)
#: Groups of the package's calls (its method names; ``package`` = all of them).
PACKAGE_GROUPS: Mapping[str, tuple[str, ...]] = {
    "package": PACKAGE_KINDS,
    "link_clusters": ("link",),
    "unlink_clusters": ("unlink",),
}
#: The kinds a lost peer affects (registration is local).
NETWORK_KINDS: tuple[str, ...] = ("link", "unlink", *TRANSFER_KINDS, *PACKAGE_TRANSFER_KINDS)


def peer_loss_status(kind: str) -> int:
    """What a call of ``kind`` returns when its peer is lost (§10 rule 2)."""
    if kind == "link":
        return int(Status.LLM_LINK_FAILED)  # the dead peer's port refuses connections
    if kind == "unlink":
        return int(Status.LLM_UNLINK_FAILED)
    return TIMEOUT  # §10 rule 2: the owner cannot be reached


def parse_kinds(kinds: str | Iterable[str]) -> frozenset[str]:
    """Kind names and groups -> the set of :data:`CALL_KINDS`; ``ValueError`` for unknown names."""
    names = [kinds] if isinstance(kinds, str) else list(kinds)
    out: set[str] = set()
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"call kinds must be str, not {type(name).__name__}")
        key = name.strip()
        if key in KIND_GROUPS:
            out.update(KIND_GROUPS[key])
        elif key in PACKAGE_GROUPS:
            out.update(PACKAGE_GROUPS[key])
        elif key in KNOWN_KINDS:
            out.add(key)
        else:
            raise ValueError(f"unknown call kind {name!r}; use one of {', '.join(KNOWN_KINDS)} "
                             f"or a group ({', '.join((*KIND_GROUPS, *PACKAGE_GROUPS))})")
    if not out:
        raise ValueError("no call kind given")
    return frozenset(out)

