"""The capacity benchmark's repeated step-time comparison. At the largest size all three
allocators fit (table.common_size), N rounds; each round runs the three allocators once, each in
its own process (trial.run_trial), in an order that rotates: round r starts with allocator r mod 3
of ALLOCATOR_ORDER, so a drift over the run (clocks, temperature, the host's other work) and
whatever one run leaves to the next fall on each allocator alike. The rounds always run all three
allocators, whatever --allocators says: the comparison is vramledger's against both torch ones.

The figures, per row:
- a run's step time is the median of its steady steps, those after the first two (the first two
  fill the cache; records hold six steps of varying length, the same lengths for every allocator);
- each allocator's figure is the median over rounds of its runs' step times;
- per round, the paired ratio is vramledger's step time over a torch allocator's in that round (the
  two ran minutes apart at most, so what drifts between rounds cancels);
- the point estimate is the geometric mean of the rounds' ratios, its 90% interval (interval()) the
  span of two: the 5th and 95th percentiles of that mean over RESAMPLES resamples of the rounds with
  replacement, from a seeded generator (the same records give the same interval), and Student's t
  interval over the same rounds. Where the rounds ran on more than one machine, each resample draws
  the machines with replacement and then each drawn machine's rounds, and the t interval is over the
  machines' means, each machine once, not over the rounds: a machine's rounds share whatever makes
  that machine fast or slow, and resampling rounds alone would count 18 rounds of three machines as
  18 independent machines. The t interval is there for the rows with few rounds: a bootstrap
  interval never reaches past the rounds' own range, so over 3 to 6 rounds it is narrower than the
  truth. The table gives the number of rounds beside the interval, and of machines where it counted
  them.
- the verdict on "vramledger's step time is not above the torch allocator's": "not above" when
  the interval's upper end is at most 1 + MARGIN, "above" when its lower end is above 1 + MARGIN,
  "undecided" between (more rounds narrow the interval). MARGIN is 2%: a tie must be able to pass
  (an upper end <= 1.0 rule passes a true tie at most half the time), and 2% lies well below the
  5-14% gaps the comparison has to resolve on these machines.
- each allocator's device allocations, frees, all-stream synchronizations and alloc retries per
  steady step, summed over its runs (trial.py's per-step counters; records written before those
  were recorded show "-"), and vramledger's driver time and waits (cudaEventSynchronize,
  cudaStreamSynchronize) with their time per steady step (trial.py; "-" for torch's allocators
  and older records);
- the card the runs ran on: a round's three runs share one machine; a round whose two runs name
  different cards, or different machines (kernel boots) where both records name theirs (records
  merged or joined from several machines' files under one round number), is not paired
  (same_machine()); and, where the records name them, on how many machines each card's runs ran
  (and how many of its runs name none).

A second table (steps_table()) gives the same ratio for each steady step on its own, with the
rounds in which vramledger's step was the slower: the steps have different lengths, and a step
slower in most rounds while the median ties says which kind of step to look into. Its last column
is the ratio of the steady steps' total time, with the same verdict: what the steady steps cost a
run, the steps the median leaves out (the fastest and the slowest of a run's four) included. A
third line per row gives torch expandable's ratio over torch native's the same way, without a
verdict: how far torch's own two allocators differ on the row.

benchmarks/capacity/machines.py reads the rounds by machine (`--by-machine`): each machine's own
ratios, and the verdicts that change when one machine's rounds are left out.

A run's machine (machine()) is its kernel boot id (trial.host_facts()); a record written before
trials recorded their host may carry a `machine` label instead, set from the log of the calls
that ran it; a run with neither counts as a machine of its own in the interval.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Iterable

import scipy.stats

from benchmarks.capacity import runner, search, table
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results
from benchmarks.capacity.workloads import LENGTH_FRACTIONS, WORKLOADS

WARM_STEPS = table.WARM_STEPS
# The paired ratios the tables give per row, (numerator, denominator): vramledger's over each
# torch allocator's, then torch expandable's over torch native's.
RATIOS = (("vramledger", "torch"), ("vramledger", "torch-expandable"),
          ("torch-expandable", "torch"))
MARGIN = 0.02
RESAMPLES = 10000
LEVEL = 0.90
SEED = 0


def order(round_: int) -> list[str]:
    """The allocators in the order round `round_` runs them."""
    k = round_ % len(ALLOCATOR_ORDER)
    return list(ALLOCATOR_ORDER[k:] + ALLOCATOR_ORDER[:k])


def run_rounds(groups: Iterable[tuple[str, float, str]], rounds: int, trial: runner.Trial,
               results: Results, budget: runner.Budget, *, seq_step: int = 64,
               trial_timeout_s: float = 240.0, log: Callable[[str], None] = print) -> None:
    """Runs rounds 0 .. rounds-1 of every group with a size all three fit, skipping the runs
    `results` already holds, each stored as it ends; stops where the budget ends."""
    for workload, cap, dim in groups if rounds > 0 else ():
        size = table.common_size(results, workload, cap, dim, ALLOCATOR_ORDER, seq_step)
        if not size:
            log(f"step rounds {workload} {cap:g} GiB {dim}: no size all three allocators fit yet")
            continue
        for r in range(rounds):
            for a in order(r):
                if results.get_round(workload, a, cap, dim, size, r) is not None:
                    continue
                if not budget.can_try():
                    log(f"step rounds: the budget ended before round {r} of {workload} "
                        f"{cap:g} GiB {dim}")
                    return
                try:
                    record = runner.run_one(trial, budget, workload, a, cap, dim, size,
                                            trial_timeout_s=trial_timeout_s, label=f"round {r}",
                                            log=log)
                except search.Stop:
                    return
                record["round"] = r
                results.add_round(record)


def steady_time(record: dict) -> float | None:
    """The median of a fitting run's steady steps; None when it did not fit or has none."""
    steps = record.get("step_s") or []
    if not record.get("fits") or len(steps) <= WARM_STEPS:
        return None
    return statistics.median(steps[WARM_STEPS:])


