"""The capacity benchmark's step rounds by machine: how far the machines whose rounds the pooled
interval resamples (step_rounds.interval) lie apart, and whether a verdict rests on one of them.

A run's machine (step_rounds.machine()) is its kernel boot id, or a label on records written before
trials recorded their host; tables name a boot id by its first 8 digits (short_machine()).
- machines_table() (`--by-machine`): each machine's own ratios (step_rounds.RATIOS), the geometric
  mean of its rounds' by the median and by the total. A machine's point estimates are not
  intervals: with a few rounds each they spread as far as the rounds' own noise takes them.
- one_machine_out_table() (`--by-machine`, after it): each verdict that changes when one
  machine's rounds are left out, with the interval without them. A verdict that none changes
  does not rest on any one machine; one that flips rests on that machine.
- without_machines() (`--without-machines`): takes the named machines' step-round runs out of the
  results, so that every step-round table reads as if they had not run.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Iterable

from benchmarks.capacity import step_rounds, table
from benchmarks.capacity.results import Results
from benchmarks.capacity.workloads import WORKLOADS


BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def short_machine(name: str | None) -> str:
    """A machine's name for a table: a kernel boot id's first 8 digits (the docs name machines
    so), a label as it is, "not recorded" for None."""
    if name is None:
        return "not recorded"
    return name[:8] if BOOT_ID.fullmatch(name) else name


def without_machines(results: Results, names: Iterable[str]) -> list[str]:
    """Takes out of `results` the step-round runs of the machines `names` name, to show whether a
    pooled verdict rests on one machine's rounds; returns those machines (machine()), in the
    order named. A name is a machine's label or the start of its kernel boot id (as the tables
    cut it), in any case; runs that name no machine cannot be named. ValueError where a name
    matches no machine or several."""
    machines = sorted({m for r in results.rounds.values()
                       if (m := step_rounds.machine(r)) is not None})
    chosen = []
    for name in names:
        hits = ([m for m in machines if m.lower() == name.lower()]  # a whole name wins
                or [m for m in machines if BOOT_ID.fullmatch(m) and m.startswith(name.lower())])
        if len(hits) != 1:
            raise ValueError(
                f"{name!r} names {'no machine' if not hits else f'{len(hits)} machines'} of the "
                f"step rounds; "
                + (f"give more of its boot id: {', '.join(hits)}" if hits else
                   f"they ran on {', '.join(short_machine(m) for m in machines) or 'none named'}"
                   " (runs that name no machine cannot be left out)"))
        if hits[0] not in chosen:
            chosen.append(hits[0])
    for k in [k for k, r in results.rounds.items() if step_rounds.machine(r) in chosen]:
        del results.rounds[k]
    return chosen


def geometric_mean(ratios: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in ratios))


def machines_table(results: Results, rows: Iterable[tuple[str, float, str]],
                   seq_step: int) -> str:
    """Per row, one line per machine (machine()) its paired rounds ran on, the most rounds
    first: the geometric mean of that machine's paired ratios (RATIOS), by each run's steady
    median and by the steady steps' total, and how many rounds each covers (by the median; the
    total leaves out a round whose run stopped short). The pooled interval resamples these
    machines; this says how far apart they lie, and whether a comparison's figure comes from
    most machines or a few. A machine's point estimates are not intervals: with a few rounds each
    they spread as far as the rounds' own noise takes them. Runs whose records name no machine
    share one line per card, though the interval counts each as a machine of its own. A row
    without vramledger runs at its size has no lines."""
    lines = ["| workload | cap GiB | dimension | size | machine | card | "
             + " | ".join(f"{table.NAMES[of]} / {table.NAMES[a]}"
                          for of, a in step_rounds.RATIOS) + " |",
             "|---" * (6 + len(step_rounds.RATIOS)) + "|"]
    for workload, cap, dim in rows:
        size, runs = step_rounds.row_runs(results, workload, cap, dim, seq_step)
        if not size or not runs["vramledger"]:
            continue
        # (machine, card) -> ratio pair -> each paired round's (by the median, by the total)
        by_machine: dict[tuple[str | None, str], dict[tuple[str, str],
                                                      list[tuple[float, float | None]]]] = {}
        for of, a in step_rounds.RATIOS:
            for k, on, by_median, by_total in step_rounds.round_ratios(runs, of, a):
                card = (runs[of][k].get("device") or "-").removeprefix("NVIDIA ")
                by_machine.setdefault((on, card), {}).setdefault((of, a), []).append(
                    (by_median, by_total))
        for on, card in sorted(by_machine, key=lambda m: (
                -max(map(len, by_machine[m].values())), m[0] is None, m[0] or "", m[1])):
            cells = []
            for pair in step_rounds.RATIOS:
                got = by_machine[on, card].get(pair, [])
                totals = [t for _, t in got if t is not None]
                cells.append("-" if not got else
                             f"{geometric_mean([x for x, _ in got]):.3f} / "
                             + (f"{geometric_mean(totals):.3f}" if totals else "-")
                             + f" ({len(got)})")
            lines.append(f"| {WORKLOADS[workload].title} | {cap:g} | {dim} | {size} | "
                         f"{short_machine(on)} | {card} | " + " | ".join(cells) + " |")
    if len(lines) == 2:
        return "No step rounds recorded at a size all three allocators fit."
    return "\n".join(lines)


def measures(runs: dict[str, dict[int, dict]], of: str,
             against: str) -> list[tuple[str, list[tuple[float, str | None]]]]:
    """The paired rounds' (ratio, machine) pairs of `of` over `against`, by each run's steady
    median and by the steady steps' total (a round whose run stopped short has no total)."""
    rounds = step_rounds.round_ratios(runs, of, against)
    return [("median", [(by_median, on) for _, on, by_median, _ in rounds]),
            ("total", [(by_total, on) for _, on, _, by_total in rounds if by_total is not None])]


