"""The step rounds the records still want, and running them: one device call adds a machine to the
rows whose verdicts it can help decide most.

The step rounds (step_rounds.py) judge vramledger's step time against each torch allocator's over
rounds pooled across machines, and a machine counts once in the interval however many rounds it
ran. So what narrows an undecided interval is rounds on machines the row has not run on yet, fewest
machines first (verdicts.wanted() orders the rows so).

  python -m benchmarks.capacity.next_rounds list RESULTS... [--card-gib G] [--machine BOOT_ID]
      (any machine) the rows not yet decided that a card of G GiB can run (default: this
      machine's GPU, from nvidia-smi), in the order `run` takes them, each with why.
  python -m benchmarks.capacity.next_rounds run RESULTS... --out-dir DIR [--rows N] [--rounds 3]
      [--budget-s 540] [--timeout-s 150] [--card-gib G]
      (on the GPU machine; benchmarks/gpu/run.sh item `steprounds`) runs, row after row in that
      order, --rounds rounds of torch native, torch expandable and vramledger's default
      (conf_rounds.run_rounds, one process each in rotating order) until the budget ends, each
      row's runs in DIR/BOOT-WORKLOAD-CAP-DIM-SIZE.json (BOOT: the first 8 digits of this boot's
      id; a file there of this boot resumes, its runs not run again); then, last, the verdicts
      of the rows it ran before and after pooling the new runs with RESULTS (the files in DIR
      that RESULTS already hold are left out of the pool, with a note), and the commands that
      join them for good (conf_rounds join).

RESULTS are capacity results files as `python -m benchmarks.capacity --table-only --resume` reads
them; the join commands join into the first and pool with the rest. Exit status 0 (also when the
budget ended before the rows it listed), 1 when a run failed or did not fit, or a results file
cannot be read; 2 on bad arguments (also when the card's memory cannot be found).
"""

from __future__ import annotations

import argparse
import copy
import glob
import math
import os
import subprocess
import sys
import time
from typing import Callable

from benchmarks.capacity import conf_rounds, results, table, trial, verdicts
from benchmarks.capacity.results import Results
from benchmarks.capacity.workloads import WORKLOADS

VARIANTS = ["torch", "torch-expandable", conf_rounds.DEFAULT]  # the step rounds' three allocators
SEQ_STEP = 64  # the searches' sequence grid (python -m benchmarks.capacity --seq-step)


def card_gib() -> float:
    """The first GPU's memory in GiB (nvidia-smi's memory.total).

    Raises:
      ValueError: nvidia-smi is missing, fails or prints no number.
    """
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return float(out.split()[0]) / 1024  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise ValueError(f"the GPU's memory: nvidia-smi gave none ({e}); name it with "
                         "--card-gib") from None


def load(paths: list[str]) -> Results:
    pool = Results()
    pool.load(paths)
    return pool


def runs_path(out_dir: str, boot: str | None, w: verdicts.Wanted) -> str:
    prefix = (boot or "unknown")[:8]
    return os.path.join(out_dir, f"{prefix}-{w.workload}-{w.cap_gib:g}-{w.dim}-{w.size}.json")


def run_wanted(pool: Results, want: list[verdicts.Wanted], out_dir: str, boot: str | None,
               rounds: int, budget_s: float, timeout_s: float,
               run: Callable[[conf_rounds.Variant, str, float, str, int, float], dict],
               log: Callable[[str], None] = print) -> tuple[list[str], int]:
    """Runs the rounds of each row of `want` in turn into its runs file (runs_path()) until the
    budget ends; returns the files written and how many runs failed or did not fit.
    `run(variant, workload, cap_gib, dim, size, timeout_s)` runs one trial."""
    start = time.monotonic()
    written, bad = [], 0
    for w in want:
        left = budget_s - (time.monotonic() - start)
        if left < min(timeout_s, 60.0):
            log(f"next rounds: the budget ended before {w.task()}")
            break
        path = runs_path(out_dir, boot, w)
        runs = conf_rounds.Runs(path, {"workload": w.workload, "cap_gib": float(w.cap_gib),
                                       "dim": w.dim, "size": w.size})
        log(f"next rounds: {w.task()} ({w.reason()}) into {path}")

        def one(variant: conf_rounds.Variant, t: float, w=w) -> dict:
            nonlocal bad
            record = run(variant, w.workload, w.cap_gib, w.dim, w.size, t)
            bad += record.get("fits") is not True and not (
                record.get("timed_out") and t < timeout_s)  # the budget's cut is not a failure
            return record

        conf_rounds.run_rounds(runs, VARIANTS, rounds, one, left, timeout_s, log=log)
        if runs.runs:
            written.append(path)
    return written, bad


def pooled_with(pool: Results, files: list[str],
                log: Callable[[str], None] = print) -> tuple[Results, list[str]]:
    """A copy of `pool` with the runs of `files` joined as their rows' next step rounds
    (conf_rounds.joined_rounds), and the files joined; a file whose runs `pool` already holds,
    that cannot be read or that holds no run to join (every one failed) is left out with a
    note."""
    after = copy.deepcopy(pool)
    joined = []
    for path in files:
        try:
            records, _ = conf_rounds.joined_rounds(conf_rounds.read(path), after,
                                                   os.path.basename(path))
        except ValueError as e:
            log(f"next rounds: {os.path.basename(path)} left out of the pool: {e}")
            continue
        if not records:
            log(f"next rounds: {os.path.basename(path)} left out of the pool: no run of "
                f"{', '.join(conf_rounds.JOINED)} that ended with an answer")
            continue
        for r in records:
            k = results.round_key(r["workload"], r["allocator"], r["cap_gib"], r["dim"],
                                  r["size"], r["round"])
            after.rounds[k] = r
            after.round_files[k] = path
        joined.append(path)
    return after, joined


