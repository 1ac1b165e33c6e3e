"""The capacity benchmark's option-setting rounds (benchmarks/capacity/conf_rounds.py) without a
GPU: the variants and their order, the rounds on a stand-in trial, resuming from the file, the
table's figures and the command's errors."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.capacity import conf_rounds, results, step_rounds, trial  # noqa: E402

ROW = {"workload": "llama1b", "cap_gib": 24.0, "dim": "batch", "size": 1}


def steps(steady: float) -> list[float]:
    """Six step times: two warm-up steps, then four steady ones whose median is `steady`."""
    return [0.6, 0.21, steady, steady, steady * 0.5, steady * 1.1]


class Trial:
    """A stand-in for trial.run_trial: vramledger with no setting is 5% slower than torch,
    with any setting or from another build as fast; records every call's variant."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple[str, str | None]] = []
        self.plugins: list[str | None] = []
        self.fail = fail

    def __call__(self, variant: conf_rounds.Variant, timeout_s: float) -> dict:
        self.calls.append((variant.allocator, variant.conf))
        self.plugins.append(variant.plugin)
        if variant.conf is not None and variant.conf == self.fail:
            return {"fits": None, "error": "exit 1: boom"}
        slow = 1.05 if variant == conf_rounds.Variant("vramledger") else 1.0
        return {"fits": True, "step_s": steps(0.2 * slow), "device": "NVIDIA H100 80GB HBM3",
                "torch": "2.11.0+cu130"}


def test_each_variant_names_its_allocator_settings_and_build(tmp_path):
    v = conf_rounds.parse_variant
    assert v("torch") == conf_rounds.Variant("torch")
    assert v("torch-expandable") == conf_rounds.Variant("torch-expandable")
    assert v("default") == conf_rounds.Variant("vramledger")
    assert v("expandable_page_mb:20,keep_old_mappings:False") == conf_rounds.Variant(
        "vramledger", "expandable_page_mb:20,keep_old_mappings:False")
    for bad in ("", "expandable_page_mb", "a:b:c", "a:1,", ":1"):
        with pytest.raises(ValueError, match="key:value"):
            v(bad)
    build = tmp_path / "lib-new"
    with pytest.raises(ValueError, match="lib-new is not a folder"):
        v(f"{build}@default")
    with pytest.raises(ValueError, match=r"\(empty\) is not a folder"):
        v("@default")
    build.mkdir()
    with pytest.raises(ValueError, match="holds no libvramledger_plugin.so or libvramledger_nat"):
        v(f"{build}@default")
    (build / "libvramledger_plugin.so").write_bytes(b"")
    # The plugin alone would run on the pluggable route: not the same allocator to compare.
    with pytest.raises(ValueError, match="holds no libvramledger_native.so$"):
        v(f"{build}@default")
    (build / "libvramledger_native.so").write_bytes(b"")
    plugin = str(build / "libvramledger_plugin.so")
    assert v(f"{build}@default") == conf_rounds.Variant("vramledger", None, plugin)
    assert v(f"{build}@expandable_page_mb:20") == conf_rounds.Variant(
        "vramledger", "expandable_page_mb:20", plugin)
    # A folder whose name holds '+' (a torch version's, say) is a folder, not a suffix.
    plus = tmp_path / "lib-2.11.0+cu130"
    plus.mkdir()
    for name in conf_rounds.BUILD_LIBRARIES:
        (plus / name).write_bytes(b"")
    assert v(f"{plus}@default+A=1") == conf_rounds.Variant(
        "vramledger", None, str(plus / "libvramledger_plugin.so"), (("A", "1"),))
    with pytest.raises(ValueError, match="key:value"):
        v(f"{build}@")


def test_a_build_variant_runs_its_plugin_beside_the_current_one(tmp_path):
    build = tmp_path / "lib-new"
    build.mkdir()
    for name in conf_rounds.BUILD_LIBRARIES:
        (build / name).write_bytes(b"")
    runs = conf_rounds.Runs(str(tmp_path / "r.json"), ROW)
    fake = Trial()
    variants = ["torch", "default", f"{build}@default"]
    assert conf_rounds.run_rounds(runs, variants, 2, fake, 600, 60, log=lambda s: None) == 0
    assert fake.plugins[:3] == [None, None, str(build / "libvramledger_plugin.so")]
    lines = conf_rounds.table(runs.runs, variants).splitlines()
    assert (f"| {build}@default | 2 | 200.0 | 200.0 | 100.0 | 220.0 | 200.0 "
            f"| 1.000 [1.000, 1.000] | not above |") in lines


