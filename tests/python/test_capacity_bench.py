"""benchmarks/capacity without a GPU: the search, the budget, the resume and the tables, driven by
a stand-in trial that fits up to a known size (no torch, no process per trial)."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.capacity import __main__ as capacity_main  # noqa: E402
from benchmarks.capacity import runner, search, table  # noqa: E402
from benchmarks.capacity.results import Results  # noqa: E402
from benchmarks.capacity.workloads import BATCH_BOUND  # noqa: E402


class Clock:
    """A clock the stand-in trial advances by `trial_s` per trial."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StandIn:
    """A trial that fits when its size along the searched dimension is at most `limits[(workload,
    allocator, cap, dim)]`; records every call; takes `trial_s` of the clock."""

    def __init__(self, limits, clock=None, trial_s=20.0, retries=None, step_s=None):
        self.limits, self.clock, self.trial_s = limits, clock or Clock(), trial_s
        self.retries = retries or {}
        self.step_s = step_s or {}
        self.calls = []

    def __call__(self, workload, allocator, cap, dim, size, timeout_s):
        self.calls.append((workload, allocator, cap, dim, size))
        if timeout_s < self.trial_s:
            self.clock.now += timeout_s
            return {"fits": None, "timed_out": True, "error": "timed out"}
        self.clock.now += self.trial_s
        fits = size <= self.limits[(workload, allocator, cap, dim)]
        steps = [self.step_s.get(allocator, 0.5)] * 6 if fits else []
        return {"fits": fits, "oom": not fits, "step_s": steps,
                "median_step_s": steps[0] if steps else None,
                "retries": self.retries.get(allocator, 0), "device": "stand-in", "torch": "none"}


def no_prediction(*_):
    return None


# ---- the search alone ----

@pytest.mark.parametrize("step, bound", [(1, 40), (64, 64 * 40)])
def test_search_finds_the_exact_limit_from_any_guess(step, bound):
    for limit_units in range(0, 41):
        limit = limit_units * step
        for guess in (None, step, limit, limit + 3 * step, max(step, limit - 3 * step), bound):
            calls = []

            def fits(size):
                calls.append(size)
                assert size % step == 0 and step <= size <= bound
                return size <= limit

            s = search.largest_fit(fits, bound=bound, step=step, guess=guess, spread=0.05)
            assert s.largest == limit, (limit, guess)
            assert len(calls) == len(set(calls)) == s.trials  # no size tried twice
            if limit == 0:
                assert s.status == search.NOTHING and s.failing == step
            elif limit == bound:
                assert s.status == search.EVERY and s.failing is None
            else:
                assert s.status == search.FOUND and s.failing == limit + step


def test_a_right_guess_takes_two_trials():
    s = search.largest_fit(lambda n: n <= 12, bound=BATCH_BOUND, guess=12)
    assert (s.status, s.largest, s.trials) == (search.FOUND, 12, 2)
    s = search.largest_fit(lambda n: n <= 2560, bound=65536, step=64, guess=2560)
    assert (s.status, s.largest) == (search.FOUND, 2560) and s.trials <= 4


def test_search_starts_from_known_results_and_reports_errors():
    tried = []

    def fits(n):
        tried.append(n)
        return n <= 9

    s = search.largest_fit(fits, bound=100, known={5: True, 12: False}, guess=50)
    assert s.largest == 9 and all(5 < n < 12 for n in tried)
    s = search.largest_fit(lambda n: None, bound=100, guess=10)
    assert (s.status, s.trials) == (search.ERROR, 1)
    with pytest.raises(ValueError, match="step"):
        search.largest_fit(fits, bound=10, step=64)


# ---- the runner with the stand-in ----

LIMITS = {("gpt2m", "torch", 24.0, "batch"): 4, ("gpt2m", "torch-expandable", 24.0, "batch"): 6,
          ("gpt2m", "vramledger", 24.0, "batch"): 7,
          ("gpt2m", "torch", 24.0, "seq"): 1152, ("gpt2m", "torch-expandable", 24.0, "seq"): 1664,
          ("gpt2m", "vramledger", 24.0, "seq"): 1792}
