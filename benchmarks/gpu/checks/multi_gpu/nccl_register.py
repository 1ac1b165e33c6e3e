"""NCCL buffer-registration worker of the multi-GPU check (run.py launches it under torchrun, once
per allocator, with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 and NCCL_DEBUG=INFO,
NCCL_DEBUG_SUBSYS=REG, NCCL_DEBUG_FILE=OUT/nccl.%p.log).

With the hook on, ProcessGroupNCCL registers every segment of torch's allocator snapshot when the
communicator is created, then attaches an allocator trace tracker that registers the segment of
each SEGMENT_ALLOC and deregisters it at its SEGMENT_FREE (torch 2.11 acts on those two only:
SEGMENT_MAP / SEGMENT_UNMAP of expandable pages are passed over). This worker attaches a second
tracker of its own (libvramledger_trace_counter.so, benchmarks/gpu/trace_counter.cc) before the
communicator exists, so it sees what NCCL's hook is shown, and drives the allocator through:

  1. 32 blocks of 20 MiB allocated before the communicator: registered from the snapshot;
  2. all_reduce on three buffers (1, 8, 64 MiB) and on a block of step 1;
  3. page recycling forced: every other block freed, then 200 MiB allocated; under vramledger the
     growth takes the free pages out of the holes (unmapped there, mapped at the new place: page
     moves), then all_reduce on it;
  4. a buffer inside vramledger.contiguous_segments() (a plain segment: SEGMENT_ALLOC, registered
     by the hook), all_reduce on it;
  5. everything freed and empty_cache(): SEGMENT_FREE (deregistered by the hook) and
     SEGMENT_UNMAP; then the memory allocated again (pages mapped anew, also into the range
     registered in step 1) and all_reduce on every new block.

Every all_reduce sums full(rank + 1) over the ranks and must give world * (world + 1) / 2 in every
element. Each rank writes OUT/rank<R>.json: the tracker's counts per action from before the
communicator to its end, the segments registered at creation, the registrations and
deregistrations the hook was due (SEGMENT_ALLOC / SEGMENT_FREE on this rank's device), page moves,
each all_reduce's result and any error. run.py matches the registrations against the
`register comm ... buffer ... size ...` lines NCCL wrote.

  torchrun --nproc-per-node N nccl_register.py --allocator native|vramledger --out DIR \
      --tracker .devbuild/lib/libvramledger_trace_counter.so
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import traceback

MiB = 1 << 20
# torch's TraceEntry::Action values (c10/core/CachingDeviceAllocator.h)
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")
SEGMENT_ALLOC, SEGMENT_FREE = ACTIONS.index("segment_alloc"), ACTIONS.index("segment_free")
_REGISTER = re.compile(r"register comm \S+ buffer (0x[0-9a-fA-F]+) size (\d+)")
_SKIPPED = re.compile(r"Skipping registration for buffer (0x[0-9a-fA-F]+) size (\d+)")


def parse_nccl_log(text: str) -> dict:
    """NCCL's REG-subsystem lines of one process: {"registered": [(addr, size)], "skipped":
    [(addr, size)], "warnings": [line]} (skipped: NCCL_LOCAL_REGISTER=0 or P2P through memcpy)."""
    out = {"registered": [], "skipped": [], "warnings": []}
    for line in text.splitlines():
        for key, pattern in (("registered", _REGISTER), ("skipped", _SKIPPED)):
            m = pattern.search(line)
            if m:
                out[key].append((int(m.group(1), 16), int(m.group(2))))
        if "NCCL WARN" in line:
            out["warnings"].append(line.strip())
    return out


def expected_registrations(at_init: list[tuple[int, int]], events: list[tuple],
                           device: int) -> dict:
    """What torch's hook is due: the segments of the snapshot at creation, then one registration
    per SEGMENT_ALLOC on `device` and one deregistration per SEGMENT_FREE of a registered segment.
    `events` are (action, device, addr, size) from the communicator's creation to its end."""
    registered = {addr for addr, _ in at_init}
    regs, deregs, unknown_frees = list(at_init), [], []
    for action, dev, addr, size in events:
        if dev != device:
            continue
        if action == SEGMENT_ALLOC:
            if addr not in registered:  # registerSegment(errorOnRereg=false) passes over it
                regs.append((addr, size))
                registered.add(addr)
        elif action == SEGMENT_FREE:
            if addr in registered:
                deregs.append((addr, size))
                registered.discard(addr)
            else:
                unknown_frees.append((addr, size))
    return {"registrations": regs, "deregistrations": deregs, "unknown_frees": unknown_frees}


