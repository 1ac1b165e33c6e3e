"""FSDP2 worker of the multi-GPU check (run.py launches it under torchrun, once per allocator).

GPT-2-medium (random weights from its config, dropout off, no download), every transformer block
and then the whole model wrapped with `fully_shard`, AdamW lr 1e-4, bf16 autocast, batch 4 per
rank, sequence lengths U[128, 1024] from random.seed(0) (the same on every rank and under both
allocators), token ids from a CUDA generator seeded 1000 + rank. Each step's loss is the mean over
the ranks (all_reduce). Under vramledger, vramledger.install() with no options (its default:
torch-native mode, expandable segments with page recycling) comes before CUDA starts, with
step_log=OUT/steps, and vramledger.step() ends each step, so each rank writes its step log.

  torchrun --nproc-per-node N fsdp.py --allocator native|vramledger --out DIR [--steps 10]
      [--trace TRACE.pickle.gz]

With --trace, rank 0 records the allocator's memory history (torch's or vramledger's
record_memory_history, no stacks) and takes a snapshot after each step outside its timed span,
whose `snapshot` entry ends the step in the trace, as the capacity benchmark's traced trials do;
the last snapshot goes to the path, which `vramledger replay` reads: the streams' allocations
of sharded training, to try a recycling policy on without a GPU. Its step times include the
recording's cost.

Each rank writes DIR/rank<R>.json: losses, step times, median step time and the median of the
steady steps (those after the first WARM_STEPS, which fill the cache), peak allocated and peak
reserved bytes (torch.cuda.memory_stats, over the whole run) and their ratio, and per step what
the allocator's counters changed by, outside the timed span: `device_alloc` / `device_free`
(num_device_alloc / num_device_free: cudaMalloc / cudaFree, or maps and unmaps of pages) and,
under vramledger, its driver time and waits (benchmarks/capacity/trial.vramledger_totals:
`step_driver_ms`, `step_waits`, `step_wait_ms`) and `page_moves`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
sys.path[:0] = [HERE, ROOT]
from benchmarks.capacity.trial import vramledger_totals  # noqa: E402
from table import WARM_STEPS  # noqa: E402  (beside this file: the steps the table leaves out)


def counters(torch, vramledger) -> dict[str, float]:
    """The running totals whose change over a step the rank records."""
    stats = torch.cuda.memory_stats()
    out = {"device_alloc": stats.get("num_device_alloc", 0),
           "device_free": stats.get("num_device_free", 0)}
    if vramledger is not None:
        frag = vramledger.fragmentation()
        out.update(vramledger_totals(frag), page_moves=frag["page_moves"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allocator", choices=["native", "vramledger"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trace", help="rank 0's memory history, a snapshot per step, to this path")
    args = ap.parse_args()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    vramledger = None
    if args.allocator == "vramledger":
        import vramledger
        vramledger.install(step_log=os.path.join(args.out, "steps"))

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.cuda.set_device(local)
    trace = args.trace if rank == 0 else None
    last = None  # the last snapshot taken (with --trace)
    if trace:
        if vramledger is not None:
            record, take_snapshot = vramledger.record_memory_history, vramledger.snapshot
        else:
            record = torch.cuda.memory._record_memory_history
            take_snapshot = torch.cuda.memory._snapshot
        record("all", context=None, stacks="python", max_entries=3_000_000)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    torch.manual_seed(0)  # the same initial weights on every rank and under both allocators
    with torch.device("cuda"):  # initialised on the GPU: seconds less than on the host
        model = GPT2LMHeadModel(cfg)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    random.seed(0)
    losses, times = [], []
    per_step: dict[str, list[float]] = {}
    for _ in range(args.steps):
        seq = random.randint(128, 1024)
        ids = torch.randint(0, cfg.vocab_size, (4, seq), device="cuda", generator=gen)
        torch.cuda.synchronize()
        if args.trace and world > 1:
            dist.barrier()  # rank 0's snapshot stays out of the other ranks' timed spans too
        before = counters(torch, vramledger)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for key, total in counters(torch, vramledger).items():
            per_step.setdefault(key, []).append(total - before[key])
        losses.append(float(mean) / world)
        if vramledger is not None:
            vramledger.step()
        if trace:
            last = take_snapshot()  # its `snapshot` entry ends the step in the trace
    if trace:
        # torch's snapshot holds the entries before its own: one more holds the last step's.
        if vramledger is None or last is None:
            last = take_snapshot()
        from vramledger._snapshot import write_snapshot
        write_snapshot(last, trace)
    stats = torch.cuda.memory_stats()
    peak_alloc = int(stats["allocated_bytes.all.peak"])
    peak_reserved = int(stats["reserved_bytes.all.peak"])
    result = {"rank": rank, "world": world, "device": local, "allocator": args.allocator,
              "losses": losses, "step_s": times, "median_step_s": statistics.median(times),
              "steady_median_step_s": statistics.median(times[WARM_STEPS:] or times), **per_step,
              "peak_allocated": peak_alloc, "peak_reserved": peak_reserved,
              "utilization": peak_alloc / peak_reserved if peak_reserved else 0.0}
    if vramledger is not None:
        result["mode"] = vramledger.installed_mode()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
