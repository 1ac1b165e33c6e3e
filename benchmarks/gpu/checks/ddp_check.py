"""Several GPUs, one process per GPU: GPT-2-medium DDP training (NCCL, two ranks) under torchrun, on
torch's native allocator and under vramledger.install() with a plan per rank.

The model, optimiser and data follow train_compare.py (GPT-2-medium shape, random weights, bf16
autocast, AdamW lr 1e-4, batch 8 per rank, sequence lengths U[128, 1024] from random.seed(0), the
same lengths on both ranks, token ids from torch.manual_seed(rank)). Each rank records per step the
loss averaged over the ranks (all_reduce), its peak allocated and reserved bytes, and, under
vramledger, calls vramledger.step() so that the per-rank step log is written.

Worker (under torchrun):
  torchrun --nproc_per_node=2 ddp_check.py --worker --allocator vramledger --out DIR [--steps 10]
Each rank writes DIR/rank<R>.json. Rank 0 also writes DIR/placement.json: for each rank's process
the GPUs on which nvidia-smi shows it (its memory must be on its own GPU only), and the result of
an all_reduce of a buffer allocated inside vramledger.contiguous_segments() and of one from an
expandable segment.

Compare (after both runs):
  python ddp_check.py --compare NATIVE_DIR VRAMLEDGER_DIR
prints the table and exits 0 when losses agree within 1e-3 relative on every step and every check
passed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REL_TOL = 1e-3


def smi_placement() -> dict[int, list[int]]:
    """{pid: [GPU indices where nvidia-smi lists a compute context of that pid]}."""
    idx = {}
    for line in subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        i, bus = [x.strip() for x in line.split(",")]
        idx[bus.lower()] = int(i)
    out: dict[int, list[int]] = {}
    for line in subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        if not line.strip():
            continue
        pid, bus = [x.strip() for x in line.split(",")]
        out.setdefault(int(pid), []).append(idx.get(bus.lower(), -1))
    return out


def worker(allocator: str, steps: int, out: str) -> None:
    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if allocator == "vramledger":
        import vramledger
        # One plan file, one entry per rank's GPU (devices: {"<local rank>": ...}).
        vramledger.install(expandable_segments=True, plan=os.path.join(out, "plan.json"),
                           step_log=os.path.join(out, "steps"))
    import random

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    random.seed(0)
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
    cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
    model = DDP(GPT2LMHeadModel(cfg).cuda(), device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    if allocator == "vramledger":
        import vramledger
        stats, reset_peak = vramledger.memory_stats, vramledger.reset_peak_memory_stats
    else:
        stats, reset_peak = torch.cuda.memory_stats, torch.cuda.reset_peak_memory_stats
    torch.cuda.synchronize()
    reset_peak()
    losses, times = [], []
    for _ in range(steps):
        seq = random.randint(128, 1024)
        x = torch.randint(0, cfg.vocab_size, (8, seq), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().float().clone()
        dist.all_reduce(avg)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(avg) / world)
        if allocator == "vramledger":
            vramledger.step()
    s = stats()
    result = {"rank": rank, "device": local, "pid": os.getpid(), "losses": losses,
              "median_step_s": statistics.median(times),
              "peak_allocated": s["allocated_bytes.all.peak"],
              "peak_reserved": s["reserved_bytes.all.peak"]}

    # NCCL on vramledger memory: an expandable-segment buffer and a contiguous_segments() one.
    if allocator == "vramledger" and hasattr(vramledger, "contiguous_segments"):
        with vramledger.contiguous_segments():
            c = torch.full((16 << 20,), float(rank + 1), device="cuda")
        e = torch.full((16 << 20,), float(rank + 1), device="cuda")
        dist.all_reduce(c)
        dist.all_reduce(e)
        want = world * (world + 1) / 2
        result["allreduce_contiguous_ok"] = bool((c == want).all())
        result["allreduce_expandable_ok"] = bool((e == want).all())
    torch.cuda.synchronize()
    pids = [None] * world
    dist.all_gather_object(pids, (rank, local, os.getpid()))
    if rank == 0:
        placement = smi_placement()
        result["placement"] = {str(r): {"device": d, "pid": p, "gpus": placement.get(p, [])}
                               for r, d, p in pids}
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def compare(native_dir: str, vl_dir: str) -> int:
    def load(d: str) -> dict[int, dict]:
        out = {}
        for name in sorted(os.listdir(d)):
            if name.startswith("rank") and name.endswith(".json"):
                r = json.load(open(os.path.join(d, name)))
                out[r["rank"]] = r
        return out

    for d in (native_dir, vl_dir):
        if not os.path.isdir(d):
            print(f"FAIL ddp_check --compare: {d} is not a directory")
            return 1
    nat, vl = load(native_dir), load(vl_dir)
    if not nat or not vl or sorted(nat) != sorted(vl):
        print(f"FAIL ddp_check --compare: rank results native {sorted(nat)}, vramledger "
              f"{sorted(vl)} (rank<R>.json files; a run that failed writes none)")
        return 1
    ok = True
    lines = ["| rank | allocator | peak alloc GiB | peak reserved GiB | median step ms |",
             "|---|---|---|---|---|"]
    worst = 0.0
    for r in sorted(vl):
        for name, runs in (("native", nat), ("vramledger", vl)):
            x = runs[r]
            lines.append(f"| {r} | {name} | {x['peak_allocated'] / 2**30:.2f} | "
                         f"{x['peak_reserved'] / 2**30:.2f} | {x['median_step_s'] * 1e3:.1f} |")
        for a, b in zip(nat[r]["losses"], vl[r]["losses"]):
            worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    loss_ok = worst <= REL_TOL
    ok &= loss_ok
    print("\n".join(lines))
    print(f"{'PASS' if loss_ok else 'FAIL'} losses agree: worst relative difference {worst:.2e} "
          f"(tolerance {REL_TOL})")
    for label, runs in (("native", nat), ("vramledger", vl)):
        placement = runs.get(0, {}).get("placement", {})
        stray = {r: p["gpus"] for r, p in placement.items() if p["gpus"] != [p["device"]]}
        good = bool(placement) and not stray
        if label == "vramledger":
            ok &= good
        where = ", ".join(f"rank {r} on GPUs {p['gpus']}" for r, p in sorted(placement.items()))
        print(f"{'PASS' if good else 'FAIL'} {label}: every rank's process is on its own GPU only "
              f"(nvidia-smi: {where})")
    for key in ("allreduce_expandable_ok", "allreduce_contiguous_ok"):
        vals = [vl[r].get(key) for r in sorted(vl)]
        if all(v is None for v in vals):
            print(f"SKIP {key}: not measured")
            continue
        good = all(vals)
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} NCCL all_reduce on vramledger memory ({key}): {vals}")
    steps_dir = os.path.join(vl_dir, "steps")
    logs = sorted(os.listdir(steps_dir)) if os.path.isdir(steps_dir) else []
    good = len(logs) == len(vl) > 0
    ok &= good
    print(f"{'PASS' if good else 'FAIL'} per-rank step logs: {logs}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--allocator", choices=["native", "vramledger"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("NATIVE_DIR", "VRAMLEDGER_DIR"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not (args.worker and args.allocator and args.out):
        ap.error("--worker needs --allocator and --out (or use --compare)")
    worker(args.allocator, args.steps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