def interval(ratios: list[float], *, machines: list[str | None] | None = None,
             level: float = LEVEL, resamples: int = RESAMPLES,
             seed: int = SEED) -> tuple[float, float, float] | None:
    """(geometric mean over every round, low, high) of paired ratios: the smallest interval that
    spans two `level` intervals, bootstrap_interval()'s, of that geometric mean, and
    t_interval()'s, of the mean over rounds, or over machines where the rounds ran on several (the
    lower of their low ends, the higher of their high ends); None below two ratios.

    A bootstrap percentile interval never reaches past the units' own range, so with few rounds
    (or machines) it is narrower than the truth: over three rounds a 90% bootstrap interval holds
    the true ratio far less often than 90% of the time. Student's t interval widens as the units
    get fewer (its quantile over 3 rounds is 2.92 standard errors, over 30 rounds 1.70) and is
    exact where the log ratios are normal; with many rounds the two agree, and resampled by
    machine either can be the wider (the bootstrap counts a machine's own spread twice). Over
    machines the two estimate different means, one weighing rounds and one machines: they differ
    where the machines that ran more rounds lie apart from the rest, and the span holds both.
    """
    boot = bootstrap_interval(ratios, machines=machines, level=level, resamples=resamples,
                              seed=seed)
    return None if boot is None else span(boot, t_interval(ratios, machines=machines,
                                                           level=level))


def span(a: tuple[float, float, float],
         b: tuple[float, float, float]) -> tuple[float, float, float]:
    """The smallest interval spanning two: a's estimate, the lower low end, the higher high end."""
    return a[0], min(a[1], b[1]), max(a[2], b[2])


def log_groups(ratios: list[float],
               machines: list[str | None] | None) -> tuple[list[float], list[list[float]]]:
    """The ratios' logs and the logs grouped by machine (cluster_keys()); checks the input."""
    if any(not x > 0 for x in ratios):
        raise ValueError(f"ratios must be positive, got {ratios}")
    if machines is not None and len(machines) != len(ratios):
        raise ValueError(f"{len(machines)} machines for {len(ratios)} ratios")
    logs = [math.log(x) for x in ratios]
    groups: dict[object, list[float]] = {}
    for key, x in zip(cluster_keys(machines, len(logs)), logs):
        groups.setdefault(key, []).append(x)
    return logs, list(groups.values())


