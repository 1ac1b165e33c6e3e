"""vramledger.install(mode="pluggable") on a real GPU: tensors, frees and stats with torch's
meanings, size 0, OOM as torch.OutOfMemoryError, the memory-fraction cap, empty_cache, threads and
record_stream. The figures are those of torch's plain policy, so every snippet runs with
VRAMLEDGER_CONF=expandable_segments:False (install()'s default is expandable segments).

Every test runs in its own interpreter, because install() must precede CUDA's initialisation and
can happen once per process. Skipped where torch or CUDA is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

PRELUDE = """
import os, random, sys, threading
import vramledger
vramledger.install(mode="pluggable"{sep}{options})
import torch
MiB = 1 << 20
"""


def run_snippet(body: str, options: str = "", prelude: bool = True,
                timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs PRELUDE (install with `options`) plus `body` in a fresh interpreter; the body must
    print OK last. Fails the test with both streams otherwise."""
    code = (PRELUDE.format(sep=", " if options else "", options=options) if prelude else "")
    code += textwrap.dedent(body)
    env = dict(os.environ)
    env["VRAMLEDGER_CONF"] = "expandable_segments:False"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), (
        f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    return r


def test_tensors_free_and_stats_follow_torch():
    r = run_snippet("""
        assert vramledger.is_installed()
        assert torch.cuda.get_allocator_backend() == "pluggable", torch.cuda.get_allocator_backend()
        s = vramledger.memory_stats()
        assert list(s) == sorted(s)
        assert s["allocated_bytes.all.current"] == 0 and s["reserved_bytes.all.current"] == 0, s
        for family in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                       "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"):
            for pool in ("all", "small_pool", "large_pool"):
                for field in ("current", "peak", "allocated", "freed"):
                    assert f"{family}.{pool}.{field}" in s, f"{family}.{pool}.{field}"
        for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                    "num_device_free", "max_split_size", "oversize_allocations.current",
                    "oversize_segments.current", "utilization", "largest_free_block_bytes"):
            assert key in s, key

        x = torch.empty(1000, dtype=torch.float32, device="cuda")   # 4000 bytes
        s = vramledger.memory_stats()
        assert s["allocated_bytes.all.current"] == 4096, s["allocated_bytes.all.current"]
        assert s["requested_bytes.all.current"] == 4000, s["requested_bytes.all.current"]
        assert s["allocated_bytes.small_pool.current"] == 4096
        assert s["allocation.all.current"] == 1 and s["segment.all.current"] == 1
        assert s["reserved_bytes.all.current"] == 2 * MiB, s["reserved_bytes.all.current"]
        assert vramledger.memory_allocated() == 4096 and vramledger.memory_reserved() == 2 * MiB

        y = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        assert vramledger.memory_allocated() == 4096 + 30 * MiB
        assert vramledger.memory_stats()["allocated_bytes.large_pool.current"] == 30 * MiB
        assert vramledger.memory_reserved() == 32 * MiB, vramledger.memory_reserved()

        x.fill_(2.0)
        y.fill_(1)
        assert float(x.sum()) == 2000.0 and int(y.sum()) == 30 * MiB  # may use temporaries
        del x, y
        assert vramledger.memory_allocated() == 0
        assert vramledger.max_memory_allocated() >= 4096 + 30 * MiB
        reserved = vramledger.memory_reserved()
        assert reserved >= 32 * MiB, reserved                  # cached, as torch
        assert vramledger.max_memory_reserved() >= reserved
        for dev in (None, 0, "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)):
            assert vramledger.memory_reserved(dev) == reserved, dev
        s = vramledger.memory_stats()
        assert s["largest_free_block_bytes"] >= 30 * MiB, s["largest_free_block_bytes"]
        assert 0.0 < s["utilization"] <= 1.0, s["utilization"]

        # Autograd frees from its worker thread.
        w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        (w * w).sum().backward()
        assert torch.allclose(w.grad, 2 * w)
        del w
        assert vramledger.memory_allocated() == 0, vramledger.memory_allocated()

        vramledger.reset_peak_memory_stats()
        assert vramledger.max_memory_allocated() == 0
        assert vramledger.max_memory_reserved() == vramledger.memory_reserved()
        vramledger.reset_accumulated_memory_stats()
        s = vramledger.memory_stats()
        assert s["allocation.all.allocated"] == 0 and s["allocated_bytes.all.freed"] == 0, s
        assert s["num_device_alloc"] == 0
        print("OK")
    """)
    assert "vramledger: free of" not in r.stderr, r.stderr


def test_size_zero_tensors():
    r = run_snippet("""
        x = torch.empty(0, device="cuda")
        assert x.data_ptr() == 0
        y = torch.empty((0, 16), dtype=torch.float16, device="cuda")
        z = torch.ones(3, device="cuda")
        e = torch.cat([z[:0], z[:0]])
        assert e.numel() == 0
        s = vramledger.memory_stats()
        assert s["allocation.all.current"] == 1, s["allocation.all.current"]   # z only
        del x, y, e
        assert vramledger.memory_stats()["allocation.all.current"] == 1
        print("OK")
    """)
    assert "vramledger:" not in r.stderr, r.stderr


def test_out_of_memory_is_torch_out_of_memory_error_and_process_stays_usable():
    r = run_snippet("""
        free, total = torch.cuda.mem_get_info()
        x = torch.ones(1 << 20, device="cuda")
        try:
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            raise SystemExit("no out-of-memory error")
        except torch.OutOfMemoryError as e:
            msg = str(e)
        assert msg.startswith("CUDA out of memory. Tried to allocate "), msg
        assert "GPU 0 has a total capacity of " in msg and " is free." in msg, msg
        assert vramledger.memory_stats()["num_ooms"] == 1
        assert float((x * 2).sum()) == 2.0 * (1 << 20)        # CUDA context still fine
        big = torch.empty(total // 4, dtype=torch.uint8, device="cuda")
        big.fill_(1)
        torch.cuda.synchronize()
        print(msg.splitlines()[0][:300])
        print("OK")
    """)
    print(r.stdout)


def test_memory_fraction_caps_reserved():
    run_snippet("""
        free, total = torch.cuda.mem_get_info()
        torch.cuda.set_per_process_memory_fraction(0.25)
        a = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
        try:
            torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
            raise SystemExit("the 0.25 cap was not enforced")
        except torch.OutOfMemoryError as e:
            assert "allowed" in str(e), str(e)
        assert vramledger.memory_reserved() <= 0.25 * total
        del a
        b = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
        assert vramledger.memory_reserved() <= 0.25 * total
        print("OK")
    """)


def test_empty_cache_returns_reserved_memory():
    run_snippet("""
        keep = torch.ones(1000, device="cuda")              # its 2 MiB small segment stays
        ts = [torch.empty(n, dtype=torch.uint8, device="cuda")
              for n in (100, 5 * MiB, 50 * MiB, 300 * MiB, 1000)]
        del ts
        assert vramledger.memory_reserved() >= 350 * MiB, vramledger.memory_reserved()
        free_before = torch.cuda.mem_get_info()[0]
        vramledger.empty_cache()
        assert vramledger.memory_reserved() == 2 * MiB, vramledger.memory_reserved()
        assert torch.cuda.mem_get_info()[0] >= free_before + 300 * MiB
        ts = [torch.empty(64 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
        del ts
        torch.cuda.empty_cache()                               # the reset hook
        assert vramledger.memory_reserved() == 2 * MiB, vramledger.memory_reserved()
        del keep
        vramledger.empty_cache()
        assert vramledger.memory_reserved() == 0, vramledger.memory_reserved()
        print("OK")
    """)


def test_eight_threads_allocate_concurrently():
    run_snippet("""
        errors, live, lock = [], {}, threading.Lock()
        barrier = threading.Barrier(8)
        def work(tid):
            try:
                rng = random.Random(tid)
                mine = []
                for _ in range(300):
                    n = rng.randint(1, 4 * MiB)
                    mine.append(torch.full((n,), tid + 1, dtype=torch.uint8, device="cuda"))
                    if len(mine) > 8:
                        mine.pop(rng.randrange(len(mine)))
                barrier.wait()
                with lock:
                    for t in mine:
                        live[t.data_ptr()] = t.numel()
                for t in mine:
                    assert int(t.sum()) == t.numel() * (tid + 1), "data of another thread"
            except BaseException as e:
                errors.append(f"thread {tid}: {e!r}")
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        spans = sorted((p, p + n) for p, n in live.items())
        assert len(spans) == 64
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"live blocks overlap: {a0:#x}+{a1 - a0} and {b0:#x}"
        torch.cuda.synchronize()
        s = vramledger.memory_stats()
        assert s["allocated_bytes.all.current"] == 0, s["allocated_bytes.all.current"]
        assert s["allocation.all.allocated"] == s["allocation.all.freed"]
        assert s["allocation.all.allocated"] >= 8 * 300
        print("OK")
    """)


def test_record_stream_defers_reuse_on_a_side_stream():
    run_snippet("""
        side = torch.cuda.Stream()
        x = torch.ones(16 * MiB, device="cuda")               # 64 MiB on the default stream
        torch.cuda.synchronize()
        ptr = x.data_ptr()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(8e9))                        # ~4 s of busy side stream
            x.mul_(2)
        x.record_stream(side)
        del x                                                  # torch frees at once
        s = vramledger.memory_stats()
        pending = s["active_bytes.all.current"] - s["allocated_bytes.all.current"]
        assert pending == 64 * MiB, pending
        busy = not side.query()  # measured on the H200: the first stats call can take ~2 s
        y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        if busy:
            assert y.data_ptr() != ptr, "reused while the side stream may still use it"
        side.synchronize()
        z = torch.empty(128, device="cuda")                    # events are processed here
        s = vramledger.memory_stats()
        assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"], s
        w = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        if busy:  # otherwise y already took the completed block
            assert w.data_ptr() == ptr, "the completed block should be reused"
        print("OK")
    """)


def test_install_rules_and_max_split_size():
    run_snippet("""
        vramledger.install(max_split_size_mb=200)              # same options: no-op
        try:
            vramledger.install(max_split_size_mb=300)
            raise SystemExit("a second install with other options was accepted")
        except RuntimeError as e:
            assert "already installed" in str(e), str(e)
        # torch's max_split_size rule: the cached 300 MiB block is not split for 250 MiB.
        a = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        del a
        b = torch.empty(250 * MiB, dtype=torch.uint8, device="cuda")
        c = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        assert vramledger.memory_reserved() == 550 * MiB, vramledger.memory_reserved()
        assert vramledger.memory_stats()["max_split_size"] == 200 * MiB
        print("OK")
    """, options="max_split_size_mb=200")


def test_install_after_cuda_initialisation_says_what_to_do():
    run_snippet("""
        import torch, vramledger
        torch.ones(1, device="cuda")
        try:
            vramledger.install()
            raise SystemExit("install() after CUDA init was accepted")
        except RuntimeError as e:
            assert "already initialised" in str(e) and "before the first CUDA tensor" in str(e), e
        assert not vramledger.is_installed()
        print("OK")
    """, prelude=False)
