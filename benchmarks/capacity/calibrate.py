"""The allowance under a cap (vramledger/_plan_allowance.py), computed from capacity trial records:
for each allocator, peak reserved / peak allocated of the largest size that trained in each
calibration row, the largest over the rows; and the planned peak's correction, measured / planned
peak allocated over every trial that trained in those rows, the largest. Only the rows in
_plan_allowance.CALIBRATION_ROWS calibrate; every other row evaluates.

  python -m benchmarks.capacity.calibrate [--resume FILE ...]   (default: the calibration records)
Prints the figures per row, the constants they give, and whether the planner's constants are
those; exit status 1 when they differ, 2 on a bad file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from benchmarks.capacity import planner, table
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class AtLimit:
    """One calibration row's allocator at its limit: the largest size that trained and its trial's
    figures."""
    workload: str
    cap_gib: float
    dim: str
    allocator: str
    size: int
    retries: int
    peak_reserved: int
    peak_allocated: int

    @property
    def ratio(self) -> float:
        return self.peak_reserved / self.peak_allocated


@dataclasses.dataclass
class Calibration:
    at_limit: list[AtLimit]
    allowance: dict[str, float]      # allocator -> largest ratio at the limit, rounded up
    corrections: list[tuple[str, float, str, str, int, float]]  # per trial that trained
    peak_correction: float           # the largest measured / planned, rounded up


def calibrate(results: Results, seq_step: int = 64) -> Calibration:
    """The cap model's constants from the calibration rows of `results`.

    Raises:
      ValueError: a calibration row or allocator without a found limit (the message names it).
    """
    from vramledger import _plan_allowance
    at_limit, corrections = [], []
    for workload, cap, dim in _plan_allowance.CALIBRATION_ROWS:
        for a in ALLOCATOR_ORDER:
            size = table.measured(results, workload, a, cap, dim, seq_step)
            if not size:
                raise ValueError(f"{workload} {dim} under {cap:g} GiB, {a}: no limit found in "
                                 f"the records; the calibration needs every calibration row")
            r = results.get(workload, a, cap, dim, size)
            at_limit.append(AtLimit(workload, cap, dim, a, size, r["retries"],
                                    r["peak_reserved"], r["peak_allocated"]))
            for s, fits in sorted(results.known(workload, a, cap, dim).items()):
                if fits:
                    t = results.get(workload, a, cap, dim, s)
                    planned = planner.planned_peak(workload, t["batch"], t["seq"])
                    corrections.append((workload, cap, dim, a, s, t["peak_allocated"] / planned))
    allowance = {a: _plan_allowance.round_up(max(x.ratio for x in at_limit if x.allocator == a))
                 for a in ALLOCATOR_ORDER}
    peak = _plan_allowance.round_up(max(c[-1] for c in corrections))
    return Calibration(at_limit, allowance, corrections, peak)


def report(c: Calibration) -> str:
    from vramledger import _plan_allowance as pa
    lines = ["| row | allocator | limit | retries in 6 steps | peak reserved / peak allocated |",
             "|---|---|---|---|---|"]
    for x in c.at_limit:
        lines.append(f"| {x.workload} {x.dim} {x.cap_gib:g} GiB | {table.NAMES[x.allocator]} | "
                     f"{x.size} | {x.retries} | {x.ratio:.4f} |")
    lines += ["", "| allocator | allowance under a cap | uncapped allowance |", "|---|---|---|"]
    lines += [f"| {table.NAMES[a]} | {c.allowance[a]:.4f} | {pa.UNCAPPED[a]:.4f} |"
              for a in ALLOCATOR_ORDER]
    ratios = [r for *_, r in c.corrections]
    lines += ["", f"measured / planned peak allocated over {len(ratios)} trials that trained: "
                  f"{min(ratios):.4f} to {max(ratios):.4f}; peak correction "
                  f"{c.peak_correction:.4f}"]
    return "\n".join(lines)


def brackets(results: Results, seq_step: int = 64) -> list[tuple]:
    """Per row with a found limit, calibration and evaluation alike: (workload, cap, dim,
    allocator, role, low, high) where the allocator's reserved / allocated need at its limit lies
    in (low, high], if it is one number per row: the size that trained bounds it from above (peak
    reserved / peak allocated), the next size, which did not, from below (cap / that size's peak
    allocated, as a trial of another allocator that trained at it measured; None when none did).
    A row whose limit's record kept no peaks (rebuilt from a run's log) has no bracket."""
    out = []
    for workload, cap, dim in sorted(results.groups()):
        for a in ALLOCATOR_ORDER:
            size = table.measured(results, workload, a, cap, dim, seq_step)
            if not size:
                continue
            r = results.get(workload, a, cap, dim, size)
            if "peak_reserved" not in r:
                continue
            failing = min(s for s, fits in results.known(workload, a, cap, dim).items()
                          if not fits)
            above = [t["peak_allocated"] for o in ALLOCATOR_ORDER
                     if (t := results.get(workload, o, cap, dim, failing)) and t.get("fits")
                     and "peak_allocated" in t]
            low = r["cap_bytes"] / max(above) if above else None
            out.append((workload, cap, dim, a, planner.role(workload, cap, dim), low,
                        r["peak_reserved"] / r["peak_allocated"]))
    return out


def matches_package(c: Calibration) -> bool:
    from vramledger import _plan_allowance as pa
    return c.allowance == pa.UNDER_A_CAP and c.peak_correction == pa.PEAK_CORRECTION


def main(argv=None) -> int:
    from vramledger import _plan_allowance as pa
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.calibrate",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resume", nargs="+", default=[os.path.join(ROOT, pa.CALIBRATION_RECORDS)])
    ap.add_argument("--seq-step", type=int, default=64)
    a = ap.parse_args(argv)
    results = Results()
    try:
        results.load(a.resume)
        c = calibrate(results, a.seq_step)
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--resume: {e}")
    print(report(c))
    print("\nWhere each row puts the allocator's need at its limit (not used by the calibration "
          "but for its rows):\n\n| row | allocator | role | need in |\n|---|---|---|---|")
    for workload, cap, dim, alloc, role, low, high in brackets(results, a.seq_step):
        print(f"| {workload} {dim} {cap:g} GiB | {table.NAMES[alloc]} | {role} | "
              f"({'?' if low is None else f'{low:.4f}'}, {high:.4f}] |")
    same = matches_package(c)
    print("the planner's constants (vramledger/_plan_allowance.py) are these" if same else
          f"the planner's constants differ: UNDER_A_CAP {pa.UNDER_A_CAP}, PEAK_CORRECTION "
          f"{pa.PEAK_CORRECTION}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
