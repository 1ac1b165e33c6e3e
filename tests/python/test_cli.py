# Tests of `vramledger replay` (vramledger.cli) run as `python -m vramledger`: the bundled trace
# and snapshot, options from the environment and --conf, and errors that name file and line.
"""End-to-end tests of the vramledger command line (needs the package with its _core module)."""

import gzip
import importlib.util
import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACES = ROOT / "traces"
GPT2_TRACE = TRACES / "trace-gpt2m-native.csv.gz"
GPT2_SNAPSHOT = TRACES / "snapshot-gpt2m-native.pickle.gz"
REQUIRED_KEYS = {"events", "peak_allocated_bytes", "peak_requested_bytes", "peak_reserved_bytes",
                 "utilization", "recorded_peak_reserved_bytes", "recorded_utilization",
                 "driver_calls", "modeled_driver_us"}
MIB = 1 << 20
# A max_split_size scenario: 300 MiB, free, 250 MiB, 300 MiB.
MAX_SPLIT_TRACE = ("action,addr,size,stream,time_us\n"
                   f"alloc,1073741824,{300 * MIB},0,1\n"
                   f"free_completed,1073741824,{300 * MIB},0,2\n"
                   f"alloc,2147483648,{250 * MIB},0,3\n"
                   f"alloc,3221225472,{300 * MIB},0,4\n")


