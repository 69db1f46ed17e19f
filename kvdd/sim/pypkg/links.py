"""``link_clusters_v2`` / ``unlink_clusters_v2`` and the rank-table calls of the wrapper (PYPKG.md
§1.4, §3.3, §3.4), on the process's engine (:mod:`.lifecycle`).

``link_clusters_v2`` / ``unlink_clusters_v2`` are kvdd's :meth:`SimBackend.link_llm_clusters` /
``unlink_llm_clusters`` (SEMANTICS.md §3.5-3.6: comm links bidirectional and keyed by the peer's
real cluster id, hixl links one-directional and keyed by the given id, force rules, per-cluster
statuses in input order, the last failure overall, an empty list → ``(LLM_PARAM_INVALID, [])``),
with the Python path's differences: IPs arrive as little-endian u32 integers and are taken as they
are (no IPv4-string check), and both ends' ``llm.EnableRemoteCacheAccessible`` must be equal
(``LLM_PARAM_INVALID`` for that cluster, :mod:`.instance`).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence

from ...llm_datadist._seam import ClusterTuple
from ...status import FAILED, PARAM_INVALID, S_OK, Status
from ...types import ClusterInfo, IpInfo
from .instance import Claim, stating
from .lifecycle import current_engine, note

__all__ = ["link_clusters_v2", "unlink_clusters_v2", "link", "unlink", "query_register_mem_status",
           "ip_text"]


def ip_text(ip: int) -> str:
    """A little-endian u32 IP (as ``LLMClusterInfo`` sends it) as dotted text: 127.0.0.1 is
    ``0x0100007F``."""
    return socket.inet_ntoa((int(ip) & 0xFFFFFFFF).to_bytes(4, "little"))


def _clusters(clusters: Sequence[ClusterTuple]) -> list[ClusterInfo]:
    out = []
    for remote_id, _role, local, remote in clusters:
        out.append(ClusterInfo(
            remote_cluster_id=remote_id,  # remote_role_type is never sent (§3.4)
            local_ip_infos=[IpInfo(ip_text(ip), port) for ip, port in local],
            remote_ip_infos=[IpInfo(ip_text(ip), port) for ip, port in remote]))
    return out


def link_clusters_v2(clusters: Sequence[ClusterTuple], timeout_ms: int) -> tuple[int, list[int]]:
    """Link to each cluster (PYPKG.md §3.4): ``(status, [status per cluster])``; no engine →
    ``(LLM_FAILED, [])`` (§1.4)."""
    engine = current_engine()
    if engine is None:
        return note(FAILED, "no engine: initialize first"), []
    try:
        infos = _clusters(clusters)
    except (TypeError, ValueError, OverflowError) as exc:
        return note(PARAM_INVALID, f"clusters: {exc}"), []
    inst = engine.instance
    with stating(Claim(inst.cluster_id, inst.remote_accessible)):
        status, rets = inst.link_llm_clusters(infos, timeout_ms)
    if status != S_OK:
        note(status, inst.last_error_detail() or "link_clusters failed")
    return int(status), [int(r) for r in rets]


def unlink_clusters_v2(clusters: Sequence[ClusterTuple], timeout_ms: int,
                       force: bool) -> tuple[int, list[int]]:
    """Unlink each cluster (PYPKG.md §3.4, SEMANTICS.md §3.6): ``(status, [status per
    cluster])``; no engine → ``(LLM_FAILED, [])`` (§1.4)."""
    engine = current_engine()
    if engine is None:
        return note(FAILED, "no engine: initialize first"), []
    try:
        infos = _clusters(clusters)
    except (TypeError, ValueError, OverflowError) as exc:
        return note(PARAM_INVALID, f"clusters: {exc}"), []
    inst = engine.instance
    status, rets = inst.unlink_llm_clusters(infos, timeout_ms, bool(force))
    if status != S_OK:
        note(status, inst.last_error_detail() or "unlink_clusters failed")
    return int(status), [int(r) for r in rets]


def link(comm_name: str, cluster_rank_info: Sequence[tuple[int, int]] | Mapping[int, int],
         rank_table: str) -> tuple[int, int]:
    """Rank-table link (PYPKG.md §3.3): ``(status, comm_id)``; the comm id starts PREPARING.

    ``LLM_FEATURE_NOT_ENABLED`` on the hixl backend; ``LLM_PARAM_INVALID`` when this engine's
    cluster id is not a key of ``cluster_rank_info`` or 512 domains exist; ``LLM_LINK_FAILED`` for
    a rank table that is not a JSON object with a ``server_list``, or an unusable rendezvous;
    ``LLM_FAILED`` without an engine."""
    engine = current_engine()
    if engine is None:
        return note(FAILED, "no engine: initialize first"), 0
    pairs = list(cluster_rank_info.items()) if isinstance(cluster_rank_info, Mapping) \
        else list(cluster_rank_info)
    status, comm_id, why = engine.domains.link(comm_name, pairs, rank_table)
    if status != S_OK:
        return note(status, why), 0
    return int(S_OK), comm_id


def unlink(comm_id: int) -> int:
    """Drop a rank-table domain on this side (PYPKG.md §3.3): unknown id → ``LLM_NOT_YET_LINK``;
    hixl → ``LLM_FEATURE_NOT_ENABLED``; no engine → ``LLM_FAILED``."""
    engine = current_engine()
    if engine is None:
        return note(FAILED, "no engine: initialize first")
    if engine.transfer_backend == "hixl":
        return note(Status.LLM_FEATURE_NOT_ENABLED, "the hixl transfer backend has no rank-table links")
    status, why = engine.domains.unlink(comm_id)
    if status != S_OK:
        return note(status, why)
    return int(S_OK)


def query_register_mem_status(comm_id: int) -> tuple[int, int]:
    """``(status, 0 OK | 1 PREPARING | 2 FAILED)`` of a rank-table domain (PYPKG.md §3.3):
    unknown id → ``LLM_NOT_YET_LINK``; hixl → ``LLM_FEATURE_NOT_ENABLED``; no engine →
    ``LLM_FAILED``."""
    engine = current_engine()
    if engine is None:
        return note(FAILED, "no engine: initialize first"), 0
    if engine.transfer_backend == "hixl":
        return note(Status.LLM_FEATURE_NOT_ENABLED, "the hixl transfer backend has no rank-table links"), 0
    status, state, why = engine.domains.query(comm_id)
    if status != S_OK:
        return note(status, why), 0
    return int(S_OK), state
