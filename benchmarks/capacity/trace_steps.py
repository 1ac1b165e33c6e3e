"""A traced capacity trial, step by step, from its snapshot alone (no GPU): what the program asked
for and what the allocator did to the device in each step.

The trace's `snapshot` entries end the steps (the traced trial takes one after each; trial.py). Per
step: the program's allocations and their largest, the live bytes at the step's peak (allocs less
free_requested, counted from the trace's first entry: a trace kept only in part, such as a
snapshot's last max_entries, starts from 0), the allocator's segment events (segment_alloc /
segment_free: whole segments; segment_map / segment_unmap: pages of an expandable segment,
vramledger's old mappings taken back and left behind included, so its record's cuMemMap / cuMemUnmap
counts say which made driver calls), the bytes they mapped and unmapped, any `oom` entry, and the
host time in runs of segment events: for each maximal run, from the entry before it to its last
entry (the allocator writes an entry after the call it records, so a run's time is its driver calls'
and the waits between them, plus the program's own time before its first; the access grant after a
run's maps, cuMemSetAccess, falls after its last entry and is left out).

  PYTHONPATH=torch_plugin/python python -m benchmarks.capacity.trace_steps TRACE.pickle.gz [--json]
Exit status 0; 2 with a message when the file cannot be read or holds no trace.
"""

from __future__ import annotations

import argparse
import json
import sys

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
GB = 1e9


def steps(trace: list[dict]) -> list[dict]:
    """Per step of `trace` (entries up to and including each `snapshot` entry; the entries after
    the last one, if any, as a last step marked unfinished), its figures."""
    out: list[dict] = []
    live = 0
    current = _new_step()
    prev_time = None
    run_start = None  # time of the entry before the current run of segment events
    for e in trace:
        action, size, t = e.get("action"), int(e.get("size", 0)), int(e.get("time_us", 0))
        if action == "alloc":
            live += size
            current["allocs"] += 1
            current["largest_alloc"] = max(current["largest_alloc"], size)
            current["peak_live"] = max(current["peak_live"], live)
        elif action == "free_requested":
            live -= size
        elif action == "oom":
            current["ooms"] += 1
        if action in SEGMENT_ACTIONS:
            current[action] += 1
            if action in ("segment_alloc", "segment_map"):
                current["mapped_bytes"] += size
            else:
                current["unmapped_bytes"] += size
            if run_start is None:
                run_start = prev_time if prev_time is not None else t
                current["runs"] += 1
            current["segment_run_us"] += t - run_start
            run_start = t
        else:
            run_start = None
        prev_time = t
        if action == "snapshot":
            out.append(current)
            current = _new_step()
            current["peak_live"] = live
    if any(current[k] for k in ("allocs", "ooms", *SEGMENT_ACTIONS)):
        current["unfinished"] = True
        out.append(current)
    return out


def _new_step() -> dict:
    return {"allocs": 0, "largest_alloc": 0, "peak_live": 0, "ooms": 0,
            **{a: 0 for a in SEGMENT_ACTIONS}, "mapped_bytes": 0, "unmapped_bytes": 0,
            "runs": 0, "segment_run_us": 0}


def table(rows: list[dict]) -> str:
    lines = ["| step | allocs | largest alloc GB | peak live GB | segment alloc / free / map / "
             "unmap | mapped / unmapped GB | runs of segment events, ms | oom |",
             "|---" * 8 + "|"]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i}{' (unfinished)' if r.get('unfinished') else ''} | {r['allocs']} | "
            f"{r['largest_alloc'] / GB:.2f} | {r['peak_live'] / GB:.2f} | "
            + " / ".join(str(r[a]) for a in SEGMENT_ACTIONS)
            + f" | {r['mapped_bytes'] / GB:.2f} / {r['unmapped_bytes'] / GB:.2f} | "
            f"{r['runs']}, {r['segment_run_us'] / 1e3:.1f} | {r['ooms']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.trace_steps",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("trace", metavar="TRACE", help="a snapshot with its trace (.pickle[.gz])")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args(argv)
    from vramledger._snapshot import SnapshotFormatError, load_snapshot

    try:
        snapshot = load_snapshot(a.trace)
    except (OSError, SnapshotFormatError) as e:
        print(f"trace_steps: error: {e}", file=sys.stderr)
        return 2
    traces = snapshot.get("device_traces") or []
    if not 0 <= a.device < len(traces) or not traces[a.device]:
        print(f"trace_steps: error: {a.trace} holds no trace for device {a.device} (record "
              "with record_memory_history('all'))", file=sys.stderr)
        return 2
    rows = steps(traces[a.device])
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(table(rows))
    if all(r.get("unfinished") for r in rows):
        print(f"{a.trace} has no `snapshot` entry: its trace is one step, not a traced capacity "
              "trial's (which ends each step with one)")
    return 0


if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
