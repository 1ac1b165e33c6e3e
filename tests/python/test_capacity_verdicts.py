"""The step rounds' verdict table (benchmarks/capacity/verdicts.py) and the rounds the records
still want (benchmarks/capacity/next_rounds.py) without a GPU, on the stand-ins of
test_capacity_step_rounds: each comparison's verdicts, the rows' order, running them on a stand-in
trial and the verdicts before and after pooling the new runs."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchmarks.capacity import __main__ as capacity_main  # noqa: E402
from benchmarks.capacity import conf_rounds, next_rounds, table, trial, verdicts  # noqa: E402
from benchmarks.capacity.results import Results  # noqa: E402
from test_capacity_step_rounds import ROW, RoundRuns, run_rounds, searched  # noqa: E402

BOOT = "77d062bb-d422-40d1-ba9b-3f9c6217a59f"
OTHER_BOOT = "3ec416ad-0000-4000-8000-000000000000"


def rounds_of(native, expandable, vramledger, boots=None) -> Results:
    """The row's searches and len(native) rounds with these steady steps, round r on boots[r]
    (None: a record that names no machine)."""
    results = searched()
    run_rounds(results, RoundRuns({"torch": native, "torch-expandable": expandable,
                                   "vramledger": vramledger}), len(native))
    for r in results.rounds.values():
        if boots and boots[r["round"]]:
            r["host"] = {"boot_id": boots[r["round"]]}
    return results


def test_each_comparison_has_a_verdict_by_the_median_and_by_the_total():
    """vramledger 10% slower than torch native in every round ("above"), as fast as torch
    expandable ("not above"); the table gives the counts first, then a line per comparison."""
    results = rounds_of([0.5] * 4, [0.55] * 4, [0.55] * 4, [BOOT, BOOT, OTHER_BOOT, None])
    found = verdicts.comparisons(results, [ROW], 64)
    assert [(c.against, c.rounds, len(c.named_machines())) for c in found] == [
        ("torch", 4, 3), ("torch-expandable", 4, 3)]  # two boot ids and "not recorded"
    native, expandable = found
    assert native.bounds["median"] == pytest.approx((1.1, 1.1, 1.1))
    assert [native.verdict(m) for m in verdicts.MEASURES] == ["above", "above"]
    assert [expandable.verdict(m) for m in verdicts.MEASURES] == ["not above", "not above"]
    assert native.decided() and expandable.decided()
    text = verdicts.verdicts_table(found)
    lines = text.splitlines()
    assert lines[0] == ("By the median: 1 not above, 0 undecided, 1 above; by the total: 1 not "
                        "above, 0 undecided, 1 above (2 comparisons).")
    assert lines[4] == ("| GPT-2-medium | 24 | batch | 4 | torch native | 4 (2 machines; 1 not "
                        "recorded) | above: 1.100 (1.100 - 1.100) | above: 1.100 (1.100 - "
                        "1.100) |")
    assert verdicts.verdicts_table([]).startswith("No step rounds")


def test_the_rounds_cell_names_the_machines_and_a_total_over_fewer_rounds():
    results = rounds_of([0.5] * 3, [0.5] * 3, [0.5] * 3)
    (c, _) = verdicts.comparisons(results, [ROW], 64)
    assert verdicts.rounds_text(c) == "3 (not recorded)"
    key = next(k for k, r in results.rounds.items()
               if r["allocator"] == "vramledger" and r["round"] == 1)
    results.rounds[key]["step_s"] = results.rounds[key]["step_s"][:5]  # stopped short
    (c, _) = verdicts.comparisons(results, [ROW], 64)
    assert verdicts.rounds_text(c) == "3 (not recorded); 2 with a total"
    results = rounds_of([0.5] * 3, [0.5] * 3, [0.5] * 3, [BOOT] * 3)
    assert verdicts.rounds_text(verdicts.comparisons(results, [ROW], 64)[0]) == "3 (1 machine)"


def comparison(workload, cap, dim, against, on, bounds) -> verdicts.Comparison:
    """A comparison whose rounds ran on machines `on` with these bounds by both measures."""
    return verdicts.Comparison(workload, cap, dim, 4, against,
                               machines={m: tuple(on) for m in verdicts.MEASURES},
                               bounds={m: bounds for m in verdicts.MEASURES})


UNDECIDED = (1.0, 0.95, 1.05)
NOT_ABOVE = (1.0, 0.99, 1.01)


def test_the_rows_wanted_fewest_machines_first_and_the_asking_machines_last():
    found = [
        comparison("llama1b", 24, "batch", "torch", ["a", "b", "c"], UNDECIDED),
        comparison("llama1b", 24, "batch", "torch-expandable", ["a", "b", "c"], NOT_ABOVE),
        comparison("gpt2m", 24, "batch", "torch", ["a", "b"], UNDECIDED),
        comparison("gpt2m", 24, "batch", "torch-expandable", ["a", "b"], UNDECIDED),
        # Three rounds that name no machine: one machine here, not three.
        comparison("gpt2m", 80, "batch", "torch", [None, None, None], UNDECIDED),
        comparison("llama1b-ckpt", 24, "batch", "torch", ["a"], NOT_ABOVE),  # decided
        comparison("llama1b-lora", 24, "seq", "torch", ["z"], (1.1, 0.9, 1.3)),
    ]
    assert found[4].named_machines() == {None}  # one here; the interval counts each round
    want = verdicts.wanted(found, card_gib=140.0)
    assert [w.task() for w in want] == ["gpt2m 80 batch 4", "llama1b-lora 24 seq 4",
                                        "gpt2m 24 batch 4", "llama1b 24 batch 4"]
    assert want[2].reason() == ("rounds 2 (2 machines); undecided against torch native by the "
                                "median and the total, torch expandable by the median and the "
                                "total")
    # An H100's 79.6 GiB cannot run the 80 GiB cap; machine "z" ran the LoRA row already.
    want = verdicts.wanted(found, card_gib=79.6, machine="Z")  # the start of its id, any case
    assert [w.task() for w in want] == ["gpt2m 24 batch 4", "llama1b 24 batch 4",
                                        "llama1b-lora 24 seq 4"]
    assert want[-1].ran_here and want[-1].reason().endswith("; this machine ran it already")
    # Too few rounds is not decided either; with as many machines, the more undecided first.
    few = [comparison("gpt2m", 24, "seq", "torch", ["a"], None),
           comparison("llama1b", 24, "seq", "torch", ["b"], UNDECIDED),
           comparison("llama1b", 24, "seq", "torch-expandable", ["b"], UNDECIDED)]
    assert few[0].verdict("median") == "too few rounds"
    assert [w.task() for w in verdicts.wanted(few, 80)] == ["llama1b 24 seq 4", "gpt2m 24 seq 4"]


def test_the_tables_command_prints_the_verdicts_alone(tmp_path, capsys):
    path = tmp_path / "results.json"
    results = rounds_of([0.5] * 3, [0.55] * 3, [0.55] * 3)
    results.path = str(path)
    results.save()
    assert capacity_main.main(["--table-only", "--verdicts", "--resume", str(path)]) == 0
    out = capsys.readouterr().out
    assert "By the median: 1 not above, 0 undecided, 1 above;" in out
    assert "| GPT-2-medium | 24 | batch | 4 | torch expandable | 3 (not recorded) |" in out
    assert "Retries and step time" not in out  # the other tables are left out
    for argv, says in ((["--verdicts", "--resume", str(path)], "needs --table-only"),
                       (["--table-only", "--verdicts", "--by-machine", "--resume", str(path)],
                        "name one")):
        with pytest.raises(SystemExit) as e:
            capacity_main.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


class Trial:
    """A stand-in for trial.run_trial: torch native's steady step 0.5 s, torch expandable's and
    vramledger's 0.55 s, on BOOT; `fail` names an allocator whose runs fail."""

    def __init__(self, fail=None):
        self.calls = []
        self.fail = fail

    def __call__(self, variant, workload, cap, dim, size, timeout_s):
        self.calls.append((variant.allocator, workload, cap, dim, size))
        if variant.allocator == self.fail:
            return {"fits": None, "error": "exit 1: boom"}
        t = 0.5 if variant.allocator == "torch" else 0.55
        return {"fits": True, "step_s": [9.0, 9.0] + [t] * 4, "device": "stand-in",
                "torch": "none", "host": {"boot_id": BOOT}}


