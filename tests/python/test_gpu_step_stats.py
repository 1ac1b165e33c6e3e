"""The step-time figures the GPU scripts compute from their runs, checked on made-up runs:
workloads_compare's paired and calibrated ratios, step_ab's verdict, pooling and allocator host
share, train_compare's host share per step, graph_step_ab's bootstrap interval."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from test_gpu_scripts import GPU, _load

STEP_AB_PY = GPU / "bench" / "step_ab.py"
TRAIN_COMPARE_PY = GPU / "checks" / "train_compare.py"


def _workloads_compare():
    import importlib.util
    spec = importlib.util.spec_from_file_location("workloads_compare",
                                                  GPU / "bench" / "workloads_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only the standard library at the top
    return module


def test_paired_step_ratio_cancels_sequence_length():
    wc = _workloads_compare()
    # Steps of very different lengths (random sequence lengths), 10% slower step for step, in
    # two rounds: the first (warm-up) step is left out.
    native = [{"step_s": [9.0, 0.2, 0.6, 0.4]}, {"step_s": [8.0, 0.3, 0.5, 0.1]}]
    slower = [{"step_s": [1.0] + [x * 1.1 for x in n["step_s"][1:]]} for n in native]
    assert wc.paired_step_ratio(slower, native) == pytest.approx(1.1)
    # A ratio of medians would say otherwise when the rounds' lengths differ.
    odd = [{"step_s": [1.0, 0.22, 0.66, 0.44]}, {"step_s": [1.0, 0.3, 0.5, 0.1]}]
    assert wc.paired_step_ratio(odd, native) == pytest.approx(1.05)


def test_paired_step_ratio_needs_two_steps():
    wc = _workloads_compare()
    with pytest.raises(ValueError, match="no steps to pair"):
        wc.paired_step_ratio([{"step_s": [1.0]}], [{"step_s": [1.0]}])


def _step_ab():
    import importlib.util
    spec = importlib.util.spec_from_file_location("step_ab", STEP_AB_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only the standard library at the top
    return module


def _rounds(ratios, native_ms=200.0):
    """Rounds whose `shim` run is `ratio` times native's, step for step."""
    out = []
    for k, ratio in enumerate(ratios):
        steps = [native_ms + 10 * k, native_ms - 5 * k, native_ms]
        out.append({
            "native": {"median_ms": statistics.median(steps), "min_ms": min(steps),
                       "step_ms": steps, "losses": [1.0, 2.0]},
            "shim": {"median_ms": statistics.median(steps) * ratio,
                     "min_ms": min(steps) * ratio, "step_ms": [x * ratio for x in steps],
                     "losses": [1.0, 2.0 * (1 + 1e-6)]},
        })
    return out


def test_step_ab_verdict_shown_refuted_neither():
    ab = _step_ab()
    shown = ab.summarize(_rounds([1.00, 1.01, 0.99, 1.02, 1.00, 1.01]), "shim", 1.03)
    assert shown["verdict"] == "shown"
    assert shown["rounds"] == 6
    assert shown["ratio"] == pytest.approx(1.005)
    assert shown["paired_step_ratio"] == pytest.approx(1.005)
    assert shown["interval90"][1] <= 1.03
    assert shown["worst_loss_rel"] == pytest.approx(1e-6, rel=1e-3)
    refuted = ab.summarize(_rounds([1.08, 1.10, 1.09, 1.12, 1.07]), "shim", 1.03)
    assert refuted["verdict"] == "refuted"
    assert refuted["interval90"][0] > 1.03
    # Rounds on both sides of the target: the interval straddles it.
    neither = ab.summarize(_rounds([0.95, 1.10, 0.97, 1.12, 1.01, 1.06]), "shim", 1.03)
    assert neither["verdict"] == "neither"
    assert neither["interval90"][0] <= 1.03 < neither["interval90"][1]
    assert neither["geomean"] == pytest.approx(statistics.geometric_mean(
        [0.95, 1.10, 0.97, 1.12, 1.01, 1.06]))


def test_step_ab_summary_needs_rounds_with_both_modes():
    ab = _step_ab()
    with pytest.raises(ValueError, match="no round has both 'plugin' and native"):
        ab.summarize(_rounds([1.0]), "plugin", 1.03)


def test_step_ab_pools_earlier_outputs(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rounds": _rounds([1.00, 1.01])}))
    b.write_text(json.dumps({"rounds": _rounds([1.02, 0.99, 1.00])}))
    out = tmp_path / "pooled.json"
    proc = subprocess.run([sys.executable, str(STEP_AB_PY), "--pool", str(a), str(b),
                           "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| shim | 5 |" in proc.stdout
    pooled = json.loads(out.read_text())
    assert len(pooled["rounds"]) == 5
    assert pooled["verdicts"]["shim"]["ratio"] == pytest.approx(1.00)


def test_step_ab_pool_names_a_bad_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"verdicts": {}}))
    proc = subprocess.run([sys.executable, str(STEP_AB_PY), "--pool", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"--pool {bad}: not a step_ab --json output (KeyError" in proc.stderr


def test_step_ab_refuses_an_unknown_mode():
    proc = subprocess.run([sys.executable, str(STEP_AB_PY), "--modes", "native,shmi"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--modes: unknown mode(s) shmi (known: native, plugin, shim," in proc.stderr


def test_step_ab_calibrated_ratio_divides_out_a_slow_process():
    ab = _step_ab()
    # The shim's process runs everything 10% slower (its matmul and its launches alike), and its
    # steps with it: the raw ratio says 1.10, the calibrated ratios 1.00.
    rounds = _rounds([1.10, 1.10, 1.10])
    for r in rounds:
        r["native"]["calibration"] = {"gpu_ms": 0.5, "launch_us": 4.0}
        r["shim"]["calibration"] = {"gpu_ms": 0.55, "launch_us": 4.4}
    v = ab.summarize(rounds, "shim", 1.03)
    assert v["ratio"] == pytest.approx(1.10)
    assert v["gpu_calibrated_ratio"] == pytest.approx(1.00)
    assert v["launch_calibrated_ratio"] == pytest.approx(1.00)
    # A run without calibration (an older output pooled in): no calibrated figure.
    del rounds[0]["shim"]["calibration"]
    assert ab.summarize(rounds, "shim", 1.03)["gpu_calibrated_ratio"] is None


def test_workloads_calibrated_step_ratio():
    wc = _workloads_compare()
    native = [{"median_step_s": 0.2, "calibration": {"gpu_ms": 0.5}},
              {"median_step_s": 0.3, "calibration": {"gpu_ms": 0.6}}]
    # Round 1: a process 10% slower at everything; round 2: 2% slower steps, the same speed.
    runs = [{"median_step_s": 0.22, "calibration": {"gpu_ms": 0.55}},
            {"median_step_s": 0.306, "calibration": {"gpu_ms": 0.6}}]
    assert wc.calibrated_step_ratio(runs, native) == pytest.approx(1.01)
    assert wc.calibrated_step_ratio([{"median_step_s": 0.2}], native[:1]) is None


def _train_compare():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_compare", TRAIN_COMPARE_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only the standard library at the top
    return module


def test_host_share_per_step_after_the_first():
    tc = _train_compare()
    # Steps of 0.2, 0.1, 0.4 s after a 2 s first step; 1, 2, 2 ms inside the allocator.
    share = tc.host_share([2.0, 0.2, 0.1, 0.4], [50.0, 1.0, 2.0, 2.0])
    assert share["median"] == pytest.approx(0.005)  # 1/200, 2/100, 2/400 -> 0.005, 0.02, 0.005
    assert share["max"] == pytest.approx(0.02)
    assert tc.host_share([0.2, 0.3], None) is None  # native: no host time
    assert tc.host_share([0.2], [1.0]) is None       # nothing after the first step
    with pytest.raises(ValueError, match="2 host times .* for 3 steps"):
        tc.host_share([1.0, 1.0, 1.0], [1.0, 2.0])  # not silently one step
    with pytest.raises(ValueError, match="None entries: 1"):
        tc.host_share([1.0, 1.0], [1.0, None])
    # Over rounds: the median of the rounds' medians, the largest step of all.
    both = tc.host_share_over_rounds([([2.0, 0.2, 0.1, 0.4], [50.0, 1.0, 2.0, 2.0]),
                                      ([2.0, 0.1, 0.1], [50.0, 3.0, 1.0])])
    assert both["median"] == pytest.approx((0.005 + 0.02) / 2)
    assert both["max"] == pytest.approx(0.03)
    assert tc.host_share_over_rounds([([0.2, 0.3], None)]) is None
    assert tc.host_share_over_rounds([]) is None


def test_host_time_per_step_differences_the_running_total(monkeypatch):
    tc = _train_compare()
    totals = iter([100.0, 1100.0, 4100.0])  # us, as allocator_host_us reports them
    monkeypatch.setattr(tc, "allocator_host_us", lambda allocator: next(totals))
    per = tc.HostTimePerStep("vramledger")
    per.step_done()
    per.step_done()
    assert per.per_step == [pytest.approx(1.0), pytest.approx(3.0)]  # ms
    monkeypatch.setattr(tc, "allocator_host_us", lambda allocator: None)
    none = tc.HostTimePerStep("native")
    none.step_done()
    assert none.per_step == []


def test_allocator_host_us_is_none_without_vramledger():
    # This process has neither the plugin installed as allocator "vramledger" nor the shim.
    assert _train_compare().allocator_host_us("native") is None


def test_step_ab_reports_the_allocator_host_share():
    ab = _step_ab()
    rounds = _rounds([1.01, 1.00])
    for r in rounds:  # 1% of every step, 3% of the first
        r["shim"]["host_ms"] = [x * 0.01 for x in r["shim"]["step_ms"]]
        r["shim"]["host_ms"][0] *= 3
    v = ab.summarize(rounds, "shim", 1.03)
    assert v["allocator_host_share"]["median"] == pytest.approx(0.01)
    assert v["allocator_host_share"]["max"] == pytest.approx(0.03)
    assert ab.summarize(_rounds([1.0]), "shim", 1.03)["allocator_host_share"] is None


def test_graph_step_ab_interval_holds_the_ratio_of_medians():
    gs = _load(GPU / "bench" / "graph_step_ab.py", "graph_step_ab")
    a = [0.100 + 0.001 * (i % 7) for i in range(80)]
    b = [1.05 * t for t in a]
    lo, hi = gs.bootstrap_ratio(a, b)
    ratio = statistics.median(b) / statistics.median(a)
    assert lo <= ratio <= hi and hi - lo < 0.05
    assert abs(ratio - 1.05) < 1e-9
