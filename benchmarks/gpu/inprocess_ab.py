"""In-process step-time A/B: torch's native allocator and vramledger in one process (issues 3, 7).

Whole processes on the H200 machine differ by up to 15% in speed (step_ab's A/A control,
docs/design/step-time-measurement.md), which hides a 2% target. Here one process holds both
allocators: vramledger is installed as usual (vramledger.install(), torch's
CUDAPluggableAllocator), torch's native caching allocator is kept, and the helper library
(allocator_swap.cc, beside the plugin) makes one or the other torch's current allocator between
steps, after a synchronize. Every tensor is freed by the allocator that made it (torch's DataPtr
carries its deleter), so each allocator serves the steps it is current for: the activations,
gradients and temporaries of that step; the model and the optimizer state stay where they were
first made (vramledger).

The workloads are workloads_compare.py's (capture.py's models, batch and sequence-length ranges).
Each group runs one training step under each mode, the order rotated from group to group:
native, vramledger, native-again (native once more: the A/A control of the method itself). The
first step at a sequence length the process has not run before takes up to twice as long as the
next one, whatever the allocator (torch's per-shape work; H200, session 8: GPT-2 0.21 s, then
0.08 s twice), so a group's steps must all be new lengths or all be repeats:
  --lengths fresh (default)  as in training: every timed step runs a length never run before in
        the process; a group takes three adjacent lengths L, L+1, L+2 (from a shuffle of the
        workload's range cut into such triples), the i-th step of the group running L+i. The
        rotation gives each mode each offset equally often (one token of 128-2048 changes a
        step by well under 1%, and cancels over the rotation).
  --lengths repeat  harsher on the allocator: one length per group, first run by an untimed
        priming step (on native; under the shim on the plugin, see below), so the timed steps
        are the shorter repeats and an allocator's cost is a larger share of them. Priming on
        native favours native: its cache has just served that length, while vramledger's timed
        step follows its own step of another length.
The first --warmup groups are not counted. Per group, the
ratio of a mode's step to native's step of the same group; the verdict is on the median over
groups, with a bootstrap 90% interval (5,000 resamplings of the groups, seeded): "shown" when the
interval lies at or under --target, "refuted" when above it, otherwise "neither". Losses are not
compared (each group trains three steps); workloads_compare.py compares them, a process each.

Also printed per workload: vramledger's driver calls (cuMem*, cudaMalloc, cudaFree; the cheap
cudaEvent* calls left out) in the counted groups' vramledger steps (median and last three) and
the driver time of those steps (all calls, measured around each) as a share of the step.

Issue 7 (--shim LIB): torch's native allocator cannot be reached in a process where the
LD_PRELOAD shim has chosen torch's cudaMallocAsync backend (torch picks its backend once, when
libc10_cuda loads, and exports only the current one). So each workload also runs under the shim,
where the modes are shim (that backend, its calls served by the shim), vramledger (the plugin, a
second vramledger in the process) and shim-again, and the shim's ratio to native is chained:
median(vramledger / native) in the plain process times median(shim / vramledger) under the shim,
both ratios inside one process, with a bootstrap interval over both sets of groups.

Usage: python inprocess_ab.py [--workloads gpt2m,llama1b,llama1b-ckpt] [--groups 30]
       [--warmup 4] [--lengths fresh|repeat] [--target 1.02] [--shim LIB [--shim-target 1.03]]
       [--json OUT.json]
       python inprocess_ab.py --pool A.json B.json ...   (no GPU: the groups of earlier runs
       pooled per workload, reference and lengths, each ratio still inside one process)
Env: VRAMLEDGER_PLUGIN (the plugin; the helper is found beside it unless VRAMLEDGER_AB_SWAP names
it), VRAMLEDGER_CONF (default expandable_segments:True).
Exit status: 0 when every workload ran (whatever the verdict), 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
RESULT = "RESULT_JSON "


def summarize(groups: list[dict], mode: str, target: float, base: str = "native",
              resamples: int = 5000, seed: int = 0) -> dict:
    """`mode` against `base` over groups (each: mode -> step seconds, all of one sequence length).

    Returns the per-group ratios (mode / base of the same group), their median, a bootstrap 90%
    interval of the median (`resamples` resamplings of the groups, seeded), the ratio of the
    modes' median steps, and a verdict on `target` (e.g. 1.02): "shown" when the interval lies at
    or under it, "refuted" when it lies above, otherwise "neither".

    Raises:
      ValueError: no group has both `mode` and `base`.
    """
    both = [g for g in groups if g.get(mode) and g.get(base)]
    if not both:
        raise ValueError(f"no group has both {mode!r} and {base}")
    ratios = [g[mode] / g[base] for g in both]
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                  for _ in range(resamples))
    return {
        "groups": len(both),
        "ratio": statistics.median(ratios),
        "interval90": interval90(boot),
        "median_step_ratio": (statistics.median(g[mode] for g in both) /
                              statistics.median(g[base] for g in both)),
        "target": target,
        "verdict": verdict(interval90(boot), target),
    }


def interval90(sorted_samples: list[float]) -> list[float]:
    """The 5th and 95th percentiles of sorted bootstrap samples."""
    n = len(sorted_samples)
    return [sorted_samples[int(0.05 * n)], sorted_samples[int(0.95 * n) - 1]]


def verdict(interval: list[float], target: float) -> str:
    return "shown" if interval[1] <= target else "refuted" if interval[0] > target else "neither"


def chained(first: list[dict], second: list[dict], target: float, resamples: int = 5000,
            seed: int = 0) -> dict:
    """The shim against native through vramledger's plugin, from two processes' groups:
    median(vramledger / native) over `first`'s groups times median(shim / vramledger) over
    `second`'s. Each factor is a ratio inside one process, so neither process's own speed
    enters. The 90% interval is the bootstrap's over both sets of groups resampled
    independently (seeded); the verdict as summarize's.

    Raises:
      ValueError: a set has no group with both of its modes.
    """
    a = [g["vramledger"] / g["native"] for g in first if g.get("vramledger") and g.get("native")]
    b = [g["shim"] / g["vramledger"] for g in second if g.get("shim") and g.get("vramledger")]
    if not a or not b:
        raise ValueError("chained: both runs need groups with their two modes")
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(a, k=len(a))) *
                  statistics.median(rng.choices(b, k=len(b))) for _ in range(resamples))
    iv = interval90(boot)
    return {"ratio": statistics.median(a) * statistics.median(b), "interval90": iv,
            "target": target, "verdict": verdict(iv, target)}


def swap_library():
    """The helper (allocator_swap.cc) loaded by ctypes, with its signatures declared."""
    import ctypes
    path = os.environ.get("VRAMLEDGER_AB_SWAP") or os.path.join(
        os.path.dirname(os.environ.get("VRAMLEDGER_PLUGIN", "")),
        "libvramledger_allocator_swap.so")
    lib = ctypes.CDLL(path)
    lib.vramledger_ab_current.restype = ctypes.c_void_p
    lib.vramledger_ab_store.argtypes = [ctypes.c_void_p]
    lib.vramledger_ab_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.vramledger_ab_name.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]

    def name(allocator) -> str:
        buf = ctypes.create_string_buffer(64)
        lib.vramledger_ab_name(allocator, buf, len(buf))
        return buf.value.decode()

    lib.name = name
    return lib


def fresh_triples(lo: int, hi: int, count: int, seed: int) -> list[int]:
    """`count` starting lengths L of disjoint triples (L, L+1, L+2) inside [lo, hi], shuffled
    (seeded), so that no length repeats. Raises ValueError when the range holds fewer triples."""
    starts = list(range(lo, hi - 1, 3))
    if len(starts) < count:
        raise ValueError(f"[{lo}, {hi}] holds {len(starts)} triples of fresh lengths, "
                         f"{count} asked for")
    random.Random(seed).shuffle(starts)
    return starts[:count]


def child(workload: str, groups: int, warmup: int, seed: int, lengths: str = "fresh") -> None:
    """One workload's groups in this process; prints RESULT_JSON with every group's steps.

    torch's allocator at start names the reference: "native" in a plain process; under the
    LD_PRELOAD shim, torch's cudaMallocAsync backend, whose calls the shim serves ("shim"). The
    modes are then (reference, vramledger, reference-again). With `lengths` "repeat", the
    untimed priming step runs on native in a plain process and on vramledger's plugin under the
    shim, so that the mode each ratio's numerator names (vramledger / native, shim / vramledger)
    never follows its own step of the same length."""
    import torch  # noqa: F401  (loads libc10_cuda before the helper needs its symbols)

    swap = swap_library()
    first = swap.vramledger_ab_current()
    started = swap.name(first)
    shimmed = "libvramledger_preload" in os.environ.get("LD_PRELOAD", "")
    if started == "native" and not shimmed:
        base, prime = "native", "native"
    elif started == "cudaMallocAsync" and shimmed:
        base, prime = "shim", "vramledger"
        # torch parses PYTORCH_CUDA_ALLOC_CONF again on first use and asserts that the backend
        # it names is the current allocator's (CUDAAllocatorConfig.cpp, "parsed at runtime !=
        # parsed at load time"): the shim's backend:cudaMallocAsync would then fail against the
        # pluggable one. The backend is chosen already (at load); the variable is done with.
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        raise RuntimeError(f"torch's allocator at start is {started!r} (LD_PRELOAD "
                           f"{os.environ.get('LD_PRELOAD')!r}): expected native, or "
                           "cudaMallocAsync under the shim")
    import vramledger
    vramledger.install()
    plugged = swap.vramledger_ab_current()
    assert swap.name(plugged) == "pluggable", swap.name(plugged)
    from workloads_compare import make

    torch.manual_seed(0)
    model, p = make(workload)
    model = model.cuda()  # under vramledger; torch's lazy init sets up only the current allocator
    if swap.vramledger_ab_init(first, torch.cuda.device_count()) < 0:
        raise RuntimeError(f"torch's {started} allocator could not be initialized (stderr)")
    if p["ckpt"]:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    modes = (base, "vramledger", base + "-again")
    current = {base: first, base + "-again": first, "vramledger": plugged}

    def step(seq: int) -> float:
        x = torch.randint(0, p["vocab"], (p["batch"], seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    def driver_calls() -> tuple[int, float]:
        f = vramledger.fragmentation()["driver_calls"]
        return (sum(v["count"] for k, v in f.items() if not k.startswith("cudaEvent")),
                sum(v["time_us"] for v in f.values()))

    rng = random.Random(seed)
    starts = (fresh_triples(p["lo"], p["hi"], warmup + groups, seed) if lengths == "fresh"
              else None)
    out = []
    for g in range(warmup + groups):
        seq = starts[g] if starts else rng.randint(p["lo"], p["hi"])
        order = modes[g % 3:] + modes[:g % 3]
        row = {"seq": seq, "order": list(order), "warmup": g < warmup, "lengths": lengths}
        steps = order if starts else ("prime",) + order
        for i, mode in enumerate(steps):
            torch.cuda.synchronize()
            swap.vramledger_ab_store(current[prime if mode == "prime" else mode])
            before = driver_calls()
            t0 = time.perf_counter()
            loss = step(seq + i if starts else seq)
            torch.cuda.synchronize()
            row[mode] = time.perf_counter() - t0
            if mode == "vramledger":
                after = driver_calls()
                row["vramledger_driver_calls"] = after[0] - before[0]
                row["vramledger_driver_us"] = round(after[1] - before[1], 1)
            if loss != loss:  # NaN: the step itself went wrong
                raise RuntimeError(f"{workload} group {g} {mode}: loss is NaN")
        out.append(row)
    swap.vramledger_ab_store(plugged)  # vramledger current again for the exit
    s = vramledger.memory_stats()
    print(RESULT + json.dumps(dict(
        workload=workload, base=base, groups=out,
        vramledger_peak_reserved=s["reserved_bytes.all.peak"],
        vramledger_peak_allocated=s["allocated_bytes.all.peak"])), flush=True)


def run(workload: str, a: argparse.Namespace, shim: str | None = None) -> dict:
    """One child process for `workload`; under the LD_PRELOAD shim `shim` when given."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.setdefault("VRAMLEDGER_CONF", "expandable_segments:True")
    if shim:  # the shim's exit dump and its lines on stderr are not what is measured here
        env.update(LD_PRELOAD=shim, VRAMLEDGER_PRELOAD_QUIET="1",
                   VRAMLEDGER_PRELOAD_NO_EXIT_DUMP="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload,
                           "--groups", str(a.groups), "--warmup", str(a.warmup),
                           "--seed", str(a.seed), "--lengths", a.lengths], env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"--- {workload}{' under the shim' if shim else ''} failed "
                         f"({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n")
        return dict(workload=workload, failed=True, base="shim" if shim else "native")
    return json.loads(lines[-1][len(RESULT):])


