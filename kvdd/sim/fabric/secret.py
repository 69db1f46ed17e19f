"""The shared secret of the fabric: where it comes from, which files are refused, and its cache.

Sources, first found wins (``docs/security.md``):

1. ``KVDD_FABRIC_SECRET`` — the secret itself, hex or base64, at least 16 bytes decoded, not all zero;
2. ``KVDD_FABRIC_SECRET_FILE`` — a file holding it (raw bytes, or hex/base64 text);
3. the per-user file ``$XDG_RUNTIME_DIR/kvdd/fabric.secret`` (else ``~/.config/kvdd/fabric.secret``),
   created on first use atomically (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600, 32 random bytes), so
   processes of the same user on one host share it without configuration.

Every file read opens without following a link and without blocking, and checks (``fstat``, before
reading) that the file is a regular file owned by this user and not accessible by group or others;
anything else is refused with a message saying what to fix.  A secret read from a file is kept and
read again only when the file (or the automatic file's directory) changes, checked with one
``lstat`` each per call.  ``KVDD_FABRIC_AUTH=off`` (trusted networks only) replaces the secret by a
public constant.
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ENV_SECRET", "ENV_SECRET_FILE", "ENV_AUTH", "SecretError", "Secret", "load_secret",
           "generate_secret", "describe_secret", "default_secret_path", "MIN_SECRET_BYTES",
           "SECRET_BYTES", "check_private_dir"]

ENV_SECRET = "KVDD_FABRIC_SECRET"
ENV_SECRET_FILE = "KVDD_FABRIC_SECRET_FILE"
ENV_AUTH = "KVDD_FABRIC_AUTH"

MIN_SECRET_BYTES = 16
SECRET_BYTES = 32
_MAX_SECRET_FILE = 4096
_OFF_KEY = b"kvdd-fabric: authentication is off (KVDD_FABRIC_AUTH=off)"


class SecretError(Exception):
    """No usable secret: the message says what is wrong and what to set."""


@dataclass(frozen=True)
class Secret:
    """The key a handshake proves knowledge of, and where it came from (for ``kvdd doctor``)."""

    key: bytes = field(repr=False)
    source: str  # "env KVDD_FABRIC_SECRET", "file /path", "off"
    auth_off: bool = False


def _decode(text: str) -> bytes | None:
    text = text.strip()
    if len(text) % 2 == 0:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass  # not hex: try base64 next
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _check_key(key: bytes | None, where: str) -> bytes:
    if key is None:
        raise SecretError(f"{where} is neither hex nor base64; generate one with `kvdd fabric-secret`")
    if len(key) < MIN_SECRET_BYTES:
        raise SecretError(f"{where} holds {len(key)} bytes; at least {MIN_SECRET_BYTES} are needed "
                          "(generate one with `kvdd fabric-secret`)")
    if not any(key):
        raise SecretError(f"{where} is all zero bytes, not a secret (generate one with "
                          "`kvdd fabric-secret`)")
    return key


def _unsafe_dir(mode: int, first: bool) -> bool:
    """Writable by others, and (above the first) without the sticky bit."""
    return bool(mode & 0o002) and (first or not mode & stat.S_ISVTX)


def _world_writable(path: str) -> bool:
    """True when ``path`` is writable by others (e.g. ``/tmp``), or an ancestor of it is without
    the sticky bit (so another user could rename what lies below).

    A directory reached through symbolic links (``/home`` -> ``/data/home``) is judged by the
    real modes of what they resolve to; each link on the way must belong to this user or root
    and lie in a directory that passes the same test (a symbolic link's own mode is always
    0777 and means nothing)."""
    p = Path(os.path.abspath(path))
    euid = os.geteuid()
    for i, d in enumerate((p, *p.parents)):
        try:
            st = os.lstat(d)
        except OSError:
            return True
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, euid):
                return True
        # "-1": the first directory judged as one above it; the loop below judges that same
        # directory (``p`` is no link here, so its real path names it) as the first, so the
        # answer cannot change
        elif _unsafe_dir(st.st_mode, i == 0):  # mutation: equivalent(0 -> -1)
            return True
    real = Path(os.path.realpath(p))
    for i, d in enumerate((real, *real.parents)):
        try:
            st = os.stat(d)
        except OSError:
            return True
        if _unsafe_dir(st.st_mode, i == 0):
            return True
    return False


def default_secret_path() -> Path:
    """``$XDG_RUNTIME_DIR/kvdd/fabric.secret``, else ``~/.config/kvdd/fabric.secret``.

    ``$XDG_RUNTIME_DIR`` is used only when it is an absolute path to a real directory (no
    symbolic link) owned by this user, not under a world-writable directory such as ``/tmp``
    (another user could own ``kvdd/`` there)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.lstat(runtime)
        except OSError:
            st = None
        if (st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
                and not _world_writable(runtime)):
            return Path(runtime) / "kvdd" / "fabric.secret"
    return Path.home() / ".config" / "kvdd" / "fabric.secret"