def run_cli(*args, env_conf=None, cwd=None):
    env = dict(os.environ)
    env.pop("VRAMLEDGER_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the replay warns that it does not read it
    if env_conf is not None:
        env["VRAMLEDGER_CONF"] = env_conf
    return subprocess.run([sys.executable, "-m", "vramledger", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def assert_cli_error(proc, message):
    """Exit status 2 and one `vramledger: error:` holding `message`, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("vramledger: error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def replay_json(*args, env_conf=None):
    proc = run_cli("replay", *args, "--json", env_conf=env_conf)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_bundled_trace_json_has_the_keys_and_torch_figures():
    result, stderr = replay_json(GPT2_TRACE)
    assert REQUIRED_KEYS <= result.keys()
    assert result["peak_requested_bytes"] == 27_105_552_624
    assert result["trace_peak_requested_bytes"] == 27_105_552_624
    assert result["recorded_peak_reserved_bytes"] == 39_151_730_688
    assert result["events"] == 34_621 + 33_740
    assert result["unknown_frees"] == 0
    assert result["driver_calls"]["cudaMalloc"] == result["device_allocs"] > 0
    assert result["modeled_driver_us"] > 0
    assert 0 < result["utilization"] <= 1
    assert result["recorded_utilization"] == pytest.approx(27_105_552_624 / 39_151_730_688)
    assert stderr == ""


def test_bundled_trace_table_shows_both_columns():
    proc = run_cli("replay", GPT2_TRACE)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # The recorded column names the policy that wrote the trace (torch native: cudaMalloc
    # segments), whatever conf the replay ran with.
    assert "vramledger (replay)" in out and "recorded (trace, native)" in out
    assert "the cache the program still held when the trace ended" in out
    for row in ("alloc+free events", "peak allocated", "peak requested", "peak reserved",
                "utilization"):
        assert f"\n  {row} " in out
    assert "27,105,552,624 B (25.24 GiB)" in out
    assert "39,151,730,688 B (36.46 GiB)" in out
    assert "cudaMalloc" in out and "total" in out


def test_snapshot_pickle_replays_its_device_trace():
    result, stderr = replay_json(GPT2_SNAPSHOT)
    assert REQUIRED_KEYS <= result.keys()
    # The last 4,000 entries: 1,023 allocs, 1,489 free_completed of which 466 free blocks
    # allocated before the window (reported as unknown frees).
    assert result["trace_events"] == 4000
    assert result["allocs"] == 1023
    assert result["unknown_frees"] == 466
    assert result["events"] == 2046
    assert result["device"] == 0
    assert result["snapshot_reserved_bytes"] == 39_151_730_688
    assert "466 free_completed events" in stderr
    assert "snapshot-gpt2m-native.pickle.gz:device_traces[0]:1 " in stderr


def test_gzip_csv_and_options_from_env_and_conf(tmp_path):
    trace = tmp_path / "split.csv.gz"
    with gzip.open(trace, "wt") as f:
        f.write(MAX_SPLIT_TRACE)
    assert replay_json(trace)[0]["peak_reserved_bytes"] == 600 * MIB
    from_env, _ = replay_json(trace, env_conf="max_split_size_mb:200")
    assert from_env["peak_reserved_bytes"] == 550 * MIB
    # --conf wins over VRAMLEDGER_CONF: 300 MiB blocks may be split again below 400 MiB.
    both, _ = replay_json(trace, "--conf", "max_split_size_mb:400",
                          env_conf="max_split_size_mb:200")
    assert both["peak_reserved_bytes"] == 600 * MIB


def test_malformed_trace_names_file_and_line(tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("action,addr,size,stream,time_us\nalloc,1,2,0,3\nallocate,1,2,0,3\n")
    proc = run_cli("replay", trace)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (f"vramledger: error: {trace}:3: unknown action 'allocate' "
                           "(allocate,1,2,0,3)\n")


def test_non_numeric_size_names_file_and_line(tmp_path):
    trace = tmp_path / "bad.csv.gz"
    with gzip.open(trace, "wt") as f:
        f.write("action,addr,size,stream,time_us\nalloc,1,big,0,3\n")
    proc = run_cli("replay", trace, "--json")
    assert proc.returncode == 2
    assert proc.stderr == (f"vramledger: error: {trace}:2: size is not an unsigned integer: "
                           "'big' (alloc,1,big,0,3)\n")


def test_unknown_free_is_reported(tmp_path):
    trace = tmp_path / "unknown.csv"
    trace.write_text("action,addr,size,stream,time_us\nalloc,4096,1000,0,1\n"
                     "free_completed,8192,1000,0,2\n")
    result, stderr = replay_json(trace)
    assert result["unknown_frees"] == 1
    assert result["unknown_frees_listed"] == [{"line": 3, "addr": 8192}]
    assert stderr.startswith("vramledger: warning: 1 free_completed events")
    assert f"{trace}:3 (addr 0x2000)" in stderr


def test_simulated_oom_names_the_line(tmp_path):
    trace = tmp_path / "big.csv"
    trace.write_text(f"action,addr,size,stream,time_us\nalloc,4096,{2 << 30},0,1\n")
    proc = run_cli("replay", trace, "--capacity-gib", "1")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"vramledger: error: {trace}:2: alloc of {2 << 30} bytes")


@pytest.mark.parametrize("args, message", [
    (["replay", "no-such-trace.csv"], "no-such-trace.csv: cannot open"),
    (["replay", str(GPT2_TRACE), "--conf", "foo:1"], "unknown option 'foo'"),
    (["replay", str(GPT2_TRACE), "--capacity-gib", "-3"],
     "--capacity-gib must be a number of GiB from 0.001953125 (2 MiB) to 1e6"),
    (["replay", str(GPT2_TRACE), "--capacity-gib", "1e-12"],  # was a card of 0 bytes
     "--capacity-gib must be a number of GiB from 0.001953125 (2 MiB) to 1e6"),
    (["replay"], "the following arguments are required: TRACE"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_errors_exit_2_with_one_line(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("vramledger: error: ")
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_pickle_that_is_not_a_snapshot_is_refused(tmp_path):
    not_snapshot = tmp_path / "other.pickle"
    not_snapshot.write_bytes(pickle.dumps({"segments": []}))
    proc = run_cli("replay", not_snapshot)
    assert proc.returncode == 2
    assert f"{not_snapshot}: not a torch memory snapshot" in proc.stderr

    with_class = tmp_path / "class.pickle"
    with_class.write_bytes(pickle.dumps({"device_traces": [], "p": pathlib.PurePosixPath("/")}))
    proc = run_cli("replay", with_class)
    assert proc.returncode == 2
    assert "refusing to load pathlib.PurePosixPath" in proc.stderr

    proc = run_cli("replay", GPT2_SNAPSHOT, "--device", "3")
    assert proc.returncode == 2
    assert "no device 3 in device_traces" in proc.stderr

    proc = run_cli("replay", GPT2_SNAPSHOT, "--device", "-1")
    assert proc.returncode == 2
    assert "--device must be a device index (0 or more), got -1" in proc.stderr

    proc = run_cli("replay", GPT2_TRACE, "--device", "1")  # a CSV has one device's events
    assert proc.returncode == 2
    assert "--device selects a device only in a torch snapshot" in proc.stderr


def test_main_returns_the_status_in_process(capsys, monkeypatch):
    monkeypatch.delenv("VRAMLEDGER_CONF", raising=False)
    from vramledger import cli
    assert cli.main(["replay", str(GPT2_TRACE), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recorded_peak_reserved_bytes"] == 39_151_730_688
    assert cli.main([]) == 2
    assert "vramledger: error:" in capsys.readouterr().err


# ---- timeline, plot, fragmentation, steps, driver time ----

TIMELINE_HEADER = ("event,line,time_us,allocated_bytes,reserved_bytes,wasted_bytes,"
                   "requested_bytes,recorded_reserved_bytes,driver_us")
FRAGMENTATION_KEYS = {"utilization", "wasted_bytes", "wasted_bytes_at_peak", "largest_free_block",
                      "free_space_fragmentation", "holes", "mapped_free_pages",
                      "other_stream_cached_bytes"}


def read_timeline(path):
    import csv
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) if k == "driver_us" else int(v) for k, v in r.items()} for r in rows]


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_gpt2_expandable_timeline_plot_and_json(tmp_path):
    csv_path, png_path = tmp_path / "gpt2.csv", tmp_path / "gpt2.png"
    plot = ["--plot", png_path] if HAVE_MATPLOTLIB else []
    result, stderr = replay_json(GPT2_TRACE, "--conf", "expandable_segments:True",
                                 "--timeline", csv_path, *plot)
    assert stderr == ""
    # The utilization target (0.99) on the GPT-2 trace; the replay still serves every request as torch did.
    assert result["utilization"] >= 0.99
    assert result["peak_requested_bytes"] == 27_105_552_624
    assert result["page_moves"] > 0
    assert FRAGMENTATION_KEYS <= result["fragmentation_at_peak"].keys()
    assert FRAGMENTATION_KEYS <= result["fragmentation_at_end"].keys()
    assert result["utilization_at_each_step"] == []  # the bundled traces mark no steps
    assert result["trace_span_us"] == 6_719_931
    assert result["driver_time_pct_of_span"] == pytest.approx(
        100 * result["modeled_driver_us"] / 6_719_931)
    steady = result["steady_state"]
    assert steady["start_event"] == 102_529 // 4 + 1
    assert 0 < steady["modeled_driver_us"] < result["modeled_driver_us"]
    assert result["timeline"] == str(csv_path)
    assert "timeline_csv" not in result

    assert csv_path.read_text().splitlines()[0] == TIMELINE_HEADER
    rows = read_timeline(csv_path)
    assert result["sample_every"] == 52 and len(rows) == result["timeline_points"]
    assert 1972 <= len(rows) <= 2200
    last = rows[-1]
    assert last["event"] == 102_529
    assert last["allocated_bytes"] == result["final_allocated_bytes"]
    assert last["reserved_bytes"] == result["final_reserved_bytes"]
    assert last["wasted_bytes"] == last["reserved_bytes"] - last["allocated_bytes"]
    assert last["driver_us"] == pytest.approx(result["modeled_driver_us"], abs=1e-3)
    assert max(r["reserved_bytes"] for r in rows) == result["peak_reserved_bytes"]
    assert max(r["recorded_reserved_bytes"] for r in rows) == 39_151_730_688
    peak = result["fragmentation_at_peak"]
    at_peak = next(r for r in rows if r["event"] == peak["event"])
    assert at_peak["wasted_bytes"] == peak["wasted_bytes"]

    if HAVE_MATPLOTLIB:  # the plot is optional: matplotlib is not a dependency
        assert result["plot"] == str(png_path)
        png = png_path.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_timeline_sample_every_and_table_lines(tmp_path):
    csv_path = tmp_path / "t.csv"
    trace = tmp_path / "split.csv"
    trace.write_text(MAX_SPLIT_TRACE)
    proc = run_cli("replay", trace, "--timeline", csv_path, "--sample-every", "1")
    assert proc.returncode == 0, proc.stderr
    rows = read_timeline(csv_path)
    assert [r["event"] for r in rows] == [1, 2, 3, 4]
    assert [r["allocated_bytes"] for r in rows] == [300 * MIB, 0, 250 * MIB, 550 * MIB]
    assert [r["reserved_bytes"] for r in rows] == [300 * MIB] * 3 + [600 * MIB]
    assert [r["time_us"] for r in rows] == [1, 2, 3, 4]
    for label in ("trace span", "driver time (modelled)", "steady state", "page moves",
                  "fragmentation", "largest free block", "mapped free pages"):
        assert f"\n  {label} " in proc.stdout, label
    assert f"\n  wrote the timeline CSV to {csv_path}\n" in proc.stdout


def test_snapshot_rows_mark_steps(tmp_path):
    trace = tmp_path / "steps.csv"
    trace.write_text("action,addr,size,stream,time_us\n"
                     "alloc,1000000000,3000000,0,10\n"
                     "free_completed,1000000000,3000000,0,20\n"
                     "snapshot,0,0,0,30\n"
                     "alloc,2000000000,1000,0,40\n"
                     "snapshot,0,1000,0,50\n")
    result, _ = replay_json(trace)
    steps = result["utilization_at_each_step"]
    assert [s["end_line"] for s in steps] == [4, 6]
    assert [s["peak_allocated_bytes"] for s in steps] == [3_000_320, 1024]
    assert [s["peak_reserved_bytes"] for s in steps] == [20 * MIB, 22 * MIB]
    assert steps[0]["utilization"] == pytest.approx(3_000_320 / (20 * MIB))
    assert [s["driver_calls"] for s in steps] == [1, 1]
    assert result["step_marks"] == 2
    assert [s["memory_calls"] for s in steps] == [1, 1]  # one cudaMalloc each
    proc = run_cli("replay", trace)
    assert "\n  step     end line    events     peak allocated      peak reserved utilization" \
        "    calls mem calls    driver (us)" in proc.stdout
    assert "  mem calls: the calls that map, unmap, create or free device memory" in proc.stdout
    assert "\n  num_alloc_retries 0 " in proc.stdout
    assert "\n  num_ooms          0 (a replay stops at one)" in proc.stdout
    assert "\n  2               6         1              1,024         23,068,672      0.0000" \
        in proc.stdout


def test_snapshot_pickle_timeline(tmp_path):
    csv_path = tmp_path / "snap.csv"
    result, _ = replay_json(GPT2_SNAPSHOT, "--timeline", csv_path)
    rows = read_timeline(csv_path)
    assert rows[-1]["event"] == 4000
    assert rows[-1]["reserved_bytes"] == result["final_reserved_bytes"]


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="needs matplotlib")
@pytest.mark.parametrize("name, magic", [("t.svg", b"<?xml"), ("T.PDF", b"%PDF-")])
def test_plot_format_follows_the_name(tmp_path, name, magic):
    trace = tmp_path / "split.csv"
    trace.write_text(MAX_SPLIT_TRACE)
    proc = run_cli("replay", trace, "--plot", tmp_path / name)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / name).read_bytes().startswith(magic)


@pytest.mark.parametrize("args, message", [
    (["--sample-every", "0"], "--sample-every must be a positive number of events"),
    (["--gpu-lag-us", "-1"], "--gpu-lag-us must be a non-negative number of microseconds"),
    (["--timeline", "/no/such/dir/t.csv"], "--timeline /no/such/dir/t.csv: no such directory"),
    pytest.param(["--plot", "/no/such/dir/t.png"], "--plot /no/such/dir/t.png: no such directory",
                 marks=pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="needs matplotlib")),
    (["--plot", "t.jpeg"], "t.jpeg: --plot writes .png, .svg, .pdf files"),
    (["--plot", "timeline"], "timeline: --plot writes .png, .svg, .pdf files"),
])
def test_timeline_errors(tmp_path, args, message):
    trace = tmp_path / "split.csv"
    trace.write_text(MAX_SPLIT_TRACE)
    proc = run_cli("replay", trace, *args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("vramledger: error: ")
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_gpu_lag_keeps_the_checkpointed_trace_within_one_percent():
    """--gpu-lag-us: fences complete 20 ms of trace time late; the allocator queries them (it
    never needs to with a GPU that keeps up), takes handles back onto old mappings, and the
    checkpointed trace stays within 1.01 (docs/design/page-recycling.md, "Recycling")."""
    trace = TRACES / "trace-llama1b-ckpt-native.csv.gz"
    now, _ = replay_json(trace, "--conf", "expandable_segments:True")
    late, _ = replay_json(trace, "--conf", "expandable_segments:True", "--gpu-lag-us", "20000")
    assert now["driver_calls"]["cudaEventQuery"] < late["driver_calls"]["cudaEventQuery"]
    assert late["peak_reserved_bytes"] <= 1.01 * late["peak_allocated_bytes"]
    assert late["reused_old_mappings"] > 0
    assert late["page_moves"] >= late["reused_old_mappings"]


def _run_with_fake_shim(tmp_path, *args):
    """`vramledger run ARGS` with VRAMLEDGER_PRELOAD naming an empty file: the environment and
    the errors are checked, not the shim (the loader ignores an empty preload, saying so)."""
    fake = tmp_path / "libvramledger_preload.so"
    fake.write_bytes(b"")
    env = dict(os.environ, VRAMLEDGER_PRELOAD=str(fake), VRAMLEDGER_CONF="max_dumps:3")
    return subprocess.run([sys.executable, "-m", "vramledger", "run", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=60), fake


def test_run_sets_the_environment_and_names_a_missing_command(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text('{"limit": "40GiB"}\n')
    proc, fake = _run_with_fake_shim(tmp_path, "--conf", "expandable_segments:True", "--plan",
                                     plan, "--", "sh", "-c",
                                     'echo "$VRAMLEDGER_CONF"; echo "$LD_PRELOAD"')
    assert proc.returncode == 0, proc.stderr
    conf, preload = proc.stdout.splitlines()
    assert conf == f"max_dumps:3,expandable_segments:True,plan:{plan}"
    assert preload.split()[0] == str(fake)
    proc, _ = _run_with_fake_shim(tmp_path, "--", "no_such_cmd_xyz")
    assert proc.returncode != 0
    assert "vramledger: error: run: no_such_cmd_xyz: command not found on PATH" in proc.stderr
    proc, _ = _run_with_fake_shim(tmp_path, "--")
    assert proc.returncode != 0 and "give the command after --" in proc.stderr


def test_run_blames_a_missing_or_bad_plan_on_the_flag(tmp_path):
    """--plan is checked before the command runs and blamed on --plan, not on VRAMLEDGER_CONF
    (where `run` passes it to the shim; blaming that names a setting the user never wrote)."""
    marker = tmp_path / "ran"
    bad = tmp_path / "bad.json"
    bad.write_text('{"limit": "40GiB",\n "limit": "50GiB"}\n')
    for plan, needle in ((tmp_path / "missing.json", "does not exist"),
                         (tmp_path, "is a directory"),
                         (bad, "bad.json:2: field 'limit': given twice")):
        proc, _ = _run_with_fake_shim(tmp_path, "--plan", plan, "--", "touch", marker)
        assert proc.returncode == 2, proc.stderr
        assert "vramledger: error: run: --plan: " in proc.stderr and needle in proc.stderr, \
            proc.stderr
        assert "Traceback" not in proc.stderr and "VRAMLEDGER_CONF" not in proc.stderr
        assert not marker.exists()
        # The same plan given as a --conf option is blamed on --conf, where the user wrote it
        # (the shim, reading VRAMLEDGER_CONF, would name the variable).
        proc, _ = _run_with_fake_shim(tmp_path, "--conf", f"plan:{plan}", "--", "touch", marker)
        assert proc.returncode == 2, proc.stderr
        assert "vramledger: error: run: --conf: option 'plan': " in proc.stderr, proc.stderr
        assert needle in proc.stderr and "VRAMLEDGER_CONF" not in proc.stderr, proc.stderr
        assert not marker.exists()


def test_run_names_where_a_bad_option_came_from(tmp_path):
    """A bad key in --conf is blamed on --conf, one in the environment on VRAMLEDGER_CONF,
    before the command runs: the user must be told which of the two to fix."""
    marker = tmp_path / "ran"
    proc, _ = _run_with_fake_shim(tmp_path, "--conf", "bogus:1", "--", "touch", marker)
    assert proc.returncode != 0
    assert "vramledger: error: run: --conf: " in proc.stderr and "bogus" in proc.stderr, proc.stderr
    assert not marker.exists()
    fake = tmp_path / "libvramledger_preload.so"
    env = dict(os.environ, VRAMLEDGER_PRELOAD=str(fake), VRAMLEDGER_CONF="recycle_slack:lots")
    proc = subprocess.run([sys.executable, "-m", "vramledger", "run", "--", "touch", str(marker)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    assert "vramledger: error: run: VRAMLEDGER_CONF: " in proc.stderr and "recycle_slack" in proc.stderr
    assert not marker.exists()


def test_empty_and_short_traces_are_replayed_with_a_warning(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("action,addr,size,stream,time_us\n")
    proc = run_cli("replay", empty)
    assert proc.returncode == 0, proc.stderr
    assert f"warning: {empty} holds no alloc or free event: nothing was replayed" in proc.stderr
    short = tmp_path / "short.csv"
    short.write_text("action,addr,size,stream,time_us\n"
                     "alloc,1000,1048576,0,10\nfree_completed,1000,1048576,0,20\n")
    proc = run_cli("replay", short)
    assert proc.returncode == 0, proc.stderr
    assert f"warning: {short} spans only 10 us of trace time" in proc.stderr
    backwards = tmp_path / "backwards.csv"
    backwards.write_text("action,addr,size,stream,time_us\n"
                         "alloc,1,1048576,0,100\nalloc,2097152,1048576,0,50\n"
                         "free_completed,1,1048576,0,40\nfree_completed,2097152,1048576,0,60\n")
    proc = run_cli("replay", backwards, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["time_reversals"], result["first_time_reversal_line"],
            result["first_time_reversal_us"]) == (2, 3, 50)
    assert (f"warning: 2 events are earlier (time_us) than the event before them, the first at "
            f"{backwards}:3 (50 us earlier): the trace is not in time order") in proc.stderr
    assert "spans only" not in proc.stderr  # the span is -40 us: the time-order warning says why
    assert result["peak_requested_bytes"] == 2 * 1048576  # the memory figures stand
    bad = tmp_path / "missing-column.csv"
    bad.write_text("action,addr,size,time_us\nalloc,1,2,3\n")
    proc = run_cli("replay", bad)
    assert proc.returncode == 2
    assert "expected the header 'action,addr,size,stream,time_us'; missing stream" in proc.stderr


# ---- bad input: flags beyond the binding's 64-bit types, snapshot entries, ignored options ----

INT64_MAX = (1 << 63) - 1


@pytest.mark.parametrize("args, message", [
    (["--gpu-lag-us", str(1 << 63)], "--gpu-lag-us must be a non-negative number of "
                                     f"microseconds, at most {INT64_MAX}, got {1 << 63}"),
    (["--gpu-lag-us", "99999999999999999999"], "got 99999999999999999999"),
    (["--sample-every", "99999999999999999999"],  # without --timeline too
     f"--sample-every must be a positive number of events, at most {INT64_MAX}, "
     "got 99999999999999999999"),
    (["--snapshot", "s.json", "--max-entries", "99999999999999999999"],
     f"--max-entries must be >= 1 and at most {INT64_MAX}, got 99999999999999999999"),
    (["--timeline", "tl.csv", "--snapshot", "s.json", "--max-entries", "0"],
     "--max-entries must be >= 1"),
    (["--timeline", "-"], "--timeline -: the timeline is not written to stdout"),
    (["--snapshot", "-"], "--snapshot -: the snapshot is not written to stdout"),
])
def test_replay_flags_out_of_range_are_refused_before_the_replay(tmp_path, args, message):
    trace = tmp_path / "split.csv"
    trace.write_text(MAX_SPLIT_TRACE)
    proc = run_cli("replay", trace, *args, cwd=tmp_path)
    assert_cli_error(proc, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split.csv"]  # nothing written


SNAPSHOT_ENTRY = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1}


@pytest.mark.parametrize("traces, message", [
    ([[dict(SNAPSHOT_ENTRY, size=-5)]], "entry 1: 'size' must be an integer from 0 to 2**64 - 1, "
                                        "got -5"),
    ([[dict(SNAPSHOT_ENTRY, addr=-1)]], "entry 1: 'addr' must be an integer from 0 to 2**64 - 1"),
    ([[SNAPSHOT_ENTRY, dict(SNAPSHOT_ENTRY, stream=-1)]], "entry 2: 'stream' must be an integer "
                                                         "from 0 to 2**64 - 1, got -1"),
    ([[dict(SNAPSHOT_ENTRY, size=1 << 70)]], f"'size' must be an integer from 0 to 2**64 - 1, "
                                             f"got {1 << 70}"),
    ([[dict(SNAPSHOT_ENTRY, size=True)]], "'size' must be an integer from 0 to 2**64 - 1, got True"),
    ([[dict(SNAPSHOT_ENTRY, time_us=1 << 62)]],
     "'time_us' must be an integer strictly between -2**62"),
    ([[dict(SNAPSHOT_ENTRY, time_us="now")]],
     "'time_us' must be an integer strictly between -2**62"),
    ([[{"action": "oom", "size": 5}]], "entry 1: an 'oom' entry without 'device_free'"),
    ([[{"size": 5}]], "entry 1: no 'action'"),
    ([[5]], "device_traces[0] entry 1: must be a dict, got 5"),
    ([5], "device_traces[0] must be a list of trace entries (dicts), got 5"),
])
def test_snapshot_pickle_entries_are_checked_against_the_bindings_ranges(tmp_path, traces,
                                                                         message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps({"device_traces": traces, "segments": []}))
    proc = run_cli("replay", path)
    assert_cli_error(proc, f"{path}: device_traces[0]")
    assert message in proc.stderr
    assert_cli_error(run_cli("replay", path, "--snapshot", tmp_path / "s.json"), message)


@pytest.mark.parametrize("segments, message", [
    (5, "'segments' must be a list, got 5"),
    ([5], "segments[0] must be a dict, got 5"),
    ([{"device": 0, "total_size": "x"}], "segments[0]: 'total_size' must be a non-negative "
                                         "integer, got 'x'"),
    ([{"device": "gpu"}], "segments[0]: 'device' must be a non-negative integer, got 'gpu'"),
])
def test_snapshot_pickle_segments_are_checked(tmp_path, segments, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[SNAPSHOT_ENTRY]], "segments": segments}))
    assert_cli_error(run_cli("replay", path), f"{path}: {message}")


def test_replay_warns_that_it_ignores_the_process_settings(tmp_path):
    """Process settings other than the plan take effect in the plugin or the shim only; the plan
    is enforced on the simulated device (tests/python/test_replay_follow.py), so a plan file
    that does not exist is an error, not a warning."""
    trace = tmp_path / "split.csv"
    trace.write_text(MAX_SPLIT_TRACE)
    proc = run_cli("replay", trace, "--conf", "step_log:/proc/x")
    assert proc.returncode == 0, proc.stderr
    assert ("vramledger: warning: option step_log:/proc/x is ignored by the replay, which "
            "simulates the allocator only (directory for per-step peak logs"
            in proc.stderr)
    assert "LD_PRELOAD shim" in proc.stderr
    proc = run_cli("replay", trace, env_conf="step_log:/from/env")  # VRAMLEDGER_CONF too
    assert proc.returncode == 0, proc.stderr
    assert "option step_log:/from/env is ignored by the replay" in proc.stderr
    assert "ignored by the replay" not in run_cli("replay", trace).stderr
    # Every process setting of the option table is named, the shim's too.
    proc = run_cli("replay", trace, "--conf", "preload_quiet:True")
    assert proc.returncode == 0, proc.stderr
    assert "option preload_quiet:True is ignored by the replay" in proc.stderr
    assert_cli_error(run_cli("replay", trace, env_conf="plan:/from/env.json"),
                     "/from/env.json: cannot read the plan file")


def test_replay_warns_of_flags_and_settings_it_does_not_use(tmp_path):
    """dump_dir, --at / --max-entries without --snapshot and PYTORCH_CUDA_ALLOC_CONF were
    ignored without a word."""
    trace = tmp_path / "split.csv"
    trace.write_text(MAX_SPLIT_TRACE)
    proc = run_cli("replay", trace, "--conf", "dump_dir:/x,max_dumps:2", "--at", "end",
                   "--max-entries", "10")
    assert proc.returncode == 0, proc.stderr
    assert ("option dump_dir:/x is ignored by the replay, which simulates the allocator only "
            "(directory for OOM forensics)" in proc.stderr)
    assert "option max_dumps:2 is ignored by the replay" in proc.stderr
    assert "--at and --max-entries apply to --snapshot, not given: ignored" in proc.stderr
    proc = run_cli("replay", trace, "--at", "end", "--snapshot", tmp_path / "s.pickle")
    assert proc.returncode == 0 and "--at" not in proc.stderr, proc.stderr
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    env.pop("VRAMLEDGER_CONF", None)
    proc = subprocess.run([sys.executable, "-m", "vramledger", "replay", str(trace)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is not read by the replay"
            in proc.stderr)
    assert "is not read" not in run_cli("replay", trace).stderr


def test_replay_out_of_memory_names_the_flag_to_try():
    proc = run_cli("replay", GPT2_TRACE, "--capacity-gib", "20")
    assert_cli_error(proc, "VRAMLEDGER_CONF=expandable_segments:True to avoid fragmentation. "
                           "(Here: --conf expandable_segments:True.)")


def test_replay_of_an_expandable_recording_suggests_expandable_segments():
    """A trace torch recorded with expandable segments, replayed with torch's defaults, compares
    unlike things: the warning says so and how to compare like with like."""
    trace = ROOT / "traces" / "trace-gpt2m-prefetch-expandable.csv.gz"
    proc = run_cli("replay", trace, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["recorded_segment_maps"] > 0
    assert "recorded with torch's expandable segments" in proc.stderr, proc.stderr
    assert "--conf expandable_segments:True" in proc.stderr
    proc = run_cli("replay", trace, "--json", "--conf", "expandable_segments:True")
    assert proc.returncode == 0 and "recorded with torch's expandable" not in proc.stderr
    native = run_cli("replay", ROOT / "traces" / "trace-gpt2m-native.csv.gz", "--json")
    assert json.loads(native.stdout)["recorded_segment_maps"] == 0
    assert "expandable segments" not in native.stderr


def test_replay_table_names_the_policy_that_recorded_the_trace(tmp_path):
    """The recorded column's heading follows the trace's segment events, not the replay's conf;
    a trace without segment events names none."""
    expandable = TRACES / "trace-gpt2m-prefetch-expandable.csv.gz"
    bare = tmp_path / "no-segments.csv"
    bare.write_text(MAX_SPLIT_TRACE)
    for trace, conf, heading in ((expandable, "expandable_segments:True", "(trace, expandable)"),
                                 (expandable, "expandable_segments:False", "(trace, expandable)"),
                                 (GPT2_TRACE, "expandable_segments:True", "(trace, native)"),
                                 (bare, "expandable_segments:True", "(trace)")):
        proc = run_cli("replay", trace, "--conf", conf)
        assert proc.returncode == 0, proc.stderr
        header = next(line for line in proc.stdout.splitlines() if "vramledger (replay)" in line)
        assert header.split() == ["vramledger", "(replay)", "recorded", *heading.split()]
