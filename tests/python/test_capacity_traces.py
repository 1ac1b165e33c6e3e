"""The capacity benchmark's traced trials without a GPU: the trial's recording and its snapshot file
(torch.cuda's calls and vramledger stood in for), the traces phase with a stand-in trial (which
sizes, which files, resuming, the budget), and trace_steps on a trace whose figures are known."""

from __future__ import annotations

import gzip
import json
import pathlib
import pickle
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.capacity import __main__ as capacity_main  # noqa: E402
from benchmarks.capacity import runner, trace_steps, traces  # noqa: E402
from benchmarks.capacity.results import Results  # noqa: E402
# The real package's snapshot module, imported before a test stands in for `vramledger` itself:
# the traced trial writes its file with it.
from vramledger import _snapshot  # noqa: E402,F401

MIB = 1 << 20


def entry(action, size=0, t=0, addr=0):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "frames": []}


# ---- trace_steps ----

# Two steps and the start of a third. Step 1: allocs of 4 and 8 MiB, a 2 MiB page run mapped
# right after the second (at t=130, 30 us after the alloc before it, then a second map at 135),
# then the first alloc's block freed; step 2: a 16 MiB alloc, a run unmap + map (10 + 5 us), an
# oom; after the second snapshot one alloc of 1 MiB, unfinished.
TRACE = [entry("alloc", 4 * MIB, 10), entry("alloc", 8 * MIB, 100),
         entry("segment_map", 2 * MIB, 130), entry("segment_map", 4 * MIB, 135),
         entry("free_requested", 4 * MIB, 140), entry("free_completed", 4 * MIB, 141),
         entry("snapshot", 0, 150),
         entry("alloc", 16 * MIB, 200), entry("segment_unmap", 2 * MIB, 210),
         entry("segment_map", 2 * MIB, 215), entry("oom", 0, 220), entry("snapshot", 0, 230),
         entry("alloc", MIB, 300)]


def test_trace_steps_splits_at_snapshots_and_counts_each_step():
    rows = trace_steps.steps(TRACE)
    assert len(rows) == 3 and rows[2]["unfinished"] and "unfinished" not in rows[0]
    one, two, three = rows
    assert (one["allocs"], one["largest_alloc"], one["peak_live"]) == (2, 8 * MIB, 12 * MIB)
    assert (one["segment_map"], one["segment_unmap"], one["mapped_bytes"]) == (2, 0, 6 * MIB)
    assert (one["runs"], one["segment_run_us"]) == (1, 35)  # from the alloc at 100 to 135
    # Step 2 starts with 8 MiB live: its peak is 24 MiB.
    assert (two["allocs"], two["peak_live"], two["ooms"]) == (1, 24 * MIB, 1)
    assert (two["segment_unmap"], two["segment_map"], two["unmapped_bytes"]) == (1, 1, 2 * MIB)
    assert (two["runs"], two["segment_run_us"]) == (1, 15)
    assert (three["allocs"], three["peak_live"], three["runs"]) == (1, 25 * MIB, 0)
    table = trace_steps.table(rows)
    assert "| 3 (unfinished) | 1 |" in table and "| 0 / 0 / 2 / 0 | 0.01 / 0.00 | 1, 0.0 |" in table


def test_trace_steps_command_line(tmp_path, capsys):
    path = tmp_path / "t.pickle.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [TRACE]}, f, protocol=4)
    assert trace_steps.main([str(path), "--json"]) == 0
    assert [r["allocs"] for r in json.loads(capsys.readouterr().out)] == [2, 1, 1]
    assert trace_steps.main([str(path)]) == 0
    assert "no `snapshot` entry" not in capsys.readouterr().out
    unmarked = tmp_path / "unmarked.pickle.gz"
    with gzip.open(unmarked, "wb") as f:
        pickle.dump({"segments": [], "device_traces": [TRACE[:5]]}, f, protocol=4)
    assert trace_steps.main([str(unmarked)]) == 0
    out = capsys.readouterr().out
    assert "| 1 (unfinished) | 2 |" in out
    assert "has no `snapshot` entry: its trace is one step" in out
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(pickle.dumps({"segments": [], "device_traces": []}, protocol=4))
    assert trace_steps.main([str(empty)]) == 2
    assert "holds no trace for device 0" in capsys.readouterr().err
    assert trace_steps.main([str(path), "--device", "1"]) == 2
    (tmp_path / "bad.pickle").write_text("not a snapshot")
    assert trace_steps.main([str(tmp_path / "bad.pickle")]) == 2
    assert "bad.pickle" in capsys.readouterr().err
    assert trace_steps.main([str(tmp_path / "missing.pickle")]) == 2


