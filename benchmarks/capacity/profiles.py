"""The capacity benchmark's profiled trials: where a step's host and device time go under each
allocator, at one row's size. The step rounds (step_rounds.py) say whether vramledger's step is
slower than torch's; the driver-call and wait counters say whether its own calls are why; this
says where the rest of the time goes, op by op, when neither is.

One trial per allocator (trial.py, each in its own process, --profile), its steps PROFILED_STEPS
each under torch.profiler (CPU activity, and CUDA activity on a GPU). Per step (summarize()): the
host ops (torch.profiler's key averages of CPU events) with their calls and self CPU time; the
total self CPU time of the host ops less the calls that wait for the GPU (WAITS: the step's
closing synchronize and the loss's copy to the host), those waits apart, and the device time of
the kernels and copies (the device rows alone: a host op's self device time repeats its kernels').
vramledger runs with its `host_timing` option, so the record also holds the host time of its own
allocations and frees per step; that option costs two clock reads per call, in vramledger's
steps alone. The profiler's overhead is in these steps' times, so a profiled trial's step times
are compared only with each other, never with the rounds'.

  python -m benchmarks.capacity.profiles run WORKLOAD CAP_GIB DIM SIZE --out DIR [--timeout-s S]
      (on the GPU machine; benchmarks/gpu/run.sh item `capprofile`) writes DIR/NAME.json per
      allocator (profile_name()), its trial record.
  python -m benchmarks.capacity.profiles compare DIR [--top N]
      (any machine) prints, per profiled step, each allocator's step time, total self CPU and
      device time over its ops and, under vramledger, its allocator's host time; then the ops
      whose self CPU time differs most between vramledger and torch native over those steps.
Exit status 0; 1 when a trial failed (run); 2 on bad arguments and when DIR's files cannot be
compared: no profile of vramledger and torch native both, a file that is not a profile, profiles
of different rows (compare).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterable

from benchmarks.capacity import refuse
from benchmarks.capacity.results import ALLOCATOR_ORDER

# The steady steps (after trial.py's first two, which fill the cache): lengths 0.3, 0.8, 1.0 and
# 0.45 of the longest (workloads.LENGTH_FRACTIONS), the third a length seen before, the others new.
PROFILED_STEPS = (2, 3, 4, 5)
MAX_OPS = 300  # host ops kept per step, by self CPU time
# Host calls that wait for the GPU: their self CPU time is the GPU's, not the host's work.
WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def profile_name(workload: str, allocator: str, cap_gib: float, dim: str, size: int) -> str:
    """The profile's file name (letters, digits, '.', '-' and '_' alone)."""
    return f"{workload}-{cap_gib:g}gib-{dim}{size}-{allocator}.json"


