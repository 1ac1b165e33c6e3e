# Tests of snapshots: inspect / convert / diff on torch's own snapshots and ours, the
# pickle's opcodes, round trips, replay --snapshot, torch's _memory_viz reading our files, and
# the history's Python stacks and record modes on a simulated device (vramledger._core).
"""Snapshot files, the snapshot subcommands and the memory history, on a machine without a GPU."""

from __future__ import annotations

import gzip
import io
import json
import os
import pathlib
import pickle
import pickletools
import re
import subprocess
import sys

import pytest

from vramledger import _inspect, _snapshot

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "torch-2.11"
TORCH_SNAPSHOTS = [FIXTURES / "snapshot-native.pickle", FIXTURES / "snapshot-expandable.pickle",
                   ROOT / "traces" / "snapshot-gpt2m-native.pickle.gz"]
GPT2_TRACE = ROOT / "traces" / "trace-gpt2m-native.csv.gz"
MIB = 1 << 20
# docs/design/torch-facts.md §6.4: the opcodes pytorch.org/memory_viz's pickle decoder accepts.
VIEWER_OPCODES = {"PROTO", "FRAME", "MEMOIZE", "BINGET", "LONG_BINGET", "EMPTY_DICT",
                  "EMPTY_LIST", "MARK", "SETITEMS", "SETITEM", "APPEND", "APPENDS",
                  "SHORT_BINUNICODE", "BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1",
                  "BINFLOAT", "NEWTRUE", "NEWFALSE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
                  "EMPTY_TUPLE", "NONE", "DICT", "LIST", "BINPUT", "LONG_BINPUT", "STOP"}


def core():
    return pytest.importorskip("vramledger._core")


