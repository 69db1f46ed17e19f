"""Where the members of a rank-table link find each other (PYPKG.md §8.2, §9.2).

A rank table names NPUs (``device_ip``, ``server_id``, ``rank_id``), never a host:port a simulator
could dial.  kvdd resolves a member's fabric address in this order:

1. **Across hosts**: :data:`ENV_ADDRS` maps a rank table's ``device_ip`` (or ``server_id``) to a
   fabric address, e.g. ``KVDD_SIM_RANK_TABLE_ADDRS="10.0.0.1=192.168.1.5:27001,10.0.0.2=192.168.1.6:27001"``.
   A member whose own ``device_ip`` / ``server_id`` is mapped listens there while it links; peers
   dial it there.  Every process of the job gets the same value.
2. **On one host, nothing to set**: each member publishes the address of the fabric listener it
   started for the link in a per-user rendezvous directory, one file per ``(comm_name, cluster)``;
   the others read it.  The directory (:data:`ENV_DIR`, default ``$XDG_RUNTIME_DIR/kvdd/rendezvous``,
   else ``~/.config/kvdd/rendezvous``) follows the fabric's trust rules: it must be a real directory
   of this user, mode 0700, not under a world-writable directory (the same check as the fabric
   secret's, :func:`kvdd.sim.fabric.auth.check_private_dir`); entries must be regular files of this
   user that only this user can read; entries of processes that are gone are ignored.

Finding an address shares nothing: every link then runs the fabric's mutual authentication
before any cache table or memory is exchanged.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..fabric.auth import SecretError, check_private_dir, default_secret_path

__all__ = ["ENV_DIR", "ENV_ADDRS", "RendezvousError", "Member", "rendezvous_dir", "address_map",
           "rank_table_members", "publish", "lookup", "withdraw"]

ENV_DIR = "KVDD_SIM_RENDEZVOUS_DIR"
ENV_ADDRS = "KVDD_SIM_RANK_TABLE_ADDRS"
_MAX_ENTRY = 4096
_MAX_RANK_TABLE = 16 << 20


class RendezvousError(Exception):
    """The rendezvous cannot be used: the message says what to fix."""


@dataclass(frozen=True)
class Member:
    """One device of a rank table."""

    rank: int
    device_ip: str
    server_id: str


def rendezvous_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The rendezvous directory (created 0700 when absent), checked; RendezvousError if unusable."""
    env = os.environ if environ is None else environ
    given = env.get(ENV_DIR, "")
    path = Path(given) if given else default_secret_path().parent / "rendezvous"
    if not given:
        try:
            os.makedirs(path.parent, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise RendezvousError(f"cannot create {path.parent}: {exc.strerror}; set {ENV_DIR}") from None
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # checked below, whoever made it
    except OSError as exc:
        raise RendezvousError(f"cannot create the rendezvous directory {path}: {exc.strerror}; "
                              f"set {ENV_DIR} to a directory of yours (mode 700)") from None
    try:
        check_private_dir(path, "rendezvous directory",
                          f"set {ENV_DIR} to a directory of yours (mode 700)")
    except SecretError as exc:
        raise RendezvousError(str(exc)) from None
    return path


def address_map(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, int]]:
    """:data:`ENV_ADDRS` as ``{device_ip or server_id: (ip, port)}``; RendezvousError if malformed."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_ADDRS, "").strip()
    out: dict[str, tuple[str, int]] = {}
    if not text:
        return out
    for item in text.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, addr = item.partition("=")
        host, colon, port = addr.strip().rpartition(":")
        if not sep or not colon or not key.strip() or not host or not port.isdigit() \
                or not 0 < int(port) < 65536:
            raise RendezvousError(f"{ENV_ADDRS}: {item!r} is not DEVICE_IP_OR_SERVER_ID=IP:PORT "
                                  "(a port 1..65535)")
        out[key.strip()] = (host.strip("[]"), int(port))
    return out


def rank_table_members(rank_table: str) -> dict[int, Member] | None:
    """The devices of a rank table (versions 1.0 / 1.2: ``server_list[].device[]``) by rank, or
    None when it is not a JSON object of that shape (HCCL could not build a communicator)."""
    if len(rank_table) > _MAX_RANK_TABLE:
        return None
    try:
        obj = json.loads(rank_table)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("server_list"), list):
        return None
    out: dict[int, Member] = {}
    for server in obj["server_list"]:
        if not isinstance(server, dict) or not isinstance(server.get("device", []), list):
            return None
        server_id = str(server.get("server_id", ""))
        for dev in server.get("device", []):
            if not isinstance(dev, dict):
                return None
            try:
                rank = int(str(dev.get("rank_id", "")))
            except ValueError:
                return None
            out[rank] = Member(rank, str(dev.get("device_ip", "")), server_id)
    return out


def mapped_address(member: Member | None, addrs: Mapping[str, tuple[str, int]]) -> tuple[str, int] | None:
    """The fabric address :data:`ENV_ADDRS` gives ``member`` (its device_ip first), if any."""
    if member is None:
        return None
    for key in (member.device_ip, member.server_id):
        if key and key in addrs:
            return addrs[key]
    return None


def _entry_path(directory: Path, comm_name: str, cluster_id: int) -> Path:
    digest = hashlib.sha256(comm_name.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return directory / f"{digest}.{cluster_id}.json"


def publish(directory: Path, comm_name: str, cluster_id: int, ip: str, port: int) -> Path:
    """Publish where ``cluster_id`` accepts the links of domain ``comm_name`` (atomically, mode
    0600, replacing an older entry); the entry's path (for :func:`withdraw`)."""
    path = _entry_path(directory, comm_name, cluster_id)
    data = json.dumps({"comm_name": comm_name, "cluster_id": cluster_id, "ip": ip, "port": port,
                       "pid": os.getpid()}).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def lookup(directory: Path, comm_name: str, cluster_id: int) -> tuple[str, int] | None:
    """The address ``cluster_id`` published for ``comm_name``, or None (not yet, its process is
    gone, or the entry is not a private regular file of this user)."""
    path = _entry_path(directory, comm_name, cluster_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        data = os.read(fd, _MAX_ENTRY + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_ENTRY:
        return None
    try:
        obj = json.loads(data)
        ip, port, pid = obj["ip"], obj["port"], obj["pid"]
        same = obj["comm_name"] == comm_name and obj["cluster_id"] == cluster_id
    except (ValueError, TypeError, KeyError):
        return None
    if not same or not isinstance(ip, str) or not isinstance(port, int) or not isinstance(pid, int):
        return None
    if not 0 < port < 65536:
        return None
    if not _alive(pid):  # its process is gone: the entry is stale (our own directory)
        withdraw(path, pid)
        return None
    return ip, port


def withdraw(path: Path, owner: int | None = None) -> None:
    """Remove an entry published by process ``owner`` (default: this one); absent, or replaced
    by another process's entry meanwhile: kept."""
    try:
        with open(path, "rb") as f:
            pid = json.loads(f.read(_MAX_ENTRY + 1)).get("pid")
        if pid == (os.getpid() if owner is None else owner):
            os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass
