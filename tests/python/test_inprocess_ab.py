"""benchmarks/gpu/bench/inprocess_ab.py without a GPU: its schedule, statistics, pooling and table
(inprocess_stats.py, made-up groups with known ratios), and the allocator-swap helper
(allocator_swap.cc) against torch's own view of its current allocator."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

import pytest

GPU = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench"
sys.path.insert(0, str(GPU))
import inprocess_stats as st  # noqa: E402  (standard library only)


def _groups(ratios, native_s=0.25, again=1.0, process=None):
    """Groups of one length each, vramledger's step `ratio` times native's, native-again
    `again` times; tagged with `process` when given."""
    out = []
    for k, r in enumerate(ratios):
        n = native_s + 0.01 * k
        g = {"native": n, "vramledger": n * r, "native-again": n * again}
        if process is not None:
            g["process"] = process
        out.append(g)
    return out


def test_verdicts_shown_refuted_neither():
    shown = st.summarize(_groups([1.00, 1.01, 0.99, 1.005, 1.00, 1.01, 0.995]), "vramledger", 1.02)
    assert shown["verdict"] == "shown" and shown["groups"] == 7 and shown["processes"] == 1
    assert shown["ratio"] == pytest.approx(1.0)
    assert shown["interval90"][1] <= 1.02
    refuted = st.summarize(_groups([1.05, 1.06, 1.04, 1.07, 1.05]), "vramledger", 1.02)
    assert refuted["verdict"] == "refuted" and refuted["interval90"][0] > 1.02
    neither = st.summarize(_groups([0.97, 1.06, 0.98, 1.07, 1.00, 1.05]), "vramledger", 1.02)
    assert neither["verdict"] == "neither"
    assert neither["interval90"][0] <= 1.02 < neither["interval90"][1]
    # The A/A control: native-again 3% over native in every group; no verdict without a target.
    aa = st.summarize(_groups([1.0] * 5, again=1.03), "native-again", None)
    assert aa["ratio"] == pytest.approx(1.03) and "verdict" not in aa
    with pytest.raises(ValueError, match="no group has both 'vramledger' and native"):
        st.summarize([{"native": 0.2}], "vramledger", 1.02)


def test_processes_that_differ_widen_the_interval():
    """Two processes, each tight, 2.5% apart: counted as independent groups the interval is
    narrow; resampling processes first (what summarize does) makes it span both."""
    a = _groups([1.000 + 0.001 * (k % 3) for k in range(60)], process="a")
    b = _groups([1.025 + 0.001 * (k % 3) for k in range(60)], process="b")
    two = st.summarize(a + b, "vramledger", 1.02)
    flat = st.summarize([dict(g, process="") for g in a + b], "vramledger", 1.02)
    assert two["processes"] == 2 and flat["processes"] == 1
    assert flat["interval90"][1] - flat["interval90"][0] < 0.026
    assert two["interval90"][0] <= 1.002 and two["interval90"][1] >= 1.025
    assert two["verdict"] == "neither"


def test_chained_multiplies_the_two_processes_ratios():
    plain = _groups([1.01] * 9)
    shimmed = [{"vramledger": g["native"], "shim": g["native"] * 1.015} for g in plain]
    c = st.chained(plain, shimmed, 1.03)
    assert c["ratio"] == pytest.approx(1.01 * 1.015)
    assert c["interval90"] == pytest.approx([1.01 * 1.015] * 2)  # no spread, no width
    assert c["verdict"] == "shown" and c["processes"] == [1, 1]
    slow = [dict(g, shim=g["vramledger"] * 1.05) for g in shimmed]
    assert st.chained(plain, slow, 1.03)["verdict"] == "refuted"
    with pytest.raises(ValueError, match="both sides need groups"):
        st.chained(plain, [{"native": 1.0}], 1.03)


def test_schedule_balances_positions_and_primes_repeats():
    counts = collections.Counter()
    offsets = collections.Counter()
    for g in range(12):
        fresh = st.schedule(g, "native", "fresh", 500)
        assert [s for _, s in fresh] == [500, 501, 502]  # a new length per step
        order = [m for m, _ in fresh]
        assert sorted(order) == ["native", "native-again", "vramledger"]
        counts.update((m, i) for i, m in enumerate(order))
        offsets[order.index("vramledger") - order.index("native")] += 1
        repeat = st.schedule(g, "native", "repeat", 700)
        assert repeat[0] == ("prime", 700)
        assert [m for m, _ in repeat[1:]] == order and {s for _, s in repeat} == {700}
        steady = st.schedule(g, "native", "steady", 700)
        assert steady[:2] == [("prime", 700), ("prime-vramledger", 700)]
        assert [m for m, _ in steady[2:]] == order and {s for _, s in steady} == {700}
    assert set(counts.values()) == {4}  # every mode at every position 4 times in 12 groups
    assert offsets == {1: 4, -1: 4, 2: 2, -2: 2}  # vramledger's length offset: symmetric
    assert [m for m, _ in st.schedule(0, "shim", "fresh", 1)] == ["shim", "vramledger",
                                                                   "shim-again"]
    with pytest.raises(ValueError, match="lengths must be"):
        st.schedule(0, "native", "both", 1)


def test_fresh_lengths_never_repeat_and_leave_the_setup_length():
    starts = st.fresh_triples(128, 1024, 298, seed=0)
    lengths = [s + i for s in starts for i in range(3)]
    assert len(set(lengths)) == len(lengths) == 894
    assert min(lengths) == 129 and max(lengths) <= 1024  # 128: the setup step's
    assert starts != sorted(starts)  # shuffled
    assert st.fresh_triples(128, 1024, 5, seed=0) == starts[:5]  # seeded
    with pytest.raises(ValueError, match=r"\[129, 1024\] holds 298 triples"):
        st.fresh_triples(128, 1024, 299, seed=0)


def _counted(groups, calls=0):
    return [dict(g, warmup=k == 0, vramledger_driver_calls=calls + k, vramledger_driver_us=500.0)
            for k, g in enumerate(groups)]


def test_table_rows_name_each_ratio_and_verdict_only_the_target():
    r = {"workload": "gpt2m", "base": "native", "groups": _counted(_groups([1.01] * 8))}
    rows = st.table_rows(r, 1.02)
    assert [row.split(" | ")[1] for row in rows] == ["vramledger / native",
                                                     "native-again / native"]
    assert rows[0].startswith("| gpt2m | vramledger / native | 7 (1 proc.) |")
    assert "shown at 1.02" in rows[0] and "[5, 6, 7]" in rows[0]  # last three counted groups
    assert "A/A control" in rows[1] and "shown" not in rows[1]
    assert set(r["verdicts"]) == {"vramledger/native", "native-again/native"}
    shim = [{"vramledger": g["native"], "shim": g["native"] * 1.02, "shim-again": g["native"]}
            for g in _groups([1.0] * 8)]
    rows = st.table_rows({"workload": "gpt2m", "base": "shim", "groups": _counted(shim),
                          "lengths": "fresh"}, 1.02)
    assert rows[0].startswith("| gpt2m (fresh lengths) | shim / vramledger | 7 (1 proc.) |")
    assert "1.0200" in rows[0] and "factor of the chained row" in rows[0]
    assert st.table_rows({"workload": "x", "base": "shim", "failed": True}, 1.03) == [
        "| x | shim: FAILED | | | | | |"]


def _result(base, ratio, n, lengths=None, conf=None, run_id=None, prime=True):
    groups = []
    for g in _counted(_groups([ratio] * n)):
        if prime:
            g["prime"] = g["native"] * 2
        if base == "shim":
            g = dict(g, shim=g["native"] * ratio, vramledger=g["native"],
                     **{"shim-again": g["native"]})
        groups.append(g)
    r = {"workload": "gpt2m", "base": base, "groups": groups}
    for key, value in (("lengths", lengths), ("conf", conf), ("run_id", run_id)):
        if value is not None:
            r[key] = value
    return r


def test_pool_merges_like_runs_only(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    # a: older outputs (no lengths / conf / run id): primed groups are repeat, unprimed are not.
    a.write_text(json.dumps([_result("native", 1.01, 5), _result("shim", 1.02, 5),
                             _result("native", 1.5, 4, prime=False),
                             {"workload": "llama1b", "base": "native", "failed": True}]))
    b.write_text(json.dumps([
        _result("native", 1.01, 7, "repeat", "expandable_segments:True", "p1"),
        _result("native", 1.05, 4, "fresh", "expandable_segments:True", "p2"),
        _result("native", 1.04, 4, "repeat", "expandable_segments:True,recycle_slack:0.01",
                "p3")]))
    c.write_text(json.dumps([_result("native", 1.01, 3, "repeat", "expandable_segments:True",
                                     "p1")]))
    pooled = st.pooled([str(a), str(b)])
    keys = {(r["base"], r["lengths"], r["conf"]): r for r in pooled}
    assert set(keys) == {
        ("native", "repeat", "unrecorded"), ("shim", "repeat", "unrecorded"),
        ("native", "unprimed", "unrecorded"), ("native", "repeat", "expandable_segments:True"),
        ("native", "fresh", "expandable_segments:True"),
        ("native", "repeat", "expandable_segments:True,recycle_slack:0.01")}
    old = keys[("native", "repeat", "unrecorded")]
    assert len(old["groups"]) == 4 and old["processes"] == 1  # warm-up group left out
    rows = st.report(pooled, 1.02, 1.03)
    chained = [row for row in rows if "shim / native, chained" in row]
    assert len(chained) == 1 and "1.0302" in chained[0]  # 1.01 x 1.02: the unrecorded pair only
    assert any("[expandable_segments:True,recycle_slack:0.01]" in row for row in rows)
    with pytest.raises(ValueError, match="given twice"):
        st.pooled([str(a), str(a)])
    with pytest.raises(ValueError, match="run p1 appears twice"):
        st.pooled([str(b), str(c)])


def test_pool_from_the_command_line(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps([_result("native", 1.01, 4, "fresh", "expandable_segments:True",
                                        "p1")]))
    bad.write_text('{"rounds": []}')
    script = str(GPU / "inprocess_ab.py")
    proc = subprocess.run([sys.executable, script, "--pool", str(good)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| gpt2m (fresh lengths) | vramledger / native | 3 (1 proc.) |" in proc.stdout
    for args, message in (([str(bad)], "not an inprocess_ab --json output"),
                          ([str(good), str(good)], "given twice")):
        proc = subprocess.run([sys.executable, script, "--pool", *args], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr


def _swap_library_path():
    root = GPU.parents[2]
    for build in ("build-ci", "build"):
        path = root / build / "torch_plugin" / "lib" / "libvramledger_allocator_swap.so"
        if path.exists():
            return path
    return None


def test_allocator_swap_makes_either_allocator_torchs_current():
    """allocator_swap.cc on this CPU machine: torch's native allocator first, vramledger's
    pluggable one after change_current_allocator, and each made current again by a store, as
    torch itself reports (get_allocator_backend); init of the native one without a GPU fails
    cleanly (-1, the message on stderr) instead of aborting."""
    pytest.importorskip("torch")
    lib = _swap_library_path()
    if lib is None:
        pytest.skip("libvramledger_allocator_swap.so is not built (benchmarks off or no torch)")
    code = f"""
import sys, torch
sys.path.insert(0, {str(GPU)!r})
import inprocess_ab
from vramledger import _plugin
_plugin.load()
swap = inprocess_ab.SwapLibrary()
native = swap.current()
print(swap.name(native), torch.cuda.get_allocator_backend())
alloc = torch.cuda.memory.CUDAPluggableAllocator(_plugin.loaded_path(), "vramledger_malloc",
                                                 "vramledger_free")
torch.cuda.memory.change_current_allocator(alloc)
plugged = swap.current()
print(swap.name(plugged), torch.cuda.get_allocator_backend(), plugged != native)
swap.store(native)
print(torch.cuda.get_allocator_backend())
swap.store(plugged)
print(torch.cuda.get_allocator_backend())
if not torch.cuda.is_available():
    print("init", swap.init(native, 1))
"""
    env = dict(os.environ, VRAMLEDGER_AB_SWAP=str(lib))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:4] == ["native native", "pluggable pluggable True", "native", "pluggable"]
    if len(lines) > 4:  # no GPU here: the native allocator's init needs one
        assert lines[4] == "init -1"
        assert "vramledger_ab_init: " in proc.stderr