def test_the_order_rotates_so_each_variant_runs_first_in_turn():
    v = ["torch", "default", "x:1"]
    assert [conf_rounds.order(v, r)[0] for r in range(4)] == ["torch", "default", "x:1", "torch"]
    assert sorted(conf_rounds.order(v, 2)) == sorted(v)


def test_rounds_run_every_variant_once_a_round_and_the_table_finds_the_slow_one(tmp_path):
    runs = conf_rounds.Runs(str(tmp_path / "r.json"), ROW)
    fake = Trial()
    variants = ["torch", "default", "expandable_handle_mb:96"]
    assert conf_rounds.run_rounds(runs, variants, 3, fake, 600, 60, log=lambda s: None) == 0
    assert len(fake.calls) == 9
    assert fake.calls[:3] == [("torch", None), ("vramledger", None),
                              ("vramledger", "expandable_handle_mb:96")]
    assert fake.calls[3] == ("vramledger", None)  # round 1 starts with the second variant
    text = conf_rounds.table(runs.runs, variants)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[2:]}
    assert "| reference |" in rows["torch"]
    assert "| 1.050 [1.050, 1.050] | above |" in rows["default"]
    assert "| 1.000 [1.000, 1.000] | not above |" in rows["expandable_handle_mb:96"]
    # steady median: the median of 0.2, 0.2, 0.1, 0.22 (steps 3-6) is 0.2 s
    assert "| 3 | 200.0 | 200.0 | 100.0 | 220.0 | 200.0 |" in rows["torch"]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["row"] == ROW and len(saved["runs"]) == 9
    assert {r["conf"] for r in saved["runs"]} == {None, "expandable_handle_mb:96"}


def test_a_second_run_resumes_and_runs_only_what_is_missing(tmp_path):
    path = str(tmp_path / "r.json")
    conf_rounds.run_rounds(conf_rounds.Runs(path, ROW), ["torch", "default"], 2, Trial(), 600,
                           60, log=lambda s: None)
    fake = Trial()
    runs = conf_rounds.Runs(path, ROW)
    conf_rounds.run_rounds(runs, ["torch", "default"], 3, fake, 600, 60, log=lambda s: None)
    assert len(fake.calls) == 2 and len(runs.runs) == 6
    with pytest.raises(ValueError, match="another row"):
        conf_rounds.Runs(path, dict(ROW, size=2))


def test_a_failed_run_is_counted_kept_left_out_of_the_figures_and_run_again(tmp_path):
    path = str(tmp_path / "r.json")
    runs = conf_rounds.Runs(path, ROW)
    logged = []
    failed = conf_rounds.run_rounds(runs, ["torch", "x:1"], 2, Trial(fail="x:1"), 600, 60,
                                    log=logged.append)
    assert failed == 2 and any("failed: exit 1: boom" in line for line in logged)
    assert "| x:1 | 0 | - | - | - | - | - | - | no fitting run |" in conf_rounds.table(runs.runs)
    # A second call runs the failed runs again, in their place, and keeps the others.
    fake = Trial()
    runs = conf_rounds.Runs(path, ROW)
    assert conf_rounds.run_rounds(runs, ["torch", "x:1"], 2, fake, 600, 60,
                                  log=lambda s: None) == 0
    assert fake.calls == [("vramledger", "x:1")] * 2 and len(runs.runs) == 4
    assert "| x:1 | 2 |" in conf_rounds.table(runs.runs)


def test_a_run_the_budget_cut_short_is_not_kept(tmp_path):
    runs = conf_rounds.Runs(str(tmp_path / "r.json"), ROW)
    cut = lambda variant, timeout_s: {"fits": None, "timed_out": True,  # noqa: E731
                                      "error": f"timed out after {timeout_s:.0f} s"}
    logged = []
    assert conf_rounds.run_rounds(runs, ["torch"], 1, cut, 100, 240, log=logged.append) == 1
    assert runs.runs == [] and "not kept" in logged[-1]
    # A run that reached its own timeout, within the budget, is a failure and is kept.
    assert conf_rounds.run_rounds(runs, ["torch"], 1, cut, 600, 240, log=lambda s: None) == 1
    assert len(runs.runs) == 1 and runs.runs[0]["timed_out"]


def test_runs_of_a_round_pair_only_on_one_card():
    def run(variant, round_, device, steady):
        return {"variant": variant, "round": round_, "fits": True, "step_s": steps(steady),
                "device": device}
    runs = [run("torch", 0, "H100", 0.2), run("default", 0, "H100", 0.21),
            run("torch", 1, "H100", 0.2), run("default", 1, "H200", 0.1),
            run("torch", 2, "H100", 0.2), run("default", 2, "H100", 0.21)]
    assert "| 1.050 [1.050, 1.050] | above |" in conf_rounds.table(runs)


