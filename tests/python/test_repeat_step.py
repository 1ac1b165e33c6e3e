"""benchmarks/repeat_step.py (the repeated-step trace) and the step detection it shares with
benchmarks/expandable_policy_sweep.py, on a made-up trace with two steps and a persistent block."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import expandable_policy_sweep as sweep  # noqa: E402
import repeat_step  # noqa: E402

GIB = 1 << 30
HEADER = "action,addr,size,stream,time_us"


def _trace() -> list[str]:
    rows = [
        ("alloc", 100, 64 << 20, 0),  # weights: live to the end
        # step 1: 2 GiB of activations, freed
        ("alloc", 200, 2 * GIB, 0), ("free_requested", 200, 2 * GIB, 0),
        ("free_completed", 200, 2 * GIB, 0),
        # step 2: 2 GiB of activations and a 1 MiB block left live, and the weights' old copy
        ("segment_alloc", 300, 4 * GIB, 0), ("alloc", 300, 2 * GIB, 0), ("alloc", 400, 1 << 20, 0),
        ("free_requested", 300, 2 * GIB, 0), ("free_completed", 300, 2 * GIB, 0),
    ]
    return [HEADER] + [f"{a},{p},{s},{st},{1000 * i}" for i, (a, p, s, st) in enumerate(rows)]


def test_step_ends_fall_where_live_bytes_return_to_their_final_level():
    rows = [line.split(",") for line in _trace()[1:]]
    assert sweep.step_ends(rows) == [4, 9]
    assert sweep.step_ends([]) == []


def test_the_step_repeats_at_fresh_addresses_and_each_run_starts_from_the_same_live_set():
    out = repeat_step.repeat_step_trace(_trace(), step=2, repeats=2)
    assert out[:10] == _trace()  # steps 1-2 as recorded
    assert out[10] == "snapshot,0,0,0,8000"
    rows = [line.split(",") for line in out[11:]]
    shift1, shift2 = 1 << 44, 2 << 44
    first = [(a, int(p) - shift1, int(s)) for a, p, s, _, _ in rows[:6]]
    assert first == [("alloc", 300, 2 * GIB), ("alloc", 400, 1 << 20),
                     ("free_requested", 300, 2 * GIB), ("free_completed", 300, 2 * GIB),
                     ("free_requested", 400, 1 << 20), ("free_completed", 400, 1 << 20)]
    assert rows[6][0] == "snapshot"
    # The last run leaves its 1 MiB block live, as the recorded step did; no segment rows repeat.
    assert [(a, int(p) - shift2) for a, p, _, _, _ in rows[7:11]] == [
        ("alloc", 300), ("alloc", 400), ("free_requested", 300), ("free_completed", 300)]
    assert rows[11][0] == "snapshot" and len(rows) == 12
    times = [int(r[4]) for r in rows]
    assert times == sorted(times) and times[0] > 8000  # each run after the one before


def test_bad_requests_name_what_was_wrong():
    with pytest.raises(ValueError, match="holds 2 steps; step 3 asked for"):
        repeat_step.repeat_step_trace(_trace(), step=3, repeats=1)
    with pytest.raises(ValueError, match="must be at least 1"):
        repeat_step.repeat_step_trace(_trace(), step=1, repeats=0)
    with pytest.raises(ValueError, match="line 3: not action,addr,size,stream,time_us"):
        repeat_step.repeat_step_trace([HEADER, "alloc,1,2,0,5", "alloc,x,2,0,6"], 1, 1)


def test_policy_sweep_names_the_bundled_traces_and_refuses_others():
    assert sweep.trace_file("llama1b-ckpt") == "trace-llama1b-ckpt-native.csv.gz"
    with pytest.raises(SystemExit) as e:
        sweep.trace_file("gpt3")
    assert "no bundled trace 'gpt3'" in str(e.value)
    assert "gpt2m, gpt2m-prefetch, llama1b, llama1b-ckpt" in str(e.value)


def test_policy_sweep_passes_the_gpu_lag_to_the_replay(monkeypatch):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return type("Done", (), {"stdout": "{}"})()

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    sweep.replay("bin", "t.csv", "expandable_segments:True", gpu_lag_us=5000)
    sweep.replay("bin", "t.csv", "expandable_segments:True")
    assert seen == [["bin", "t.csv", "--json", "--conf", "expandable_segments:True",
                     "--gpu-lag-us", "5000"],
                    ["bin", "t.csv", "--json", "--conf", "expandable_segments:True"]]
