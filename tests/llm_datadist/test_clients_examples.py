"""``examples/python/``: every prefill/decode program of CANN's ``llm_datadist`` package runs as
its processes against kvdd's simulator (``run_pairs.py --sim``) and verifies every byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from demo_support import child_env

RUNNER = Path(__file__).resolve().parents[2] / "examples" / "python" / "run_pairs.py"
PAIRS = ("pull_blocks", "pull_cache", "push", "layerwise_push", "switch_role", "many_prefills", "rank_table")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RUNNER), "--sim", *args], capture_output=True, text=True,
                          env=child_env(), timeout=900)


def test_every_example_pair_passes() -> None:
    r = _run("--timeout", "150")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in PAIRS:
        assert f"examples/python: {name}: passed" in r.stdout
    assert f"{len(PAIRS)} of {len(PAIRS)} passed" in r.stdout


def test_a_failing_pair_fails_the_run_and_shows_its_output() -> None:
    # A fault the example does not expect: its first pull fails, decode exits 1, the runner says so.
    env = child_env("pull_blocks:status=LLM_LINK_BUSY:count=1")
    r = subprocess.run([sys.executable, str(RUNNER), "--sim", "--only", "pull_blocks", "--timeout", "60"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 1
    assert "examples/python: pull_blocks: FAILED" in r.stdout
    assert "LLM_LINK_BUSY" in r.stdout
    assert "0 of 1 passed" in r.stdout


FAKE_TORCH = '''
"""A stand-in for torch + torch_npu: "NPU" tensors are numpy arrays (enough for examples/python)."""
import numpy as np

int16 = np.int16
devices = []


class _Npu:
    @staticmethod
    def set_device(device_id):
        devices.append(device_id)


npu = _Npu()


class Tensor:
    def __init__(self, array):
        self.array = array

    def data_ptr(self):
        return int(self.array.ctypes.data)

    def copy_(self, other):
        self.array[:] = other.array
        return self

    def cpu(self):
        return Tensor(self.array.copy())

    def numpy(self):
        return self.array


def empty(n, dtype, device):
    assert device == "npu" and devices, "set_device must come first"
    return Tensor(np.empty(n, dtype))


def from_numpy(a):
    return Tensor(a)
'''


def test_the_npu_memory_branch_with_a_stand_in_torch(tmp_path: Path) -> None:
    # Where torch and torch_npu import, the examples register NPU memory (set_device, empty,
    # data_ptr, copy_, cpu): run that branch against a numpy stand-in to check its plumbing.
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    (tmp_path / "torch_npu.py").write_text("")
    env = child_env(extra_paths=[str(tmp_path)])
    r = subprocess.run([sys.executable, str(RUNNER), "--sim", "--only", "pull_blocks,many_prefills", "--timeout", "120"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 of 2 passed" in r.stdout
