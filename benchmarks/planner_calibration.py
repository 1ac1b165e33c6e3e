#!/usr/bin/env python3
# Checks `vramledger plan` against measured H200 runs: per-step peaks and categories recovered from
# the bundled allocation traces, and the peaks of reference/h200-baselines.jsonl. CPU only.
"""Planner calibration: estimate vs measured, by category and in total.

Usage: python benchmarks/planner_calibration.py [--baselines PATH] [--json]

From each bundled trace (traces/trace-gpt2m-native.csv.gz, traces/trace-llama1b-native.csv.gz;
one training step = one new input tensor of batch x seq int64) it recovers, by a least-squares fit
of the per-step peak live (requested) bytes against the step's tokens:
  - persistent bytes: live between steps (fp32 weights + AdamW state + small buffers);
  - per-token bytes: the slope (activations + logits and loss);
  - forward-only bytes: the intercept minus the persistent bytes (autocast's bf16 weight copies).
Steps shorter than 512 tokens per sequence are left out of the fit: their peak is the optimizer
step's, not the forward pass's. It then runs the planner (vramledger._plan) with the same shapes and prints both side by side,
plus the total peak against reference/h200-baselines.jsonl (including Llama-1B with
checkpointing: its bundled trace is not fitted, every step of it peaks in the optimizer step at
the same bytes, so the per-step peaks carry no per-token slope).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "torch_plugin", "python"))
from vramledger import _plan  # noqa: E402

GPT2M = _plan.Model(name="GPT-2-medium", layers=24, hidden=1024, heads=16, kv_heads=16,
                    vocab=50257, mlp="gelu-tanh", tied=True, positions=1024, biases=True)
LLAMA1B = _plan.Model(name="Llama-1B", layers=22, hidden=2048, heads=32, kv_heads=4,
                      intermediate=5632, vocab=32000, mlp="gated", tied=False)
RUNS = [  # (baseline tag, trace, model, micro-batch, checkpointing)
    ("gpt2m-native", "trace-gpt2m-native.csv.gz", GPT2M, 8, False),
    ("llama1b-native", "trace-llama1b-native.csv.gz", LLAMA1B, 4, False),
    ("llama1b-ckpt-native", None, LLAMA1B, 4, True),
]


def trace_steps(path: str, batch: int) -> list[dict]:
    """Per step: its sequence length, live bytes when its input arrives (`base`) and the step's
    peak live bytes. A step starts with an int64 batch x seq input allocated while live memory is
    at the between-steps level (the lowest such level in the second half of the trace)."""
    live: dict[str, int] = {}
    cur = 0
    curve: list[int] = []
    candidates: list[tuple[int, int, int]] = []  # (event index, seq, base)
    with gzip.open(path, "rt") as f:
        next(f)
        for line in f:
            action, addr, size, _stream, _t = line.rstrip("\n").split(",")
            size = int(size)
            if action == "alloc":
                live[addr] = size
                cur += size
                seq, rem = divmod(size, 8 * batch)
                if rem == 0 and 128 <= seq <= 8192:
                    candidates.append((len(curve), seq, cur - size))
            elif action == "free_completed":
                cur -= live.pop(addr, 0)
            curve.append(cur)
    level = min(base for _, _, base in candidates[len(candidates) // 2:])
    starts: list[tuple[int, int, int]] = []
    for i, seq, base in candidates:  # a step has thousands of events; its input comes first
        if base <= 1.01 * level and (not starts or i - starts[-1][0] > 2000):
            starts.append((i, seq, base))
    steps = []
    for k, (i, seq, base) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(curve)
        steps.append({"seq": seq, "base": base, "peak": max(curve[i:end])})
    return steps


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baselines", default=os.path.join(ROOT, "..", "shared", "reference",
                                                         "h200-baselines.jsonl"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    baselines = {}
    if os.path.exists(args.baselines):
        with open(args.baselines) as f:
            for line in f:
                row = json.loads(line)
                baselines[row["tag"]] = row
    results = []
    for tag, trace, model, batch, ckpt in RUNS:
        row: dict = {"run": tag, "model": model.name}
        measured_peak = baselines.get(tag, {}).get("peak_allocated")
        seq = None
        if trace:
            steps = [s for s in trace_steps(os.path.join(ROOT, "traces", trace), batch)]
            # Steady steps: same between-steps level as the last step (drops the warm-up step).
            level = steps[-1]["base"]
            steady = [s for s in steps if abs(s["base"] - level) < 0.001 * level]
            # Short steps peak in the optimizer step (20 B/param with AdamW), not at the end of
            # the forward pass: fit the forward peak on steps of 512 tokens per sequence or more.
            steady = [s for s in steady if s["seq"] >= 512]
            slope, intercept = fit([(batch * s["seq"], s["peak"]) for s in steady])
            seq = max(s["seq"] for s in steady)
            row.update(steps=len(steady), max_seq=seq, persistent=level,
                       per_token=slope, forward_only=intercept - level)
        seq = seq or 1955  # the checkpointed run drew the same sequences as the plain one
        est = _plan.estimate(model, _plan.Setup(seq=seq, batch=batch, checkpointing=ckpt))
        T = batch * seq
        p = est["params"]
        textbook = _plan.estimate(model, _plan.Setup(seq=seq, batch=batch, checkpointing=ckpt,
                                                      activation_model="korthikanti"))
        row["textbook_total"] = textbook["total_bytes"]
        row["estimate_total"] = est["total_bytes"]
        row["estimate_phase"] = est["peak_phase"]
        row["measured_total"] = measured_peak
        if measured_peak:
            row["total_error"] = est["total_bytes"] / measured_peak - 1
        if trace:
            per_token_est = (est["activations"]) / T
            row["estimate_persistent"] = 12 * p + _plan.WORKSPACE_BASE
            row["estimate_per_token"] = per_token_est
            row["textbook_per_token"] = textbook["activations"] / T
            row["estimate_forward_only"] = 2 * p
        results.append(row)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(f"{r['run']} ({r['model']})")
        if "per_token" in r:
            for name, key in (("persistent (weights fp32 + AdamW + buffers)", "persistent"),
                              ("bf16 weight copies (forward/backward)", "forward_only"),
                              ("activations + logits per token", "per_token")):
                m, e = r[key], r["estimate_" + key]
                unit = "B/token" if key == "per_token" else "B"
                print(f"  {name:<46} measured {m:>16,.0f} {unit:<7} planned {e:>16,.0f}  "
                      f"{e / m - 1:+.1%}")
            print(f"  {'  textbook (Korthikanti 34 h L + 10 V)':<46} {'':>33}          "
                  f"{r['textbook_per_token']:>16,.0f}  {r['textbook_per_token'] / r['per_token'] - 1:+.1%}")
            print(f"  (fit over {r['steps']} steps; longest sequence {r['max_seq']})")
        if not r.get("measured_total"):
            print(f"  {'peak allocated (' + r['estimate_phase'] + ')':<46} planned "
                  f"{r['estimate_total']:>16,} B (no measured peak: {args.baselines} "
                  f"{'has no ' + r['run'] + ' row' if baselines else 'not found'})")
        else:
            print(f"  {'peak allocated (' + r['estimate_phase'] + ')':<46} measured "
                  f"{r['measured_total']:>16,} B       planned {r['estimate_total']:>16,}  "
                  f"{r['total_error']:+.1%}")
            print(f"  {'  textbook activations instead':<46} {'':>33}          "
                  f"{r['textbook_total']:>16,}  {r['textbook_total'] / r['measured_total'] - 1:+.1%}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
