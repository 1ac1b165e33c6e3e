# Records, under torch's own caching allocator on a GPU, a program that works on 10 streams in
# phases and calls torch.cuda.empty_cache() between them: the trace CSV the replay reads, and
# torch's own peak reserved bytes. --compare prints them beside the replay's figures.
"""Record a multi-stream trace with empty_cache() phases, and compare replays of it.

  record:   python record_empty_cache_trace.py --out DIR [--phases 4] [--streams 10]
            writes DIR/trace-empty-cache.csv.gz (``action,addr,size,stream,time_us``, as
            traces/ holds) and DIR/torch.json (torch's memory_stats figures: peak reserved,
            peak allocated, num_alloc_retries; the empty_cache() calls made).
  compare:  python record_empty_cache_trace.py --compare DIR
            reads DIR/torch.json, DIR/followed.json and DIR/ignored.json (the replay's --json
            output with and without --ignore-releases) and prints torch's peak reserved beside
            both replays'; exit status 0 when the replay that follows the releases is within 1%.

Each phase gives every stream a set of tensors whose sizes grow from phase to phase (so blocks
cached by an earlier phase cannot serve a later one), runs a matmul on each, frees half and
allocates the rest, then frees everything; between phases the program synchronizes and calls
torch.cuda.empty_cache(). Run under torch's default allocator (PYTORCH_CUDA_ALLOC_CONF unset).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

_GIB = 1 << 30
_MIB = 1 << 20


def _record(out: str, phases: int, streams: int) -> int:
    import torch  # only the record mode needs a GPU

    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        print(f"record: PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']} is set; "
              "this trace is meant for torch's default allocator", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("record: no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=1_000_000)
    side = [torch.cuda.Stream() for _ in range(streams)]
    calls = 0
    for phase in range(phases):
        live = []
        for i, stream in enumerate(side):
            with torch.cuda.stream(stream):
                # Sizes in MiB grow by 16 MiB a phase; a little per stream so they differ.
                first = [torch.empty(((96 + 16 * phase + 8 * k) * _MIB + 4096 * i) // 2,
                                     dtype=torch.bfloat16, device="cuda") for k in range(4)]
                a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
                b = a @ a  # work on the stream, so the blocks are used there
                del first[0], first[0]  # half of them go back to the stream's cache
                second = [torch.empty(((80 + 16 * phase) * _MIB) // 2, dtype=torch.bfloat16,
                                      device="cuda"),
                          torch.empty((3 * _MIB) // 2, dtype=torch.bfloat16, device="cuda")]
                live.append((first, second, a, b))
        torch.cuda.synchronize()
        del live
        torch.cuda.empty_cache()
        calls += 1
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][0]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "trace-empty-cache.csv.gz")
    with gzip.open(path, "wt") as f:
        f.write("action,addr,size,stream,time_us\n")
        for e in trace:
            addr = e["device_free"] if e["action"] == "oom" else e["addr"]
            f.write(f"{e['action']},{addr},{e['size']},{e['stream']},{e.get('time_us', 0)}\n")
    figures = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "streams": streams, "phases": phases, "empty_cache_calls": calls,
               "trace_events": len(trace),
               "segment_frees": sum(e["action"] == "segment_free" for e in trace),
               "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
               "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
               "num_alloc_retries": stats["num_alloc_retries"]}
    with open(os.path.join(out, "torch.json"), "w") as f:
        json.dump(figures, f, indent=2)
    print(json.dumps(figures))
    print(f"wrote {path}")
    return 0


def _compare(out: str) -> int:
    with open(os.path.join(out, "torch.json")) as f:
        torch_figures = json.load(f)
    replays = {}
    for name in ("followed", "ignored"):
        with open(os.path.join(out, f"{name}.json")) as f:
            replays[name] = json.load(f)
    torch_reserved = torch_figures["peak_reserved_bytes"]
    print(f"program: {torch_figures['streams']} streams, {torch_figures['phases']} phases, "
          f"{torch_figures['empty_cache_calls']} empty_cache() calls, "
          f"{torch_figures['trace_events']:,} trace events; {torch_figures['device']}, "
          f"torch {torch_figures['torch']}")
    print(f"| {'figure':<44} | {'peak reserved':>22} | {'vs torch':>9} |")
    print(f"| {'torch (memory_stats reserved_bytes.all.peak)':<44} | "
          f"{torch_reserved:>14,} {torch_reserved / _GIB:>5.2f} GiB | {'':>9} |")
    recorded = replays["followed"]["recorded_peak_reserved_bytes"]
    print(f"| {'the trace (its segment events)':<44} | {recorded:>14,} {recorded / _GIB:>5.2f} GiB"
          f" | {100 * (recorded / torch_reserved - 1):>+8.2f}% |")
    for name, label in (("followed", "replay, torch's policy, releases followed"),
                        ("ignored", "replay, torch's policy, --ignore-releases")):
        peak = replays[name]["peak_reserved_bytes"]
        print(f"| {label:<44} | {peak:>14,} {peak / _GIB:>5.2f} GiB | "
              f"{100 * (peak / torch_reserved - 1):>+8.2f}% |")
    rel = replays["followed"]["releases"]
    print(f"releases in the trace: {rel['runs']} ({rel['empty_cache_runs']} empty_cache(), "
          f"{rel['retry_runs']} possible out-of-memory retries); applied {rel['applied']}, "
          f"skipped {rel['skipped']}")
    within = abs(replays["followed"]["peak_reserved_bytes"] / torch_reserved - 1) <= 0.01
    print(f"replay with releases followed within 1% of torch: {'yes' if within else 'NO'}")
    return 0 if within else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="record: the folder to write the trace and figures to")
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument("--compare", metavar="DIR", help="compare the replays in DIR")
    args = parser.parse_args(argv)
    if args.compare:
        return _compare(args.compare)
    if not args.out:
        parser.error("--out DIR (record) or --compare DIR is needed")
    if args.phases < 1 or args.streams < 1:
        parser.error("--phases and --streams must be at least 1")
    return _record(args.out, args.phases, args.streams)


if __name__ == "__main__":
    sys.exit(main())
