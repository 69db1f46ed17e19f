#!/usr/bin/env bash
# CI stage: kvdd's native backend and C++ programs against kvdd's simulated CANN root (called by
# .ci/run).
#
# usage: bash .ci/native.sh [WORKDIR]
#
#   1. installs kvdd from this checkout (simulator only) into WORKDIR/venv when that venv exists
#      (.ci/run's, where it is already installed), else into a new WORKDIR/native-venv;
#   2. writes the simulated CANN root with that installation: kvdd cann-root WORKDIR/cann-root;
#   3. re-installs kvdd against it (-Dascend-home=<root> -Dnative=enabled) and checks the build;
#   4. runs tests/conformance and tests/native with KVDD_BACKEND=native, then tests/conformance
#      again with native peers in other processes (KVDD_PEER=process, see README "On an Atlas
#      node");
#   5. runs mypy.stubtest on the compiled modules (installed stubs);
#   6. builds examples/cpp with -Wall -Wextra -Werror after `source <root>/set_env.sh` and runs
#      each pair as two processes on loopback, on both transfer backends;
#   7. builds and runs tests/cann/cann_client.cpp (-Wall -Wextra -Werror) against the root: a C++
#      client of ge/llm_error_codes.h that hashes a ge::AscendString and compares it with a literal;
#   8. compiles the binding's build path for a real CANN install (KVDD_TEST_DOUBLE=0): meson
#      configures against a copy of the root without its marker (headers and libraries only) and
#      compiles kvdd/_native/_datadist alone (-O0; nothing is installed or run).
#
# WORKDIR defaults to a new temporary directory (removed at exit).  Any failing step fails the
# script; pytest's "no tests collected" (exit 5) is a failure too.  Environment: PYTHON,
# KVDD_CXX11_ABI (0 or 1, default 0: CANN's setting), KVDD_PYTEST_ARGS (extra pytest arguments,
# default: -m "not slow"), KVDD_CANN_STRICT_RESERVED (passed through: 1 turns on kvdd's lint that
# refuses structs with non-zero reserved bytes; stricter than CANN, which accepts them).
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -ge 1 && -n "$1" ]]; then
  WORK="$(mkdir -p "$1" && cd "$1" && pwd)"
else
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvdd-native-ci.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
fi
ABI="${KVDD_CXX11_ABI:-0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() { printf '\n--- native: %s ---\n' "$*"; }

run_pytest() {  # pytest exits 5 when it collected nothing: that is a failure here
  local rc=0
  "$@" || rc=$?
  if [[ $rc -eq 5 ]]; then echo "native: pytest collected no tests" >&2; return 1; fi
  if [[ $rc -ne 0 ]]; then echo "native: pytest failed (exit $rc)" >&2; fi
  return "$rc"
}

if [[ -x "$WORK/venv/bin/python" ]]; then
  VENV="$WORK/venv"
