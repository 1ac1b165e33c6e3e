"""The step rounds' verdicts on vramledger's step time, one line per comparison, and the rows that
more rounds could decide.

- comparisons(): per row with a size all three allocators fit (table.common_size), vramledger's
  step over each torch allocator's there: the paired rounds (step_rounds.round_ratios; none where
  the row has no step rounds yet), the machines they ran on, and the interval and verdict (step_rounds.interval, step_rounds.verdict) by each run's
  steady median and by the steady steps' total.
- verdicts_table() (`python -m benchmarks.capacity --table-only --verdicts`): the counts of each
  verdict by each measure, then those comparisons in one short table; the rounds table and the
  steps table give the same figures among many others.
- wanted(): the rows with a comparison that is not yet decided, in the order new rounds on one new
  machine would do most: a machine counts once in the interval however many rounds it ran (the t
  interval is over the machines' means, the bootstrap resamples machines first), so a new machine
  narrows the interval most where fewest machines ran. Runs whose records name no machine count as
  one machine here (where the interval counts each as its own, three unnamed rounds of one call
  would look like three machines). A row the asking machine already ran comes last: its rounds
  there add to that machine's mean, not a machine.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from benchmarks.capacity import machines, step_rounds, table
from benchmarks.capacity.results import Results
from benchmarks.capacity.workloads import WORKLOADS

Bounds = tuple[float, float, float]
MEASURES = ("median", "total")
VERDICTS = ("not above", "undecided", "above", "too few rounds")


@dataclasses.dataclass
class Comparison:
    """vramledger's step over one torch allocator's on one row: per measure, the paired rounds'
    machines (step_rounds.machine(); None where a record names none) and the interval (None
    below two rounds; a row with no paired round has none)."""
    workload: str
    cap_gib: float
    dim: str
    size: int
    against: str
    machines: dict[str, tuple[str | None, ...]]  # measure -> each paired round's machine
    bounds: dict[str, Bounds | None]  # measure -> (estimate, low, high)

    def verdict(self, measure: str) -> str:
        """The verdict by `measure` (step_rounds.verdict(): "too few rounds" below two)."""
        return step_rounds.verdict(self.bounds[measure])

    @property
    def rounds(self) -> int:
        return len(self.machines["median"])

    def named_machines(self) -> set[str | None]:
        """The machines the rounds ran on, the runs that name none as one (None)."""
        return set(self.machines["median"])

    def decided(self) -> bool:
        """Whether both measures give "not above" or "above"."""
        return all(self.verdict(m) in ("not above", "above") for m in MEASURES)


def comparisons(results: Results, rows: Iterable[tuple[str, float, str]],
                seq_step: int) -> list[Comparison]:
    """Every comparison of vramledger's step with a torch allocator's on the rows given, in their
    order, where the row has a size all three allocators fit (table.common_size); a row without
    paired rounds there gives comparisons of no rounds."""
    found = []
    for workload, cap, dim in rows:
        size, runs = step_rounds.row_runs(results, workload, cap, dim, seq_step)
        if not size:
            continue
        for of, against in step_rounds.RATIOS:
            if of != "vramledger":  # torch's own two allocators' ratio has no verdict
                continue
            pairs = dict(machines.measures(runs, of, against))
            found.append(Comparison(
                workload, cap, dim, size, against,
                machines={m: tuple(on for _, on in p) for m, p in pairs.items()},
                bounds={m: step_rounds.interval([x for x, _ in p], machines=[on for _, on in p])
                        for m, p in pairs.items()}))
    return found


def counts(found: list[Comparison]) -> str:
    """"by the median: 16 not above, 16 undecided, 0 above; by the total: ... (32 comparisons)"."""
    parts = []
    for measure in MEASURES:
        n = collections.Counter(c.verdict(measure) for c in found)
        said = [f"{n[v]} {v}" for v in VERDICTS if v != "too few rounds" or n[v]]
        parts.append(f"by the {measure}: " + ", ".join(said))
    return "; ".join(parts) + f" ({len(found)} comparisons)"


def cell(c: Comparison, measure: str) -> str:
    """"undecided: 1.023 (0.967 - 1.074)": the verdict by `measure` with the geometric mean and its
    interval; "too few rounds (N)" below two."""
    bounds = c.bounds[measure]
    if bounds is None:
        return f"too few rounds ({len(c.machines[measure])})"
    return f"{c.verdict(measure)}: {step_rounds.bounds_text(bounds)}"


def rounds_text(c: Comparison) -> str:
    """"11 (2 machines)", "22 (1 machine; 6 not recorded)", "3 (not recorded)", "none": the paired
    rounds, the machines that ran them and the rounds whose records name none (the interval counts
    each of those as a machine of its own); a total over fewer rounds says so."""
    on = c.machines["median"]
    if not on:
        return "none"
    named = len(set(on) - {None})
    unknown = sum(m is None for m in on)
    parts = ([f"{named} machine{'s' if named > 1 else ''}"] if named else []) + (
        [f"{unknown} not recorded" if named else "not recorded"] if unknown else [])
    short = len(c.machines["total"])
    return (f"{c.rounds} ({'; '.join(parts)})"
            + (f"; {short} with a total" if short != c.rounds else ""))


def verdicts_table(found: list[Comparison]) -> str:
    """The counts (counts()), then a line per comparison: its rounds and machines and, by each
    measure, the verdict with the geometric mean and its 90% interval."""
    if not found:
        return "No step rounds recorded at a size all three allocators fit."
    said = counts(found)
    lines = [f"{said[0].upper()}{said[1:]}.", "",
             "| workload | cap GiB | dimension | size | vramledger against | rounds (machines) | "
             "by the median | by the total |", "|---" * 8 + "|"]
    for c in found:
        lines.append(f"| {WORKLOADS[c.workload].title} | {c.cap_gib:g} | {c.dim} | {c.size} | "
                     f"{table.NAMES[c.against]} | {rounds_text(c)} | {cell(c, 'median')} | "
                     f"{cell(c, 'total')} |")
    return "\n".join(lines)


@dataclasses.dataclass
class Wanted:
    """A row whose step rounds are wanted, and why: its comparisons not yet decided."""
    workload: str
    cap_gib: float
    dim: str
    size: int
    machines: int  # the fewest machines among those comparisons (unnamed runs as one)
    undecided: tuple[Comparison, ...]
    ran_here: bool  # the asking machine ran rounds of the row already

    def task(self) -> str:
        """The row as `conf_rounds run` takes it: WORKLOAD CAP_GIB DIM SIZE."""
        return f"{self.workload} {self.cap_gib:g} {self.dim} {self.size}"

    def reason(self) -> str:
        """The rounds of the comparison with the fewest machines (and rounds), then what is
        undecided: "rounds 11 (2 machines); undecided against torch native by the median and the
        total"."""
        fewest = min(self.undecided, key=lambda c: (len(c.named_machines()), c.rounds))
        said = []
        for c in self.undecided:
            how = [m for m in MEASURES if c.verdict(m) not in ("not above", "above")]
            said.append(f"{table.NAMES[c.against]} by the {' and the '.join(how)}")
        return (f"rounds {rounds_text(fewest)}; undecided against " + ", ".join(said)
                + ("; this machine ran it already" if self.ran_here else ""))