class Tracker:
    """ctypes view of libvramledger_trace_counter.so."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.vramledger_tc_count.restype = ctypes.c_long
        self.lib.vramledger_tc_dropped.restype = ctypes.c_long
        u64 = ctypes.POINTER(ctypes.c_uint64)
        ip = ctypes.POINTER(ctypes.c_int)
        self.lib.vramledger_tc_events.argtypes = [ctypes.c_int, ctypes.c_int, ip, ip, u64, u64]

    def attach(self) -> None:
        if self.lib.vramledger_tc_attach() != 0:
            raise RuntimeError("attachAllocatorTraceTracker refused the tracker (see stderr)")

    def counts(self) -> dict[str, int]:
        return {name: int(self.lib.vramledger_tc_count(i)) for i, name in enumerate(ACTIONS)}

    def events(self, first: int = 0) -> list[tuple[int, int, int, int]]:
        out = []
        while True:
            n = 4096
            a, d = (ctypes.c_int * n)(), (ctypes.c_int * n)()
            addr, size = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
            got = self.lib.vramledger_tc_events(first + len(out), n, a, d, addr, size)
            out += [(a[i], d[i], int(addr[i]), int(size[i])) for i in range(got)]
            if got < n:
                return out


def run(args, torch, dist, rank: int, local: int, world: int, result: dict) -> None:
    tracker = Tracker(args.tracker)
    # torch's own allocator hands a tracker to the device allocators it has, so CUDA starts first.
    torch.cuda.init()
    tracker.attach()
    want = float(world * (world + 1) // 2)
    checks = result["all_reduce"]

    def reduce(name: str, t) -> None:
        t.fill_(rank + 1)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        checks.append({"name": name, "bytes": t.numel() * t.element_size(),
                       "ok": bool((t == want).all())})

    blocks = [torch.empty(20 * MiB // 4, device="cuda") for _ in range(32)]  # step 1
    torch.cuda.synchronize()
    result["at_init"] = [(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
                         if s["device"] == local]
    first_event = len(tracker.events())
    before = tracker.counts()
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    dist.barrier()
    moves_before = page_moves(local)
    for n in (1, 8, 64):  # step 2
        reduce(f"{n} MiB", torch.empty(n * MiB // 4, device="cuda"))
    reduce("a block registered at creation", blocks[0])
    del blocks[1::2]  # step 3: holes of whole free pages inside the registered range
    big = torch.empty(200 * MiB // 4, device="cuda")
    reduce("200 MiB grown after recycling", big)
    result["page_moves"] = None if moves_before is None else page_moves(local) - moves_before
    if args.allocator == "vramledger":  # step 4
        import vramledger
        with vramledger.contiguous_segments():
            plain = torch.empty(32 * MiB // 4, device="cuda")
        reduce("32 MiB in contiguous_segments()", plain)
        del plain
    del big, blocks  # step 5
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    again = [torch.empty(20 * MiB // 4, device="cuda") for _ in range(26)]
    for i, t in enumerate(again):
        reduce(f"block {i} after empty_cache", t)
    dist.barrier()
    dist.destroy_process_group()
    after = tracker.counts()
    events = tracker.events(first_event)
    result["counts"] = {k: after[k] - before[k] for k in ACTIONS}
    result["dropped_events"] = int(tracker.lib.vramledger_tc_dropped())
    result.update(expected_registrations(result["at_init"], events, local))


def page_moves(device: int) -> int | None:
    """vramledger's page moves on `device` so far; None under torch's allocator."""
    try:
        import vramledger
    except ImportError:
        return None
    if not vramledger.is_installed():
        return None
    return int(vramledger.fragmentation(device)["page_moves"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allocator", choices=["native", "vramledger"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tracker", required=True, help="path of libvramledger_trace_counter.so")
    args = ap.parse_args()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "1")
    result = {"rank": rank, "world": world, "device": local, "allocator": args.allocator,
              "pid": os.getpid(), "all_reduce": [], "error": None}
    try:
        if args.allocator == "vramledger":
            import vramledger
            vramledger.install()
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(local)
        run(args, torch, dist, rank, local, world, result)
    except Exception as e:  # the result names the failure; run.py prints it
        result["error"] = traceback.format_exception_only(type(e), e)[-1].strip()[:400]
        traceback.print_exc()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
