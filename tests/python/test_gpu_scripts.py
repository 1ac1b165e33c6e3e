"""The GPU scripts (benchmarks/gpu/: run.sh, checks/, bench/) run only on the GPU machine, where
a syntax error costs a device call: here every Python script must compile, every shell script
must parse (bash -n), the argparse-based ones must print their usage without a GPU, and the
runner must name every check and benchmark; the figures the scripts compute from runs (paired
step ratio, step_ab's verdict and pooling) are checked on made-up runs."""

from __future__ import annotations

import json
import pathlib
import py_compile
import statistics
import subprocess
import sys

import pytest

GPU = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
STEP_AB_PY = GPU / "bench" / "step_ab.py"
TRAIN_COMPARE_PY = GPU / "checks" / "train_compare.py"
WITH_HELP = ("checks/ddp_check", "checks/guard_check", "checks/snapshot_check",
             "checks/streams_compile_check", "checks/torch_integration_check",
             "checks/train_compare", "checks/two_gpu_check", "checks/feature_matrix/run",
             "checks/multi_gpu/run", "checks/multi_gpu/fsdp", "checks/multi_gpu/nccl_register",
             "checks/multi_gpu/ipc_pair",
             "bench/graph_step_ab", "bench/inprocess_ab", "bench/step_ab", "bench/vmm_kernel_time",
             "bench/workloads_compare", "record/record_empty_cache_trace")