ALLOCS = ("torch", "torch-expandable", "vramledger")
GROUPS = [("gpt2m", 24.0, "batch"), ("gpt2m", 24.0, "seq")]
PLANNED = {"torch": (3, 1088), "torch-expandable": (6, 1705), "vramledger": (6, 1780)}


def planned(workload, allocator, cap, dim):
    return PLANNED[allocator][dim == "seq"]


def run(results, stand_in, budget_s, predict=planned, groups=GROUPS):
    runner.run_grid(groups, ALLOCS, stand_in, results, runner.Budget(budget_s, stand_in.clock),
                    predict, log=lambda _: None)


def test_runner_finds_every_limit_and_the_tables_show_them(tmp_path):
    stand_in = StandIn(LIMITS, retries={"torch": 3, "vramledger": 0, "torch-expandable": 1},
                       step_s={"torch": 0.52, "torch-expandable": 0.51, "vramledger": 0.5})
    results = Results(str(tmp_path / "r.json"))
    run(results, stand_in, budget_s=1e9)
    for (w, a, c, d), limit in LIMITS.items():
        assert table.measured(results, w, a, c, d, 64) == limit
    assert len(stand_in.calls) == len(set(stand_in.calls)) < 40
    text = table.capacity_table(results, [("gpt2m", 24.0)], planned, 64)
    rows = {line.split(" | ")[2]: line for line in text.splitlines()[2:]}
    assert "| 4 (1024) | 3 (-25.0%) | 1152 (4) | 1088 (-5.6%) |" in rows["torch native"]
    assert "| 7 (1024) | 6 (-14.3%) | 1792 (4) | 1780 (-0.7%) |" in rows["vramledger"]
    assert rows["vramledger"].endswith("| x1.75 / x1.17 | x1.56 / x1.08 |")
    # At the largest size all three fit (batch 4, seq 1152), each allocator's own trial.
    retries = table.retries_table(results, GROUPS, 64)
    assert "| GPT-2-medium | 24 | batch | 4 | torch native | 0.50 | 0.520 |" in retries
    assert "| GPT-2-medium | 24 | seq | 1152 | vramledger | 0.00 | 0.500 |" in retries
    saved = json.loads((tmp_path / "r.json").read_text())["trials"]
    assert len(saved) == len(stand_in.calls)


def test_budget_cuts_the_run_and_the_table_shows_what_finished(tmp_path):
    stand_in = StandIn(LIMITS, trial_s=20.0)
    results = Results(str(tmp_path / "r.json"))
    # 30 s expected at first, then 20: three trials in 70 s. vramledger searches first, from the
    # planner's 6: 6 and 7 fit, 9 does not.
    run(results, stand_in, budget_s=70.0)
    assert stand_in.calls == [("gpt2m", "vramledger", 24.0, "batch", n) for n in (6, 7, 9)]
    assert stand_in.clock.now == 60.0
    assert len(json.loads((tmp_path / "r.json").read_text())["trials"]) == 3

    def row(allocator):
        text = table.capacity_table(results, [("gpt2m", 24.0)], planned, 64)
        return next(line for line in text.splitlines() if f"| {allocator} |" in line)

    assert "| >= 7, < 9 (unfinished) (1024) |" in row("vramledger")
    assert "| - (1024) |" in row("torch expandable")
    # 30 s more (a first trial is expected to take 30 s): 8, which ends vramledger's search.
    more = StandIn(LIMITS, trial_s=20.0)
    run(results, more, budget_s=30.0)
    assert more.calls == [("gpt2m", "vramledger", 24.0, "batch", 8)]
    assert "| 7 (1024) |" in row("vramledger")
    # The torch allocators' searches start from vramledger's 7: expandable's 7 and 6 come next.
    more = StandIn(LIMITS, trial_s=20.0)
    run(results, more, budget_s=50.0)
    assert more.calls == [("gpt2m", "torch-expandable", 24.0, "batch", n) for n in (7, 6)]
    assert "| 6 (1024) |" in row("torch expandable")


