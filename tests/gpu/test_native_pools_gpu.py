"""torch.cuda.MemPool and allocator trace trackers with vramledger as torch's allocator
(install(mode="native")) on a real GPU: MemPool + use_mem_pool, MemPool.snapshot(), use_on_oom,
a MemPool whose segments come from a CUDAPluggableAllocator, and ProcessGroupNCCL's register hook
(TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, world size 1), which follows vramledger's
segments through its trace tracker.

Every test runs in its own interpreter (install() must precede CUDA's initialisation). Skipped
where torch, CUDA, the native library, a C compiler (the pluggable allocator's library) or NCCL
is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

PRELUDE = """
import ctypes, os, subprocess, sys
import vramledger
vramledger.install(mode="native", {options})
import torch
MiB = 1 << 20
assert torch.cuda.get_allocator_backend() == "vramledger", torch.cuda.get_allocator_backend()
"""


def run_snippet(body: str, options: str = "", env_extra: dict | None = None,
                timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs PRELUDE plus `body` in a fresh interpreter; the body must print OK last."""
    code = PRELUDE.format(options=options) + textwrap.dedent(body)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0 and "torch-native library" in r.stderr and "not found" in r.stderr:
        pytest.skip("libvramledger_native.so is not built for this torch")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), (
        f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    return r


def test_mempool_and_use_mem_pool():
    run_snippet("""
        import threading
        pool = torch.cuda.MemPool()
        assert pool.use_count() == 1, pool.use_count()
        outside = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        with torch.cuda.use_mem_pool(pool):
            assert pool.use_count() == 2, pool.use_count()
            inside = torch.full((MiB,), 3.0, device="cuda")
            # use_mem_pool routes only its own thread's allocations.
            other = []
            t = threading.Thread(target=lambda: other.append(
                torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")))
            t.start(); t.join()
        assert pool.use_count() == 1, pool.use_count()
        def owner(ptr, segments):
            for s in segments:
                if s["address"] <= ptr < s["address"] + s["total_size"]:
                    return tuple(s["segment_pool_id"])
            return None
        mine = pool.snapshot()
        assert mine and all(tuple(s["segment_pool_id"]) == pool.id for s in mine), mine
        assert owner(inside.data_ptr(), mine) == pool.id
        every = torch.cuda.memory._snapshot()["segments"]
        assert owner(outside.data_ptr(), every) == (0, 0)
        assert owner(other[0].data_ptr(), every) == (0, 0)
        assert float(inside.sum()) == 3.0 * MiB
        reserved = torch.cuda.memory_reserved()
        del inside
        del pool  # releasePool + emptyCache(pool.id): its segments go back
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() < reserved, (torch.cuda.memory_reserved(), reserved)
        print("OK")
    """)


def test_one_pool_allocated_to_twice_at_once():
    # As under torch's own allocator: use_mem_pool nested and on two threads at once, and a
    # graph captured into the pool inside use_mem_pool of it.
    run_snippet("""
        import threading
        pool = torch.cuda.MemPool()
        def owner(t):
            for s in pool.snapshot():
                if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]:
                    return True
            return False
        kept = []
        with torch.cuda.use_mem_pool(pool):
            with torch.cuda.use_mem_pool(pool):
                kept.append(torch.ones(MiB, device="cuda"))
            kept.append(torch.ones(MiB, device="cuda"))  # the outer entry still routes
            started, done = threading.Event(), threading.Event()
            def other():
                with torch.cuda.use_mem_pool(pool):
                    kept.append(torch.ones(MiB, device="cuda"))
                    started.set(); done.wait()
                kept.append(torch.ones(MiB, device="cuda"))  # outside: the default pool
            t = threading.Thread(target=other); t.start(); started.wait()
            kept.append(torch.ones(MiB, device="cuda"))  # both threads' entries open
            done.set(); t.join()
            kept.append(torch.ones(MiB, device="cuda"))  # the other thread's end left ours
            g = torch.cuda.CUDAGraph()
            static_in = torch.ones(MiB, device="cuda")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, pool=pool.id, stream=s):
                    static_out = static_in * 2
            torch.cuda.current_stream().wait_stream(s)
        assert pool.use_count() >= 1, pool.use_count()
        inside = [owner(t) for t in kept]
        # nested, outer, the other thread's inside, both open, the other's after its end, ours
        assert inside == [True, True, True, True, False, True], inside
        assert owner(static_out), "the graph's output is not in the pool"
        static_in.fill_(3.0); g.replay(); torch.cuda.synchronize()
        assert float(static_out[0]) == 6.0
        print("OK")
    """)

def test_mempool_use_on_oom_serves_the_default_pool():
    run_snippet("""
        free, total = torch.cuda.mem_get_info()
        pool = torch.cuda.MemPool(use_on_oom=True)
        block = 1 << 30
        with torch.cuda.use_mem_pool(pool):
            cached = torch.empty(block, dtype=torch.uint8, device="cuda")
        cached_ptr = cached.data_ptr()
        del cached  # free, cached in the pool
        held = []
        try:  # fill the device in the default pools
            while True:
                held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            pass
        # The pool's free block was the default pool's last resort, in torch's order.
        assert any(t.data_ptr() == cached_ptr for t in held), "use_on_oom pool was not used"
        del held
        torch.cuda.empty_cache()
        print("OK")
    """, options="max_dumps=0", timeout=600)


def test_mempool_with_a_pluggable_allocator_takes_its_segments_from_it(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the pluggable allocator's library")
    source = tmp_path / "pool_alloc.c"
    source.write_text(textwrap.dedent("""
        #include <stddef.h>
        extern int cudaMalloc(void** p, size_t n);
        extern int cudaFree(void* p);
        static long allocs, frees;
        void* pool_alloc(size_t n, int device, void* stream) {
          void* p = 0;
          (void)device; (void)stream;
          if (cudaMalloc(&p, n) != 0) return 0;
          ++allocs;
          return p;
        }
        void pool_free(void* p, size_t n, int device, void* stream) {
          (void)n; (void)device; (void)stream;
          cudaFree(p);
          ++frees;
        }
        long pool_allocs(void) { return allocs; }
        long pool_frees(void) { return frees; }
    """))
    run_snippet(f"""
        torch.empty(1, device="cuda")  # CUDA up: its runtime library is loaded
        cudart = next(line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line)
        lib = {str(tmp_path / "libpool_alloc.so")!r}
        subprocess.run([{cc!r}, "-shared", "-fPIC", "-o", lib, {str(source)!r}, cudart,
                        "-Wl,-rpath," + os.path.dirname(cudart)], check=True)
        counts = ctypes.CDLL(lib)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "pool_alloc", "pool_free")
        pool = torch.cuda.MemPool(alloc.allocator())
        with torch.cuda.use_mem_pool(pool):
            t = torch.arange(MiB, dtype=torch.float32, device="cuda")
        assert counts.pool_allocs() == 1, counts.pool_allocs()
        mine = pool.snapshot()
        assert len(mine) == 1 and mine[0]["address"] <= t.data_ptr(), mine
        assert float(t[-1]) == MiB - 1
        del t
        del pool
        torch.cuda.synchronize()
        assert counts.pool_frees() == 1, counts.pool_frees()
        print("OK")
    """)


@pytest.mark.parametrize("options", ["expandable_segments=False", "expandable_segments=True"])
def test_nccl_register_hook_follows_vramledgers_segments(tmp_path, options):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch has no NCCL")
    run_snippet(f"""
        import torch.distributed as dist
        torch.cuda.set_device(0)
        before = torch.ones(8 * MiB, device="cuda")  # a segment the hook finds in the snapshot
        dist.init_process_group("nccl", init_method="file://{tmp_path / 'store'}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        dist.all_reduce(before)
        torch.cuda.synchronize()
        assert float(before[0]) == 1.0
        for round in range(3):
            # New segments (registered as they are made), freed again (deregistered).
            xs = [torch.full((n * MiB,), float(round + 1), device="cuda") for n in (1, 5, 40)]
            for x in xs:
                dist.all_reduce(x)
            torch.cuda.synchronize()
            assert all(float(x.sum()) == (round + 1) * x.numel() for x in xs)
            del xs
            torch.cuda.empty_cache()
        dist.destroy_process_group()
        print("OK")
    """, options=options, env_extra={"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"})
