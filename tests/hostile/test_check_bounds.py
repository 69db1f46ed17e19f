"""The fabric's checks at their exact bounds, played from a raw socket or a fake acceptor.

Each test names a behaviour of docs/security.md and sits on its boundary (exactly one past,
exactly at the cap), so a check weakened by one, or skipped, fails here:

* an owner serves a READ run that ends exactly at the tensor's end and refuses one that ends one
  byte past it, or names tensor ``n`` (one past the last) (SEMANTICS.md §10 rule 1);
* a connection holds at most ``MAX_LEASES`` leases, and a lease lives at most ``MAX_LEASE_MS``
  (plus the grace) whatever wait the peer announced;
* the listener drops a malformed authentication hello without a challenge, and refuses (does not
  challenge) a hello whose authentication mode differs;
* an initiator refuses a challenge of the wrong length and an acceptor that cannot prove the
  secret (links get LLM_LINK_FAILED; the plain-socket handshake raises AuthError);
* a secret shorter than 16 bytes and a secret directory of any mode but 0700 are refused.

The victim is an instance of this process; every test checks that its cache memory and the
guard bytes around it are untouched, and that it still serves a legitimate peer afterwards.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmRole, Status
from kvdd.sim.fabric import announce, auth, leases, wire
from kvdd.sim.fabric.serving import check_request
from kvdd.sim.fabric.auth import NONCE_BYTES, AuthError, load_secret

from hostile import rawpeer

LOCALHOST = "127.0.0.1"
S = Status.LLM_SUCCESS
N, T = 2, 256  # the victim's cache: 2 tensors of 256 bytes
GUARD = 64


@dataclass
class Victim:
    dd: kvdd.LlmDataDist
    port: int
    cache_id: int
    arena: np.ndarray  # guard | tensor 0 | guard | tensor 1 | guard
    before: np.ndarray

    def tensor(self, i: int) -> np.ndarray:
        start = GUARD + i * (T + GUARD)
        return self.arena[start:start + T]

    def untouched(self) -> None:
        changed = int(np.count_nonzero(self.arena != self.before))
        assert changed == 0, f"{changed} byte(s) of the victim's memory changed"

    def serves_a_legitimate_peer(self) -> None:
        """A fresh kvdd instance links, pulls tensor bytes (checked) and unlinks."""
        mem = np.zeros(N * T, np.uint8)
        desc = CacheDesc(num_tensors=N, data_type=DataType.DT_UINT8, shape=(1, T))
        with kvdd.LlmDataDist(99, LlmRole.DECODER, backend="sim") as d:
            d.initialize({kvdd.OPTION_DEVICE_ID: "0"})
            cid = d.register_kv_cache(desc, kvdd.tensor_addrs([mem[:T], mem[T:]]))
            info = ClusterInfo(remote_cluster_id=7, remote_ip_infos=[IpInfo(LOCALHOST, self.port)],
                               local_ip_infos=[IpInfo(LOCALHOST, 0)])
            assert d.link_llm_clusters([info]) == [S]
            d.pull_kv_cache(CacheIndex(7, self.cache_id, 0), Cache(cid, cache_desc=desc))
            assert d.unlink_llm_clusters([info]) == [S]
        assert bytes(mem[:T]) == bytes(self.tensor(0)) and bytes(mem[T:]) == bytes(self.tensor(1))


@pytest.fixture
def victim() -> Iterator[Victim]:
    arena = np.random.default_rng(5).integers(0, 256, GUARD + N * (T + GUARD), dtype=np.uint8)
    desc = CacheDesc(num_tensors=N, data_type=DataType.DT_UINT8, shape=(1, T))
    dd = kvdd.LlmDataDist(7, LlmRole.PROMPT, backend="sim")
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0"})
    try:
        tensors = [arena[GUARD + i * (T + GUARD):GUARD + i * (T + GUARD) + T] for i in range(N)]
        cache_id = dd.register_kv_cache(desc, kvdd.tensor_addrs(tensors))
        v = Victim(dd, dd.listening_port, cache_id, arena, arena.copy())
        yield v
        v.untouched()
        v.serves_a_legitimate_peer()
    finally:
        dd.finalize()


def _closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closed ``s`` (EOF or reset) within ``timeout`` having sent nothing."""
    s.settimeout(timeout)
    try:
        return s.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _read(s: socket.socket, lease_id: int, tensors: list[int], off: list[int], length: list[int],
          req: int) -> tuple[int, bytes]:
    """(status of DONE, bytes of the DATA frames) of one READ on a linked raw connection."""
    body = wire.encode_request(lease_id, tensors, np.array(off, np.int64), np.array(length, np.int64))
    s.sendall(rawpeer.frame(wire.F_READ, body, req))
    data = b""
    while True:
        ftype, rreq, payload = rawpeer.read_frame(s)
        if rreq != req:
            continue
        if ftype == wire.F_DATA:
            data += payload
        elif ftype == wire.F_DONE:
            return struct.unpack_from("<I", payload)[0], data


