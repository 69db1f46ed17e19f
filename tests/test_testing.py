"""kvdd.testing: cache memory per backend (host numpy buffers; ACL device memory on native)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvdd
import kvdd.testing as kt
from kvdd import CacheDesc, CachePlacement, DataType


def _acl_available() -> bool:
    try:
        kt.acl_runtime()
    except OSError:
        return False
    return True


BACKENDS = ["sim"] + (["native"] if _acl_available() else [])


def test_device_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kt.ENV_DEVICE_IDS, raising=False)
    assert kt.device_ids() == (0, 1, 2, 3, 4, 5, 6, 7)
    monkeypatch.setenv(kt.ENV_DEVICE_IDS, "4, 5")
    assert kt.device_ids() == (4, 5)
    for bad in ("a,b", "1,,2", "-1"):
        monkeypatch.setenv(kt.ENV_DEVICE_IDS, bad)
        with pytest.raises(ValueError, match=kt.ENV_DEVICE_IDS):
            kt.device_ids()


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_read_round_trip(backend: str) -> None:
    buf = kt.allocate(300, backend=backend, device_id=kt.device_ids()[0])
    assert isinstance(buf, kt.DeviceBuffer if backend == "native" else kt.HostBuffer)
    assert buf.nbytes == 300 and buf.address > 0
    pattern = np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8)
    buf.write(pattern)
    assert np.array_equal(buf.read(), pattern)
    buf.write(b"\xaa\xbb", offset=298)
    buf.write(np.array([1, 2], dtype=np.uint16), offset=10)  # any dtype, as its bytes
    expected = pattern.copy()
    expected[298:] = [0xAA, 0xBB]
    expected[10:14] = np.array([1, 2], dtype=np.uint16).view(np.uint8)
    assert np.array_equal(buf.read(), expected)
    assert buf.read(10, 4).tobytes() == np.array([1, 2], dtype=np.uint16).tobytes()
    assert list(buf.addrs([0, 100], 64)) == [buf.address, buf.address + 100]
    buf.free()
    buf.free()  # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_bounds_is_refused_and_changes_nothing(backend: str) -> None:
    buf = kt.allocate(16, backend=backend, device_id=kt.device_ids()[0])
    buf.write(bytes(range(16)))
    with pytest.raises(ValueError, match="outside the buffer"):
        buf.write(b"xyz", offset=14)
    with pytest.raises(ValueError, match="outside the buffer"):
        buf.read(10, 7)
    with pytest.raises(ValueError, match="outside the buffer"):
        buf.addrs([8], 9)
    with pytest.raises(ValueError, match="C-contiguous"):
        buf.write(np.zeros((4, 4), dtype=np.uint8)[:, ::2])
    assert buf.read().tobytes() == bytes(range(16))
    buf.free()


def test_placement_and_backend_choose_the_memory() -> None:
    assert isinstance(kt.allocate(8, backend="sim", placement=CachePlacement.DEVICE), kt.HostBuffer)
    assert isinstance(kt.allocate(8, backend="native", placement=CachePlacement.HOST),
                      kt.HostBuffer)
    with pytest.raises(ValueError, match="unknown backend"):
        kt.allocate(8, backend="npu")


def test_missing_runtime_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OSError, match="set_env.sh"):
        kt.AclRuntime(os.path.join(os.sep, "nonexistent", "libascendcl.so"))


def test_allocate_cache_tensors_register_on_the_simulator() -> None:
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_INT32, shape=(2, 4))
    mem = kt.allocate_cache(desc, backend="sim")
    src = kt.allocate_cache(desc, backend="sim")
    src.write(0, np.arange(8, dtype=np.int32))
    src.write(1, np.arange(8, 16, dtype=np.int32))
    with pytest.raises(ValueError, match="holds 32 bytes"):
        src.write(0, b"short")
    with kvdd.LlmDataDist(1, kvdd.LlmRole.MIX, backend="sim") as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        a = dd.register_kv_cache(desc, src.tensor_addrs())
        b = dd.register_kv_cache(desc, mem.tensor_addrs())
        assert a != b
    # Nothing moved: the destination still holds its zeros, the source its values.
    assert mem.read(0).tobytes() == bytes(32)
    assert np.array_equal(src.read(1).view(np.int32), np.arange(8, 16))
    mem.free()
    src.free()
