#!/usr/bin/env bash
# Builds kvdd's C++ examples against $ASCEND_HOME_PATH with -Wall -Wextra -Werror and runs each as
# two processes (prefill and decode) on loopback, on both transfer backends.  Exit status 0 when
# every pair passed.  Used by CI after `source DEST/set_env.sh` of a simulated CANN root.
#
# usage: examples/cpp/run_pairs.sh BUILD_DIR [PORT_BASE]      (ports PORT_BASE .. PORT_BASE+17)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="${1:?usage: $0 BUILD_DIR [PORT_BASE]}"
port="${2:-26500}"
: "${ASCEND_HOME_PATH:?source set_env.sh of a CANN root first}"
mkdir -p "$build"
cxx="${CXX:-g++}"
pids=()
for example in pull push switch_roles; do
  "$cxx" -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=0 -O2 -Wall -Wextra -Werror \
    -I"$ASCEND_HOME_PATH/include" "$here/$example.cpp" -L"$ASCEND_HOME_PATH/lib64" \
    -lllm_datadist -lmetadef -lascendcl -lpthread -o "$build/$example" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

failed=0
for example in pull push switch_roles; do
  for backend in comm hixl; do
    timeout 120 "$build/$example" prefill "$backend" "$port" >"$build/$example-$backend-prefill.log" 2>&1 &
    prefill=$!
    rc_decode=0
    timeout 120 "$build/$example" decode "$backend" "$port" >"$build/$example-$backend-decode.log" 2>&1 \
      || rc_decode=$?
    rc_prefill=0
    wait "$prefill" || rc_prefill=$?
    if [[ $rc_decode -eq 0 && $rc_prefill -eq 0 ]]; then
      echo "examples/cpp: $example on $backend: passed"
    else
      echo "examples/cpp: $example on $backend: FAILED (decode exit $rc_decode, prefill exit $rc_prefill)"
      cat "$build/$example-$backend-prefill.log" "$build/$example-$backend-decode.log"
      failed=1
    fi
    port=$((port + 3))
  done
done
exit "$failed"
