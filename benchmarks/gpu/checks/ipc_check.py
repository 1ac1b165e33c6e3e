"""GPU check of CUDA IPC between a vramledger process and a torch-allocator process: a CUDA tensor
sent with torch.multiprocessing opens and is read and written on the other side, both ways, for
plain segments (cudaMalloc memory, cudaIpcMemHandle) and expandable segments (mapped pages,
shared as POSIX file descriptors of their physical handles).

Each case is two spawned processes, a sender and a receiver, each with its own allocator:
  torch      torch's own caching allocator (expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  vramledger vramledger.install(mode="native") (expandable: expandable_segments=True)
The sender allocates a pad and then a tensor x = arange(N) + 1 (so x starts inside its segment or
page, at an offset), notes from torch.cuda.memory_snapshot() whether x's segment is expandable,
and puts x on a torch.multiprocessing queue. The receiver checks it reads arange(N) + 1,
doubles it in place, synchronizes, and says so; the sender then checks that x holds the
doubled values (the write reached its memory), and the receiver that its own reserved bytes did
not grow (opened memory is not its allocator's). One table row per case.

Usage on the GPU machine (plugin built with `benchmarks/gpu/run.sh prepare`, carry
.devbuild/lib; run.sh item `ipc`):
  VRAMLEDGER_PLUGIN=.devbuild/lib/libvramledger_plugin.so PYTHONPATH=torch_plugin/python \
      /opt/torch/.venv/bin/python3 benchmarks/gpu/checks/ipc_check.py
Exit status: 0 when no case failed (no CUDA device: nothing runs; pidfd_getfd refused on the
machine, as torch's own expandable-segment case shows: those cases are SKIP), 1 when one failed.
"""

from __future__ import annotations

import os
import queue
import sys
import traceback

N = 2 * 1024 * 1024  # float32: 8 MiB, more than one page and not a multiple of one
PAD = 3 * 1024 * 1024 + 512  # bytes allocated first, so that x starts at an offset
TIMEOUT_S = 120

# (sender, receiver), each (allocator, expandable). The first is torch with itself: where it fails
# to duplicate the sender's descriptors (pidfd_getfd refused by a seccomp profile or Yama), the
# expandable cases cannot pass either, and are reported as skipped for that reason.
REFERENCE = (("torch", True), ("torch", False))
CASES = [
    REFERENCE,
    (("vramledger", False), ("torch", False)),
    (("vramledger", True), ("torch", False)),
    (("torch", False), ("vramledger", False)),
    (("torch", False), ("vramledger", True)),
    (("torch", True), ("vramledger", True)),
    (("vramledger", True), ("vramledger", True)),
]


def setup(allocator: str, expandable: bool) -> None:
    """Makes `allocator` this process's CUDA allocator, before CUDA starts."""
    if allocator == "torch":
        if expandable:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        else:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        return
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import vramledger

    vramledger.install(mode="native", expandable_segments=expandable)


def name(role: tuple[str, bool]) -> str:
    return f"{role[0]} {'expandable' if role[1] else 'plain'}"


def segment_of(torch, ptr: int) -> dict | None:
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    return None


