#!/usr/bin/env bash
# Builds the C++ tree (libraries, tests, benchmarks) in build-ci/ and installs the Python package
# (scikit-build-core, same CMake) into .venv. Run scripts/setup.sh first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
echo "== CMake build (build-ci/)"
cmake -S . -B build-ci -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$ROOT/.venv/bin/python" >/dev/null
cmake --build build-ci -j"$(nproc)"
echo "== pip install --no-build-isolation . (into .venv)"
.venv/bin/python -m pip install -q --no-build-isolation .
