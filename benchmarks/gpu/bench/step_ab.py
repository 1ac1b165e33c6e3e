"""Step time of GPT-2-medium training, interleaved A/B over several rounds: torch's native
allocator, vramledger through the plugin (install()), and vramledger through the LD_PRELOAD shim
(expandable segments on), each in its own process (train_compare.py's child, the same seeds).

Step time varies between processes of the same script far more than the allocators differ
(native alone ranged 190-253 ms median across runs on the H200), so one run each proves nothing.
Each round runs every mode once, in a rotating order; the figure per run is the median step after
the first two (warm-up) steps; the verdict uses the median over rounds of the per-round ratio to
native, and prints the min-step ratio and the paired step ratio (each warm step over native's
same step in the same round, the same sequence length; median over rounds and steps) beside it,
with a bootstrap 90% interval of the median of rounds and a verdict on --target (shown: the
interval lies at or under it; refuted: above it; neither). Mode native-again runs native a
second time in each round: its ratios are the noise floor. --pool pools earlier --json outputs.
The calibrated ratios divide each run's median step by its own process's speed on fixed work
(train_compare.calibrate: a matmul, and kernel launches) before the ratio; n/a for runs without.

Usage (GPU machine; VRAMLEDGER_PLUGIN and PYTHONPATH as run.sh sets them):
  python step_ab.py [--rounds 3] [--steps 10] [--shim SO] [--json F] [--target 1.03] [--cpus 8]
                    [--modes native,plugin,shim,shim-noexp,torch-exp,torch-async,native-again]
  python step_ab.py --pool A.json B.json ... [--target 1.03]   (no GPU: the table over all rounds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = os.path.join(HERE, "..", "checks")  # train_compare.py
sys.path.insert(0, CHECKS)
from train_compare import host_share_over_rounds  # noqa: E402  (standard library only)
PREFIX = "RESULT_JSON "
MODES = ("native", "plugin", "shim", "shim-noexp", "torch-exp", "torch-async", "native-again")


def run(mode: str, steps: int, shim: str, cpus: list[int] | None = None) -> dict:
    """One training process of `mode`; returns its warm steps' figures (ms).

    Every mode's process gets the same PYTHONHASHSEED and, when `cpus` is given, the same CPU
    affinity, so two processes differ by as little as the machine allows.

    Raises:
      RuntimeError: the process failed or printed no result.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    # native-again: torch's native allocator in a second process per round, the A/A control
    # that shows how far two runs of the same thing drift apart on this machine.
    child = "vramledger" if mode == "plugin" else "native"
    if mode == "plugin":  # host_timing: vramledger's host time per step (allocator_host_us)
        env.setdefault("VRAMLEDGER_CONF", "host_timing:True")
    if mode in ("shim", "shim-noexp"):  # the shim with / without expandable segments
        env["LD_PRELOAD"] = shim
        env["VRAMLEDGER_CONF"] = ("expandable_segments:True" if mode == "shim"
                                  else "expandable_segments:False") + ",host_timing:True"
        env["VRAMLEDGER_PRELOAD_QUIET"] = "1"
    if mode == "torch-exp":  # torch's own expandable segments: a control for mapped memory
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if mode == "torch-async":  # torch's own cudaMallocAsync backend, which the shim goes through
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    proc = subprocess.run([sys.executable, os.path.join(CHECKS, "train_compare.py"), "--child", child,
                           "--steps", str(steps)], env=env, capture_output=True, text=True,
                          timeout=300,
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    r = json.loads(lines[-1][len(PREFIX):])
    warm = r["step_s"][2:] or r["step_s"]
    host_ms = r.get("allocator_host_ms")  # the same steps as `warm`
    host_ms = (host_ms[2:] if r["step_s"][2:] else host_ms) if host_ms else None
    return {"mode": mode, "median_ms": statistics.median(warm) * 1e3,
            "min_ms": min(warm) * 1e3, "step_ms": [x * 1e3 for x in warm], "losses": r["losses"],
            "peak_reserved": r["peak_reserved"], "peak_allocated": r["peak_allocated"],
            "calibration": r.get("calibration"),
            "host_ms": host_ms}


# docs/design/step-time-measurement.md: why rounds, an A/A control, an interval and calibration.
def summarize(rounds: list[dict[str, dict]], mode: str, target: float,
              resamples: int = 5000, seed: int = 0) -> dict:
    """Figures of one mode against native over rounds (each round: mode -> run dict).

    Returns per-round ratios of median steps (mode / native of the same round), their median and
    geometric mean, a bootstrap 90% interval of the median (`resamples` resamplings of the rounds,
    seeded), the min-step ratio, the paired step ratio (each warm step over native's same step in
    the same round, median), the worst relative loss difference, and a verdict on `target` (a
    ratio, e.g. 1.03): "shown" when the interval lies at or under it, "refuted" when it lies
    above, otherwise "neither".

    Raises:
      ValueError: no round has both `mode` and native.
    """
    import random

    both = [r for r in rounds if mode in r and "native" in r]
    if not both:
        raise ValueError(f"no round has both {mode!r} and native")
    ratios = [r[mode]["median_ms"] / r["native"]["median_ms"] for r in both]
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                  for _ in range(resamples))
    low, high = boot[int(0.05 * resamples)], boot[int(0.95 * resamples) - 1]
    verdict = "shown" if high <= target else "refuted" if low > target else "neither"

    def calibrated(key: str) -> float | None:
        # Each run's median step over its own calibration figure (train_compare.calibrate), so
        # a process that runs everything 10% slower is not counted against its allocator.
        runs = [r[m] for r in both for m in (mode, "native")]
        if not all((run.get("calibration") or {}).get(key) for run in runs):
            return None
        return statistics.median(
            (r[mode]["median_ms"] / r[mode]["calibration"][key]) /
            (r["native"]["median_ms"] / r["native"]["calibration"][key]) for r in both)

    return {
        "rounds": len(both),
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "geomean": statistics.geometric_mean(ratios),
        "interval90": [low, high],
        "ratio_min": statistics.median(r[mode]["min_ms"] / r["native"]["min_ms"] for r in both),
        "paired_step_ratio": statistics.median(
            a / b for r in both for a, b in zip(r[mode]["step_ms"], r["native"]["step_ms"])),
        "worst_loss_rel": max(abs(a - b) / max(abs(a), 1e-12) for r in both
                              for a, b in zip(r["native"]["losses"], r[mode]["losses"])),
        "allocator_host_share": host_share_of(r[mode] for r in both),
        "gpu_calibrated_ratio": calibrated("gpu_ms"),
        "launch_calibrated_ratio": calibrated("launch_us"),
        "target": target,
        "verdict": verdict,
    }