def bootstrap_interval(ratios: list[float], *, machines: list[str | None] | None = None,
                       level: float = LEVEL, resamples: int = RESAMPLES,
                       seed: int = SEED) -> tuple[float, float, float] | None:
    """(geometric mean, low, high) of paired ratios, the bounds the central `level` of the
    geometric mean over resamples; None below two ratios.

    Without `machines`, or where they name a single machine or a different one for every ratio,
    a resample draws the ratios with replacement. With `machines` (one per ratio; None for an
    unknown one, which counts as a machine of its own) naming several machines for some ratios, a
    resample draws as many machines as there are, with replacement, and then each drawn machine's
    ratios, as many as it has, with replacement; the mean is over every ratio drawn. Drawing at
    both stages counts a machine's own spread twice, so the interval errs wide, as a pooled
    in-process comparison's does (inprocess_stats); with two or three machines it is little more
    than their ratios' range.
    """
    if len(ratios) < 2:
        return None
    logs, machine_logs = log_groups(ratios, machines)
    rng = random.Random(seed)
    n = len(logs)
    if len(machine_logs) in (1, n):
        means = [math.fsum(rng.choices(logs, k=n)) / n for _ in range(resamples)]
    else:
        means = []
        for _ in range(resamples):
            drawn = [x for mine in rng.choices(machine_logs, k=len(machine_logs))
                     for x in rng.choices(mine, k=len(mine))]
            means.append(math.fsum(drawn) / len(drawn))
    means.sort()
    tail = (1 - level) / 2
    low = means[int(math.floor(tail * (resamples - 1)))]
    high = means[int(math.ceil((1 - tail) * (resamples - 1)))]
    return math.exp(math.fsum(logs) / n), math.exp(low), math.exp(high)


def t_interval(ratios: list[float], *, machines: list[str | None] | None = None,
               level: float = LEVEL) -> tuple[float, float, float] | None:
    """(estimate, low, high) from Student's t over the mean of the ratios' logs; None below two
    ratios. On one machine, over the rounds (n - 1 degrees of freedom), the estimate their
    geometric mean; on several, over the machines: each machine's mean log ratio counts once, and
    the estimate and interval are those of the mean of those G means (G - 1 degrees of freedom).
    Where every machine has as many rounds, this is the cluster-robust interval of the rounds'
    mean (its error with the small-sample factor G / (G - 1)); where one machine has most of the
    rounds, that error is small because the mean sits on that machine's rounds, and the interval
    holds the true ratio far less often than it says (coverage.py, --machine-rounds), while the
    machines' means do not lean on it."""
    if len(ratios) < 2:
        return None
    logs, machine_logs = log_groups(ratios, machines)
    values = logs if len(machine_logs) == 1 else [math.fsum(m) / len(m) for m in machine_logs]
    centre = math.fsum(values) / len(values)
    error = statistics.stdev(values) / math.sqrt(len(values))
    half = scipy.stats.t.ppf((1 + level) / 2, len(values) - 1) * error
    return math.exp(centre), math.exp(centre - half), math.exp(centre + half)


def cluster_keys(machines: list[str | None] | None, n: int) -> list[object]:
    """The key interval() groups each of n ratios by: its machine, or the ratio's own where the
    machine is unknown (or no machines are given)."""
    return [machines[i] if machines and machines[i] is not None else ("round", i)
            for i in range(n)]


def machines_note(machines: list[str | None]) -> str:
    """", K machines" (", K machines (U unknown)") when interval() resamples these ratios by
    machine, else ""."""
    k = len(set(cluster_keys(machines, len(machines))))
    if k in (1, len(machines)):
        return ""
    unknown = sum(m is None for m in machines)
    return f", {k} machines" + (f" ({unknown} unknown)" if unknown else "")


def bounds_text(bounds: tuple[float, float, float], form: str = "{} ({} - {})") -> str:
    """The geometric mean and its interval, to three decimals; an end that rounds to the verdict's
    limit (1 + MARGIN) to four, so the text says on which side of it the end lies."""
    limit = 1 + MARGIN

    def text(x: float) -> str:
        return f"{x:.4f}" if f"{x:.3f}" == f"{limit:.3f}" and x != limit else f"{x:.3f}"

    return form.format(f"{bounds[0]:.3f}", text(bounds[1]), text(bounds[2]))


def verdict(bounds: tuple[float, float, float] | None) -> str:
    if bounds is None:
        return "too few rounds"
    _, low, high = bounds
    if high <= 1 + MARGIN:
        return "not above"
    return "above" if low > 1 + MARGIN else "undecided"


def machine(record: dict) -> str | None:
    """The machine a run ran on: its kernel boot id, else the `machine` label of a record written
    before trials recorded their host; None when the record names neither."""
    return (record.get("host") or {}).get("boot_id") or record.get("machine") or None


