"""The capacity benchmark's traced trials: what each allocator did, request by request, at the
sizes where the step-time comparison and the limits are read, so the reasons behind a slow step
can be studied on a machine without a GPU (`vramledger replay`, trace_steps.py).

With --traces DIR (benchmarks/gpu/run.sh: CAPACITY_TRACES=1, DIR $OUT/traces), after the searches
and the step rounds, for each row asked for with a measured size: one trial per traced allocator
(--trace-allocators, CAPACITY_TRACE_ALLOCATORS; vramledger by default) at the largest size all three
allocators fit and at vramledger's own limit, each in its own process with its allocator's memory
history on (trial.py), writing DIR/WORKLOAD-CAPgib-DIMSIZE-ALLOCATOR.pickle.gz (a snapshot whose
trace marks each step's end with a `snapshot` entry) and its record, by that file name, into
DIR/traces.json. A traced trial's step times include the recording's cost, so its record stays out
of the results file and the tables. A trace already in DIR with its record is not taken again,
unless that trial failed (its `fits` None: a crash, a timeout) or wrote no file.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Callable, Iterable

from benchmarks.capacity import runner, search, table
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results

INDEX = "traces.json"


def trace_name(workload: str, allocator: str, cap_gib: float, dim: str, size: int) -> str:
    """The trace's file name (letters, digits, '.', '-' and '_' alone)."""
    return f"{workload}-{cap_gib:g}gib-{dim}{size}-{allocator}.pickle.gz"


def sizes(results: Results, workload: str, cap_gib: float, dim: str, seq_step: int) -> list[int]:
    """The sizes a row's traces are taken at: the largest all three allocators fit and
    vramledger's limit, once measured (one size when they are the same)."""
    common = table.common_size(results, workload, cap_gib, dim, ALLOCATOR_ORDER, seq_step)
    limit = table.measured(results, workload, "vramledger", cap_gib, dim, seq_step)
    return sorted({s for s in (common, limit) if s})


def load_index(out_dir: str) -> dict[str, dict]:
    """DIR/traces.json's records by trace name; {} when there is none yet."""
    path = os.path.join(out_dir, INDEX)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not all(isinstance(r, dict) for r in doc.values()):
        raise ValueError(f"{path}: not an object of trace records by file name")
    return doc


def record_traces(groups: Iterable[tuple[str, float, str]], allocators: Iterable[str],
                  trial: runner.Trial, results: Results, budget: runner.Budget, out_dir: str,
                  *, seq_step: int = 64, trial_timeout_s: float = 240.0,
                  log: Callable[[str], None] = print) -> int:
    """Takes the traces of every group with a measured size, each allocator in ALLOCATOR_ORDER,
    skipping those already in `out_dir`; stops where the budget ends. Returns how many it took."""
    os.makedirs(out_dir, exist_ok=True)
    index = load_index(out_dir)
    taken = 0
    allocators = [a for a in ALLOCATOR_ORDER if a in set(allocators)]
    for workload, cap, dim in groups:
        row = sizes(results, workload, cap, dim, seq_step)
        if not row:
            log(f"traces {workload} {cap:g} GiB {dim}: no size measured yet")
        for size in row:
            for a in allocators:
                name = trace_name(workload, a, cap, dim, size)
                path = os.path.join(out_dir, name)
                if (name in index and index[name].get("fits") is not None
                        and os.path.exists(path)):
                    continue
                if not budget.can_try():
                    log(f"traces: the budget ended before {name}")
                    return taken
                try:
                    record = runner.run_one(functools.partial(trial, trace=path), budget,
                                            workload, a, cap, dim, size,
                                            trial_timeout_s=trial_timeout_s, label="trace",
                                            log=log)
                except search.Stop:
                    return taken
                if not os.path.exists(path) and not record.get("error"):
                    record["error"] = "the trial wrote no trace"
                index[name] = record
                _save(out_dir, index)
                taken += os.path.exists(path)
    return taken


def _save(out_dir: str, index: dict[str, dict]) -> None:
    path = os.path.join(out_dir, INDEX)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
