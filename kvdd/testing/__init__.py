"""Cache memory per backend, and moving bytes in and out of it (for tests and users).

A cache's tensors live where the backend's transfers reach them: on the simulator in host memory of
the registering process (numpy arrays; from :func:`kvdd.empty`, which a same-host peer maps);
on the native backend, for ``CachePlacement.DEVICE`` caches, in NPU device memory that only the
Ascend runtime (ACL) can allocate, fill and read back.  This module gives both the same shape, so one test or program runs unchanged on either backend:

>>> import kvdd, kvdd.testing as kt
>>> buf = kt.allocate(1024, backend="sim")          # or backend="native" on an Atlas node
>>> buf.write(bytes(range(256)) * 4)
>>> bytes(buf.read(0, 4))
b'\\x00\\x01\\x02\\x03'
>>> buf.free()

On native, device memory comes from ``aclrtMalloc`` and bytes move with ``aclrtMemcpy``
(``ACL_MEMCPY_HOST_TO_DEVICE`` / ``ACL_MEMCPY_DEVICE_TO_HOST``), loaded with :mod:`ctypes` from
``$ASCEND_HOME_PATH/lib64/libascendcl.so`` (else ``libascendcl.so`` on the library path): the real
runtime on an Atlas node, the stand-in of kvdd's simulated CANN root (``kvdd cann-root``) in CI,
where device memory is host memory, so the same code path runs in both places.  ``HOST``
placement caches are host memory on every backend.

Environment: ``KVDD_TEST_DEVICE_IDS`` (comma-separated NPU ids for the conformance suite, see
:func:`device_ids`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..memory import TensorAddrs, tensor_addrs
from ..shm import empty
from ..types import CacheDesc, CachePlacement

__all__ = [
    "AclError",
    "AclRuntime",
    "Buffer",
    "CacheMemory",
    "DeviceBuffer",
    "HostBuffer",
    "allocate",
    "allocate_cache",
    "acl_runtime",
    "device_ids",
    "ENV_DEVICE_IDS",
]

logger = logging.getLogger(__name__)

#: Comma-separated NPU device ids the conformance suite may use: the first for the node under test,
#: the others for peer processes (``KVDD_PEER=process``).
ENV_DEVICE_IDS = "KVDD_TEST_DEVICE_IDS"
_DEFAULT_DEVICE_IDS = (0, 1, 2, 3, 4, 5, 6, 7)

# ACL constants (acl/acl_base.h, acl/acl_rt.h of CANN; values from CANN's ACL documentation).
ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEM_MALLOC_HUGE_FIRST = 0

Bytes = npt.NDArray[np.uint8]


def device_ids() -> tuple[int, ...]:
    """The NPU ids given by ``$KVDD_TEST_DEVICE_IDS`` (default ``0,1,...,7``).

    Returns
    -------
    tuple of int
        At least one id; the first is the node under test's, the others go to peer processes.

    Raises
    ------
    ValueError
        When the variable is set but is not a comma-separated list of non-negative integers.
    """
    text = os.environ.get(ENV_DEVICE_IDS, "").strip()
    if not text:
        return _DEFAULT_DEVICE_IDS
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"{ENV_DEVICE_IDS}={text!r}: expected comma-separated NPU ids such as '0,1'") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"{ENV_DEVICE_IDS}={text!r}: expected non-negative NPU ids such as '0,1'")
    return ids


class AclError(RuntimeError):
    """An ACL call returned an error code.

    Attributes
    ----------
    call : str
        The ACL function, e.g. ``"aclrtMalloc"``.
    code : int
        Its ``aclError`` return value.
    """

    def __init__(self, call: str, code: int, message: str = "") -> None:
        self.call = call
        self.code = code
        text = f"{call} failed with aclError {code}"
        super().__init__(f"{text}: {message}" if message else text)


def _library_path() -> str:
    home = os.environ.get("ASCEND_HOME_PATH")
    if home:
        path = os.path.join(home, "lib64", "libascendcl.so")
        if os.path.exists(path):
            return path
    return "libascendcl.so"


class AclRuntime:
    """The ACL functions kvdd needs, loaded with ctypes.

    Parameters
    ----------
    path : str, optional
        The ``libascendcl.so`` to load; default ``$ASCEND_HOME_PATH/lib64/libascendcl.so``, else
        the one the dynamic loader finds (``LD_LIBRARY_PATH`` set by CANN's ``set_env.sh``).

    Raises
    ------
    OSError
        When the library cannot be loaded (with what to do about it).

    Notes
    -----
    ACL keeps a *current context* per thread.  Every method first makes the context of its
    ``device_id`` current on the calling thread (``aclrtSetDevice`` the first time in this process,
    ``aclrtSetCurrentContext`` afterwards), so the methods may be called from any thread.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path or _library_path()
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise OSError(
                f"cannot load the Ascend runtime {self.path!r} ({exc}). On an Atlas node source "
                "CANN's set_env.sh; elsewhere create kvdd's simulated CANN root (kvdd cann-root "
                "DEST) and source DEST/set_env.sh.") from exc
        self._lib = lib
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32
        self._sig("aclInit", [ctypes.c_char_p])
        self._sig("aclrtSetDevice", [i32])
        self._sig("aclrtGetCurrentContext", [ctypes.POINTER(vp)])
        self._sig("aclrtSetCurrentContext", [vp])
        self._sig("aclrtMalloc", [ctypes.POINTER(vp), sz, ctypes.c_int])
        self._sig("aclrtFree", [vp])
        self._sig("aclrtMemcpy", [vp, sz, vp, sz, ctypes.c_int])
        self._recent = getattr(lib, "aclGetRecentErrMsg", None)
        if self._recent is not None:
            self._recent.restype = ctypes.c_char_p
            self._recent.argtypes = []
        self._lock = threading.Lock()
        self._contexts: dict[int, int] = {}
        self._local = threading.local()
        code = lib.aclInit(None)
        if code not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
            self._fail("aclInit", code)

    def _sig(self, name: str, argtypes: list[type]) -> None:
        fn = getattr(self._lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes

    def _fail(self, call: str, code: int) -> None:
        message = ""
        if self._recent is not None:
            raw = self._recent()
            message = raw.decode("utf-8", "replace") if raw else ""
        raise AclError(call, code, message)

    def _check(self, call: str, code: int) -> None:
        if code != ACL_SUCCESS:
            self._fail(call, code)

    def activate(self, device_id: int) -> None:
        """Make ``device_id``'s context current on the calling thread.

        Parameters
        ----------
        device_id : int
            NPU id (``aclrtSetDevice``).

        Raises
        ------
        AclError
            When ACL refuses the device.
        """
        if getattr(self._local, "device", None) == device_id:
            return
        with self._lock:
            ctx = self._contexts.get(device_id)
            if ctx is None:
                self._check("aclrtSetDevice", self._lib.aclrtSetDevice(device_id))
                out = ctypes.c_void_p()
                self._check("aclrtGetCurrentContext",
                            self._lib.aclrtGetCurrentContext(ctypes.byref(out)))
                self._contexts[device_id] = int(out.value or 0)
            else:
                self._check("aclrtSetCurrentContext", self._lib.aclrtSetCurrentContext(ctx))
        self._local.device = device_id

    def malloc(self, nbytes: int, device_id: int) -> int:
        """``aclrtMalloc(&ptr, nbytes, ACL_MEM_MALLOC_HUGE_FIRST)``: device memory, its address."""
        self.activate(device_id)
        out = ctypes.c_void_p()
        self._check("aclrtMalloc",
                    self._lib.aclrtMalloc(ctypes.byref(out), nbytes, ACL_MEM_MALLOC_HUGE_FIRST))
        return int(out.value or 0)

    def free(self, address: int, device_id: int) -> None:
        """``aclrtFree(address)``."""
        self.activate(device_id)
        self._check("aclrtFree", self._lib.aclrtFree(address))

    def to_device(self, address: int, data: Bytes, device_id: int) -> None:
        """``aclrtMemcpy(address, n, data, n, ACL_MEMCPY_HOST_TO_DEVICE)``."""
        self.activate(device_id)
        n = int(data.nbytes)
        self._check("aclrtMemcpy", self._lib.aclrtMemcpy(
            address, n, data.ctypes.data, n, ACL_MEMCPY_HOST_TO_DEVICE))

    def to_host(self, out: Bytes, address: int, device_id: int) -> None:
        """``aclrtMemcpy(out, n, address, n, ACL_MEMCPY_DEVICE_TO_HOST)``."""
        self.activate(device_id)
        n = int(out.nbytes)
        self._check("aclrtMemcpy", self._lib.aclrtMemcpy(
            out.ctypes.data, n, address, n, ACL_MEMCPY_DEVICE_TO_HOST))


_runtime: AclRuntime | None = None
_runtime_lock = threading.Lock()


def acl_runtime() -> AclRuntime:
    """This process's :class:`AclRuntime` (loaded on first use)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = AclRuntime()
        return _runtime


def _as_bytes(data: object) -> Bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    arr = np.asarray(data)
    if not arr.flags.c_contiguous:
        raise ValueError("data must be C-contiguous (use numpy.ascontiguousarray)")
    return arr.reshape(-1).view(np.uint8)


class Buffer(Protocol):
    """Memory a cache's tensors can live in (see :func:`allocate`)."""

    @property
    def address(self) -> int:
        """Address of the first byte (what ``register_kv_cache`` takes)."""
        ...

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        ...

    def read(self, offset: int = 0, nbytes: int | None = None) -> Bytes:
        """A host copy of ``nbytes`` bytes (default: to the end) from ``offset``."""
        ...

    def write(self, data: object, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like or C-contiguous array, any dtype) in at ``offset``."""
        ...

    def addrs(self, offsets: Sequence[int], nbytes: int) -> Sequence[int]:
        """Addresses of tensors of ``nbytes`` at ``offsets``, ready for ``register_kv_cache``."""
        ...

    def free(self) -> None:
        """Release the memory (idempotent); unregister caches in it first."""
        ...


def _span(size: int, offset: int, nbytes: int | None) -> tuple[int, int]:
    n = size - offset if nbytes is None else nbytes
    if offset < 0 or n < 0 or offset + n > size:
        raise ValueError(f"bytes [{offset}, {offset + n}) are outside the buffer of {size} bytes")
    return offset, n


class HostBuffer:
    """Host memory (a numpy ``uint8`` array): every simulator cache, and ``HOST`` placement.

    Parameters
    ----------
    nbytes : int
        Size in bytes.
    shareable : bool, default False
        True: memory from :func:`kvdd.empty`, which a simulator peer process on this host maps
        (:func:`allocate` gives simulator caches this); False: ``numpy.zeros``.
    """

    def __init__(self, nbytes: int, shareable: bool = False) -> None:
        # shareable: kvdd.empty (zero-filled), which the simulator's same-host peers map
        self.array: Bytes = empty(nbytes, np.uint8) if shareable else np.zeros(nbytes, np.uint8)

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def read(self, offset: int = 0, nbytes: int | None = None) -> Bytes:
        start, n = _span(self.nbytes, offset, nbytes)
        out: Bytes = self.array[start:start + n].copy()
        return out

    def write(self, data: object, offset: int = 0) -> None:
        src = _as_bytes(data)
        start, n = _span(self.nbytes, offset, src.nbytes)
        self.array[start:start + n] = src

    def addrs(self, offsets: Sequence[int], nbytes: int) -> TensorAddrs:
        """A :class:`kvdd.TensorAddrs` of views: registration keeps the array alive."""
        for o in offsets:
            _span(self.nbytes, o, nbytes)
        return tensor_addrs([self.array[o:o + nbytes] for o in offsets])

    def free(self) -> None:
        """Nothing to do: the array goes when the last reference (incl. a registration) does."""


class DeviceBuffer:
    """NPU device memory from ``aclrtMalloc`` (native ``DEVICE`` placement).

    Parameters
    ----------
    nbytes : int
        Size in bytes (> 0).
    device_id : int
        NPU id.
    runtime : AclRuntime, optional
        Default :func:`acl_runtime`.

    Raises
    ------
    AclError
        When ACL cannot allocate it.

    Notes
    -----
    Freed by :meth:`free`, else when garbage-collected.  Registering it passes plain integer
    addresses, so keeping it alive while registered is the caller's job, as on hardware.
    """

    def __init__(self, nbytes: int, device_id: int, runtime: AclRuntime | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, not {nbytes}")
        self._rt = runtime or acl_runtime()
        self.device_id = device_id
        self._nbytes = nbytes
        self._address = self._rt.malloc(nbytes, device_id)
        self._finalizer = weakref.finalize(self, _free_quietly, self._rt, self._address, device_id)

    @property
    def address(self) -> int:
        return self._address

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def read(self, offset: int = 0, nbytes: int | None = None) -> Bytes:
        start, n = _span(self._nbytes, offset, nbytes)
        out = np.empty(n, dtype=np.uint8)
        if n:
            self._rt.to_host(out, self._address + start, self.device_id)
        return out

    def write(self, data: object, offset: int = 0) -> None:
        src = _as_bytes(data)
        start, n = _span(self._nbytes, offset, src.nbytes)
        if n:
            self._rt.to_device(self._address + start, src, self.device_id)

    def addrs(self, offsets: Sequence[int], nbytes: int) -> tuple[int, ...]:
        for o in offsets:
            _span(self._nbytes, o, nbytes)
        return tuple(self._address + o for o in offsets)

    def free(self) -> None:
        if self._finalizer.detach() is not None:
            self._rt.free(self._address, self.device_id)


def _free_quietly(runtime: AclRuntime, address: int, device_id: int) -> None:
    try:
        runtime.free(address, device_id)
    except (AclError, OSError) as exc:  # at interpreter exit: report, never raise from a finalizer
        logger.warning("leaked device memory at %#x: %s", address, exc)


def allocate(nbytes: int, *, backend: str, placement: int = CachePlacement.DEVICE,
             device_id: int = 0) -> Buffer:
    """Memory for cache tensors of ``backend``, zero-filled on the host side.

    Parameters
    ----------
    nbytes : int
        Size in bytes.
    backend : {"sim", "native"}
        The backend whose caches will live there (``LlmDataDist.backend_name``).
    placement : int, default CachePlacement.DEVICE
        ``CacheDesc.placement`` of the cache: native ``DEVICE`` memory is ACL device memory
        (:class:`DeviceBuffer`, contents undefined until written); everything else is host memory
        (:class:`HostBuffer`).
    device_id : int, default 0
        NPU id for device memory (the instance's ``llm.DeviceId``).

    Returns
    -------
    Buffer

    Raises
    ------
    ValueError
        For an unknown backend.
    AclError, OSError
        When the Ascend runtime cannot be loaded or refuses the allocation.
    """
    if backend == "native" and placement == CachePlacement.DEVICE:
        return DeviceBuffer(nbytes, device_id)
    if backend not in ("sim", "native"):
        raise ValueError(f"unknown backend {backend!r}; valid names: sim, native")
    return HostBuffer(nbytes, shareable=backend == "sim")


class CacheMemory:
    """The tensors of one cache, one :class:`Buffer` each (see :func:`allocate_cache`).

    Attributes
    ----------
    desc : CacheDesc
    buffers : tuple of Buffer
        One per tensor, ``desc.tensor_nbytes`` bytes each.
    """

    def __init__(self, desc: CacheDesc, buffers: Sequence[Buffer]) -> None:
        self.desc = desc
        self.buffers = tuple(buffers)

    def tensor_addrs(self) -> list[int]:
        """The addresses to pass to ``register_kv_cache`` (one per tensor)."""
        addrs: list[int] = []
        for buf in self.buffers:
            addrs.extend(buf.addrs([0], buf.nbytes))
        return addrs

    def read(self, k: int) -> Bytes:
        """A host copy of tensor ``k`` (``desc.tensor_nbytes`` bytes)."""
        return self.buffers[k].read()

    def write(self, k: int, data: object) -> None:
        """Fill tensor ``k`` from ``data`` (exactly ``desc.tensor_nbytes`` bytes)."""
        src = _as_bytes(data)
        if src.nbytes != self.buffers[k].nbytes:
            raise ValueError(f"tensor {k} holds {self.buffers[k].nbytes} bytes, got {src.nbytes}")
        self.buffers[k].write(src)

    def free(self) -> None:
        """Free every tensor (unregister the cache first)."""
        for buf in self.buffers:
            buf.free()


def allocate_cache(desc: CacheDesc, *, backend: str, device_id: int = 0) -> CacheMemory:
    """Memory for the ``desc.num_tensors`` tensors of a cache of ``backend``.

    Parameters
    ----------
    desc : CacheDesc
        Shape, dtype and placement (SEMANTICS.md §2.1: each tensor is ``desc.tensor_nbytes``).
    backend : {"sim", "native"}
    device_id : int, default 0
        NPU id (native ``DEVICE`` placement).

    Returns
    -------
    CacheMemory

    Raises
    ------
    ValueError
        When ``desc`` has no defined tensor size, or the backend is unknown.
    AclError, OSError
        As :func:`allocate`.
    """
    nbytes = desc.tensor_nbytes
    return CacheMemory(desc, [allocate(nbytes, backend=backend, placement=desc.placement,
                                       device_id=device_id) for _ in range(desc.num_tensors)])
