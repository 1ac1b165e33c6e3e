#!/usr/bin/env bash
# README command one: installs what the main job needs and replays the bundled real trace
# (GPT-2-medium training on an H200, torch 2.11) through vramledger on the simulated H200:
# first with torch's own settings (the figures must match what torch's native allocator did),
# then with expandable segments and page recycling.
# It builds only the Python package (pip builds _core, the torch plugin and the LD_PRELOAD shim
# with tests and benchmarks off, in build-py/), so each source is compiled once; the CMake tree
# with its tests is scripts/test.sh's job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/setup.sh
echo "== pip install --no-build-isolation . (into .venv; compiles the C++ part quietly: ~4 min)"
.venv/bin/python -m pip install -q --no-build-isolation .
TRACE="${1:-traces/trace-gpt2m-native.csv.gz}"
echo
echo "== vramledger replay $TRACE   (torch's native settings)"
.venv/bin/vramledger replay "$TRACE"
echo
echo "== vramledger replay $TRACE --conf expandable_segments:True"
.venv/bin/vramledger replay "$TRACE" --conf expandable_segments:True