def run_cli(*args, cwd=None):
    env = dict(os.environ)
    env.pop("VRAMLEDGER_CONF", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run([sys.executable, "-m", "vramledger", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


def load_raw(path: pathlib.Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


class RefusingUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"class {module}.{name} in a snapshot")


@pytest.mark.parametrize("path", TORCH_SNAPSHOTS, ids=lambda p: p.name)
def test_inspect_totals_equal_the_sums_over_segments(path):
    snap = load_raw(path)
    proc = run_cli("inspect", path, "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["origin"] == "torch"
    for d in summary["devices"]:
        segs = [s for s in snap["segments"] if s["device"] == d["device"]]
        assert d["pools"]["all"]["reserved_bytes"] == sum(s["total_size"] for s in segs)
        assert d["pools"]["all"]["allocated_bytes"] == sum(s["allocated_size"] for s in segs)
        assert d["pools"]["all"]["active_bytes"] == sum(s["active_size"] for s in segs)
        assert d["fragmentation"]["reserved_bytes"] == d["pools"]["all"]["reserved_bytes"]
        assert d["segments"] == len(segs)
    text = run_cli("inspect", path)
    assert text.returncode == 0, text.stderr
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert re.search(rf"GPU reserved memory +{re.escape(_inspect.fmt_bytes(reserved))} ",
                     text.stdout), text.stdout


def test_inspect_groups_live_allocations_by_innermost_user_frame():
    summary = _inspect.summarize(_snapshot.load_snapshot(FIXTURES / "snapshot-native.pickle"), 3)
    top = summary["devices"][0]["top_allocations"]
    assert [(g["frame"], g["bytes"], g["count"]) for g in top] == [
        ("probe/probe_native.py:18 in <module>", 31457792, 1),
        ("probe/probe_native.py:23 in <module>", 5 * MIB, 1),
        ("probe/probe_native.py:17 in <module>", 3146240, 1)]
    frag = summary["devices"][0]["fragmentation"]
    assert frag["largest_free_block"] == 16776192
    assert frag["free_space_fragmentation"] == pytest.approx(1 - 16776192 / frag["free_bytes"])
    streams = {s["stream"]: s for s in summary["devices"][0]["holes_per_stream"]}
    assert set(streams) == {0, 542699392}
    assert streams[542699392]["holes"] == 2


def test_innermost_user_frame_skips_torch_and_the_standard_library():
    frames = [{"filename": "/v/lib/python3.12/site-packages/torch/nn/functional.py", "line": 1,
               "name": "cross_entropy"},
              {"filename": "/usr/lib/python3.12/contextlib.py", "line": 2, "name": "inner"},
              {"filename": "/v/lib/python3.12/site-packages/transformers/loss.py", "line": 40,
               "name": "loss"}]
    assert _inspect.innermost_user_frame(frames) == (frames[2]["filename"], 40, "loss")
    assert _inspect.innermost_user_frame(frames[:1])[2] == "cross_entropy"
    assert _inspect.innermost_user_frame([]) == _inspect.NO_STACK


@pytest.mark.parametrize("content, expected", [
    (None, "truncated or corrupt pickle"),
    (b"hello, not a snapshot\n", "unrecognised content"),
    (pickle.dumps([1, 2, 3], protocol=4), "segments[0] is not a dict"),
    (json.dumps({"device_traces": []}).encode(), "no 'segments' list"),
    (b"", "the file is empty"),
], ids=["truncated", "text", "list", "json-no-segments", "empty"])
def test_inspect_of_a_bad_file_names_it_and_what_was_expected(tmp_path, content, expected):
    path = tmp_path / "bad.pickle"
    if content is None:  # a torch snapshot cut in half
        content = (FIXTURES / "snapshot-native.pickle").read_bytes()[:2000]
    path.write_bytes(content)
    proc = run_cli("inspect", path)
    assert proc.returncode == 2
    assert str(path) in proc.stderr and expected in proc.stderr, proc.stderr
    assert "expected a memory snapshot" in proc.stderr


def test_inspect_refuses_pickled_classes(tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": pathlib.PurePosixPath("/")}, protocol=4))
    proc = run_cli("inspect", path)
    assert proc.returncode == 2 and "refusing to load" in proc.stderr, proc.stderr


def test_inspect_plot_and_self_contained_html(tmp_path):
    pytest.importorskip("matplotlib")
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    proc = run_cli("inspect", TORCH_SNAPSHOTS[2], "--top", "3", "--plot", png, "--html", page)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = page.read_text()
    assert "<svg" in html and "polyline" in html and "top live allocations" in html
    assert "<script" not in html
    assert [u for u in ("http://", "https://") for _ in range(html.count(u))] == ["http://"]
    assert "http://www.w3.org/2000/svg" in html  # the SVG namespace, not a fetch


def test_plot_of_a_snapshot_without_trace_says_so(tmp_path):
    snap = load_raw(FIXTURES / "snapshot-native.pickle")
    snap["device_traces"] = [[]]
    path = tmp_path / "notrace.pickle"
    _snapshot.write_snapshot(snap, str(path))
    proc = run_cli("inspect", path, "--plot", tmp_path / "x.png")
    assert proc.returncode == 2 and "no trace entries" in proc.stderr, proc.stderr


def assert_cli_error(proc, message):
    """Exit status 2 and one `vramledger: error:` holding `message`, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("vramledger: error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _set(path, value):
    """A mutation of the native fixture: sets the key at `path` (keys and indices) to `value`."""
    def apply(snap):
        target = snap
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return apply


@pytest.mark.parametrize("mutate, text, message", [
    (_set(("segments", 0, "total_size"), "x"), None,
     "segments[0]: 'total_size' must be a non-negative integer, got 'x'"),
    (_set(("segments", 0, "total_size"), "x"), ('"x"', "NaN"),
     "segments[0]: 'total_size' must be a non-negative integer, got nan"),
    (_set(("segments", 0, "total_size"), "x"), ('"x"', "1e400"),
     "segments[0]: 'total_size' must be a non-negative integer, got inf"),
    (_set(("segments", 0, "address"), -4096), None,
     "segments[0]: 'address' must be a non-negative integer, got -4096"),
    (_set(("segments", 0, "blocks", 1, "size"), "big"), None,
     "segments[0].blocks[1]: 'size' must be a non-negative integer, got 'big'"),
    (_set(("segments", 0, "blocks"), None), None, "segments[0]: 'blocks' must be a list, got None"),
    (_set(("segments", 0, "blocks", 0, "frames"), "abc"), None,
     "segments[0].blocks[0]: 'frames' must be a list, got 'abc'"),
    (_set(("segments", 0, "blocks", 0, "frames"), [5]), None,
     "segments[0].blocks[0].frames[0] must be a dict, got 5"),
    (_set(("segments", 0, "blocks", 0, "frames", 0, "line"), "x"), None,
     "segments[0].blocks[0].frames[0]: 'line' must be an integer, got 'x'"),
    (_set(("segments", 0, "device"), "gpu"), None,
     "segments[0]: 'device' must be a non-negative integer, got 'gpu'"),
    (_set(("device_traces", 0, 0, "size"), True), None,
     "device_traces[0][0]: 'size' must be a non-negative integer, got True"),
    (_set(("allocator_settings",), 5), None, "'allocator_settings' must be a dict, got 5"),
], ids=["size-str", "size-nan", "size-1e400", "address-negative", "block-size", "blocks-null",
        "frames-str", "frames-int", "frame-line", "device-str", "entry-size-bool", "settings"])
def test_inspect_diff_convert_refuse_mistyped_fields(tmp_path, mutate, text, message):
    snap = load_raw(FIXTURES / "snapshot-native.pickle")
    mutate(snap)
    encoded = json.dumps(snap)
    if text is not None:  # what json.dumps cannot write: NaN and 1e400 as JSON numbers
        encoded = encoded.replace(*text, 1)
    path = tmp_path / "bad.json"
    path.write_text(encoded)
    out = tmp_path / "out.pickle"
    good = FIXTURES / "snapshot-native.pickle"
    for args in (["inspect", path], ["inspect", path, "--json"], ["diff", good, path],
                 ["diff", path, good], ["convert", path, out]):
        assert_cli_error(run_cli(*args), f"{path}: {message}")
    assert not out.exists()


def test_inspect_plot_names_a_bad_path_and_follows_the_extension(tmp_path):
    snapshot = TORCH_SNAPSHOTS[2]
    jpg = tmp_path / "x.jpg"
    assert_cli_error(run_cli("inspect", snapshot, "--plot", jpg),
                     f"{jpg}: --plot writes .png, .svg, .pdf files")  # as replay --plot
    assert not jpg.exists()
    pytest.importorskip("matplotlib")
    missing = tmp_path / "no-such-dir" / "x.png"
    assert_cli_error(run_cli("inspect", snapshot, "--plot", missing),
                     f"--plot {missing}: no such directory: {missing.parent}")
    # --html too, before the report is printed (it was refused after it, exit 1).
    proc = run_cli("inspect", snapshot, "--html", missing.with_suffix(".html"))
    assert_cli_error(proc, f"--html {missing.with_suffix('.html')}: no such directory")
    assert proc.stdout == ""
    svg = tmp_path / "x.SVG"
    proc = run_cli("inspect", snapshot, "--plot", svg)
    assert proc.returncode == 0, proc.stderr
    assert svg.read_bytes().startswith(b"<?xml")


@pytest.mark.parametrize("device, message", [
    ("-1", "--device must be a device index (0 or more), got -1"),
    ("99", "--device 99: {path} has no segments or trace entries of device 99 (devices with "
           "either: 0)"),
])
def test_inspect_names_a_device_the_snapshot_lacks(device, message):
    path = TORCH_SNAPSHOTS[2]
    proc = run_cli("inspect", path, "--device", device)
    assert_cli_error(proc, message.format(path=path))
    assert "the snapshot is empty" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("flag", ["--html", "--plot"])
def test_inspect_refuses_stdout_as_its_file(tmp_path, flag):
    """`inspect --html -` would write a file named '-', where stdout is meant; refused as
    replay's --timeline - is."""
    proc = run_cli("inspect", TORCH_SNAPSHOTS[2], flag, "-", cwd=tmp_path)
    assert_cli_error(proc, f"{flag} -: the file is not written to stdout; give a file name")
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("path", TORCH_SNAPSHOTS, ids=lambda p: p.name)
def test_convert_pickle_json_pickle_round_trips_to_the_same_dict(tmp_path, path):
    original = load_raw(path)
    as_json, back = tmp_path / "s.json", tmp_path / "s.pickle"
    assert run_cli("convert", path, as_json).returncode == 0
    assert run_cli("convert", as_json, back).returncode == 0
    assert json.loads(as_json.read_text())["segments"][0]["segment_pool_id"] == [0, 0]
    with open(back, "rb") as f:
        assert RefusingUnpickler(f).load() == original
    raw = back.read_bytes()
    assert raw[:2] == b"\x80\x04"
    assert {op.name for op, _, _ in pickletools.genops(raw)} <= VIEWER_OPCODES


def test_convert_reads_suffixes_in_any_case(tmp_path):
    """OUT.JSON was written as a pickle and OUT.JSON.GZ as an uncompressed one (the suffix was
    matched case-sensitively): the format follows the suffix whatever its case, as replay's input does."""
    original = load_raw(TORCH_SNAPSHOTS[0])
    upper, upper_gz = tmp_path / "S.JSON", tmp_path / "S.Json.GZ"
    assert run_cli("convert", TORCH_SNAPSHOTS[0], upper).returncode == 0
    assert run_cli("convert", TORCH_SNAPSHOTS[0], upper_gz).returncode == 0
    assert json.loads(upper.read_text())["segments"][0]["segment_pool_id"] == [0, 0]
    assert json.loads(gzip.decompress(upper_gz.read_bytes())) == json.loads(upper.read_text())
    back = tmp_path / "S.PICKLE.GZ"
    assert run_cli("convert", upper_gz, back).returncode == 0
    assert pickle.loads(gzip.decompress(back.read_bytes())) == original


def test_write_snapshot_is_atomic_and_refuses_non_plain_values(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(b"old")
    with pytest.raises(TypeError, match="not a plain value"):
        _snapshot.write_snapshot({"segments": [], "x": object()}, str(path))
    assert path.read_bytes() == b"old"
    with pytest.raises(OSError):
        _snapshot.write_snapshot({"segments": []}, str(tmp_path / "missing" / "s.pickle"))
    _snapshot.write_snapshot({"segments": [], "device_traces": [[]]}, str(path))
    assert pickle.loads(path.read_bytes()) == {"segments": [], "device_traces": [[]]}
    _snapshot.write_snapshot({"segments": []}, str(tmp_path / "s.json.gz"))
    assert json.loads(gzip.decompress((tmp_path / "s.json.gz").read_bytes())) == {"segments": []}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json.gz", "s.pickle"]


# ---- Our snapshots (vramledger._core) ----

def allocate_in_model_code(sim, size, release_gil=False):
    return sim.malloc(size, release_gil=release_gil)  # the line the snapshot must name


@pytest.mark.parametrize("release_gil", [False, True], ids=["gil-held", "gil-released"])
def test_history_captures_the_python_frames_of_the_allocating_code(release_gil):
    sim = core().SimAllocator(8 << 30)
    sim.record_memory_history(enabled="all", context="all", stacks="python")
    ptr = allocate_in_model_code(sim, 3 * MIB, release_gil)
    snap = sim.snapshot()
    block = next(b for s in snap["segments"] for b in s["blocks"] if b["address"] == ptr)
    line = allocate_in_model_code.__code__.co_firstlineno + 1
    assert block["frames"][0] == {"name": "allocate_in_model_code", "filename": __file__,
                                  "line": line}
    assert block["frames"][1]["name"] == "test_history_captures_the_python_frames_of_the_" \
                                         "allocating_code"
    alloc = [e for e in snap["device_traces"][0] if e["action"] == "alloc"][0]
    assert alloc["frames"] == block["frames"] and alloc["addr"] == ptr
    summary = _inspect.summarize(_snapshot.normalize(snap), 1)
    assert summary["devices"][0]["top_allocations"][0]["frame"] == \
        f"{__file__}:{line} in allocate_in_model_code"


def test_threads_allocating_with_and_without_the_gil_share_interned_stacks():
    import threading

    sim = core().SimAllocator(64 << 30)
    sim.record_memory_history(max_entries=1000)
    errors = []

    def work(release_gil):
        try:
            for _ in range(300):
                sim.free(allocate_in_model_code(sim, 1 * MIB, release_gil))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i % 2 == 1,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    snap = sim.snapshot()
    assert len(snap["device_traces"][0]) == 1000
    frames = {json.dumps(e["frames"]) for e in snap["device_traces"][0] if e["action"] == "alloc"}
    assert len(frames) == 1  # one call site, one stack, whichever thread and GIL state
    assert snap["vramledger"]["history"]["stacks_interned"] <= 3  # alloc, free, (segment)


def test_ring_of_four_and_record_modes():
    sim = core().SimAllocator(8 << 30)
    sim.record_memory_history("all", "all", "python", max_entries=4)
    sim.malloc(1 * MIB)
    two = sim.malloc(2 * MIB)
    sim.malloc(4 * MIB)
    sim.free(two)
    sim.malloc(8 * MIB)
    trace = sim.snapshot()["device_traces"][0]  # the snapshot entry takes one of the 4 slots
    assert [(e["action"], e["size"]) for e in trace] == [
        ("free_requested", 2 * MIB), ("free_completed", 2 * MIB), ("alloc", 8 * MIB),
        ("snapshot", 13 * MIB)]  # active bytes: 1 + 4 + 8 MiB
    sim.record_memory_history("state", "all", "python")
    p = sim.malloc(MIB)
    snap = sim.snapshot()
    assert snap["device_traces"] == [[]]
    assert any(b["frames"] for s in snap["segments"] for b in s["blocks"] if b["address"] == p)
    sim.record_memory_history(None)
    q = sim.malloc(MIB)
    snap = sim.snapshot()
    assert snap["device_traces"] == [[]]
    assert all(not b["frames"] for s in snap["segments"] for b in s["blocks"] if b["address"] == q)
    with pytest.raises(ValueError, match="context='sometimes'"):
        sim.record_memory_history("all", "sometimes")


def test_states_are_torchs_and_oom_entry_has_device_free():
    sim = core().SimAllocator(64 * MIB)
    sim.record_memory_history()
    a = sim.malloc(2 * MIB)
    sim.malloc(5 * MIB)
    with pytest.raises(MemoryError, match="CUDA out of memory"):
        sim.malloc(100 * MIB)
    pending = sim.malloc(3 * MIB)  # after the OOM, which synchronises every pending event
    sim.record_stream(pending, 0x77)
    sim.free(pending)
    sim.free(a)
    snap = sim.snapshot()
    states = {b["state"] for s in snap["segments"] for b in s["blocks"]}
    assert states == {"active_allocated", "active_pending_free", "inactive"}
    oom = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
    assert len(oom) == 1 and "addr" not in oom[0] and oom[0]["device_free"] == 64 * MIB - 20 * MIB
    stats = snap["vramledger"]["devices"][0]["stats"]
    assert sum(s["total_size"] for s in snap["segments"]) == stats["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in snap["segments"]) == \
        stats["allocated_bytes.all.current"]


def test_json_and_pickle_of_our_snapshot_are_the_same_dict(tmp_path):
    sim = core().SimAllocator(8 << 30)
    sim.record_memory_history()
    for size in (1000, 3 * MIB, 30 * MIB):
        sim.malloc(size)
    sim.dump_snapshot_json(str(tmp_path / "s.json"))
    from_json = _snapshot.load_snapshot(tmp_path / "s.json")
    _snapshot.write_snapshot(from_json, str(tmp_path / "s.pickle"))
    from_pickle = _snapshot.load_snapshot(tmp_path / "s.pickle")
    assert from_pickle == from_json
    assert from_pickle["segments"][0]["segment_pool_id"] == (0, 0)
    raw = (tmp_path / "s.pickle").read_bytes()
    assert {op.name for op, _, _ in pickletools.genops(raw)} <= VIEWER_OPCODES
    with open(tmp_path / "s.pickle", "rb") as f:
        RefusingUnpickler(f).load()


def test_diff_lists_the_stack_that_grew(tmp_path):
    sim = core().SimAllocator(8 << 30)
    sim.record_memory_history()
    allocate_in_model_code(sim, 4 * MIB)
    sim.dump_snapshot_json(str(tmp_path / "a.json"))
    for _ in range(3):
        allocate_in_model_code(sim, 6 * MIB)
    sim.dump_snapshot_json(str(tmp_path / "b.json"))
    proc = run_cli("diff", tmp_path / "a.json", tmp_path / "b.json", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bytes_grew"] == 18 * MIB
    top = result["grew"][0]
    assert top["delta_bytes"] == 18 * MIB and top["count_after"] == 3
    assert top["frame"].endswith("in allocate_in_model_code")
    text = run_cli("diff", tmp_path / "a.json", tmp_path / "b.json").stdout
    assert "+18.00 MiB" in text


@pytest.mark.parametrize("at", ["peak", "end"])
def test_replay_snapshot_holds_the_replays_reserved_bytes(tmp_path, at):
    core()
    out = tmp_path / "r.pickle"
    proc = run_cli("replay", GPT2_TRACE, "--json", "--snapshot", out, "--at", at)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    snap = _snapshot.load_snapshot(out)
    reserved = sum(s["total_size"] for s in snap["segments"])
    expected = result["peak_reserved_bytes"] if at == "peak" else result["final_reserved_bytes"]
    assert reserved == expected == result["snapshot"]["reserved_bytes"]
    assert snap["vramledger"]["replay"]["at"] == at
    trace = snap["device_traces"][0]
    assert trace[-1]["action"] == "snapshot"
    assert trace[0]["action"] == "segment_alloc" and trace[1]["action"] == "alloc"
    raw = out.read_bytes()
    assert {op.name for op, _, _ in pickletools.genops(raw)} <= VIEWER_OPCODES


def test_replay_snapshot_follows_the_gpu_lag(tmp_path):
    """replay --gpu-lag-us --snapshot: the snapshot's replay has the same lagging GPU as the
    replay it accompanies (it used to replay without it), so its segments hold that replay's
    peak, which differs from the peak without lag on the checkpointed trace."""
    core()
    trace = GPT2_TRACE.parent / "trace-llama1b-ckpt-native.csv.gz"
    conf = ("--conf", "expandable_segments:True")
    out = tmp_path / "lag.pickle"
    proc = run_cli("replay", trace, *conf, "--gpu-lag-us", "20000", "--json", "--snapshot", out)
    assert proc.returncode == 0, proc.stderr
    late = json.loads(proc.stdout)
    reserved = sum(s["total_size"] for s in _snapshot.load_snapshot(out)["segments"])
    assert reserved == late["peak_reserved_bytes"] == late["snapshot"]["reserved_bytes"]
    now = json.loads(run_cli("replay", trace, *conf, "--json").stdout)
    assert now["peak_reserved_bytes"] != late["peak_reserved_bytes"]


# ---- torch's own viewers read our files ----

def test_torch_memory_viz_reads_our_pickle(tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz")
    core()
    out = tmp_path / "peak.pickle"
    assert run_cli("replay", GPT2_TRACE, "--snapshot", out).returncode == 0
    with open(out, "rb") as f:
        data = RefusingUnpickler(f).load()
    stats = mv.segsum(data)
    reserved = sum(s["total_size"] for s in data["segments"])
    allocated = sum(b["requested_size"] for s in data["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated")
    assert f"total_reserved: {mv.Bytes(reserved)}" in stats
    assert f"total_allocated: {mv.Bytes(allocated)}" in stats
    summary = _inspect.summarize(data)["devices"][0]
    assert summary["pools"]["all"]["reserved_bytes"] == reserved
    assert summary["pools"]["all"]["requested_bytes"] >= allocated
    assert "entries" in mv.trace(data)
    assert "add_local_files" in mv.trace_plot(data)
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"total_reserved: {mv.Bytes(reserved)}" in proc.stdout
    html = tmp_path / "plot.html"
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(out),
                           "-o", str(html)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert html.stat().st_size > 1000


# ---- The plugin's ctypes path on a simulated device (needs the built plugin and torch) ----

PLUGIN_SCRIPT = r"""
import ctypes, json, pickle, sys
import vramledger
from vramledger import _plugin, _snapshot
lib = _plugin.load()
assert lib.vramledger_testing_use_sim_backend(1, 1 << 30) == 0
gil = ctypes.PyDLL(_plugin.loaded_path())  # same library; calls keep the GIL (torch's case)
gil.vramledger_malloc.restype = ctypes.c_void_p
gil.vramledger_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
vramledger.record_memory_history("all", "all", "python", max_entries=100)
lib.vramledger_malloc.restype = ctypes.c_void_p  # CDLL: the GIL is released, as torch does
lib.vramledger_malloc.argtypes = gil.vramledger_malloc.argtypes
def model_forward(dll):
    return dll.vramledger_malloc(3 << 20, 0, None)
p, q = model_forward(gil), model_forward(lib)
snap = vramledger.snapshot()
frames = [b["frames"][0] for s in snap["segments"] for b in s["blocks"] if b["address"] in (p, q)]
print(json.dumps({"frames": frames, "actions": [e["action"] for e in snap["device_traces"][0]]}))
vramledger.dump_snapshot(sys.argv[1] + "/s.pickle")
vramledger.dump_snapshot(sys.argv[1] + "/s.json")
assert pickle.load(open(sys.argv[1] + "/s.pickle", "rb"))["segments"]
try:
    vramledger.record_memory_history("all", "sometimes")
except ValueError as e:
    print("ValueError", e)
"""


def test_plugin_records_python_frames_and_dumps(tmp_path):
    from vramledger import _plugin

    try:
        _plugin.plugin_path()
        import torch  # noqa: F401
    except (RuntimeError, ImportError):
        pytest.skip("the torch plugin library or torch is not available")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    result = json.loads(lines[0])
    frame = {"name": "model_forward", "filename": "<string>", "line": 14}
    assert result["frames"] == [frame, frame]  # with the GIL held, and released (torch's case)
    # Expandable segments (a served process's default) map their first pages.
    assert result["actions"] == ["segment_map", "alloc", "alloc", "snapshot"]
    assert lines[1].startswith("ValueError vramledger: record_memory_history: context='sometimes'")
    assert json.loads((tmp_path / "s.json").read_text())["device_traces"][0][-1]["action"] == \
        "snapshot"


def test_inspect_header_writes_no_limit_and_no_context_in_words():
    """A replay's snapshot keeps every entry (max_entries INT64_MAX) and records no stacks: the
    header says so instead of printing the raw values."""
    from vramledger import _inspect
    text = _inspect.format_summary(
        {"origin": "vramledger", "devices": [],
         "history": {"enabled": True, "context": None, "stacks": "python",
                     "max_entries": (1 << 63) - 1}}, "s.pickle")
    assert "context=None (no stacks recorded) max_entries=all" in text, text
    assert "9223372036854775807" not in text and "stacks=" not in text
    older = _inspect.format_summary(  # older vramledger snapshots wrote the word "None"
        {"origin": "vramledger", "devices": [],
         "history": {"enabled": "all", "context": "None", "stacks": "python", "max_entries": 1}},
        "s.pickle")
    assert "context=None (no stacks recorded) max_entries=1" in older, older


def test_inspect_marks_the_stats_torch_does_not_keep_with_expandable_segments(tmp_path):
    """An expandable replay's snapshot showed 'GPU reserved segments' 23 now and 0 at peak, which
    reads as a bug: torch keeps segment and inactive_split at 0 there, so the peak is n/a."""
    core()
    snap = tmp_path / "e.pickle"
    proc = run_cli("replay", GPT2_TRACE, "--conf", "expandable_segments:True", "--snapshot", snap)
    assert proc.returncode == 0, proc.stderr
    text = run_cli("inspect", snap).stdout
    rows = {line[:30].strip(): line[30:].split() for line in text.splitlines()
            if line.startswith("  ") and not line.startswith("    ")}
    assert rows["GPU reserved segments"][-2:] == ["n/a", "*"], text
    assert rows["Non-releasable memory"][-2:] == ["n/a", "*"], text
    assert int(rows["GPU reserved segments"][0].replace(",", "")) > 0
    assert rows["Allocated memory"][-1] not in ("*", "n/a")  # kept: a figure
    assert "* expandable segments: torch keeps no segment or inactive_split stats" in text
    page = tmp_path / "e.html"  # the HTML report's totals say the same
    assert run_cli("inspect", snap, "--html", page).returncode == 0
    html = page.read_text()
    assert "n/a *" in html and "torch keeps no segment or inactive_split stats" in html
    plain = tmp_path / "p.pickle"
    assert run_cli("replay", GPT2_TRACE, "--snapshot", plain).returncode == 0
    assert "n/a *" not in run_cli("inspect", plain).stdout


def test_inspect_keeps_the_plain_segments_peak_beside_expandable_ones():
    """Beside contiguous (plain) segments the stat's peak is real: shown, marked, not n/a."""
    d = {"expandable": "some", "stats": {"segment.all.peak": 3}}
    assert _inspect.peak_text(d, "segment", "all", str) == "3 *"
    assert _inspect.peak_text(d, "allocated_bytes", "all", str) == "n/a"  # not in the stats
    assert "Peak the plain (contiguous) segments only" in _inspect.expandable_note(d)
    assert _inspect.peak_text({"expandable": "all", "stats": {"segment.all.peak": 0}},
                              "segment", "all", str) == "n/a *"
    assert _inspect.peak_text({"expandable": "none", "stats": {"segment.all.peak": 0}},
                              "segment", "all", str) == "0"
    assert _inspect.expandable_note({"expandable": "none"}) is None