def start(torch):
    """A started torch.profiler over CPU activity, and CUDA activity where CUDA is there."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.start()
    return prof


def stop(prof) -> dict[str, Any]:
    """Stops `prof` (start()) and returns summarize() of its key averages."""
    prof.stop()
    return summarize(prof.key_averages())


def summarize(events: Iterable) -> dict[str, Any]:
    """One profiled step from torch.profiler's key averages: "ops", the host ops (CPU rows) with
    their name, calls, self CPU and total CPU time (us), the MAX_OPS with the most self CPU time,
    most first (ops with none left out); "self_cpu_us", the self CPU time of every host op but
    the WAITS; "gpu_wait_us", the WAITS'; "device_us", the self time of the device rows (kernels
    and copies). Totals are taken over every row, before the cut to MAX_OPS."""
    ops, device_us, host_us, wait_us = [], 0.0, 0.0, 0.0
    for e in events:
        if str(getattr(e, "device_type", "DeviceType.CPU")) != "DeviceType.CPU":
            device_us += float(e.self_device_time_total)
            continue
        self_cpu = float(e.self_cpu_time_total)
        if e.key in WAITS:
            wait_us += self_cpu
        else:
            host_us += self_cpu
        if self_cpu > 0:
            ops.append({"name": e.key, "calls": int(e.count), "self_cpu_us": self_cpu,
                        "cpu_us": float(e.cpu_time_total)})
    ops.sort(key=lambda o: (-o["self_cpu_us"], o["name"]))
    return {"ops": ops[:MAX_OPS], "self_cpu_us": host_us, "gpu_wait_us": wait_us,
            "device_us": device_us}


def _step_figures(record: dict, step: int) -> dict[str, float | None]:
    """A step's figures from its record (None where the record lacks them: a step that did not
    run, or one not profiled)."""
    prof = (record.get("profile") or {}).get(str(step))
    steps = record.get("step_s") or []
    host = record.get("step_host_us") or []

    def ms(key: str) -> float | None:
        return None if prof is None else prof[key] / 1e3

    return {"step_s": steps[step] if step < len(steps) else None,
            "self_cpu_ms": ms("self_cpu_us"), "gpu_wait_ms": ms("gpu_wait_us"),
            "device_ms": ms("device_us"),
            "allocator_host_ms": host[step] / 1e3 if step < len(host) else None}


def compare(records: dict[str, dict], top: int = 20) -> str:
    """The comparison compare() prints, from one profiled trial record per allocator (at least
    vramledger's and torch native's).

    Raises:
      ValueError: vramledger's or torch native's record is missing (the message names it).
    """
    for a in ("vramledger", "torch"):
        if a not in records:
            raise ValueError(f"no profile of {a}")
    present = [a for a in ALLOCATOR_ORDER if a in records]
    any_record = records["vramledger"]
    lines = [f"profiled steps of {any_record.get('workload')} at {any_record.get('cap_gib'):g} "
             f"GiB, {any_record.get('dim')} {any_record.get('size')} "
             f"({any_record.get('device', '?')}, torch {any_record.get('torch', '?')}):", "",
             "| step | allocator | step s | host ms (self CPU, all ops but waits) | GPU wait ms | "
             "device ms (kernels, copies) | allocator host ms (malloc + free) |",
             "|---|---|---|---|---|---|---|"]

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for step in PROFILED_STEPS:
        for a in present:
            f = _step_figures(records[a], step)
            lines.append(f"| {step + 1} | {a} | {fmt(f['step_s'], '.3f')} | "
                         f"{fmt(f['self_cpu_ms'], '.1f')} | {fmt(f['gpu_wait_ms'], '.1f')} | "
                         f"{fmt(f['device_ms'], '.1f')} | {fmt(f['allocator_host_ms'], '.2f')} |")

    def totals(record: dict) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for step in PROFILED_STEPS:
            for o in ((record.get("profile") or {}).get(str(step)) or {}).get("ops", []):
                t = out.setdefault(o["name"], [0.0, 0.0])
                t[0] += o["self_cpu_us"]
                t[1] += o["calls"]
        return out

    ours, theirs = totals(records["vramledger"]), totals(records["torch"])
    diffs = sorted(((ours.get(n, [0, 0])[0] - theirs.get(n, [0, 0])[0], n)
                    for n in set(ours) | set(theirs)), key=lambda d: (-abs(d[0]), d[1]))
    lines += ["", f"ops whose self CPU time over steps {PROFILED_STEPS[0] + 1}-"
                  f"{PROFILED_STEPS[-1] + 1} differs most, vramledger - torch native:", "",
              "| op | vramledger ms (calls) | torch native ms (calls) | difference ms |",
              "|---|---|---|---|"]
    for d, name in diffs[:top]:
        o, t = ours.get(name, [0, 0]), theirs.get(name, [0, 0])
        lines.append(f"| {name} | {o[0] / 1e3:.2f} ({o[1]:.0f}) | {t[0] / 1e3:.2f} ({t[1]:.0f}) | "
                     f"{d / 1e3:+.2f} |")
    return "\n".join(lines)


def load(out_dir: str) -> dict[str, dict]:
    """The profiled trial records in `out_dir` by allocator.

    Raises:
      ValueError: a file that is not JSON or not a trial record, two records of one allocator, or
        records of different rows (the message names the files).
    """
    records = {}
    for name in sorted(os.listdir(out_dir)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(out_dir, name)
        with open(path, encoding="utf-8") as f:
            try:
                r = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(r, dict) or r.get("allocator") not in ALLOCATOR_ORDER:
            raise ValueError(f"{path}: not a profiled trial record (no known \"allocator\")")
        if r["allocator"] in records:
            raise ValueError(f"{path}: a second profile of {r['allocator']} in {out_dir}")
        records[r["allocator"]] = r
    rows = {(r.get("workload"), r.get("cap_gib"), r.get("dim"), r.get("size")): a
            for a, r in records.items()}
    if len(rows) > 1:
        raise ValueError(f"{out_dir}: profiles of different rows: "
                         + "; ".join(f"{a}: {w} {c:g} GiB {d} {n}" if isinstance(c, (int, float))
                                     else f"{a}: {w} {c} GiB {d} {n}"
                                     for (w, c, d, n), a in sorted(rows.items(), key=str)))
    return records


def run(workload: str, cap_gib: float, dim: str, size: int, out_dir: str,
        timeout_s: float = 240.0) -> int:
    """One profiled trial per allocator; returns how many failed (no record written for them)."""
    from benchmarks.capacity import trial, workloads
    batch, seq = workloads.WORKLOADS[workload].shape(dim, size)
    os.makedirs(out_dir, exist_ok=True)
    failed = 0
    for a in ALLOCATOR_ORDER:
        record = trial.run_trial(workload, a, cap_gib, dim, size, timeout_s, profile=True,
                                 host_timing=(a == "vramledger"))
        record.update(workload=workload, allocator=a, cap_gib=cap_gib, dim=dim, size=size,
                      batch=batch, seq=seq)
        if record.get("fits") is None or "profile" not in record:
            print(f"profiles: {a}: {record.get('error') or 'no profile'}", file=sys.stderr)
            failed += 1
            continue
        with open(os.path.join(out_dir, profile_name(workload, a, cap_gib, dim, size)), "w",
                  encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        print(f"profiles: {a}: fits {record['fits']}, steps "
              + " ".join(f"{s:.3f}" for s in record["step_s"]))
    return failed


def main(argv=None) -> int:
    from benchmarks.capacity import workloads
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.profiles",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="profiled trials at one row's size (GPU machine)")
    workloads.add_row_arguments(r)
    r.add_argument("--out", required=True)
    r.add_argument("--timeout-s", type=float, default=240.0)
    c = sub.add_parser("compare", help="compare the profiles in a directory")
    c.add_argument("out_dir")
    c.add_argument("--top", type=int, default=20)
    a = ap.parse_args(argv)
    if a.command == "run":
        workloads.check_row(ap, a)
        return 1 if run(a.workload, a.cap_gib, a.dim, a.size, a.out, a.timeout_s) else 0
    if a.top < 1:
        ap.error(f"--top must be at least 1, got {a.top}")
    try:
        text = compare(load(a.out_dir), a.top)
    except OSError as e:
        ap.error(f"{a.out_dir}: {e.strerror}")
    except ValueError as e:
        return refuse("profiles", str(e))
    print(text)  # outside the try: a reader that closes the pipe is not a bad folder
    return 0


if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