def _check_secret_dir(directory: Path) -> None:
    """The automatic secret's directory must be a real directory (no symbolic link) of this user
    with mode 0700, not under a world-writable directory; SecretError (saying what to set)
    otherwise."""
    check_private_dir(directory, "secret directory",
                      f"set {ENV_SECRET_FILE} to a file of yours (mode 0600) in a directory only "
                      f"you can write, or {ENV_SECRET}")


def check_private_dir(directory: Path, what: str, fix: str) -> None:
    """``directory`` must be a real directory (no symbolic link) of this user with mode 0700, not
    under a world-writable directory; else :class:`SecretError` naming ``what`` it is and
    ending with ``fix`` (what to set instead).  The fabric's secret directory and the rank-table
    rendezvous (:mod:`kvdd.sim.pypkg.rendezvous`) use it."""
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise SecretError(f"{what} {directory}: {exc.strerror}; {fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SecretError(f"{what} {directory} is not a directory (a symbolic link?); "
                          f"refusing it; {fix}")
    if st.st_uid != os.geteuid():
        raise SecretError(f"{what} {directory} belongs to uid {st.st_uid}, not to this "
                          f"user (uid {os.geteuid()}); refusing it; {fix}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise SecretError(f"{what} {directory} has mode {stat.S_IMODE(st.st_mode):o}, "
                          f"not 700; run `chmod 700 {directory}` or {fix}")
    if _world_writable(str(directory.parent)):
        raise SecretError(f"{what} {directory} lies under a world-writable directory "
                          f"(e.g. /tmp); refusing it; {fix}")


def _read_checked(path: Path) -> bytes:
    """The file's bytes, if it is a regular file of ours that only we can access.

    Opened without following a symbolic link and without blocking (a FIFO, socket or device
    planted there is refused at once, never waited on), then checked with ``fstat`` before
    any byte is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                     | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SecretError(f"secret file {path} is a symbolic link; refusing it") from None
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket (or a FIFO without writer)
            raise SecretError(f"secret file {path} is not a regular file (a socket?); refusing "
                              f"it; set {ENV_SECRET_FILE} to a regular file (mode 0600)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret file {path} is not a regular file (a "
                              f"{_kind(st.st_mode)}); refusing it; set {ENV_SECRET_FILE} to a "
                              "regular file (mode 0600)")
        if st.st_uid != os.geteuid():
            raise SecretError(f"secret file {path} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()}); remove it or set {ENV_SECRET_FILE}")
        if st.st_mode & 0o077:
            raise SecretError(f"secret file {path} is accessible by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`")
        data = os.read(fd, _MAX_SECRET_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_FILE:
        raise SecretError(f"secret file {path} is larger than {_MAX_SECRET_FILE} bytes")
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def _file_key(data: bytes, where: str) -> bytes:
    if len(data) == SECRET_BYTES:  # raw bytes, as the automatic file holds them
        return _check_key(data, where)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return _check_key(data, where)
    return _check_key(_decode(text), where)


def _existing_file(path: Path) -> bytes:
    """The per-user secret if it exists (its directory checked first), else FileNotFoundError."""
    if not os.path.lexists(path.parent):
        raise FileNotFoundError(errno.ENOENT, "no secret directory", str(path.parent))
    _check_secret_dir(path.parent)
    return _read_checked(path)


def _user_file(path: Path) -> bytes:
    """Read the per-user secret, creating it first if absent (atomically, mode 0600)."""
    try:
        os.makedirs(path.parent.parent, mode=0o700, exist_ok=True)
        os.mkdir(path.parent, 0o700)  # ours, 0700 (umask only removes bits)
    except FileExistsError:
        pass  # checked below, whoever made it
    except OSError as exc:
        raise SecretError(f"cannot create the secret directory {path.parent}: {exc.strerror}; "
                          f"set {ENV_SECRET_FILE} or {ENV_SECRET}") from None
    _check_secret_dir(path.parent)
    try:
        return _read_checked(path)
    except FileNotFoundError:
        pass  # first use: create it below
    key = secrets.token_bytes(SECRET_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # another process created it first: use theirs
        return _read_checked(path)
    try:
        os.write(fd, key)
    finally:
        os.close(fd)
    return _read_checked(path)


def _sig(path: Path | str) -> tuple[int, ...] | None:
    """What changes when a file or directory is replaced, rewritten, chmod-ed or chown-ed
    (``lstat``: one system call, never following a link); None when it cannot be seen."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns)


