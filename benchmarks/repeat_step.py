#!/usr/bin/env python3
"""Does a repeated training step settle? Replays a trace whose one step is repeated.

A run at a fixed sequence length makes the same requests in every step, so an allocator that
settles maps and unmaps nothing once it has seen the step. This builds a trace from a bundled one:
its events up to step N, then step N's events R times more (a `snapshot` row, i.e. a step mark,
after the prefix and after each repetition), and replays it on SimBackend under each --conf,
printing each repetition's driver calls (cudaEvent* included: the fences of old mappings taken
back) and their modelled time, and peak reserved / peak allocated. Steps are found
as in expandable_policy_sweep.step_ends. Each repetition allocates at fresh addresses (shifted by
r << 44); frees of blocks made before step N are kept in its first run only; blocks step N leaves
live are freed after each repetition but the last, so every repetition starts from the same live
set. Recorded segment rows (torch's) are kept in the first run only. Times are modelled.

    python benchmarks/repeat_step.py [TRACE] [--step 6] [--repeats 5] [--conf S ...]
        [--gpu-lag-us N] [--binary build/tools/vramledger-replay]

TRACE: a bundled trace's name or a path (default trace-llama1b-ckpt-native.csv.gz). Exit status
2 on a bad argument or a trace without that step, 1 when a replay fails (e.g. a bad --conf).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from expandable_policy_sweep import ROOT, find_binary, step_ends  # noqa: E402

# Repetition r adds r << 44 to every address: 16 TiB apart, wider than any bundled trace's span
# of addresses (under 0.4 TiB), so no two repetitions share one; far below int64's limit.
SHIFT_BITS = 44


def repeat_step_trace(lines: list[str], step: int, repeats: int) -> list[str]:
    """The rows (header first) of a trace: `lines`' events up to and including step `step`
    (1-based), then that step's events `repeats` times more, each followed by a snapshot row.

    Raises ValueError when `lines` holds fewer than `step` steps, `repeats` < 1, or a row is not
    action,addr,size,stream,time_us (naming its line)."""
    if step < 1 or repeats < 1:
        raise ValueError(f"step ({step}) and repeats ({repeats}) must be at least 1")
    rows = []
    for n, line in enumerate(lines[1:], start=2):
        r = line.split(",")
        if len(r) == 5 and r[1][:2].lower() == "0x":  # hex addresses, as the replay reads them
            try:
                r[1] = str(int(r[1], 16))
            except ValueError:
                pass  # refused below
        if len(r) != 5 or not all(x.lstrip("-").isdigit() for x in r[1:]):
            raise ValueError(f"line {n}: not action,addr,size,stream,time_us: {line[:80]!r}")
        rows.append(r)
    ends = step_ends(rows)
    if len(ends) < step:
        raise ValueError(f"the trace holds {len(ends)} steps; step {step} asked for")
    start, end = ends[step - 2] if step > 1 else 0, ends[step - 1]
    window = rows[start:end]
    span = int(window[-1][4]) - int(window[0][4]) + 1000
    sizes = {r[1]: r[2] for r in window if r[0] == "alloc"}
    out = [lines[0]] + [",".join(r) for r in rows[:end]]
    out.append(f"snapshot,0,0,0,{rows[end - 1][4]}")
    for rep in range(1, repeats + 1):
        shift, live = rep << SHIFT_BITS, set()
        for action, addr, size, stream, t in window:
            t = str(int(t) + rep * span)
            if action == "alloc":
                live.add(addr)
            elif addr not in live:  # a block made before the step (freed in its first run only)
                continue            # or a recorded segment row (kept in the first run only)
            elif action == "free_completed":
                live.discard(addr)
            out.append(",".join((action, str(int(addr) + shift), size, stream, t)))
        t_end = int(window[-1][4]) + rep * span + 10
        if rep < repeats:
            for addr in sorted(live):  # the step's leftovers, so each run starts alike
                for action in ("free_requested", "free_completed"):
                    out.append(f"{action},{int(addr) + shift},{sizes[addr]},0,{t_end}")
        out.append(f"snapshot,0,0,0,{t_end}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default="trace-llama1b-ckpt-native.csv.gz")
    ap.add_argument("--step", type=int, default=6, help="the step to repeat (1-based)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--conf", action="append",
                    help="allocator options (default: expandable_segments:True)")
    ap.add_argument("--gpu-lag-us", type=int, default=0)
    ap.add_argument("--binary")
    a = ap.parse_args()
    path = a.trace if os.path.exists(a.trace) else str(ROOT / "traces" / a.trace)
    if not os.path.exists(path):
        ap.error(f"{a.trace}: no such trace")
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        lines = f.read().splitlines()
    try:
        rows = repeat_step_trace(lines, a.step, a.repeats)
    except ValueError as e:
        ap.error(f"{a.trace}: {e}")
    binary = find_binary(a.binary)
    with tempfile.TemporaryDirectory(prefix="vramledger-repeat-") as tmp:
        out = os.path.join(tmp, "repeat.csv")
        with open(out, "w") as f:
            f.write("\n".join(rows) + "\n")
        print(f"{os.path.basename(path)}: steps 1-{a.step}, then step {a.step} {a.repeats} "
              f"times more; GPU lag {a.gpu_lag_us} us")
        print("| conf | driver calls, steps 1-N | driver calls per repetition "
              "| modelled driver us per repetition | peak reserved / allocated |")
        print("|---|---|---|---|---|")
        for conf in a.conf or ["expandable_segments:True"]:
            proc = subprocess.run(
                [binary, out, "--json", "--conf", conf, "--gpu-lag-us", str(a.gpu_lag_us)],
                capture_output=True, text=True, env={})
            if proc.returncode != 0:
                print(f"replay failed under --conf {conf} (exit {proc.returncode}): "
                      f"{proc.stderr.strip()[:500]}", file=sys.stderr)
                return 1
            report = json.loads(proc.stdout)
            steps = report["utilization_at_each_step"]
            calls = ", ".join(str(s["driver_calls"]) for s in steps[1:])
            micros = ", ".join(f"{s['modeled_driver_us']:.0f}" for s in steps[1:])
            ratio = report["peak_reserved_bytes"] / report["peak_allocated_bytes"]
            print(f"| `{conf}` | {steps[0]['driver_calls']} | {calls} | {micros} | {ratio:.4f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
