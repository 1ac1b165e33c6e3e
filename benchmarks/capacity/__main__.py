"""How much larger a batch or sequence trains under vramledger than under torch's allocators.

For each workload (GPT-2-medium, Llama-1B, Llama-1B with checkpointing, Llama-1B LoRA rank 16 with
checkpointing; random weights, bf16 autocast, AdamW), cap on reserved memory (each allocator's
per-process memory fraction) and allocator (torch native, torch expandable_segments:True,
vramledger's defaults), the largest micro-batch and, separately, the largest sequence length that
trains six steps of varying length without running out of memory, one process per trial. The
search assumes a size fits when any larger one does: it gallops from a guess (vramledger's from the
planner's prediction, `vramledger plan --fit`; the torch allocators' from vramledger's measured
limit) and bisects. Prints the largest sizes
beside the planner's (allowance under a cap) with its error and vramledger's gain over each torch
allocator; then plan --fit's error per row under both allowance models, uncapped and under a cap,
each row marked as one the cap model is calibrated on or one that evaluates it
(docs/design/memory-planner.md, "Two allowances"); then each allocator's retries per step and
median step time at the largest size all three fit. With --step-rounds N, after the searches,
N rounds at that size of the three allocators in rotating order, one process each, and per row
each one's steady step time and vramledger's ratio to each torch allocator with its 90% interval
over the rounds, then the same ratio for each steady step on its own
(benchmarks/capacity/step_rounds.py); with --table-only --by-machine, only those ratios on each
machine the rounds ran on, then the verdicts that change when one machine's rounds are left out
(benchmarks/capacity/machines.py); with --table-only --verdicts, only vramledger's step-time
verdicts: their counts by each measure, then a line per comparison
(benchmarks/capacity/verdicts.py; benchmarks/capacity/next_rounds.py runs the rounds that could
decide the undecided ones). With --traces DIR, last, traced trials at the largest size all three
fit and at vramledger's limit, written to DIR for study without a GPU
(benchmarks/capacity/traces.py). With --table-only, no trial runs: the tables of the --resume
files' rows that --workloads, --caps (any cap unless given) and --dims select; --without-machines
leaves out the step rounds of the machines it names (labels, or the start of a kernel boot id as
the tables print it), to show whether a pooled verdict rests on one machine's rounds, and says
which of them ran none of the rows selected (leaving those out changes nothing printed);
--unnamed-as-one counts the step-round runs whose records name no machine as one machine, where
the intervals otherwise count each as a machine of its own. --allocators, --step-rounds and
--traces pick trials, so --table-only refuses them.

  python -m benchmarks.capacity [--workloads ...] [--caps 24,80] [--allocators ...]
      [--dims batch,seq] [--budget-s 500] [--step-rounds 0] [--resume FILE ...] [--out FILE]
      [--traces DIR] [--trace-allocators vramledger]
      [--table-only [--by-machine | --verdicts] [--without-machines NAMES] [--unnamed-as-one]]
Filters and budget also come from CAPACITY_WORKLOADS, CAPACITY_CAPS, CAPACITY_ALLOCATORS,
CAPACITY_DIMS, CAPACITY_BUDGET_S, CAPACITY_STEP_ROUNDS, CAPACITY_TRACE_ALLOCATORS and
CAPACITY_RESUME (paths, space-separated). --out is rewritten after every trial with every record,
the resumed ones included, so the next run resumes from it (neither a search trial nor a round's
run recorded there runs again). Exit status 0 (also when the budget ended the run first), 1 when
the reader closes the output early (`| head`), 2 on a bad flag (also a --without-machines name
that matches no machine of the step rounds, or several).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os

from benchmarks.capacity import (machines, planner, runner, step_rounds, table, traces, trial,
                                 verdicts)
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results
from benchmarks.capacity.workloads import WORKLOADS

DIMS = ("batch", "seq")


def _list(text: str, allowed, what: str, parse=str) -> list:
    """The comma- or space-separated items of `text`; ValueError naming `what` for a bad one."""
    items = [x.strip() for x in text.replace(" ", ",").split(",") if x.strip()]
    try:
        values = [parse(x) for x in items]
    except ValueError:
        raise ValueError(f"{what}: expected numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what}: empty")
    bad = [x for x in values if allowed is not None and x not in allowed]
    if bad:
        raise ValueError(f"{what}: unknown {', '.join(map(str, bad))}; choose from "
                         f"{', '.join(map(str, allowed))}")
    if parse is float and any(not 0 < x <= 1e6 for x in values):
        raise ValueError(f"{what}: GiB above 0 and at most 1e6, got {text!r}")
    return values


def _count(text: str, what: str) -> int:
    """A whole number from 0 to 1000; ValueError naming `what` otherwise."""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{what}: expected a whole number, got {text!r}") from None
    if not 0 <= n <= 1000:
        raise ValueError(f"{what}: from 0 to 1000, got {n}")
    return n


def main(argv=None) -> int:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=env("CAPACITY_WORKLOADS", ",".join(WORKLOADS)))
    ap.add_argument("--caps", default=env("CAPACITY_CAPS"),
                    help="GiB (default 24,80; with --table-only, any)")
    ap.add_argument("--allocators", default=env("CAPACITY_ALLOCATORS", ",".join(ALLOCATOR_ORDER)))
    ap.add_argument("--dims", default=env("CAPACITY_DIMS", ",".join(DIMS)))
    ap.add_argument("--budget-s", type=float, default=float(env("CAPACITY_BUDGET_S", "500")))
    ap.add_argument("--step-rounds", default=env("CAPACITY_STEP_ROUNDS", "0"),
                    help="rounds of the step-time comparison per row (0: none)")
    ap.add_argument("--resume", nargs="*", default=(env("CAPACITY_RESUME") or "").split())
    ap.add_argument("--out", default="capacity-results.json")
    ap.add_argument("--seq-step", type=int, default=64, help="sequences searched N apart")
    ap.add_argument("--spread", type=float, default=0.05,
                    help="first stride from the planner's prediction, as a fraction of it")
    ap.add_argument("--trial-timeout-s", type=float, default=240.0)
    ap.add_argument("--traces", default=None, metavar="DIR",
                    help="last, traced trials at each row's common size and vramledger's limit")
    ap.add_argument("--trace-allocators", default=env("CAPACITY_TRACE_ALLOCATORS", "vramledger"))
    ap.add_argument("--table-only", action="store_true", help="print the tables of --resume")
    ap.add_argument("--by-machine", action="store_true",
                    help="with --table-only: print only the step rounds' ratios on each machine, "
                         "then the verdicts that change when one machine's rounds are left out, "
                         "of the rows --workloads, --caps and --dims select")
    ap.add_argument("--verdicts", action="store_true",
                    help="with --table-only: print only the verdicts on vramledger's step time, "
                         "their counts, then a line per comparison (benchmarks/capacity/"
                         "verdicts.py)")
    ap.add_argument("--unnamed-as-one", action="store_true",
                    help="with --table-only: count the step-round runs whose records name no "
                         "machine as one machine (the intervals count each as a machine of its "
                         "own)")
    ap.add_argument("--without-machines", default=None, metavar="NAMES",
                    help="with --table-only: leave out the step rounds of these machines "
                         "(comma-separated labels, or starts of kernel boot ids, as the "
                         "--by-machine table names them)")
    a = ap.parse_args(argv)
    try:
        workloads = _list(a.workloads, WORKLOADS, "--workloads (CAPACITY_WORKLOADS)")
        caps = _list("24,80" if a.caps is None else a.caps, None, "--caps (CAPACITY_CAPS)", float)
        without = (None if a.without_machines is None else
                   _list(a.without_machines, None, "--without-machines", str))
        allocators = _list(a.allocators, ALLOCATOR_ORDER, "--allocators (CAPACITY_ALLOCATORS)")
        dims = _list(a.dims, DIMS, "--dims (CAPACITY_DIMS)")
        rounds = _count(a.step_rounds, "--step-rounds (CAPACITY_STEP_ROUNDS)")
        traced = _list(a.trace_allocators, ALLOCATOR_ORDER,
                       "--trace-allocators (CAPACITY_TRACE_ALLOCATORS)")
    except ValueError as e:
        ap.error(str(e))
    if a.by_machine and a.verdicts:
        ap.error("--by-machine and --verdicts each print their own tables: name one")
    for flag, given in (("--by-machine", a.by_machine), ("--verdicts", a.verdicts),
                        ("--without-machines", without),
                        ("--unnamed-as-one", a.unnamed_as_one)):
        if given and not a.table_only:
            ap.error(f"{flag} prints a table of --resume: it needs --table-only")
    # Trials' flags: --table-only runs none, and its tables show every allocator the files hold.
    for flag, given in (("--allocators", set(allocators) != set(ALLOCATOR_ORDER)),
                        ("--step-rounds", rounds), ("--traces", a.traces)):
        if given and a.table_only:
            ap.error(f"{flag} picks what trials run; --table-only runs none and prints every "
                     "allocator the --resume files hold: leave it out")
    if a.table_only and not a.resume:
        ap.error("--table-only prints the tables of the --resume files (CAPACITY_RESUME): name "
                 "one or more")
    if importlib.util.find_spec("vramledger") is None:  # the planner's columns need it
        ap.error("the vramledger package cannot be imported: run the README's set-up and use its "
                 ".venv, or, in a checkout, set PYTHONPATH=torch_plugin/python")
    results = Results(None if a.table_only else a.out)
    try:
        read = results.load(a.resume)
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--resume (CAPACITY_RESUME): {e}")
    print(f"resumed {read} trial(s) and {len(results.rounds)} step-round run(s) from "
          f"{' '.join(a.resume)}" if a.resume else "no results to resume from", flush=True)
    if a.unnamed_as_one:
        unnamed = [r for r in results.rounds.values() if step_rounds.machine(r) is None]
        for r in unnamed:
            r["machine"] = UNNAMED
        print(f"counted the {len(unnamed)} step-round run(s) that name no machine as one machine, "
              f"{UNNAMED!r}", flush=True)
    removed: dict[str, set] = {}  # each machine left out, in the order named: its runs' rows
    if without:
        held_runs = list(results.rounds.values())
        try:
            left_out = machines.without_machines(results, without)
        except ValueError as e:
            ap.error(f"--without-machines: {e}")
        removed = {m: {(r["workload"], r["cap_gib"], r["dim"]) for r in held_runs
                       if step_rounds.machine(r) == m} for m in left_out}
        print(f"left out the step rounds of {', '.join(map(machines.short_machine, left_out))}; "
              f"{len(results.rounds)} step-round run(s) remain", flush=True)
    if a.traces:
        try:  # a folder that cannot hold or read the traces fails before any trial runs
            os.makedirs(a.traces, exist_ok=True)
            traces.load_index(a.traces)
        except (OSError, ValueError) as e:
            ap.error(f"--traces: {e}")
    groups = [(w, c, d) for d in dims for w in workloads for c in caps]
    if a.table_only:  # the rows with search trials the filters select (any cap unless given)
        held = results.groups()
        groups = [g for g in held if g[0] in workloads and g[2] in dims
                  and (a.caps is None or g[1] in caps)]
        if not groups:
            cap_text = "any" if a.caps is None else ", ".join(f"{c:g}" for c in caps)
            print(f"No search trials of the rows selected (workloads {', '.join(workloads)}; caps "
                  f"{cap_text}; dimensions {', '.join(dims)}); step rounds are read at the size "
                  f"the searches found. The trials hold workloads "
                  f"{', '.join(sorted({w for w, _, _ in held})) or 'none'}; caps "
                  f"{', '.join(f'{c:g}' for c in sorted({c for _, c, _ in held})) or 'none'}.")
            return 0
        idle = [m for m in removed if not removed[m] & set(groups)]
        if idle:
            print(f"{', '.join(map(machines.short_machine, idle))} ran no step rounds of "
                  f"the rows selected: leaving "
                  f"{'it' if len(idle) == 1 else 'them'} out changes none of these tables",
                  flush=True)
    if a.by_machine:
        print("Each machine's step-round ratios at the largest size all three fit: the geometric "
              "mean of its rounds' ratios by each run's steady median / by the steady steps' "
              "total (rounds):\n")
        rows = sorted(groups, key=table.row_order)
        print(machines.machines_table(results, rows, a.seq_step))
        print("\nThe verdicts on vramledger's step that change when one machine's rounds are left "
              "out, only those (the interval resamples the rest as the pooled one does):\n")
        print(machines.one_machine_out_table(results, rows, a.seq_step))
        return 0
    if a.verdicts:
        print("\nvramledger's step time over torch's at the largest size all three fit, by each "
              "run's steady median and by the steady steps' total: the verdict, the geometric "
              "mean of the rounds' ratios and its 90% interval (verdicts as the rounds table "
              "says); "
              + ("the rounds whose records name no machine count as one machine here:\n"
                 if a.unnamed_as_one else
                 "rounds whose records name no machine are \"not recorded\", and the interval "
                 "counts each of them as a machine of its own:\n"))
        rows = sorted(groups, key=table.row_order)
        print(verdicts.verdicts_table(verdicts.comparisons(results, rows, a.seq_step)))
        return 0
    if not a.table_only:
        results.save()
        budget = runner.Budget(a.budget_s)
        runner.run_grid(groups, allocators, trial.run_trial, results, budget, planner.predict,
                        seq_step=a.seq_step, spread=a.spread, trial_timeout_s=a.trial_timeout_s,
                        log=lambda m: print(m, flush=True))
        step_rounds.run_rounds(groups, rounds, trial.run_trial, results, budget,
                               seq_step=a.seq_step, trial_timeout_s=a.trial_timeout_s,
                               log=lambda m: print(m, flush=True))
        if a.traces:
            n = traces.record_traces(groups, traced, trial.run_trial, results, budget, a.traces,
                                     seq_step=a.seq_step, trial_timeout_s=a.trial_timeout_s,
                                     log=lambda m: print(m, flush=True))
            print(f"took {n} trace(s) into {a.traces}", flush=True)
    print(report(results, groups, a.seq_step, only=a.table_only))
    return 0


UNNAMED = "unnamed"  # --unnamed-as-one's machine


def report(results: Results, groups, seq_step: int, only: bool = False) -> str:
    """Both tables over the groups asked for and, unless `only`, every group with records."""
    every = sorted(set(groups) | (set() if only else results.groups()), key=table.row_order)
    rows = list(dict.fromkeys((w, c) for w, c, _ in every))
    searched_on = sorted({f"{r.get('device')}, torch {r.get('torch')}"
                          for r in results.records.values() if r.get("device")})
    rounds_on = collections.Counter(f"{r.get('device')}, torch {r.get('torch')}"
                                    for r in results.rounds.values() if r.get("device"))
    rounds_text = "; ".join(f"{k}: {n} run{'s' if n > 1 else ''}"
                            for k, n in sorted(rounds_on.items()))
    models = {"uncapped allowance": planner.predict_uncapped,
              "allowance under a cap": planner.predict}
    return ("\n" + f"capacity searches ({'; '.join(searched_on) or 'no trial ran'}); step rounds "
            f"({rounds_text or 'none'}); planner, with the allowance under a cap: "
            f"{planner.COMMAND}\n\n"
            + table.capacity_table(results, rows, planner.predict, seq_step) + "\n"
            f"Sequences are searched {seq_step} apart: the limit lies below the next multiple; the "
            f"error is (planned - measured) / measured.\n\n"
            "plan --fit's error by allowance model (the allowance under a cap is calibrated on "
            "the calibration rows only):\n\n"
            + table.errors_table(results, every, models, planner.role, seq_step) + "\n\n"
            + "Retries and step time at the largest size all three fit, one trial per allocator "
            "where one ran at that size (the search's own; its median over all six steps; the "
            "step rounds below, where a row has them, repeat it):\n\n"
            + table.retries_table(results, every, seq_step)
            + ("\n\nStep time over rounds at the largest size all three fit (steady steps: "
               f"after the first {step_rounds.WARM_STEPS}; verdict: not above when the 90% "
               f"interval's upper end is at most {1 + step_rounds.MARGIN:g}, above when its lower "
               f"end is above {1 + step_rounds.MARGIN:g}, undecided between):\n\n"
               + step_rounds.rounds_table(results, every, seq_step)
               + "\n\nEach steady step's vramledger / torch ratio over the same rounds (the "
               "step's length as a fraction of the longest in parentheses), then the ratio of "
               "the steady steps' total time, with the same verdict; the third line of a row, "
               "torch expandable / torch native over the rounds that ran both, without one:\n\n"
               + step_rounds.steps_table(results, every, seq_step) if results.rounds else ""))

if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
