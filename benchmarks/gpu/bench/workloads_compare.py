"""The three traced workloads (GPT-2-medium, Llama-1B, Llama-1B checkpointed) under three allocators.

Workloads (as the runs behind traces/ were recorded: random weights, bf16 autocast, AdamW lr 1e-4, a
new random sequence length every step, seeds random.seed(0), torch.manual_seed(0)):
  gpt2m         GPT-2 24 layers, hidden 1024, 16 heads; batch 8, seq U[128,1024], 12 steps
  llama1b       Llama 22 layers, hidden 2048, MLP 5632, 32/4 heads; batch 4, seq U[256,2048], 10 steps
  llama1b-ckpt  the same with gradient checkpointing
Allocators, each in its own process: torch native; torch expandable_segments:True; vramledger
(expandable segments + page recycling, VRAMLEDGER_CONF overrides).
Prints per run: peak allocated, peak reserved, reserved/allocated, median step time (and its
ratio to native; the paired step ratio: the median over rounds and steps of each step's time
over native's same step, the same sequence length; and the gpu-calibrated step ratio: each run's
median step over its own process's matmul time, train_compare.calibrate, over the same for
native: whole processes run up to 15% faster or slower), and the driver calls made in the last
three steps (vramledger: map + unmap + cudaMalloc + cudaFree counted by its stats; torch:
num_device_alloc + num_device_free).

Usage: python workloads_compare.py [--out DIR] [--workloads gpt2m,llama1b,llama1b-ckpt] [--rounds N]
Under vramledger it also prints the driver calls of the last three steps per kind with their
measured time, and the measured driver time of every step (cumulative).
  python workloads_compare.py --record llama1b-ckpt trace.csv.gz   records a workload's trace on
  torch's native allocator (torch's memory history) in the bundled traces' CSV format.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checks"))
from train_compare import HostTimePerStep, calibrate, host_share_over_rounds  # noqa: E402

RESULT = "RESULT_JSON "


def make(workload):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    if workload == "gpt2m":
        cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
        return GPT2LMHeadModel(cfg), dict(batch=8, lo=128, hi=1024, vocab=50257, ckpt=False, steps=12)
    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg), dict(batch=4, lo=256, hi=2048, vocab=32000,
                                       ckpt=workload.endswith("ckpt"), steps=10)


def setup(workload: str, before_cuda=None):
    """Seeds, the model on the GPU (checkpointing as the workload says), AdamW; `before_cuda()`
    runs after the model is built and before it moves to the GPU. Returns (torch, model, opt, p,
    step) where step() draws the next sequence length, runs one training step and returns the
    loss tensor."""
    import random

    import torch
    random.seed(0)
    torch.manual_seed(0)
    model, p = make(workload)
    if before_cuda is not None:
        before_cuda()
    model = model.cuda()
    if p["ckpt"]:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        return train_step(torch, model, opt, p, random.randint(p["lo"], p["hi"]))

    return torch, model, opt, p, step


def train_step(torch, model, opt, p: dict, seq: int):
    """One training step of the workload `p` (make()'s dict) on a random batch of `seq` tokens a
    row: bf16 autocast forward, backward, AdamW step, gradients set to None. Returns the loss
    tensor (on the GPU; reading it synchronizes)."""
    x = torch.randint(0, p["vocab"], (p["batch"], seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def record_trace(workload: str, path: str) -> None:
    """Runs `workload` on torch's native allocator with torch's memory history on and writes its
    trace as the bundled traces' CSV (action,addr,size,stream,time_us), gzip-compressed."""
    import gzip

    def record():
        import torch
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=3_000_000)

    torch, _, _, p, step = setup(workload, before_cuda=record)
    for _ in range(p["steps"]):
        step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(path, "wt") as f:
        f.write("action,addr,size,stream,time_us\n")
        for e in trace:
            f.write(f"{e['action']},{e['addr']},{e['size']},{e['stream']},{e.get('time_us', 0)}\n")
    print(f"{path}: {len(trace)} events")