# ---- serving: runs and tensor indices at the end of the cache -----------------------------------


@pytest.mark.parametrize("runs", [1, 17])  # the plain-Python and the numpy check of a request
def test_read_run_ending_exactly_at_the_tensor_end_is_served(victim: Victim, runs: int) -> None:
    s, _snap = rawpeer.link(victim.port, 4242)
    with s:
        status, lease_id = rawpeer.lease(s, victim.cache_id)
        assert status == S
        off, length = [T - 1] * (runs - 1) + [0], [1] * (runs - 1) + [T]
        status, data = _read(s, lease_id, [N - 1], off, length, 5)
        assert status == S
        last = bytes(victim.tensor(N - 1))
        assert data == last[T - 1:] * (runs - 1) + last


@pytest.mark.parametrize("runs", [1, 17])
@pytest.mark.parametrize("what", ["one byte past the end", "tensor n", "negative offset"])
def test_read_one_past_the_cache_is_refused(victim: Victim, runs: int, what: str) -> None:
    tensors, off, length = [N - 1], [0] * runs, [1] * runs
    if what == "one byte past the end":
        off[-1], length[-1] = 1, T  # ends at T + 1
    elif what == "tensor n":
        tensors = [N]
    else:
        off[-1] = -1
    s, _snap = rawpeer.link(victim.port, 4242)
    with s:
        status, lease_id = rawpeer.lease(s, victim.cache_id)
        assert status == S
        status, data = _read(s, lease_id, tensors, off, length, 6)
        assert (status, data) == (Status.LLM_PARAM_INVALID, b"")
        # the connection and its lease stay usable for a valid request
        status, data = _read(s, lease_id, [0], [0], [T], 7)
        assert (status, data) == (S, bytes(victim.tensor(0)))


def _check(tensors: list[int], off: list[int], length: list[int], n: int = N, t: int = T) -> int:
    return check_request(n, t, np.array(tensors, np.int64), np.array(off, np.int64),
                         np.array(length, np.int64))


@pytest.mark.parametrize("runs", [1, 16, 17, 40])  # both sides of the plain-Python/numpy switch
def test_owner_request_check_at_every_bound(runs: int) -> None:
    ok, bad = Status.LLM_SUCCESS, Status.LLM_PARAM_INVALID
    zeros, ones = [0] * runs, [1] * runs

    def with_last(values: list[int], last: int) -> list[int]:
        return values[:-1] + [last]

    assert _check([N - 1], zeros, ones) == ok
    assert _check([N], zeros, ones) == bad  # tensor n, one past the last
    assert _check([0, N - 1, 0], zeros, ones) == ok
    assert _check([0, N, 0], zeros, ones) == bad
    assert _check([0], with_last(zeros, T - 1), ones) == ok  # the last byte
    assert _check([0], with_last(zeros, T), ones) == bad  # one past it
    assert _check([0], zeros, with_last(ones, T)) == ok  # a whole tensor
    assert _check([0], zeros, with_last(ones, T + 1)) == bad
    assert _check([0], with_last(zeros, 1), with_last(ones, T - 1)) == ok  # ends exactly at T
    assert _check([0], with_last(zeros, 1), with_last(ones, T)) == bad  # one byte past
    assert _check([0], zeros, with_last(ones, 0)) == ok  # an empty run is no violation
    assert _check([0], zeros, with_last(ones, -1)) == bad
    assert _check([0], with_last(zeros, -1), ones) == bad
    assert _check([], zeros, ones) == ok  # no tensor: nothing moves


def test_owner_request_check_caps_tensors_times_runs() -> None:
    cap = wire.MAX_RUNS  # 2**31
    tensors = np.zeros(1 << 16, np.int64)
    for runs, want in ((cap >> 16, Status.LLM_SUCCESS), ((cap >> 16) + 1, Status.LLM_PARAM_INVALID)):
        off, length = np.zeros(runs, np.int64), np.ones(runs, np.int64)
        assert check_request(N, T, tensors, off, length) == want, runs


# ---- leases: the per-connection cap and the lifetime cap -------------------------------------------


