"""GPU checks' code paths run here, so a slip costs no device call: train_compare.calibrate()
and workloads_compare.train_step() on torch's CPU tensors behind a stand-in for CUDA, the
feature matrix's comparisons and budget, and record_empty_cache_trace.py --compare on made-up
figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_gpu_scripts import GPU, _load
from test_gpu_step_stats import TRAIN_COMPARE_PY, _workloads_compare


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