def test_a_trial_the_budget_cuts_off_is_not_a_result(tmp_path):
    stand_in = StandIn(LIMITS, trial_s=50.0)
    runner.run_grid(GROUPS[:1], ALLOCS, stand_in, Results(), runner.Budget(60.0, stand_in.clock,
                                                                         first_s=10.0),
                    planned, log=lambda _: None)
    # The first trial ran (50 s); the second had 10 s left, expected 50: not started.
    assert len(stand_in.calls) == 1
    results = Results()
    stand_in = StandIn(LIMITS, trial_s=50.0)
    runner.run_grid(GROUPS[:1], ALLOCS, stand_in, results, runner.Budget(40.0, stand_in.clock,
                                                                         first_s=10.0),
                    planned, log=lambda _: None)
    assert len(stand_in.calls) == 1 and results.records == {}  # timed out by the budget


def test_resume_continues_without_repeating_a_trial(tmp_path):
    one_shot = StandIn(LIMITS)
    run(Results(), one_shot, budget_s=1e9)
    first, second = StandIn(LIMITS), StandIn(LIMITS)
    path = str(tmp_path / "r.json")
    run(Results(path), first, budget_s=130.0)
    assert 0 < len(first.calls) < len(one_shot.calls)
    resumed = Results(str(tmp_path / "r2.json"))
    assert resumed.load([path]) == len(first.calls)
    run(resumed, second, budget_s=1e9)
    assert not set(first.calls) & set(second.calls)
    assert sorted(first.calls + second.calls) == sorted(one_shot.calls)
    for (w, a, c, d), limit in LIMITS.items():
        assert table.measured(resumed, w, a, c, d, 64) == limit


def test_records_set_aside_are_kept_by_every_save_and_not_searched(tmp_path):
    path = tmp_path / "r.json"
    old = {"workload": "gpt2m", "allocator": "vramledger", "cap_gib": 24.0, "dim": "batch",
           "size": 8, "fits": True, "library": "older"}
    aside = {"note": "measured again with a later build", "trials": [old], "step_rounds": []}
    path.write_text(json.dumps({"trials": [], "superseded": aside}))
    results = Results(str(tmp_path / "out.json"))
    assert results.load([str(path), str(path)]) == 0
    assert results.known("gpt2m", "vramledger", 24.0, "batch") == {}
    results.add({**old, "fits": False, "library": "newer"})
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["superseded"] == aside
    assert [r["library"] for r in doc["trials"]] == ["newer"]
    path.write_text(json.dumps({"trials": [], "superseded": [old]}))
    with pytest.raises(ValueError, match='"superseded" is not an object'):
        Results().load([str(path)])


def test_nothing_fits_and_fits_at_every_size_tried(tmp_path):
    limits = {("llama1b", a, 24.0, "batch"): 0 for a in ALLOCS}
    limits[("llama1b", "vramledger", 24.0, "batch")] = 10 ** 9  # above any size tried
    stand_in = StandIn(limits)
    results = Results()
    run(results, stand_in, budget_s=1e9, predict=no_prediction,
        groups=[("llama1b", 24.0, "batch")])
    text = table.capacity_table(results, [("llama1b", 24.0)], no_prediction, 64)
    assert "| none (1 does not fit) (2048) |" in text
    assert f"| >= {BATCH_BOUND} (every size tried) (2048) |" in text
    assert "| - / - |" in text  # no gain over a torch allocator that fits nothing
    assert "| Llama-1B | 24 | batch | - | vramledger | - | - |" in table.retries_table(
        results, [("llama1b", 24.0, "batch")], 64)


def test_an_error_stops_the_row_and_shows_in_the_table():
    def broken(workload, allocator, cap, dim, size, timeout_s):
        return {"fits": None, "error": "exit 1: ImportError"}

    results = Results()
    runner.run_grid(GROUPS[:1], ("vramledger",), broken, results, runner.Budget(1e9), planned,
                    log=lambda _: None)
    assert len(results.errors("gpt2m", "vramledger", 24.0, "batch")) == 1
    assert "| error (1024) |" in table.capacity_table(results, [("gpt2m", 24.0)], planned, 64)