def host_share_of(runs) -> dict | None:
    """vramledger's host time in its allocation calls as a share of the step over rounds
    (train_compare.host_share_over_rounds on each run's warm steps). None when a run has no host
    time (native, torch's own modes)."""
    return host_share_over_rounds([([t / 1e3 for t in run["step_ms"]], run.get("host_ms"))
                                   for run in runs], skip=0)


def print_table(rounds: list[dict[str, dict]], modes: list[str], target: float) -> dict:
    """Prints the markdown table of every mode against native; returns the verdicts by mode."""

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    def share(x: dict | None) -> str:
        return "n/a" if x is None else f"{100 * x['median']:.2f}%, {100 * x['max']:.2f}%"

    print(f"\n| mode | rounds | median step ms per round | ratio to native (median of rounds) "
          f"| 90% interval | geomean | min-step ratio | paired step ratio "
          f"| within {target:.2f}? | gpu-calibrated ratio | launch-calibrated ratio "
          f"| allocator host % of step (median, max) | losses vs native (worst rel) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    verdicts = {}
    for mode in modes:
        v = summarize(rounds, mode, target)
        verdicts[mode] = v
        med = [r[mode]["median_ms"] for r in rounds if mode in r]
        print(f"| {mode} | {v['rounds']} | {', '.join(f'{m:.1f}' for m in med)} | {v['ratio']:.3f} "
              f"| {v['interval90'][0]:.3f}-{v['interval90'][1]:.3f} | {v['geomean']:.3f} "
              f"| {v['ratio_min']:.3f} | {v['paired_step_ratio']:.3f} | {v['verdict']} "
              f"| {fmt(v['gpu_calibrated_ratio'])} | {fmt(v['launch_calibrated_ratio'])} "
              f"| {share(v['allocator_host_share'])} | {v['worst_loss_rel']:.1e} |")
    return verdicts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every mode once")
    ap.add_argument("--steps", type=int, default=10,
                    help="training steps per process; the first two are warm-up, not counted")
    ap.add_argument("--modes", default="native,plugin,shim",
                    help="comma-separated, must include native: native, plugin (install()), "
                         "shim (LD_PRELOAD, expandable segments), shim-noexp, torch-exp "
                         "(torch's expandable segments), torch-async (torch's cudaMallocAsync "
                         "backend), native-again (the A/A control)")
    ap.add_argument("--shim", default=os.path.join(HERE, "..", "..", "..", ".devbuild", "lib",
                                                   "libvramledger_preload.so"),
                    help="the preload library for the shim modes")
    ap.add_argument("--target", type=float, default=1.03,
                    help="ratio to native the verdict is about (1.03 for the shim, 1.02 for the allocator)")
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="no GPU run: pool the rounds of earlier --json outputs and print the "
                         "table over all of them")
    ap.add_argument("--cpus", type=int, default=8,
                    help="pin every process to the same first N CPUs this one may use "
                         "(0: no pinning)")
    ap.add_argument("--json", help="write every round and the verdicts here")
    args = ap.parse_args()
    rounds, modes = pooled(ap, args.pool) if args.pool else measured(ap, args)
    verdicts = print_table(rounds, modes, args.target)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "verdicts": verdicts}, f, indent=1)
    return 0


def pooled(ap: argparse.ArgumentParser, paths: list[str]) -> tuple[list[dict], list[str]]:
    """The rounds of earlier --json outputs and the modes they hold (exits on a bad file)."""
    rounds = []
    for path in paths:
        try:
            with open(path) as f:
                rounds += json.load(f)["rounds"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--pool {path}: not a step_ab --json output ({type(e).__name__}: {e})")
    modes = list(dict.fromkeys(m for r in rounds for m in r))
    if "native" not in modes:
        ap.error("the pooled rounds have no native runs")
    return rounds, modes


def measured(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Runs args.rounds rounds of every mode (GPU); exits on a bad --modes."""
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown mode(s) {', '.join(unknown)} (known: {', '.join(MODES)})")
    if "native" not in modes:
        ap.error("--modes must include native (the reference)")
    cpus = sorted(os.sched_getaffinity(0))[:args.cpus] if args.cpus > 0 else None
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        order = modes[k % len(modes):] + modes[:k % len(modes)]
        this = {}
        for mode in order:
            this[mode] = run(mode, args.steps, os.path.abspath(args.shim), cpus)
            print(f"round {k + 1} {mode:>6}: median {this[mode]['median_ms']:.1f} ms, "
                  f"min {this[mode]['min_ms']:.1f} ms", flush=True)
        rounds.append(this)
    return rounds, modes


if __name__ == "__main__":
    sys.exit(main())
