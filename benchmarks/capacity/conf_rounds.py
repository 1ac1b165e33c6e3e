"""vramledger's step time under several option settings or builds, beside torch's allocators, at
one row's size. The step rounds (step_rounds.py) compare vramledger's default policy with torch's;
when it is slower on a row, this says which part of the policy is why: a setting whose runs are as
fast as torch's removes the cause (fewer, larger driver objects; torch's plain policy; ...), and a
candidate build runs beside the current one on the same host.

Each variant is a trial process (trial.run_trial): "torch" and "torch-expandable" are torch's
allocators; any other variant is vramledger with that VRAMLEDGER_CONF (`key:value,...`; "default" is
vramledger with no setting), from another build where it starts with `BUILD@` (a folder holding that
build's libvramledger_plugin.so, libvramledger_native.so and the Abseil libraries beside them, as
`run.sh prepare` bundles them; loaded through VRAMLEDGER_PLUGIN). A vramledger record names the
route install() took (`mode`). Any variant may end in `+NAME=VALUE` (repeatable): its process gets
that environment variable too, under any allocator, e.g. the host allocator's settings
(`torch+GLIBC_TUNABLES=glibc.malloc.trim_threshold=...`) to tell the heap's behaviour from the
allocator's work. Each round runs every variant once, in an order that rotates as the step rounds'
does (round r starts with variant r mod k), so drift falls on each variant alike. Per variant, the
table gives the median over rounds of each steady step (the steps after the first two,
step_rounds.WARM_STEPS) and of the run's steady median, and the paired ratio to torch native's run
of the same round (geometric mean over rounds and its 90% interval, step_rounds.interval).
A second table gives where each variant's steady step went on the host (the time until its work was
queued, and trial.PROCESS_FIGURES: CPU time in user and kernel mode, minor page faults, context
switches, the main thread's CPU time, run-queue wait and moves between CPUs, the machine's stolen
time; and the host probes timed before each step, trial.host_probes()), and a line per machine
(kernel boot) gives its runs, CPUs and load averages: a variant slower on one machine shows there
whether it queued its work more slowly, faulted or switched more, or waited for a CPU, and whether
its process ran fixed host work slower too (the probes: if not, the difference lies in what the
probes do not exercise, the step's own work or the memory system under it).

  python -m benchmarks.capacity.conf_rounds run WORKLOAD CAP_GIB DIM SIZE --variants V ...
      --rounds N --out FILE.json [--timeout-s S] [--budget-s S]
      (on the GPU machine; benchmarks/gpu/run.sh item `confrounds`) runs the rounds, adding each
      run to FILE.json as it ends (a file that holds runs of this row resumes: the runs it holds
      are not run again), and prints the table.
  python -m benchmarks.capacity.conf_rounds table FILE.json [--against VARIANT]
      (any machine) prints the table of a file's runs, its ratios to torch native's or to
      VARIANT's runs.
  python -m benchmarks.capacity.conf_rounds join FILE.json RESULTS.json [--pooled-with OTHER]...
      (any machine) adds the file's runs of torch native, torch expandable and vramledger's
      default (no setting, build or environment: the step rounds' own trial) to a capacity
      results file's step rounds of the row, as the rounds after its last one there and in the
      OTHER results files the table pools with it (benchmarks.capacity --resume RESULTS OTHER:
      rounds of one row must be numbered apart across them); each joined record's
      `conf_rounds` names the file (relative to RESULTS' folder) and its round there.
Exit status 0; 1 when a run failed or the budget ended first (run), or when the reader closes the
output early (`| head`); 2 on bad arguments and on files it refuses, nothing written: FILE cannot
be read, is not a runs file or holds no run of torch native or of the --against variant (table),
or the runs cannot be joined (join: runs RESULTS or an OTHER already holds, a FILE outside
RESULTS' folder, a file that cannot be read or whose row is not one, results files that number two
runs alike).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Callable, Sequence

from benchmarks.capacity import check_files, refuse, results, step_rounds, trial, workloads
from benchmarks.capacity import table as table_names

TORCH_VARIANTS = ("torch", "torch-expandable")
DEFAULT = "default"  # vramledger with no setting
REFERENCE = "torch"


# A build folder's libraries (vramledger._plugin's and _native's names). Without the native one,
# or with one built for another torch, install() would fall back to the pluggable route and the
# rounds would compare two routes, not two builds.
BUILD_LIBRARIES = ("libvramledger_plugin.so", "libvramledger_native.so")


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a variant's trial runs: the allocator, vramledger's settings (VRAMLEDGER_CONF; None:
    none), the plugin library of another build (VRAMLEDGER_PLUGIN; None: the package's) and
    other environment variables of its process, as (name, value) pairs."""
    allocator: str
    conf: str | None = None
    plugin: str | None = None
    env: tuple[tuple[str, str], ...] = ()