def test_command_line_table_only_and_bad_filters(tmp_path, capsys):
    path = tmp_path / "r.json"
    run(Results(str(path)), StandIn(LIMITS), budget_s=1e9)
    assert capacity_main.main(["--table-only", "--resume", str(path), "--workloads", "gpt2m",
                               "--caps", "24"]) == 0
    out = capsys.readouterr().out
    assert f"resumed {len(json.loads(path.read_text())['trials'])} trial(s)" in out
    assert "stand-in, torch none" in out and "| 7 (1024) |" in out
    # The single trials' table says what it is, ahead of its header.
    caption = "Retries and step time at the largest size all three fit, one trial per allocator"
    assert out.index(caption) < out.index("| workload | cap GiB | dimension | size all three fit")
    for flags, needle in ((["--workloads", "gpt3"], "unknown gpt3"),
                          (["--caps", "0"], "GiB above 0"),
                          (["--dims", "tokens"], "unknown tokens"),
                          (["--resume", str(tmp_path / "missing.json")], "--resume")):
        with pytest.raises(SystemExit) as e:
            capacity_main.main(["--table-only", *flags])
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


def test_usage_and_a_trial_without_a_gpu_is_an_error_not_a_no_fit():
    """The module runs from the repository root; a trial that cannot start CUDA (this machine)
    is a failed trial (fits None), never counted as running out of memory."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "benchmarks.capacity", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "CAPACITY_WORKLOADS" in proc.stdout, proc.stderr
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the trial would run for real")
    from benchmarks.capacity import trial
    r = trial.run_trial("gpt2m", "torch", 24.0, "batch", 1, timeout_s=120)
    assert r["fits"] is None and r["error"].startswith("exit 1: "), r


@pytest.mark.parametrize("name", ["gpt2m", "llama1b-ckpt", "llama1b-lora"])
def test_each_workload_builds_and_trains_a_small_copy_on_the_cpu(name):
    """The workloads' model code (transformers, peft) on a 2-layer, 64-wide copy of each: the
    LoRA one trains only its adapters, over a bf16 base; every step gives a finite loss."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import dataclasses
    import math

    from benchmarks.capacity import workloads
    w = workloads.WORKLOADS[name]
    small = dict(w.config)
    for k in ("n_layer", "num_hidden_layers"):
        if k in small:
            small[k] = 2
    for k, v in (("n_embd", 64), ("hidden_size", 64), ("intermediate_size", 128),
                 ("n_head", 4), ("num_attention_heads", 4), ("num_key_value_heads", 2),
                 ("vocab_size", 97)):
        if k in small:
            small[k] = v
    model, opt = workloads.build(torch, dataclasses.replace(w, config=small), device="cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if w.lora_rank:
        assert trainable and all(p.dtype == torch.float32 for p in trainable)
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    else:
        assert len(trainable) == len(list(model.parameters()))
    before = [p.detach().clone() for p in trainable]
    for length in workloads.lengths(16):
        assert math.isfinite(workloads.train_step(torch, model, opt, 97, 2, length,
                                                  device="cpu"))
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable))


