"""The capacity benchmark's tables, from trial records alone: the largest size per workload, cap
and allocator beside the planner's prediction and vramledger's gain, then retries and step time at
the largest size all three allocators fit."""

from __future__ import annotations

from typing import Callable, Iterable

from benchmarks.capacity import search
from benchmarks.capacity.trial import STEP_COUNTERS, VRAMLEDGER_FIGURES, VRAMLEDGER_MAPPINGS
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results
from benchmarks.capacity.workloads import WORKLOADS, size_grid

NAMES = {"torch": "torch native", "torch-expandable": "torch expandable",
         "vramledger": "vramledger"}
WARM_STEPS = 2  # a trial's steps before its steady ones (the first two fill the cache)
# trial.py's per-step counters, in the order the tables give them.
COUNTERS = tuple(STEP_COUNTERS)
# The column of vramledger's own per-step figures (trial.py; "-" for torch's allocators).
LEDGER_COLUMN = ("vramledger driver ms / waits / wait ms / cuMemMap / cuMemUnmap / take-backs per "
                 "steady step")


def row_order(group: tuple[str, float, str]) -> tuple[int, float, str]:
    """The tables' order of (workload, cap, dim) rows: workloads as WORKLOADS lists them."""
    workload, cap, dim = group
    return list(WORKLOADS).index(workload), cap, dim


def state(results: Results, workload: str, allocator: str, cap_gib: float, dim: str,
          seq_step: int) -> search.Search | None:
    """Where the row's search stands on its records; None when it has none."""
    known = results.known(workload, allocator, cap_gib, dim)
    if not known:
        return None
    step, bound = size_grid(WORKLOADS[workload], dim, seq_step)
    return search.from_known(known, step=step, bound=bound)


def cell(results: Results, workload: str, allocator: str, cap_gib: float, dim: str,
         seq_step: int) -> str:
    s = state(results, workload, allocator, cap_gib, dim, seq_step)
    errors = results.errors(workload, allocator, cap_gib, dim)
    if s is None:
        return "error" if errors else "-"
    if s.status == search.FOUND:
        return str(s.largest)
    if s.status == search.EVERY:
        return f">= {s.largest} (every size tried)"
    if s.status == search.NOTHING:
        return f"none ({s.failing} does not fit)"
    low = f">= {s.largest}" if s.largest else ""
    high = f"< {s.failing}" if s.failing else ""
    return (", ".join(x for x in (low, high) if x) + (" (error)" if errors else " (unfinished)"))


def measured(results: Results, workload: str, allocator: str, cap_gib: float, dim: str,
             seq_step: int) -> int | None:
    """The largest size found, or None while the row is unfinished."""
    s = state(results, workload, allocator, cap_gib, dim, seq_step)
    return s.largest if s is not None and s.status == search.FOUND else None


def common_size(results: Results, workload: str, cap_gib: float, dim: str,
                allocators: Iterable[str], seq_step: int) -> int | None:
    """The largest size every allocator fits (each row found or fitting every size tried)."""
    sizes = []
    for a in allocators:
        s = state(results, workload, a, cap_gib, dim, seq_step)
        if s is None or s.status not in (search.FOUND, search.EVERY) or s.largest == 0:
            return None
        sizes.append(s.largest)
    return min(sizes) if sizes else None


def _gain(vl: int | None, other: int | None) -> str:
    return f"x{vl / other:.2f}" if vl and other else "-"


