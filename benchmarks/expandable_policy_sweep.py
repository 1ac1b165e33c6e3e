#!/usr/bin/env python3
# Steady-state measurement for expandable segments: replays bundled training traces on the
# simulated H200 under several option strings and prints the expandable-segment figures side by side.
"""Replays bundled traces (default ``trace-gpt2m-native`` and ``trace-llama1b-native``; ``--trace``
names others, e.g. ``llama1b-ckpt`` or ``gpt2m-prefetch``) on SimBackend for each ``--conf``
(default: a small set of expandable-segment configurations) and prints one Markdown row per
configuration: utilization (peak allocated / peak reserved) per trace, modelled driver time as a
share of the trace's time span (overall, and after the first 25% of the events), driver calls in
the last three marked steps (memory calls in brackets), and page moves, the traces' figures
separated by " / " in the order given. Times are modelled (device/sim_cost_model.cc, H200
medians), not measured. ``--gpu-lag-us`` passes the replay's simulated GPU lag (microseconds).

    python benchmarks/expandable_policy_sweep.py [--binary build-exp/tools/vramledger-replay]
        [--trace gpt2m --trace llama1b-ckpt ...] [--gpu-lag-us 5000]
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
TRACES = ("gpt2m", "llama1b")  # traces/trace-NAME-native.csv.gz
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


def replay(binary: str, trace_path: str, conf: str, gpu_lag_us: int = 0) -> dict:
    """The replay's --json report for one trace under `conf` (VRAMLEDGER_CONF is not read), with
    the simulated GPU `gpu_lag_us` microseconds behind the host when nonzero."""
    lag = ["--gpu-lag-us", str(gpu_lag_us)] if gpu_lag_us else []
    out = subprocess.run([binary, trace_path, "--json", "--conf", conf, *lag],
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


def trace_file(name: str) -> str:
    """The bundled trace's file name for `name` (gpt2m, llama1b, llama1b-ckpt, gpt2m-prefetch);
    exits naming the bundled ones when there is no such trace."""
    file = f"trace-{name}-native.csv.gz"
    if not (ROOT / "traces" / file).is_file():
        known = sorted(p.name[len("trace-"):-len("-native.csv.gz")]
                       for p in (ROOT / "traces").glob("trace-*-native.csv.gz"))
        sys.exit(f"no bundled trace '{name}' (traces/{file}); bundled: {', '.join(known)}")
    return file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary")
    parser.add_argument("--conf", action="append")
    parser.add_argument("--trace", action="append",
                        help=f"a bundled trace's name, repeatable (default: {', '.join(TRACES)})")
    parser.add_argument("--gpu-lag-us", type=int, default=0,
                        help="simulated GPU lag behind the host, microseconds (default 0)")
    args = parser.parse_args()
    if args.gpu_lag_us < 0:
        parser.error("--gpu-lag-us must be 0 or more")
    names = args.trace or list(TRACES)
    files = [trace_file(n) for n in names]
    binary = find_binary(args.binary)
    tmp = tempfile.mkdtemp(prefix="vramledger-steps-")
    traces = [mark_steps(t, tmp) for t in files]
    who = " / ".join(names)
    print(f"| conf | util {who} | driver % span | steady % | calls in last 3 steps (memory calls) "
          f"| page moves |")
    print("|---|---|---|---|---|---|")
    for conf in args.conf or DEFAULT_CONFS:
        f = [figures(replay(binary, t, conf, args.gpu_lag_us)) for t in traces]

        def cell(fmt: str, key: str) -> str:
            return " / ".join(format(x[key], fmt) for x in f)

        print(f"| `{conf}` | {cell('.4f', 'util')} | {cell('.2f', 'pct')} "
              f"| {cell('.2f', 'steady_pct')} | {cell('d', 'last3')} ({cell('d', 'last3_mem')}) "
              f"| {cell('d', 'moves')} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
