"""Step time of GPT-2-medium training, interleaved A/B over several rounds: torch's native
allocator, vramledger through the plugin (install()), and vramledger through the LD_PRELOAD shim
(expandable segments on), each in its own process (train_compare.py's child, the same seeds).

Step time varies between processes of the same script far more than the allocators differ
(native alone ranged 190-253 ms median across runs on the H200), so one run each proves nothing.
Each round runs every mode once, in a rotating order; the figure per run is the median step after
the first two (warm-up) steps; the verdict uses the median over rounds of the per-round ratio to
native, and prints the min-step ratio and the paired step ratio (each warm step over native's
same step in the same round, the same sequence length; median over rounds and steps) beside it.
Mode native-again runs native a second time in each round: its ratios are the noise floor.

Usage (GPU machine; VRAMLEDGER_PLUGIN and PYTHONPATH as in run_h200.sh):
  python step_ab.py [--rounds 3] [--steps 10] [--shim SO] [--json F]
                    [--modes native,plugin,shim,shim-noexp,torch-exp,native-again]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "RESULT_JSON "


def run(mode: str, steps: int, shim: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # native-again: torch's native allocator in a second process per round, the A/A control
    # that shows how far two runs of the same thing drift apart on this machine.
    child = "vramledger" if mode == "plugin" else "native"
    if mode in ("shim", "shim-noexp"):  # the shim with / without expandable segments
        env["LD_PRELOAD"] = shim
        env["VRAMLEDGER_CONF"] = ("expandable_segments:True" if mode == "shim"
                                  else "expandable_segments:False")
        env["VRAMLEDGER_PRELOAD_QUIET"] = "1"
    if mode == "torch-exp":  # torch's own expandable segments: a control for mapped memory
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "train_compare.py"), "--child", child,
                           "--steps", str(steps)], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    r = json.loads(lines[-1][len(PREFIX):])
    warm = r["step_s"][2:] or r["step_s"]
    return {"mode": mode, "median_ms": statistics.median(warm) * 1e3,
            "min_ms": min(warm) * 1e3, "step_ms": [x * 1e3 for x in warm], "losses": r["losses"],
            "peak_reserved": r["peak_reserved"], "peak_allocated": r["peak_allocated"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="native,plugin,shim")
    ap.add_argument("--shim", default=os.path.join(HERE, "..", "..", ".devbuild", "lib",
                                                   "libvramledger_preload.so"))
    ap.add_argument("--json")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "native" not in modes:
        ap.error("--modes must include native (the reference)")
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        order = modes[k % len(modes):] + modes[:k % len(modes)]
        this = {}
        for mode in order:
            this[mode] = run(mode, args.steps, os.path.abspath(args.shim))
            print(f"round {k + 1} {mode:>6}: median {this[mode]['median_ms']:.1f} ms, "
                  f"min {this[mode]['min_ms']:.1f} ms", flush=True)
        rounds.append(this)
    print(f"\n| mode | median step ms per round | ratio to native (median of rounds) "
          f"| min-step ratio | paired step ratio | losses vs native (worst rel) |")
    print("|---|---|---|---|---|---|")
    verdicts = {}
    for mode in modes:
        med = [r[mode]["median_ms"] for r in rounds]
        ratio = statistics.median(r[mode]["median_ms"] / r["native"]["median_ms"] for r in rounds)
        ratio_min = statistics.median(r[mode]["min_ms"] / r["native"]["min_ms"] for r in rounds)
        worst = max(abs(a - b) / max(abs(a), 1e-12) for r in rounds
                    for a, b in zip(r["native"]["losses"], r[mode]["losses"]))
        # Each warm step over native's same step of the same round (same sequence length).
        paired = statistics.median(a / b for r in rounds
                                   for a, b in zip(r[mode]["step_ms"], r["native"]["step_ms"]))
        verdicts[mode] = {"ratio": ratio, "ratio_min": ratio_min, "paired_step_ratio": paired,
                          "worst_loss_rel": worst}
        print(f"| {mode} | {', '.join(f'{m:.1f}' for m in med)} | {ratio:.3f} | {ratio_min:.3f} "
              f"| {paired:.3f} | {worst:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "verdicts": verdicts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