def capacity_table(results: Results, rows: Iterable[tuple[str, float]],
                   predict: Callable[[str, str, float, str], int | None],
                   seq_step: int) -> str:
    """One line per (workload, cap) in `rows` and allocator: the largest micro-batch and
    sequence, the planner's prediction with its error, and vramledger's gain over each torch
    allocator (its largest over theirs)."""
    lines = ["| workload | cap GiB | allocator | largest batch (seq) | plan --fit batch (error) | "
             "largest seq (batch) | plan --fit seq (error) | vramledger gain, batch: over "
             "native / expandable | gain, seq: over native / expandable |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workload, cap in rows:
        w = WORKLOADS[workload]
        for a in ALLOCATOR_ORDER:
            cols = []
            for dim in ("batch", "seq"):
                fixed = w.seq_for_batch if dim == "batch" else w.batch_for_seq
                cols.append(f"{cell(results, workload, a, cap, dim, seq_step)} ({fixed})")
                pred, got = predict(workload, a, cap, dim), measured(results, workload, a, cap,
                                                                     dim, seq_step)
                err = f" ({100 * (pred - got) / got:+.1f}%)" if pred is not None and got else ""
                cols.append("-" if pred is None else f"{pred}{err}")
            gains = ["", ""]
            if a == "vramledger":
                gains = [" / ".join(_gain(measured(results, workload, a, cap, dim, seq_step),
                                          measured(results, workload, o, cap, dim, seq_step))
                                    for o in ("torch", "torch-expandable"))
                         for dim in ("batch", "seq")]
            lines.append(f"| {w.title} | {cap:g} | {NAMES[a]} | " + " | ".join(cols + gains)
                         + " |")
    return "\n".join(lines)


def errors_table(results: Results, groups: Iterable[tuple[str, float, str]],
                 models: dict[str, Callable[[str, str, float, str], int | None]],
                 role: Callable[[str, float, str, str], str], seq_step: int) -> str:
    """Per row with a measured limit: its role (calibration or evaluation), the limit, what one
    step of the search is there, and each model's prediction with its error; then, per model and
    role, on how many rows the error is within 5%."""
    names = list(models)
    lines = ["| workload | cap GiB | dimension | allocator | role | measured | one step | "
             + " | ".join(f"{m} (error)" for m in names) + " |",
             "|---" * (7 + len(names)) + "|"]
    within: dict[tuple[str, str], list[bool]] = {}
    for workload, cap, dim in groups:
        for a in ALLOCATOR_ORDER:
            got = measured(results, workload, a, cap, dim, seq_step)
            if not got:
                continue
            r = role(workload, cap, dim, a)
            step = (f"{100 / got:.1f}%" if dim == "batch"
                    else f"searched {seq_step} apart ({100 * seq_step / got:.1f}%)")
            cols = []
            for m in names:
                pred = models[m](workload, a, cap, dim)
                if pred is None:
                    cols.append("-")
                    continue
                err = (pred - got) / got
                within.setdefault((m, r), []).append(abs(err) <= 0.05)
                cols.append(f"{pred} ({100 * err:+.1f}%)")
            lines.append(f"| {WORKLOADS[workload].title} | {cap:g} | {dim} | {NAMES[a]} | {r} | "
                         f"{got} | {step} | " + " | ".join(cols) + " |")
    lines.append("")
    for m in names:
        counts = [f"{sum(v)} of {len(v)} {r} rows" for (mm, r), v in sorted(within.items())
                  if mm == m]
        lines.append(f"{m}: within 5% on " + (", ".join(counts) or "no rows") + ".")
    return "\n".join(lines)


def retries_table(results: Results, rows: Iterable[tuple[str, float, str]],
                  seq_step: int) -> str:
    """At the largest size all three allocators fit: each one's alloc retries per step, its
    median step time (the trial's six steps) and, where the record has them, its device allocs,
    frees, all-stream syncs and retries per steady step, and vramledger's driver time and waits
    per steady step."""
    lines = ["| workload | cap GiB | dimension | size all three fit | allocator | retries per step "
             f"| median step s | device allocs / frees / syncs / retries per steady step | "
             f"{LEDGER_COLUMN} |",
             "|---" * 9 + "|"]
    for workload, cap, dim in rows:
        size = common_size(results, workload, cap, dim, ALLOCATOR_ORDER, seq_step)
        for a in ALLOCATOR_ORDER:
            r = results.get(workload, a, cap, dim, size) if size else None
            if r is None or not r.get("fits"):
                figures = "- | - | - | -"
            else:
                steps = r.get("steps") or len(r["step_s"])
                figures = (f"{r['retries'] / steps:.2f} | "
                           f"{r['median_step_s']:.3f} | {counters([r])} | {ledger([r])}")
            lines.append(f"| {WORKLOADS[workload].title} | {cap:g} | {dim} | "
                         f"{size if size else '-'} | {NAMES[a]} | {figures} |")
    return "\n".join(lines)


def counters(runs: list[dict]) -> str:
    """Per steady step over the fitting `runs` that have the per-step counters: device allocs /
    frees / syncs / retries; "-" when none has them."""
    return _per_steady_step(runs, COUNTERS)


def ledger(runs: list[dict]) -> str:
    """Per steady step over the fitting `runs` that have vramledger's own figures: driver ms,
    waits and their ms, then cuMemMap and cuMemUnmap calls and old mappings taken back ("- / - /
    -" where the runs predate those); "-" when none has them (torch's allocators, records written
    before they were kept)."""
    timing = _per_steady_step(runs, VRAMLEDGER_FIGURES)
    if timing == "-":
        return "-"
    mappings = _per_steady_step(runs, VRAMLEDGER_MAPPINGS)
    return f"{timing} / {'- / - / -' if mappings == '-' else mappings}"


def _per_steady_step(runs: list[dict], fields: tuple[str, ...]) -> str:
    have = [r for r in runs if r.get("fits") and len(r.get(fields[0]) or ()) > WARM_STEPS
            and all(isinstance(r.get(f), list) for f in fields)]
    if not have:
        return "-"
    steps = sum(len(r[fields[0]]) - WARM_STEPS for r in have)
    return " / ".join(f"{sum(sum(r[f][WARM_STEPS:]) for r in have) / steps:.2f}"
                      for f in fields)
