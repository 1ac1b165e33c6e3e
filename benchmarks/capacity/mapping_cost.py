"""What a CUDA call costs the host while the process holds many blocks of device memory, under
each allocator. The capacity rows' steps are host-bound, and on some machines vramledger's were
slower at queuing the same work; whether a call costs the driver more the more objects
(cudaMalloc segments, mapped pages) the allocator holds is a candidate cause. This measures that
apart from training: one process per variant allocates blocks step by step (COUNTS blocks of
BLOCK_MIB, kept live) and, at each count, times calls that do nothing but reach those blocks.

Probes (each the median over REPEATS batches of BATCH calls; the GPU drained before each batch,
outside the timed span, and the drain after it timed too, so a batch whose calls waited on a
full queue shows; the addresses visit the blocks in a fixed shuffled order, so consecutive calls
reach different segments or pages under every allocator):
  control   cudaGetDevice: no device address, the process's baseline
  ptr_attr  cudaPointerGetAttributes on a block (the driver looks the address up)
  memset    cudaMemsetAsync of 256 bytes in a block
  memcpy    cudaMemcpyAsync of 256 bytes between two blocks, device to device
  launch    a one-element tensor's add_(1): a kernel launch through torch's dispatcher (a fixed
            few us of Python and dispatch in every process, beside the launch's own cost)
The first four go to the libcudart the process loaded (found in /proc/self/maps) through ctypes,
whose cost is the same in every process. A training step of the Llama-1B 24 GiB batch row makes
about 3,100 launches and some hundreds of memsets and copies, so only the launches could carry a
gap of tens of ms a step. Only a probe's growth with the count, within one process and beside
the control's, compares across variants: levels are one process each, and processes differ.
Per variant and count the record holds each probe's us per call, the drain's us per batch, and
what the allocator holds (torch's num_device_alloc, which under expandable segments counts map
calls, reserved bytes, and vramledger's cuMemMap calls).

  python -m benchmarks.capacity.mapping_cost run --variants V ... --out FILE.json [--rounds N]
      [--counts 0,256,...] [--block-mib M] [--timeout-s S] [--budget-s S]
      (on the GPU machine; benchmarks/gpu/run.sh item `mapcost`) runs each variant (conf_rounds'
      variants: torch, torch-expandable, default, vramledger settings, BUILD@...) in its own
      process, rounds in rotating order, into a new FILE, and prints the table.
  python -m benchmarks.capacity.mapping_cost table FILE.json
      (any machine) prints the table of a file's runs: per variant and count, each probe's us per
      call (median over rounds), and per probe its growth per 1,000 blocks (least squares over
      the counts above 0, whose blocks are the measured kind).
Exit status 0; 1 when a run failed or the budget ended first (run); 2 on bad arguments (an --out
that exists included) and when FILE cannot be read or holds no run (table).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Callable

from benchmarks.capacity import conf_rounds, refuse, trial

RESULT = "RESULT_JSON "
PROBES = ("control", "ptr_attr", "memset", "memcpy", "launch")
COUNTS = (0, 256, 1024, 2048, 3072)
BLOCK_MIB = 6  # vramledger's default page: one block, one page, one mapping
BATCH = 400
REPEATS = 7
MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def cudart(maps: str | None = None) -> tuple[ctypes.CDLL, str]:
    """The CUDA runtime library this process loaded (torch's), found in /proc/self/maps, and its
    path.

    Raises:
      OSError: no libcudart is loaded (a runtime loaded here instead could be another one).
    """
    maps = maps if maps is not None else (trial.read_text("/proc/self/maps") or "")
    paths = [line.split(None, 5)[5].removesuffix(" (deleted)") for line in maps.splitlines()
             if "libcudart.so" in line and len(line.split(None, 5)) == 6]
    if not paths:
        raise OSError("no libcudart in this process (is CUDA initialised?)")
    return ctypes.CDLL(paths[0]), paths[0]


def time_batches(call: Callable[[int], object], drain: Callable[[], None],
                 batch: int = BATCH, repeats: int = REPEATS,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Microseconds a call of `call(i)` takes, the median over `repeats` batches of `batch` calls
    (i counting on across batches), and the median time of the `drain()` after each batch (us;
    near 0 when the calls, not the GPU, set the pace). `drain()` also runs before the first."""
    per_call, drains = [], []
    i = 0
    drain()
    for _ in range(repeats):
        t0 = clock()
        for _ in range(batch):
            call(i)
            i += 1
        t1 = clock()
        drain()
        per_call.append((t1 - t0) / batch * 1e6)
        drains.append((clock() - t1) * 1e6)
    return statistics.median(per_call), statistics.median(drains)


def probes(rt, blocks: list, scalar) -> dict[str, Callable[[int], object]]:
    """The probes' calls over `blocks` (tensors held), in a fixed shuffled order; with fewer than
    two blocks, over the scalar's storage."""
    ptrs = [b.data_ptr() for b in blocks]
    random.Random(0).shuffle(ptrs)
    if len(ptrs) < 2:
        ptrs = [scalar.data_ptr()] * 2
    attr = ctypes.create_string_buffer(256)  # cudaPointerAttributes: 88 bytes in CUDA 13
    device = ctypes.c_int()
    n = len(ptrs)
    half = n // 2  # memcpy's source: half the order away, another segment or page than its dst

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUDA error {rc}")

    return {
        "control": lambda i: check(rt.cudaGetDevice(ctypes.byref(device)), "cudaGetDevice"),
        "ptr_attr": lambda i: check(rt.cudaPointerGetAttributes(attr, ctypes.c_void_p(ptrs[i % n])),
                                    "cudaPointerGetAttributes"),
        "memset": lambda i: check(rt.cudaMemsetAsync(ctypes.c_void_p(ptrs[i % n]), 0,
                                                     ctypes.c_size_t(256), None),
                                  "cudaMemsetAsync"),
        "memcpy": lambda i: check(rt.cudaMemcpyAsync(ctypes.c_void_p(ptrs[i % n]),
                                                     ctypes.c_void_p(ptrs[(i + half) % n]),
                                                     ctypes.c_size_t(256),
                                                     MEMCPY_DEVICE_TO_DEVICE, None),
                                  "cudaMemcpyAsync"),
        "launch": lambda i: scalar.add_(1),
    }


def held(allocator: str, torch) -> dict:
    """What the allocator says it holds: torch's num_device_alloc and reserved bytes and, under
    vramledger, the cuMemMap calls it made."""
    mem = sys.modules["vramledger"] if allocator == "vramledger" else torch.cuda
    stats = mem.memory_stats()
    out = {"num_device_alloc": stats.get("num_device_alloc", 0),
           "reserved_bytes": stats.get("reserved_bytes.all.current", 0)}
    if allocator == "vramledger":
        out["cu_mem_map"] = mem.fragmentation()["driver_calls"]["cuMemMap"]["count"]
    return out


def child(allocator: str, counts: list[int], block_mib: int) -> dict:
    """Runs the probes in this process (nothing of CUDA initialised yet) at each count of blocks
    held, in increasing order, and returns its record; a count the card cannot hold ends it
    (`oom` names the count), keeping the counts measured."""
    if allocator == "vramledger":
        import vramledger
        vramledger.install()
    import torch
    scalar = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    rt, path = cudart()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudart": path,
           "host": trial.host_facts(), "block_mib": block_mib, "at": []}
    if allocator == "vramledger":
        out["mode"] = sys.modules["vramledger"].installed_mode()
    blocks = []
    for count in sorted(counts):
        try:
            while len(blocks) < count:
                blocks.append(torch.empty(block_mib << 20, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            out["oom"] = count
            break
        torch.cuda.synchronize()
        calls = probes(rt, blocks, scalar)
        us, drain_us = {}, {}
        for name in PROBES:
            us[name], drain_us[name] = time_batches(calls[name], torch.cuda.synchronize)
        out["at"].append({"blocks": count, "us": us, "drain_us": drain_us,
                          **held(allocator, torch)})
    return out


def run_child(variant: conf_rounds.Variant, counts: list[int], block_mib: int,
              timeout_s: float) -> dict:
    """The child in a new process, in the variant's environment (trial.process_env)."""
    env = trial.process_env(variant.allocator, variant.conf, variant.plugin, dict(variant.env))
    cmd = [sys.executable, "-m", "benchmarks.capacity.mapping_cost", "child", variant.allocator,
           ",".join(map(str, counts)), str(block_mib)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=trial.ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "timed_out": True, "error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    return dict(json.loads(lines[-1][len(RESULT):]), ok=True, wall_s=time.monotonic() - t0)


def slope(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of y over x, or None with fewer than two distinct x."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    return (sum((x - mx) * (y - my) for x, y in points)
            / sum((x - mx) ** 2 for x in xs))


def table(runs: list[dict]) -> str:
    """Per variant and count of blocks: each probe's us per call (median over the variant's runs
    that reached that count), the longest of the probes' drains, and what the allocator held;
    per variant, each probe's growth in us per 1,000 blocks over the counts above 0.

    Raises:
      ValueError: no run that measured anything.
    """
    done = [r for r in runs if r.get("ok") and r.get("at")]
    if not done:
        raise ValueError("no run that measured anything")
    lines = ["| variant | blocks | runs | " + " | ".join(f"{p} us" for p in PROBES)
             + " | drain us | device allocs | reserved GiB | cuMemMap |",
             "|---|---|---|" + "---|" * (len(PROBES) + 4)]
    growth = ["| variant | runs | " + " | ".join(f"{p} us / 1,000 blocks" for p in PROBES) + " |",
              "|---|---|" + "---|" * len(PROBES)]
    for v in dict.fromkeys(r["variant"] for r in done):
        mine = [r for r in done if r["variant"] == v]
        points = {p: [] for p in PROBES}
        for count in sorted({a["blocks"] for r in mine for a in r["at"]}):
            at = [a for r in mine for a in r["at"] if a["blocks"] == count]
            cells = []
            for p in PROBES:
                values = [a["us"][p] for a in at if p in a["us"]]
                if count > 0:  # count 0 reaches the scalar's small block, another kind
                    points[p] += [(count, x) for x in values]
                cells.append(f"{statistics.median(values):.2f}" if values else "-")
            drains = [max(a["drain_us"].values()) for a in at if a.get("drain_us")]
            cells.append(f"{statistics.median(drains):.0f}" if drains else "-")
            cells.append(f"{statistics.median(a.get('num_device_alloc', 0) for a in at):.0f}")
            cells.append(f"{statistics.median(a.get('reserved_bytes', 0) for a in at) / 2**30:.1f}")
            maps = [a["cu_mem_map"] for a in at if "cu_mem_map" in a]
            cells.append(f"{statistics.median(maps):.0f}" if maps else "-")
            lines.append(f"| {v} | {count} | {len(at)} | " + " | ".join(cells) + " |")
        slopes = [slope(points[p]) for p in PROBES]
        growth.append(f"| {v} | {len(mine)} | " + " | ".join(
            "-" if s is None else f"{s * 1000:+.2f}" for s in slopes) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(growth)


def run_all(variants: list[str], rounds: int, out: str, counts: list[int], block_mib: int,
            budget_s: float, timeout_s: float,
            one: Callable[..., dict] = run_child, log: Callable[[str], None] = print) -> int:
    """Runs every variant once a round in rotating order (conf_rounds.order), adding each run to
    `out` as it ends. Returns how many runs failed, plus one when the budget ended first."""
    parsed = {v: conf_rounds.parse_variant(v) for v in variants}
    runs: list[dict] = []
    start = time.monotonic()
    failed = 0
    for r in range(rounds):
        for v in conf_rounds.order(variants, r):
            left = budget_s - (time.monotonic() - start)
            if left < min(timeout_s, 30.0):
                log(f"mapping cost: the budget ended before round {r}, {v}")
                return failed + 1
            record = dict(one(parsed[v], counts, block_mib, min(timeout_s, left)),
                          variant=v, round=r)
            runs.append(record)
            tmp = out + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"counts": counts, "block_mib": block_mib, "runs": runs}, f, indent=1)
            os.replace(tmp, out)
            if not record["ok"]:
                failed += 1
                log(f"mapping cost: round {r}, {v}: failed: {record.get('error')}")
            else:
                log(f"mapping cost: round {r}, {v}: " + ", ".join(
                    f"{a['blocks']}: {a['us']['memset']:.2f}" for a in record["at"])
                    + " us a memset")
    return failed


def parse_counts(text: str) -> list[int]:
    """"0,256,1024" as a sorted list of distinct counts.

    Raises:
      ValueError: not comma-separated whole numbers of at least 0.
    """
    try:
        counts = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise ValueError(f"--counts {text!r}: expected whole numbers, comma-separated") from None
    if not counts or counts[0] < 0:
        raise ValueError(f"--counts {text!r}: counts are at least 0")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.mapping_cost",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the probes under each variant (GPU machine)")
    r.add_argument("--variants", nargs="+", required=True)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--out", required=True)
    r.add_argument("--counts", default=",".join(map(str, COUNTS)))
    r.add_argument("--block-mib", type=int, default=BLOCK_MIB)
    r.add_argument("--timeout-s", type=float, default=180.0)
    r.add_argument("--budget-s", type=float, default=600.0)
    t = sub.add_parser("table", help="the table of a file's runs")
    t.add_argument("file")
    c = sub.add_parser("child")  # the process run_child starts
    c.add_argument("allocator", choices=trial.ALLOCATORS)
    c.add_argument("counts")
    c.add_argument("block_mib", type=int)
    a = ap.parse_args(argv)
    if a.command == "child":
        print(RESULT + json.dumps(child(a.allocator, parse_counts(a.counts), a.block_mib)),
              flush=True)
        return 0
    if a.command == "table":
        try:
            with open(a.file, encoding="utf-8") as f:
                runs = json.load(f)["runs"]
            text = table(runs)
        except (OSError, ValueError, KeyError, TypeError) as e:
            return refuse("mapping cost", f"{a.file}: {e}")
        print(text)
        return 0
    conf_rounds.check_run_flags(ap, a)
    if a.block_mib < 1:
        ap.error(f"--block-mib must be at least 1, got {a.block_mib}")
    folder = os.path.dirname(os.path.abspath(a.out))
    if os.path.isdir(a.out) or not os.path.isdir(folder):
        ap.error(f"{a.out}: not a file in a folder that exists")
    if os.path.exists(a.out):  # its runs would be taken for this call's
        ap.error(f"{a.out} exists; name a new file")
    try:
        counts = parse_counts(a.counts)
        variants = list(dict.fromkeys(a.variants))
        for v in variants:
            conf_rounds.parse_variant(v)
    except ValueError as e:
        ap.error(str(e))
    failed = run_all(variants, a.rounds, a.out, counts, a.block_mib, a.budget_s, a.timeout_s)
    runs = []
    if os.path.exists(a.out):
        with open(a.out, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
    dev = ", ".join(sorted({x["device"] for x in runs if x.get("device")})) or "?"
    print(f"mapping cost, {a.block_mib} MiB blocks ({dev})")
    try:
        print(table(runs))
    except ValueError as e:
        print(f"mapping cost: {e}", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    from benchmarks.capacity import exit_with
    exit_with(main)