# the last secret read from a file: (what identified it, the secret); re-read when any of it changes
_cached: tuple[tuple[object, ...], Secret] | None = None
# the automatic file's path (and it and its directory as text) for (XDG_RUNTIME_DIR, HOME, lstat
# of the runtime directory)
_cached_path: tuple[tuple[object, ...], Path, str, str] | None = None


def _automatic_path() -> tuple[Path, str, str]:
    """The automatic file's path, the same as text and its directory as text (each link's
    authentication asks: the text saves the path arithmetic)."""
    global _cached_path
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    key = (runtime, os.environ.get("HOME", ""),
           _sig(runtime) if runtime and os.path.isabs(runtime) else None)
    got = _cached_path
    if got is not None and got[0] == key:
        return got[1], got[2], got[3]
    path = default_secret_path()
    _cached_path = (key, path, str(path), str(path.parent))
    return path, str(path), str(path.parent)


def load_secret(create: bool = True) -> Secret:
    """The secret of this process, from the first source that is set (see the module docstring).

    A secret read from a file is kept and read again only when the file or its directory
    changes (checked with one ``lstat`` each per call: inode, size, times, mode, owner), so a
    listener answering a hello costs a few microseconds here, not a file read.

    Parameters
    ----------
    create : bool
        Create the per-user file when no other source is set and it does not exist yet (False:
        raise :class:`SecretError` instead).

    Raises
    ------
    SecretError
        When the source that is set is unusable (too short, all zero bytes, not hex/base64, a
        file that is not a regular file of ours, or is group/world-accessible); the message
        says what to set.
    """
    global _cached
    if os.environ.get(ENV_AUTH, "").strip().lower() == "off":
        return Secret(_OFF_KEY, "off", auth_off=True)
    value = os.environ.get(ENV_SECRET)
    if value:
        got = _cached
        # without this the value is decoded again: the same key, from the same source
        if got is not None and got[0] == ("env", value):  # mutation: equivalent(skip)
            return got[1]
        secret = Secret(_check_key(_decode(value), f"${ENV_SECRET}"), f"env {ENV_SECRET}")
        _cached = (("env", value), secret)
        return secret
    file = os.environ.get(ENV_SECRET_FILE)
    if file:
        path = Path(file)
        key: tuple[object, ...] = ("file", file, _sig(path))
        got = _cached
        if got is not None and got[0] == key and key[2] is not None:
            return got[1]
        try:
            data = _read_checked(path)
        except OSError as exc:
            hint = (f" (make one: kvdd fabric-secret > {file} && chmod 600 {file})"
                    if isinstance(exc, FileNotFoundError) else "")
            raise SecretError(f"cannot read {ENV_SECRET_FILE}={file}: {exc.strerror}{hint}") from None
        secret = Secret(_file_key(data, f"secret file {path}"), f"file {path}")
        _cached = (key, secret)
        return secret
    path, text, parent = _automatic_path()
    key = ("auto", text, _sig(parent), _sig(text))
    got = _cached
    if got is not None and got[0] == key and key[2] is not None and key[3] is not None:
        return got[1]
    try:
        data = _user_file(path) if create else _existing_file(path)
    except FileNotFoundError:
        raise SecretError(f"no secret yet: {path} is created on the first link") from None
    except OSError as exc:
        raise SecretError(f"cannot create or read the per-user secret {path}: {exc.strerror}; "
                          f"set {ENV_SECRET} or {ENV_SECRET_FILE}") from None
    secret = Secret(_file_key(data, f"secret file {path}"), f"file {path} (per-user, automatic)")
    if key[2] is None or key[3] is None:  # created now: identified as it is after creation
        key = ("auto", text, _sig(parent), _sig(text))
    _cached = (key, secret)
    return secret


def describe_secret() -> str:
    """One line for ``kvdd doctor``: where the secret comes from (never the secret itself) and
    whether authentication is off; creates nothing."""
    try:
        secret = load_secret(create=False)
    except SecretError as exc:
        return f"not usable yet: {exc}"
    if secret.auth_off:
        return (f"authentication OFF ({ENV_AUTH}=off): any process that reaches a listen port "
                "may link (trusted networks only); bounds still apply")
    return f"{secret.source}, {len(secret.key)} bytes; peers must prove they hold the same secret"


def generate_secret() -> str:
    """A new secret for ``KVDD_FABRIC_SECRET``: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(SECRET_BYTES)