def same_machine(a: dict, b: dict) -> bool:
    """Whether two runs of a round may be paired: on one card, and on one machine where both
    records name theirs (a round whose runs were resumed or joined from elsewhere may hold runs of
    several)."""
    machine_a, machine_b = machine(a), machine(b)
    return a.get("device") == b.get("device") and (
        not machine_a or not machine_b or machine_a == machine_b)


def cards(runs: list[dict]) -> str:
    """The GPUs `runs` ran on, without the vendor's name ("H200"; two names when a row's rounds
    came from two kinds of card: a ratio pairs a round's runs only when they name one card), each
    with the machines (machine()) its runs ran on where the records say: "H100 80GB HBM3 on 3
    machines and 2 runs of unknown machines, H200 (machines not recorded)"."""
    by_card: dict[str, list[str | None]] = {}  # each card's runs' machines
    for r in runs:
        if r.get("device"):
            by_card.setdefault(r["device"].removeprefix("NVIDIA "), []).append(machine(r))
    recorded = any(m is not None for group in by_card.values() for m in group)
    parts = []
    for name, group in sorted(by_card.items()):
        hosts = set(group) - {None}
        unknown = group.count(None)
        text = name
        if hosts:
            text += f" on {len(hosts)} machine{'s' if len(hosts) > 1 else ''}"
            if unknown:
                text += f" and {unknown} run{'s' if unknown > 1 else ''} of unknown machines"
        elif recorded:  # other cards' runs name theirs: say that these do not
            text += " (machines not recorded)"
        parts.append(text)
    return ", ".join(parts) or "-"


def row_runs(results: Results, workload: str, cap: float, dim: str,
             seq_step: int) -> tuple[int | None, dict[str, dict[int, dict]]]:
    """The row's common size and, per allocator, its step-round runs there by round."""
    size = table.common_size(results, workload, cap, dim, ALLOCATOR_ORDER, seq_step)
    return size, {a: {r["round"]: r for r in results.rounds.values()
                      if (r["workload"], r["allocator"], r["cap_gib"], r["dim"], r["size"])
                      == (workload, a, cap, dim, size)} for a in ALLOCATOR_ORDER}


def paired_rounds(runs: dict[str, dict[int, dict]], against: str,
                  of: str = "vramledger") -> list[tuple[int, str | None]]:
    """The rounds whose `of` run and `against` run both have a steady time (steady_time()) on one
    machine (same_machine()), each with that machine (machine(); None when unknown)."""
    mine, theirs = runs[of], runs[against]
    return [(k, machine(mine[k]) or machine(theirs[k])) for k in sorted(mine.keys() & theirs.keys())
            if steady_time(mine[k]) is not None and steady_time(theirs[k]) is not None
            and same_machine(mine[k], theirs[k])]


def ratio_cell(pairs: list[tuple[float, str | None]], judged: bool = False) -> str:
    """A steps-table cell of (ratio, machine) pairs: the geometric mean, its interval (interval(),
    by machine where the pairs ran on several) and in how many the ratio's numerator was the
    slower, then the verdict (verdict()) where `judged`; the one ratio of a single pair; "-"
    without any."""
    bounds = interval([x for x, _ in pairs], machines=[m for _, m in pairs])
    if not bounds:
        return f"{pairs[0][0]:.3f}, 1 round" if pairs else "-"
    slower = sum(x > 1 for x, _ in pairs)
    return (f"{bounds_text(bounds)}, slower in {slower} of "
            f"{len(pairs)}" + (f", {verdict(bounds)}" if judged else ""))


def total_ratio(mine: list[float], theirs: list[float]) -> float | None:
    """The ratio of two runs' steady steps' total time; None unless both ran every step."""
    if not len(mine) == len(theirs) == len(LENGTH_FRACTIONS):
        return None
    return sum(mine[WARM_STEPS:]) / sum(theirs[WARM_STEPS:])


def round_ratios(runs: dict[str, dict[int, dict]], of: str,
                 against: str) -> list[tuple[int, str | None, float, float | None]]:
    """Per paired round (paired_rounds()): its round, machine, and the ratio of `of` over `against`
    by each run's steady median and by the steady steps' total (None where a run stopped short)."""
    mine, theirs = runs[of], runs[against]
    return [(k, on, steady_time(mine[k]) / steady_time(theirs[k]),
             total_ratio(mine[k]["step_s"], theirs[k]["step_s"]))
            for k, on in paired_rounds(runs, against, of)]