def judged(pairs: list[tuple[float, str | None]]) -> tuple[str, str]:
    """A verdict, and it with its interval and rounds: "not above: 0.992 (0.972 - 1.015), 134
    rounds"."""
    bounds = step_rounds.interval([x for x, _ in pairs], machines=[on for _, on in pairs])
    says = step_rounds.verdict(bounds)
    return says, (f"{says}: {step_rounds.bounds_text(bounds)}, "
                  f"{len(pairs)} rounds")


def one_machine_out_table(results: Results, rows: Iterable[tuple[str, float, str]],
                          seq_step: int) -> str:
    """Each verdict on vramledger's step (by the median and by the total) that changes when the
    rounds of one named machine are left out, a line per such machine, after a count of the
    verdicts checked. A verdict is checked where leaving out some named machine keeps two rounds
    or more; a machine whose rounds are all but one of the comparison's is not left out (what
    remains could not make an interval)."""
    lines = ["| workload | cap GiB | dimension | size | ratio | measure | verdict, all machines "
             "| machine left out (its rounds) | verdict without it |", "|---" * 9 + "|"]
    checked = changed = 0
    for workload, cap, dim in rows:
        size, runs = step_rounds.row_runs(results, workload, cap, dim, seq_step)
        if not size or not runs["vramledger"]:
            continue
        for of, a in step_rounds.RATIOS:
            if of != "vramledger":  # torch's own two allocators' ratio has no verdict
                continue
            for measure, pairs in measures(runs, of, a):
                named = sorted({on for _, on in pairs if on is not None})
                out = {m: [(x, on) for x, on in pairs if on != m] for m in named}
                out = {m: rest for m, rest in out.items() if len(rest) >= 2}
                if not out:
                    continue
                checked += 1
                says, whole = judged(pairs)
                flips = [(m, rest, text) for m, rest in out.items()
                         for said, text in [judged(rest)] if said != says]
                changed += bool(flips)
                for m, rest, without in flips:
                    lines.append(
                        f"| {WORKLOADS[workload].title} | {cap:g} | {dim} | {size} | "
                        f"{table.NAMES[of]} / {table.NAMES[a]} | {measure} | {whole} | "
                        f"{short_machine(m)} ({len(pairs) - len(rest)}) | {without} |")
    if not checked:
        return ("No verdict to check: no row selected has rounds on a named machine beside two or "
                "more other rounds.")
    head = (f"{checked} verdict(s) checked; leaving out one machine's rounds changes "
            + (f"{changed} of them:" if changed else "none of them."))
    return head + ("\n\n" + "\n".join(lines) if changed else "")
