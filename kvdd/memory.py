"""Tensor memory for registration: :func:`tensor_addrs` and :class:`TensorAddrs` (docs/spec/API.md "Memory").

Addresses are plain integers, as on hardware; a :class:`TensorAddrs` also holds the objects that
own the memory, so that a registered cache cannot be freed under the library (every backend keeps
them alive until the cache is unregistered or the instance finalized).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["TensorAddrs", "tensor_addrs"]


class TensorAddrs(tuple[int, ...]):
    """A tuple of tensor addresses (ints) that also holds the objects owning the memory.

    Parameters
    ----------
    addrs : Iterable[int]
        One address per tensor, in cache order.
    owners : Iterable[object]
        The objects owning the memory (kept alive while registered).
    nbytes : Iterable[int]
        Bytes of memory behind each address, as its owner reports it.

    Attributes
    ----------
    owners : tuple of object
    nbytes : tuple of int

    Notes
    -----
    Pass it to :meth:`kvdd.LlmDataDist.register_kv_cache`, which refuses a tensor smaller than
    ``cache_desc.tensor_nbytes`` (docs/spec/SEMANTICS.md §10).  Pickled copies are plain tuples of
    addresses: owners do not cross processes.
    """

    owners: tuple[object, ...]
    nbytes: tuple[int, ...]

    def __new__(cls, addrs: Iterable[int], owners: Iterable[object] = (),
                nbytes: Iterable[int] = ()) -> TensorAddrs:
        self = super().__new__(cls, (int(a) for a in addrs))
        self.owners = tuple(owners)
        self.nbytes = tuple(nbytes)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled copies are plain addresses: owners do not cross processes.
        return (tuple, (tuple(self),))


def _from_array_interface(obj: object, iface: dict[str, Any], what: str) -> tuple[int, int]:
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise ValueError(f"{what}: __array_interface__ has no (address, readonly) data pointer")
    addr, readonly = data
    if readonly:
        raise ValueError(f"{what}: memory is read-only; a KV cache must be writable")
    shape = tuple(iface["shape"])
    itemsize = np.dtype(iface["typestr"]).itemsize
    strides = iface.get("strides")
    if strides is not None:
        expected = itemsize
        for dim, stride in zip(reversed(shape), reversed(strides)):
            if dim > 1 and stride != expected:
                raise ValueError(f"{what}: not C-contiguous (strides {strides} for shape {shape})")
            expected *= dim
    n = itemsize
    for dim in shape:
        n *= dim
    return int(addr), n


def _one(obj: object, i: int) -> tuple[int, int]:
    what = f"tensor {i} ({type(obj).__name__})"
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{what}: not C-contiguous; pass np.ascontiguousarray(...) "
                             "and register that (a copy is not the cache you transfer into)")
        if not obj.flags.writeable:
            raise ValueError(f"{what}: array is read-only; a KV cache must be writable")
        return int(obj.ctypes.data), int(obj.nbytes)
    module = type(obj).__module__ or ""
    if module.startswith("torch"):
        t: Any = obj
        if t.device.type != "cpu":
            raise ValueError(f"{what}: on device {t.device}; the simulator needs CPU tensors "
                             "(on an Atlas node use the native backend with NPU tensors)")
        if not t.is_contiguous():
            raise ValueError(f"{what}: not contiguous; call .contiguous() first")
        return int(t.data_ptr()), int(t.numel() * t.element_size())
    iface = getattr(obj, "__array_interface__", None)
    if isinstance(iface, dict):
        return _from_array_interface(obj, iface, what)
    if hasattr(obj, "__dlpack__"):
        dev = getattr(obj, "__dlpack_device__", None)
        if dev is not None:
            dev_type = int(dev()[0])
            if dev_type not in (1, 3):  # kDLCPU, kDLCUDAHost
                raise ValueError(f"{what}: DLPack device type {dev_type} is not CPU memory")
        try:
            arr = np.from_dlpack(obj)
        except (TypeError, ValueError, RuntimeError, BufferError) as exc:
            raise ValueError(f"{what}: cannot read its DLPack capsule ({exc})") from None
        if not arr.flags.c_contiguous:
            raise ValueError(f"{what}: not C-contiguous")
        if not arr.flags.writeable:  # DLPack >= 1.0 exporters flag read-only memory
            raise ValueError(f"{what}: memory is read-only; a KV cache must be writable")
        return int(arr.ctypes.data), int(arr.nbytes)
    raise TypeError(f"{what}: expected a numpy array, a torch tensor, or an object with "
                    "__array_interface__ or __dlpack__")


def tensor_addrs(tensors: Iterable[object]) -> TensorAddrs:
    """Addresses of ``tensors`` (one per cache tensor, in cache order) for ``register_kv_cache``.

    Parameters
    ----------
    tensors : Iterable[object]
        C-contiguous numpy arrays (views allowed), objects with ``__array_interface__`` or a CPU
        ``__dlpack__``, or torch CPU tensors (torch is optional).

    Returns
    -------
    TensorAddrs
        The addresses, with the tensors as owners (kept alive while the cache is registered) and
        each tensor's size in bytes.

    Raises
    ------
    ValueError
        A tensor that is not C-contiguous, read-only, or not in CPU memory.
    TypeError
        ``tensors`` is not an iterable of tensors, or an item is none of the kinds above.
    """
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise TypeError("tensor_addrs() takes an iterable of tensors")
    owners = list(tensors)
    pairs = [_one(obj, i) for i, obj in enumerate(owners)]
    return TensorAddrs((a for a, _ in pairs), owners, (n for _, n in pairs))