# ---- the trial's recording ----

@pytest.fixture
def trial_env(monkeypatch):
    """trial.child() with torch.cuda's calls, the workload and vramledger stood in for; `calls`
    lists what happened in order; `history` is the recorded trace (one entry per step's alloc and
    a `snapshot` entry per snapshot). Each snapshot function returns the trace as its allocator
    does: vramledger's with its own `snapshot` entry, torch's without it (torch copies the trace
    first)."""
    torch = pytest.importorskip("torch")
    from benchmarks.capacity import trial, workloads
    env = types.SimpleNamespace(calls=[], history=None, oom_at=None, trial=trial)

    def record(enabled, context="all", stacks="python", max_entries=0):
        env.calls.append(("record", enabled, context, max_entries))
        env.history = []

    def snapshot(own_entry_first):
        env.calls.append("snapshot")
        if own_entry_first:
            env.history.append(entry("snapshot", 0, len(env.history)))
        out = {"segments": [], "device_traces": [list(env.history)]}
        if not own_entry_first:
            env.history.append(entry("snapshot", 0, len(env.history)))
        return out

    frag = {"driver_time_us_total": 0.0, "reused_old_mappings": 0, "page_moves": 0,
            "driver_calls": {n: {"count": 0, "time_us": 0.0} for n in (
                "cuMemMap", "cuMemUnmap", "cudaEventSynchronize", "cudaStreamSynchronize")}}
    vl = types.ModuleType("vramledger")
    vl.install = lambda: env.calls.append("install")
    vl.installed_mode = lambda: "native"
    vl.memory_stats = lambda: {}
    vl.fragmentation = lambda: json.loads(json.dumps(frag))
    vl.record_memory_history = record
    vl.snapshot = lambda: snapshot(own_entry_first=True)
    monkeypatch.setitem(sys.modules, "vramledger", vl)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snapshot(own_entry_first=False))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1 << 40, 1 << 40))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(workloads, "build", lambda t, w: env.calls.append("build") or
                        (torch.nn.Linear(3, 2), None))

    def step(t, model, opt, vocab, batch, seq):
        i = sum(isinstance(c, tuple) and c[0] == "step" for c in env.calls)
        env.calls.append(("step", i))
        if env.history is not None:
            env.history.append(entry("alloc", MIB * (i + 1), len(env.history)))
        if i == env.oom_at:
            if env.history is not None:
                env.history.append(entry("oom", 0, len(env.history)))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return 1.0

    monkeypatch.setattr(workloads, "train_step", step)
    return env


@pytest.mark.parametrize("allocator", ["torch", "torch-expandable", "vramledger"])
def test_a_traced_trial_records_from_the_start_and_marks_each_step(trial_env, tmp_path,
                                                                   allocator):
    path = tmp_path / "t.pickle.gz"
    r = trial_env.trial.child("gpt2m", allocator, 24.0, 4, 1000, str(path))
    calls = [c for c in trial_env.calls if c != "install"]
    assert calls[0] == ("record", "all", None, trial_env.trial.MAX_TRACE_ENTRIES)
    assert calls[1] == "build"
    # A snapshot after each step (outside its timed span); under torch one more, whose trace
    # holds the sixth step's `snapshot` entry.
    extra = [] if allocator == "vramledger" else ["snapshot"]
    assert calls[2:] == [c for i in range(6) for c in (("step", i), "snapshot")] + extra
    assert r["fits"] and r["trace"] == "t.pickle.gz" and r["trace_entries"] == 12
    from vramledger._snapshot import load_snapshot
    rows = trace_steps.steps(load_snapshot(str(path))["device_traces"][0])
    assert [row["allocs"] for row in rows] == [1] * 6
    assert not any(row.get("unfinished") for row in rows)
    assert [row["largest_alloc"] for row in rows] == [MIB * (i + 1) for i in range(6)]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("allocator", ["torch", "vramledger"])