def test_the_budget_stops_the_rounds_and_counts_as_a_failure(tmp_path):
    runs = conf_rounds.Runs(str(tmp_path / "r.json"), ROW)
    fake = Trial()
    assert conf_rounds.run_rounds(runs, ["torch", "default"], 2, fake, 10, 60,
                                  log=lambda s: None) == 1
    assert fake.calls == []


def test_the_table_needs_torch_native():
    with pytest.raises(ValueError, match="torch native"):
        conf_rounds.table([{"variant": "default", "round": 0, "fits": True,
                            "step_s": steps(0.2)}])
    assert step_rounds.WARM_STEPS == 2  # the table's step numbers start after these


def test_the_table_command_prints_a_file_and_names_bad_input(tmp_path, capsys):
    path = tmp_path / "r.json"
    conf_rounds.run_rounds(conf_rounds.Runs(str(path), ROW), ["torch", "default"], 2, Trial(),
                           600, 60, log=lambda s: None)
    assert conf_rounds.main(["table", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("row: llama1b at 24 GiB, batch 1\n") and "| default | 2 |" in out
    for name, text in (("empty.json", "{}"), ("list.json", "[1]"), ("text.json", "runs"),
                       ("norow.json", '{"runs": []}'),
                       ("noref.json", json.dumps({"row": ROW, "runs": []}))):
        (tmp_path / name).write_text(text)
        assert conf_rounds.main(["table", str(tmp_path / name)]) == 2, name
        out = capsys.readouterr()
        assert out.out == "" and name in out.err and "Traceback" not in out.err, name
    for path, said in ((tmp_path / "missing.json", "no such file"), (tmp_path, "not a file")):
        with pytest.raises(SystemExit) as e:
            conf_rounds.main(["table", str(path)])
        assert e.value.code == 2 and f"{path}: {said}" in capsys.readouterr().err


def test_the_table_divides_by_the_variant_it_is_asked_to(tmp_path, capsys):
    """--against VARIANT: the ratios are to that variant's runs of the same rounds, which the
    table marks as the reference; a variant the file does not hold is refused, naming those it
    does."""
    runs = []
    for k, x in enumerate((1.10, 1.12, 1.08)):
        runs += [{"variant": v, "round": k, "fits": True, "step_s": steps(0.2 * f)}
                 for v, f in (("torch", 1.0), ("default", x), ("x:1", x * 1.05))]
    text = conf_rounds.table(runs, against="default")
    assert "| / default [90%] |" in text and "| default | 3 |" in text
    assert text.splitlines()[3].endswith("| - | reference |")  # default's line, the second
    gm, low, high = step_rounds.interval([1.0 / x for x in (1.10, 1.12, 1.08)])
    assert f"| torch | 3 |" in text and f"| {gm:.3f} [{low:.3f}, {high:.3f}] |" in text
    gm, low, high = step_rounds.interval([1.05] * 3)
    assert f"| {gm:.3f} [{low:.3f}, {high:.3f}] | above |" in text
    assert "| / torch native [90%] |" in conf_rounds.table(runs)
    assert "| / torch expandable [90%] |" in conf_rounds.table(
        [dict(r, variant="torch-expandable") if r["variant"] == "torch" else r for r in runs],
        against="torch-expandable")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"row": ROW, "runs": runs}))
    assert conf_rounds.main(["table", str(path), "--against", "x:1"]) == 0
    assert "| / x:1 [90%] |" in capsys.readouterr().out
    assert conf_rounds.main(["table", str(path), "--against", "torch-expandable"]) == 2
    err = capsys.readouterr().err
    assert "--against torch-expandable: no run of that variant (the file's: torch, default, x:1)" \
        in err and "Traceback" not in err


def test_the_run_command_refuses_bad_arguments_before_running(tmp_path, capsys):
    out = str(tmp_path / "r.json")
    row = ["run", "llama1b", "24", "batch", "1"]
    good = ["--variants", "default", "--rounds", "2"]
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "other.json").write_text(json.dumps({"row": dict(ROW, size=2), "runs": []}))
    for args, said in (
            ([*row, "--out", out, "--variants", "default", "--rounds", "0"], "--rounds"),
            ([*row, "--out", out, "--variants", "page_mb", "--rounds", "2"], "key:value"),
            ([*row, "--out", out, "--variants", f"{tmp_path}@default", "--rounds", "2"],
             "holds no libvramledger_plugin.so"),
            ([*row, "--out", out, *good, "--timeout-s", "-5"], "--timeout-s must be"),
            ([*row, "--out", out, *good, "--budget-s", "nan"], "--budget-s must be"),
            (["run", "llama1b", "24", "batch", "0", "--out", out, *good], "size must be"),
            (["run", "llama1b", "0", "batch", "1", "--out", out, *good], "cap_gib above 0"),
            ([*row, "--out", str(tmp_path), *good], "not a file in a folder"),
            ([*row, "--out", str(tmp_path / "no" / "r.json"), *good], "not a file in a folder"),
            ([*row, "--out", str(tmp_path / "list.json"), *good], "not a runs file"),
            ([*row, "--out", str(tmp_path / "other.json"), *good], "another row")):
        with pytest.raises(SystemExit) as e:
            conf_rounds.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "r.json").exists()