def before_after(before: list[verdicts.Comparison], after: list[verdicts.Comparison],
                 rows: set[tuple[str, float, str, int]]) -> str:
    """A line per comparison of `rows`: its rounds and machines, then by each measure the verdict
    and interval before and after."""
    old = {(c.workload, c.cap_gib, c.dim, c.size, c.against): c for c in before}
    lines = ["| workload | cap GiB | dimension | size | vramledger / | rounds (machines), before "
             "-> after | by the median, before -> after | by the total, before -> after |",
             "|---" * 8 + "|"]
    for c in after:
        if (c.workload, c.cap_gib, c.dim, c.size) not in rows:
            continue
        was = old.get((c.workload, c.cap_gib, c.dim, c.size, c.against))

        def then(text: Callable[[verdicts.Comparison], str]) -> str:
            return f"{text(was) if was else 'none'} -> {text(c)}"

        lines.append(f"| {WORKLOADS[c.workload].title} | {c.cap_gib:g} | {c.dim} | "
                     f"{c.size} | {table.NAMES[c.against]} | {then(verdicts.rounds_text)} | "
                     + " | ".join(then(lambda x, m=m: verdicts.cell(x, m))
                                  for m in verdicts.MEASURES) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.next_rounds",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    lister = sub.add_parser("list", help="the rows not yet decided, in the order run takes them")
    runner = sub.add_parser("run", help="run their rounds (GPU machine)")
    for p in (lister, runner):
        p.add_argument("results", nargs="+", metavar="RESULTS")
        p.add_argument("--card-gib", type=float, default=None,
                       help="the card's memory (default: nvidia-smi's, of the first GPU)")
    lister.add_argument("--machine", default=None, metavar="BOOT_ID",
                        help="the machine that would run them (its kernel boot id): the rows it "
                             "ran already come last")
    runner.add_argument("--out-dir", required=True)
    runner.add_argument("--rows", type=int, default=None, help="at most N rows (default: all)")
    runner.add_argument("--rounds", type=int, default=3, help="rounds per row (default 3)")
    runner.add_argument("--budget-s", type=float, default=540.0)
    runner.add_argument("--timeout-s", type=float, default=150.0, help="per trial process")
    a = ap.parse_args(argv)
    if a.command == "run":
        if a.rounds < 1 or (a.rows is not None and a.rows < 1):
            ap.error(f"--rounds and --rows must be at least 1, got {a.rounds} and {a.rows}")
        for flag, value in (("--timeout-s", a.timeout_s), ("--budget-s", a.budget_s)):
            if not 0 < value < math.inf:
                ap.error(f"{flag} must be a number of seconds above 0, got {value:g}")
        if not os.path.isdir(a.out_dir):
            ap.error(f"--out-dir {a.out_dir}: not a folder")
    if a.card_gib is not None and not 0 < a.card_gib < math.inf:
        ap.error(f"--card-gib must be above 0, got {a.card_gib:g}")
    for path in a.results:
        if not os.path.isfile(path):
            ap.error(f"{path}: " + ("not a file" if os.path.exists(path) else "no such file"))
    try:
        card = a.card_gib if a.card_gib is not None else card_gib()
    except ValueError as e:
        ap.error(str(e))
    try:
        pool = load(a.results)
    except (OSError, ValueError) as e:
        print(f"next rounds: {e}", file=sys.stderr)
        return 1
    rows = sorted(pool.groups(), key=table.row_order)
    before = verdicts.comparisons(pool, rows, SEQ_STEP)
    boot = a.machine if a.command == "list" else trial.host_facts()["boot_id"]
    want = verdicts.wanted(before, card, boot)
    if a.command == "run" and a.rows is not None:
        want = want[:a.rows]
    print(f"{len(want)} row(s) not yet decided that a card of {card:.1f} GiB can run, in order:")
    for w in want:
        print(f"  {w.task()}  ({w.reason()})")
    if a.command == "list":
        return 0

    def one(variant, workload, cap, dim, size, timeout_s):
        return trial.run_trial(workload, variant.allocator, cap, dim, size, timeout_s)

    written, bad = run_wanted(pool, want, a.out_dir, boot, a.rounds, a.budget_s, a.timeout_s,
                              one)
    files = sorted(glob.glob(os.path.join(a.out_dir, "*.json")))
    after, joined = pooled_with(pool, files)
    if not joined:
        print("\nno runs to pool with the records")
    else:
        ran = {(r["workload"], r["cap_gib"], r["dim"], r["size"])
               for k, r in after.rounds.items() if after.round_files.get(k) in joined}
        now = verdicts.comparisons(after, rows, SEQ_STEP)
        print(f"\nThe verdicts on the rows run, before and after pooling {len(joined)} file(s) "
              f"of {a.out_dir} with the records:\n")
        print(before_after(before, now, ran))
        print(f"\nEvery row after pooling, {verdicts.counts(now)}.")
        home = os.path.dirname(a.results[0]) or "."
        pooled = "".join(f" --pooled-with {p}" for p in a.results[1:])
        print(f"\nTo join them for good, copy each file under {home} and run:")
        for path in joined:
            print(f"  python -m benchmarks.capacity.conf_rounds join {home}/.../"
                  f"{os.path.basename(path)} {a.results[0]}{pooled}")
    print(f"next rounds: {len(written)} row(s) ran, {bad} run(s) failed or did not fit")
    return 1 if bad else 0


if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
