"""`vramledger report DIR`: per-rank peaks of a job from its step logs, their spread, and the ranks
more than 5% above the median (a straggler holding more memory, or uneven sharding).

Reads the JSON-lines files vramledger.step() writes (<DIR>/vramledger-steps-rank<R>.jsonl, one
record per step and device; torch_plugin/runtime/guard_api.h). Pure Python, no torch.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics
from typing import Any

GIB = 1 << 30
FLAG_ABOVE_MEDIAN = 0.05  # a rank more than this fraction above the median is flagged
_RANK_IN_NAME = re.compile(r"rank(\d+)")


class ReportError(ValueError):
    """Unreadable or malformed logs (the message names the file and line)."""


def load_logs(directory: str) -> dict[int, list[dict[str, Any]]]:
    """Step records of every rank, by rank ("rank" of each record; else from the file name).

    Raises:
      ReportError: no logs in `directory`, a line that is not a JSON object, or a record without
        peak_allocated_bytes / peak_reserved_bytes.
    """
    if not os.path.exists(directory):
        raise ReportError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise ReportError(f"{directory}: not a directory")
    files = sorted(glob.glob(os.path.join(directory, "*.jsonl")))
    if not files:
        raise ReportError(f"{directory}: no step logs (*.jsonl, written by vramledger.step() "
                          "with the step_log option)")
    ranks: dict[int, list[dict[str, Any]]] = {}
    for path in files:
        m = _RANK_IN_NAME.search(os.path.basename(path))
        default_rank = int(m.group(1)) if m else None
        with open(path, encoding="utf-8", errors="replace") as f:  # bad bytes: not JSON
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ReportError(f"{path}:{number}: not JSON: {e}") from e
                if not isinstance(record, dict):
                    raise ReportError(f"{path}:{number}: expected a JSON object")
                for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
                    if key not in record:
                        raise ReportError(f"{path}:{number}: missing integer field '{key}'")
                for key in ("peak_allocated_bytes", "peak_reserved_bytes", "warnings", "step",
                            "device"):
                    value = record.get(key, 0)
                    if type(value) is not int or value < 0:  # bool is no count
                        raise ReportError(f"{path}:{number}: field '{key}' must be a "
                                          f"non-negative integer, got {value!r:.60}")
                rank = record.get("rank", default_rank)
                if rank is None:
                    raise ReportError(f"{path}:{number}: no rank (field 'rank' or rankN in the "
                                      "file name)")
                if type(rank) is not int or rank < 0:
                    raise ReportError(f"{path}:{number}: field 'rank' must be a non-negative "
                                      f"integer, got {rank!r:.60}")
                ranks.setdefault(rank, []).append(record)
    return ranks


def summarise(ranks: dict[int, list[dict[str, Any]]],
              threshold: float = FLAG_ABOVE_MEDIAN) -> dict[str, Any]:
    """Per-rank peaks (over steps and devices), medians, spread and flagged ranks."""
    rows = []
    for rank in sorted(ranks):
        records = ranks[rank]
        rows.append({
            "rank": rank,
            "steps": len({(r.get("device", 0), r.get("step", i)) for i, r in enumerate(records)}),
            "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in records),
            "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in records),
            "warnings": sum(int(r.get("warnings", 0)) for r in records),
        })
    out: dict[str, Any] = {"ranks": rows, "threshold": threshold}
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        values = [r[key] for r in rows]
        median = statistics.median(values)
        out[key] = {"median": median, "min": min(values), "max": max(values),
                    "spread": max(values) - min(values),
                    "spread_fraction": (max(values) - min(values)) / median if median else 0.0}
        for r in rows:
            above = (r[key] - median) / median if median else 0.0
            r[key.replace("_bytes", "_vs_median")] = above
            if above > threshold:
                r.setdefault("flags", []).append(key.replace("_bytes", ""))
    out["flagged_ranks"] = [r["rank"] for r in rows if r.get("flags")]
    return out


def format_report(directory: str, s: dict[str, Any]) -> str:
    def gib(n: float) -> str:
        return f"{n / GIB:.2f} GiB"

    n = len(s["ranks"])
    lines = [f"vramledger report of {directory}: {n} rank{'' if n == 1 else 's'}", "",
             f"  {'rank':>4} {'steps':>6} {'peak allocated':>16} {'vs median':>10} "
             f"{'peak reserved':>16} {'vs median':>10} {'warnings':>8}  flag"]
    for r in s["ranks"]:
        flag = f"> {s['threshold']:.0%} above the median ({', '.join(r['flags'])})" if r.get("flags") else ""
        lines.append(f"  {r['rank']:>4} {r['steps']:>6} {gib(r['peak_allocated_bytes']):>16} "
                     f"{r['peak_allocated_vs_median']:>+10.1%} {gib(r['peak_reserved_bytes']):>16} "
                     f"{r['peak_reserved_vs_median']:>+10.1%} {r['warnings']:>8}  {flag}".rstrip())
    lines.append("")
    for key, name in (("peak_allocated_bytes", "allocated"), ("peak_reserved_bytes", "reserved")):
        v = s[key]
        lines.append(f"  peak {name}: median {gib(v['median'])}, min {gib(v['min'])}, max "
                     f"{gib(v['max'])}, spread {gib(v['spread'])} ({v['spread_fraction']:.1%} of "
                     "the median)")
    warned = [r for r in s["ranks"] if r["warnings"]]
    if warned:
        lines.append(f"  guard warnings (the plan's warn_at crossed, at most one a step): "
                     f"{sum(r['warnings'] for r in warned)} in all, on rank(s) "
                     f"{', '.join(str(r['rank']) for r in warned)}")
    if s["flagged_ranks"]:
        lines.append(f"  flagged: rank(s) {', '.join(map(str, s['flagged_ranks']))} more than "
                     f"{s['threshold']:.0%} above the median")
    else:
        lines.append(f"  no rank is more than {s['threshold']:.0%} above the median")
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("dir", metavar="DIR", help="directory of vramledger-steps-rank*.jsonl logs")
    p.add_argument("--threshold", type=float, default=FLAG_ABOVE_MEDIAN,
                   help="flag ranks more than this fraction above the median (default 0.05)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--fail-on-flag", action="store_true",
                   help="exit with status 1 when a rank is flagged")


def run(args, cli_error: type[Exception]) -> int:
    """Runs `vramledger report`; errors become `cli_error`."""
    if not (math.isfinite(args.threshold) and args.threshold >= 0):
        raise cli_error(f"--threshold must be a non-negative fraction of the median (0.05: 5%), "
                        f"got {args.threshold}")
    try:
        summary = summarise(load_logs(args.dir), args.threshold)
    except (ReportError, OSError) as e:
        raise cli_error(str(e)) from e
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_report(args.dir, summary), end="")
    return 1 if args.fail_on_flag and summary["flagged_ranks"] else 0