def child(workload: str, allocator: str) -> None:
    if allocator == "vramledger":
        import vramledger
        vramledger.install()
    torch, _, _, p, step = setup(workload)
    if allocator == "vramledger":
        import vramledger as mem
    else:
        mem = torch.cuda
    torch.cuda.synchronize()
    mem.reset_peak_memory_stats()
    times, losses, calls, driver, peaks = [], [], [], [], []
    host = HostTimePerStep(allocator)  # vramledger's host time inside Malloc and Free, per step
    for _ in range(p["steps"]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        host.step_done()
        s = mem.memory_stats()
        calls.append(s.get("num_device_alloc", 0) + s.get("num_device_free", 0))
        peaks.append(s["allocated_bytes.all.peak"])  # the running peak: a step that raises it
        if allocator == "vramledger":  # every driver call, measured around the call
            f = mem.fragmentation()
            driver.append({k: (v["count"], round(v["time_us"])) for k, v in
                           f["driver_calls"].items() if v["count"]})
    s = mem.memory_stats()
    extra = {"allocator_host_ms": host.per_step or None}
    extra["calibration"] = calibrate(torch)  # after the figures: its buffers change none of them
    if driver:  # per kind: calls and microseconds in the last three steps
        last3 = {k: [c - driver[-4].get(k, (0, 0))[0], t - driver[-4].get(k, (0, 0))[1]]
                 for k, (c, t) in driver[-1].items()}
        extra.update(driver_last3={k: v for k, v in last3.items() if v[0]},
                     driver_us_per_step=[sum(t for _, t in d.values()) for d in driver])
    print(RESULT + json.dumps(dict(
        workload=workload, allocator=allocator, losses=losses, step_s=times,
        median_step_s=statistics.median(times),
        peak_allocated=s["allocated_bytes.all.peak"], peak_reserved=s["reserved_bytes.all.peak"],
        driver_calls_last3=calls[-1] - calls[-4], num_alloc_retries=s["num_alloc_retries"],
        peak_allocated_after_step=peaks,
        **extra)),
        flush=True)


def run(workload: str, allocator: str) -> dict:
    # The same hash seed and the same 8 CPUs for every process (as step_ab.py --cpus 8), so two
    # processes differ by as little as the machine allows.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    cpus = sorted(os.sched_getaffinity(0))[:8]
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if allocator == "torch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if allocator == "vramledger":
        # host_timing: vramledger's host time per step (train_compare.allocator_host_us)
        env.setdefault("VRAMLEDGER_CONF", "expandable_segments:True,host_timing:True")
    kind = "vramledger" if allocator == "vramledger" else "torch"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload, kind],
                          env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"--- {workload}/{allocator} failed ({proc.returncode})\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n")
        return dict(workload=workload, allocator=allocator, failed=True)
    r = json.loads(lines[-1][len(RESULT):])
    r["allocator"] = allocator
    return r


# docs/design/step-time-measurement.md, "Divide out the process's own speed".
def calibrated_step_ratio(runs: list, native_runs: list, key: str = "gpu_ms") -> float | None:
    """Median over rounds of (this run's median step / its process's calibration[key]) over the
    same for native's run of the round (train_compare.calibrate: gpu_ms or launch_us), so a
    process that runs everything slower is not counted against its allocator. None when a run
    has no calibration."""
    pairs = list(zip(runs, native_runs))
    if not pairs or not all((x.get("calibration") or {}).get(key) for p in pairs for x in p):
        return None
    return statistics.median((r["median_step_s"] / r["calibration"][key]) /
                             (n["median_step_s"] / n["calibration"][key]) for r, n in pairs)