def test_a_traced_trial_that_runs_out_of_memory_keeps_its_last_step(trial_env, tmp_path,
                                                                    allocator):
    path = tmp_path / "t.pickle.gz"
    trial_env.oom_at = 2
    r = trial_env.trial.child("gpt2m", allocator, 24.0, 4, 1000, str(path))
    assert r["oom"] and len(r["step_s"]) == 2 and trial_env.calls[-1] == "snapshot"
    from vramledger._snapshot import load_snapshot
    rows = trace_steps.steps(load_snapshot(str(path))["device_traces"][0])
    # The step that ran out, with its oom entry (unfinished under torch: no snapshot closed it).
    assert len(rows) == 3 and rows[2]["ooms"] == 1 and rows[2]["allocs"] == 1
    assert bool(rows[2].get("unfinished")) == (allocator == "torch")


def test_an_untraced_trial_records_no_history(trial_env):
    r = trial_env.trial.child("gpt2m", "vramledger", 24.0, 4, 1000)
    assert r["fits"] and "trace" not in r
    assert not any(c == "snapshot" or c[0] == "record" for c in trial_env.calls)


# ---- the traces phase ----

class TracingStandIn:
    """A trial that fits up to `limits[allocator]` and, given a trace path, writes a small
    snapshot there (unless `write` is False); records each call."""

    def __init__(self, limits, trial_s=10.0, write=True, crash=False):
        self.limits, self.trial_s, self.write, self.crash = limits, trial_s, write, crash
        self.now, self.calls = 0.0, []

    def clock(self):
        return self.now

    def __call__(self, workload, allocator, cap, dim, size, timeout_s, trace=None):
        self.calls.append((allocator, size, trace and pathlib.Path(trace).name))
        self.now += self.trial_s
        fits = size <= self.limits[allocator]
        if trace and self.write:
            with gzip.open(trace, "wb") as f:
                pickle.dump({"segments": [], "device_traces": [TRACE]}, f, protocol=4)
        if self.crash:  # a process that failed after writing its trace
            return {"fits": None, "error": "exit 139: "}
        return {"fits": fits, "oom": not fits, "error": None,
                "step_s": [0.5] * 6 if fits else [], "retries": 0, "device": "stand-in",
                "torch": "none"}


def searched(limits, dims=("seq",)):
    """Results whose searches found `limits` (trials at each limit and one step above)."""
    results = Results()
    for dim in dims:
        for a, n in limits.items():
            for size, fits in ((n, True), (n + 64, False)):
                results.add({"workload": "gpt2m", "allocator": a, "cap_gib": 24.0, "dim": dim,
                             "size": size, "fits": fits, "oom": not fits, "retries": 0,
                             "step_s": [0.5] * 6 if fits else [],
                             "median_step_s": 0.5 if fits else None})
    return results


LIMITS = {"torch": 1152, "torch-expandable": 1664, "vramledger": 1792}


def test_traces_are_taken_at_the_common_size_and_vramledgers_limit(tmp_path):
    results = searched(LIMITS)
    assert traces.sizes(results, "gpt2m", 24.0, "seq", 64) == [1152, 1792]
    stand_in = TracingStandIn(LIMITS)
    out = tmp_path / "traces"
    n = traces.record_traces([("gpt2m", 24.0, "seq")], ["vramledger", "torch-expandable"],
                             stand_in, results, runner.Budget(1e9, stand_in.clock), str(out),
                             log=lambda _: None)
    names = ["gpt2m-24gib-seq1152-torch-expandable.pickle.gz",
             "gpt2m-24gib-seq1152-vramledger.pickle.gz",
             "gpt2m-24gib-seq1792-torch-expandable.pickle.gz",
             "gpt2m-24gib-seq1792-vramledger.pickle.gz"]
    assert n == 4 and [c[2] for c in stand_in.calls] == names
    index = json.loads((out / "traces.json").read_text())
    assert sorted(index) == names
    assert index[names[1]]["fits"] and not index[names[2]]["fits"]  # expandable's limit is lower
    assert index[names[3]]["size"] == 1792 and index[names[3]]["allocator"] == "vramledger"
    assert sorted(p.name for p in out.iterdir()) == sorted(names + ["traces.json"])
    # The traced trials stay out of the results (their step times carry the recording's cost).
    assert all(r.get("trace") is None for r in results.records.values())
    # Taken again: nothing runs.
    stand_in.calls.clear()
    assert traces.record_traces([("gpt2m", 24.0, "seq")], ["vramledger", "torch-expandable"],
                                stand_in, results, runner.Budget(1e9, stand_in.clock), str(out),
                                log=lambda _: None) == 0
    assert stand_in.calls == []


