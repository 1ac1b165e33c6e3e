"""Step time of a GPT-2-medium training step compiled with torch.compile(mode="reduce-overhead")
(CUDA graph trees), torch's allocator against vramledger's default (install()).

The two allocators cannot share a process (torch takes one allocator before CUDA starts), so
processes alternate A B A B ...; each compiles (the inductor cache is warm after the first),
warms up, then times every step (synchronized). Printed: the median step of each allocator, the
ratio vramledger / torch with a 95% bootstrap interval (steps resampled within each allocator),
and the ratio per round.

    python benchmarks/gpu/bench/graph_step_ab.py --rounds 2 --steps 40
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


def child(allocator: str, warmup: int, steps: int) -> None:
    if allocator == "vramledger":
        import vramledger
        vramledger.install()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    compiled = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(1)
    times, losses = [], []
    for i in range(warmup + steps):
        ids = torch.randint(0, 50257, (4, 256), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are done with
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        value = float(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(value)
    print("GSAB " + json.dumps({"allocator": allocator, "times": times, "losses": losses,
                                "backend": torch.cuda.get_allocator_backend()}), flush=True)


def bootstrap_ratio(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(b, k=len(b))) / statistics.median(rng.choices(a, k=len(a)))
        for _ in range(n))
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no round after this many seconds (0: no limit); the table is "
                         "printed from the rounds that finished")
    ap.add_argument("--child", choices=("native", "vramledger"))
    args = ap.parse_args()
    if args.child:
        child(args.child, args.warmup, args.steps)
        return 0
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF", "VRAMLEDGER_CONF")}
    runs: dict[str, list] = {"native": [], "vramledger": []}
    per_round = []
    start = time.monotonic()
    for r in range(args.rounds):
        if r and args.budget_s and time.monotonic() - start > args.budget_s * r / (r + 1):
            # Another round would likely outlast the budget: print what the finished rounds give.
            print(f"budget: {r} of {args.rounds} rounds run", flush=True)
            break
        medians = {}
        for allocator in ("native", "vramledger"):
            proc = subprocess.run([sys.executable, __file__, "--child", allocator, "--warmup",
                                   str(args.warmup), "--steps", str(args.steps)],
                                  env=env, capture_output=True, text=True, timeout=400)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("GSAB ")]
            if proc.returncode != 0 or not lines:
                print(proc.stdout[-2000:], proc.stderr[-3000:])
                print(f"FAIL: {allocator} round {r} exit {proc.returncode}")
                return 1
            result = json.loads(lines[-1][5:])
            runs[allocator].append(result)
            medians[allocator] = statistics.median(result["times"])
            print(f"round {r} {allocator}: median step {medians[allocator] * 1e3:.2f} ms over "
                  f"{len(result['times'])} steps ({time.monotonic() - start:.0f} s)", flush=True)
        per_round.append(medians["vramledger"] / medians["native"])
    a = [t for run in runs["native"] for t in run["times"]]
    b = [t for run in runs["vramledger"] for t in run["times"]]
    lo, hi = bootstrap_ratio(a, b)
    worst = max(abs(x - y) / max(abs(x), 1e-12)
                for ra, rb in zip(runs["native"], runs["vramledger"])
                for x, y in zip(ra["losses"], rb["losses"]))
    ratio = statistics.median(b) / statistics.median(a)
    print(f"backends: {runs['native'][0]['backend']} / {runs['vramledger'][0]['backend']}")
    print(f"per-round ratios: {', '.join(f'{x:.4f}' for x in per_round)}")
    print(f"losses agree: worst relative difference {worst:.2e}")
    print("| allocator | steps | median step | ratio vs torch (95% interval) |")
    print(f"| torch native | {len(a)} | {statistics.median(a) * 1e3:.2f} ms | 1 |")
    print(f"| vramledger default | {len(b)} | {statistics.median(b) * 1e3:.2f} ms | "
          f"{ratio:.4f} ({lo:.4f}-{hi:.4f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
