"""Pausable regions from Python: vramledger.region / pause / resume / regions on the plugin's
simulated device (no GPU), their figures in memory_stats, memory_summary and fragmentation, the
errors each refusal raises, and the same calls reaching the runtime through the LD_PRELOAD shim.

Each case runs in a fresh interpreter, as in test_fragmentation.py: the simulated device and the
options are set once per process, and install() (which needs CUDA) is stood in for by marking the
package installed. Skips where the plugin library or torch is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import vramledger
from vramledger import _plugin, _summary

MiB = 1 << 20

PRELUDE = r"""
import ctypes, json, sys, threading
import torch
import vramledger
from vramledger import _plugin
lib = _plugin.load()
lib.vramledger_testing_use_sim_backend.argtypes = [ctypes.c_int, ctypes.c_size_t]
assert lib.vramledger_testing_use_sim_backend(1, CAPACITY) == 0
_plugin.configure("expandable_segments:True,expandable_page_mb:2" + EXTRA)
vramledger._installed = ("test", "")  # install() needs CUDA; the simulator stands in for it
lib.vramledger_testing_malloc.restype = ctypes.c_void_p
lib.vramledger_testing_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_void_p)]
MiB = 1 << 20

def alloc(size):
    p = lib.vramledger_testing_malloc(size, 0, None)
    assert p, size
    return p

def refusal(size):
    msg = ctypes.c_void_p()
    p = lib.vramledger_testing_malloc(size, 0, ctypes.byref(msg))
    assert not p
    text = ctypes.string_at(msg.value).decode()
    lib.vramledger_string_free(msg.value)
    return text

def free(p, size):
    lib.vramledger_free(p, size, 0, None)

def raises(fn):
    try:
        fn()
    except Exception as e:  # the type and message the test checks
        return [type(e).__name__, str(e)]
    return None
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


def run(body: str, capacity: int = 8 << 30, extra: str = "", env: dict | None = None) -> list:
    """Runs PRELUDE + `body` in a fresh interpreter; returns the JSON of each printed line."""
    prelude = PRELUDE.replace("CAPACITY", str(capacity)).replace("EXTRA", repr(extra))
    code = prelude + textwrap.dedent(body)
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith(("{", "["))]


@needs_plugin
def test_round_trip_reports_bytes_and_no_ops_say_so():
    (out,) = run("""
        outside = alloc(6 * MiB)
        with vramledger.region("train"):
            inside = alloc(20 * MiB)
        (before,) = vramledger.regions()
        reserved = vramledger.memory_stats()["reserved_bytes.all.current"]
        paused = vramledger.pause("train", backup="cpu")
        again = vramledger.pause("train", backup="cpu")
        (during,) = vramledger.regions(0)
        stats = vramledger.memory_stats()
        summary = vramledger.memory_summary()
        resumed = vramledger.resume("train")
        noop = vramledger.resume("train")
        (after,) = vramledger.regions()
        free(inside, 20 * MiB)
        free(outside, 6 * MiB)
        print(json.dumps({"before": before, "during": during, "after": after, "paused": paused,
                          "again": again, "resumed": resumed, "noop": noop,
                          "reserved": reserved, "stats": {k: v for k, v in stats.items()
                          if k.startswith("regions.") or k == "reserved_bytes.all.current"},
                          "summary": summary,
                          "frag": vramledger.fragmentation()["regions"]}))
    """)
    before, during, after = out["before"], out["during"], out["after"]
    assert before["name"] == "train" and before["device"] == 0 and not before["paused"]
    assert before["allocated_bytes"] == 20 * MiB
    reserved = before["mapped_bytes"]  # the physical bytes it holds: what a pause releases
    assert reserved >= 20 * MiB and before["reserved_bytes"] >= reserved
    paused = out["paused"]
    assert {k: paused[k] for k in ("released_bytes", "backed_up_bytes", "already_paused")} == {
        "released_bytes": reserved, "backed_up_bytes": 20 * MiB, "already_paused": False}
    assert paused["handles"] == 1  # the block's whole pages share one handle in a region
    assert all(paused[k] >= 0 for k in ("wait_seconds", "copy_seconds", "driver_seconds"))
    assert out["again"] == {"released_bytes": 0, "backed_up_bytes": 0, "already_paused": True,
                            "handles": 0, "wait_seconds": 0, "copy_seconds": 0,
                            "driver_seconds": 0}
    assert during["paused"] and during["mapped_bytes"] == 0
    assert during["paused_bytes"] == reserved and during["backed_up_bytes"] == 20 * MiB
    stats = out["stats"]
    assert stats["reserved_bytes.all.current"] == out["reserved"] - reserved
    assert stats["regions.train.paused"] == 1
    assert stats["regions.train.reserved_bytes"] == before["reserved_bytes"]
    assert stats["regions.train.backed_up_bytes"] == 20 * MiB
    assert "| train paused " in out["summary"]
    resumed = out["resumed"]
    assert {k: resumed[k] for k in ("mapped_bytes", "restored_bytes", "already_running")} == {
        "mapped_bytes": reserved, "restored_bytes": 20 * MiB, "already_running": False}
    assert resumed["handles"] == 1
    assert resumed["driver_seconds"] >= 0 and resumed["copy_seconds"] >= 0
    assert out["noop"]["already_running"] is True
    assert not after["paused"] and after["mapped_bytes"] == reserved
    assert after["host_buffer_bytes"] == 0
    assert out["frag"][0]["name"] == "train" and out["frag"][0]["allocated_bytes"] == 0


