#!/usr/bin/env python3
# Steady-state measurement for expandable segments: replays the two single-stream training traces on
# the simulated H200 under several option strings and prints the issue-3 figures side by side.
"""Replays ``trace-gpt2m-native`` and ``trace-llama1b-native`` on SimBackend for each ``--conf``
(default: a small set of expandable-segment configurations) and prints one Markdown row per
configuration: utilization (peak allocated / peak reserved) per trace, modelled driver time as a
share of the trace's time span (overall, and after the first 25% of the events), driver calls in
the last three marked steps, and page moves. Times are modelled (device/sim_cost_model.cc, H200
medians), not measured.

    python benchmarks/expandable_policy_sweep.py [--binary build-exp/tools/vramledger-replay]
        [--conf "expandable_segments:True" --conf "..."]
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import gzip
import os
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRACES = ("trace-gpt2m-native.csv.gz", "trace-llama1b-native.csv.gz")
DEFAULT_CONFS = (
    "expandable_segments:True,page_recycling:False",
    "expandable_segments:True",
)


def find_binary(given: str | None) -> str:
    """The replay binary: --binary, else the newest build*/tools/vramledger-replay."""
    if given:
        return given
    found = sorted(glob.glob(str(ROOT / "build*/tools/vramledger-replay")),
                   key=lambda p: pathlib.Path(p).stat().st_mtime)
    if not found:
        sys.exit("no vramledger-replay binary: build one or pass --binary")
    return found[-1]


def step_ends(rows: list[list[str]]) -> list[int]:
    """Indices one past the last event of each training step in `rows` (a trace's CSV fields,
    header excluded).

    The bundled traces carry no step marks. A step ends where live (requested) bytes fall back to
    their level at the end of the trace (weights, gradients and optimizer state) after having
    risen at least 1 GiB above it (the activations of the next forward pass)."""
    live, cur = [], 0
    for r in rows:
        cur += int(r[2]) if r[0] == "alloc" else -int(r[2]) if r[0] == "free_completed" else 0
        live.append(cur)
    base = live[-1] if live else 0
    ends, armed = [], False
    for i, level in enumerate(live):
        armed = armed or level > base + (1 << 30)
        if armed and level <= base + (64 << 20):
            ends.append(i + 1)
            armed = False
    return ends


def mark_steps(trace: str, out_dir: str) -> str:
    """A copy of `trace` (a bundled trace's name) with a `snapshot` row after each training step
    (step_ends); returns its path."""
    with gzip.open(ROOT / "traces" / trace, "rt") as f:
        lines = f.read().splitlines()
    rows = [line.split(",") for line in lines[1:]]
    ends = set(step_ends(rows))
    out = [lines[0]]
    for i, line in enumerate(lines[1:]):
        out.append(line)
        if i + 1 in ends:
            out.append("snapshot,0,0,0," + rows[i][4])
    path = os.path.join(out_dir, trace.replace(".csv.gz", "-steps.csv"))
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path


def replay(binary: str, trace_path: str, conf: str) -> dict:
    """The replay's --json report for one trace under `conf` (VRAMLEDGER_CONF is not read)."""
    out = subprocess.run([binary, trace_path, "--json", "--conf", conf],
                         check=True, capture_output=True, text=True, env={})
    return json.loads(out.stdout)


def figures(report: dict) -> dict:
    """Utilization, driver % of span (overall, steady), calls in the last 3 steps, page moves."""
    steps = [s for s in report.get("utilization_at_each_step", []) if s.get("complete", True)]
    steady = report.get("steady_state", {})
    return {
        "util": report["utilization"],
        "pct": report["driver_time_pct_of_span"],
        "steady_pct": steady.get("driver_time_pct_of_span", float("nan")),
        "last3": sum(s["driver_calls"] for s in steps[-3:]),
        "last3_mem": sum(s.get("memory_calls", 0) for s in steps[-3:]),  # cuMem*, cudaMalloc/Free
        "moves": report.get("page_moves", 0),
        "steps": len(steps),
        "calls": sum(report["driver_calls"].values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary")
    parser.add_argument("--conf", action="append")
    args = parser.parse_args()
    binary = find_binary(args.binary)
    tmp = tempfile.mkdtemp(prefix="vramledger-steps-")
    traces = [mark_steps(t, tmp) for t in TRACES]
    print("| conf | util gpt2 / llama | driver % span gpt2 / llama | steady % gpt2 / llama "
          "| calls in last 3 steps gpt2 / llama (memory calls) | page moves gpt2 / llama |")
    print("|---|---|---|---|---|---|")
    for conf in args.conf or DEFAULT_CONFS:
        f = [figures(replay(binary, t, conf)) for t in traces]
        print(f"| `{conf}` | {f[0]['util']:.4f} / {f[1]['util']:.4f} "
              f"| {f[0]['pct']:.2f} / {f[1]['pct']:.2f} "
              f"| {f[0]['steady_pct']:.2f} / {f[1]['steady_pct']:.2f} "
              f"| {f[0]['last3']} / {f[1]['last3']} ({f[0]['last3_mem']} / {f[1]['last3_mem']}) "
              f"| {f[0]['moves']} / {f[1]['moves']} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
