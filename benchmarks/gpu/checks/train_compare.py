"""GPT-2-medium training under torch's native allocator and under vramledger.

Trains a GPT-2-medium-shaped model (transformers GPT2Config: 24 layers, hidden 1024, 16 heads,
vocab 50257; random weights) with bf16 autocast and AdamW (lr 1e-4), batch 8, sequence lengths
drawn from U[128, 1024], 10 steps, seeds random.seed(0) and torch.manual_seed(0). Each allocator
runs in its own process (install() must precede CUDA's initialisation), the same seed in both.
Prints the per-step losses of both, checks they agree within 1e-3 relative, and prints peak
allocated, peak reserved and median step time of both with their ratios (vramledger / native).

Usage:
  python train_compare.py [--steps 10] [--out DIR] [--vramledger-conf 'key:value,...']
With --out, writes DIR/train_compare.json (both runs in full) and DIR/train_compare_table.txt.
Exit status: 0 when the losses agree, 1 when they do not, 2 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RESULT_PREFIX = "RESULT_JSON "
REL_TOL = 1e-3


def child(allocator: str, steps: int) -> None:
    """One training run; prints one RESULT_JSON line."""
    if allocator == "vramledger":
        import vramledger
        vramledger.install()  # options from VRAMLEDGER_CONF, if set
    import random

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    random.seed(0)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if allocator == "vramledger":
        import vramledger
        reset_peak, stats = vramledger.reset_peak_memory_stats, vramledger.memory_stats
    else:
        reset_peak, stats = torch.cuda.reset_peak_memory_stats, torch.cuda.memory_stats
    torch.cuda.synchronize()
    reset_peak()
    losses, times, seqs = [], [], []
    host = HostTimePerStep(allocator)
    for _ in range(steps):
        seq = random.randint(128, 1024)
        x = torch.randint(0, cfg.vocab_size, (8, seq), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        seqs.append(seq)
        host.step_done()
    s = stats()
    result = {
        "allocator": allocator,
        "conf": os.environ.get("VRAMLEDGER_CONF" if allocator == "vramledger"
                               else "PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "params": sum(p.numel() for p in model.parameters()),
        "seq_lens": seqs,
        "losses": losses,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "peak_allocated": s["allocated_bytes.all.peak"],
        "peak_reserved": s["reserved_bytes.all.peak"],
        "num_alloc_retries": s["num_alloc_retries"],
        "num_ooms": s["num_ooms"],
        "num_device_alloc": s.get("num_device_alloc"),
        # vramledger's host time per step inside its allocation calls (None under native).
        "allocator_host_ms": host.per_step or None,
        # After the figures above, so its buffers change none of them.
        "calibration": calibrate(torch),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# docs/design/step-time-measurement.md, "Time inside the allocator".
def allocator_host_us(allocator: str) -> float | None:
    """Host microseconds this process has spent in vramledger's allocation calls so far.

    Under the plugin (allocator "vramledger"): Malloc and Free of the current device's allocator
    (fragmentation()["host_time"]). Under the LD_PRELOAD shim: the interposed cudaMalloc* and
    cudaFree* calls from entry to return, every device (vramledger_preload_stats_json). Zeros
    unless VRAMLEDGER_CONF has host_timing:True; None without vramledger.
    """
    if allocator == "vramledger":
        import vramledger
        host = vramledger.fragmentation()["host_time"]
        return host["malloc"]["time_us"] + host["free"]["time_us"]
    import ctypes
    process = ctypes.CDLL(None)
    stats = getattr(process, "vramledger_preload_stats_json", None)
    if stats is None:
        return None
    stats.restype = ctypes.c_void_p
    raw = stats()
    if not raw:
        return None
    try:
        return json.loads(ctypes.string_at(raw).decode())["host_time_us"]["interposed_calls"]
    finally:
        process.free(ctypes.c_void_p(raw))


class HostTimePerStep:
    """vramledger's host time in each training step (ms), from allocator_host_us: construct
    before the first step, call step_done() after each; `per_step` is empty without vramledger."""

    def __init__(self, allocator: str):
        self.allocator = allocator
        self.before = allocator_host_us(allocator)
        self.per_step: list[float] = []

    def step_done(self) -> None:
        after = allocator_host_us(self.allocator)
        if after is not None and self.before is not None:
            self.per_step.append((after - self.before) / 1e3)
            self.before = after


def host_share(step_s: list[float], host_ms: list[float] | None, skip: int = 1) -> dict | None:
    """vramledger's host time as a share of each step, over the steps after the first `skip`.

    step_s: step times (s); host_ms: host time inside vramledger's allocation calls in the same
    steps (ms), or None. Returns {"median": ..., "max": ...} (fractions of the step), or None
    when there is no host time or no step after `skip`.

    Raises:
      ValueError: step_s and host_ms differ in length, or host_ms holds a None.
    """
    if not host_ms:
        return None
    if len(host_ms) != len(step_s) or any(h is None for h in host_ms):
        raise ValueError(f"host_share: {len(host_ms)} host times (None entries: "
                         f"{sum(h is None for h in host_ms)}) for {len(step_s)} steps")
    shares = [h / (t * 1e3) for t, h in list(zip(step_s, host_ms))[skip:] if t > 0]
    return {"median": statistics.median(shares), "max": max(shares)} if shares else None


def host_share_over_rounds(rounds: list[tuple[list[float], list[float] | None]],
                           skip: int = 1) -> dict | None:
    """host_share over rounds, each (step_s, host_ms): the median of the rounds' median shares
    and the largest step's share. None when there is no round or one has no host time."""
    shares = [host_share(step_s, host_ms, skip) for step_s, host_ms in rounds]
    if not shares or any(x is None for x in shares):
        return None
    return {"median": statistics.median(x["median"] for x in shares),
            "max": max(x["max"] for x in shares)}