def paired_step_ratio(runs: list, native_runs: list) -> float:
    """Median, over every round and every step after the first, of this allocator's step time
    divided by native's same step in the same round. Both saw the same sequence lengths (same
    seeds), so a step's length cancels out, which a ratio of medians over steps of random length
    does not do. `runs` / `native_runs`: one child result per round, each with "step_s" (seconds).
    Raises ValueError when no step pairs up."""
    ratios = [a / b for r, n in zip(runs, native_runs)
              for a, b in zip(r["step_s"][1:], n["step_s"][1:]) if b > 0]
    if not ratios:
        raise ValueError("no steps to pair (each run needs at least two steps)")
    return statistics.median(ratios)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--out")
    ap.add_argument("--workloads", default="gpt2m,llama1b,llama1b-ckpt")
    ap.add_argument("--rounds", type=int, default=1,
                    help="processes per allocator, interleaved; step time = median of rounds")
    ap.add_argument("--record", nargs=2, metavar=("WORKLOAD", "OUT_CSV_GZ"),
                    help="only record WORKLOAD's allocation trace on torch's native allocator")
    a = ap.parse_args()
    if a.record:
        record_trace(*a.record)
        return 0
    if a.child:
        child(*a.child)
        return 0
    rows = []
    for w in a.workloads.split(","):
        runs = {}
        allocs = ("native", "torch-expandable", "vramledger")
        for rnd in range(a.rounds):  # allocators interleaved, the order reversed every other round
            for alloc in (allocs if rnd % 2 == 0 else allocs[::-1]):
                r = run(w, alloc)
                runs.setdefault(alloc, []).append(r)
                # Each run as it ends, so a call cut short by its time limit still reports.
                if r.get("failed"):
                    print(f"run {w} {alloc} round {rnd + 1}: FAILED", flush=True)
                else:
                    print(f"run {w} {alloc} round {rnd + 1}: median step "
                          f"{r['median_step_s']:.4f} s, reserved/alloc "
                          f"{r['peak_reserved'] / r['peak_allocated']:.4f}, steps "
                          f"{[round(x, 4) for x in r['step_s']]}", flush=True)
                if a.out:
                    os.makedirs(a.out, exist_ok=True)
                    with open(os.path.join(a.out, "workloads_runs.jsonl"), "a") as f:
                        f.write(json.dumps(dict(r, round=rnd + 1)) + "\n")
        for alloc, rs in runs.items():
            ok_runs = [r for r in rs if not r.get("failed")]
            if len(ok_runs) < len(rs):
                rows.append(dict(workload=w, allocator=alloc, failed=True))
                continue
            r = dict(ok_runs[0])
            # The step time of one process moves by several % between processes: the median of
            # the rounds' medians, each round's beside it.
            r["round_median_step_s"] = [x["median_step_s"] for x in ok_runs]
            r["median_step_s"] = statistics.median(r["round_median_step_s"])
            r["round_step_s"] = [x["step_s"] for x in ok_runs]
            r["round_host_ms"] = [x.get("allocator_host_ms") for x in ok_runs]
            nat_runs = runs.get("native", [])
            if all(not x.get("failed") for x in nat_runs):
                r["paired_step_ratio"] = paired_step_ratio(ok_runs, nat_runs)
                r["gpu_calibrated_step_ratio"] = calibrated_step_ratio(ok_runs, nat_runs)
            rows.append(r)
    lines = ["| workload | allocator | peak alloc GiB | peak reserved GiB | reserved/alloc | "
             "median step s | step vs native | paired step ratio | gpu-calibrated step ratio | "
             "allocator host % of step (median, max) | driver calls last 3 steps | "
             "losses match native |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['workload']} | {r['allocator']} | FAILED | | | | | | | | | |")
            ok = False
            continue
        nat = next(x for x in rows if x["workload"] == r["workload"] and x["allocator"] == "native")
        if nat.get("failed"):  # nothing to compare with
            nat = dict(losses=[], median_step_s=float("nan"))
        match = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(r["losses"], nat["losses"]))
        cal = r.get("gpu_calibrated_step_ratio")
        cal = "n/a" if cal is None else f"{cal:.3f}"
        # docs/design/step-time-measurement.md, "Time inside the allocator": every round's steps
        share = host_share_over_rounds(list(zip(r.get("round_step_s", [r["step_s"]]),
                                                r.get("round_host_ms", [None]))))
        host = ("n/a" if share is None else
                f"{100 * share['median']:.2f}%, {100 * share['max']:.2f}%")
        lines.append(
            f"| {r['workload']} | {r['allocator']} | {r['peak_allocated']/2**30:.2f} | "
            f"{r['peak_reserved']/2**30:.2f} | {r['peak_reserved']/r['peak_allocated']:.4f} | "
            f"{r['median_step_s']:.4f} | {r['median_step_s']/nat['median_step_s']:.3f} | "
            f"{r.get('paired_step_ratio', float('nan')):.3f} | "
            f"{cal} | {host} | "
            f"{r['driver_calls_last3']} | {match} |")
    for r in rows:
        if r.get("driver_last3"):
            lines.append(f"\n{r['workload']} vramledger, driver calls in the last 3 steps "
                         f"[count, us]: {json.dumps(r['driver_last3'])}; driver us per step: "
                         f"{r['driver_us_per_step']}; median step per round (s): "
                         f"{[round(x, 4) for x in r['round_median_step_s']]}")
    # Which steps raised the peak of allocated memory, and by how much (the running peak after
    # each step over the one before): a step that raises it past 1.01 x cannot be served with no
    # driver call at 1.01 (docs/design/expandable-segments.md, "What it does not do").
    for r in rows:
        peaks = r.get("peak_allocated_after_step")
        if peaks and len(peaks) > 3:
            raised = [f"{k + 1}: x{b / a:.4f}" for k, (a, b) in enumerate(zip(peaks, peaks[1:]), 1)
                      if b > a]
            lines.append(f"{r['workload']} {r['allocator']}: steps that raised peak allocated "
                         f"[{', '.join(raised) or 'none after the first'}]; last 3 steps raise it "
                         f"x{peaks[-1] / peaks[-4]:.4f}")
    table = "\n".join(lines)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "workloads_compare.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(a.out, "workloads_compare_table.md"), "w") as f:
            f.write(table + "\n")
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
