# Tests of `vramledger replay` following the program's releases (empty_cache(): runs of
# segment_free in the trace) and enforcing a plan (--conf plan:FILE) on the simulated device,
# run as `python -m vramledger` on traces and snapshots a simulated device records here.
"""The replay's releases and plan, end to end (needs the package with its _core module)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

MIB = 1 << 20
GIB = 1 << 30


def core():
    return pytest.importorskip("vramledger._core")


def run_cli(*args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("VRAMLEDGER_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    return subprocess.run([sys.executable, "-m", "vramledger", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def allocate_in_model_code(sim, size, stream):
    return sim.malloc(size, stream)  # the frame a refusal's stack must name


def record_phases(phases=4, empty_cache=True, streams=10):
    """A program on `streams` streams in phases under torch's policy (a simulated device with
    expandable segments off) with the history on: in each phase every stream allocates four
    blocks whose sizes grow from phase to phase, frees two, allocates two more, and at the end
    frees all of them; empty_cache() between phases. Returns (snapshot, torch's peak reserved
    from the trace's segment events)."""
    sim = core().SimAllocator(140 * GIB)
    sim.record_memory_history(enabled="all", context="all", stacks="python")
    for phase in range(phases):
        live = []
        for stream in range(1, streams + 1):
            blocks = [allocate_in_model_code(sim, (96 + 16 * phase + 8 * k) * MIB + 4096 * stream,
                                             stream) for k in range(4)]
            sim.free(blocks[0])
            sim.free(blocks[1])
            live += blocks[2:] + [sim.malloc((80 + 16 * phase) * MIB, stream),
                                  sim.malloc(3 * MIB, stream)]
        for ptr in live:
            sim.free(ptr)
        if empty_cache:
            sim.empty_cache()
    snap = sim.snapshot()
    reserved = peak = 0
    for e in snap["device_traces"][0]:
        if e["action"] in ("segment_alloc", "segment_map"):
            reserved += e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
        peak = max(peak, reserved)
    return snap, peak


def write_pickle(tmp_path, snap, name="snap.pickle"):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snap))
    return path


def replay_json(*args, status=0):
    proc = run_cli("replay", *args, "--json")
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_multi_stream_empty_cache_phases_reproduce_torchs_reserved(tmp_path):
    snap, torch_peak = record_phases()
    path = write_pickle(tmp_path, snap)
    followed, _ = replay_json(path)
    assert followed["recorded_peak_reserved_bytes"] == torch_peak
    assert abs(followed["peak_reserved_bytes"] / torch_peak - 1) <= 0.01
    releases = followed["releases"]
    assert releases["runs"] == releases["applied"] == 4
    assert releases["followed"] and releases["replay_released_bytes"] > 0

    ignored, _ = replay_json(path, "--ignore-releases")
    assert ignored["releases"]["applied"] == 0 and not ignored["releases"]["followed"]
    # Each phase's segments stay cached on their streams, too small for the next phase's
    # blocks: the four phases' segments add up (2.1 times torch's peak here).
    assert ignored["peak_reserved_bytes"] > 2 * torch_peak

    table = run_cli("replay", path)
    assert table.returncode == 0, table.stderr
    assert "program's releases: 4 in the trace (4 empty_cache(), 0 out-of-memory retries;" \
        in table.stdout
    assert "applied 4 (the replay's cache emptied there" in table.stdout
    table = run_cli("replay", path, "--ignore-releases")
    assert "not applied (--ignore-releases): the replay kept its cache" in table.stdout


def test_a_trace_without_releases_is_replayed_as_before(tmp_path):
    snap, torch_peak = record_phases(phases=2, empty_cache=False)
    path = write_pickle(tmp_path, snap)
    followed, _ = replay_json(path)
    ignored, _ = replay_json(path, "--ignore-releases")
    assert followed["releases"]["runs"] == 0
    assert followed["peak_reserved_bytes"] == ignored["peak_reserved_bytes"] == torch_peak
    assert "program's releases" not in run_cli("replay", path).stdout


def plan_file(tmp_path, limit="1GiB", name="plan.json"):
    path = tmp_path / name
    path.write_text('{\n  "vramledger_plan": 1,\n  "comment": "replay test",\n'
                    f'  "limit": "{limit}"\n}}\n')  # the limit on line 4
    return path


def record_blocks(count, size=100 * MIB):
    """A snapshot of `count` blocks of `size` allocated on stream 1 with the Python history on,
    then freed: under torch's policy each is a segment of its own, and none is cached while
    they are live, so a plan's limit refuses exactly the blocks past it."""
    sim = core().SimAllocator(140 * GIB)
    sim.record_memory_history(enabled="all", context="all", stacks="python")
    blocks = [allocate_in_model_code(sim, size, 1) for _ in range(count)]
    for ptr in blocks:
        sim.free(ptr)
    return sim.snapshot()


def alloc_lines(snap):
    return [i for i, e in enumerate(snap["device_traces"][0], 1) if e["action"] == "alloc"]