def parse_env(variant: str, assignments: list[str]) -> tuple[tuple[str, str], ...]:
    """The (name, value) pairs of a variant's `+NAME=VALUE` suffixes.

    Raises:
      ValueError: one is not NAME=VALUE with a variable's name, or names one the trial sets.
    """
    env = []
    for a in assignments:
        name, eq, value = a.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"variant {variant!r}: {'+' + a!r} is not +NAME=VALUE")
        if name in trial.TRIAL_ENV:
            raise ValueError(f"variant {variant!r}: {name} is set by the trial itself")
        if any(name == n for n, _ in env):
            raise ValueError(f"variant {variant!r}: {name} is given twice")
        env.append((name, value))
    return tuple(env)


def parse_variant(variant: str) -> Variant:
    """The trial of `variant`: "torch", "torch-expandable", "default" (vramledger), vramledger's
    settings `key:value[,key:value...]`, or either of the last two after `BUILD@`, a folder that
    holds another build's libvramledger_plugin.so and libvramledger_native.so (with the Abseil
    libraries the plugin loads from its own folder: a `run.sh prepare` bundle such as
    .devbuild/lib), which vramledger then loads; any of them followed by `+NAME=VALUE` suffixes,
    environment variables of the trial's process.

    Raises:
      ValueError: an empty variant, settings that are not `key:value` pairs, a BUILD that is
        not a folder holding both libraries, or a suffix that is not NAME=VALUE.
    """
    # A '+' starts a suffix only before NAME=: a build folder or a value may hold '+' too.
    head, *assignments = re.split(r"\+(?=[A-Za-z_][A-Za-z0-9_]*=)", variant)
    if head.endswith("+"):
        raise ValueError(f"variant {variant!r}: a '+' at its end is not +NAME=VALUE")
    env = parse_env(variant, assignments)
    if head in TORCH_VARIANTS:
        return Variant(head, env=env)
    build, at, settings = head.rpartition("@")
    plugin = None
    if at:
        if not build or not os.path.isdir(build):
            raise ValueError(f"variant {variant!r}: {build or '(empty)'} is not a folder")
        missing = [n for n in BUILD_LIBRARIES if not os.path.isfile(os.path.join(build, n))]
        if missing:
            raise ValueError(f"variant {variant!r}: {build} holds no {' or '.join(missing)}")
        plugin = os.path.abspath(os.path.join(build, BUILD_LIBRARIES[0]))
    if settings == DEFAULT:
        return Variant("vramledger", None, plugin, env)
    pairs = settings.split(",")
    if not settings or any(p.count(":") != 1 or not all(p.split(":")) for p in pairs):
        raise ValueError(f"variant {variant!r}: expected torch, torch-expandable, or [BUILD@] "
                         f"then {DEFAULT} or vramledger settings as key:value[,key:value...], "
                         f"then any +NAME=VALUE")
    return Variant("vramledger", settings, plugin, env)


def order(variants: list[str], round_: int) -> list[str]:
    """The variants in the order round `round_` runs them."""
    k = round_ % len(variants)
    return variants[k:] + variants[:k]


