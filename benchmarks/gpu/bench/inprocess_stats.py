"""The figures of inprocess_ab.py, apart from the GPU: its step schedule, the ratios, bootstrap
intervals and verdicts, the shim's chained ratio, pooling of earlier outputs and the table.

Standard library only, so the CPU tests (tests/python/test_inprocess_ab.py) check all of it.
docs/design/step-time-measurement.md, "One process, both allocators", says why each is so.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics

# Every order of a group's three modes, cycled group by group: each mode takes each position
# equally often over six groups, and each ordered pair of positions once, so neither a position
# effect nor (fresh lengths) a length offset favours a mode, for a median as for a mean.
ORDERS = tuple(itertools.permutations(range(3)))


def modes_for(base: str) -> tuple[str, str, str]:
    """The modes of a process whose reference allocator is `base` ("native" or "shim")."""
    return (base, "vramledger", base + "-again")


def fresh_triples(lo: int, hi: int, count: int, seed: int) -> list[int]:
    """`count` starting lengths L of disjoint triples (L, L+1, L+2) inside [lo + 1, hi], shuffled
    (seeded), so that no length repeats; `lo` itself is left for the untimed setup step.
    Raises ValueError when the range holds fewer triples."""
    starts = list(range(lo + 1, hi - 1, 3))
    if len(starts) < count:
        raise ValueError(f"[{lo + 1}, {hi}] holds {len(starts)} triples of fresh lengths, "
                         f"{count} asked for")
    random.Random(seed).shuffle(starts)
    return starts[:count]


def schedule(group: int, base: str, lengths: str, seq: int) -> list[tuple[str, int]]:
    """The steps of group `group` as (mode, sequence length), in the order they run.

    repeat: an untimed "prime" step at `seq` first (its allocator: inprocess_ab's prime rule),
    then the three modes at `seq`. steady: untimed steps at `seq` on both allocators first
    ("prime" on the reference, "prime-vramledger"), so that every timed step repeats the length
    its own allocator served last, then the three modes at `seq`. fresh: the three modes at seq,
    seq+1, seq+2 by position. The order of the modes is ORDERS[group % 6].

    Raises ValueError for any other `lengths`."""
    modes = modes_for(base)
    order = [modes[i] for i in ORDERS[group % len(ORDERS)]]
    if lengths == "fresh":
        return [(mode, seq + i) for i, mode in enumerate(order)]
    if lengths == "repeat":
        return [("prime", seq)] + [(mode, seq) for mode in order]
    if lengths == "steady":
        return [("prime", seq), ("prime-vramledger", seq)] + [(mode, seq) for mode in order]
    raise ValueError(f"lengths must be 'fresh', 'repeat' or 'steady', not {lengths!r}")


def interval90(sorted_samples: list[float]) -> list[float]:
    """The 5th and 95th percentiles of sorted bootstrap samples."""
    n = len(sorted_samples)
    return [sorted_samples[int(0.05 * n)], sorted_samples[int(0.95 * n) - 1]]


def verdict(interval: list[float], target: float) -> str:
    """"shown" when the interval lies at or under target, "refuted" above, else "neither"."""
    return "shown" if interval[1] <= target else "refuted" if interval[0] > target else "neither"


def _ratios_by_process(groups: list[dict], mode: str, base: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for g in groups:
        if g.get(mode) and g.get(base):
            out.setdefault(str(g.get("process", "")), []).append(g[mode] / g[base])
    return out


def _resampled_median(by_process: dict[str, list[float]], rng: random.Random) -> float:
    """One bootstrap median: with one process, its groups resampled; with several, processes
    resampled first, then each drawn process's groups (a two-level bootstrap), so that runs that
    differ as processes widen the interval instead of being counted as independent groups."""
    procs = list(by_process.values())
    if len(procs) == 1:
        return statistics.median(rng.choices(procs[0], k=len(procs[0])))
    drawn = []
    for ratios in rng.choices(procs, k=len(procs)):
        drawn += rng.choices(ratios, k=len(ratios))
    return statistics.median(drawn)


def summarize(groups: list[dict], mode: str, target: float | None, base: str = "native",
              resamples: int = 5000, seed: int = 0) -> dict:
    """`mode` against `base` over groups (each: mode -> step seconds; a group's steps run one
    length, or with fresh lengths three adjacent ones; "process": the process it ran in).

    Returns the per-group ratios' median (mode / base of the same group), its bootstrap 90%
    interval (`resamples` resamplings, seeded; two-level when the groups come from several
    processes), the ratio of the modes' median steps, the number of groups and processes, and,
    when `target` is given, a verdict on it (e.g. 1.02).

    Raises:
      ValueError: no group has both `mode` and `base`.
    """
    by_process = _ratios_by_process(groups, mode, base)
    if not by_process:
        raise ValueError(f"no group has both {mode!r} and {base}")
    rng = random.Random(seed)
    boot = sorted(_resampled_median(by_process, rng) for _ in range(resamples))
    both = [g for g in groups if g.get(mode) and g.get(base)]
    out = {
        "groups": len(both),
        "processes": len(by_process),
        "ratio": statistics.median(r for rs in by_process.values() for r in rs),
        "interval90": interval90(boot),
        "median_step_ratio": (statistics.median(g[mode] for g in both) /
                              statistics.median(g[base] for g in both)),
    }
    if target is not None:
        out.update(target=target, verdict=verdict(out["interval90"], target))
    return out


def chained(first: list[dict], second: list[dict], target: float, resamples: int = 5000,
            seed: int = 0) -> dict:
    """The shim against native through vramledger's plugin: median(vramledger / native) over
    `first`'s groups (plain processes) times median(shim / vramledger) over `second`'s (shimmed
    processes). Each factor is a ratio inside one process, so no process's speed enters; it
    assumes the plugin costs the same beside the shim as without it. The 90% interval is the
    bootstrap's over both sides resampled independently (each two-level when it spans several
    processes, as summarize); the verdict as summarize's.

    Raises:
      ValueError: a side has no group with both of its modes.
    """
    a = _ratios_by_process(first, "vramledger", "native")
    b = _ratios_by_process(second, "shim", "vramledger")
    if not a or not b:
        raise ValueError("chained: both sides need groups with their two modes")
    rng = random.Random(seed)
    boot = sorted(_resampled_median(a, rng) * _resampled_median(b, rng)
                  for _ in range(resamples))
    iv = interval90(boot)
    ratio = (statistics.median(r for rs in a.values() for r in rs) *
             statistics.median(r for rs in b.values() for r in rs))
    return {"ratio": ratio, "interval90": iv, "processes": [len(a), len(b)], "target": target,
            "verdict": verdict(iv, target)}


def _lengths_of(result: dict, counted: list[dict]) -> str:
    if result.get("lengths"):
        return result["lengths"]
    if counted and counted[0].get("lengths"):  # the first fresh runs' outputs kept it per group
        return counted[0]["lengths"]
    # Outputs from before --lengths: primed groups were the repeat form; earlier ones had none.
    return "repeat" if counted and "prime" in counted[0] else "unprimed"


def pooled(paths: list[str]) -> list[dict]:
    """The results of earlier --json outputs merged per (workload, reference, lengths, conf):
    their counted groups one after another, each tagged with the process it ran in, so that every
    ratio stays inside one process and summarize / chained resample processes, then groups.

    Raises:
      ValueError: a file that is not such an output, or the same file or run given twice.
    """
    merged: dict[tuple, dict] = {}
    seen_paths, seen_runs = set(), set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen_paths:
            raise ValueError(f"{path}: given twice (its groups would count twice)")
        seen_paths.add(real)
        try:
            with open(path) as f:
                results = json.load(f)
            if not isinstance(results, list):
                raise TypeError(f"a list of results expected, found {type(results).__name__}")
            for k, r in enumerate(results):
                if r.get("failed"):
                    continue
                run_id = r.get("run_id") or f"{real}#{k}"
                if run_id in seen_runs:
                    raise ValueError(f"run {run_id} appears twice")
                seen_runs.add(run_id)
                counted = [dict(g, process=run_id) for g in r["groups"] if not g["warmup"]]
                key = (r["workload"], r.get("base", "native"), _lengths_of(r, counted),
                       r.get("conf", "unrecorded"))
                m = merged.setdefault(key, dict(workload=key[0], base=key[1], lengths=key[2],
                                                conf=key[3], groups=[], processes=0))
                m["groups"] += counted
                m["processes"] += 1
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"{path}: not an inprocess_ab --json output "
                             f"({type(e).__name__}: {e})") from e
    return list(merged.values())


def _label(r: dict) -> str:
    label = r["workload"]
    if r.get("lengths"):
        label += f" ({r['lengths']} lengths)"
    if r.get("conf") not in (None, "", "unrecorded", "expandable_segments:True"):
        label += f" [{r['conf']}]"
    return label


def _fmt(v: dict) -> str:
    return f"{v['ratio']:.4f} [{v['interval90'][0]:.4f}, {v['interval90'][1]:.4f}]"


def table_rows(r: dict, target: float) -> list[str]:
    """Markdown rows of one result (a child's or a pooled one; sets r["verdicts"]): under the
    reference native, vramledger / native with a verdict at `target` and the A/A control; under
    the shim, the factor shim / vramledger (no verdict: the chained row carries it) and the A/A
    control."""
    w, base = _label(r), r["base"]
    if r.get("failed"):
        return [f"| {w} | {base}: FAILED | | | | | |"]
    counted = [g for g in r["groups"] if not g["warmup"]]
    calls = [g["vramledger_driver_calls"] for g in counted]
    share = statistics.median(g["vramledger_driver_us"] / 1e6 / g["vramledger"] for g in counted)
    driver = (f"{statistics.median(calls):g}, {calls[-3:]}; driver time median "
              f"{100 * share:.2f}% of the step, last 3 "
              f"{[round(g['vramledger_driver_us'] / 1e3, 1) for g in counted[-3:]]} ms")
    # (numerator, denominator, verdict target or None)
    pairs = ([("vramledger", "native", target), ("native-again", "native", None)]
             if base == "native" else
             [("shim", "vramledger", None), ("shim-again", "shim", None)])
    rows, r["verdicts"] = [], {}
    for mode, ref, tgt in pairs:
        v = summarize(counted, mode, tgt, base=ref)
        r["verdicts"][f"{mode}/{ref}"] = v
        if tgt is not None:
            said = f"{v['verdict']} at {tgt}"
        else:
            said = "A/A control" if mode.endswith("-again") else "factor of the chained row"
        rows.append(
            f"| {w} | {mode} / {ref} | {v['groups']} ({v['processes']} proc.) | "
            f"{statistics.median(g[mode] for g in counted):.4f} / "
            f"{statistics.median(g[ref] for g in counted):.4f} | {_fmt(v)} | {said} | "
            f"{driver if mode == 'vramledger' else ''} |")
    return rows


HEADER = ["| workload | ratio | groups | median steps s | ratio, median over groups [90% "
          "interval] | verdict | vramledger driver calls per step (median, last 3) and driver "
          "time |", "|---|---|---|---|---|---|---|"]


def report(results: list[dict], target: float, shim_target: float) -> list[str]:
    """Table rows for child results (or pooled ones): each result's rows, then per workload,
    lengths and conf the shim chained through the plugin when both a plain and a shimmed result
    exist."""
    lines = []
    for r in results:
        lines += table_rows(r, target)
    same = ("workload", "lengths", "conf")
    for r in results:
        if r["base"] != "native" or r.get("failed"):
            continue
        shimmed = [x for x in results if x["base"] == "shim" and not x.get("failed")
                   and all(x.get(k) == r.get(k) for k in same)]
        if not shimmed:
            continue
        c = chained([g for g in r["groups"] if not g["warmup"]],
                    [g for g in shimmed[0]["groups"] if not g["warmup"]], shim_target)
        shimmed[0]["chained"] = c
        lines.append(f"| {_label(r)} | shim / native, chained | | | {_fmt(c)} | "
                     f"{c['verdict']} at {shim_target} | |")
    return lines
