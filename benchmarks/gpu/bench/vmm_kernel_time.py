"""Do kernels run slower on memory from vramledger's expandable segments than on cudaMalloc memory?

One process, so the between-process noise of step_ab.py / workloads_compare.py (up to 30% on
the H200) cancels: vramledger is installed (expandable segments, 6 MiB pages), buffers of the
same size come from torch (vramledger's mapped pages, "vl") and from the runtime's cudaMalloc
through ctypes ("cm", wrapped with __cuda_array_interface__), and the same kernels run on each,
alternately, timed with CUDA events. The vramledger buffers are taken once on fresh pages and
once after a churn that leaves holes, so their pages are recycled (moved) ones.

Kernels: a 2 GiB copy (bandwidth), a 4096^3 fp16 matmul (compute), and a random-row gather from
an 8 GiB table (one 4 KiB row per index: TLB-bound if the page tables differ).

Needs a CUDA GPU (about 40 GiB free) and the plugin. Usage (GPU machine; VRAMLEDGER_PLUGIN and
PYTHONPATH as run.sh sets them, or run.sh kernels):
  python vmm_kernel_time.py [--reps 20] [--rounds 5] [--json F]
Prints one line per kernel: median ms on each memory and the ratio vl / cm.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics

GIB = 1 << 30


class _Raw:
    """A cudaMalloc'd buffer that torch.as_tensor can wrap (fp16, 1-D, `n` elements)."""

    def __init__(self, cudart: ctypes.CDLL, n: int) -> None:
        self.ptr = ctypes.c_void_p()
        err = cudart.cudaMalloc(ctypes.byref(self.ptr), ctypes.c_size_t(n * 2))
        if err != 0:
            raise RuntimeError(f"cudaMalloc({n * 2} bytes) failed: error {err}")
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f2",
                                         "data": (self.ptr.value, False), "version": 3}


def _cudart() -> ctypes.CDLL:
    import torch

    root = os.path.dirname(os.path.dirname(torch.__file__))
    for path in (os.path.join(root, "nvidia", "cu13", "lib", "libcudart.so.13"),
                 "libcudart.so.13", "libcudart.so"):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("libcudart not found beside torch")


def _time_ms(fn, reps: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="launches per timing (CUDA events)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="timings per kernel and memory, the memories' order reversed each round")
    ap.add_argument("--json", help="write the medians and every round's timing here")
    args = ap.parse_args()
    import vramledger

    vramledger.install(expandable_segments=True)
    import torch

    cudart = _cudart()
    raws = []

    def raw(n: int) -> "torch.Tensor":
        r = _Raw(cudart, n)
        raws.append(r)
        return torch.as_tensor(r, device="cuda")

    def kernels(mem: dict) -> dict:
        idx = mem["idx"]
        return {
            "copy 2 GiB": lambda: mem["dst"].copy_(mem["src"]),
            "matmul 4096^3 fp16": lambda: torch.mm(mem["a"], mem["b"], out=mem["c"]),
            "gather 8 GiB table": lambda: torch.index_select(mem["table"], 0, idx, out=mem["rows"]),
        }

    def buffers(make) -> dict:
        n = 4096 * 4096
        return {"src": make(GIB), "dst": make(GIB),
                "a": make(n).view(4096, 4096), "b": make(n).view(4096, 4096),
                "c": make(n).view(4096, 4096),
                "table": make(4 * GIB).view(-1, 2048), "rows": make(1 << 18 << 11).view(-1, 2048)}

    gen = torch.Generator(device="cuda").manual_seed(0)
    cm = buffers(raw)
    vl_fresh = buffers(lambda n: torch.empty(n, dtype=torch.float16, device="cuda"))
    # Churn: 600 blocks of 3-9 MiB, every other one freed, so the next buffers take moved pages.
    keep = [torch.empty((3 + i % 7) << 19, dtype=torch.float16, device="cuda") for i in range(600)]
    del keep[::2]
    vl_moved = buffers(lambda n: torch.empty(n, dtype=torch.float16, device="cuda"))
    rows = cm["table"].shape[0]
    idx = torch.randint(0, rows, (1 << 18,), device="cuda", generator=gen)
    for mem in (cm, vl_fresh, vl_moved):
        mem["idx"] = idx
        for k in ("src", "a", "b", "table"):
            mem[k].normal_(generator=gen)
    mems = {"cm": cm, "vl": vl_fresh, "vl-moved": vl_moved}
    times: dict = {}
    for rnd in range(args.rounds):
        order = list(mems) if rnd % 2 == 0 else list(reversed(mems))
        for name in order:
            for kernel, fn in kernels(mems[name]).items():
                times.setdefault(kernel, {}).setdefault(name, []).append(_time_ms(fn, args.reps))
    stats = vramledger.fragmentation()
    result = {"kernels": {}, "page_moves": stats.get("page_moves"),
              "reserved": torch.cuda.memory_reserved()}
    for kernel, by_mem in times.items():
        med = {name: statistics.median(v) for name, v in by_mem.items()}
        result["kernels"][kernel] = {"median_ms": med, "rounds_ms": by_mem}
        print(f"{kernel}: cudaMalloc {med['cm']:.3f} ms, vramledger fresh {med['vl']:.3f} ms "
              f"({med['vl'] / med['cm']:.3f}), vramledger moved pages {med['vl-moved']:.3f} ms "
              f"({med['vl-moved'] / med['cm']:.3f})")
    for r in raws:
        cudart.cudaFree(r.ptr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