def test_a_conf_or_plugin_is_refused_for_torchs_allocators():
    with pytest.raises(ValueError, match="^conf 'x:1': vramledger's"):
        trial.run_trial("llama1b", "torch", 24.0, "batch", 1, 10.0, conf="x:1")
    with pytest.raises(ValueError, match="^plugin '/x.so': vramledger's"):
        trial.run_trial("llama1b", "torch-expandable", 24.0, "batch", 1, 10.0, plugin="/x.so")


def test_the_trial_process_gets_the_settings_and_the_build(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 0, trial.RESULT + '{"fits": true}\n', "")
    monkeypatch.setattr(trial.subprocess, "run", fake_run)
    monkeypatch.setenv("VRAMLEDGER_CONF", "from:outside")
    plugin = str(tmp_path / "lib-new" / "libvramledger_plugin.so")
    record = trial.run_trial("llama1b", "vramledger", 24.0, "batch", 1, 10.0,
                             conf="expandable_page_mb:20", plugin=plugin)
    assert seen["env"]["VRAMLEDGER_CONF"] == "expandable_page_mb:20"
    assert seen["env"]["VRAMLEDGER_PLUGIN"] == plugin
    assert record["library"] == "lib-new"
    trial.run_trial("llama1b", "vramledger", 24.0, "batch", 1, 10.0)
    assert "VRAMLEDGER_CONF" not in seen["env"]  # the outer setting never leaks into a trial


def test_a_variant_may_give_its_process_environment_variables():
    v = conf_rounds.parse_variant
    tunables = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"
    assert v(f"torch+GLIBC_TUNABLES={tunables}") == conf_rounds.Variant(
        "torch", env=(("GLIBC_TUNABLES", tunables),))
    assert v("expandable_page_mb:20+A=1+B=") == conf_rounds.Variant(
        "vramledger", "expandable_page_mb:20", env=(("A", "1"), ("B", "")))
    assert v("default+LD_PRELOAD=/x/libjemalloc.so.2") == conf_rounds.Variant(
        "vramledger", env=(("LD_PRELOAD", "/x/libjemalloc.so.2"),))
    # A '+' starts a suffix only before NAME=; elsewhere it is part of a value or a folder.
    assert v("torch+LD_PRELOAD=/opt/g++/lib.so+A=1") == conf_rounds.Variant(
        "torch", env=(("LD_PRELOAD", "/opt/g++/lib.so"), ("A", "1")))
    for bad, said in (("torch+A", "then any +NAME=VALUE"), ("torch+=1", "then any +NAME=VALUE"),
                      ("default+1A=2", "then any +NAME=VALUE"), ("torch+", "'+' at its end"),
                      ("default+A=1+A=2", "A is given twice"),
                      ("torch+VRAMLEDGER_CONF=x:1", "VRAMLEDGER_CONF is set by the trial"),
                      ("default+PYTHONPATH=/x", "PYTHONPATH is set by the trial")):
        with pytest.raises(ValueError, match=re.escape(said)):
            v(bad)


