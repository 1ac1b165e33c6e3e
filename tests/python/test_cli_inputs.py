"""Bad inputs to the CLI and the Python API that used to end in a traceback, a wrong file or a
wrong figure: each gives a clear error or the right output."""

import gzip
import json
import os
import pickle

import pytest

from test_cli import GPT2_SNAPSHOT, GPT2_TRACE, assert_cli_error, run_cli

TRACE_HEAD = "action,addr,size,stream,time_us\n"


def test_a_path_or_conf_that_is_not_utf8_is_an_error(tmp_path):
    bad = os.path.join(tmp_path, os.fsdecode(b"\xff.csv"))
    with open(bad, "w") as f:
        f.write(TRACE_HEAD + "alloc,4096,100,0,1\n")
    assert_cli_error(run_cli("replay", bad), "TRACE is not valid UTF-8 at character")
    assert_cli_error(run_cli("replay", GPT2_TRACE, "--conf", os.fsdecode(b"\xff")),
                     "--conf is not valid UTF-8")
    assert_cli_error(run_cli("run", "--conf", os.fsdecode(b"\xff"), "--", "true"),
                     "run: --conf: not valid UTF-8")


@pytest.mark.parametrize("payload", [b"K\x01K\x02a.", b"K\x01K\x02K\x03s.", b"}]K\x01s."])
def test_a_malformed_pickle_is_an_error_in_replay(tmp_path, payload):
    path = tmp_path / "p.pickle"
    path.write_bytes(payload)
    assert_cli_error(run_cli("replay", path), "cannot read the snapshot pickle")


def test_json_nested_too_deeply_is_an_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    for args in (("inspect", deep), ("diff", deep, deep), ("convert", deep, tmp_path / "x.pickle")):
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("vramledger: error: "), proc.stderr


def test_a_dollar_in_the_trace_name_is_not_mathtext(tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "tr$\\foo$.csv"
    trace.write_text(TRACE_HEAD + "alloc,4096,1048576,0,1\nfree_completed,4096,1048576,0,2\n")
    plot = tmp_path / "p.png"
    proc = run_cli("replay", trace, "--plot", plot)
    assert proc.returncode == 0, proc.stderr
    assert plot.stat().st_size > 0


def test_inspect_html_leaves_no_temporary_file_behind(tmp_path):
    target = tmp_path / "dir"
    target.mkdir()
    proc = run_cli("inspect", GPT2_SNAPSHOT, "--html", target)
    assert proc.returncode == 2, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]


def test_a_snapshot_written_through_a_symlink_keeps_the_link(tmp_path):
    real = tmp_path / "real.pickle"
    link = tmp_path / "link.pickle"
    link.symlink_to(real)
    proc = run_cli("convert", GPT2_SNAPSHOT, link)
    assert proc.returncode == 0, proc.stderr
    assert link.is_symlink()
    with open(real, "rb") as f:
        assert "device_traces" in pickle.load(f)


def test_a_snapshot_written_to_dev_null_leaves_it_a_device():
    proc = run_cli("convert", GPT2_SNAPSHOT, os.devnull)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.isfile(os.devnull)  # still the character device, not replaced


def test_nul_bytes_in_names_are_refused():
    import vramledger

    with pytest.raises(ValueError, match="NUL"):
        vramledger.dump_snapshot("/tmp/a\0b.json")
    with pytest.raises(ValueError, match="NUL"):
        vramledger.record_memory_history(enabled="all\0x")
    with pytest.raises(ValueError, match="NUL"):
        with vramledger.tag("a\0b"):
            pass


def test_plan_numbers_too_large_and_a_lora_rank_past_the_model(tmp_path):
    proc = run_cli("plan", "--params", "1e308")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert_cli_error(run_cli("plan", "--layers", "2", "--hidden", "64", "--vocab", "100",
                             "--lora-rank", "256"),
                     "--lora-rank 256: the adapters would hold")