else
  VENV="$WORK/native-venv"
  if [[ ! -x "$VENV/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$VENV"
    step "install kvdd (simulator only)"
    "$VENV/bin/python" -m pip install -q "$SRC[test]"
  fi
fi
PY="$VENV/bin/python"

# Everything below imports the installed kvdd: run from a directory without the source tree
# (python -m puts the working directory first on sys.path, and mypy searches it too).
RUN="$WORK/native-run"
mkdir -p "$RUN"
cd "$RUN"

step "write the simulated CANN root (kvdd cann-root, cxx11_abi=$ABI)"
ROOT="$WORK/cann-root"
"$PY" -m kvdd cann-root --cxx11-abi "$ABI" "$ROOT"

step "install kvdd against it (-Dnative=enabled)"
"$PY" -m pip install -q "$SRC[test]" \
  "-Csetup-args=-Dascend-home=$ROOT" "-Csetup-args=-Dnative=enabled" \
  "-Csetup-args=-Dcxx11-abi=$ABI"
# shellcheck disable=SC1091
source "$ROOT/set_env.sh"

step "check the build"
"$PY" - <<'PYCHECK'
import kvdd
from kvdd import _build_config as cfg
from kvdd._native import _datadist
from kvdd.backend import looks_like_ascend_node, resolve_backend_name
from kvdd.cann import root_problem

assert cfg.NATIVE_BUILT, f"native backend not built: {cfg.NATIVE_REASON}"
assert cfg.NATIVE_TEST_DOUBLE, f"not a simulated-root build: {cfg.NATIVE_REASON}"
assert "native" in kvdd.available_backends(), kvdd.available_backends()
assert root_problem(cfg.ASCEND_HOME) is None, root_problem(cfg.ASCEND_HOME)
# set_env.sh of a simulated root does not make this an Ascend node; backend=None stays sim.
assert not looks_like_ascend_node() and resolve_backend_name(None) == "sim"
info = _datadist.build_info()
assert info["test_double_cxx11_abi"] == info["cxx11_abi"] == int(cfg.CXX11_ABI), info
print(cfg.NATIVE_REASON)
print(info)
PYCHECK
"$PY" -m kvdd doctor

step "pytest tests/conformance tests/native tests/cann/test_binding_data_type.py with KVDD_BACKEND=native"
if [[ -n "${KVDD_PYTEST_ARGS:-}" ]]; then
  read -r -a extra <<<"$KVDD_PYTEST_ARGS"
else
  extra=(-m "not slow")
fi
KVDD_BACKEND=native run_pytest "$PY" -m pytest -q -p no:cacheprovider -c "$SRC/pyproject.toml" \
  --rootdir "$SRC" "${extra[@]}" "$SRC/tests/conformance" "$SRC/tests/native" \
  "$SRC/tests/cann/test_binding_data_type.py"

step "pytest tests/conformance as on an Atlas node: native peers in other processes, ACL memory"
# Peers of the backend under test in their own processes (one instance each, NPU ids from
# KVDD_TEST_DEVICE_IDS), every cache in aclrtMalloc memory of the root's libascendcl.so, listen
# ports chosen beforehand (the port-0 hook of the root is switched off), and the root refusing
# structs with non-zero reserved bytes (kvdd's lint, stricter than CANN).
KVDD_BACKEND=native KVDD_PEER=process KVDD_TESTDOUBLE_PORT_HOOK=0 KVDD_CANN_STRICT_RESERVED=1 \
  run_pytest "$PY" -m pytest -q -p no:cacheprovider -c "$SRC/pyproject.toml" --rootdir "$SRC" \
  -rs "${extra[@]}" "$SRC/tests/conformance"

step "mypy.stubtest kvdd._native._datadist kvdd._native._copy kvdd._native._xproc kvdd._native._runs kvdd._native._small kvdd._native._gather kvdd.sim._fastpath"
"$PY" -m mypy.stubtest kvdd._native._datadist kvdd._native._copy kvdd._native._xproc kvdd._native._runs \
  kvdd._native._small kvdd._native._gather kvdd.sim._fastpath

step "C++ examples (examples/cpp) against the simulated root, both transfer backends"
bash "$SRC/examples/cpp/run_pairs.sh" "$WORK/examples-cpp"

step "CANN's Python package from the root: examples/python with import llm_datadist after set_env.sh"
# set_env.sh put the root's python/site-packages on PYTHONPATH: the examples import llm_datadist
# exactly as on an Atlas node, and get kvdd's simulator of that package.
"$PY" -c "import llm_datadist, kvdd.llm_datadist; assert llm_datadist is kvdd.llm_datadist"
"$PY" "$SRC/examples/python/run_pairs.py" --installed

step "a C++ client of ge/llm_error_codes.h and ge::AscendString against the root"
# shellcheck disable=SC2086
"${CXX:-g++}" -std=c++17 "-D_GLIBCXX_USE_CXX11_ABI=$ABI" -Wall -Wextra -Werror \
  -I"$ASCEND_HOME_PATH/include" "$SRC/tests/cann/cann_client.cpp" -L"$ASCEND_HOME_PATH/lib64" \
  -lmetadef -o "$WORK/cann_client"
"$WORK/cann_client"

step "compile the build path for a real CANN install (KVDD_TEST_DOUBLE=0, the root without its marker)"
# A real install has no kvdd_simulated_root: meson must take the CANN branch (no test-double
# define, no test-double hooks), and the binding must compile there too.
REAL="$WORK/cann-root-unmarked"
rm -rf "$REAL" "$WORK/real-build"
mkdir -p "$REAL"
cp -a "$ROOT/include" "$ROOT/lib64" "$REAL/"
"$PY" -m pip install -q meson ninja "Cython>=3.0.8"
env -u ASCEND_HOME_PATH "$VENV/bin/meson" setup "$WORK/real-build" "$SRC" --buildtype=plain \
  "-Dascend-home=$REAL" -Dnative=enabled "-Dcxx11-abi=$ABI" >"$WORK/real-build.log" \
  || { cat "$WORK/real-build.log"; exit 1; }
grep -q "^NATIVE_BUILT: bool = True" "$WORK/real-build/kvdd/_build_config.py" \
  && grep -q "^NATIVE_TEST_DOUBLE: bool = False" "$WORK/real-build/kvdd/_build_config.py" \
  || { echo "native: the unmarked root was taken for a simulated one" >&2; exit 1; }
target=$("$VENV/bin/ninja" -C "$WORK/real-build" -t targets all \
  | grep -o '^kvdd/_native/_datadist[^:]*\.so' | head -n 1)
[[ -n "$target" ]] || { echo "native: no _datadist target in the real-install build" >&2; exit 1; }
"$VENV/bin/ninja" -C "$WORK/real-build" "$target"

echo "native: all steps passed"