def steps_table(results: Results, rows: Iterable[tuple[str, float, str]], seq_step: int) -> str:
    """Per row, each steady step's ratio over the paired rounds (paired_rounds()), then the ratio
    of the steady steps' total time (ratio_cell()): vramledger's over each torch allocator's, with
    the total's verdict, then torch expandable's over torch native's, without one (the target is
    vramledger's; that line says how far torch's two allocators differ on the row, the spread a
    vramledger ratio is read against). The steady median hides which steps differ; a step slower
    in most rounds points at what that step does (LENGTH_FRACTIONS: step 3, the shortest, comes
    right after the longest warm-up step, on the pools that step grew). The total is what the
    steady steps cost a run, every step counted: a run's median of four steps leaves out its
    fastest and its slowest step. A row without vramledger runs at its size has no lines."""
    fractions = LENGTH_FRACTIONS
    steady = range(WARM_STEPS, len(fractions))
    head = [f"step {i + 1} ({fractions[i]:.2g})" if fractions[i] % 1 else
            f"step {i + 1} ({fractions[i]:.1f})" for i in steady] + ["steady steps' total"]
    lines = ["| workload | cap GiB | dimension | size | ratio | " + " | ".join(head) + " |",
             "|---" * (5 + len(head)) + "|"]
    for workload, cap, dim in rows:
        size, runs = row_runs(results, workload, cap, dim, seq_step)
        if not size or not runs["vramledger"]:
            continue
        for of, a in RATIOS:
            keys = paired_rounds(runs, a, of)
            steps = [(runs[of][k]["step_s"], runs[a][k]["step_s"], on) for k, on in keys]
            cells = [ratio_cell([(mine[i] / theirs[i], on) for mine, theirs, on in steps
                                 if len(mine) > i and len(theirs) > i]) for i in steady]
            cells.append(ratio_cell([(x, on) for mine, theirs, on in steps
                                     if (x := total_ratio(mine, theirs)) is not None],
                                    judged=of == "vramledger"))
            lines.append(f"| {WORKLOADS[workload].title} | {cap:g} | {dim} | {size} | "
                         f"{table.NAMES[of]} / {table.NAMES[a]} | " + " | ".join(cells) + " |")
    if len(lines) == 2:
        return "No step rounds recorded at a size all three allocators fit."
    return "\n".join(lines)


def rounds_table(results: Results, rows: Iterable[tuple[str, float, str]], seq_step: int) -> str:
    """One line per row with step-round runs at its common size and allocator (the module's
    docstring says what each figure is)."""
    lines = ["| workload | cap GiB | dimension | size | allocator | rounds fit | steady step s "
             "by round | median steady step s | device allocs / frees / syncs / retries per "
             "steady step | vramledger / this (90% interval) | verdict | "
             f"{table.LEDGER_COLUMN} | card |",
             "|---" * 13 + "|"]
    for workload, cap, dim in rows:
        size, runs = row_runs(results, workload, cap, dim, seq_step)
        if not size or not any(runs.values()):
            continue
        times = {a: {k: steady_time(r) for k, r in by_round.items()}
                 for a, by_round in runs.items()}
        for a in ALLOCATOR_ORDER:
            mine = {k: t for k, t in times[a].items() if t is not None}
            by_round = " ".join(f"{mine[k]:.3f}" if k in mine else "-"
                                for k in sorted(times[a]))
            median = f"{statistics.median(list(mine.values())):.3f}" if mine else "-"
            ratio, says = "-", "-"
            if a != "vramledger":
                rounds = round_ratios(runs, "vramledger", a)
                paired = [by_median for _, _, by_median, _ in rounds]
                on = [m for _, m, _, _ in rounds]
                bounds = interval(paired, machines=on)
                if bounds:
                    ratio = (f"{bounds_text(bounds)} over "
                             f"{len(paired)} rounds{machines_note(on)}")
                elif paired:
                    ratio = f"{paired[0]:.3f} over 1 round"
                says = verdict(bounds)
            lines.append(f"| {WORKLOADS[workload].title} | {cap:g} | {dim} | {size} | "
                         f"{table.NAMES[a]} | {len(mine)} of {len(runs[a])} | {by_round or '-'} "
                         f"| {median} | {table.counters(list(runs[a].values()))} | {ratio} | "
                         f"{says} | {table.ledger(list(runs[a].values()))} | "
                         f"{cards(list(runs[a].values()))} |")
    if len(lines) == 2:
        return "No step rounds recorded at a size all three allocators fit."
    return "\n".join(lines)
