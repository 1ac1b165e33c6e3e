"""CUDA IPC part of the multi-GPU check: a CUDA tensor shared through torch.multiprocessing from a
process on GPU 0 to a process on GPU (1 % GPUs), and one shared back, both processes under
vramledger.install() with no options (its default), for a plain segment (allocated inside
vramledger.contiguous_segments(): one cudaMalloc, shared as a cudaIpcMemHandle) and for an
expandable segment (mapped pages, shared as POSIX descriptors of their physical handles).

For each layout and direction the sender allocates arange(N) + base on its own GPU and puts it on
a queue; the receiver copies it to its own GPU and compares (read), writes twice the values back
into the shared memory with copy_ (a copy across devices when the GPUs differ) and synchronizes;
the sender then checks that its tensor holds them (write). With one GPU both processes run on
GPU 0, which the result says.

  python ipc_pair.py --out RESULT.json [--gpus N]
Exit status 0 when every read and write was right, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import traceback

N = 2 * 1024 * 1024 + 123  # float32: a little over 8 MiB, not a multiple of a page
TIMEOUT_S = 120
LAYOUTS = ("plain", "expandable")


def allow_descriptor_access() -> None:
    """Lets the other process (a sibling) duplicate this one's descriptors under Yama's
    ptrace_scope 1 (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)); expandable pages travel so."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def segment_kind(torch, ptr: int) -> str:
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return "pages" if seg.get("is_expandable") else "cudaMalloc"
    return "?"


def send(torch, vramledger, me, device, layout, inbox, outbox) -> dict:
    base = 1.0 + me
    scope = vramledger.contiguous_segments() if layout == "plain" else contextlib.nullcontext()
    with scope:
        x = torch.arange(N, dtype=torch.float32, device=f"cuda:{device}") + base
    torch.cuda.synchronize(device)
    kind = segment_kind(torch, x.data_ptr())
    outbox.put(x)
    _, read_ok, where = inbox.get(timeout=TIMEOUT_S)
    torch.cuda.synchronize(device)
    expect = (torch.arange(N, dtype=torch.float32, device=f"cuda:{device}") + base) * 2
    write_ok = bool(torch.equal(x, expect))
    outbox.put("checked")
    inbox.get(timeout=TIMEOUT_S)  # the receiver let go: x may be freed
    del x
    return {"layout": layout, "from_gpu": device, "to_gpu": where, "segment": kind,
            "read_ok": read_ok, "write_ok": write_ok}


def receive(torch, sender, device, inbox, outbox) -> None:
    x = inbox.get(timeout=TIMEOUT_S)
    y = x.to(f"cuda:{device}")
    expect = torch.arange(N, dtype=torch.float32, device=f"cuda:{device}") + (1.0 + sender)
    read_ok = bool(torch.equal(y, expect))
    x.copy_(y * 2)
    torch.cuda.synchronize(x.device)
    torch.cuda.synchronize(device)
    outbox.put(("written", read_ok, device))
    inbox.get(timeout=TIMEOUT_S)  # "checked"
    del x, y
    torch.cuda.synchronize(device)
    outbox.put("released")


def peer(me, device, inbox, outbox, results) -> None:
    try:
        allow_descriptor_access()
        import vramledger
        vramledger.install()
        import torch
        torch.cuda.set_device(device)
        for layout in LAYOUTS:
            for sender in (0, 1):
                if sender == me:
                    results.put(send(torch, vramledger, me, device, layout, inbox, outbox))
                else:
                    receive(torch, sender, device, inbox, outbox)
    except Exception:
        results.put({"error": f"process on GPU {device}: {traceback.format_exc(limit=4)}"})
        outbox.put(("failed", False, device))


def run(gpus: int) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    a_to_b, b_to_a, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    devices = (0, 1 % gpus)
    procs = [ctx.Process(target=peer, args=(0, devices[0], b_to_a, a_to_b, results)),
             ctx.Process(target=peer, args=(1, devices[1], a_to_b, b_to_a, results))]
    for p in procs:
        p.start()
    rows, errors = [], []
    for _ in range(2 * len(LAYOUTS)):
        try:
            r = results.get(timeout=2 * TIMEOUT_S)
        except queue.Empty:
            errors.append("no result within the timeout")
            break
        if "error" in r:
            errors.append(r["error"])
            break
        rows.append(r)
    for p in procs:
        p.join(TIMEOUT_S)
        if p.is_alive():
            p.kill()
            errors.append(f"process {p.pid} did not end")
        elif p.exitcode != 0:
            errors.append(f"process {p.pid} exit {p.exitcode}")
    return {"gpus": list(devices), "same_gpu": devices[0] == devices[1], "rows": rows,
            "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: all there are)")
    args = ap.parse_args()
    gpus = args.gpus
    if gpus <= 0:
        import torch
        gpus = torch.cuda.device_count()  # NVML-based: CUDA stays uninitialised here
    result = run(max(gpus, 1))
    with open(args.out, "w") as f:
        json.dump(result, f)
    good = not result["errors"] and len(result["rows"]) == 2 * len(LAYOUTS) and all(
        r["read_ok"] and r["write_ok"] for r in result["rows"])
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