def test_traces_stop_with_the_budget_and_retake_a_missing_file(tmp_path):
    results = searched(LIMITS)
    stand_in = TracingStandIn(LIMITS, trial_s=10.0)
    out = tmp_path / "traces"
    budget = runner.Budget(25.0, stand_in.clock, first_s=10.0)
    logs = []
    # 25 s at 10 s a trial: two of the four traces.
    assert traces.record_traces([("gpt2m", 24.0, "seq")], ["vramledger", "torch-expandable"],
                                stand_in, results, budget, str(out), log=logs.append) == 2
    assert logs[-1] == ("traces: the budget ended before "
                        "gpt2m-24gib-seq1792-torch-expandable.pickle.gz")
    # A trial that wrote no trace is recorded with an error and taken again next time.
    results = searched(LIMITS)
    broken = TracingStandIn(LIMITS, write=False)
    out2 = tmp_path / "broken"
    assert traces.record_traces([("gpt2m", 24.0, "seq")], ["vramledger"], broken, results,
                                runner.Budget(1e9, broken.clock), str(out2),
                                log=lambda _: None) == 0
    index = json.loads((out2 / "traces.json").read_text())
    assert all(r["error"] == "the trial wrote no trace" for r in index.values())
    fixed = TracingStandIn(LIMITS)
    assert traces.record_traces([("gpt2m", 24.0, "seq")], ["vramledger"], fixed, results,
                                runner.Budget(1e9, fixed.clock), str(out2),
                                log=lambda _: None) == 2
    assert all(r["error"] is None for r in json.loads((out2 / "traces.json").read_text()).values())
    # A trial that failed after writing its file is taken again too.
    out3 = tmp_path / "crashed"
    crashed = TracingStandIn(LIMITS, crash=True)
    traces.record_traces([("gpt2m", 24.0, "seq")], ["vramledger"], crashed, results,
                         runner.Budget(1e9, crashed.clock), str(out3), log=lambda _: None)
    assert len(list(out3.glob("*.pickle.gz"))) == 2
    again = TracingStandIn(LIMITS)
    traces.record_traces([("gpt2m", 24.0, "seq")], ["vramledger"], again, results,
                         runner.Budget(1e9, again.clock), str(out3), log=lambda _: None)
    assert len(again.calls) == 2


def test_a_row_without_a_measured_size_takes_no_trace(tmp_path):
    logs = []
    stand_in = TracingStandIn(LIMITS)
    assert traces.record_traces([("gpt2m", 24.0, "batch")], ["vramledger"], stand_in, Results(),
                                runner.Budget(1e9, stand_in.clock), str(tmp_path),
                                log=logs.append) == 0
    assert stand_in.calls == [] and "no size measured yet" in logs[0]


def test_command_line_traces_flags(tmp_path, capsys, monkeypatch):
    results_path = tmp_path / "r.json"
    results = searched(LIMITS)
    results.path = str(results_path)
    results.save()
    stand_in = TracingStandIn(LIMITS)
    from benchmarks.capacity import trial
    monkeypatch.setattr(trial, "run_trial", stand_in)
    out = tmp_path / "traces"
    assert capacity_main.main(["--workloads", "gpt2m", "--caps", "24", "--dims", "seq",
                               "--allocators", "vramledger", "--resume", str(results_path),
                               "--out", str(tmp_path / "o.json"), "--traces", str(out),
                               "--trace-allocators", "torch"]) == 0
    assert "took 2 trace(s)" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("*.pickle.gz")) == [
        "gpt2m-24gib-seq1152-torch.pickle.gz", "gpt2m-24gib-seq1792-torch.pickle.gz"]
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--table-only", "--trace-allocators", "cuda"])
    assert e.value.code == 2 and "unknown cuda" in capsys.readouterr().err
    ran = len(stand_in.calls)
    for bad, says in (("[1, 2]", "not an object of trace records"),
                      ('{"a.pickle.gz": 3}', "not an object of trace records"),
                      ("{", "traces.json")):
        (out / "traces.json").write_text(bad)
        with pytest.raises(SystemExit) as e:
            capacity_main.main(["--workloads", "gpt2m", "--caps", "24", "--dims", "seq",
                                "--out", str(tmp_path / "o2.json"), "--traces", str(out)])
        assert e.value.code == 2 and says in capsys.readouterr().err, bad
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--workloads", "gpt2m", "--caps", "24", "--dims", "seq",
                            "--out", str(tmp_path / "o3.json"), "--traces", str(not_a_folder)])
    assert e.value.code == 2 and "--traces" in capsys.readouterr().err
    assert len(stand_in.calls) == ran  # the bad folders stopped the run before any trial
