"""The capacity benchmark's loop: for each (workload, cap, dimension) and allocator, the largest
size that trains without running out of memory, searched from the planner's prediction, one
process per trial, within a time budget; then, at the largest size all three allocators fit, a
trial of each one that has none there (for its retries and step time)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable

from benchmarks.capacity import search, table
from benchmarks.capacity.results import Results
from benchmarks.capacity.workloads import WORKLOADS, size_grid

# A trial: (workload, allocator, cap GiB, dimension, size, timeout s) -> its record
# (trial.run_trial).
Trial = Callable[[str, str, float, str, int, float], dict]


class Budget:
    """The run's deadline, and whether another trial fits before it (a trial is expected to take
    the median of those run so far, `first_s` before any)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic,
                 first_s: float = 30.0):
        self.clock, self.deadline, self.first_s = clock, clock() + seconds, first_s
        self.walls: list[float] = []

    def left(self) -> float:
        return self.deadline - self.clock()

    def expected(self) -> float:
        return statistics.median(self.walls) if self.walls else self.first_s

    def can_try(self) -> bool:
        return self.left() >= self.expected()


def run_one(trial: Trial, budget: Budget, workload: str, allocator: str, cap: float, dim: str,
            size: int, *, trial_timeout_s: float = 240.0, label: str = "trial",
            log: Callable[[str], None] = print) -> dict:
    """Runs one trial within the budget and returns its record with the trial's coordinates;
    raises search.Stop when the budget cut it off (not a result)."""
    batch, seq = WORKLOADS[workload].shape(dim, size)
    timeout = min(trial_timeout_s, budget.left())
    t0 = budget.clock()
    r = trial(workload, allocator, cap, dim, size, timeout)
    budget.walls.append(budget.clock() - t0)
    if r.get("timed_out") and timeout < trial_timeout_s:
        log(f"{label} {workload} {allocator} {cap:g} GiB {dim} {size}: cut off by the budget")
        raise search.Stop()  # not a result: the budget ended it
    r.update(workload=workload, allocator=allocator, cap_gib=cap, dim=dim, size=size,
             batch=batch, seq=seq)
    verdict = {True: "fits", False: "out of memory", None: f"ERROR {r.get('error')}"}
    log(f"{label} {workload} {allocator} {cap:g} GiB {dim} {size} (batch {batch}, seq {seq}): "
        f"{verdict[r.get('fits')]}, {budget.walls[-1]:.1f} s")
    return r


def run_grid(groups: Iterable[tuple[str, float, str]], allocators: Iterable[str], trial: Trial,
             results: Results, budget: Budget,
             predict: Callable[[str, str, float, str], int | None], *, seq_step: int = 64,
             spread: float = 0.05, trial_timeout_s: float = 240.0,
             log: Callable[[str], None] = print) -> None:
    """Searches every group x allocator, storing each trial in `results` as it ends."""
    allocators = list(allocators)

    def run_one_stored(workload: str, allocator: str, cap: float, dim: str,
                       size: int) -> bool | None:
        r = run_one(trial, budget, workload, allocator, cap, dim, size,
                    trial_timeout_s=trial_timeout_s, log=log)
        results.add(r)
        return r.get("fits")

    # vramledger first: its limit, once measured, is where the torch allocators' searches start
    # (under a cap they land near it, nearer than the planner's allowance for them says).
    order = [a for a in ("vramledger", "torch-expandable", "torch") if a in allocators]
    for workload, cap, dim in groups:
        w = WORKLOADS[workload]
        step, bound = size_grid(w, dim, seq_step)
        guesses = {a: predict(workload, a, cap, dim) for a in order}
        start = None  # the last limit this group measured
        for a in order:
            guess = start or guesses[a] or max((g for g in guesses.values() if g), default=None)
            try:
                s = search.largest_fit(
                    lambda size, a=a: run_one_stored(workload, a, cap, dim, size), bound=bound,
                    step=step, guess=guess, spread=spread,
                    known=results.known(workload, a, cap, dim), can_try=budget.can_try)
            except search.Stop:
                s = search.Search(search.STOPPED, 0, None)
            if s.status == search.FOUND:
                start = s.largest
            log(f"search {workload} {a} {cap:g} GiB {dim}: {s.status}, largest {s.largest}, "
                f"{s.trials} trial(s), planner {guesses[a]}")
        # Retries and step time at the largest size all three fit: a trial of each allocator
        # there, where its search did not leave one.
        size = table.common_size(results, workload, cap, dim, allocators, seq_step)
        for a in order if size else ():
            if results.get(workload, a, cap, dim, size) is None and budget.can_try():
                try:
                    run_one_stored(workload, a, cap, dim, size)
                except search.Stop:
                    break
