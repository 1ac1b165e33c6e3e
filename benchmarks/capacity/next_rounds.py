"""The step rounds the records still want, and running them: one device call adds a machine to the
rows whose verdicts it can help decide most.

The step rounds (step_rounds.py) judge vramledger's step time against each torch allocator's over
rounds pooled across machines, and a machine counts once in the interval however many rounds it
ran. So what narrows an undecided interval is rounds on machines the row has not run on yet, fewest
machines first (verdicts.wanted() orders the rows so).

  python -m benchmarks.capacity.next_rounds list RESULTS... [--card-gib G] [--machine BOOT_ID]
      (any machine; without a GPU, name --card-gib) the rows not yet decided that a card of G GiB
      can run (default: this machine's first GPU, from nvidia-smi), in the order `run` takes
      them, each with why; rows with a size all three allocators fit but no step round come
      first.
  python -m benchmarks.capacity.next_rounds run RESULTS... --out-dir DIR [--rows N] [--rounds 3]
      [--budget-s 540] [--timeout-s 150] [--card-gib G]
      (on the GPU machine; benchmarks/gpu/run.sh item `steprounds`) runs, row after row in that
      order, --rounds rounds of torch native, torch expandable and vramledger's default
      (conf_rounds.run_rounds, one process each in rotating order) until the budget ends, each
      row's runs in DIR/BOOT-WORKLOAD-CAP-DIM-SIZE.json (BOOT: the first 8 digits of this boot's
      id, which it refuses to run without; a file there of this boot resumes: its runs with an
      answer are not run again, a failed one is); then, last, the verdicts of the rows of every
      file in DIR before and after pooling its runs with RESULTS (a file RESULTS already holds,
      or that cannot be read, is left out of the pool with a note), and the commands that join
      them for good (conf_rounds join, from the folder of runs files beside the first RESULTS:
      capacity-CARD-conf-rounds/ for capacity-CARD-*.json, as the records keep them).

RESULTS are capacity results files as `python -m benchmarks.capacity --table-only --resume` reads
them; the join commands join into the first and pool with the rest. Exit status 0 (also when the
budget ended before the rows it listed), 1 when a run failed or did not fit, a row's runs file
could not be used, or the reader closed the output early (`| head`); 2 on bad arguments and
files (a results file that cannot be read; also when the card's memory or the boot's id cannot
be found, or, for `run`, nvidia-smi lists no GPU or the trials would find no vramledger plugin).
"""

from __future__ import annotations

import argparse
import copy
import glob
import math
import os
import re
import subprocess
import sys
import time
from typing import Callable

from benchmarks.capacity import check_files, conf_rounds, refuse, results, table, trial, verdicts
from benchmarks.capacity.results import Results
from benchmarks.capacity.workloads import WORKLOADS

VARIANTS = ("torch", "torch-expandable", conf_rounds.DEFAULT)  # the step rounds' three allocators
SEQ_STEP = 64  # the searches' sequence grid (python -m benchmarks.capacity --seq-step)
DIMS = ("batch", "seq")


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


def gpu_listed() -> bool:
    """Whether nvidia-smi lists a GPU here."""
    try:
        return "GPU" in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                       timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False


def plugin_found() -> bool:
    """Whether a vramledger trial finds its plugin: trials import the package from the checkout
    (trial.py), which holds the plugin only where VRAMLEDGER_PLUGIN names a built one
    (`run.sh prepare` builds it into .devbuild/lib, and run.sh sets the variable)."""
    named = os.environ.get("VRAMLEDGER_PLUGIN")
    return bool(named and os.path.isfile(named)) or os.path.isfile(os.path.join(
        trial.ROOT, "torch_plugin", "python", "vramledger", "libvramledger_plugin.so"))


def runs_path(out_dir: str, boot: str, w: verdicts.Wanted) -> str:
    """The runs file of row `w` on the machine of kernel boot id `boot`."""
    return os.path.join(out_dir, f"{boot[:8]}-{w.workload}-{w.cap_gib:g}-{w.dim}-{w.size}.json")