@needs_plugin
def test_region_scope_is_per_thread_nests_and_works_as_a_decorator():
    (out,) = run("""
        got = {}
        @vramledger.region("r")
        def in_region(size):
            return alloc(size)
        with vramledger.region("r"):
            with vramledger.region("r"):
                a = alloc(4 * MiB)
            b = alloc(2 * MiB)
            t = threading.Thread(target=lambda: got.update(other=alloc(8 * MiB)))
            t.start(); t.join()
        c = in_region(2 * MiB)
        outside = alloc(16 * MiB)
        (r,) = vramledger.regions()
        threaded = torch._C._is_multithreading_enabled
        modes = [threaded()]
        with vramledger.region("r"):
            modes.append(threaded())  # backward() on this thread inside the block
            with vramledger.region("r", backward_on_this_thread=False):
                modes.append(threaded())
            modes.append(threaded())
        modes.append(threaded())
        print(json.dumps({"allocated": r["allocated_bytes"], "modes": modes}))
    """)
    assert out["allocated"] == (4 + 2 + 2) * MiB  # not the other thread's, not outside
    assert out["modes"] == [True, False, False, False, True]


@needs_plugin
def test_errors_name_the_region_and_leave_it_as_it_was():
    (out,) = run("""
        with vramledger.region("big"):
            p = alloc(160 * MiB)
        r = {}
        r["bad_backup"] = raises(lambda: vramledger.pause("big", backup="disk"))
        r["empty"] = raises(lambda: vramledger.region(""))
        r["unknown"] = raises(lambda: vramledger.pause("ghost"))
        r["unknown_resume"] = raises(lambda: vramledger.resume("ghost"))
        vramledger.pause("big", backup="cpu")
        with vramledger.region("big"):
            r["paused_alloc"] = refusal(MiB)
        q = alloc(160 * MiB)  # the card holds one of the two at a time
        r["resume"] = raises(lambda: vramledger.resume("big"))
        r["is_oom"] = r["resume"] is not None and r["resume"][0] == "OutOfMemoryError"
        (r["region"],) = vramledger.regions()
        free(q, 160 * MiB)
        vramledger.empty_cache()
        r["resumed"] = vramledger.resume("big")
        print(json.dumps(r))
    """, capacity=256 * MiB)
    assert out["bad_backup"] == ["ValueError",
                                 "vramledger.pause(): backup must be 'none' or 'cpu', got 'disk'"]
    assert out["empty"][0] == "ValueError"
    assert out["unknown"][0] == "RuntimeError" and "'ghost'" in out["unknown"][1]
    assert out["unknown_resume"][0] == "RuntimeError" and "'ghost'" in out["unknown_resume"][1]
    assert "big" in out["paused_alloc"]
    assert out["is_oom"], out["resume"]
    assert "big" in out["resume"][1]
    region = out["region"]
    assert region["paused"] and region["mapped_bytes"] == 0
    assert region["backed_up_bytes"] == 160 * MiB
    assert out["resumed"]["restored_bytes"] == 160 * MiB