def wanted_row(results) -> list[verdicts.Wanted]:
    return verdicts.wanted(verdicts.comparisons(results, [ROW], 64), 80.0)


def test_a_row_without_step_rounds_is_wanted_first():
    """A row whose searches found a size all three fit, but with no step round, has comparisons
    of no rounds ("too few rounds"), and comes before a row with rounds on one machine."""
    found = verdicts.comparisons(searched(), [ROW], 64)
    assert [(c.against, c.rounds, c.verdict("median")) for c in found] == [
        ("torch", 0, "too few rounds"), ("torch-expandable", 0, "too few rounds")]
    assert verdicts.rounds_text(found[0]) == "none"
    assert "| torch native | none | too few rounds (0) | too few rounds (0) |" in \
        verdicts.verdicts_table(found)
    other = comparison("llama1b", 24, "batch", "torch", ["a"], UNDECIDED)
    assert [w.task() for w in verdicts.wanted(found + [other], 80)] == [
        "gpt2m 24 batch 4", "llama1b 24 batch 4"]


def test_the_wanted_rows_run_into_a_file_of_this_boot_and_pool_after(tmp_path):
    """Two rounds on two machines leave vramledger against torch native undecided; three rounds
    on a third machine, 10% slower every round, pooled: the interval narrows (a third machine),
    and the pool the rounds ran against is unchanged."""
    before = rounds_of([0.5, 0.5], [0.5, 0.5], [0.5, 0.56], [OTHER_BOOT, "second"])
    want = wanted_row(before)
    assert [w.task() for w in want] == ["gpt2m 24 batch 4"]
    stand_in = Trial()
    ran, bad = next_rounds.run_wanted(want, str(tmp_path), BOOT, 3, 1e9, 100.0, stand_in,
                                      log=lambda _: None)
    assert (ran, bad) == (["gpt2m 24 batch 4"], 0)
    written = [str(tmp_path / "77d062bb-gpt2m-24-batch-4.json")]
    assert len(stand_in.calls) == 9  # three rounds of three allocators
    data = conf_rounds.read(written[0])
    assert data["row"] == {"workload": "gpt2m", "cap_gib": 24.0, "dim": "batch", "size": 4}
    held = copy.deepcopy((before.rounds, before.round_files))
    after, joined = next_rounds.pooled_with(before, written, log=lambda _: None)
    assert joined == written and len(after.rounds) == len(before.rounds) + 9
    assert (before.rounds, before.round_files) == held  # the pool itself is not changed
    rows = {("gpt2m", 24.0, "batch", 4)}
    text = next_rounds.before_after(verdicts.comparisons(before, [ROW], 64),
                                    verdicts.comparisons(after, [ROW], 64), rows)
    line = text.splitlines()[2].split(" | ")
    assert line[4:6] == ["torch native", "2 (2 machines) -> 5 (3 machines)"]
    # Geometric means: (1.0 * 1.12) ** (1 / 2) before, (1.0 * 1.12 * 1.1 ** 3) ** (1 / 5) after.
    was, now = line[6].split(" -> ")
    assert was.startswith("undecided: 1.058 (") and now.startswith("undecided: 1.083 (")
    (low0, high0), (low1, high1) = (map(float, x.split("(")[1].rstrip(")").split(" - "))
                                    for x in (was, now))
    assert low0 < low1 < 1.02 < high1 < high0  # narrower, still across the limit
    # A second call on the same boot resumes its file: nothing runs again.
    stand_in = Trial()
    assert next_rounds.run_wanted(want, str(tmp_path), BOOT, 3, 1e9, 100.0, stand_in,
                                  log=lambda _: None) == ([], 0)
    assert stand_in.calls == []
    # A file the pool already holds is left out, with a note.
    notes = []
    _, joined = next_rounds.pooled_with(after, written, log=notes.append)
    assert joined == [] and "left out of the pool" in notes[0] and "already holds" in notes[0]