def read(path: str) -> dict:
    """A runs file's contents: {"row": ..., "runs": [record, ...]}.

    Raises:
      ValueError: it cannot be read or is not a runs file (the message names it).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable runs file ({e})") from e
    if not (isinstance(data, dict) and "row" in data and isinstance(data.get("runs"), list)
            and all(isinstance(r, dict) and {"variant", "round"} <= r.keys()
                    for r in data["runs"])):
        raise ValueError(f"{path}: not a runs file (expected an object with \"row\" and a "
                         f"\"runs\" list of records with a variant and a round)")
    row = data["row"]
    if not (isinstance(row, dict) and isinstance(row.get("workload"), str)
            and row["workload"] in workloads.WORKLOADS and row.get("dim") in ("batch", "seq")
            and isinstance(row.get("size"), int) and row["size"] >= 1
            and isinstance(row.get("cap_gib"), (int, float)) and row["cap_gib"] > 0):
        raise ValueError(f"{path}: its row {row!r} is not a workload "
                         f"({', '.join(workloads.WORKLOADS)}), cap_gib above 0, dim batch or "
                         f"seq and a size of at least 1")
    if not all(isinstance(r["variant"], str) and isinstance(r["round"], int)
               for r in data["runs"]):
        raise ValueError(f"{path}: a run whose variant is not a name or whose round is not a "
                         f"number")
    return data


class Runs:
    """The runs of one row, by (variant, round), kept in a JSON file written after each run."""

    def __init__(self, path: str, row: dict):
        """Reads the runs `path` holds, if it exists.

        Raises:
          ValueError: the file is not a runs file of this row, or cannot be read or written
            (the message names it).
        """
        self.path = path
        self.row = row
        self.runs: list[dict] = []
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"{path}: not a file in a folder that exists and can be written")
        if not os.path.exists(path):
            return
        data = read(path)
        if data.get("row") != row:
            raise ValueError(f"{path} holds runs of another row ({data.get('row')}, not "
                             f"{row}); name another file")
        self.runs = data["runs"]

    def get(self, variant: str, round_: int) -> dict | None:
        return next((r for r in self.runs
                     if r["variant"] == variant and r["round"] == round_), None)

    def add(self, record: dict) -> None:
        """Keeps `record`, in place of a run of the same variant and round if there is one."""
        self.runs = [r for r in self.runs
                     if (r["variant"], r["round"]) != (record["variant"], record["round"])]
        self.runs.append(record)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"row": self.row, "runs": self.runs}, f, indent=1)
        os.replace(tmp, self.path)


def run_rounds(runs: Runs, variants: list[str], rounds: int, run: Callable[..., dict],
               budget_s: float, timeout_s: float, log: Callable[[str], None] = print) -> int:
    """Runs rounds 0 .. rounds-1; a run `runs` holds is kept, one that failed (no verdict) is run
    again. Returns how many runs failed, plus one when the budget ended first (a run the budget
    cut short is not kept). `run(Variant, timeout_s)` runs one."""
    start = time.monotonic()
    failed = 0
    parsed = {v: parse_variant(v) for v in variants}  # once: a build folder is checked up front
    for r in range(rounds):
        for v in order(variants, r):
            held = runs.get(v, r)
            if held is not None and held.get("fits") is not None:
                continue
            left = budget_s - (time.monotonic() - start)
            if left < min(timeout_s, 60.0):
                log(f"conf rounds: the budget ended before round {r}, {v}")
                return failed + 1
            record = run(parsed[v], min(timeout_s, left))
            if record.get("timed_out") and left < timeout_s:
                log(f"conf rounds: the budget ended during round {r}, {v} (not kept)")
                return failed + 1
            record.update(variant=v, round=r, conf=parsed[v].conf)
            runs.add(record)
            if record.get("fits") is None:
                failed += 1
                log(f"conf rounds: round {r}, {v}: failed: {record.get('error')}")
            elif not record["fits"]:
                failed += 1
                log(f"conf rounds: round {r}, {v}: did not fit: {record.get('error')}")
            else:
                log(f"conf rounds: round {r}, {v}: "
                    + " ".join(f"{x:.3f}" for x in record["step_s"]))
    return failed


def label(variant: str) -> str:
    """A variant as the tables name it: torch's two allocators by name, others as given."""
    return table_names.NAMES.get(variant, variant)


