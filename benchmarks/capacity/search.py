"""The largest size that fits, by galloping from a guess and bisecting, over a monotone trial
(every size up to the limit fits, none above it). Sizes are multiples of `step` in [step, bound].
Standard library only: the tests drive it with a stand-in for the GPU trial."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

FOUND, NOTHING, EVERY, STOPPED, ERROR = (
    "found", "nothing fits", "fits at every size tried", "stopped", "error")


class Stop(Exception):
    """No time is left for another trial."""


@dataclasses.dataclass
class Search:
    """Where a search stands. `largest`: the largest size seen to fit (0: none); `failing`: the
    smallest size seen not to fit (None: none); `trials`: trials this search ran (not counting the
    known results it started from); `error`: why a trial failed other than by not fitting."""
    status: str
    largest: int
    failing: int | None
    trials: int = 0
    error: str | None = None


def bracket(known: Mapping[int, bool], step: int, bound: int) -> tuple[int, int]:
    """(lo, hi) in units of `step` from known results: lo the largest unit known to fit below the
    smallest known not to fit (hi; bound // step + 1 when none is known)."""
    top = bound // step
    hi = min((s // step for s, ok in known.items() if ok is False), default=top + 1)
    lo = max((s // step for s, ok in known.items() if ok and s // step < hi), default=0)
    return lo, hi


def status_of(lo: int, hi: int, top: int) -> str:
    if hi - lo > 1:
        return STOPPED
    return NOTHING if lo == 0 else EVERY if lo == top else FOUND


def largest_fit(fits: Callable[[int], bool | None], *, bound: int, step: int = 1,
                guess: int | None = None, spread: float = 0.05,
                known: Mapping[int, bool] | None = None,
                can_try: Callable[[], bool] = lambda: True) -> Search:
    """Searches the largest multiple of `step` in [step, bound] for which `fits(size)` is True.

    Starts from `known` results (size -> fits, e.g. an earlier run's), else tries `guess` (the
    planner's prediction; 1 step when None), then gallops up or down from it in strides of
    `spread` x guess that double each time, then bisects. Before each trial `can_try()` must
    allow it, else the search stops where it stands (status STOPPED). `fits` returns None for a
    trial that failed other than by running out of memory (status ERROR)."""
    if step < 1 or bound < step:
        raise ValueError(f"need 1 <= step <= bound, got step {step}, bound {bound}")
    top = bound // step
    seen = dict(known or {})
    lo, hi = bracket(seen, step, bound)
    g = min(top, max(1, round((guess or step) / step)))
    stride = max(1, math.ceil(spread * g))
    trials = 0
    while hi - lo > 1:
        if lo == 0 and hi == top + 1:
            k = g
        elif hi == top + 1:  # only fits known: gallop up
            k = min(top, lo + stride)
            stride *= 2
        elif lo == 0:  # only failures known: gallop down
            k = max(1, hi - stride)
            stride *= 2
        else:
            k = (lo + hi) // 2
        if not can_try():
            return Search(STOPPED, lo * step, hi * step if hi <= top else None, trials)
        ok = fits(k * step)
        trials += 1
        if ok is None:
            return Search(ERROR, lo * step, hi * step if hi <= top else None, trials,
                          error=f"the trial at {k * step} failed")
        seen[k * step] = ok
        lo, hi = (k, hi) if ok else (lo, k)
    return Search(status_of(lo, hi, top), lo * step, hi * step if hi <= top else None, trials)


def from_known(known: Mapping[int, bool], *, step: int, bound: int) -> Search:
    """Where the search stands on known results alone (no trial)."""
    lo, hi = bracket(known, step, bound)
    top = bound // step
    return Search(status_of(lo, hi, top) if known else STOPPED, lo * step,
                  hi * step if hi <= top else None)