@pytest.mark.parametrize("script", sorted(str(p.relative_to(GPU)) for p in GPU.rglob("*.py")))
def test_python_script_compiles(script, tmp_path):
    py_compile.compile(str(GPU / script), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("script", sorted(str(p.relative_to(GPU)) for p in GPU.rglob("*.sh")))
def test_shell_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", WITH_HELP)
def test_usage_without_a_gpu(name):
    proc = subprocess.run([sys.executable, str(GPU / f"{name}.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_ipc_check_skips_without_a_gpu():
    """ipc_check.py has no options; without a device it says SKIP and passes."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the check would run for real")
    proc = subprocess.run([sys.executable, str(GPU / "checks" / "ipc_check.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("SKIP: no CUDA device"), proc.stdout


def test_the_runner_runs_every_check_and_benchmark():
    """run.sh names every script of checks/ and bench/ (inprocess_stats.py is inprocess_ab.py's
    library, train_compare.py also the benchmarks'), so a new check cannot be left out of it."""
    runner = (GPU / "run.sh").read_text()
    scripts = [p for p in (GPU / "checks").iterdir() if p.suffix in (".py", ".sh")]
    scripts += [p for p in (GPU / "bench").glob("*.py") if p.name != "inprocess_stats.py"]
    scripts += [GPU / "checks" / "feature_matrix" / "run.py",
                GPU / "checks" / "multi_gpu" / "run.py"]
    scripts += list((GPU / "record").glob("*.py"))
    assert len(scripts) == 23, scripts  # 17 checks, 5 benchmarks, 1 recording
    missing = [str(p.relative_to(GPU)) for p in scripts if str(p.relative_to(GPU)) not in runner]
    assert not missing, f"run.sh does not run {missing}"


@pytest.mark.parametrize("item", ["guard", "preload", "multi", "ddp", "hostcost",
                                  "record_empty_cache", "capacity", "checks", "bench"])
def test_the_runner_knows_every_item(item, tmp_path):
    """An item name passes the runner's check; it then stops, since its copy's tree has no
    prepared plugin."""
    runner = tmp_path / "benchmarks" / "gpu" / "run.sh"
    runner.parent.mkdir(parents=True)
    runner.write_text((GPU / "run.sh").read_text())
    proc = subprocess.run(["bash", str(runner), item], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert "no item" not in proc.stdout, proc.stdout
    assert proc.returncode == 2 and "is missing" in proc.stdout, proc.stdout


def test_the_runner_refuses_an_unknown_item_and_prints_its_usage():
    proc = subprocess.run(["bash", str(GPU / "run.sh"), "unti"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no item 'unti'" in proc.stdout
    proc = subprocess.run(["bash", str(GPU / "run.sh"), "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "bash benchmarks/gpu/run.sh prepare" in proc.stdout


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


def test_calibrate_runs_on_a_stand_in_for_cuda():
    """train_compare.calibrate() with torch's CPU tensors behind a stand-in for the "cuda" device
    and CUDA events: the code path the H200 runs, checked here so a slip costs no device call."""
    torch = pytest.importorskip("torch")
    import importlib.util
    import time as time_module
    import types

    spec = importlib.util.spec_from_file_location("train_compare", TRAIN_COMPARE_PY)
    tc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tc)

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = time_module.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    def on_cpu(fn):
        return lambda *a, device=None, **k: fn(*a, **k)

    fake = types.SimpleNamespace(
        randn=on_cpu(torch.randn), zeros=on_cpu(torch.zeros), empty_like=torch.empty_like,
        mm=torch.mm, bfloat16=torch.bfloat16,
        cuda=types.SimpleNamespace(Event=Event, synchronize=lambda: None))
    cal = tc.calibrate(fake, n=64)
    assert set(cal) == {"gpu_ms", "launch_us"}
    assert cal["gpu_ms"] > 0 and cal["launch_us"] > 0



def test_train_step_runs_on_a_stand_in_for_cuda():
    """workloads_compare.train_step (shared by workloads_compare and inprocess_ab) with torch's
    CPU tensors behind a stand-in for "cuda" and its autocast: one step moves the weights and
    leaves no gradient behind."""
    torch = pytest.importorskip("torch")
    import contextlib
    import types

    wc = _workloads_compare()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 4)

        def forward(self, input_ids, labels):
            loss = self.emb(input_ids).float().pow(2).mean() + 0 * labels.sum()
            return types.SimpleNamespace(loss=loss)

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.emb.weight.detach().clone()
    fake = types.SimpleNamespace(
        randint=lambda lo, hi, shape, device=None: torch.randint(lo, hi, shape),
        autocast=lambda device, dtype=None: contextlib.nullcontext(), bfloat16=torch.bfloat16)
    loss = wc.train_step(fake, model, opt, {"vocab": 11, "batch": 2}, 5)
    assert loss.item() > 0
    assert not torch.equal(before, model.emb.weight)
    assert model.emb.weight.grad is None


def _load(path: pathlib.Path, name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_feature_matrix_compares_with_torch_native_within_its_tolerance(monkeypatch):
    fm = _load(GPU / "checks" / "feature_matrix" / "run.py", "feature_matrix_run")
    assert fm.agree([2.0, 10.0], [2.0, 10.0]) == (True, 0.0)
    same, worst = fm.agree([1.0, 4.0], [1.0005, 4.0])
    assert same and abs(worst - 0.0005 / 1.0005) < 1e-12
    assert fm.agree([1.0], [1.01])[0] is False
    assert fm.agree([1.0], [1.0, 2.0]) == (False, float("inf"))
    monkeypatch.setenv("LD_PRELOAD", "/elsewhere.so")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:100")
    assert "LD_PRELOAD" not in fm.column_env("native", "/s.so")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in fm.column_env("vramledger", "/s.so")
    assert fm.column_env("expandable", "/s.so")["PYTORCH_CUDA_ALLOC_CONF"] == \
        "expandable_segments:True"
    assert fm.column_env("shim", "/s.so")["LD_PRELOAD"] == "/s.so"
    assert set(fm.FEATURES) == set(_load(GPU / "checks" / "feature_matrix" / "cells.py",
                                         "feature_matrix_cells").FEATURES)


def test_graph_step_ab_interval_holds_the_ratio_of_medians():
    gs = _load(GPU / "bench" / "graph_step_ab.py", "graph_step_ab")
    a = [0.100 + 0.001 * (i % 7) for i in range(80)]
    b = [1.05 * t for t in a]
    lo, hi = gs.bootstrap_ratio(a, b)
    ratio = statistics.median(b) / statistics.median(a)
    assert lo <= ratio <= hi and hi - lo < 0.05
    assert abs(ratio - 1.05) < 1e-9


def test_feature_matrix_lists_cells_past_its_budget_as_not_run():
    """A column whose budget is spent starts no cell: each is listed as not run, never as
    passed (a run that ends early must still print its table)."""
    import time
    fm = _load(GPU / "checks" / "feature_matrix" / "run.py", "feature_matrix_run_budget")
    results = fm.run_column("vramledger", ["stats", "oom"], "/s.so", "/nonexistent", 60,
                            deadline=time.time() + 5)
    assert [r["feature"] for r in results] == ["stats", "oom"]
    assert all(r.get("not_run") and not r["ok"] for r in results)
    assert results[0]["detail"] == "not run: the budget was spent"


def test_record_empty_cache_compares_torch_with_both_replays(tmp_path):
    """record_empty_cache_trace.py --compare on made-up figures: torch's peak reserved beside
    the replay's with and without the releases, and its verdict (within 1%) as exit status."""
    script = GPU / "record" / "record_empty_cache_trace.py"
    gib = 1 << 30
    (tmp_path / "torch.json").write_text(json.dumps({
        "torch": "2.11.0+cu130", "device": "NVIDIA H200", "streams": 10, "phases": 4,
        "empty_cache_calls": 4, "trace_events": 1234, "segment_frees": 120,
        "peak_reserved_bytes": 8 * gib, "peak_allocated_bytes": 7 * gib,
        "num_alloc_retries": 0}))
    releases = {"runs": 4, "empty_cache_runs": 4, "retry_runs": 0, "applied": 4, "skipped": 0}

    def replay(name, peak):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "peak_reserved_bytes": peak, "recorded_peak_reserved_bytes": 8 * gib,
            "releases": releases}))

    replay("followed", 8 * gib + 8 * gib // 200)  # +0.5%
    replay("ignored", 16 * gib)
    proc = subprocess.run([sys.executable, str(script), "--compare", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "8.00 GiB" in proc.stdout and "16.00 GiB" in proc.stdout
    assert "+0.50%" in proc.stdout and "+100.00%" in proc.stdout
    assert "within 1% of torch: yes" in proc.stdout
    replay("followed", 9 * gib)
    proc = subprocess.run([sys.executable, str(script), "--compare", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "within 1% of torch: NO" in proc.stdout
