"""Fixtures of the hostile-peer suite: a victim instance in its own process, a legitimate peer here.

``KVDD_HOSTILE_PROFILE=long`` runs every attack with more connections, cases and rounds (local
use, not CI; see README "Security").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent / "sim"))  # peer_proc

import peer_node  # noqa: E402
from conformance.harness import World  # noqa: E402
from peer_proc import PeerProcess  # noqa: E402

LONG = os.environ.get("KVDD_HOSTILE_PROFILE", "fast").strip().lower() == "long"


@pytest.fixture(scope="module")
def victim_proc() -> Iterator[PeerProcess]:
    """The process of the attacked instance (its RSS and arenas are checked)."""
    with PeerProcess(env={"KVDD_SIM_XPROC": "tcp"}) as p:
        yield p


@pytest.fixture
def world(victim_proc: PeerProcess) -> Iterator[World]:
    with peer_node.process_world(victim_proc) as w:
        yield w
