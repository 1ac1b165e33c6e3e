#!/usr/bin/env bash
# Builds the C++ tree (libraries, tests, benchmarks) in build-ci/ and installs the Python package
# into .venv from that same tree, so each source is compiled once. Run scripts/setup.sh first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The CMake options both steps give build-ci/: pip's step must configure the tree exactly as the
# first did, or it would rebuild it (pyproject.toml's own options are for a user's `pip install .`,
# which builds only the package, in build-py/).
# VRAMLEDGER_CHECKED_TESTS=OFF leaves out core_checked_test (scripts/test.sh, when its sanitizer
# phase runs that suite under ASan + UBSan instead).
OPTIONS=(-DVRAMLEDGER_BUILD_TESTS=ON -DVRAMLEDGER_BUILD_BENCHMARKS=ON -DVRAMLEDGER_WERROR=ON
         -DVRAMLEDGER_CHECKED_TESTS="${VRAMLEDGER_CHECKED_TESTS:-ON}")
start=$SECONDS
echo "== CMake build (build-ci/)"
cmake -S . -B build-ci -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${OPTIONS[@]}" \
  -DPython_EXECUTABLE="$ROOT/.venv/bin/python" >/dev/null
cmake --build build-ci -j"$(nproc)"
echo "== phase build-ci: $((SECONDS - start)) s"
start=$SECONDS
echo "== pip install --no-build-isolation . (into .venv, from build-ci/)"
.venv/bin/python -m pip install -q --no-build-isolation -C build-dir=build-ci \
  -C cmake.build-type=RelWithDebInfo -C cmake.args="$(IFS=';'; echo "${OPTIONS[*]}")" .
echo "== phase pip install: $((SECONDS - start)) s"