def table_rows(r: dict, target: float) -> list[str]:
    """Markdown rows of one child's result (sets r["verdicts"])."""
    w, base = r["workload"], r["base"]
    if r.get("lengths"):
        w += f" ({r['lengths']} lengths)"
    if r.get("failed"):
        return [f"| {w} | {base}: FAILED | | | | | |"]
    counted = [g for g in r["groups"] if not g["warmup"]]
    calls = [g["vramledger_driver_calls"] for g in counted]
    share = statistics.median(g["vramledger_driver_us"] / 1e6 / g["vramledger"] for g in counted)
    driver = (f"{statistics.median(calls):g}, {calls[-3:]}; driver time median "
              f"{100 * share:.2f}% of the step, last 3 "
              f"{[round(g['vramledger_driver_us'] / 1e3, 1) for g in counted[-3:]]} ms")
    # (numerator, denominator): vramledger / native in a plain process; under the shim, the
    # shim / vramledger's plugin (the factor chained() multiplies by).
    pairs = ([("vramledger", "native"), ("native-again", "native")] if base == "native" else
             [("shim", "vramledger"), ("shim-again", "shim")])
    rows, r["verdicts"] = [], {}
    for mode, ref in pairs:
        v = summarize(counted, mode, target, base=ref)
        r["verdicts"][f"{mode}/{ref}"] = v
        rows.append(
            f"| {w} | {mode} / {ref} | {v['groups']} | "
            f"{statistics.median(g[mode] for g in counted):.4f} / "
            f"{statistics.median(g[ref] for g in counted):.4f} | {v['ratio']:.4f} "
            f"[{v['interval90'][0]:.4f}, {v['interval90'][1]:.4f}] | {v['verdict']} at "
            f"{target} | {driver if mode == 'vramledger' else ''} |")
    return rows