def test_a_connection_holds_at_most_max_leases(victim: Victim) -> None:
    s, _snap = rawpeer.link(victim.port, 4242)
    with s:
        ids = []
        for req in range(1, wire.MAX_LEASES + 1):
            status, lease_id = rawpeer.lease(s, victim.cache_id, req)
            assert status == S, req
            ids.append(lease_id)
        assert len(set(ids)) == wire.MAX_LEASES
        # a cache the link does not show is not found, whatever the connection holds
        assert rawpeer.lease(s, victim.cache_id + 1000, 999) == (Status.LLM_KV_CACHE_NOT_EXIST, 0)
        assert rawpeer.lease(s, victim.cache_id, 1000) == (Status.LLM_FAILED, 0)
        # releasing one makes room for exactly one more
        s.sendall(rawpeer.frame(wire.F_RELEASE, struct.pack("<Q", ids[0]), 1001))
        deadline = time.monotonic() + 5
        while True:
            status, lease_id = rawpeer.lease(s, victim.cache_id, 1002)
            if status == S or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert status == S and lease_id not in ids
        assert rawpeer.lease(s, victim.cache_id, 1003) == (Status.LLM_FAILED, 0)


def test_a_lease_lives_at_most_the_cap_whatever_wait_the_peer_announced(
        victim: Victim, monkeypatch: pytest.MonkeyPatch) -> None:
    cap_ms = 200
    monkeypatch.setattr(leases, "MAX_LEASE_MS", cap_ms)
    s, _snap = rawpeer.link(victim.port, 4242, wait_ms=60_000)  # the peer asks for 60 s
    with s:
        status, lease_id = rawpeer.lease(s, victim.cache_id)
        assert status == S
        assert _read(s, lease_id, [0], [0], [T], 2) == (S, bytes(victim.tensor(0)))
        time.sleep((cap_ms + wire.LEASE_GRACE_MS) / 1000 + 0.5)
        status, data = _read(s, lease_id, [0], [0], [T], 3)
        assert status != S and data == b""


