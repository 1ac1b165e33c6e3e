"""Expandable-segment figures from Python: vramledger.contiguous_segments() and vramledger.fragmentation() on the
plugin's simulated device (vramledger_testing_use_sim_backend; no GPU).

Each case runs in a fresh interpreter: the simulated device table and the options can be set once
per process. install() needs CUDA, so the scripts mark the package installed by hand
(vramledger._installed) after pointing the plugin at the simulator, which is what install() would
have guarded. Skips where the plugin library or torch is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vramledger import _plugin

MiB = 1 << 20

PRELUDE = r"""
import ctypes, json, sys, threading
import vramledger
from vramledger import _fragmentation, _plugin
lib = _plugin.load()
assert lib.vramledger_testing_use_sim_backend(1, 1 << 30) == 0
_plugin.configure("expandable_segments:True,expandable_page_mb:2,page_recycling:False,"
                  "host_timing:True")
vramledger._installed = ("test", "")  # install() needs CUDA; the simulator stands in for it
lib.vramledger_testing_malloc.restype = ctypes.c_void_p
lib.vramledger_testing_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
MiB = 1 << 20

def alloc(size):
    p = lib.vramledger_testing_malloc(size, 0, None)
    assert p, size
    return p

def free(p, size):
    lib.vramledger_free(p, size, 0, None)

def segment_of(p):
    for s in vramledger.snapshot()["segments"]:
        if s["address"] <= p < s["address"] + s["total_size"]:
            return {"expandable": s["is_expandable"], "handles": s["handles"]}
    raise AssertionError(hex(p))