def table(runs: list[dict], variants: list[str] | None = None,
          against: str = REFERENCE) -> str:
    """Per variant: rounds, the median of each steady step and of the steady median over rounds
    (ms), and the paired ratio to the variant `against` (torch native unless given) with its 90%
    interval and verdict.

    Raises:
      ValueError: no fitting run of `against`.
    """
    fitting = [r for r in runs if r.get("fits") and (step_rounds.steady_time(r) or 0) > 0]
    reference = {r["round"]: r for r in fitting if r["variant"] == against}
    if not reference:
        raise ValueError(f"no fitting run of {label(against)}, the reference")
    if variants is None:
        variants = list(dict.fromkeys(r["variant"] for r in runs))
    warm = step_rounds.WARM_STEPS
    steps = max(len(r["step_s"]) for r in fitting) - warm
    head = " | ".join(f"step {warm + 1 + i} ms" for i in range(steps))
    lines = [f"| variant | rounds | {head} | steady ms | / {label(against)} [90%] | verdict |",
             "|---|---|" + "---|" * steps + "---|---|---|"]
    for v in variants:
        mine = [r for r in fitting if r["variant"] == v]
        if not mine:
            lines.append(f"| {v} | 0 |" + " - |" * steps + " - | - | no fitting run |")
            continue
        per_step = []
        for i in range(warm, warm + steps):
            times = [r["step_s"][i] for r in mine if len(r["step_s"]) > i]
            per_step.append(f"{statistics.median(times) * 1e3:.1f}" if times else "-")
        steady = statistics.median(step_rounds.steady_time(r) for r in mine)
        # A round's runs pair only when they ran on one machine (a file resumed elsewhere).
        paired = [r for r in mine if r["round"] in reference
                  and step_rounds.same_machine(r, reference[r["round"]])]
        ratios = [step_rounds.steady_time(r) / step_rounds.steady_time(reference[r["round"]])
                  for r in paired]
        on = [step_rounds.machine(r) for r in paired]
        bounds = step_rounds.interval(ratios, machines=on) if v != against else None
        ratio = (step_rounds.bounds_text(bounds, "{} [{}, {}]") + step_rounds.machines_note(on)
                 if bounds else "-")
        verdict = step_rounds.verdict(bounds) if v != against else "reference"
        lines.append(f"| {v} | {len(mine)} | " + " | ".join(per_step)
                     + f" | {steady * 1e3:.1f} | {ratio} | {verdict} |")
    return "\n".join(lines)


# The process table's columns: a record's per-step field, its heading, its decimals.
PROCESS_COLUMNS = (("step_s", "step ms", 1), ("step_launch_ms", "queued by ms", 1),
                   ("step_user_ms", "user ms", 1), ("step_sys_ms", "sys ms", 1),
                   ("step_minflt", "minor faults", 0), ("step_vcsw", "vol. switches", 0),
                   ("step_ivcsw", "invol. switches", 0),
                   ("step_main_cpu_ms", "main thread ms", 1), ("step_runq_ms", "run queue ms", 2),
                   ("step_migrations", "migrations", 1), ("step_steal_ms", "steal ms", 1),
                   ("step_probe_py_us", "Python probe us", 0),
                   ("step_probe_launch_us", "launch probe us", 2))


def steady_mean(record: dict, field: str) -> float | None:
    """The mean of a per-step field over a run's steady steps, or None where it has none."""
    values = [x for x in (record.get(field) or [])[step_rounds.WARM_STEPS:] if x is not None]
    return statistics.fmean(values) if values else None


