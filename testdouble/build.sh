#!/usr/bin/env bash
# Builds kvdd's CI test double of a CANN install ("fake CANN root") into DEST:
#
#   DEST/include/llm_datadist/llm_datadist.h            (+ external/ge_common/*, graph/*)
#   DEST/lib64/libllm_datadist.so   SONAME libllm_datadist.so, forwards to kvdd.sim.engine
#   DEST/lib64/libmetadef.so        SONAME libmetadef.so, ge::AscendString out of line
#   DEST/kvdd_test_double           marker file that kvdd's meson build detects
#
# usage: testdouble/build.sh DEST
# environment: CXX (default g++), PYTHON (default python3; only its headers are used),
#              KVDD_CXX11_ABI (0 or 1, default 0; must equal kvdd's meson option cxx11-abi).
#
# libllm_datadist.so uses only CPython's stable ABI (3.10+) and does not link libpython: it is
# loaded into a Python process by kvdd's extension module and takes the Python symbols from it.
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
  echo "usage: $0 DEST" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$1"
cxx="${CXX:-g++}"
python="${PYTHON:-python3}"
abi="${KVDD_CXX11_ABI:-0}"
case "$abi" in
  0|1) ;;
  *) echo "KVDD_CXX11_ABI must be 0 or 1, not '$abi'" >&2; exit 2 ;;
esac

py_include="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
if [[ ! -f "$py_include/Python.h" ]]; then
  echo "Python.h not found in $py_include (PYTHON=$python)" >&2
  exit 1
fi

mkdir -p "$dest/include" "$dest/lib64"
dest="$(cd "$dest" && pwd)"
cp -R "$here/include/." "$dest/include/"

cxxflags=(-std=c++17 -O2 -g -fPIC -Wall -Wextra "-D_GLIBCXX_USE_CXX11_ABI=$abi"
          -I "$dest/include")

"$cxx" "${cxxflags[@]}" -shared "$here/src/ascend_string.cc" \
  -Wl,-soname,libmetadef.so -o "$dest/lib64/libmetadef.so"

# Python symbols stay undefined (the default for -shared on Linux); no -lpython on purpose.
"$cxx" "${cxxflags[@]}" -I "$py_include" -shared "$here/src/llm_datadist.cc" \
  -Wl,-soname,libllm_datadist.so -L "$dest/lib64" -lmetadef -Wl,-rpath,'$ORIGIN' \
  -o "$dest/lib64/libllm_datadist.so"

if readelf -d "$dest/lib64/libllm_datadist.so" 2>/dev/null | grep -q 'NEEDED.*libpython'; then
  echo "libllm_datadist.so must not link libpython" >&2
  exit 1
fi

cat > "$dest/kvdd_test_double" <<MARKER
kvdd_test_double=1
cxx11_abi=$abi
MARKER

echo "kvdd test double built in $dest (cxx11_abi=$abi)"
