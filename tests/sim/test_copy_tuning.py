"""Copy kernels of the simulator (kvdd._native._copy): the benchmarks' copies, the ISA and tuning
switches, cache sizes and CPU features, the compiled block-run planner, and every kernel path
checked in C (tests/sim/copy_impl_check.c): natively, as the plain memcpy build, and for aarch64
NEON with a cross compiler under qemu-user when those are installed."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdd._native import _copy

from copy_support import Arena, reference, ISAS, restore_tuning


# ---- helpers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [_copy.memcpy_bench, _copy.stream_bench], ids=["memcpy", "stream"])
def test_bench_copies(fn: Any, restore_tuning: None) -> None:
    for isa in ISAS:
        _copy.set_isa(isa)
        arena = Arena(20000, seed=17)
        before = arena.snapshot()
        fn(arena.region(10001, 9000), arena.region(3, 9000), 9000)
        np.testing.assert_array_equal(arena.buf, reference(before, [3], [10001], [0], [0], [9000]))
        after = arena.snapshot()
        with pytest.raises(ValueError):
            fn(arena.region(0, 10), arena.region(100, 20), 11)
        with pytest.raises(ValueError):
            fn(arena.region(0, 10), arena.region(100, 20), -1)
        np.testing.assert_array_equal(arena.buf, after)


def test_bench_overlap_is_memmove(restore_tuning: None) -> None:
    for fn in (_copy.memcpy_bench, _copy.stream_bench):
        arena = Arena(20000, seed=18)
        before = arena.snapshot()
        fn(arena.region(10, 9000), arena.region(3, 9000), 9000)
        np.testing.assert_array_equal(arena.buf, reference(before, [3], [10], [0], [0], [9000]))


def test_isa_selection(restore_tuning: None) -> None:
    assert ISAS[0] == "memcpy" and _copy.get_isa() == ISAS[-1]
    for isa in ISAS:
        _copy.set_isa(isa)
        assert _copy.get_isa() == isa
    assert _copy.set_isa("best") == ISAS[-1]
    assert _copy.get_isa() == ISAS[-1]
    with pytest.raises(ValueError, match="unknown"):
        _copy.set_isa("altivec")
    for isa in {"sse2", "avx2", "avx512", "neon"} - set(ISAS):
        with pytest.raises(ValueError, match="cannot run"):
            _copy.set_isa(isa)


def test_tuning_setters(restore_tuning: None) -> None:
    prev = _copy.set_streaming_threshold(123)
    assert _copy.set_streaming_threshold(prev) == 123
    assert _copy.set_threads_threshold(0) == _copy.DEFAULT_THREADS_THRESHOLD
    assert _copy.set_threads_threshold(None) == 0
    assert _copy.set_chunk_size(4096) == _copy.DEFAULT_CHUNK_SIZE and _copy.get_chunk_size() == 4096
    for setter in (_copy.set_streaming_threshold, _copy.set_threads_threshold, _copy.set_chunk_size):
        with pytest.raises(ValueError):
            setter(-1)
        with pytest.raises(TypeError):
            setter(1.5)  # type: ignore[arg-type]


def test_cache_sizes() -> None:
    sizes = _copy.cache_sizes()
    assert set(sizes) == {"l2", "llc"} and all(isinstance(v, int) and v >= 0 for v in sizes.values())
    assert sizes["llc"] >= sizes["l2"]
    if sizes["l2"]:  # the streaming threshold follows the L2 size
        assert _copy.DEFAULT_STREAMING_THRESHOLD == min(max(2 * sizes["l2"], 1 << 20), 4 << 20)


def test_cpu_features() -> None:
    f = _copy.cpu_features()
    assert f and all(isinstance(k, str) and isinstance(v, bool) for k, v in f.items())
    assert f.get("avx512f", False) == ("avx512" in ISAS)
    assert f.get("avx2", False) == ("avx2" in ISAS)
    s = _copy.thread_stats()
    assert set(s) == {"calls", "chunks", "helper_chunks", "stalls", "jobs", "job_ns", "post_ns", "wait_ns", "moves",
                      "wakes"}
    assert isinstance(_copy.job_ns(), int) and _copy.job_ns() == _copy.thread_stats()["job_ns"] >= s["job_ns"]



# ---- the compiled block-run planner (kvdd/sim/runs.py's small path; tests/sim/test_runs.py compares it
# with the numpy path) ------------------------------------------------------------------------------------

def test_group_small_runs_declines_what_it_cannot_plan() -> None:
    """None (the caller plans with numpy) for anything but 1..max_pairs pairs of plain uint64 ints."""
    u64 = (1 << 64) - 1
    for src, dst, cap in (([], [], 8), ([1, 2], [1], 8), ([1, 2, 3], [1, 2, 3], 2), ([-1], [0], 8),
                          ([u64 + 1], [0], 8), ([0], [u64 + 1], 8), ([1.0], [1], 8), ([True], [1], 8),
                          (np.array([1]), [1], 8), ("ab", "ab", 8), ([1] * 257, [1] * 257, 1000)):
        assert _copy.group_small_runs(src, dst, cap) is None, (src, dst, cap)
    assert _copy.group_small_runs((u64, 0, 5), [3, 4, 9], 8) == ([u64, 5], [3, 9], [2, 1], [0, 5], [4, 9], 9)
    assert _copy.group_small_runs([7] * 256, list(range(256)), 256) == ([7] * 256, list(range(256)), [1] * 256,
                                                                   [7] * 256, list(range(256)), 255)


def test_small_byte_plan_offsets_tail_and_bounds() -> None:
    so, do, ln, total, src_end, dst_end = _copy.small_byte_plan([3, 0], [1, 9], [2, 1], 4096, 0)
    assert (so.tolist(), do.tolist(), ln.tolist()) == ([12288, 0], [4096, 36864], [8192, 4096])
    assert (total, src_end, dst_end) == (12288, 20480, 40960)
    assert _copy.small_byte_plan([3, 0], [1, 9], [2, 1], 4096, 100)[2].tolist() == [8192, 100]
    big = (1 << 32) - 1
    assert _copy.small_byte_plan([big], [0], [1], (1 << 31) - 1, 0)[4] == (big + 1) * ((1 << 31) - 1)
    for args in (([1 << 32], [0], [1], 8, 0), ([0], [1 << 32], [1], 8, 0), ([0], [0], [1 << 32], 8, 0),
                 ([0], [0], [1], 1 << 31, 0), ([0], [0], [1], -1, 0), ([0], [0], [1], 8, -1),
                 ([0, 1], [0], [1], 8, 0), ([], [], [], 8, 0)):
        with pytest.raises(ValueError):
            _copy.small_byte_plan(*args)
    with pytest.raises(ValueError, match="overflows"):
        _copy.small_byte_plan([0] * 3, [0] * 3, [big] * 3, (1 << 31) - 1, 0)


# ---- every kernel path in C, including the ones this machine cannot force from Python ----------------

IMPL_DIR = Path(__file__).resolve().parent.parent.parent / "kvdd" / "_native"
CHECK_C = Path(__file__).resolve().parent / "copy_impl_check.c"


def _build(cc: str, out: Path, *flags: str) -> None:
    proc = subprocess.run([cc, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *flags, f"-I{IMPL_DIR}",
                           "-o", str(out), str(CHECK_C), "-lpthread"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def _run_check(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok "), proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(not (IMPL_DIR / "_copy_impl.c").is_file(), reason="needs the source tree (kvdd/_native)")
@pytest.mark.parametrize("variant", ["native", "no-simd"])
def test_c_kernels_on_this_machine(variant: str, tmp_path: Path) -> None:
    """Every implementation this CPU runs (and, with KVDD_NO_SIMD, the plain memcpy build), regular and
    streaming, 1 and 2 threads, checked byte for byte in C."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "check"
    _build(cc, exe, *(["-DKVDD_NO_SIMD"] if variant == "no-simd" else []))
    out = _run_check([str(exe)])
    mask = int(out.split("isa mask ")[1], 16)
    if variant == "no-simd":
        assert mask == 1
    else:
        assert mask == sum(1 << i for i, name in enumerate(("memcpy", "sse2", "avx2", "avx512", "neon"))
                           if name in ISAS)


@pytest.mark.skipif(not (IMPL_DIR / "_copy_impl.c").is_file(), reason="needs the source tree (kvdd/_native)")
def test_c_kernels_aarch64_neon(tmp_path: Path) -> None:
    """The aarch64 NEON path: cross-compiled (aarch64-linux-gnu-gcc, Debian package gcc-aarch64-linux-gnu)
    and run under qemu-user (qemu-aarch64-static, package qemu-user-static) when they are installed."""
    if platform.machine() in ("aarch64", "arm64"):
        pytest.skip("native aarch64: test_c_kernels_on_this_machine covers NEON")
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if cc is None:
        pytest.skip("no aarch64 cross compiler (apt install gcc-aarch64-linux-gnu)")
    exe = tmp_path / "check-aarch64"
    _build(cc, exe, "-static")
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("compiled for aarch64; no qemu-aarch64 to run it (apt install qemu-user-static)")
    out = _run_check([qemu, str(exe)])
    assert int(out.split("isa mask ")[1], 16) == 1 | (1 << 4)  # memcpy and neon