"""


def plugin_available() -> bool:
    try:
        _plugin.plugin_path()
        import torch  # noqa: F401
    except (RuntimeError, ImportError):
        return False
    return True


needs_plugin = pytest.mark.skipif(not plugin_available(),
                                  reason="the torch plugin library or torch is not available")


def run(*bodies: str, with_prelude: bool = True) -> list:
    """Runs PRELUDE + `bodies` in a fresh interpreter; returns the JSON of each printed line."""
    code = (PRELUDE if with_prelude else "") + "".join(textwrap.dedent(b) for b in bodies)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


@needs_plugin
def test_inside_the_scope_one_plain_handle_outside_expandable():
    (out,) = run("""
        before = alloc(30 * MiB)
        with vramledger.contiguous_segments():
            inside = alloc(30 * MiB)
            depth_inside = _fragmentation.contiguous_depth()
        after = alloc(30 * MiB)
        print(json.dumps({"before": segment_of(before), "inside": segment_of(inside),
                          "after": segment_of(after), "depth_inside": depth_inside,
                          "depth_after": _fragmentation.contiguous_depth()}))
    """)
    assert out["inside"] == {"expandable": False, "handles": 1}
    assert out["before"]["expandable"] and out["after"]["expandable"]
    assert out["before"]["handles"] == 30  # 60 MiB mapped: before and after share the range
    assert (out["depth_inside"], out["depth_after"]) == (1, 0)


@needs_plugin
def test_scopes_nest_and_an_exception_restores_the_state():
    (out,) = run("""
        depths = []
        with vramledger.contiguous_segments():
            with vramledger.contiguous_segments():
                depths.append(_fragmentation.contiguous_depth())
            depths.append(_fragmentation.contiguous_depth())
            nested_tail = alloc(12 * MiB)  # still inside the outer scope
        try:
            with vramledger.contiguous_segments():
                depths.append(_fragmentation.contiguous_depth())
                raise KeyError("boom")
        except KeyError:
            pass
        depths.append(_fragmentation.contiguous_depth())
        outside = alloc(12 * MiB)
        print(json.dumps({"depths": depths, "nested_tail": segment_of(nested_tail),
                          "outside": segment_of(outside)}))
    """)
    assert out["depths"] == [2, 1, 1, 0]
    assert out["nested_tail"] == {"expandable": False, "handles": 1}
    assert out["outside"]["expandable"] is True


@needs_plugin
def test_threads_have_their_own_scope():
    (out,) = run("""
        entered, done = threading.Event(), threading.Event()
        result = {}
        def other():
            entered.wait()
            result["other_depth"] = _fragmentation.contiguous_depth()
            result["other"] = segment_of(alloc(14 * MiB))
            with vramledger.contiguous_segments():
                result["other_inside"] = segment_of(alloc(14 * MiB))
            done.set()
        t = threading.Thread(target=other)
        t.start()
        with vramledger.contiguous_segments():
            entered.set()
            done.wait()
            result["main_depth_after_other"] = _fragmentation.contiguous_depth()
            result["main"] = segment_of(alloc(14 * MiB))
        t.join()
        print(json.dumps(result))
    """)
    assert out["other_depth"] == 0
    assert out["other"]["expandable"] is True          # the main thread's scope is not its own
    assert out["other_inside"] == {"expandable": False, "handles": 1}
    assert out["main_depth_after_other"] == 1          # the other thread's exit left ours alone
    assert out["main"] == {"expandable": False, "handles": 1}


@needs_plugin
def test_exit_without_enter_is_an_error_and_changes_nothing():
    (out,) = run("""
        _fragmentation._lib()
        rc = lib.vramledger_contiguous_segments_exit()
        message = lib.vramledger_last_error().decode()
        try:
            _plugin._check(lib.vramledger_contiguous_segments_exit())
            raised = None
        except RuntimeError as e:
            raised = str(e)
        print(json.dumps({"rc": rc, "message": message, "raised": raised,
                          "depth": _fragmentation.contiguous_depth()}))
    """)
    assert out["rc"] == 2  # VRAMLEDGER_FAILED
    assert "exit without a matching enter" in out["message"]
    assert "exit without a matching enter" in out["raised"]
    assert out["depth"] == 0


def test_leaving_the_scope_on_another_thread_is_a_clear_error():
    (out,) = run("""
        cm = vramledger.contiguous_segments()
        cm.__enter__()
        errors = []
        def leave():
            try:
                cm.__exit__(None, None, None)
            except RuntimeError as e:
                errors.append(str(e))
        t = threading.Thread(target=leave)
        t.start()
        t.join()
        print(json.dumps({"errors": errors, "depth_here": _fragmentation.contiguous_depth()}))
    """)
    assert len(out["errors"]) == 1
    assert "left on another thread" in out["errors"][0]
    assert out["depth_here"] == 1  # the entering thread's scope stays open, as the error says


def test_not_installed_raises_a_clear_error():
    (out,) = run("""
        import json, vramledger
        result = {}
        for name, fn in (("contiguous", lambda: vramledger.contiguous_segments().__enter__()),
                         ("fragmentation", lambda: vramledger.fragmentation())):
            try:
                fn()
            except RuntimeError as e:
                result[name] = str(e)
        print(json.dumps(result))
    """, with_prelude=False)
    assert "vramledger is not installed" in out["contiguous"]
    assert "vramledger.install()" in out["contiguous"]
    assert "vramledger is not installed" in out["fragmentation"]


def test_a_bad_stream_is_a_value_error_naming_it():
    (out,) = run("""
        import json, vramledger
        result = {}
        for bad in (-1, 2**64, 1.5, True, "s"):
            try:
                vramledger.fragmentation(stream=bad)
                result[repr(bad)] = "no error"
            except ValueError as e:
                result[repr(bad)] = str(e)
        print(json.dumps(result))
    """, with_prelude=False)
    for bad in ("-1", str(2**64), "1.5", "True", "'s'"):
        assert "fragmentation(stream=...)" in out[bad] and bad in out[bad], out[bad]


# A hand-computed layout on one expandable range with 2 MiB pages and no page recycling:
#   a 4 MiB [0, 4)  b 6 MiB [4, 10)  c 4 MiB [10, 14); free b (a 6 MiB hole, pages 2-4);
#   d 8 MiB does not fit the hole -> [14, 22) (4 new pages); free d (the free tail).
# Peak allocated 16 MiB (a + c + d), peak reserved 22 MiB (11 pages); now allocated 8 MiB.
SCENARIO = """
    a = alloc(4 * MiB); b = alloc(6 * MiB); c = alloc(4 * MiB)
    free(b, 6 * MiB)
    d = alloc(8 * MiB)
    free(d, 8 * MiB)