def test_a_refusal_names_trace_line_plan_line_breakdown_and_stack(tmp_path):
    snap = record_blocks(12)
    path = write_pickle(tmp_path, snap)
    plan = plan_file(tmp_path)
    proc = run_cli("replay", path, "--conf", f"plan:{plan}")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    source = f"{path}:device_traces[0]"
    assert f"plan {plan} (device 0): cap on reserved 1,073,741,824 B (1.00 GiB); refusals: 1 " \
           "(the replay stopped at the first)" in out
    # Ten 100 MiB segments fit under 1 GiB; the eleventh block would make a segment past it.
    line = alloc_lines(snap)[10]
    assert f"refusal 1 at {source}:{line} (trace event {line}): alloc," in out
    assert f"vramledger plan violation: {plan}:4: limit: reserved memory would grow to " \
           "1.07 GiB" in out
    assert "live bytes by category (current / plan):" in out
    assert "untagged" in out and "1000.00 MiB / -" in out
    assert "stack (innermost first), as the snapshot recorded it for this allocation:" in out
    assert f"{__file__}:" in out and "in allocate_in_model_code" in out
    assert (f"vramledger: the plan {plan} refused 1 allocation(s), the first at {source}:{line} "
            "(limit, plan line 4)") in proc.stderr

    result, _ = replay_json(path, "--conf", f"plan:{plan}", status=1)
    refusal = result["plan"]["listed"][0]
    assert (refusal["line"], refusal["plan_line"], refusal["rule"]) == (line, 4, "limit")
    assert refusal["stack"][0]["name"] == "allocate_in_model_code"
    assert result["allocs"] == 10  # the replay stopped at the refused one


def test_keep_going_counts_every_refusal(tmp_path):
    snap = record_blocks(25)
    path = write_pickle(tmp_path, snap)
    plan = plan_file(tmp_path)
    result, _ = replay_json(path, "--conf", f"plan:{plan}", "--plan-keep-going", status=1)
    figures = result["plan"]
    assert not figures["stopped"] and figures["keep_going"]
    assert figures["refusals"] == 15
    assert [r["line"] for r in figures["listed"]] == alloc_lines(snap)[10:20]
    assert result["peak_reserved_bytes"] == 1000 * MIB
    assert result["unknown_frees"] == 0  # the refused blocks' frees are expected
    proc = run_cli("replay", path, "--conf", f"plan:{plan}", "--plan-keep-going")
    assert proc.returncode == 1
    assert "refusals: 15 (each refused allocation skipped, the replay went on)" in proc.stdout
    assert "(5 more refusals not listed)" in proc.stdout


def test_a_trace_csv_refusal_says_it_has_no_stack(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("action,addr,size,stream,time_us\n"
                     f"alloc,4096,{600 * MIB},0,1\n"
                     f"alloc,{8 * GIB},{600 * MIB},0,2\n")
    plan = plan_file(tmp_path)
    proc = run_cli("replay", trace, "--conf", f"plan:{plan}")
    assert proc.returncode == 1, proc.stderr
    assert f"refusal 1 at {trace}:3 (trace event 2): alloc,{8 * GIB},{600 * MIB},0,2" in proc.stdout
    assert "stack: none (a trace CSV records no stacks" in proc.stdout
    # A plan that holds: exit 0, the plan's line says so.
    roomy = plan_file(tmp_path, limit="4GiB", name="roomy.json")
    proc = run_cli("replay", trace, "--conf", f"plan:{roomy}")
    assert proc.returncode == 0, proc.stderr
    assert "refusals: 0; warn_at warnings: 0" in proc.stdout
    assert "ignored by the replay" not in proc.stderr


@pytest.mark.parametrize("text,needle", [
    (None, "cannot read the plan file"),
    ('{\n  "limit": "40 parsecs"\n}\n', ":2: field 'limit'"),
    ('{\n  "limit": "40GiB",\n  "limit": "30GiB"\n}\n', ":3:"),
    ('{"limit": "400GiB"}\n', "exceeds the card's total memory"),
])
def test_a_bad_plan_file_is_a_clear_error(tmp_path, text, needle):
    trace = tmp_path / "t.csv"
    trace.write_text(f"action,addr,size,stream,time_us\nalloc,4096,{MIB},0,1\n")
    plan = tmp_path / "plan.json"
    if text is not None:
        plan.write_text(text)
    proc = run_cli("replay", trace, "--conf", f"plan:{plan}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("vramledger: error: "), proc.stderr
    assert str(plan) in proc.stderr and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_keep_going_without_a_plan_is_named_as_ignored(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(f"action,addr,size,stream,time_us\nalloc,4096,{MIB},0,1\n")
    proc = run_cli("replay", trace, "--plan-keep-going")
    assert proc.returncode == 0, proc.stderr
    assert "--plan-keep-going applies to a plan (--conf plan:FILE), none given: ignored" \
        in proc.stderr