def test_report_fields_of_the_wrong_type_are_errors(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(
        json.dumps({"peak_allocated_bytes": 1, "peak_reserved_bytes": 1, "step": [1]}) + "\n")
    assert_cli_error(run_cli("report", tmp_path), "field 'step' must be a non-negative integer")


def test_times_at_the_int64_limits_are_refused(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE_HEAD + "alloc,4096,100,0,-9223372036854775808\n"
                     "alloc,8192,100,0,9223372036854775807\n")
    assert_cli_error(run_cli("replay", trace), "is out of range: it must lie strictly between "
                                               "-2**62 and 2**62")


def test_inspect_shows_a_nan_figure_as_na(tmp_path):
    with gzip.open(GPT2_SNAPSHOT, "rb") as f:
        snap = pickle.load(f)
    snap["vramledger"] = {"devices": [{"device": 0,
                                       "stats": {"allocated_bytes.all.peak": float("nan")}}]}
    path = tmp_path / "s.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    proc = run_cli("inspect", path)
    assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr, proc.stderr


def test_replay_reads_a_json_snapshot_as_its_pickle(tmp_path):
    as_json = tmp_path / "s.json.gz"
    assert run_cli("convert", GPT2_SNAPSHOT, as_json).returncode == 0
    from_pickle = run_cli("replay", GPT2_SNAPSHOT, "--json")
    from_json = run_cli("replay", as_json, "--json")
    assert from_pickle.returncode == 0 and from_json.returncode == 0, from_json.stderr
    a, b = json.loads(from_pickle.stdout), json.loads(from_json.stdout)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "events", "unknown_frees"):
        assert a[key] == b[key], key
    bad = tmp_path / "bad.json"
    bad.write_text("{\"segments\": 3}")
    assert_cli_error(run_cli("replay", bad), "no 'segments' list")


def test_flags_that_change_nothing_are_warned(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE_HEAD + "alloc,4096,1048576,0,1\nfree_completed,4096,1048576,0,2\n")
    proc = run_cli("replay", trace, "--sample-every", "10", "--gpu-lag-us", "5000")
    assert proc.returncode == 0, proc.stderr
    assert "--sample-every applies to --timeline and --plot" in proc.stderr
    assert "without expandable_segments:True it changes nothing" in proc.stderr
    proc = run_cli("replay", trace, "--gpu-lag-us", "5000", "--conf", "expandable_segments:True")
    assert "changes nothing" not in proc.stderr, proc.stderr


def test_a_config_boolean_given_as_a_string_is_an_error(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                  "num_attention_heads": 4, "vocab_size": 100,
                                  "intermediate_size": 128, "tie_word_embeddings": "false"}))
    assert_cli_error(run_cli("plan", "--config", config),
                     "'tie_word_embeddings' must be true or false, got 'false'")


def test_outputs_in_a_missing_directory_are_refused_before_the_replay(tmp_path):
    timeline = tmp_path / "t.csv"
    proc = run_cli("replay", GPT2_TRACE, "--timeline", timeline,
                   "--snapshot", tmp_path / "no" / "s.json")
    assert_cli_error(proc, "--snapshot")
    assert "no such directory" in proc.stderr
    assert not timeline.exists()  # nothing half-written
    assert_cli_error(run_cli("replay", GPT2_TRACE, "--timeline", tmp_path), "is a directory")