def test_trial_child_caps_memory_and_tells_out_of_memory_from_other_errors(monkeypatch):
    """trial.child() with torch.cuda's calls and the model stood in for: it caps reserved memory
    at cap / total before the model is built, runs the six lengths, and records an
    OutOfMemoryError as not fitting (with the step it reached); any other error propagates.
    Each completed step's change of the allocator's counters lies beside its time."""
    torch = pytest.importorskip("torch")
    from benchmarks.capacity import trial, workloads
    total = 150109880320
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (total // 2, total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f: calls.append(("fraction", f)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    stats = {"num_alloc_retries": 2, "allocated_bytes.all.peak": 10,
             "reserved_bytes.all.peak": 12}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: dict(stats))
    model = torch.nn.Linear(3, 2)
    monkeypatch.setattr(workloads, "build", lambda t, w: calls.append("build") or (model, None))

    def step(t, model, opt, vocab, batch, seq):
        calls.append((batch, seq))
        # The step of index i maps i times; the second unmaps once; every other step waits on
        # the streams; the sixth retries once. num_device_* start absent (read as 0).
        i = len(calls) - 3
        stats["num_alloc_retries"] += i == 5
        stats["num_device_alloc"] = stats.get("num_device_alloc", 0) + i
        stats["num_device_free"] = stats.get("num_device_free", 0) + (i == 1)
        stats["num_sync_all_streams"] = stats.get("num_sync_all_streams", 0) + i % 2
        if batch * seq > limit:
            raise error
        return 1.0

    monkeypatch.setattr(workloads, "train_step", step)
    limit, error = 10 ** 9, None
    r = trial.child("gpt2m", "torch", 24.0, 4, 1000)
    assert calls[:2] == [("fraction", 24 * 2 ** 30 / total), "build"]
    assert calls[2:] == [(4, n) for n in workloads.lengths(1000)]
    assert r["fits"] and not r["oom"] and len(r["step_s"]) == 6 and r["retries"] == 3
    assert (r["peak_reserved"], r["cap_bytes"], r["device"]) == (12, 24 * 2 ** 30, "stand-in")
    assert (r["param_bytes"], r["buffer_bytes"]) == (8 * 4, 0)
    assert r["step_device_alloc"] == [0, 1, 2, 3, 4, 5]
    assert r["step_device_free"] == [0, 1, 0, 0, 0, 0]
    assert r["step_sync_all_streams"] == [0, 1, 0, 1, 0, 1]
    assert r["step_alloc_retries"] == [0, 0, 0, 0, 0, 1]
    limit, error = 4 * 900, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    calls.clear()
    r = trial.child("gpt2m", "torch", 24.0, 4, 1000)
    assert not r["fits"] and r["oom"] and len(r["step_s"]) == 1  # the step of 1000 ran out
    assert r["step_device_alloc"] == [0] and r["step_sync_all_streams"] == [0]  # completed only
    assert "Tried to allocate" in r["error"]
    error = RuntimeError("CUBLAS_STATUS_ALLOC_FAILED: out of memory")
    assert trial.child("gpt2m", "torch", 24.0, 4, 1000)["oom"]
    error = RuntimeError("an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        trial.child("gpt2m", "torch", 24.0, 4, 1000)


def test_trial_child_under_vramledger_records_its_driver_time_and_waits(monkeypatch):
    """trial.child() under vramledger (a stand-in module in its place): install() comes first,
    memory_stats() and fragmentation() are vramledger's, and each completed step's change of its
    driver time and of its waits (event and stream synchronizations) lies beside its time; a step
    that runs out of memory records none."""
    torch = pytest.importorskip("torch")
    import types
    from benchmarks.capacity import trial, workloads
    calls = []
    frag = {"driver_time_us_total": 0.0, "page_moves": 0, "reused_old_mappings": 0,
            "driver_calls": {name: {"count": 0, "time_us": 0.0}
                             for name in ("cuMemMap", "cuMemUnmap", "cudaEventSynchronize",
                                          "cudaStreamSynchronize")}}
    stand_in = types.ModuleType("vramledger")
    stand_in.install = lambda: calls.append("install")
    stand_in.installed_mode = lambda: "native"
    stand_in.memory_stats = lambda: {"num_device_alloc": len(calls)}
    stand_in.fragmentation = lambda: json.loads(json.dumps(frag))  # a copy, as the plugin's
    monkeypatch.setitem(sys.modules, "vramledger", stand_in)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f: calls.append("fraction"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(workloads, "build",
                        lambda t, w: calls.append("build") or (torch.nn.Linear(3, 2), None))

    def step(t, model, opt, vocab, batch, seq):
        # Step i spends 1000 * i us in the driver; step 1 waits on an event for 400 us, step 3
        # on a stream for 250 us; step i maps 2 * i times, unmaps i % 2 times and takes back 3
        # old mappings; the step of index `oom_at` runs out of memory after its calls.
        i = sum(isinstance(c, tuple) for c in calls)
        calls.append((batch, seq))
        frag["driver_time_us_total"] += 1000.0 * i
        frag["driver_calls"]["cuMemMap"]["count"] += 2 * i
        frag["driver_calls"]["cuMemUnmap"]["count"] += i % 2
        frag["reused_old_mappings"] += 3
        kind = {1: ("cudaEventSynchronize", 400.0), 3: ("cudaStreamSynchronize", 250.0)}.get(i)
        if kind:
            frag["driver_calls"][kind[0]]["count"] += 1
            frag["driver_calls"][kind[0]]["time_us"] += kind[1]
        if i == oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return 1.0

    monkeypatch.setattr(workloads, "train_step", step)
    oom_at = None
    r = trial.child("gpt2m", "vramledger", 24.0, 4, 1000)
    assert calls[:3] == ["install", "fraction", "build"]
    assert r["fits"] and len(r["step_s"]) == 6
    assert r["mode"] == "native" and set(r["host"]) == {"boot_id", "cpu_model", "cpus", "loadavg"}
    assert r["step_driver_ms"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert r["step_waits"] == [0, 1, 0, 1, 0, 0]
    assert r["step_wait_ms"] == [0.0, 0.4, 0.0, 0.25, 0.0, 0.0]
    assert r["step_cu_mem_map"] == [0, 2, 4, 6, 8, 10]
    assert r["step_cu_mem_unmap"] == [0, 1, 0, 1, 0, 1]
    assert r["step_take_backs"] == [3] * 6
    assert len(r["step_device_alloc"]) == 6
    # What the process did in each step, read from the real counters: one entry a step.
    for field in trial.PROCESS_FIGURES:
        assert len(r[field]) == 6, field
        assert all(x is None or x >= 0 for x in r[field]), field
    assert all(isinstance(x, float) for x in r["step_user_ms"] + r["step_sys_ms"])
    assert len(r["step_launch_ms"]) == 6 and all(0 <= x for x in r["step_launch_ms"])
    # Each step's host probes and the CPU its main thread ended it on.
    assert len(r["step_probe_py_us"]) == len(r["step_probe_launch_us"]) == 6
    assert all(x > 0 for x in r["step_probe_py_us"] + r["step_probe_launch_us"])
    assert len(r["step_cpu"]) == 6 and set(r["step_cpu"]) <= os.sched_getaffinity(0)
    assert r["maxrss_mib"] > 0 and r["threads"] >= 1
    calls.clear()
    oom_at = 2
    r = trial.child("gpt2m", "vramledger", 24.0, 4, 1000)
    assert r["oom"] and len(r["step_s"]) == len(r["step_driver_ms"]) == len(r["step_waits"]) == 2
    # Under torch's allocators the record has none of vramledger's figures.
    calls.clear()
    oom_at = None
    r = trial.child("gpt2m", "torch", 24.0, 4, 1000)
    assert not any(f in r for f in trial.VRAMLEDGER_FIGURES + trial.VRAMLEDGER_MAPPINGS)
    assert "mode" not in r and "host" in r and len(r["step_minflt"]) == 6


def test_each_steps_process_figures_are_the_counters_change_over_that_step(monkeypatch):
    """process_totals() is read just before and just after each step's timed span: a counter that
    grows by 2.5 at each read grows by 2.5 inside each step; one that cannot be read is None."""
    torch = pytest.importorskip("torch")
    from benchmarks.capacity import trial, workloads
    reads = []

    def totals():
        reads.append(len(reads))
        n = 2.5 * len(reads)
        return {f: (None if f == "step_steal_ms" else n) for f in trial.PROCESS_FIGURES}
    monkeypatch.setattr(trial, "process_totals", totals)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, 80 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})
    monkeypatch.setattr(workloads, "build", lambda t, w: (torch.nn.Linear(3, 2), None))
    monkeypatch.setattr(workloads, "train_step", lambda *a: torch.tensor(1.5))
    r = trial.child("gpt2m", "torch", 24.0, 4, 1000)
    assert len(reads) == 12 and r["losses"] == [1.5] * 6
    for field in trial.PROCESS_FIGURES:
        assert r[field] == ([None] * 6 if field == "step_steal_ms" else [2.5] * 6), field


def test_the_main_threads_cpu_and_run_queue_wait_are_read_from_its_schedstat(monkeypatch):
    from benchmarks.capacity import trial
    monkeypatch.setattr(trial, "read_text", lambda path: {
        "/proc/thread-self/schedstat": "123456789 2500000 42"}[path])
    assert trial.thread_sched_ms() == (123.456789, 2.5)
    for text in (None, "", "1", "1 x 3", "x 1 3"):
        monkeypatch.setattr(trial, "read_text", lambda path, t=text: t)
        assert trial.thread_sched_ms() == (None, None), text


def test_a_steps_launch_time_ends_when_its_work_is_queued_and_the_loss_is_read_after(
        monkeypatch):
    """step_launch_ms stops when train_step returns, before the wait for the GPU; step_s holds
    both; the loss is read only after the wait."""
    torch = pytest.importorskip("torch")
    from benchmarks.capacity import trial, workloads
    now = [0.0]
    events = []

    class Loss:
        def __float__(self):
            events.append("read")
            return 2.0

    def step(*args):
        now[0] += 0.1  # queuing the step's work
        return Loss()

    def synchronize():
        events.append("wait")
        now[0] += 0.05  # the GPU finishing it
    monkeypatch.setattr(trial.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, 80 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})
    monkeypatch.setattr(workloads, "build", lambda t, w: (torch.nn.Linear(3, 2), None))
    monkeypatch.setattr(workloads, "train_step", step)
    r = trial.child("gpt2m", "torch", 24.0, 4, 1000)
    assert r["step_launch_ms"] == pytest.approx([100.0] * 6)
    assert r["step_s"] == pytest.approx([0.15] * 6) and r["losses"] == [2.0] * 6
    # The untimed first round of host probes; then each step: the drain before it and the host
    # probes' (outside the span), the wait, then its loss is read.
    assert events == ["wait"] + ["wait", "wait", "wait", "read"] * 6


