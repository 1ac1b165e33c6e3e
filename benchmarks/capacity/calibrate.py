"""The allowance under a cap (vramledger/_plan_allowance.py), computed from capacity trial records:
for each allocator, peak reserved / peak allocated of the largest size that trained in each
calibration row, the largest over the rows; and the planned peak's correction, measured / planned
peak allocated over every trial that trained in those rows, the largest. Only the rows in
_plan_allowance.CALIBRATION_ROWS calibrate; every other row evaluates.

  python -m benchmarks.capacity.calibrate [--resume FILE ...]   (default: the calibration records)
Prints the figures per row, the constants they give, the covering allowance of each allocator
(the smallest under which plan --fit predicts no limit in the records too large, every row
counted: _plan_allowance.COVERING), and whether the planner's constants are those; exit status 1
when they differ, 2 on a bad file.

  python -m benchmarks.capacity.calibrate --scan ALLOCATOR [--factors LOW:HIGH:STEP]
Asks whether any one allowance would do: for each factor in the range (default 1.00:1.20:0.005),
plan --fit's error on every row of ALLOCATOR with a measured limit, calibration and evaluation
rows alike, with that factor in place of the allocator's allowance under a cap (the peak
correction unchanged); prints per factor the rows within 5% and the worst errors either way, then
the factor with the most rows within 5% and its error on each row. Exit status 0; 1 when the
records hold no limit of ALLOCATOR; 2 on a bad file or --factors.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from benchmarks.capacity import planner, table
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results
from benchmarks.capacity.workloads import WORKLOADS

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
    torch_by_kind: dict[str, float]  # torch native's per training kind (its workload), the same
    corrections: list[tuple[str, float, str, str, int, float]]  # per trial that trained
    peak_correction: float           # the largest measured / planned, rounded up
    left_out: list[tuple[str, float, str, str, str]]  # rows that calibrate nothing, and why


def calibrate(results: Results, seq_step: int = 64) -> Calibration:
    """The cap model's constants from the calibration rows of `results` (each allocator's:
    planner.calibration_rows()). A row whose limit is its first size, or whose limit's record
    kept no peaks (rebuilt from a run's log), calibrates nothing (`left_out`). The peak correction
    comes from _plan_allowance.CALIBRATION_ROWS alone, every allocator's trials there.

    Raises:
      ValueError: a calibration row without a found limit, or an allocator or torch native's
        training kind left with no row that calibrates (the message names it).
    """
    from vramledger import _plan_allowance
    at_limit, corrections, left_out = [], [], []
    for a in ALLOCATOR_ORDER:
        for workload, cap, dim in planner.calibration_rows(a):
            size = table.measured(results, workload, a, cap, dim, seq_step)
            if not size:
                raise ValueError(f"{workload} {dim} under {cap:g} GiB, {a}: no limit found in "
                                 f"the records; the calibration needs every calibration row")
            r = results.get(workload, a, cap, dim, size)
            if size == (1 if dim == "batch" else seq_step):
                left_out.append((workload, cap, dim, a, f"limit {size}, the first size: the cap "
                                 f"did not press it"))
            elif r.get("peak_reserved") is None or r.get("peak_allocated") is None:
                left_out.append((workload, cap, dim, a, f"limit {size}: its record kept no "
                                 f"peaks"))
            else:
                at_limit.append(AtLimit(workload, cap, dim, a, size, r["retries"],
                                        r["peak_reserved"], r["peak_allocated"]))
    for workload, cap, dim in _plan_allowance.CALIBRATION_ROWS:
        for a in ALLOCATOR_ORDER:
            for s, fits in sorted(results.known(workload, a, cap, dim).items()):
                if fits:
                    t = results.get(workload, a, cap, dim, s)
                    planned = planner.planned_peak(workload, t["batch"], t["seq"])
                    corrections.append((workload, cap, dim, a, s, t["peak_allocated"] / planned))

    def largest(rows: list[AtLimit], what: str) -> float:
        if not rows:
            raise ValueError(f"{what}: no calibration row with a limit above its first size and "
                             f"its peaks in the records")
        return _plan_allowance.round_up(max(x.ratio for x in rows))

    by_kind = {k.workload: largest([x for x in at_limit if x.allocator == "torch"
                                    and x.workload == k.workload], f"torch native, {k.title}")
               for k in _plan_allowance.TORCH_KINDS}
    allowance = {a: largest([x for x in at_limit if x.allocator == a], table.NAMES[a])
                 for a in ALLOCATOR_ORDER}
    peak = _plan_allowance.round_up(max(c[-1] for c in corrections))
    return Calibration(at_limit, allowance, by_kind, corrections, peak, left_out)


def report(c: Calibration) -> str:
    from vramledger import _plan_allowance as pa
    lines = ["| row | allocator | limit | retries in 6 steps | peak reserved / peak allocated |",
             "|---|---|---|---|---|"]
    for x in c.at_limit:
        lines.append(f"| {x.workload} {x.dim} {x.cap_gib:g} GiB | {table.NAMES[x.allocator]} | "
                     f"{x.size} | {x.retries} | {x.ratio:.4f} |")
    lines += [f"| {w} {dim} {cap:g} GiB | {table.NAMES[a]} | left out: {why} | - | - |"
              for w, cap, dim, a, why in c.left_out]
    lines += ["", "| allocator | allowance under a cap | uncapped allowance |", "|---|---|---|"]
    lines += [f"| {table.NAMES[a]} | {c.allowance[a]:.4f} | {pa.UNCAPPED[a]:.4f} |"
              for a in ALLOCATOR_ORDER]
    lines += ["", "| torch native's training kind | allowance under a cap |", "|---|---|"]
    lines += [f"| {k.title} ({k.workload}) | {c.torch_by_kind[k.workload]:.4f} |"
              for k in pa.TORCH_KINDS]
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
            out.append((workload, cap, dim, a, planner.role(workload, cap, dim, a), low,
                        r["peak_reserved"] / r["peak_allocated"]))
    return out


@dataclasses.dataclass
class ScanRow:
    """plan --fit's prediction on one row with one trial factor."""
    workload: str
    cap_gib: float
    dim: str
    measured: int
    predicted: int

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def scan(results: Results, allocator: str, factors: list[float],
         seq_step: int = 64) -> list[tuple[float, list[ScanRow]]]:
    """For each of `factors`, plan --fit on every row where `allocator` has a measured limit, with
    that factor as its allowance under a cap and the package's peak correction."""
    rows = limits(results, allocator, seq_step)
    return [(f, predict_rows(rows, allocator, f)) for f in factors]


Limit = tuple[str, float, str, int]  # workload, cap GiB, dimension, measured limit


def limits(results: Results, allocator: str, seq_step: int = 64) -> list[Limit]:
    """(workload, cap, dimension, measured limit) of every row where `allocator` has one."""
    return [(w, cap, dim, got) for w, cap, dim in sorted(results.groups())
            if (got := table.measured(results, w, allocator, cap, dim, seq_step))]


def predict_rows(rows: list[Limit], allocator: str, factor: float) -> list[ScanRow]:
    """plan --fit on `rows` (limits()) with `factor` as `allocator`'s allowance under a cap."""
    from vramledger import _plan_allowance as pa
    allowance = pa.Allowance("cap", allocator, factor, pa.PEAK_CORRECTION, "scan")
    return [ScanRow(w, cap, dim, got, planner.predict_with(w, cap, dim, allowance))
            for w, cap, dim, got in rows]


COVERING_BOUND = 1.5  # the largest covering allowance searched


def covering(results: Results, allocator: str, seq_step: int = 64) -> float | None:
    """The smallest allowance under a cap, on a 1e-4 grid, at which plan --fit predicts none of
    `allocator`'s measured limits too large (every row, the package's peak correction); None when
    the records hold no limit of it. A larger factor never predicts a larger size, so the
    search bisects.

    Raises:
      ValueError: even COVERING_BOUND over-predicts a row (the message names the allocator).
    """
    rows = limits(results, allocator, seq_step)
    if not rows:
        return None

    def covers(k: int) -> bool:
        return all(r.predicted <= r.measured for r in predict_rows(rows, allocator, k / 10**4))

    lo, hi = 10**4 - 1, round(COVERING_BOUND * 10**4)  # covers(hi); lo stands for "does not"
    if not covers(hi):
        raise ValueError(f"{table.NAMES[allocator]}: an allowance of {COVERING_BOUND:g} still "
                         f"over-predicts a measured limit")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if covers(mid) else (mid, hi)
    return hi / 10**4


MIN_STEP = 1e-4     # the table prints factors to 4 decimals
MAX_FACTORS = 1000  # each factor is a --fit search per row


def parse_factors(text: str) -> list[float]:
    """"LOW:HIGH:STEP" as the factors LOW, LOW + STEP, ... up to HIGH (inclusive).

    Raises:
      ValueError: not three finite numbers, LOW below 1 or above HIGH, STEP below MIN_STEP, or
        more than MAX_FACTORS factors (the message names --factors and what is wrong).
    """
    try:
        low, high, step = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--factors {text!r}: expected LOW:HIGH:STEP, e.g. 1.00:1.20:0.005")
    if not all(math.isfinite(x) for x in (low, high, step)):
        raise ValueError(f"--factors {text!r}: LOW, HIGH and STEP must be finite numbers")
    if low < 1 or low > high or step < MIN_STEP:
        raise ValueError(f"--factors {text!r}: needs 1 <= LOW <= HIGH and STEP >= {MIN_STEP:g}")
    n = int(math.floor((high - low) / step + 1e-9)) + 1
    if n > MAX_FACTORS:
        raise ValueError(f"--factors {text!r}: {n} factors; at most {MAX_FACTORS}")
    return [round(low + i * step, 6) for i in range(n)]


def _worst(errors: list[float], sign: int) -> str:
    """The largest error of one sign as a percentage, "-" when there is none of that sign."""
    of_sign = [e for e in errors if e * sign > 0]
    return f"{100 * max(of_sign, key=abs):+.1f}%" if of_sign else "-"


def scan_report(allocator: str, scanned: list[tuple[float, list[ScanRow]]]) -> str:
    """The scan's table per factor and the best factor's rows (scanned must have rows)."""
    n = len(scanned[0][1])
    lines = [f"{table.NAMES[allocator]}, one allowance under a cap for every row ({n} rows):", "",
             "| factor | rows within 5% | worst over | worst under |", "|---|---|---|---|"]
    for f, rows in scanned:
        errs = [r.error for r in rows]
        lines.append(f"| {f:.4f} | {sum(abs(e) <= 0.05 for e in errs)} | {_worst(errs, 1)} | "
                     f"{_worst(errs, -1)} |")
    best_f, best = max(scanned, key=lambda x: (sum(abs(r.error) <= 0.05 for r in x[1]),
                                               -max(abs(r.error) for r in x[1])))
    within = sum(abs(r.error) <= 0.05 for r in best)
    lines += ["", f"most rows within 5%: {within} of {n}, at {best_f:.4f}:", "",
              "| row | measured | plan --fit (error) |", "|---|---|---|"]
    lines += [f"| {WORKLOADS[r.workload].title} {r.dim} {r.cap_gib:g} GiB | {r.measured} | "
              f"{r.predicted} ({100 * r.error:+.1f}%) |" for r in best]
    return "\n".join(lines)


def matches_package(c: Calibration, covered: dict[str, float | None] | None = None) -> bool:
    """Whether the planner's constants are these (and its COVERING `covered`, when given)."""
    from vramledger import _plan_allowance as pa
    return (c.allowance == pa.UNDER_A_CAP and c.torch_by_kind == pa.TORCH_BY_KIND
            and c.peak_correction == pa.PEAK_CORRECTION
            and (covered is None or covered == pa.COVERING))


def main(argv=None) -> int:
    from vramledger import _plan_allowance as pa
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.calibrate",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resume", nargs="+", default=[os.path.join(ROOT, pa.CALIBRATION_RECORDS)])
    ap.add_argument("--seq-step", type=int, default=64)
    ap.add_argument("--scan", choices=ALLOCATOR_ORDER, default=None,
                    help="try one allowance under a cap for every row of this allocator")
    ap.add_argument("--factors", default=None,
                    help="with --scan: LOW:HIGH:STEP (default 1.00:1.20:0.005)")
    a = ap.parse_args(argv)
    factors = None
    if a.factors is not None and not a.scan:
        ap.error("--factors is for --scan")
    if a.scan:
        try:
            factors = parse_factors(a.factors or "1.00:1.20:0.005")
        except ValueError as e:
            ap.error(str(e))
    results = Results()
    try:
        results.load(a.resume)
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--resume: {e}")
    if a.scan:
        scanned = scan(results, a.scan, factors, a.seq_step)
        if not scanned[0][1]:
            print(f"calibrate: no row of {table.NAMES[a.scan]} has a measured limit in "
                  f"{', '.join(a.resume)}", file=sys.stderr)
            return 1
        print(scan_report(a.scan, scanned))
        return 0
    try:
        c = calibrate(results, a.seq_step)
    except (ValueError, KeyError, TypeError) as e:
        ap.error(f"--resume: {e}")
    print(report(c))
    try:
        covered = {x: covering(results, x, a.seq_step) for x in ALLOCATOR_ORDER}
    except ValueError as e:
        ap.error(f"--resume: {e}")
    print("\nThe allowance that covers every measured limit (plan --fit predicts none too large, "
          "every row; printed by --fit beside its answer):\n\n| allocator | covering | the "
          "planner's |\n|---|---|---|")
    for x in ALLOCATOR_ORDER:
        got = "-" if covered[x] is None else f"{covered[x]:.4f}"
        print(f"| {table.NAMES[x]} | {got} | {pa.COVERING[x]:.4f} |")
    print("\nWhere each row puts the allocator's need at its limit (not used by the calibration "
          "but for its rows):\n\n| row | allocator | role | need in |\n|---|---|---|---|")
    for workload, cap, dim, alloc, role, low, high in brackets(results, a.seq_step):
        print(f"| {workload} {dim} {cap:g} GiB | {table.NAMES[alloc]} | {role} | "
              f"({'?' if low is None else f'{low:.4f}'}, {high:.4f}] |")
    same = matches_package(c, covered)
    print("the planner's constants (vramledger/_plan_allowance.py) are these" if same else
          f"the planner's constants differ: UNDER_A_CAP {pa.UNDER_A_CAP}, TORCH_BY_KIND "
          f"{pa.TORCH_BY_KIND}, PEAK_CORRECTION "
          f"{pa.PEAK_CORRECTION}, COVERING {pa.COVERING}")
    return 0 if same else 1


if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
