#!/usr/bin/env bash
# Installs everything vramledger needs on a fresh Debian 12 machine (apt + a project venv);
# scripts/run_main.sh then installs the Python package; scripts/build.sh builds the C++ tree too.
# Idempotent: re-running skips what is already there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# clang and libclang-rt-14-dev (libFuzzer, the sanitizer runtimes) build the fuzz targets
# (scripts/fuzz.sh). Its long run also needs llvm (llvm-profdata, llvm-cov) for coverage.
APT_PKGS=(build-essential cmake ninja-build pkg-config libabsl-dev zlib1g-dev nlohmann-json3-dev
          libgtest-dev libgmock-dev libbenchmark-dev python3-venv clang libclang-rt-14-dev)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, pytest, numpy, matplotlib, scipy, scikit_build_core, pybind11, hypothesis" 2>/dev/null; then
  echo "setup: pip install -r requirements.txt (torch is large; first run takes minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
fi