def wanted(found: list[Comparison], card_gib: float, machine: str | None = None) -> list[Wanted]:
    """The rows with a comparison not yet decided (undecided, or too few rounds, by either
    measure) whose cap fits a card of `card_gib` GiB, the fewest machines first (the module's
    docstring says why; a row without rounds first of all), then the most such comparisons; a row
    `machine` ran rounds of already (a kernel boot id, or its start as the tables print it) comes
    after every other."""
    by_row: dict[tuple[str, float, str, int], list[Comparison]] = {}
    for c in found:
        by_row.setdefault((c.workload, c.cap_gib, c.dim, c.size), []).append(c)
    rows = []
    for (workload, cap, dim, size), cs in by_row.items():
        open_ = tuple(c for c in cs if not c.decided())
        if not open_ or cap > card_gib:
            continue
        ran_here = bool(machine) and any(
            m is not None and m.lower().startswith(machine.lower())
            for c in cs for m in c.named_machines())
        rows.append(Wanted(workload, cap, dim, size,
                           min(len(c.named_machines()) for c in open_), open_, ran_here))
    order = list(WORKLOADS)
    return sorted(rows, key=lambda w: (w.ran_here, w.machines, -len(w.undecided),
                                       order.index(w.workload), w.cap_gib, w.dim))