def test_a_failed_run_counts_and_the_budget_ends_the_rows_quietly(tmp_path):
    results = rounds_of([0.5, 0.5], [0.5, 0.5], [0.5, 0.56], [OTHER_BOOT, "second"])
    want = wanted_row(results)
    _, bad = next_rounds.run_wanted(want, str(tmp_path), BOOT, 1, 1e9, 100.0,
                                    Trial(fail="torch-expandable"), log=lambda _: None)
    assert bad == 1
    # A run that did not fit counts; one the budget cut short (its timeout below --timeout-s)
    # does not, one that ran out its whole --timeout-s does.
    for record, timeout_s, counts in (({"fits": False, "step_s": [9.0]}, 100.0, 1),
                                      ({"fits": None, "timed_out": True}, 100.0, 1),
                                      ({"fits": None, "timed_out": True}, 1e9, 0)):
        folder = tmp_path / f"case-{timeout_s}-{record['fits']}"
        folder.mkdir()
        _, bad = next_rounds.run_wanted(want, str(folder), BOOT, 1, 1e9, timeout_s,
                                        lambda *args, r=record: dict(r), log=lambda _: None)
        assert bad == 3 * counts, record
    # A file whose every run failed has nothing to pool.
    failed_dir = tmp_path / "failed"
    failed_dir.mkdir()

    class Failing(Trial):
        def __call__(self, variant, *row):
            return {"fits": None, "error": "exit 1: no GPU"}

    ran, bad = next_rounds.run_wanted(want, str(failed_dir), BOOT, 1, 1e9, 100.0, Failing(),
                                      log=lambda _: None)
    assert bad == 3 and ran == ["gpt2m 24 batch 4"]
    notes = []
    _, joined = next_rounds.pooled_with(results, [str(p) for p in failed_dir.iterdir()],
                                        log=notes.append)
    assert joined == [] and "no run of torch, torch-expandable, default" in notes[0], notes
    said = []
    ran, bad = next_rounds.run_wanted(want, str(tmp_path / "none"), BOOT, 1, 10.0, 100.0,
                                      Trial(), log=said.append)
    assert (ran, bad) == ([], 0) and "the budget ended before gpt2m 24 batch 4" in said[0]
    # A runs file that cannot be used (not JSON) is named, counted, and the rows go on.
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    (bad_dir / "77d062bb-gpt2m-24-batch-4.json").write_text("{")
    said = []
    ran, bad = next_rounds.run_wanted(want + want, str(bad_dir), BOOT, 1, 1e9, 100.0, Trial(),
                                      log=said.append)
    assert (ran, bad) == ([], 2)
    assert said[0].startswith("next rounds: gpt2m 24 batch 4 not run: ") and \
        "not a readable runs file" in said[0]


