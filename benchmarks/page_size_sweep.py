#!/usr/bin/env python3
# Page-size measurement for expandable segments: replays every bundled trace on the simulated H200
# with torch-native options, expandable without recycling, and expandable at several page sizes.
"""Replays each trace in traces/ (``*.csv.gz``) on SimBackend under:

* ``torch-native``: vramledger's default options (torch's native allocator's behaviour);
* ``expandable_segments:True,page_recycling:False`` (default page size);
* ``expandable_segments:True,expandable_page_mb:N`` for N in --page-mb (default 2,4,8,10,20);

and prints one table per trace (utilization, peak reserved, driver calls by kind, modelled driver
time, its share of the trace's time span overall and after the first 25% of the events, page
moves) beside torch's own recorded figures, then writes the same as Markdown to --out.

Uses the ``vramledger._core`` module when it imports, else the ``vramledger-replay`` binary
(--binary, or build*/tools/vramledger-replay). VRAMLEDGER_CONF from the environment is ignored.
Times are modelled (device/sim_cost_model.cc, H200 medians), not measured.

    python benchmarks/page_size_sweep.py [--traces DIR] [--out FILE] [--page-mb 2,4,8,10,20]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import pathlib
import subprocess
import sys
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 1 << 30
# Driver calls shown in their own column, by CUDA API name; the rest add up under "other".
CALL_COLUMNS = (("cudaMalloc", "malloc"), ("cuMemCreate", "create"), ("cuMemMap", "map"),
                ("cuMemSetAccess", "set access"), ("cuMemUnmap", "unmap"),
                ("cuMemRelease", "release"))
HEADER = (["config", "utilization", "peak reserved (GiB)"] + [c[1] for c in CALL_COLUMNS]
          + ["other calls", "driver (ms)", "% of span", "steady calls", "steady (ms)",
             "steady % of its span", "page moves"])


def configs(page_mbs: list[int]) -> list[tuple[str, str]]:
    """(label, conf) pairs in table order."""
    out = [("torch-native", ""),
           ("expandable, no recycling (8 MiB)", "expandable_segments:True,page_recycling:False")]
    out += [(f"expandable, {mb} MiB pages", f"expandable_segments:True,expandable_page_mb:{mb}")
            for mb in page_mbs]
    return out


def core_replayer() -> Callable[[str, str], dict] | None:
    """replay(path, conf) through vramledger._core, or None when it does not import."""
    try:
        from vramledger import _core
    except ImportError:
        return None
    return lambda path, conf: _core.replay_file(path, conf, use_env=False)


def binary_replayer(binary: str | None) -> Callable[[str, str], dict]:
    """replay(path, conf) through the vramledger-replay binary."""
    candidates = ([binary] if binary else
                  sorted(glob.glob(str(ROOT / "build*/tools/vramledger-replay"))))
    found = [c for c in candidates if c and os.access(c, os.X_OK)]
    if not found:
        sys.exit("page_size_sweep: neither vramledger._core nor a vramledger-replay binary was "
                 "found (build first, or pass --binary)")
    env = {k: v for k, v in os.environ.items() if k != "VRAMLEDGER_CONF"}

    def replay(path: str, conf: str) -> dict:
        proc = subprocess.run([found[0], path, "--json", "--conf", conf], capture_output=True,
                              text=True, env=env, check=False)
        if proc.returncode != 0:
            sys.exit(f"page_size_sweep: {found[0]} failed on {path} ({conf}): {proc.stderr}")
        return json.loads(proc.stdout)
    return replay


def row(label: str, r: dict) -> list[str]:
    """One table row of a replay result."""
    calls = r["driver_calls"]
    shown = sum(calls.get(name, 0) for name, _ in CALL_COLUMNS)
    steady = r["steady_state"]
    return ([label, f"{r['utilization']:.4f}", f"{r['peak_reserved_bytes'] / GIB:.2f}"]
            + [f"{calls.get(name, 0):,}" for name, _ in CALL_COLUMNS]
            + [f"{sum(calls.values()) - shown:,}", f"{r['modeled_driver_us'] / 1000:.1f}",
               f"{r['driver_time_pct_of_span']:.3f}", f"{sum(steady['driver_calls'].values()):,}",
               f"{steady['modeled_driver_us'] / 1000:.1f}",
               f"{steady['driver_time_pct_of_span']:.3f}", f"{r['page_moves']:,}"])


def recorded_row(r: dict) -> list[str]:
    """torch's own figures from the trace: its segment events, priced with the same model."""
    return (["recorded (torch, from the trace)", f"{r['recorded_utilization']:.4f} (req.)",
             f"{r['recorded_peak_reserved_bytes'] / GIB:.2f}"]
            + ["" for _ in CALL_COLUMNS]
            + [f"{r['recorded_segment_allocs']:,} + {r['recorded_segment_frees']:,} seg. events",
               f"{r['recorded_modeled_driver_us'] / 1000:.1f}",
               f"{r['recorded_driver_time_pct_of_span']:.3f}", "", "", "", ""])


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |",
             "|" + "|".join("---" if i == 0 else "--:" for i in range(len(HEADER))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(HEADER, *rows)]
    fmt = lambda r: "  ".join(x.ljust(w) if i == 0 else x.rjust(w)  # noqa: E731
                              for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(HEADER)] + [fmt(r) for r in rows])


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        # The figures depend on the core and the simulated device only.
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                "allocator/core", "allocator/device"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return out + (", with uncommitted changes in allocator/core or allocator/device"
                      if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=str(ROOT / "traces"), help="directory of *.csv.gz")
    parser.add_argument("--out", default=str(ROOT / "docs/results/page-size-sweep.md"),
                        help="Markdown file to write ('' for none)")
    parser.add_argument("--page-mb", default="2,4,8,10,20",
                        help="comma-separated expandable_page_mb values (multiples of 2)")
    parser.add_argument("--binary", default=None, help="vramledger-replay to use instead of _core")
    args = parser.parse_args(argv)

    page_mbs = [int(x) for x in args.page_mb.split(",") if x.strip()]
    replay = (binary_replayer(args.binary) if args.binary else
              core_replayer() or binary_replayer(None))
    traces = sorted(glob.glob(os.path.join(args.traces, "*.csv.gz")))
    if not traces:
        sys.exit(f"page_size_sweep: no *.csv.gz in {args.traces}")

    sections = []
    for path in traces:
        rows, first = [], None
        for label, conf in configs(page_mbs):
            r = replay(path, conf)
            first = first or r
            rows.append(row(label, r))
        rows.append(recorded_row(first))
        name = os.path.basename(path)
        span = first["trace_span_us"]
        title = (f"{name}: {first['events']:,} alloc/free events, span {span / 1e6:.3f} s, "
                 f"peak requested {first['peak_requested_bytes'] / GIB:.2f} GiB")
        print(title)
        print(text_table(rows))
        print()
        sections.append(f"### {title}\n\n{markdown(rows)}\n")

    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            "# Expandable segments: page-size sweep\n\n"
            "Written by `benchmarks/page_size_sweep.py` "
            f"({datetime.date.today().isoformat()}, commit {git_commit()}). Every bundled trace "
            "replayed on the simulated H200 (SimBackend, capacity 139.80 GiB). Utilization is peak "
            "allocated / peak reserved (the recorded row: torch's peak requested / its peak "
            "reserved, from the trace's segment events). Driver times are modelled with the H200 "
            "medians of `device/sim_cost_model.cc` (a call over several mappings costs one "
            "per mapping), not measured; \"% of span\" is that time over the trace's own time "
            "span (last time_us - first); \"steady\" counts the calls after the first 25% of the "
            "events, over the span from there to the end. The recorded row prices torch's own "
            "segment events with the same model (segment_alloc = one cudaMalloc; torch's "
            "segment_map = cuMemCreate + cuMemMap + cuMemSetAccess per 20 MiB handle). "
            "Design and discussion: `docs/design/expandable-segments.md`.\n\n"
            + "\n".join(sections))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