@needs_plugin
def test_a_resume_the_plan_refuses_is_out_of_memory_naming_the_plan_line(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('{\n  "vramledger_plan": 1,\n  "limit": "256MiB"\n}\n')
    (out,) = run("""
        with vramledger.region("train"):
            p = alloc(160 * MiB)
        vramledger.pause("train", backup="none")
        q = alloc(160 * MiB)
        err = raises(lambda: vramledger.resume("train"))
        (region,) = vramledger.regions()
        print(json.dumps({"err": err, "paused": region["paused"]}))
    """, extra=f",plan:{plan},dump_dir:{tmp_path / 'dumps'}")
    assert out["err"][0] == "OutOfMemoryError"
    assert f"{plan}:3" in out["err"][1]
    assert out["paused"] is True


def test_summary_lists_regions_below_torchs_table_and_nothing_without_them():
    stats = {"num_ooms": 0, "num_alloc_retries": 0}
    for key in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
                "inactive_split_bytes", "allocation", "active", "segment", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for column in ("current", "peak", "allocated", "freed"):
                stats[f"{key}.{pool}.{column}"] = 0
    for key in ("oversize_allocations", "oversize_segments"):
        for column in ("current", "peak", "allocated", "freed"):
            stats[f"{key}.{column}"] = 0
    plain = _summary.format_summary(stats, 0)
    assert "Region" not in plain
    stats.update({"regions.roll.out.reserved_bytes": 64 * MiB, "regions.roll.out.mapped_bytes": 0,
                  "regions.roll.out.allocated_bytes": 40 * MiB,
                  "regions.roll.out.backed_up_bytes": 0, "regions.roll.out.paused": 1})
    text = _summary.format_summary(stats, 0)
    assert text.startswith(plain[:-1])  # torch's table unchanged, regions below it
    lines = text.splitlines()
    assert lines[-4] == ("|        Region         |  Reserved  |   Mapped   | Allocated  |"
                         " Backed up  |")
    # torch's units: a larger one once the value reaches 768 of it
    assert lines[-2] == ("| roll.out paused       |  65536 KiB |      0 B   |  40960 KiB |"
                         "      0 B   |")
    assert all(len(line) == 77 for line in lines)


def test_calls_need_a_serving_runtime():
    if vramledger.is_installed():
        pytest.skip("vramledger is installed in this interpreter")
    with pytest.raises(RuntimeError, match="not serving this process"):
        vramledger.regions()
    with pytest.raises(ValueError, match="backup must be 'none' or 'cpu'"):
        vramledger.pause("x", backup="gpu")


def _shim_path() -> str | None:
    from vramledger import _run_cli

    try:
        return _run_cli.preload_path(RuntimeError)
    except RuntimeError:
        return None


@needs_plugin
def test_the_same_calls_reach_the_runtime_through_the_shim():
    shim = _shim_path()
    if shim is None:
        pytest.skip("the LD_PRELOAD shim is not built")
    native = os.path.join(os.path.dirname(shim), "libvramledger_native.so")
    if not os.path.exists(native):
        pytest.skip("no libvramledger_native.so beside the shim")
    code = textwrap.dedent(r"""
        import ctypes, json, os, sys, torch
        import vramledger
        plugin = ctypes.CDLL(sys.argv[1])  # the copy the shim loaded: one runtime
        assert plugin.vramledger_testing_use_sim_backend(1, ctypes.c_size_t(1 << 30)) == 0
        plugin.vramledger_testing_malloc.restype = ctypes.c_void_p
        plugin.vramledger_testing_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int,
                                                     ctypes.c_void_p]
        assert not vramledger.is_installed()
        with vramledger.region("rollout"):
            p = plugin.vramledger_testing_malloc(8 << 20, 0, None)
        paused = vramledger.pause("rollout", backup="cpu")
        (region,) = vramledger.regions()
        resumed = vramledger.resume("rollout")
        try:
            vramledger.pause("ghost")
            err = None
        except RuntimeError as e:
            err = str(e)
        print(json.dumps({"backend": torch.cuda.get_allocator_backend(), "paused": paused,
                          "region": region, "resumed": resumed, "err": err}))
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    # The exit dump is preload_route_test's subject; here only the region calls are.
    env.update(LD_PRELOAD=shim, VRAMLEDGER_CONF="expandable_page_mb:2",
               VRAMLEDGER_PRELOAD_QUIET="1", VRAMLEDGER_PRELOAD_NO_EXIT_DUMP="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, "-c", code, os.path.join(os.path.dirname(shim), _plugin.PLUGIN_NAME)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["backend"] == "vramledger"
    assert out["paused"]["backed_up_bytes"] == 8 * MiB
    assert out["paused"]["released_bytes"] == out["region"]["paused_bytes"] > 0
    assert out["region"]["paused"] is True
    assert out["resumed"]["restored_bytes"] == 8 * MiB
    assert "'ghost'" in out["err"]


@needs_plugin
def test_the_snapshot_marks_a_paused_regions_segments():
    (out,) = run("""
        outside = alloc(4 * MiB)
        with vramledger.region("r"):
            inside = alloc(10 * MiB)
        running = vramledger.snapshot()["segments"]
        paused = vramledger.pause("r", backup="cpu")
        segments = vramledger.snapshot()["segments"]
        (region,) = vramledger.regions()
        print(json.dumps({
            "running_paused": [s.get("paused", False) for s in running],
            "paused": [[s["address"], s["total_size"], s["handles"],
                        [b["state"] for b in s["blocks"]]]
                       for s in segments if s.get("paused")],
            "not_paused": [s["total_size"] for s in segments if not s.get("paused")],
            "inside": inside, "released": paused["released_bytes"],
            "pool": region["pool"],
            "pools": [s["segment_pool_id"] for s in segments if s.get("paused")]}))
    """)
    assert not any(out["running_paused"])
    assert out["paused"], "no segment marked paused"
    assert sum(s[1] for s in out["paused"]) == out["released"]
    assert all(s[2] == 0 for s in out["paused"])  # no physical handle under a paused range
    assert any(s[0] <= out["inside"] < s[0] + s[1] and "active_allocated" in s[3]
               for s in out["paused"])  # the live block is listed where it will be again
    assert out["not_paused"], "the default pool's segment is still listed"
    assert all(p == out["pool"] for p in out["pools"])


def test_inspect_lists_paused_ranges_apart_from_the_memory_held():
    from vramledger import _inspect

    def segment(address, size, paused, blocks):
        s = {"device": 0, "address": address, "total_size": size, "segment_type": "large",
             "stream": 0, "is_expandable": True,
             "blocks": [{"address": address + off, "size": n, "state": st, "frames": []}
                        for off, n, st in blocks]}
        if paused:
            s["paused"] = True
        return s

    snap = {"segments": [segment(0, 4 * MiB, False, [(0, 4 * MiB, "active_allocated")]),
                         segment(64 * MiB, 10 * MiB, True,
                                 [(0, 6 * MiB, "active_allocated"), (6 * MiB, 4 * MiB,
                                                                     "inactive")])],
            "device_traces": [[]]}
    d = _inspect.device_summary(snap, 0)
    assert d["segments"] == 1 and d["fragmentation"]["reserved_bytes"] == 4 * MiB
    assert (d["paused_segments"], d["paused_bytes"], d["paused_allocated_bytes"]) == (
        1, 10 * MiB, 6 * MiB)
    text = _inspect.format_summary({"origin": "torch", "devices": [d]}, "x.pickle")
    assert "paused regions: 1 ranges, 10.00 MiB released, 6.00 MiB of live blocks" in text