def pooled(paths: list[str]) -> list[dict]:
    """The results of earlier --json outputs merged per (workload, reference, lengths): their
    counted groups one after another, so that each ratio stays a ratio inside one process while
    the median and its interval run over every process's groups. Runs made before --lengths
    existed were all "repeat". Raises ValueError naming a file that is not such an output."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        try:
            with open(path) as f:
                results = json.load(f)
            if not isinstance(results, list):
                raise TypeError(f"a list of results expected, found {type(results).__name__}")
            for r in results:
                if r.get("failed"):
                    continue
                counted = [g for g in r["groups"] if not g["warmup"]]
                lengths = counted[0].get("lengths", "repeat") if counted else "repeat"
                key = (r["workload"], r.get("base", "native"), lengths)
                m = merged.setdefault(key, dict(workload=key[0], base=key[1], lengths=lengths,
                                                groups=[], processes=0))
                m["groups"] += counted
                m["processes"] += 1
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"{path}: not an inprocess_ab --json output "
                             f"({type(e).__name__}: {e})") from e
    return list(merged.values())


def report(results: list[dict], target: float, shim_target: float) -> list[str]:
    """Table rows for child results (or pooled ones): each result's rows, then per workload and
    lengths the shim chained through the plugin when both a plain and a shimmed result exist."""
    lines = []
    for r in results:
        lines += table_rows(r, target if r["base"] == "native" else shim_target)
    for r in results:
        shimmed = [x for x in results if x["base"] == "shim" and x["workload"] == r["workload"]
                   and x.get("lengths") == r.get("lengths") and not x.get("failed")]
        if r["base"] != "native" or r.get("failed") or not shimmed:
            continue
        c = chained([g for g in r["groups"] if not g["warmup"]],
                    [g for g in shimmed[0]["groups"] if not g["warmup"]], shim_target)
        shimmed[0]["chained"] = c
        label = r["workload"] + (f" ({r['lengths']} lengths)" if r.get("lengths") else "")
        lines.append(f"| {label} | shim / native, chained | | | {c['ratio']:.4f} "
                     f"[{c['interval90'][0]:.4f}, {c['interval90'][1]:.4f}] | "
                     f"{c['verdict']} at {shim_target} | |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", default="gpt2m,llama1b,llama1b-ckpt")
    ap.add_argument("--groups", type=int, default=30, help="counted groups per workload")
    ap.add_argument("--warmup", type=int, default=4, help="groups run first and not counted")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sequence lengths")
    ap.add_argument("--lengths", choices=("fresh", "repeat"), default="fresh",
                    help="fresh: every timed step at a length new to the process (as in "
                         "training); repeat: the timed steps repeat a primed length (harsher)")
    ap.add_argument("--target", type=float, default=1.02,
                    help="ratio to native the verdict is about (issue 3: 1.02)")
    ap.add_argument("--shim", metavar="LIB",
                    help="also run each workload under this LD_PRELOAD shim (issue 7): the "
                         "shim against vramledger's plugin there, chained with the plugin "
                         "against native (verdict at --shim-target)")
    ap.add_argument("--shim-target", type=float, default=1.03,
                    help="the shim's ratio to native the chained verdict is about (issue 7)")
    ap.add_argument("--json", help="write every group and the verdicts here")
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="no GPU run: pool the groups of earlier --json outputs (per workload, "
                         "reference and lengths) and print the table over all of them")
    a = ap.parse_args()
    if a.groups < 1 or a.warmup < 0:
        ap.error("--groups must be at least 1 and --warmup at least 0")
    if a.shim and not os.path.isfile(a.shim):
        ap.error(f"--shim {a.shim}: no such file")
    if a.child:
        child(a.child, a.groups, a.warmup, a.seed, a.lengths)
        return 0
    lines = ["| workload | ratio | groups | median steps s | ratio, median over groups [90% "
             "interval] | verdict at target | vramledger driver calls per step (median, last 3) "
             "and driver time |", "|---|---|---|---|---|---|---|"]
    if a.pool:
        try:
            results = pooled(a.pool)
        except ValueError as e:
            ap.error(f"--pool: {e}")
        if not results:
            ap.error("--pool: the files hold no successful run")
        lines += report(results, a.target, a.shim_target)
        print("\n".join(lines))
        return 0
    results, ok = [], True
    for w in a.workloads.split(","):
        runs = [run(w, a)] + ([run(w, a, os.path.abspath(a.shim))] if a.shim else [])
        for r in runs:
            r.setdefault("lengths", a.lengths)
            results.append(r)
            ok = ok and not r.get("failed")
        rows = report(runs, a.target, a.shim_target)  # as each workload ends
        lines += rows
        print("\n".join(rows), flush=True)
    table = "\n".join(lines)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