def process_table(runs: list[dict], variants: list[str] | None = None) -> str:
    """Per variant: where a steady step's time went (PROCESS_COLUMNS: the step, the time until its
    work was queued, trial.PROCESS_FIGURES), each the median over its fitting runs of the run's
    mean over its steady steps, so the columns compare with one another; "-" where no run
    recorded it (records from before it was recorded)."""
    fitting = [r for r in runs if r.get("fits") and (step_rounds.steady_time(r) or 0) > 0]
    if variants is None:
        variants = list(dict.fromkeys(r["variant"] for r in runs))
    head = " | ".join(name for _, name, _ in PROCESS_COLUMNS)
    lines = [f"| variant (mean steady step) | runs | {head} |",
             "|---|---|" + "---|" * len(PROCESS_COLUMNS)]
    for v in variants:
        mine = [r for r in fitting if r["variant"] == v]
        if not mine:
            continue
        cells = []
        for field, _, digits in PROCESS_COLUMNS:
            scale = 1e3 if field == "step_s" else 1.0
            means = [m * scale for m in (steady_mean(r, field) for r in mine) if m is not None]
            cells.append(f"{statistics.median(means):.{digits}f}" if means else "-")
        lines.append(f"| {v} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machines(runs: list[dict]) -> str:
    """A line per machine (kernel boot) that ran `runs`: its runs, CPU model, CPUs and the range
    of the one-minute load average its runs saw; runs without host facts are left out."""
    lines = []
    for boot in dict.fromkeys(r["host"]["boot_id"] for r in runs
                              if isinstance(r.get("host"), dict) and r["host"].get("boot_id")):
        mine = [r for r in runs if isinstance(r.get("host"), dict)
                and r["host"].get("boot_id") == boot]
        host = mine[0]["host"]
        load = [r["host"]["loadavg"][0] for r in mine if r["host"].get("loadavg")]
        span = f"{min(load):.2f}-{max(load):.2f}" if load else "?"
        lines.append(f"machine {boot[:8]}: {len(mine)} runs, {host.get('cpu_model') or '?'}, "
                     f"{host.get('cpus') or '?'} CPUs, load average (1 min) {span}")
    return "\n".join(lines)


def report(runs: list[dict], variants: list[str] | None = None,
           against: str = REFERENCE) -> str:
    """The step table (ratios to `against`), the process table and the machines of `runs`.

    Raises:
      ValueError: no fitting run of `against`.
    """
    parts = [table(runs, variants, against), process_table(runs, variants), machines(runs)]
    return "\n\n".join(p for p in parts if p)


# The variants whose trial is the step rounds' own, by the allocator a step round names.
JOINED = {"torch": "torch", "torch-expandable": "torch-expandable", DEFAULT: "vramledger"}


def fingerprint(record: dict, allocator: str) -> tuple | None:
    """What tells a run apart from every other: its allocator, machine and step times (floats
    that two processes never repeat); None for a run without step times (out of memory in its
    first step), which nothing can tell apart."""
    if not record.get("step_s"):
        return None
    boot = (record.get("host") or {}).get("boot_id")
    return allocator, boot, tuple(record["step_s"])


def join(runs_path: str, results_path: str,
         pooled_with: Sequence[str] = ()) -> tuple[int, list[int]]:
    """Adds the runs of `runs_path` whose variant is in JOINED and that ended with an answer (one
    that did not fit included: it is a result at that size) to the capacity results file
    `results_path` as step rounds of the row: the file's rounds that hold such runs, in order,
    become the rounds after the row's last one in the results file and in `pooled_with`, the
    results files read with it (a round's number keys its runs when the files are pooled:
    results.Results.load refuses files that number two runs of a row alike). Each added
    record's `conf_rounds` names the runs file (relative to the results file's folder, which
    must hold it) and its round there. Only the results file is written, and only when something
    is added. Returns how many runs it added and the rounds they took.

    Raises:
      ValueError: a file that cannot be read, a runs file outside the results file's folder,
        runs the results file or a pooled one already holds (the same allocator's same step
        times, whatever the file is called now), or results files that number two runs alike.
    """
    data = read(runs_path)
    folder = os.path.dirname(os.path.abspath(results_path))
    source = os.path.relpath(os.path.abspath(runs_path), folder)
    if source.startswith(os.pardir + os.sep):
        raise ValueError(f"{runs_path} is not under {folder}, the results file's folder: copy "
                         f"it there first, so the joined records name a file beside them")
    into = results.Results(results_path)
    into.load([results_path])
    # The results file itself among the pooled ones is read once.
    others = list(dict.fromkeys(p for p in pooled_with
                                if os.path.abspath(p) != os.path.abspath(results_path)))
    pool = results.Results()
    pool.load([results_path, *others])  # the rounds the table pools: refused if numbered alike
    records, taken = joined_rounds(data, pool, source, shown=runs_path)
    for record in records:
        into.rounds[results.round_key(record["workload"], record["allocator"],
                                      record["cap_gib"], record["dim"], record["size"],
                                      record["round"])] = record
    if records:
        into.save()
    return len(records), taken


def joined_rounds(data: dict, pool: results.Results, source: str,
                  shown: str | None = None) -> tuple[list[dict], list[int]]:
    """The step-round records join() makes of a runs file's contents (read()), numbered after the
    row's last round in `pool` (the results files the table pools), each naming `source` and its
    round there; and the rounds they take. Errors name the file as `shown` (default `source`).

    Raises:
      ValueError: `pool` already holds one of the runs (the same allocator's same step times).
    """
    row = data["row"]
    joined = [r for r in data["runs"] if r["variant"] in JOINED and r.get("fits") is not None]
    held = {fingerprint(r, r["allocator"]): pool.round_files.get(k, "the records")
            for k, r in pool.rounds.items()}
    held.pop(None, None)
    # The file that holds each joined run already (a run without step times tells nothing).
    again = [held[f] for r in joined if (f := fingerprint(r, JOINED[r["variant"]])) in held]
    if again:
        raise ValueError(f"{again[0]} already holds {again.count(again[0])} of the "
                         f"{len(joined)} runs of {shown or source} (the same step times)")
    same_row = [r["round"] for r in pool.rounds.values()
                if (r["workload"], r["cap_gib"], r["dim"], r["size"])
                == (row["workload"], row["cap_gib"], row["dim"], row["size"])]
    first = max(same_row, default=-1) + 1
    rounds = sorted({r["round"] for r in joined})
    batch, seq = workloads.WORKLOADS[row["workload"]].shape(row["dim"], row["size"])
    records = []
    for r in joined:
        record = {k: v for k, v in r.items() if k not in ("variant", "conf")}
        record.update(row, allocator=JOINED[r["variant"]], batch=batch, seq=seq,
                      round=first + rounds.index(r["round"]),
                      conf_rounds=f"{source} round {r['round']}")
        records.append(record)
    return records, [first + i for i in range(len(rounds))]


def check_run_flags(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuses (ap.error, status 2) a `run` command's --rounds below 1 and a --timeout-s or
    --budget-s that is not a number of seconds above 0."""
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    for flag, value in (("--timeout-s", a.timeout_s), ("--budget-s", a.budget_s)):
        if not 0 < value < math.inf:
            ap.error(f"{flag} must be a number of seconds above 0, got {value:g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.conf_rounds",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the rounds at one row's size (GPU machine)")
    workloads.add_row_arguments(r)
    r.add_argument("--variants", nargs="+", required=True)
    r.add_argument("--rounds", type=int, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--timeout-s", type=float, default=240.0)
    r.add_argument("--budget-s", type=float, default=600.0)
    t = sub.add_parser("table", help="the table of a file's runs")
    t.add_argument("file")
    t.add_argument("--against", default=REFERENCE, metavar="VARIANT",
                   help="the variant the ratios divide by (default: torch, torch native)")
    j = sub.add_parser("join", help="a file's runs of the three allocators into the step rounds")
    j.add_argument("file")
    j.add_argument("results")
    j.add_argument("--pooled-with", action="append", default=[], metavar="OTHER",
                   help="a results file the table reads with RESULTS (once per file): the "
                        "joined rounds follow the row's last round in any of them, and runs "
                        "they hold are refused")
    a = ap.parse_args(argv)
    if a.command == "join":
        check_files(ap, (a.file, a.results, *a.pooled_with))
        try:
            added, taken = join(a.file, a.results, a.pooled_with)
        except (ValueError, OSError) as e:
            return refuse("conf rounds", str(e))
        if not added:
            print(f"{a.file}: no run of {', '.join(JOINED)} to add; {a.results} unchanged")
        else:
            said = (f"round {taken[0]}" if len(taken) == 1
                    else f"rounds {taken[0]}-{taken[-1]}")
            print(f"{a.results}: added {added} runs of {a.file} as {said}")
        return 0
    if a.command == "table":
        check_files(ap, [a.file])
        try:
            data = read(a.file)
        except ValueError as e:  # names the file
            return refuse("conf rounds", str(e))
        try:
            held = list(dict.fromkeys(r["variant"] for r in data["runs"]))
            if a.against not in held:
                raise ValueError(f"--against {a.against}: no run of that variant (the file's: "
                                 f"{', '.join(held) or 'none'})")
            text = report(data["runs"], against=a.against)
        except (ValueError, KeyError, TypeError) as e:
            return refuse("conf rounds", f"{a.file}: {e}")
        row = data["row"]
        print(f"row: {row['workload']} at {row['cap_gib']:g} GiB, {row['dim']} {row['size']}")
        print(text)
        return 0
    workloads.check_row(ap, a)
    check_run_flags(ap, a)
    variants = list(dict.fromkeys(a.variants))
    if REFERENCE not in variants:
        variants.insert(0, REFERENCE)
    try:
        for v in variants:
            parse_variant(v)
        row = {"workload": a.workload, "cap_gib": a.cap_gib, "dim": a.dim, "size": a.size}
        runs = Runs(a.out, row)
    except ValueError as e:
        ap.error(str(e))

    def one(variant: Variant, timeout_s: float) -> dict:
        return trial.run_trial(a.workload, variant.allocator, a.cap_gib, a.dim, a.size,
                               timeout_s, conf=variant.conf, plugin=variant.plugin,
                               extra_env=dict(variant.env))

    failed = run_rounds(runs, variants, a.rounds, one, a.budget_s, a.timeout_s)
    dev = ", ".join(sorted({x["device"] for x in runs.runs if x.get("device")})) or "?"
    tv = ", ".join(sorted({x["torch"] for x in runs.runs if x.get("torch")})) or "?"
    print(f"conf rounds of {a.workload} at {a.cap_gib:g} GiB, {a.dim} {a.size} ({dev}, torch {tv})")
    try:
        print(report(runs.runs, variants))
    except ValueError as e:
        print(f"conf rounds: {e}", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
