"""Backend selection (API.md "Backends"): argument, KVDD_BACKEND, auto, the Ascend-node rule.

The machine is simulated with monkeypatch: the generated ``kvdd._build_config`` module, the
``kvdd._native._datadist`` extension (a stand-in module, or None to make its import fail), the
``ASCEND_HOME_PATH`` / ``KVDD_BACKEND`` environment and the ``/dev/davinci*`` glob.
"""

from __future__ import annotations

import glob
import sys
import types
from collections.abc import Callable, Iterator

import pytest

import kvdd
import kvdd.backend
from kvdd import BackendUnavailableError, LlmDataDist, available_backends
from kvdd.backend import resolve_backend_name

Machine = Callable[..., None]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Machine]:
    """Configure a simulated machine; by default a plain one without a native build."""
    real_glob = glob.glob

    def configure(
        *,
        built: bool = False,
        test_double: bool = False,
        loads: bool = True,
        ascend_home: str | None = None,
        davinci: bool = False,
        env: str | None = None,
    ) -> None:
        cfg = types.ModuleType("kvdd._build_config")
        cfg.VERSION = kvdd.__version__  # type: ignore[attr-defined]
        cfg.NATIVE_BUILT = built  # type: ignore[attr-defined]
        cfg.NATIVE_TEST_DOUBLE = test_double  # type: ignore[attr-defined]
        cfg.ASCEND_HOME = "/opt/fake-cann" if built else ""  # type: ignore[attr-defined]
        cfg.NATIVE_REASON = (  # type: ignore[attr-defined]
            "found CANN" if built else "no CANN root (ascend-home unset)"
        )
        cfg.CXX11_ABI = "1"  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "kvdd._build_config", cfg)
        monkeypatch.setattr(kvdd, "_build_config", cfg, raising=False)
        if built and loads:
            native = types.ModuleType("kvdd._native._datadist")
            monkeypatch.setitem(sys.modules, "kvdd._native._datadist", native)
        else:
            # None in sys.modules makes any import of the module raise ImportError
            monkeypatch.setitem(sys.modules, "kvdd._native._datadist", None)
        if ascend_home is None:
            monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
        else:
            monkeypatch.setenv("ASCEND_HOME_PATH", ascend_home)
        if env is None:
            monkeypatch.delenv("KVDD_BACKEND", raising=False)
        else:
            monkeypatch.setenv("KVDD_BACKEND", env)

        def fake_glob(pattern: str, *args: object, **kwargs: object) -> list[str]:
            if pattern.startswith("/dev/davinci"):
                return ["/dev/davinci0", "/dev/davinci_manager"] if davinci else []
            return real_glob(pattern, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(glob, "glob", fake_glob)

    configure()
    yield configure


def _assert_helpful(exc: BaseException) -> None:
    msg = str(exc)
    assert "sim" in msg  # how to choose the simulator explicitly
    assert "KVDD_BACKEND" in msg or "backend=" in msg
    assert "native" in msg.lower() and "build" in msg.lower()  # how to build native


# --- explicit names ---------------------------------------------------------------------------


def test_argument_names(machine: Machine) -> None:
    assert resolve_backend_name("sim") == "sim"
    assert resolve_backend_name("native") == "native"  # resolution only; creation may fail


def test_argument_beats_environment(machine: Machine) -> None:
    machine(env="native")
    assert resolve_backend_name("sim") == "sim"
    machine(env="no-such-backend")
    assert resolve_backend_name("sim") == "sim"


@pytest.mark.parametrize("name", ["", "SIM", "Native", "simulator", "cpu", " sim"])
def test_unknown_argument_is_value_error_listing_valid_names(machine: Machine, name: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_backend_name(name)
    assert "sim" in str(info.value) and "native" in str(info.value)
    with pytest.raises(ValueError):
        LlmDataDist(1, 2, backend=name)


def test_non_string_argument_rejected(machine: Machine) -> None:
    with pytest.raises((TypeError, ValueError)):
        resolve_backend_name(1)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["sim", "native"])
def test_environment_variable(machine: Machine, value: str) -> None:
    machine(env=value)
    assert resolve_backend_name(None) == value


def test_environment_sim_on_ascend_node_is_explicit_choice(machine: Machine) -> None:
    machine(env="sim", ascend_home="/usr/local/Ascend/ascend-toolkit/latest", davinci=True)
    assert resolve_backend_name(None) == "sim"


@pytest.mark.parametrize("value", ["bogus", "SIM", "sim,native"])
def test_unknown_environment_value_is_value_error(machine: Machine, value: str) -> None:
    machine(env=value)
    with pytest.raises(ValueError) as info:
        resolve_backend_name(None)
    assert "sim" in str(info.value) and "native" in str(info.value)
    with pytest.raises(ValueError):
        LlmDataDist(1, 2)


# --- auto -----------------------------------------------------------------------------------


def test_auto_is_sim_on_a_plain_machine(machine: Machine) -> None:
    assert resolve_backend_name(None) == "sim"
    assert available_backends() == ("sim",)


def test_auto_is_sim_when_native_built_but_not_loading_off_ascend(machine: Machine) -> None:
    machine(built=True, loads=False)
    assert resolve_backend_name(None) == "sim"
    assert available_backends() == ("sim",)


def test_auto_picks_a_real_native_build(machine: Machine) -> None:
    machine(built=True)
    assert resolve_backend_name(None) == "native"
    assert set(available_backends()) == {"sim", "native"}
    machine(built=True, ascend_home="/usr/local/Ascend/ascend-toolkit/latest", davinci=True)
    assert resolve_backend_name(None) == "native"


def test_test_double_build_is_never_chosen_by_none(machine: Machine) -> None:
    machine(built=True, test_double=True)
    assert resolve_backend_name(None) == "sim"
    # but it can be chosen explicitly (CI exercises the binding with it)
    assert resolve_backend_name("native") == "native"
    assert set(available_backends()) == {"sim", "native"}
    machine(built=True, test_double=True, env="native")
    assert resolve_backend_name(None) == "native"


# --- the Ascend-node rule -----------------------------------------------------------------


@pytest.mark.parametrize(
    "node",
    [
        {"ascend_home": "/usr/local/Ascend/ascend-toolkit/latest"},
        {"davinci": True},
        {"ascend_home": "/usr/local/Ascend/ascend-toolkit/latest", "davinci": True},
    ],
    ids=["ASCEND_HOME_PATH", "dev-davinci", "both"],
)
@pytest.mark.parametrize(
    "build",
    [
        {"built": False},
        {"built": True, "loads": False},
        {"built": True, "test_double": True},
    ],
    ids=["not-built", "does-not-load", "test-double"],
)
def test_ascend_node_without_usable_native_raises(
    machine: Machine, node: dict[str, object], build: dict[str, bool]
) -> None:
    machine(**node, **build)
    with pytest.raises(BackendUnavailableError) as info:
        resolve_backend_name(None)
    assert isinstance(info.value, ImportError)
    _assert_helpful(info.value)
    # the facade does not fall back to the simulator either
    with pytest.raises(BackendUnavailableError):
        LlmDataDist(1, 2)
    # explicit choices still work
    assert resolve_backend_name("sim") == "sim"


def test_native_not_built_cannot_be_created(machine: Machine) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        LlmDataDist(1, 2, backend="native")
    assert isinstance(info.value, ImportError)
    assert "build" in str(info.value).lower()
    machine(env="native")
    with pytest.raises(BackendUnavailableError):
        LlmDataDist(1, 2)


def test_native_built_but_not_loading_cannot_be_created(machine: Machine) -> None:
    machine(built=True, loads=False)
    with pytest.raises(BackendUnavailableError):
        LlmDataDist(1, 2, backend="native")


def test_available_backends_type(machine: Machine) -> None:
    got = available_backends()
    assert type(got) is tuple and all(type(n) is str for n in got)
    assert got[0] == "sim"


def test_backend_name_of_a_sim_instance(machine: Machine) -> None:
    pytest.importorskip("kvdd.sim.engine")
    dd = LlmDataDist(1, 2, backend="sim")
    try:
        assert dd.backend_name == "sim"
    finally:
        dd.finalize()
    dd = LlmDataDist(1, 2)  # auto on a plain machine
    try:
        assert dd.backend_name == "sim"
    finally:
        dd.finalize()


def test_exported() -> None:
    for name in ("available_backends", "BackendUnavailableError", "LlmDataDist", "Backend"):
        assert name in kvdd.__all__
    assert kvdd.available_backends is kvdd.backend.available_backends