def test_a_variants_environment_reaches_its_process_and_record(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen.update(env=env)
        return subprocess.CompletedProcess(cmd, 0, trial.RESULT + '{"fits": true}\n', "")
    monkeypatch.setattr(trial.subprocess, "run", fake_run)
    record = trial.run_trial("llama1b", "torch", 24.0, "batch", 1, 10.0,
                             extra_env={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert seen["env"]["GLIBC_TUNABLES"] == "glibc.malloc.trim_threshold=1"
    assert record["env"] == {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}
    assert "env" not in trial.run_trial("llama1b", "torch", 24.0, "batch", 1, 10.0)
    with pytest.raises(ValueError, match="^PYTORCH_CUDA_ALLOC_CONF: the trial sets these"):
        trial.run_trial("llama1b", "torch", 24.0, "batch", 1, 10.0,
                        extra_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def run_record(variant: str, round_: int, boot: str, sys_ms: float, load: float) -> dict:
    """A fitting run whose steady steps each spent `sys_ms` in the kernel (its warm-up steps ten
    times that, which the process table leaves out)."""
    figures = {f: [1.0] * 6 for f in trial.PROCESS_FIGURES}
    figures["step_sys_ms"] = [sys_ms * 10] * 2 + [sys_ms] * 4
    figures["step_steal_ms"] = [None] * 6  # bare metal without /proc/stat's steal
    figures["step_launch_ms"] = [150.0] * 2 + [50.0] * 4
    figures["step_probe_py_us"] = [2000.0] * 2 + [1000.0] * 4
    figures["step_probe_launch_us"] = [9.0] * 2 + [5.0] * 4
    return {"variant": variant, "round": round_, "fits": True, "step_s": steps(0.2),
            "device": "H100", **figures,
            "host": {"boot_id": boot, "cpu_model": "Xeon", "cpus": 16,
                     "loadavg": [load, 0.0, 0.0]}}


def test_the_process_table_gives_each_variants_steady_step_and_the_machines_their_runs():
    runs = [run_record("torch", 0, "aaaaaaaa-1", 10.0, 1.5),
            run_record("default", 0, "aaaaaaaa-1", 30.0, 2.0),
            run_record("torch", 1, "bbbbbbbb-2", 12.0, 0.5),
            run_record("default", 1, "bbbbbbbb-2", 34.0, 0.25),
            {"variant": "default", "round": 2, "fits": None, "error": "exit 1"}]
    lines = conf_rounds.process_table(runs).splitlines()
    assert lines[0] == ("| variant (mean steady step) | runs | step ms | queued by ms | user ms | "
                        "sys ms | minor faults | vol. switches | invol. switches | main thread ms "
                        "| run queue ms | migrations | steal ms | Python probe us | launch probe "
                        "us |")
    # Means over the steady steps (0.2, 0.2, 0.1, 0.22 s: 180 ms), medians over the runs.
    assert ("| torch | 2 | 180.0 | 50.0 | 1.0 | 11.0 | 1 | 1 | 1 | 1.0 | 1.00 | 1.0 | - | 1000 "
            "| 5.00 |") in lines
    assert ("| default | 2 | 180.0 | 50.0 | 1.0 | 32.0 | 1 | 1 | 1 | 1.0 | 1.00 | 1.0 | - | 1000 "
            "| 5.00 |") in lines
    assert conf_rounds.machines(runs).splitlines() == [
        "machine aaaaaaaa: 2 runs, Xeon, 16 CPUs, load average (1 min) 1.50-2.00",
        "machine bbbbbbbb: 2 runs, Xeon, 16 CPUs, load average (1 min) 0.25-0.50"]
    # Records from before these figures: the columns say "-", no machine line.
    old = [{"variant": v, "round": 0, "fits": True, "step_s": steps(0.2)}
           for v in ("torch", "default")]
    assert ("| default | 1 | 180.0 | - | - | - | - | - | - | - | - | - | - | - | - |"
            in conf_rounds.process_table(old))
    assert conf_rounds.machines(old) == ""
    text = conf_rounds.report(runs)
    assert text.index("/ torch native") < text.index("sys ms") < text.index("machine aaaaaaaa")


def test_join_adds_the_three_allocators_runs_as_the_rows_next_step_rounds(tmp_path, capsys):
    runs_path = tmp_path / "machine" / "r.json"
    runs_path.parent.mkdir()
    variants = ["torch", "torch-expandable", "default", "x:1", "torch+A=1"]
    conf_rounds.run_rounds(conf_rounds.Runs(str(runs_path), ROW), variants, 2, Trial(), 600,
                           60, log=lambda s: None)
    held = [dict(ROW, allocator=a, round=r, fits=True, step_s=steps(0.3 + r / 100))
            for a in ("torch", "vramledger") for r in range(3)]
    other_row = dict(ROW, size=2, allocator="torch", round=7, fits=True, step_s=steps(0.4))
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps({"trials": [], "step_rounds": held + [other_row]}))
    assert conf_rounds.main(["join", str(runs_path), str(results_path)]) == 0
    out = capsys.readouterr().out
    assert "added 6 runs of" in out and out.rstrip().endswith("as rounds 3-4")
    doc = json.loads(results_path.read_text())
    joined = [r for r in doc["step_rounds"] if "conf_rounds" in r]
    # Rounds 0 and 1 of the file become the row's rounds 3 and 4 (after its last, 2; the other
    # row's 7 does not count); only the three plain variants, as the allocators they are.
    assert sorted((r["allocator"], r["round"], r["conf_rounds"]) for r in joined) == [
        (a, 3 + r, f"machine/r.json round {r}")
        for a in ("torch", "torch-expandable", "vramledger") for r in range(2)]
    assert all(r["batch"] == 1 and r["seq"] == 2048 and "variant" not in r for r in joined)
    assert all({"workload", "cap_gib", "dim", "size"} <= r.keys() for r in joined)
    # A second join of the same file would count its runs twice: refused, nothing written.
    before = results_path.read_text()
    assert conf_rounds.main(["join", str(runs_path), str(results_path)]) == 2
    assert "already holds 6 of the 6 runs of" in capsys.readouterr().err
    # So would the same runs under another name.
    copy = tmp_path / "copy.json"
    copy.write_text(runs_path.read_text())
    assert conf_rounds.main(["join", str(copy), str(results_path)]) == 2
    assert "already holds 6 of the 6 runs" in capsys.readouterr().err
    assert results_path.read_text() == before


def test_join_numbers_after_the_pooled_files_and_refuses_their_runs(tmp_path, capsys):
    """Results files that the table pools (--resume A B) key a round by its number: joined into
    A, a row's runs follow its last round in B too, and runs B holds are refused. B is read,
    never written."""
    runs_path = tmp_path / "r.json"
    conf_rounds.run_rounds(conf_rounds.Runs(str(runs_path), ROW), ["torch", "default"], 2,
                           Trial(), 600, 60, log=lambda s: None)
    results_path, other = tmp_path / "a.json", tmp_path / "b.json"
    results_path.write_text(json.dumps({"trials": [], "step_rounds": [
        dict(ROW, allocator="torch", round=r, fits=True, step_s=steps(0.3 + r / 100))
        for r in range(2)]}))
    other_rounds = [dict(ROW, allocator="torch", round=r, fits=True, step_s=steps(0.5 + r / 100))
                    for r in range(2, 9)]
    other_rounds.append(dict(ROW, size=2, allocator="torch", round=20, fits=True,
                             step_s=steps(0.4)))  # another row's rounds do not count
    other.write_text(json.dumps({"trials": [], "step_rounds": other_rounds}))
    other_before = other.read_text()
    assert conf_rounds.main(["join", str(runs_path), str(results_path),
                             "--pooled-with", str(other)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("as rounds 9-10")
    assert other.read_text() == other_before
    pooled = results.Results()
    pooled.load([str(results_path), str(other)])  # no round numbered twice
    assert sorted(r["round"] for r in pooled.rounds.values()
                  if r["size"] == 1 and "conf_rounds" in r) == [9, 9, 10, 10]
    # The same runs joined into B would be counted twice in the pooled table: refused.
    assert conf_rounds.main(["join", str(runs_path), str(other),
                             "--pooled-with", str(results_path)]) == 2
    assert (f"conf rounds: {results_path} already holds 4 of the 4 runs of"
            in capsys.readouterr().err)  # the file that holds them, not the one joined into
    assert other.read_text() == other_before
    with pytest.raises(SystemExit) as e:
        conf_rounds.main(["join", str(runs_path), str(other), "--pooled-with",
                          str(tmp_path / "missing.json")])
    assert e.value.code == 2 and "missing.json: no such file" in capsys.readouterr().err
    # A joined file holds its own rounds and the joined ones, none of the pooled file's.
    doc = json.loads(results_path.read_text())
    assert sorted(r["round"] for r in doc["step_rounds"]) == [0, 1, 9, 9, 10, 10]


def test_join_reads_the_pooled_files_as_the_table_does(tmp_path, capsys):
    """The flag once per file, before or after the two files; the results file may be named
    among them; files that number two runs of a row alike, whichever field tells them apart,
    are refused before anything is written."""
    runs_path = tmp_path / "r.json"
    conf_rounds.run_rounds(conf_rounds.Runs(str(runs_path), ROW), ["torch"], 1, Trial(), 600,
                           60, log=lambda s: None)
    run = dict(ROW, allocator="torch", fits=True)
    files = {}
    for name, rounds in (("a", [0]), ("b", [1, 2]), ("c", [3])):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"trials": [], "step_rounds": [
            dict(run, round=r, step_s=steps(0.3 + r / 100)) for r in rounds]}))
    a, b, c = (str(files[n]) for n in "abc")
    assert conf_rounds.main(["join", "--pooled-with", b, str(runs_path), a,
                             "--pooled-with", c, "--pooled-with", a]) == 0
    assert capsys.readouterr().out.rstrip().endswith("as round 4")
    # Joined again: refused by the one file that holds the runs, named once.
    assert conf_rounds.main(["join", str(runs_path), b, "--pooled-with", a,
                             "--pooled-with", b]) == 2
    assert capsys.readouterr().err.startswith(f"conf rounds: {a} already holds 1 of the 1 runs")
    before = {n: f.read_text() for n, f in files.items()}
    # b's round 1 again in c, with another step time or only another field: refused.
    for change in ({"step_s": steps(0.9)}, {"fits": False}, {"device": "H200"}):
        held = dict(run, round=1, step_s=steps(0.31))
        files["c"].write_text(json.dumps({"trials": [], "step_rounds": [dict(held, **change)]}))
        assert conf_rounds.main(["join", str(runs_path), b, "--pooled-with", c]) == 2, change
        err = capsys.readouterr().err
        assert f"step round 1 of llama1b torch at 24 GiB, batch 1, is also in {b}" in err, change
        assert "--pooled-with numbers joined rounds apart" in err and "Traceback" not in err
        assert files["b"].read_text() == before["b"]
    # One file that numbers two runs alike is refused as well.
    files["c"].write_text(json.dumps({"trials": [], "step_rounds": [
        dict(run, round=5, step_s=steps(0.3)), dict(run, round=5, step_s=steps(0.4))]}))
    assert conf_rounds.main(["join", str(runs_path), c]) == 2
    assert f"{c}: step round 5 of llama1b torch at 24 GiB, batch 1 is in the file twice" in \
        capsys.readouterr().err


def test_join_keeps_what_did_not_fit_skips_failures_and_may_add_nothing(tmp_path, capsys):
    runs_path = tmp_path / "r.json"
    runs = [{"variant": "torch", "round": 0, "fits": True, "step_s": steps(0.2)},
            {"variant": "default", "round": 0, "fits": False, "step_s": [0.5]},
            {"variant": "torch-expandable", "round": 0, "fits": None, "error": "exit 1"},
            {"variant": "x:1", "round": 1, "fits": True, "step_s": steps(0.2)},
            {"variant": "torch", "round": 2, "fits": True, "step_s": steps(0.21)}]
    runs_path.write_text(json.dumps({"row": ROW, "runs": runs}))
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps({"trials": []}))
    assert conf_rounds.main(["join", str(runs_path), str(results_path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("added 3 runs of " + str(runs_path)
                                                     + " as rounds 0-1")
    doc = json.loads(results_path.read_text())
    # Round 1 held only a setting's run: the rounds close up (file rounds 0 and 2 -> 0 and 1).
    assert sorted((r["allocator"], r["round"], r["fits"]) for r in doc["step_rounds"]) == [
        ("torch", 0, True), ("torch", 1, True), ("vramledger", 0, False)]
    only_settings = tmp_path / "s.json"
    only_settings.write_text(json.dumps({"row": ROW, "runs": runs[3:4]}))
    before = results_path.read_text()
    assert conf_rounds.main(["join", str(only_settings), str(results_path)]) == 0
    assert "no run of torch, torch-expandable, default to add" in capsys.readouterr().out
    assert results_path.read_text() == before


def test_join_names_bad_files(tmp_path, capsys):
    runs_path = tmp_path / "r.json"
    conf_rounds.run_rounds(conf_rounds.Runs(str(runs_path), ROW), ["torch"], 1, Trial(), 600,
                           60, log=lambda s: None)
    (tmp_path / "bad.json").write_text('{"step_rounds": []}')
    assert conf_rounds.main(["join", str(runs_path), str(tmp_path / "bad.json")]) == 2
    assert "not a capacity results file" in capsys.readouterr().err
    assert conf_rounds.main(["join", str(tmp_path / "bad.json"), str(runs_path)]) == 2
    assert "not a runs file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        conf_rounds.main(["join", str(tmp_path / "missing.json"), str(runs_path)])
    assert e.value.code == 2 and "missing.json: no such file" in capsys.readouterr().err
    # A row that is not one, a run without a name, a file outside the results' folder.
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps({"trials": []}))
    for name, doc, said in (
            ("w.json", {"row": dict(ROW, workload="nope"), "runs": []}, "is not a workload"),
            ("l.json", {"row": [], "runs": []}, "is not a workload"),
            ("u.json", {"row": dict(ROW, workload=["x"]), "runs": []}, "is not a workload"),
            ("v.json", {"row": ROW, "runs": [{"variant": [1], "round": 0}]}, "not a name")):
        (tmp_path / name).write_text(json.dumps(doc))
        assert conf_rounds.main(["join", str(tmp_path / name), str(results_path)]) == 2, name
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (name, err)
    (tmp_path / "inner").mkdir()
    inner = tmp_path / "inner" / "results.json"
    inner.write_text(json.dumps({"trials": []}))
    assert conf_rounds.main(["join", str(runs_path), str(inner)]) == 2
    assert "is not under" in capsys.readouterr().err


def test_join_tells_runs_apart_by_their_step_times_and_machine_never_by_an_empty_list(tmp_path):
    """Two runs out of memory in their first step hold no step time: neither is taken for the
    other; a run of another machine with the same figures is another run."""
    oom = {"variant": "default", "round": 0, "fits": False, "step_s": []}
    results_path = tmp_path / "results.json"
    held = dict(ROW, allocator="vramledger", round=0, fits=False, step_s=[])
    results_path.write_text(json.dumps({"trials": [], "step_rounds": [held]}))
    (tmp_path / "a.json").write_text(json.dumps({"row": ROW, "runs": [oom]}))
    assert conf_rounds.join(str(tmp_path / "a.json"), str(results_path)) == (1, [1])
    ran = {"variant": "torch", "round": 0, "fits": True, "step_s": steps(0.2),
           "host": {"boot_id": "a"}}
    (tmp_path / "b.json").write_text(json.dumps({"row": ROW, "runs": [ran]}))
    assert conf_rounds.join(str(tmp_path / "b.json"), str(results_path)) == (1, [2])
    (tmp_path / "c.json").write_text(json.dumps(
        {"row": ROW, "runs": [dict(ran, host={"boot_id": "b"})]}))
    assert conf_rounds.join(str(tmp_path / "c.json"), str(results_path)) == (1, [3])
    with pytest.raises(ValueError, match="already holds 1 of the 1 runs"):
        conf_rounds.join(str(tmp_path / "b.json"), str(results_path))


def test_the_table_resamples_rounds_of_several_machines_by_machine():
    """Six rounds on three machines, two each: the interval is step_rounds.interval's by
    machine, which differs from the rounds' own, and the cell says over how many machines."""
    slow = [1.00, 1.02, 1.10, 1.12, 0.98, 1.00]
    boots = ["a", "a", "b", "b", "c", "c"]
    runs = []
    for k, (ratio, boot) in enumerate(zip(slow, boots)):
        runs += [{"variant": v, "round": k, "fits": True, "step_s": steps(0.2 * x),
                  "device": "H100", "host": {"boot_id": boot}}
                 for v, x in (("torch", 1.0), ("default", ratio))]
    ratios = [steps(0.2 * x)[2] / steps(0.2)[2] for x in slow]
    gm, low, high = step_rounds.interval(ratios, machines=boots)
    assert (low, high) != step_rounds.interval(ratios)[1:]
    assert f"| {gm:.3f} [{low:.3f}, {high:.3f}], 3 machines |" in conf_rounds.table(runs)


def test_the_tables_pair_a_rounds_runs_only_on_one_machine():
    """A round whose runs name two machines (kernel boots) is not paired (the step rounds' table
    pairs through the same step_rounds.same_machine)."""
    def run(variant, round_, boot, steady):
        return {"variant": variant, "round": round_, "fits": True, "step_s": steps(steady),
                "device": "H100", "host": {"boot_id": boot}}
    runs = [run("torch", 0, "a", 0.2), run("default", 0, "a", 0.21),
            run("torch", 1, "a", 0.2), run("default", 1, "b", 0.1),
            run("torch", 2, "c", 0.2), run("default", 2, "c", 0.21)]
    assert "| 1.050 [1.050, 1.050] | above |" in conf_rounds.table(runs)


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("module", ["benchmarks.capacity", "benchmarks.capacity.conf_rounds",
                                    "benchmarks.capacity.profiles"])
def test_a_reader_that_stops_early_ends_the_command_without_a_traceback(tmp_path, module,
                                                                         unbuffered):
    """`... | head`: the pipe closes under the table being printed; the command ends quietly,
    whether its first write fails (unbuffered) or the last flush does."""
    runs = [{"variant": v, "round": k, "fits": True, "step_s": steps(0.2 + k / 100)}
            for k in range(3) for v in ("torch", "default")]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"row": ROW, "runs": runs}))
    args = {"benchmarks.capacity": ["--table-only", "--resume",
                                    str(ROOT / "docs/results/capacity-h200-results.json")],
            "benchmarks.capacity.conf_rounds": ["table", str(path)],
            "benchmarks.capacity.profiles": ["compare",
                                             str(ROOT / "docs/results/capacity-h100-profiles")]}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", module, *args[module]], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child has printed anything: its first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_table_names_a_bad_file_once(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{bad")
    assert conf_rounds.main(["table", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"conf rounds: {bad}: not a readable runs file (")
    assert err.count(str(bad)) == 1
    bad.write_text('{"row": {}}')
    assert conf_rounds.main(["table", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"conf rounds: {bad}: not a runs file") and err.count(str(bad)) == 1
