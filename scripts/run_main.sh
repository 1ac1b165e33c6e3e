#!/usr/bin/env bash
# README command one: installs everything, builds, and replays the bundled real trace
# (GPT-2-medium training on an H200, torch 2.11) through vramledger on the simulated H200:
# first with torch's own settings (the figures must match what torch's native allocator did),
# then with expandable segments and page recycling.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/setup.sh
./scripts/build.sh
TRACE="${1:-traces/trace-gpt2m-native.csv.gz}"
echo
echo "== vramledger replay $TRACE   (torch's native settings)"
.venv/bin/vramledger replay "$TRACE"
echo
echo "== vramledger replay $TRACE --conf expandable_segments:True"
.venv/bin/vramledger replay "$TRACE" --conf expandable_segments:True