def test_conf_given_twice_applies_both(tmp_path):
    proc = run_cli("replay", GPT2_TRACE, "--json", "--conf", "expandable_segments:True",
                   "--conf", "expandable_page_mb:2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["conf"] == "expandable_segments:True,expandable_page_mb:2"


def test_a_json_snapshot_replays_with_its_own_snapshot(tmp_path):
    as_json = tmp_path / "s.json"
    assert run_cli("convert", GPT2_SNAPSHOT, as_json).returncode == 0
    out = tmp_path / "out.json"
    proc = run_cli("replay", as_json, "--snapshot", out)
    assert proc.returncode == 0, proc.stderr
    assert "device_traces" in json.loads(out.read_text())


def test_dump_snapshot_names_a_missing_directory_as_oserror(tmp_path):
    import vramledger

    for name in ("x.json", "x.pickle"):
        with pytest.raises(FileNotFoundError):
            vramledger.dump_snapshot(str(tmp_path / "no" / name))
    with pytest.raises(ValueError, match="give a file name"):
        vramledger.dump_snapshot("")


def test_a_corrupt_gzip_snapshot_is_an_error(tmp_path):
    data = gzip.compress(b"x" * 1000)
    for name in ("z.pickle.gz", "z.json.gz"):
        path = tmp_path / name
        path.write_bytes(data[:10] + b"\xff" * 20 + data[30:])
        for command in ("replay", "inspect"):
            proc = run_cli(command, path)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (name, proc.stderr)


def test_inspect_plot_and_html_with_awkward_names(tmp_path):
    pytest.importorskip("matplotlib")
    odd = tmp_path / "tr$\\foo$.pickle.gz"
    odd.write_bytes(GPT2_SNAPSHOT.read_bytes())
    proc = run_cli("inspect", odd, "--plot", tmp_path / "p.png")
    assert proc.returncode == 0, proc.stderr
    with gzip.open(GPT2_SNAPSHOT, "rb") as f:
        snap = pickle.load(f)
    for segment in snap["segments"]:
        for block in segment.get("blocks", []):
            for frame in block.get("frames", []):
                frame["filename"] = "\udcffx.py"  # a lone surrogate (a non-UTF-8 byte)
    surrogate = tmp_path / "s.pickle"
    with open(surrogate, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    import subprocess
    import sys

    # The table on stdout holds the byte as it came (surrogate-escaped): read it as bytes.
    proc = subprocess.run([sys.executable, "-m", "vramledger", "inspect", str(surrogate),
                           "--html", str(tmp_path / "h.html")], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "h.html").stat().st_size > 0


def test_a_dangling_link_into_a_missing_directory_is_refused_before_the_replay(tmp_path):
    link = tmp_path / "d.json"
    link.symlink_to(tmp_path / "nodir" / "missing.json")
    timeline = tmp_path / "tl.csv"
    assert_cli_error(run_cli("replay", GPT2_TRACE, "--timeline", timeline, "--snapshot", link),
                     "no such directory")
    assert not timeline.exists()
    assert_cli_error(run_cli("replay", GPT2_TRACE, "--timeline", str(tmp_path / "new") + "/"),
                     "is a directory")


def test_a_snapshot_action_that_is_not_a_name_is_an_error(tmp_path):
    snap = {"segments": [], "device_traces": [[{"action": "\udcff", "addr": 1, "size": 512,
                                                "stream": 0, "time_us": 1}]]}
    path = tmp_path / "a.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    assert_cli_error(run_cli("replay", path), "'action' must be a trace action name")


def test_a_snapshot_goes_through_a_pipe():
    import subprocess
    import sys

    proc = subprocess.run(f"{sys.executable} -m vramledger convert {GPT2_SNAPSHOT} /dev/stdout | wc -c",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) > 1000


def test_an_empty_output_name_is_an_error(tmp_path):
    """`--timeline ''` and the like were taken as no flag and wrote nothing; convert to '' said
    "No such file"."""
    for args, flag in ((("replay", GPT2_TRACE, "--timeline", ""), "--timeline"),
                       (("replay", GPT2_TRACE, "--plot", ""), "--plot"),
                       (("replay", GPT2_TRACE, "--snapshot", ""), "--snapshot"),
                       (("inspect", GPT2_SNAPSHOT, "--html", ""), "--html"),
                       (("inspect", GPT2_SNAPSHOT, "--plot", ""), "--plot"),
                       (("plan", "--params", "1e9", "--out", ""), "--out"),
                       (("convert", GPT2_SNAPSHOT, ""), "OUT")):
        assert_cli_error(run_cli(*args, cwd=tmp_path), f"{flag} '': give a file name")
    assert list(tmp_path.iterdir()) == []