def runs_folder(results_path: str) -> str:
    """The folder beside a results file that keeps the runs files joined into it: the records'
    capacity-CARD-conf-rounds/ for capacity-CARD-*.json, else STEM-conf-rounds/."""
    head, name = os.path.split(results_path)
    card = re.match(r"(capacity-[^-.]+)-", name)
    return os.path.join(head, (card.group(1) if card else os.path.splitext(name)[0])
                        + "-conf-rounds")


def run_wanted(want: list[verdicts.Wanted], out_dir: str, boot: str, rounds: int,
               budget_s: float, timeout_s: float,
               run: Callable[[conf_rounds.Variant, str, float, str, int, float], dict],
               log: Callable[[str], None] = print) -> tuple[list[str], int]:
    """Runs the rounds of each row of `want` in turn into its runs file (runs_path()) until the
    budget ends; returns the rows (Wanted.task()) where a run ran, and how many runs failed or
    did not fit, plus one for each row whose runs file could not be used (named in the log).
    `run(variant, workload, cap_gib, dim, size, timeout_s)` runs one trial; a run the budget cut
    short is not a failure (conf_rounds.run_rounds does not keep it)."""
    start = time.monotonic()
    ran, bad = [], 0
    for w in want:
        left = budget_s - (time.monotonic() - start)
        if left < min(timeout_s, 60.0):
            log(f"next rounds: the budget ended before {w.task()}")
            break
        path = runs_path(out_dir, boot, w)
        try:
            runs = conf_rounds.Runs(path, {"workload": w.workload, "cap_gib": float(w.cap_gib),
                                           "dim": w.dim, "size": w.size})
        except ValueError as e:  # names the file
            log(f"next rounds: {w.task()} not run: {e}")
            bad += 1
            continue
        log(f"next rounds: {w.task()} ({w.reason()}) into {path}")
        calls = 0

        def one(variant: conf_rounds.Variant, t: float, w=w) -> dict:
            nonlocal bad, calls
            calls += 1
            record = run(variant, w.workload, w.cap_gib, w.dim, w.size, t)
            bad += record.get("fits") is not True and not (
                record.get("timed_out") and t < timeout_s)  # the budget's cut is not a failure
            return record

        conf_rounds.run_rounds(runs, list(VARIANTS), rounds, one, left, timeout_s, log=log)
        if calls:
            ran.append(w.task())
    return ran, bad


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
                                                   os.path.basename(path), shown=path)
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
    lines = ["| workload | cap GiB | dimension | size | vramledger against | rounds (machines), "
             "before -> after | by the median, before -> after | by the total, before -> after |",
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
    runner.add_argument("--out-dir", required=True,
                        help="a folder for the runs files (and those of earlier calls to pool)")
    runner.add_argument("--rows", type=int, default=None, help="at most N rows (default: all)")
    runner.add_argument("--rounds", type=int, default=3, help="rounds per row (default 3)")
    runner.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for all the rows' runs (default 540)")
    runner.add_argument("--timeout-s", type=float, default=150.0,
                        help="seconds per trial process (default 150)")
    a = ap.parse_args(argv)
    if a.command == "run":
        conf_rounds.check_run_flags(ap, a)
        if a.rows is not None and a.rows < 1:
            ap.error(f"--rows must be at least 1, got {a.rows}")
        if not os.path.isdir(a.out_dir):
            ap.error(f"--out-dir {a.out_dir}: " + ("not a folder" if os.path.exists(a.out_dir)
                                                   else "does not exist (create it first)"))
        if not os.access(a.out_dir, os.W_OK):
            ap.error(f"--out-dir {a.out_dir}: cannot be written")
    if a.card_gib is not None and not 0 < a.card_gib < math.inf:
        ap.error(f"--card-gib must be a finite number of GiB above 0, got {a.card_gib:g}")
    check_files(ap, a.results)
    try:
        card = a.card_gib if a.card_gib is not None else card_gib()
    except ValueError as e:
        ap.error(str(e))
    if a.command == "run" and not gpu_listed():
        ap.error("run needs a GPU, and nvidia-smi lists none here (`list` names the rows "
                 "without one)")
    if a.command == "run" and not plugin_found():
        ap.error("the trials would find no vramledger plugin: set VRAMLEDGER_PLUGIN to a built "
                 "libvramledger_plugin.so, or run `bash benchmarks/gpu/run.sh steprounds`, which "
                 "sets it to the one `run.sh prepare` built")
    pool = Results()
    try:
        pool.load(a.results)
    except (OSError, ValueError) as e:
        return refuse("next rounds", str(e))
    unknown = sorted({g for g in pool.groups() if g[0] not in WORKLOADS or g[2] not in DIMS},
                     key=str)
    if unknown:
        print(f"next rounds: left out the records of rows it does not know: "
              f"{', '.join(f'{w} {c:g} {d}' for w, c, d in unknown)}", file=sys.stderr)
    rows = sorted(pool.groups() - set(unknown), key=table.row_order)
    before = verdicts.comparisons(pool, rows, SEQ_STEP)
    boot = a.machine if a.command == "list" else trial.host_facts()["boot_id"]
    if a.command == "run" and not boot:
        ap.error("this machine's kernel boot id (/proc/sys/kernel/random/boot_id) cannot be "
                 "read: the runs files are named by it, so that another machine's are not "
                 "resumed as this one's")
    if a.command == "list" and boot and not any(
            m and m.lower().startswith(boot.lower()) for c in before for m in c.named_machines()):
        print(f"next rounds: no step round names machine {boot!r}: every row is new to it",
              file=sys.stderr)
    want = verdicts.wanted(before, card, boot)
    larger = len(verdicts.wanted(before, math.inf, boot)) - len(want)
    print(f"{len(want)} row(s) not yet decided that a card of {card:.1f} GiB can run, in order"
          + (f" ({larger} more need a larger card)" if larger else "") + ":")
    for w in want:
        print(f"  {w.task()}  ({w.reason()})")
    if a.command == "list":
        return 0
    if a.rows is not None and a.rows < len(want):
        want = want[:a.rows]
        print(f"--rows {a.rows}: the first {a.rows} of them")

    def one(variant, workload, cap, dim, size, timeout_s):
        return trial.run_trial(workload, variant.allocator, cap, dim, size, timeout_s,
                               conf=variant.conf, plugin=variant.plugin,
                               extra_env=dict(variant.env))

    ran, bad = run_wanted(want, a.out_dir, boot, a.rounds, a.budget_s, a.timeout_s, one)
    files = sorted(glob.glob(os.path.join(a.out_dir, "*.json")))
    after, joined = pooled_with(pool, files)
    if not joined:
        print("\nno runs to pool with the records")
    else:
        pooled_rows = {(r["workload"], r["cap_gib"], r["dim"], r["size"])
                       for k, r in after.rounds.items() if after.round_files.get(k) in joined}
        now = verdicts.comparisons(after, rows, SEQ_STEP)
        print(f"\nThe verdicts on the rows of {len(joined)} file(s) of {a.out_dir}, before and "
              f"after pooling their runs with the records:\n")
        print(before_after(before, now, pooled_rows))
        print(f"\nEvery row after pooling, {verdicts.counts(now)}.")
        into = runs_folder(a.results[0])
        pooled = "".join(f" --pooled-with {p}" for p in a.results[1:])
        print(f"\nTo join them for good, with each file copied into {into}/:")
        for path in joined:
            print(f"  python -m benchmarks.capacity.conf_rounds join "
                  f"{os.path.join(into, os.path.basename(path))} {a.results[0]}{pooled}")
    print(f"next rounds: runs ran on {len(ran)} row(s)"
          + (f" ({', '.join(ran)})" if ran else "") + f"; {bad} failed or did not fit")
    return 1 if bad else 0


if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