def allow_descriptor_access() -> None:
    """Lets the receiver (a sibling, not a child) duplicate this process's descriptors where
    Yama's ptrace_scope 1 would refuse it (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY))."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def sender(role, tensors, replies, results) -> None:
    try:
        allow_descriptor_access()
        setup(*role)
        import torch

        pad = torch.empty(PAD, dtype=torch.uint8, device="cuda")
        x = torch.arange(N, dtype=torch.float32, device="cuda") + 1
        torch.cuda.synchronize()
        seg = segment_of(torch, x.data_ptr())
        kind = "?" if seg is None else ("pages" if seg.get("is_expandable") else "cudaMalloc")
        offset = -1 if seg is None else x.data_ptr() - seg["address"]
        tensors.put(x)
        reply = replies.get(timeout=TIMEOUT_S)
        if reply != "written":
            results.put(("sender", False, kind, offset, f"receiver: {reply}"))
            return
        torch.cuda.synchronize()
        expected = (torch.arange(N, dtype=torch.float32, device="cuda") + 1) * 2
        ok = bool(torch.equal(x, expected))
        results.put(("sender", ok, kind, offset, "sees the write" if ok else "write not seen"))
        replies.get(timeout=TIMEOUT_S)  # the receiver let go: x may be freed now
        del pad, x
    except Exception:
        results.put(("sender", False, "?", -1, traceback.format_exc(limit=3)))


def receiver(role, tensors, replies, results) -> None:
    try:
        setup(*role)
        import torch

        torch.cuda.init()
        reserved_before = torch.cuda.memory_reserved()
        y = tensors.get(timeout=TIMEOUT_S)
        expected = torch.arange(N, dtype=torch.float32, device="cuda") + 1
        read_ok = bool(torch.equal(y, expected))
        y.mul_(2)
        torch.cuda.synchronize()
        del expected
        torch.cuda.empty_cache()
        grew = torch.cuda.memory_reserved() - reserved_before
        replies.put("written" if read_ok else "read wrong values")
        del y
        torch.cuda.synchronize()
        note = "reads, writes" if read_ok else "read wrong values"
        if grew > 0:
            note += f"; its reserved grew by {grew} bytes after empty_cache"
        results.put(("receiver", read_ok, "", -1, note))
        replies.put("released")
    except Exception:
        replies.put("receiver failed")
        results.put(("receiver", False, "", -1, traceback.format_exc(limit=3)))
        replies.put("released")


def run_case(mp, send_role, recv_role) -> tuple[bool, str, int, str]:
    tensors, replies, results = mp.Queue(), mp.Queue(), mp.Queue()
    procs = [
        mp.Process(target=sender, args=(send_role, tensors, replies, results)),
        mp.Process(target=receiver, args=(recv_role, tensors, replies, results)),
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            role, ok, kind, offset, note = results.get(timeout=2 * TIMEOUT_S)
            got[role] = (ok, kind, offset, note)
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(got) < 2:
        return False, "?", -1, f"timed out ({sorted(got)} reported)"
    s_ok, kind, offset, s_note = got["sender"]
    r_ok, _, _, r_note = got["receiver"]
    return s_ok and r_ok, kind, offset, f"receiver {r_note}; sender {s_note}"


def main() -> int:
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError as e:
        print(f"SKIP: torch is not importable ({e})")
        return 0
    if not torch.cuda.is_available():  # reads the driver only; this process never starts CUDA
        print("SKIP: no CUDA device")
        return 0
    mp = tmp.get_context("spawn")
    try:
        scope = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError:
        scope = "absent"
    print(f"kernel.yama.ptrace_scope: {scope}")
    rows, failed, no_pidfd = [], 0, False
    for send_role, recv_role in CASES:
        if no_pidfd and send_role[1]:
            rows.append((name(send_role), name(recv_role), "pages", -1, "SKIP",
                         "torch's own expandable IPC failed in pidfd_getfd on this machine"))
            print(f"SKIP {rows[-1][0]} -> {rows[-1][1]}: {rows[-1][5]}", flush=True)
            continue
        ok, kind, offset, note = run_case(mp, send_role, recv_role)
        if (send_role, recv_role) == REFERENCE and not ok and "pidfd" in note:
            no_pidfd = True
            rows.append((name(send_role), name(recv_role), kind, offset, "SKIP",
                         "reference case: " + note.replace("\n", " | ")))
            print(f"SKIP {rows[-1][0]} -> {rows[-1][1]}: {rows[-1][5]}", flush=True)
            continue
        failed += not ok
        rows.append((name(send_role), name(recv_role), kind, offset, "PASS" if ok else "FAIL",
                     note.replace("\n", " | ")))
        print(f"{rows[-1][4]} {rows[-1][0]} -> {rows[-1][1]}: {rows[-1][5]}", flush=True)
    print()
    print("| sender | receiver | sender's segment | offset in it | result | what each side saw |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5][:200]} |")
    passed = sum(r[4] == "PASS" for r in rows)
    print(f"\nipc_check: {passed} of {len(rows)} cases passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
