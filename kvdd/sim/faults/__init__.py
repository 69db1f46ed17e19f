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
the failure: the injections after it do not see that call (it counts in none of their ``after``,
``count`` or ``seen``).

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
2^30), ``serve`` (``0``/``1``).  The variable is read once per process, when the first simulator
instance is created; a malformed value makes that creation raise :class:`FaultSpecError` (a
``ValueError``) naming the variable, and the ``kvdd`` commands that run the simulator (``demo``,
``bench``) stop with that one line and exit status 2.

Layout
------
:mod:`.kinds` (call kinds and groups), :mod:`.injections` (:class:`Injection`, the active set,
the decision of a call), :mod:`.making` (:func:`inject`, :func:`lose_peer`), :mod:`.envspec`
(:data:`ENV_VAR`), :mod:`.hooks` (the injection points the simulator calls).
"""

from __future__ import annotations

from .envspec import ENV_VAR, FaultSpecError, check_env, env_value, load, load_env, parse
from .hooks import on_call, on_link, on_register, on_serve, on_transfer, on_unlink
from .injections import Injection, active, clear, paused
from .kinds import CALL_KINDS, KIND_GROUPS, PACKAGE_KINDS, PACKAGE_TRANSFER_KINDS, TRANSFER_KINDS, CallKind
from .making import inject, lose_peer

__all__ = [
    "ENV_VAR",
    "FaultSpecError",
    "check_env",
    "load_env",
    "CALL_KINDS",
    "TRANSFER_KINDS",
    "PACKAGE_KINDS",
    "PACKAGE_TRANSFER_KINDS",
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
    "on_link",
    "on_unlink",
    "on_register",
    "on_transfer",
    "on_serve",
    "on_call",
]