# docs/design/step-time-measurement.md, "Divide out the process's own speed".
def calibrate(torch, n: int = 2048) -> dict:
    """How fast this process runs fixed work that allocates nothing while timed.

    Step time moves by up to 15% between processes of the same script on the H200, every step
    alike (step_ab.py's A/A control); these two figures let step_ab.py divide a process's own
    speed out of its step time: gpu_ms, one bf16 n^3 matmul into a preallocated output (CUDA
    events, mean of 100); launch_us, host time per launch of a one-element add_ (2,000 launches,
    then one synchronize), the launch-bound part of a step. n: the matmul's side (2048 on the
    GPU; the CPU test passes a small one, bf16 matmuls of 2048 take minutes on some CPUs).
    """
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    tiny = torch.zeros(1, device="cuda")
    for _ in range(10):
        torch.mm(a, b, out=c)
        tiny.add_(1)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        torch.mm(a, b, out=c)
    end.record()
    end.synchronize()
    gpu_ms = start.elapsed_time(end) / 100
    t0 = time.perf_counter()
    for _ in range(2000):
        tiny.add_(1)
    torch.cuda.synchronize()
    launch_us = (time.perf_counter() - t0) / 2000 * 1e6
    return {"gpu_ms": gpu_ms, "launch_us": launch_us}


def run_child(allocator: str, steps: int, vramledger_conf: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if vramledger_conf is not None:
        env["VRAMLEDGER_CONF"] = vramledger_conf
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", allocator,
                           "--steps", str(steps)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"--- {allocator} run failed (exit {proc.returncode})\n{proc.stdout}\n"
                         f"{proc.stderr[-8000:]}\n")
        raise SystemExit(2)
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["process_wall_s"] = wall
    return result


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=["native", "vramledger"], help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", help="directory for train_compare.json")
    ap.add_argument("--vramledger-conf", default=None,
                    help="VRAMLEDGER_CONF for the vramledger run (default: inherited)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps)
        return 0

    native = run_child("native", args.steps, None)
    vl = run_child("vramledger", args.steps, args.vramledger_conf)

    print(f"GPT-2-medium ({native['params'] / 1e6:.1f}M params), bf16 autocast, AdamW, batch 8, "
          f"{args.steps} steps on {native['device']}, torch {native['torch']}")
    print(f"vramledger conf: {vl['conf'] or '(defaults)'}")
    print(f"{'step':>4} {'seq':>5} {'native loss':>12} {'vramledger loss':>16} {'rel diff':>10}"
          f" {'native s':>9} {'vramledger s':>13}")
    agree = native["seq_lens"] == vl["seq_lens"]
    worst = 0.0
    for i, (a, b) in enumerate(zip(native["losses"], vl["losses"])):
        rel = abs(a - b) / max(abs(a), 1e-12)
        worst = max(worst, rel)
        agree = agree and rel <= REL_TOL
        print(f"{i:>4} {native['seq_lens'][i]:>5} {a:>12.6f} {b:>16.6f} {rel:>10.2e}"
              f" {native['step_s'][i]:>9.4f} {vl['step_s'][i]:>13.4f}")
    print()
    rows = [
        ("peak allocated", native["peak_allocated"], vl["peak_allocated"], gib),
        ("peak reserved", native["peak_reserved"], vl["peak_reserved"], gib),
        ("median step", native["median_step_s"], vl["median_step_s"],
         lambda t: f"{t * 1e3:.1f} ms"),
    ]
    table = [f"{'':<16} {'native':>12} {'vramledger':>12} {'ratio vl/native':>16}"]
    for name, a, b, fmt in rows:
        table.append(f"{name:<16} {fmt(a):>12} {fmt(b):>12} {b / a:>16.3f}")
    table.append(f"{'utilization':<16} {native['peak_allocated'] / native['peak_reserved']:>12.3f} "
                 f"{vl['peak_allocated'] / vl['peak_reserved']:>12.3f}")
    table.append(f"losses agree within {REL_TOL:g} relative: {'yes' if agree else 'NO'} "
                 f"(worst {worst:.2e}, {args.steps} steps)")
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "train_compare.json"), "w") as f:
            json.dump({"native": native, "vramledger": vl, "losses_agree": agree,
                       "worst_rel_diff": worst}, f, indent=1)
        with open(os.path.join(args.out, "train_compare_table.txt"), "w") as f:
            f.write("\n".join(table) + "\n")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
