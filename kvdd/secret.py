"""The fabric secret: what simulator links (and any control channel of yours) prove they share.

Every simulator instance that listens authenticates each peer with a mutual challenge-response
keyed by a secret before it reads anything else (docs/security.md).  The secret comes from the first
of these that is set:

* ``KVDD_FABRIC_AUTH=off`` — no authentication (trusted networks only; bounds still apply);
* ``KVDD_FABRIC_SECRET`` — at least 16 bytes as hex or base64 (``kvdd fabric-secret`` prints one);
* ``KVDD_FABRIC_SECRET_FILE`` — a file holding it, mode 0600, owned by you;
* a per-user file created on the first link (``$XDG_RUNTIME_DIR/kvdd/fabric.secret``, else
  ``~/.config/kvdd/fabric.secret``): enough for processes of one user on one host.

This module is the public face of that mechanism: the ``kvdd`` command line, the demo's control
channel and your own code use it, e.g. to check the set-up before linking, or to authenticate a
socket of your own with the same secret (:func:`authenticate_socket`).

>>> from kvdd.secret import SecretError, load_secret
>>> try:
...     secret = load_secret()
... except SecretError as exc:
...     raise SystemExit(f"no usable fabric secret: {exc}")
"""

from __future__ import annotations

from .sim.fabric.auth import (
    ENV_AUTH,
    ENV_SECRET,
    ENV_SECRET_FILE,
    AuthError,
    Secret,
    SecretError,
    Session,
    authenticate_socket,
    default_secret_path,
    describe_secret,
    generate_secret,
    load_secret,
)

__all__ = [
    "ENV_AUTH",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "AuthError",
    "Secret",
    "SecretError",
    "Session",
    "authenticate_socket",
    "default_secret_path",
    "describe_secret",
    "generate_secret",
    "load_secret",
]
