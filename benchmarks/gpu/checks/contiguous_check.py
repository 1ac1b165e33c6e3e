"""GPU check of the per-allocation opt-out from expandable segments: vramledger.contiguous_segments() and
vramledger.fragmentation() on a real device.

Installs vramledger with expandable_segments:True, allocates tensors outside the scope (they land
in the expandable segment, one physical handle per page) and a 1 GiB buffer inside
`with vramledger.contiguous_segments():` (a plain segment). For each segment it prints what the
snapshot says (is_expandable, handles) beside what the driver says: cuMemGetAddressRange probed at
every 2 MiB of the segment (through libcuda with ctypes) gives the driver allocation each address
belongs to, so a contiguous segment must show one range whose base and size are the segment's, and
an expandable one as many distinct ranges as it has handles. cuMemRetainAllocationHandle is tried
on the first byte too (it answers only for VMM-mapped memory). Then prints
vramledger.fragmentation() (figures and the driver calls made, measured).

Usage on the GPU machine (plugin built here with `benchmarks/gpu/run.sh prepare`, carry
.devbuild/lib):
  VRAMLEDGER_PLUGIN=.devbuild/lib/libvramledger_plugin.so PYTHONPATH=torch_plugin/python \
      /opt/torch/.venv/bin/python3 benchmarks/gpu/checks/contiguous_check.py
Exit status: 0 when every check passed, 1 when one failed, 2 when CUDA or the plugin is missing.
"""

from __future__ import annotations

import ctypes
import json
import sys

MiB = 1 << 20
PROBE_STEP = 2 * MiB  # the H200's allocation granularity: no driver allocation is smaller


def load_libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, c_size_t = ctypes.c_ulonglong, ctypes.c_size_t
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(c_size_t), u64]
    lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
    lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p]
    lib.cuMemRetainAllocationHandle.restype = ctypes.c_int
    lib.cuMemRelease.argtypes = [u64]
    lib.cuMemRelease.restype = ctypes.c_int
    return lib


def address_range(cuda: ctypes.CDLL, ptr: int) -> tuple[int, int]:
    """(base, size) of the driver allocation holding `ptr`, or (-error, 0)."""
    base, size = ctypes.c_ulonglong(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    return (base.value, size.value) if rc == 0 else (-rc, 0)


def retain_handle(cuda: ctypes.CDLL, ptr: int) -> str:
    """What cuMemRetainAllocationHandle says about `ptr` (the handle is released again)."""
    handle = ctypes.c_ulonglong()
    rc = cuda.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr))
    if rc != 0:
        return f"CUresult {rc}"
    cuda.cuMemRelease(handle.value)
    return f"handle {handle.value:#x}"


def probe(cuda: ctypes.CDLL, seg: dict) -> dict:
    """Driver view of one snapshot segment: the distinct allocation ranges met every 2 MiB."""
    start, size = seg["address"], seg["total_size"]
    ranges = {}
    for offset in list(range(0, size, PROBE_STEP)) + [size - 1]:
        base, length = address_range(cuda, start + offset)
        ranges[base] = length
    covering = len(ranges) == 1 and ranges.get(start) == size
    return {"ranges": len(ranges), "covers_segment": covering,
            "first_range": next(iter(ranges.items())), "retain": retain_handle(cuda, start)}


def main() -> int:
    try:
        import vramledger
        vramledger.install(expandable_segments=True)
        import torch
    except RuntimeError as e:
        print(f"contiguous_check: cannot install vramledger: {e}")
        return 2
    cuda = load_libcuda()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"allocator backend {torch.cuda.get_allocator_backend()}")

    outside = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (256, 30, 7)]
    with vramledger.contiguous_segments():
        contiguous = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
    after = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    segments = vramledger.snapshot()["segments"]

    def segment_of(t: "torch.Tensor") -> dict:
        p = t.data_ptr()
        return next(s for s in segments if s["address"] <= p < s["address"] + s["total_size"])

    rows = [("outside (256 MiB)", outside[0]), ("contiguous (1 GiB)", contiguous),
            ("after scope (64 MiB)", after)]
    checks = []
    header = (f"{'allocation':<22} {'segment':>16} {'MiB':>7} {'kind':<11} {'handles':>7} "
              f"{'driver ranges':>13} {'one range = segment':>19}  cuMemRetainAllocationHandle")
    print(header)
    print("-" * len(header))
    for name, t in rows:
        seg = segment_of(t)
        d = probe(cuda, seg)
        kind = "expandable" if seg["is_expandable"] else "contiguous"
        print(f"{name:<22} {seg['address']:>#16x} {seg['total_size'] / MiB:>7.0f} {kind:<11} "
              f"{seg['handles']:>7} {d['ranges']:>13} {str(d['covers_segment']):>19}  "
              f"{d['retain']}")
        if t is contiguous:
            checks.append(("contiguous buffer: plain segment", not seg["is_expandable"]))
            checks.append(("contiguous buffer: snapshot says 1 handle", seg["handles"] == 1))
            checks.append(("contiguous buffer: one driver allocation covers the segment",
                           d["covers_segment"]))
        else:
            checks.append((f"{name}: expandable segment", seg["is_expandable"]))
            checks.append((f"{name}: driver ranges == snapshot handles ({d['ranges']} vs "
                           f"{seg['handles']})", d["ranges"] == seg["handles"]))

    f = vramledger.fragmentation()
    print()
    print("vramledger.fragmentation():")
    for key in ("utilization", "wasted_bytes", "wasted_bytes_at_peak", "free_bytes",
                "largest_free_block", "free_space_fragmentation", "holes", "mapped_free_pages",
                "other_stream_cached_bytes", "page_moves", "current_stream"):
        value = f[key]
        shown = f"{value:.4f}" if isinstance(value, float) else f"{value}"
        if key.endswith(("_bytes", "_block")):
            shown += f" ({value / MiB:.1f} MiB)"
        print(f"  {key:<26} {shown}")
    print(f"  driver calls ({f['driver_time']}): {f['driver_calls_total']} calls, "
          f"{f['driver_time_us_total']:.0f} us")
    for call, c in f["driver_calls"].items():
        if c["count"]:
            print(f"    {call:<26} {c['count']:>6} calls {c['time_us']:>10.1f} us")
    checks.append(("fragmentation: driver time is measured", f["driver_time"] == "measured"))
    checks.append(("fragmentation: one cudaMalloc (the contiguous segment)",
                   f["driver_calls"]["cudaMalloc"]["count"] == 1))
    stats = vramledger.memory_stats()
    checks.append(("memory_stats carries fragmentation.holes",
                   stats.get("fragmentation.holes") == f["holes"]))

    print()
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    print("RESULT_JSON " + json.dumps({"checks": {n: ok for n, ok in checks},
                                       "fragmentation": f}))
    del outside, contiguous, after
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
