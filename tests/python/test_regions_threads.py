"""Pausable regions from several Python threads at once: one `vramledger.region` object (as a
decorator shares it) entered on many threads keeps each thread's entries and restores each
thread's own autograd threading flag. Runs on the plugin's simulated device in a fresh
interpreter (test_regions.run); skips where the plugin library or torch is missing.
"""

from __future__ import annotations

from test_regions import MiB, needs_plugin, run


@needs_plugin
def test_one_region_object_entered_on_many_threads_keeps_each_threads_entries():
    (out,) = run("""
        scope = vramledger.region("r")  # one object, as a decorator shares it
        barrier = threading.Barrier(4)
        errors, modes, ptrs = [], [], []
        lock = threading.Lock()

        def worker(i):
            try:
                # torch's flag is per thread: half the threads start with it off, so a thread
                # that restored another's saved flag would show.
                torch._C._set_multithreading_enabled(i % 2 == 0)
                for _ in range(20):
                    before = torch._C._is_multithreading_enabled()
                    with scope:
                        barrier.wait()  # every thread inside at once
                        p = alloc(2 * MiB)
                        inside = torch._C._is_multithreading_enabled()
                        barrier.wait()
                    after = torch._C._is_multithreading_enabled()
                    with lock:
                        modes.append([i % 2 == 0, before, inside, after])
                        ptrs.append(p)
            except Exception as e:
                errors.append(repr(e))
                barrier.abort()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        (r,) = vramledger.regions()
        outside = alloc(2 * MiB)  # this thread was never inside
        (r2,) = vramledger.regions()
        print(json.dumps({"errors": errors, "modes": modes, "allocated": r["allocated_bytes"],
                          "after": r2["allocated_bytes"], "n": len(ptrs)}))
    """)
    assert out["errors"] == []
    assert out["n"] == 80
    # Each thread restored its own flag.
    assert all(m[1:] == [m[0], False, m[0]] for m in out["modes"]), out["modes"]
    assert out["allocated"] == 80 * 2 * MiB  # every thread's allocations went to the region
    assert out["after"] == out["allocated"]