def test_the_list_command_and_bad_arguments(tmp_path, capsys):
    path = tmp_path / "results.json"
    results = rounds_of([0.5, 0.5], [0.5, 0.5], [0.5, 0.56], [OTHER_BOOT, "second"])
    results.path = str(path)
    results.save()
    assert next_rounds.main(["list", str(path), "--card-gib", "79.6"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == [
        "1 row(s) not yet decided that a card of 79.6 GiB can run, in order:",
        "  gpt2m 24 batch 4  (rounds 2 (2 machines); undecided against torch native by the "
        "median and the total, torch expandable by the median and the total)"]
    for argv, says in (
            (["list", str(tmp_path / "no.json"), "--card-gib", "80"], "no such file"),
            (["list", str(path), "--card-gib", "0"], "--card-gib must be a finite number"),
            (["list", str(path), "--card-gib", "inf"], "--card-gib must be a finite number"),
            (["run", str(path), "--card-gib", "80", "--out-dir", str(tmp_path / "x")],
             "does not exist (create it first)"),
            # No GPU here (the run test stands one in): run refuses before any trial.
            (["run", str(path), "--card-gib", "80", "--out-dir", str(tmp_path)],
             "run needs a GPU, and nvidia-smi lists none here"),
            (["run", str(path), "--card-gib", "80", "--out-dir", str(tmp_path), "--rounds",
              "0"], "--rounds must be at least 1"),
            (["run", str(path), "--card-gib", "80", "--out-dir", str(tmp_path), "--rows",
              "0"], "--rows must be at least 1"),
            (["run", str(path), "--card-gib", "80", "--out-dir", str(path)], "not a folder"),
            (["run", str(path), "--card-gib", "80", "--out-dir", str(tmp_path), "--budget-s",
              "nan"], "--budget-s must be a number of seconds above 0")):
        with pytest.raises(SystemExit) as e:
            next_rounds.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
    (tmp_path / "bad.json").write_text("{}")
    assert next_rounds.main(["list", str(tmp_path / "bad.json"), "--card-gib", "80"]) == 2
    assert "not a capacity results file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"trials": ["a"]}')
    assert next_rounds.main(["list", str(tmp_path / "bad.json"), "--card-gib", "80"]) == 2
    assert "bad.json: a record that is not an object" in capsys.readouterr().err
    # A card too small for the row's cap: the row is counted, not listed.
    assert next_rounds.main(["list", str(path), "--card-gib", "20"]) == 0
    assert capsys.readouterr().out == ("0 row(s) not yet decided that a card of 20.0 GiB can "
                                       "run, in order (1 more need a larger card):\n")
    # A machine no round names gets a note.
    assert next_rounds.main(["list", str(path), "--card-gib", "80", "--machine", "zzz"]) == 0
    assert "no step round names machine 'zzz'" in capsys.readouterr().err
    # The machine that would run them: the start of its boot id, as the tables print it.
    assert next_rounds.main(["list", str(path), "--card-gib", "80", "--machine", "3EC416AD"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("; this machine ran it already)")
    # A record of a workload it does not know is left out, with a note.
    doc = json.loads(path.read_text())
    doc["trials"].append(dict(doc["trials"][0], workload="nope"))
    path.write_text(json.dumps(doc))
    assert next_rounds.main(["list", str(path), "--card-gib", "80"]) == 0
    out, err = capsys.readouterr()
    assert "left out the records of rows it does not know: nope 24 batch" in err
    assert out.startswith("1 row(s) not yet decided")


def test_the_run_command_runs_pools_and_prints_the_join_commands(tmp_path, capsys,
                                                                 monkeypatch):
    path = tmp_path / "results.json"
    other = tmp_path / "other.json"
    results = rounds_of([0.5, 0.5], [0.5, 0.5], [0.5, 0.56], [OTHER_BOOT, "second"])
    results.path = str(path)
    results.save()
    other.write_text(json.dumps({"trials": []}))
    stand_in = Trial()

    def run_trial(w, allocator, cap, dim, size, t, conf, plugin, extra_env):
        variant = conf_rounds.Variant(allocator, conf, plugin, tuple(extra_env.items()))
        return stand_in(variant, w, cap, dim, size, t)

    monkeypatch.setattr(trial, "run_trial", run_trial)
    monkeypatch.setattr(next_rounds, "gpu_listed", lambda: True)
    monkeypatch.setattr(next_rounds, "plugin_found", lambda: True)
    monkeypatch.setattr(trial, "host_facts", lambda: {"boot_id": BOOT})
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert next_rounds.main(["run", str(path), str(other), "--card-gib", "79.6", "--out-dir",
                             str(out_dir), "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert len(stand_in.calls) == 6
    assert f"The verdicts on the rows of 1 file(s) of {out_dir}, before and after pooling" in out
    assert ("| GPT-2-medium | 24 | batch | 4 | torch native | 2 (2 machines) -> 4 (3 machines) |"
            in out)
    assert (f"conf_rounds join {tmp_path}/results-conf-rounds/77d062bb-gpt2m-24-batch-4.json "
            f"{path} --pooled-with {other}") in out
    assert out.rstrip().endswith(
        "next rounds: runs ran on 1 row(s) (gpt2m 24 batch 4); 0 failed or did not fit")
    assert os.listdir(out_dir) == ["77d062bb-gpt2m-24-batch-4.json"]
    # A failed run makes the status 1; --rows 1 runs the first row only; no boot id, no run.
    stand_in.fail = "vramledger"
    monkeypatch.setattr(trial, "host_facts", lambda: {"boot_id": OTHER_BOOT})
    assert next_rounds.main(["run", str(path), "--card-gib", "79.6", "--out-dir", str(out_dir),
                             "--rounds", "1", "--rows", "1"]) == 1
    assert "1 failed or did not fit" in capsys.readouterr().out
    monkeypatch.setattr(trial, "host_facts", lambda: {"boot_id": None})
    with pytest.raises(SystemExit) as e:
        next_rounds.main(["run", str(path), "--card-gib", "79.6", "--out-dir", str(out_dir)])
    assert e.value.code == 2 and "boot id" in capsys.readouterr().err
    # Without a plugin the trials could load, nothing runs.
    monkeypatch.setattr(next_rounds, "plugin_found", lambda: False)
    with pytest.raises(SystemExit) as e:
        next_rounds.main(["run", str(path), "--card-gib", "79.6", "--out-dir", str(out_dir)])
    assert e.value.code == 2 and "run.sh steprounds" in capsys.readouterr().err


def test_the_plugin_is_found_where_vramledger_plugin_names_a_file(tmp_path, monkeypatch):
    plugin = tmp_path / "libvramledger_plugin.so"
    plugin.write_bytes(b"")
    monkeypatch.setattr(trial, "ROOT", str(tmp_path))  # a checkout without a built plugin
    monkeypatch.delenv("VRAMLEDGER_PLUGIN", raising=False)
    assert not next_rounds.plugin_found()
    monkeypatch.setenv("VRAMLEDGER_PLUGIN", str(tmp_path / "missing.so"))
    assert not next_rounds.plugin_found()
    monkeypatch.setenv("VRAMLEDGER_PLUGIN", str(plugin))
    assert next_rounds.plugin_found()


def test_the_results_docs_verdict_table_is_the_records_own():
    """docs/results/capacity-h200.md quotes the --verdicts table of the records beside it: it
    must be what the records give now (a round joined later changes both, or this fails)."""
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results"
    text = (docs / "capacity-h200.md").read_text()
    start = text.index("<!-- verdicts:")
    quoted = text[text.index("| workload", start):text.index("<!-- end of verdicts -->")].strip()
    pool = Results()
    pool.load([str(docs / "capacity-h200-results.json"),
               str(docs / "capacity-h100-step-rounds.json")])
    made = verdicts.verdicts_table(verdicts.comparisons(
        pool, sorted(pool.groups(), key=table.row_order), 64))
    assert quoted == made[made.index("| workload"):]


def test_runs_files_go_to_the_card_folder_the_records_use():
    """The join commands name the folder that keeps a card's runs files beside its results."""
    docs = os.path.join("docs", "results")
    for results, folder in (("capacity-h100-step-rounds.json", "capacity-h100-conf-rounds"),
                            ("capacity-h200-results.json", "capacity-h200-conf-rounds"),
                            ("mine.json", "mine-conf-rounds")):
        assert next_rounds.runs_folder(os.path.join(docs, results)) == os.path.join(docs, folder)
    for folder in ("capacity-h100-conf-rounds", "capacity-h200-conf-rounds"):
        repo = pathlib.Path(__file__).resolve().parents[2]
        assert (repo / docs / folder).is_dir(), folder
