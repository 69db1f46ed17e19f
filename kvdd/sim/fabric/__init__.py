"""Listening and linking for the simulator: how one instance reaches a peer's registered memory.


The engine (:mod:`kvdd.sim.engine`) keeps all LLM-DataDist semantics; this package gives it

* :class:`Listener` — the real TCP socket bound for ``llm.ListenIpInfo`` (SEMANTICS.md §10 rule 6),
  the in-process registry of listening instances keyed by ``(ip, port)``, and a server that
  accepts link / unlink handshakes from other processes and hosts;
* :func:`connect` — "dial" a peer address and get a :class:`Connection` whose ``link`` /
  ``notify_unlink`` work identically for a peer in this process and one elsewhere;
* :class:`PeerHandle` — what a link entity uses to reach the peer: the snapshot of its caches at
  link time, leases on a remote cache for the duration of a transfer (the owner's unregister and
  finalize wait for them, §10 rule 5), reads and writes of remote tensor bytes.

The engine and the fabric meet at the typed protocols of :mod:`.protocol` (:class:`LinkOwner`,
:class:`ServedCache` implemented by the engine; :class:`PeerHandle`, :class:`Connection` by the
fabric).

Modules, one concern each: :mod:`.wire` (frames, codecs, limits), :mod:`.hostprobe` (same-host
detection), :mod:`.watchdog` (deadlines), :mod:`.streams` (byte streams of a transfer),
:mod:`.channel` (one link's connection, leases, serving requests), :mod:`.calls` (this end's
requests on it), :mod:`.rx` (its frame reader, compiled: :mod:`kvdd._native._small`),
:mod:`.small` (one-request small transfers, served by the connection's reader), :mod:`.peers`
(peer handles and
data paths), :mod:`.handshake` (link/unlink handshakes, both sides), :mod:`.secret` and
:mod:`.auth` (the shared secret, the challenge-response), :mod:`.admission` and :mod:`.gate`
(what a listener lets peers hold: fair tables, handshake workers, link bounds), :mod:`.registry` and
:mod:`.listener` (listening).

Data paths, chosen per link and direction
-----------------------------------------
* same process: :class:`InProcessPeer`, the copy kernels directly (``copy_runs``);
* same host, other process (the ``"process_vm"`` path): one-sided copies (:mod:`kvdd._native._xproc`)
  from the attested peer's ``/proc/<pid>/mem`` at the tensor addresses of the snapshot, or through a
  mapping of its ``kvdd.empty`` memory; leases are counters in a shared lease table, so the peer's
  Python takes no part in a copy.  ``KVDD_SIM_XPROC=tcp`` disables it;
* other host (or the fallback): DATA frames over the link's TCP connection, read or written by the
  owner's server threads, only inside caches registered and visible to that peer.

Failures: a connection reset, EOF, or ESRCH is certain death → LLM_TIMEOUT at once; silence →
LLM_TIMEOUT at the deadline, after which the connection is closed (the engine marks the link
broken until relinked, rule 8).  A peer that *finalized* says so (a GOODBYE frame) before closing:
its caches then give LLM_KV_CACHE_NOT_EXIST over that link, as for an in-process peer (rule 2); a
peer that vanished without saying so gives LLM_TIMEOUT.
"""

from __future__ import annotations

from . import wire
from .channel import Channel, close_channels, close_endpoint, take_endpoint
from .handshake import InProcessConnection, RemoteConnection, connect
from .auth import (ENV_AUTH, ENV_SECRET, ENV_SECRET_FILE, AuthError, Secret, SecretError, Session,
                   authenticate_socket, default_secret_path, describe_secret, generate_secret, load_secret)
from .extensions import register_extension, unregister_extension
from .listener import Listener
from .peers import InProcessPeer, RemotePeer, in_process_peer
from .protocol import (KIND_BLOCKS, KIND_CACHE, KIND_MIX, Connection, DataPath, LinkOffer,
                       LinkOwner, LinkResult, PeerHandle, RemoteCache, ServedCache, Snapshot)
from .registry import lookup_listener
from .wire import PROTOCOL_VERSION

__all__ = [
    "KIND_MIX",
    "KIND_CACHE",
    "KIND_BLOCKS",
    "RemoteCache",
    "PeerHandle",
    "ServedCache",
    "LinkOwner",
    "Snapshot",
    "InProcessPeer",
    "RemotePeer",
    "LinkOffer",
    "LinkResult",
    "Connection",
    "InProcessConnection",
    "RemoteConnection",
    "Listener",
    "connect",
    "lookup_listener",
    "close_endpoint",
    "Channel",
    "take_endpoint",
    "close_channels",
    "in_process_peer",
    "wire",
    "PROTOCOL_VERSION",
    "ENV_XPROC",
    "DataPath",
    "Session",
    "Secret",
    "SecretError",
    "AuthError",
    "authenticate_socket",
    "load_secret",
    "generate_secret",
    "describe_secret",
    "default_secret_path",
    "register_extension",
    "unregister_extension",
    "ENV_AUTH",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "drain_window",
    "revoke_served",
]

from .samehost import ENV_XPROC  # noqa: E402  (``auto`` (default) or ``tcp``)
from .samehost_link import install as _install_samehost  # noqa: E402
from .samehost_path import drain_window  # noqa: E402


def revoke_served(peer: PeerHandle) -> None:
    """Stop ``peer``'s one-sided copies of our caches from starting, without waiting (a link
    without that path: nothing); its ``close`` waits for running ones."""
    revoke = getattr(peer, "revoke_served", None)
    if revoke is not None:
        revoke()


_install_samehost()  # the "samehost" extension: one-sided same-host links
