#!/usr/bin/env bash
# CI stage: kvdd's native backend against the CANN test double (called by .ci/run).
#
# usage: bash testdouble/ci.sh [WORKDIR]
#
#   1. builds the fake CANN root (testdouble/build.sh) into WORKDIR/cann-testdouble;
#   2. installs kvdd from this checkout with -Dascend-home=<that root> -Dnative=enabled (plus the
#      test extras) into WORKDIR/venv when that venv exists (.ci/run's), else into a new
#      WORKDIR/native-venv (made with $PYTHON, default python3);
#   3. checks that the install is a native build against the test double;
#   4. runs tests/conformance and tests/native with KVDD_BACKEND=native;
#   5. runs mypy.stubtest on the compiled modules (installed stubs).
#
# WORKDIR defaults to a new temporary directory (removed at exit).  Any failing step fails the
# script; pytest's "no tests collected" (exit 5) is a failure too.  Environment: PYTHON,
# KVDD_CXX11_ABI (0 or 1, default 0: CANN's samples' setting), KVDD_PYTEST_ARGS (extra pytest
# arguments, default: -m "not slow").
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

if [[ -x "$WORK/venv/bin/python" ]]; then
  VENV="$WORK/venv"
else
  VENV="$WORK/native-venv"
  if [[ ! -x "$VENV/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"

step "build the fake CANN root (cxx11_abi=$ABI)"
ROOT="$WORK/cann-testdouble"
rm -rf "$ROOT"
PYTHON="$PY" KVDD_CXX11_ABI="$ABI" bash "$SRC/testdouble/build.sh" "$ROOT"

step "install kvdd against it (-Dnative=enabled)"
"$PY" -m pip install -q "$SRC[test]" \
  "-Csetup-args=-Dascend-home=$ROOT" "-Csetup-args=-Dnative=enabled" \
  "-Csetup-args=-Dcxx11-abi=$ABI"
export LD_LIBRARY_PATH="$ROOT/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Everything below imports the installed kvdd: run from a directory without the source tree
# (python -m puts the working directory first on sys.path, and mypy searches it too).
RUN="$WORK/native-run"
mkdir -p "$RUN"
cd "$RUN"

step "check the build"
"$PY" - <<'PYCHECK'
import kvdd
from kvdd import _build_config as cfg
from kvdd._native import _datadist

assert cfg.NATIVE_BUILT, f"native backend not built: {cfg.NATIVE_REASON}"
assert cfg.NATIVE_TEST_DOUBLE, f"not a test-double build: {cfg.NATIVE_REASON}"
assert "native" in kvdd.available_backends(), kvdd.available_backends()
info = _datadist.build_info()
assert info["test_double_cxx11_abi"] == info["cxx11_abi"] == int(cfg.CXX11_ABI), info
print(cfg.NATIVE_REASON)
print(info)
PYCHECK

step "pytest tests/conformance tests/native with KVDD_BACKEND=native"
if [[ -n "${KVDD_PYTEST_ARGS:-}" ]]; then
  read -r -a extra <<<"$KVDD_PYTEST_ARGS"
else
  extra=(-m "not slow")
fi
rc=0
KVDD_BACKEND=native "$PY" -m pytest -q -p no:cacheprovider -c "$SRC/pyproject.toml" \
  --rootdir "$SRC" "${extra[@]}" "$SRC/tests/conformance" "$SRC/tests/native" || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "native: pytest collected no tests" >&2
  exit 1
elif [[ $rc -ne 0 ]]; then
  echo "native: pytest failed (exit $rc)" >&2
  exit "$rc"
fi

step "mypy.stubtest kvdd._native._datadist kvdd._native._copy kvdd._native._xproc"
"$PY" -m mypy.stubtest kvdd._native._datadist kvdd._native._copy kvdd._native._xproc

echo "native: all steps passed"
