"""kvdd.tensor_addrs / TensorAddrs (API.md "Memory")."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import Cache, TensorAddrs, tensor_addrs


class ArrayInterface:
    """Exposes only ``__array_interface__`` (like many third-party array types)."""

    def __init__(self, arr: np.ndarray[Any, Any], **override: Any) -> None:
        self.arr = arr
        self.override = override

    @property
    def __array_interface__(self) -> dict[str, Any]:
        iface = dict(self.arr.__array_interface__)
        iface.update(self.override)
        return iface


class DLPackOnly:
    """Exposes only ``__dlpack__``/``__dlpack_device__``, delegating to a numpy array."""

    def __init__(self, arr: np.ndarray[Any, Any], device: tuple[int, int] | None = None) -> None:
        self.arr = arr
        self.device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device is not None:
            return self.device
        dev: tuple[int, int] = self.arr.__dlpack_device__()
        return dev


def _addr(arr: np.ndarray[Any, Any]) -> int:
    return int(arr.__array_interface__["data"][0])


# --- numpy ------------------------------------------------------------------------------------


def test_numpy_arrays() -> None:
    a = np.zeros((4, 16), dtype=np.int32)
    b = np.zeros(100, dtype=np.uint8)
    addrs = tensor_addrs([a, b])
    assert isinstance(addrs, TensorAddrs) and isinstance(addrs, tuple)
    assert addrs == (a.ctypes.data, b.ctypes.data)
    assert list(addrs) == [_addr(a), _addr(b)]
    assert all(type(x) is int for x in addrs)
    assert len(addrs) == 2


def test_contiguous_views_are_allowed() -> None:
    base = np.zeros((8, 16), dtype=np.float32)
    rows = base[2:6]                      # C-contiguous view, offset 2 rows of 64 bytes
    flat = base.reshape(-1)[16:]          # 1-D view
    col = base[:, :1][3:4]                # a (1, 1) view: trivially contiguous
    addrs = tensor_addrs([rows, flat, col])
    assert addrs == (_addr(base) + 128, _addr(base) + 64, _addr(base) + 3 * 64)


def test_tuple_and_generator_inputs() -> None:
    a, b = np.zeros(4), np.zeros(8)
    assert tensor_addrs((a, b)) == (_addr(a), _addr(b))
    assert tensor_addrs(x for x in (a, b)) == (_addr(a), _addr(b))
    assert tensor_addrs([]) == ()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros((4, 16))[:, ::2],
        lambda: np.zeros((4, 16)).T,
        lambda: np.zeros((4, 16), order="F"),
        lambda: np.zeros(10)[::3],
        lambda: np.zeros((4, 4, 4))[:, 1, :],
    ],
    ids=["strided-cols", "transpose", "fortran", "step", "middle-index"],
)
def test_non_contiguous_is_value_error(make: Any) -> None:
    arr = make()
    for obj in (arr, ArrayInterface(arr), DLPackOnly(arr)):
        with pytest.raises(ValueError, match="contiguous"):
            tensor_addrs([np.zeros(4), obj])


def test_read_only_is_value_error() -> None:
    arr = np.zeros(16)
    arr.setflags(write=False)
    with pytest.raises(ValueError):
        tensor_addrs([arr])
    with pytest.raises(ValueError):
        tensor_addrs([ArrayInterface(arr)])
    with pytest.raises(ValueError):
        tensor_addrs([DLPackOnly(arr)])
    # a read-only view of writable memory is still read-only
    view = np.zeros(16)[4:]
    view.setflags(write=False)
    with pytest.raises(ValueError):
        tensor_addrs([view])
    with pytest.raises(ValueError):
        tensor_addrs([np.frombuffer(b"\x00" * 16, dtype=np.uint8)])


# --- __array_interface__ / __dlpack__ -------------------------------------------------------------


def test_array_interface_objects() -> None:
    a = np.zeros((3, 5), dtype=np.float16)
    view = np.zeros((6, 5), dtype=np.float16)[2:5]
    addrs = tensor_addrs([ArrayInterface(a), ArrayInterface(view)])
    assert addrs == (_addr(a), _addr(view))
    # explicit C strides are fine
    assert tensor_addrs([ArrayInterface(a, strides=(10, 2))]) == (_addr(a),)


def test_array_interface_read_only_flag() -> None:
    a = np.zeros(8)
    with pytest.raises(ValueError):
        tensor_addrs([ArrayInterface(a, data=(_addr(a), True))])


def test_dlpack_objects() -> None:
    a = np.zeros((4, 16), dtype=np.int32)
    view = np.zeros((8, 16), dtype=np.int32)[4:]
    addrs = tensor_addrs([DLPackOnly(a), DLPackOnly(view)])
    assert addrs == (_addr(a), _addr(view))


@pytest.mark.parametrize("device", [(2, 0), (4, 0), (13, 0)], ids=["cuda", "opencl", "ext-dev"])
def test_non_cpu_dlpack_is_value_error(device: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        tensor_addrs([DLPackOnly(np.zeros(4), device=device)])


def test_numpy_arrays_support_dlpack() -> None:
    # the premise of DLPackOnly: numpy arrays are DLPack producers on CPU (device type 1)
    a = np.zeros(4)
    assert hasattr(a, "__dlpack__")
    assert a.__dlpack_device__()[0] == 1


# --- other types --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [5, 4096, "abc", b"abc", None, object(), [1, 2], 1.5, bytearray(16), memoryview(bytearray(16))],
    ids=["int", "addr-int", "str", "bytes", "None", "object", "list", "float", "bytearray",
         "memoryview"],
)
def test_other_tensor_types_are_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        tensor_addrs([np.zeros(4), bad])


@pytest.mark.parametrize("bad", [5, None, "abc", b"abc"])
def test_argument_must_be_an_iterable_of_tensors(bad: Any) -> None:
    with pytest.raises(TypeError):
        tensor_addrs(bad)


# --- torch (optional) -------------------------------------------------------------------------


def test_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    a = torch.zeros((4, 16), dtype=torch.float16)
    b = torch.zeros((8, 16), dtype=torch.int8)[2:]
    addrs = tensor_addrs([a, b])
    assert addrs == (a.data_ptr(), b.data_ptr())
    with pytest.raises(ValueError):
        tensor_addrs([a.t()])
    with pytest.raises(ValueError):
        tensor_addrs([torch.zeros((4, 16))[:, ::2]])
    holder = [torch.zeros(32)]
    ref = weakref.ref(holder[0])
    addrs = tensor_addrs(holder)
    holder.clear()
    gc.collect()
    assert ref() is not None
    del addrs
    gc.collect()
    assert ref() is None


# --- TensorAddrs -------------------------------------------------------------------------------


def test_tensor_addrs_keeps_owners_alive() -> None:
    def make() -> tuple[TensorAddrs, weakref.ref[np.ndarray[Any, Any]], int]:
        arr = np.zeros(1 << 16, dtype=np.uint8)
        arr[:4] = [1, 2, 3, 4]
        return tensor_addrs([arr]), weakref.ref(arr), _addr(arr)

    addrs, ref, addr = make()
    gc.collect()
    alive = ref()
    assert alive is not None  # only the TensorAddrs refers to it now
    assert addrs[0] == addr and _addr(alive) == addr
    assert bytes(alive[:4]) == b"\x01\x02\x03\x04"
    assert any(o is alive for o in addrs.owners)
    del alive
    del addrs
    gc.collect()
    assert ref() is None


def test_view_keeps_its_base_alive() -> None:
    base = np.zeros(64, dtype=np.uint8)
    ref = weakref.ref(base)
    addrs = tensor_addrs([base[8:]])
    del base
    gc.collect()
    assert ref() is not None
    del addrs
    gc.collect()
    assert ref() is None


def test_tensor_addrs_is_a_tuple_of_ints() -> None:
    a, b = np.zeros(4), np.zeros(4)
    addrs = tensor_addrs([a, b])
    assert addrs == (_addr(a), _addr(b))
    assert hash(addrs) == hash((_addr(a), _addr(b)))
    assert addrs[0] == _addr(a) and addrs[-1] == _addr(b)
    assert addrs[:1] == (_addr(a),)
    # usable wherever the API takes a sequence of addresses
    c = Cache(1, addrs)
    assert c.tensor_addrs == (_addr(a), _addr(b))
    assert kvdd.TensorAddrs is TensorAddrs and "tensor_addrs" in kvdd.__all__


def test_register_refuses_a_tensor_smaller_than_the_descriptor() -> None:
    """A 16 KiB view registered as a 256 KiB tensor would let transfers overrun it: ValueError from
    the facade, and nothing is registered (the next registration still gets id 1)."""
    import kvdd

    with kvdd.LlmDataDist(1, kvdd.LlmRole.MIX, backend="sim") as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        big = np.zeros((64, 1024), np.float32)
        desc = kvdd.CacheDesc(num_tensors=2, data_type=kvdd.DataType.DT_FLOAT, shape=(64, 1024))
        small = big[:4]  # 16 KiB of the 256 KiB the descriptor describes
        with pytest.raises(ValueError, match="tensor 1 holds 16384 bytes but cache_desc needs 262144"):
            dd.register_kv_cache(desc, kvdd.tensor_addrs([big, small]))
        assert dd.register_kv_cache(desc, kvdd.tensor_addrs([big, np.zeros_like(big)])) == 1
        # plain addresses carry no sizes: the caller's job, as on hardware
        assert dd.register_kv_cache(desc, [small.ctypes.data, big.ctypes.data]) == 2
