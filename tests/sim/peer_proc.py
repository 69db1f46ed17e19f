"""Simulator (or native) peers in a separate process, driven from the test process by RPC.

The test side creates a :class:`PeerProcess` (kvdd's test kit, :class:`kvdd.testing.process.
ProcessHost`, hosting a :class:`peer_child.Helper`), then :class:`peer_node.ProcessNode` objects:
proxies of the conformance harness's ``Node`` whose methods run in the child (the codec of their
arguments: :mod:`peer_wire`).

Every call has a timeout (a hung peer fails the test instead of hanging it); :meth:`PeerProcess.close`
(also run at interpreter exit for anything left over) stops the child, killing it if needed.  The
child exits by itself when the test process goes away (EOF on the socketpair).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kvdd
from kvdd.testing.process import ProcessHost

from peer_wire import CALL_TIMEOUT, ENV_BACKEND, ENV_DEVICE_ID
from peer_node import ProcessNode

__all__ = ["PeerProcess"]


class PeerProcess(ProcessHost):
    """A child Python process hosting the harness's nodes (see the module docstring).

    Parameters
    ----------
    env : Mapping[str, str], optional
        Extra environment variables for the child (e.g. ``KVDD_SIM_XPROC``).
    prefix : Sequence[str], optional
        Command prefix, e.g. ``["ip", "netns", "exec", "ns1"]`` to run the child in a network
        namespace.
    backend : str, default "sim"
        Backend of the child's nodes (``"native"``: the conformance suite's native peers).
    device_id : int, optional
        NPU of the child's nodes (their device memory and ``llm.DeviceId``).
    """

    def __init__(self, *, env: Mapping[str, str] | None = None,
                 prefix: Sequence[str] = (), start_timeout: float = CALL_TIMEOUT,
                 backend: str = "sim", device_id: int | None = None) -> None:
        self.backend = backend
        self.device_id = device_id
        child_env = {ENV_BACKEND: backend, ENV_DEVICE_ID: "" if device_id is None else str(device_id)}
        child_env.update(env or {})
        here = Path(__file__).resolve().parent
        super().__init__(env=child_env, prefix=prefix, codec="peer_wire", sys_path=(str(here), str(here.parent)),
                         thread_init="peer_child:activate_device", start_timeout=start_timeout)
        self._helper = self.new("peer_child:Helper").oid

    def root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a method of the child's :class:`peer_child.Helper`."""
        return self.call(self._helper, method, *args, **kwargs)

    def node(self, cluster_id: int, role: int = kvdd.LlmRole.MIX) -> ProcessNode:
        return ProcessNode(self, cluster_id, role)

    def __enter__(self) -> PeerProcess:
        return self