def test_the_main_threads_cpu_and_migrations_are_read_from_proc(monkeypatch):
    from benchmarks.capacity import trial
    # A command name with spaces and a parenthesis: the fields after its last ')' count.
    stat = "4242 (py (main) x) R " + " ".join(str(n) for n in range(4, 39)) + " 7 0 0"
    sched = "python (4242, #threads: 3)\n---\nse.exec_start  :  12.5\nse.nr_migrations  :  9\n"
    monkeypatch.setattr(trial, "read_text", lambda path: {
        "/proc/thread-self/stat": stat, "/proc/thread-self/sched": sched}[path])
    assert (trial.thread_cpu(), trial.thread_migrations()) == (7, 9)
    for text in (None, "", "1 (x) R 4", "se.nr_migrations : many"):
        monkeypatch.setattr(trial, "read_text", lambda path, t=text: t)
        assert (trial.thread_cpu(), trial.thread_migrations()) == (None, None), text
    # The live process: its CPU is one it may run on.
    monkeypatch.undo()
    migrations = trial.thread_migrations()
    assert trial.thread_cpu() in os.sched_getaffinity(0) and (migrations is None or migrations >= 0)


def test_the_host_probes_time_fixed_work_and_launch_on_the_given_tensor():
    torch = pytest.importorskip("torch")
    from benchmarks.capacity import trial
    scalar = torch.zeros(1)
    python_us, launch_us = trial.host_probes(type("T", (), {"cuda": type(
        "C", (), {"synchronize": staticmethod(lambda: None)})}), scalar)
    assert python_us > 0 and launch_us > 0
    assert scalar.item() == trial.PROBE_LAUNCHES  # each launch added 1


def test_the_stolen_time_is_read_from_the_cpu_line_of_proc_stat(monkeypatch):
    from benchmarks.capacity import trial
    ticks = os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(trial, "read_text", lambda path: {
        "/proc/stat": f"cpu  10 0 20 30 0 0 0 {ticks * 3} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10"}[path])
    assert trial.steal_ms() == 3000.0
    for text in (None, "", "cpu 1 2 3", "intr 1 2 3 4 5 6 7 8 9", "cpu 1 2 3 4 5 6 7 x 9"):
        monkeypatch.setattr(trial, "read_text", lambda path, t=text: t)
        assert trial.steal_ms() is None, text


def test_the_planner_tests_gpt2_config_is_this_benchmarks_model():
    """tests/python/data's 8192-position GPT-2-medium, which the planner's tests search sequences
    on, is this benchmark's model."""
    from benchmarks.capacity.workloads import GPT2M
    data = ROOT / "tests" / "python" / "data" / "gpt2-medium-8192-positions.json"
    assert json.loads(data.read_text()) == GPT2M
