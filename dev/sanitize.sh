#!/usr/bin/env bash
# Runs the C++ core's native test (csrc/tests/core_test.cc) under sanitizers:
#   address: AddressSanitizer + UndefinedBehaviorSanitizer, in build/asan
#   thread:  ThreadSanitizer, in build/tsan
# Each gets its own CMake build dir (SHMVEC_SANITIZE=..., SHMVEC_BUILD_TESTS=ON)
# and runs through CTest. Exits non-zero on any failed check or finding.
#
# --python additionally runs tests/test_core.py (or the pytest arguments after
# `--`) against an ASan+UBSan build of shmvec._core and shmvec._worker_loop, in a
# scratch copy of the package under build/asan/pkg: the editable install of
# this checkout is left alone. Python is not built with ASan, so libasan has
# to be preloaded, and libstdc++ with it: python does not link libstdc++, and
# without it ASan's __cxa_throw interceptor finds no real __cxa_throw and
# aborts on the first C++ exception ("CHECK failed: asan_interceptors.cpp").
# detect_leaks=0: CPython's own allocations would be reported as leaks.
#
# Usage: dev/sanitize.sh [address] [thread] [--python] [-- pytest args]
# (no sanitizer named: both).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
sanitizers=()
run_python=0
pytest_args=()
while (($#)); do
  case "$1" in
    address | thread) sanitizers+=("$1") ;;
    --python) run_python=1 ;;
    --)
      shift
      pytest_args=("$@")
      break
      ;;
    *)
      echo "usage: $0 [address] [thread] [--python] [-- pytest args]" >&2
      exit 2
      ;;
  esac
  shift
done
((${#sanitizers[@]})) || sanitizers=(address thread)
((${#pytest_args[@]})) || pytest_args=(tests/test_core.py -q)

# Any report is fatal; TSan exits 66 on a report, ASan/UBSan abort at once.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
pybind11_dir="$("$PYTHON" -c 'import pybind11; print(pybind11.get_cmake_dir())')"

configure() {  # configure <sanitizer> <build dir>
  cmake -S "$ROOT" -B "$2" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSHMVEC_SANITIZE="$1" -DSHMVEC_BUILD_TESTS=ON \
    -DPython_EXECUTABLE="$(command -v "$PYTHON")" -Dpybind11_DIR="$pybind11_dir" >/dev/null
}

for sanitizer in "${sanitizers[@]}"; do
  case "$sanitizer" in
    address) build="$ROOT/build/asan" ;;
    thread) build="$ROOT/build/tsan" ;;
  esac
  echo "== $sanitizer: $build"
  configure "$sanitizer" "$build"
  cmake --build "$build" --target shmvec_core_test -j 2
  ctest --test-dir "$build" --output-on-failure
done

if ((run_python)); then
  build="$ROOT/build/asan"
  echo "== python tests against an ASan+UBSan shmvec._core: ${pytest_args[*]}"
  configure address "$build"
  cmake --build "$build" --target _core _worker_loop -j 2
  pkg="$build/pkg"
  rm -rf "$pkg"
  mkdir -p "$pkg/shmvec"
  cp "$ROOT"/shmvec/*.py "$pkg/shmvec/"
  cp "$build"/_core*.so "$build"/_worker_loop*.so "$pkg/shmvec/"
  cp -r "$ROOT/tests" "$pkg/tests"
  preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
  # From $pkg, `python -m pytest` imports $pkg/shmvec (the cwd comes first on
  # sys.path), not the editable install.
  (cd "$pkg" && LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 \
    "$PYTHON" -c 'import shmvec._core as c, sys; sys.exit(c.__file__.find("/pkg/shmvec/") < 0)' &&
    LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 \
      "$PYTHON" -m pytest -p no:cacheprovider "${pytest_args[@]}")
fi
echo "== sanitizers: no findings"