"""


@needs_plugin
def test_fragmentation_figures_of_a_hand_computed_layout():
    main, other, stats = run(SCENARIO, """
        print(json.dumps(vramledger.fragmentation(0)))
        print(json.dumps(vramledger.fragmentation("cuda:0", stream=0x77)))
        print(json.dumps(dict(vramledger.memory_stats(0))))
    """)
    assert main["device"] == 0 and main["current_stream"] == 0
    assert main["utilization"] == pytest.approx(16 / 22)
    assert main["wasted_bytes"] == 14 * MiB           # 22 reserved - 8 allocated
    assert main["wasted_bytes_at_peak"] == 6 * MiB    # 22 - 16
    assert main["free_bytes"] == 14 * MiB
    assert main["largest_free_block"] == 8 * MiB      # the mapped free tail, not the 6 MiB hole
    assert main["free_space_fragmentation"] == pytest.approx(1 - 8 / 14)
    assert main["holes"] == 1                          # b's hole; the tail is not a hole
    assert main["mapped_free_pages"] == 7              # 3 in the hole + 4 in the tail
    assert main["other_stream_cached_bytes"] == 0      # everything is cached for stream 0
    assert other["other_stream_cached_bytes"] == 14 * MiB  # seen from another stream
    assert other["current_stream"] == 0x77
    assert main["page_moves"] == 0
    calls = main["driver_calls"]
    assert main["driver_time"] == "modelled"
    assert calls["cuMemAddressReserve"]["count"] == 1
    assert calls["cuMemCreate"]["count"] == 11 and calls["cuMemMap"]["count"] == 11
    assert calls["cuMemSetAccess"]["count"] == 4       # one per growth (a, b, c, d)
    assert calls["cudaMalloc"]["count"] == 0 and calls["cuMemUnmap"]["count"] == 0
    assert calls["cuMemMap"]["time_us"] > 0
    assert main["driver_calls_total"] == sum(c["count"] for c in calls.values())
    assert main["driver_time_us_total"] == pytest.approx(sum(c["time_us"] for c in calls.values()))
    # Host time inside Malloc and Free: a, b, c, d allocated; b and d freed.
    assert main["host_time"]["malloc"]["count"] == 4
    assert main["host_time"]["free"]["count"] == 2
    assert main["host_time"]["malloc"]["time_us"] > 0 and main["host_time"]["free"]["time_us"] > 0
    # memory_stats carries the same figures under "fragmentation." and keeps torch's keys.
    assert stats["fragmentation.holes"] == 1
    assert stats["fragmentation.largest_free_block"] == 8 * MiB
    assert stats["fragmentation.free_space_fragmentation"] == pytest.approx(1 - 8 / 14)
    assert stats["fragmentation.wasted_bytes_at_peak"] == 6 * MiB
    assert stats["fragmentation.other_stream_cached_bytes"] == 0
    assert stats["allocated_bytes.all.current"] == 8 * MiB
    assert stats["reserved_bytes.all.current"] == 22 * MiB
    torch_keys = set(run("""
        print(json.dumps(sorted(_plugin.memory_stats(0))))
    """)[0])
    assert torch_keys <= set(stats)
    assert set(stats) - torch_keys == {k for k in stats
                                       if k.startswith(("fragmentation.", "tags.", "guard."))}


@needs_plugin
def test_fragmentation_of_a_device_that_has_not_allocated_is_zeros():
    (out,) = run("""
        print(json.dumps(vramledger.fragmentation(0)))
    """)
    assert out["holes"] == 0 and out["wasted_bytes"] == 0 and out["driver_calls_total"] == 0
    assert out["host_time"] == {"malloc": {"count": 0, "time_us": 0},
                                "free": {"count": 0, "time_us": 0}}
    assert set(out["driver_calls"]) >= {"cudaMalloc", "cuMemMap", "cuMemCreate", "cuMemUnmap"}


@needs_plugin
def test_benchmarks_read_the_host_time_the_plugin_reports():
    """benchmarks/gpu/checks/train_compare.allocator_host_us, which the step-time scripts
    difference per step, reads fragmentation()["host_time"]: here against the simulated device."""
    gpu_scripts = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu", "checks")
    (before, after, host) = run(f"""
        sys.path.insert(0, {os.path.abspath(gpu_scripts)!r})
        from train_compare import allocator_host_us
        print(json.dumps(allocator_host_us("vramledger")))
        free(alloc(4 * MiB), 4 * MiB)
        print(json.dumps(allocator_host_us("vramledger")))
        print(json.dumps(vramledger.fragmentation(0)["host_time"]))
    """)
    assert before == 0
    assert after == pytest.approx(host["malloc"]["time_us"] + host["free"]["time_us"])
    assert after > 0 and host["malloc"]["count"] == 1 and host["free"]["count"] == 1


@needs_plugin
def test_the_capacity_trial_reads_the_driver_time_and_waits_the_plugin_reports():
    """benchmarks/capacity/trial.vramledger_totals, which each trial differences per step, reads
    fragmentation()'s driver calls: here against the simulated device, whose empty_cache waits on
    the stream before it unmaps (a cudaStreamSynchronize)."""
    (before, after, frag) = run(f"""
        sys.path.insert(0, {os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))!r})
        from benchmarks.capacity.trial import vramledger_totals
        print(json.dumps(vramledger_totals(vramledger.fragmentation(0))))
        free(alloc(8 * MiB), 8 * MiB)
        _plugin.empty_cache(0)
        print(json.dumps(vramledger_totals(vramledger.fragmentation(0))))
        print(json.dumps(vramledger.fragmentation(0)))
    """)
    assert before == {"step_driver_ms": 0, "step_waits": 0, "step_wait_ms": 0,
                      "step_cu_mem_map": 0, "step_cu_mem_unmap": 0, "step_take_backs": 0}
    calls = frag["driver_calls"]
    # The prelude's expandable segment: the 8 MiB block's pages mapped, then unmapped by
    # empty_cache; nothing moved, so nothing taken back.
    assert after["step_cu_mem_map"] == calls["cuMemMap"]["count"] >= 1
    assert after["step_cu_mem_unmap"] == calls["cuMemUnmap"]["count"] >= 1
    assert after["step_take_backs"] == frag["reused_old_mappings"] == 0
    waits = calls["cudaEventSynchronize"]["count"] + calls["cudaStreamSynchronize"]["count"]
    assert after["step_waits"] == waits >= 1
    assert after["step_wait_ms"] == pytest.approx(
        (calls["cudaEventSynchronize"]["time_us"] + calls["cudaStreamSynchronize"]["time_us"]) / 1e3)
    assert after["step_driver_ms"] == pytest.approx(frag["driver_time_us_total"] / 1e3)
    assert after["step_driver_ms"] > after["step_wait_ms"]  # the maps and unmaps besides


@needs_plugin
def test_a_traced_capacity_trials_calls_give_a_trace_split_into_steps(tmp_path):
    """What a traced capacity trial does under vramledger (trial.py: record_memory_history with no
    stacks, a snapshot after each step, the package's write_snapshot at the end), against the
    plugin on the simulated device: the written file loads, and trace_steps splits it at the
    snapshots with the allocator's page maps in the step that made them."""
    path = tmp_path / "trace.pickle.gz"
    (rows,) = run(f"""
        sys.path.insert(0, {os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))!r})
        from benchmarks.capacity import trace_steps, trial
        from vramledger._snapshot import load_snapshot, write_snapshot
        vramledger.record_memory_history("all", context=None, stacks="python",
                                         max_entries=trial.MAX_TRACE_ENTRIES)
        a = alloc(8 * MiB)
        vramledger.snapshot()
        free(a, 8 * MiB)
        b = alloc(4 * MiB)
        write_snapshot(vramledger.snapshot(), {str(path)!r})
        trace = load_snapshot({str(path)!r})["device_traces"][0]
        print(json.dumps(trace_steps.steps(trace)))
    """)
    assert len(rows) == 2 and not any(r.get("unfinished") for r in rows)
    assert (rows[0]["allocs"], rows[0]["largest_alloc"], rows[0]["peak_live"]) == (1, 8 * MiB,
                                                                                  8 * MiB)
    assert rows[0]["segment_map"] >= 1 and rows[0]["mapped_bytes"] == 8 * MiB
    # Step 2 starts with the 8 MiB block live (freed within it): its peak; the 4 MiB block reuses
    # the mapped pages.
    assert (rows[1]["allocs"], rows[1]["segment_map"], rows[1]["peak_live"]) == (1, 0, 8 * MiB)