def test_a_lease_asked_while_the_owner_finalizes_is_not_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Finalize first marks the instance uninitialized, then closes its links: a LEASE that
    arrives in between, on a cache the link still shows, is LLM_KV_CACHE_NOT_EXIST (the peer
    gets no lease that the finalize would then have to wait for)."""
    desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(1, T))
    mem = np.zeros(T, np.uint8)
    dd = kvdd.LlmDataDist(8, LlmRole.PROMPT, backend="sim")
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0"})
    cache_id = dd.register_kv_cache(desc, kvdd.tensor_addrs([mem]))
    s, snap = rawpeer.link(dd.listening_port, 4245)
    answers: list[tuple[int, int]] = []
    real_closed = announce.closed

    def closed(owner_id: int) -> None:  # finalize's first step once uninitialized (its listener)
        if not answers:
            answers.append(rawpeer.lease(s, cache_id, 5))
        real_closed(owner_id)

    with s:
        assert cache_id in snap
        status, lease_id = rawpeer.lease(s, cache_id, 4)
        assert status == S  # before: granted (then released)
        s.sendall(rawpeer.frame(wire.F_RELEASE, struct.pack("<Q", lease_id), 6))
        monkeypatch.setattr(announce, "closed", closed)
        dd.finalize()
    assert answers == [(Status.LLM_KV_CACHE_NOT_EXIST, 0)]


# ---- the listener's authentication: malformed hellos and mode refusals ------------------------------


@pytest.mark.parametrize("extra", [-1, 1, 40])
def test_malformed_auth_hello_is_dropped_without_a_challenge(victim: Victim, extra: int) -> None:
    with rawpeer.connect(victim.port) as s:
        s.sendall(rawpeer.frame(wire.F_AUTH_HELLO, secrets.token_bytes(NONCE_BYTES + 1 + extra)))
        assert _closed(s)


def test_auth_hello_of_the_right_length_gets_a_challenge(victim: Victim) -> None:
    with rawpeer.connect(victim.port) as s:
        s.sendall(rawpeer.frame(wire.F_AUTH_HELLO, secrets.token_bytes(NONCE_BYTES) + b"\x00"))
        ftype, _req, challenge = rawpeer.read_frame(s)
        assert ftype == wire.F_AUTH_CHALLENGE and len(challenge) == NONCE_BYTES + 1


def test_auth_mode_mismatch_is_refused_not_challenged(victim: Victim) -> None:
    # this side has authentication on: a hello saying "off" gets AUTH_REFUSED (LINK_FAILED)
    with rawpeer.connect(victim.port) as s:
        with pytest.raises(PermissionError) as info:
            rawpeer.authenticate(s, auth_off=True)
        assert str(info.value).startswith(f"{int(Status.LLM_LINK_FAILED):#x}:")


# ---- the initiator against a fake acceptor -----------------------------------------------------------


class FakeAcceptor:
    """A listener that answers a link's hello with ``challenge`` and, when asked, with a wrong
    acceptor proof; it never holds the secret."""

    def __init__(self, challenge: bytes, answer_proof: bool = False) -> None:
        self.sock = socket.create_server((LOCALHOST, 0))
        self.port = self.sock.getsockname()[1]
        self.challenge, self.answer_proof = challenge, answer_proof
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(10)
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                rawpeer.read_frame(conn)  # the hello
                conn.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE, self.challenge))
                if self.answer_proof:
                    rawpeer.read_frame(conn)  # the initiator's proof
                    conn.sendall(rawpeer.frame(wire.F_AUTH_OK, secrets.token_bytes(32)))
                conn.settimeout(5)
                conn.recv(1 << 16)  # until the initiator gives up
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


@pytest.mark.parametrize("challenge,answer", [
    (secrets.token_bytes(NONCE_BYTES) + b"\x00", True),  # right shape, wrong acceptor proof
    (secrets.token_bytes(NONCE_BYTES), False),  # one byte short
    (secrets.token_bytes(NONCE_BYTES) + b"\x00\x00", False),  # one byte long
    (b"", False),
])
def test_link_to_an_acceptor_without_the_secret_fails(challenge: bytes, answer: bool) -> None:
    fake = FakeAcceptor(challenge, answer)
    try:
        with kvdd.LlmDataDist(3, LlmRole.DECODER, backend="sim") as d:
            d.initialize({kvdd.OPTION_DEVICE_ID: "0"})
            info = ClusterInfo(remote_cluster_id=8, remote_ip_infos=[IpInfo(LOCALHOST, fake.port)],
                               local_ip_infos=[IpInfo(LOCALHOST, 0)])
            t0 = time.monotonic()
            with pytest.raises(kvdd.LLMError) as exc:
                d.link_llm_clusters([info], timeout_ms=3000)
            assert exc.value.rets == [Status.LLM_LINK_FAILED]
            assert time.monotonic() - t0 < 5
    finally:
        fake.close()


def test_plain_socket_handshake_refuses_an_acceptor_without_the_secret() -> None:
    a, b = socket.socketpair()
    context = b"kvdd-test/1"

    def impostor() -> None:  # speaks the protocol, proves nothing
        with b:
            b.recv(NONCE_BYTES + 1)
            b.sendall(secrets.token_bytes(NONCE_BYTES) + b"\x00")
            b.recv(32)
            b.sendall(b"\x01" + secrets.token_bytes(32))
            b.settimeout(5)
            b.recv(1)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with a, pytest.raises(AuthError, match="did not prove"):
        auth.authenticate_socket(a, initiator=True, context=context, timeout=5.0)
    t.join(10)


def test_plain_socket_handshake_accepts_the_real_acceptor() -> None:
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def acceptor() -> None:
        with b:
            out["session"] = auth.authenticate_socket(b, initiator=False, context=b"kvdd-test/1",
                                                      timeout=5.0)

    t = threading.Thread(target=acceptor)
    t.start()
    with a:
        mine = auth.authenticate_socket(a, initiator=True, context=b"kvdd-test/1", timeout=5.0)
    t.join(10)
    theirs = out["session"]
    assert isinstance(theirs, auth.Session) and theirs.key == mine.key


# ---- secrets: the length floor and the directory mode ---------------------------------------------------


@pytest.fixture
def no_secret_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in (auth.ENV_SECRET, auth.ENV_SECRET_FILE, auth.ENV_AUTH):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run


@pytest.mark.parametrize("nbytes,ok", [(auth.MIN_SECRET_BYTES - 1, False), (auth.MIN_SECRET_BYTES, True)])
def test_secret_length_floor(no_secret_env: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int,
                             ok: bool) -> None:
    assert auth.MIN_SECRET_BYTES == 16
    key = secrets.token_bytes(nbytes) if nbytes else b""
    key = key.replace(b"\x00", b"\x01")  # never all zero
    monkeypatch.setenv(auth.ENV_SECRET, key.hex())
    if ok:
        assert load_secret().key == key
    else:
        with pytest.raises(auth.SecretError, match=f"holds {nbytes} bytes; at least 16"):
            load_secret()


@pytest.mark.parametrize("mode,ok", [(0o700, True), (0o750, False), (0o755, False), (0o710, False),
                                     (0o701, False), (0o770, False)])
def test_secret_directory_must_be_exactly_0700(no_secret_env: Path, mode: int, ok: bool) -> None:
    directory = no_secret_env / "kvdd"
    directory.mkdir()
    directory.chmod(mode)
    if ok:
        assert len(load_secret().key) == 32
        assert os.stat(directory).st_mode & 0o777 == 0o700
    else:
        with pytest.raises(auth.SecretError, match=f"has mode {mode:o}, not 700"):
            load_secret()
