"""benchmarks/capacity/machines.py without a GPU: each machine's own step-round ratios, the
verdicts one machine's rounds decide, and leaving a machine's rounds out, on the stand-ins of
test_capacity_step_rounds."""

from __future__ import annotations

import math
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchmarks.capacity import __main__ as capacity_main  # noqa: E402
from benchmarks.capacity import machines, runner, step_rounds  # noqa: E402
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results  # noqa: E402
from test_capacity_bench import ALLOCS, LIMITS, Clock, StandIn, planned  # noqa: E402
from test_capacity_step_rounds import (EXPANDABLE, NATIVE, ROW, TORCHES, RoundRuns,  # noqa: E402
                                       run_rounds, searched)


def machine_lines(text: str) -> dict[str, list[str]]:
    """The per-machine table's lines by machine, each line's cells."""
    return {line.split(" | ")[4]: line.strip("| ").split(" | ")
            for line in text.splitlines() if line.startswith("| GPT-2-medium")}


def test_the_machines_table_gives_each_machines_ratios_by_median_and_total():
    """Five rounds: three on a boot id's machine, where vramledger's steady steps take 10% longer
    than both torch allocators' (in round 2 only its step 6, so its median ties and its total
    does not) and torch expandable's are torch native's; one on a labelled machine, where torch
    expandable's take 20% longer; one on a machine the records do not name, where vramledger runs
    out of memory. Lines go most rounds first; each cell is the machine's geometric mean by the
    median / by the total (its paired rounds)."""
    results = searched()
    run_rounds(results, RoundRuns({"torch": [0.5] * 5, "torch-expandable": [0.5] * 5,
                                   "vramledger": [0.55, 0.55, 0.5, 0.5, None]}), 5)
    boot = "77d062bb-d422-40d1-ba9b-3f9c6217a59f"
    for r in results.rounds.values():
        if r["round"] < 3:
            r["host"] = {"boot_id": boot}
        elif r["round"] == 3:
            r["machine"] = "second"
        if r["allocator"] == "vramledger" and r["round"] == 2:
            r["step_s"] = r["step_s"][:5] + [r["step_s"][5] * 1.4]  # step 6 only: 0.7 s
        if r["allocator"] == "torch-expandable" and r["round"] == 3:
            r["step_s"] = [x * 1.2 for x in r["step_s"]]
    text = machines.machines_table(results, [ROW], 64)
    head = text.splitlines()[0].split(" | ")
    assert head[4:] == ["machine", "card", NATIVE, EXPANDABLE, TORCHES + " |"]
    lines = machine_lines(text)
    assert list(lines) == ["77d062bb", "second", "not recorded"]  # the boot id's first part
    by_median = math.exp((2 * math.log(1.1) + math.log(1.0)) / 3)
    total = math.exp((2 * math.log(1.1) + math.log(2.2 / 2.0)) / 3)  # 0.5+0.5+0.5+0.7 over 2.0
    assert total == pytest.approx(1.1)
    cell = f"{by_median:.3f} / {total:.3f} (3)"
    assert cell == "1.066 / 1.100 (3)"
    assert lines["77d062bb"][5:] == ["stand-in", cell, cell, "1.000 / 1.000 (3)"]
    assert lines["second"][6:] == ["1.000 / 1.000 (1)", "0.833 / 0.833 (1)",
                                   "1.200 / 1.200 (1)"]
    # vramledger's run there did not fit: only torch's two pair.
    assert lines["not recorded"][6:] == ["-", "-", "1.000 / 1.000 (1)"]
    # A vramledger round whose record stops short counts by the median, not by the total.
    results.rounds[next(k for k, r in results.rounds.items() if r["allocator"] == "vramledger"
                        and r["round"] == 1)]["step_s"] = [9.0, 9.0, 0.55, 0.55, 0.55]
    lines = machine_lines(machines.machines_table(results, [ROW], 64))
    assert lines["77d062bb"][6] == f"{by_median:.3f} / {total:.3f} (3)"  # 1.1 and 1.1 remain
    results.rounds[next(k for k, r in results.rounds.items() if r["allocator"] == "vramledger"
                        and r["round"] == 0)]["step_s"] = [9.0, 9.0, 0.55]
    lines = machine_lines(machines.machines_table(results, [ROW], 64))
    assert lines["77d062bb"][6] == f"{by_median:.3f} / 1.100 (3)"  # one total left
    assert machines.machines_table(searched(), [ROW], 64).startswith("No step rounds")


def test_the_machines_table_orders_by_rounds_and_keeps_cards_and_labels_apart():
    """Six rounds: one on machine "a-1" (a label: kept whole), three on "z", two with no machine
    named, one of them on another card. The most rounds come first whatever the name; unnamed
    runs share a line per card; a boot id is cut to its first part, a label is not."""
    results = searched()
    run_rounds(results, RoundRuns({a: [0.5] * 6 for a in ALLOCATOR_ORDER}), 6)
    where = {0: "a-1", 1: "z", 2: "z", 3: "z", 4: None, 5: None}
    for r in results.rounds.values():
        if where[r["round"]]:
            r["machine"] = where[r["round"]]
        if r["round"] == 5:
            r["device"] = "NVIDIA H200"
    lines = machine_lines(machines.machines_table(results, [ROW], 64))
    assert list(lines) == ["z", "a-1", "not recorded"]
    assert [line[4:6] for line in machines.machines_table(
        results, [ROW], 64).splitlines()[2:] for line in [line.strip("| ").split(" | ")]] == [
        ["z", "stand-in"], ["a-1", "stand-in"], ["not recorded", "H200"],
        ["not recorded", "stand-in"]]
    # "Most rounds" is a machine's largest count of any one ratio, not their sum: "b" paired
    # three rounds of torch's two allocators alone (vramledger ran out of memory), "a" two
    # rounds of every ratio (six pairs in all).
    results = searched()
    run_rounds(results, RoundRuns({"torch": [0.5] * 5, "torch-expandable": [0.5] * 5,
                                   "vramledger": [0.5, 0.5, None, None, None]}), 5)
    for r in results.rounds.values():
        r["machine"] = "a" if r["round"] < 2 else "b"
    lines = machine_lines(machines.machines_table(results, [ROW], 64))
    assert list(lines) == ["b", "a"]
    assert lines["b"][6:] == ["-", "-", "1.000 / 1.000 (3)"]
    # A row whose vramledger runs are gone has no lines, though torch's two would pair.
    for k in [k for k, r in results.rounds.items() if r["allocator"] == "vramledger"]:
        del results.rounds[k]
    assert machines.machines_table(results, [ROW], 64).startswith("No step rounds")
    assert machines.short_machine("77d062bb-d422-40d1-ba9b-3f9c6217a59f") == "77d062bb"
    assert machines.short_machine("77d062bb-d422-40d1-ba9b-3f9c6217a59f-x") == (
        "77d062bb-d422-40d1-ba9b-3f9c6217a59f-x")  # a label that begins like a boot id
    assert machines.short_machine("node-b") == "node-b"
    assert machines.short_machine(None) == "not recorded"


def test_by_machine_prints_only_the_selected_rows_machines(tmp_path, capsys):
    path = tmp_path / "r.json"
    results = searched(str(path))
    run_rounds(results, RoundRuns({a: [0.5] * 2 for a in ALLOCATOR_ORDER}), 2)
    results.save()
    argv = ["--table-only", "--by-machine", "--resume", str(path)]
    assert capacity_main.main(argv + ["--workloads", "gpt2m", "--caps", "24"]) == 0
    out = capsys.readouterr().out
    assert "Each machine's step-round ratios" in out
    assert "| GPT-2-medium | 24 | batch | 4 | not recorded | stand-in | 1.000 / 1.000 (2) |" in out
    assert "Step time over rounds" not in out and "| retries per step" not in out
    assert capacity_main.main(argv + ["--workloads", "llama1b"]) == 0
    assert ("No search trials of the rows selected (workloads llama1b; caps any; dimensions "
            "batch, seq); step rounds are read at the size the searches found. The trials hold "
            "workloads gpt2m; caps 24.") in capsys.readouterr().out
    # Rows in the benchmark's order, whatever the flags' order; --caps and --dims select rows.
    seq = ("gpt2m", 24.0, "seq")
    runner.run_grid([seq], ALLOCS, StandIn(LIMITS), results, runner.Budget(1e9), planned,
                    log=lambda _: None)
    step_rounds.run_rounds([seq], 1, RoundRuns({a: [0.5] for a in ALLOCATOR_ORDER}), results,
                           runner.Budget(1e9, Clock()), log=lambda _: None)
    results.save()
    assert capacity_main.main(argv + ["--dims", "seq,batch"]) == 0
    dims = [line.split(" | ")[2] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| GPT-2-medium")]
    assert dims == ["batch", "seq"]
    for flag, value in (("--dims", "seq"), ("--caps", "80")):
        assert capacity_main.main(argv + [flag, value]) == 0
        dims = [line.split(" | ")[2] for line in capsys.readouterr().out.splitlines()
                if line.startswith("| GPT-2-medium")]
        assert dims == (["seq"] if flag == "--dims" else [])
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--by-machine", "--resume", str(path)])
    assert e.value.code == 2
    assert "--by-machine prints a table of --resume: it needs --table-only" in (
        capsys.readouterr().err)


BOOT_A = "77d062bb-d422-40d1-ba9b-3f9c6217a59f"
BOOT_B = "77e00000-d422-40d1-ba9b-3f9c6217a59f"


def rounds_on_machines(path=None) -> Results:
    """Four rounds of the row: rounds 0-1 on BOOT_A (vramledger 20% slower there), round 2 on
    BOOT_B, round 3 on a machine labelled "old" (by hand, before hosts were recorded)."""
    results = searched(path)
    run_rounds(results, RoundRuns({"torch": [0.5] * 4, "torch-expandable": [0.5] * 4,
                                   "vramledger": [0.6, 0.6, 0.5, 0.5]}), 4)
    for r in results.rounds.values():
        if r["round"] < 3:
            r["host"] = {"boot_id": BOOT_A if r["round"] < 2 else BOOT_B}
        else:
            r["machine"] = "old"
    return results


def test_without_machines_takes_out_the_runs_of_the_machines_named():
    results = rounds_on_machines()
    assert machines.without_machines(results, ["77d0", "OLD", "77D0"]) == [BOOT_A, "old"]
    assert {r["round"] for r in results.rounds.values()} == {2}
    assert len(results.rounds) == 3
    assert len(machine_lines(machines.machines_table(results, [ROW], 64))) == 1
    # A name matching no machine, or several, is refused and takes nothing out.
    results = rounds_on_machines()
    for names, needle in ((["77"], f"'77' names 2 machines of the step rounds; give more of its "
                                   f"boot id: {BOOT_A}, {BOOT_B}"),
                          (["zz"], "'zz' names no machine of the step rounds; they ran on "
                                   "77d062bb, 77e00000, old (runs that name no machine "
                                   "cannot be left out)"),
                          (["ol"], "'ol' names no machine")):  # a label is matched whole
        with pytest.raises(ValueError, match=re.escape(needle)):
            machines.without_machines(results, names)
        assert len(results.rounds) == 12
    with pytest.raises(ValueError, match="they ran on none named"):
        machines.without_machines(searched(), ["77d0"])


def test_the_command_line_leaves_out_a_machine_and_selects_rows(tmp_path, capsys):
    path = tmp_path / "r.json"
    rounds_on_machines(str(path)).save()
    argv = ["--table-only", "--resume", str(path)]
    assert capacity_main.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 1.095 (" in out  # vramledger / each torch: 1.2 in two rounds of four, by machine
    assert capacity_main.main(argv + ["--without-machines", "77d062bb"]) == 0
    out = capsys.readouterr().out
    assert "left out the step rounds of 77d062bb; 6 step-round run(s) remain" in out
    assert "| 1.095 (" not in out
    assert "| 1.000 (1.000 - 1.000) over 2 rounds | not above |" in out
    assert capacity_main.main(argv + ["--without-machines", "77d062bb", "--by-machine"]) == 0
    assert list(machine_lines(capsys.readouterr().out)) == ["77e00000", "old"]
    # The filters select the main tables' rows; --caps selects any cap unless given.
    assert capacity_main.main(argv + ["--dims", "seq"]) == 0
    assert "No search trials of the rows selected (workloads gpt2m, llama1b, llama1b-ckpt, " \
           "llama1b-lora; caps any; dimensions seq);" in capsys.readouterr().out
    assert capacity_main.main(argv + ["--caps", "24", "--workloads", "gpt2m"]) == 0
    assert "| GPT-2-medium | 24 | batch | 4 |" in capsys.readouterr().out
    for flags, needle in ((["--without-machines", "zz"], "--without-machines: 'zz' names no "
                                                        "machine"),
                          (["--without-machines", ","], "--without-machines: empty")):
        with pytest.raises(SystemExit) as e:
            capacity_main.main(argv + flags)
        assert e.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--without-machines", "old", "--resume", str(path)])
    assert e.value.code == 2
    assert "--without-machines prints a table of --resume: it needs --table-only" in (
        capsys.readouterr().err)


def test_the_one_machine_out_table_names_the_machine_a_verdict_rests_on():
    """Eleven rounds: ten on machine "quiet" where vramledger's step ties torch's, one on "slow"
    where it is 30% longer. All together the interval reaches above 1.02 (undecided); without
    "slow" it ties (not above): that verdict rests on "slow". Leaving out "quiet" would leave one
    round, too few for an interval: not tried."""
    results = searched()
    n = 11
    run_rounds(results, RoundRuns({"torch": [0.5] * n, "torch-expandable": [0.5] * n,
                                   "vramledger": [0.5] * 10 + [0.65]}), n)
    for r in results.rounds.values():
        r["machine"] = "slow" if r["round"] == 10 else "quiet"
    text = machines.one_machine_out_table(results, [ROW], 64)
    assert text.startswith("4 verdict(s) checked; leaving out one machine's rounds changes 4 "
                           "of them:")
    lines = [line.strip("| ").split(" | ") for line in text.splitlines()
             if line.startswith("| GPT-2-medium")]
    assert [line[4:6] for line in lines] == [[NATIVE, "median"], [NATIVE, "total"],
                                             [EXPANDABLE, "median"], [EXPANDABLE, "total"]]
    whole = step_rounds.interval([1.0] * 10 + [1.3], machines=["quiet"] * 10 + ["slow"])
    assert lines[0][6] == (f"undecided: {whole[0]:.3f} ({whole[1]:.3f} - {whole[2]:.3f}), "
                           f"11 rounds")
    assert lines[0][7:] == ["slow (1)", "not above: 1.000 (1.000 - 1.000), 10 rounds"]
    # A verdict no single machine decides is counted, not listed.
    for r in results.rounds.values():
        if r["allocator"] == "vramledger" and r["round"] == 10:
            r["step_s"] = [9.0, 9.0] + [0.5] * 4
    assert machines.one_machine_out_table(results, [ROW], 64) == (
        "4 verdict(s) checked; leaving out one machine's rounds changes none of them.")
    # Rounds on one named machine, or none named, leave no verdict to check.
    for r in results.rounds.values():
        r["machine"] = "quiet"
    assert machines.one_machine_out_table(results, [ROW], 64).startswith("No verdict to check")
    for r in results.rounds.values():
        del r["machine"]
    assert machines.one_machine_out_table(results, [ROW], 64).startswith("No verdict to check")
    assert machines.one_machine_out_table(searched(), [ROW], 64).startswith("No verdict to check")


def test_by_machine_prints_the_verdicts_one_machine_decides(tmp_path, capsys):
    path = tmp_path / "r.json"
    rounds_on_machines(str(path)).save()
    assert capacity_main.main(["--table-only", "--by-machine", "--resume", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.index("Each machine's step-round ratios") < out.index(
        "The verdicts on vramledger's step that change when one machine's rounds are left out")
    assert "4 verdict(s) checked; leaving out one machine's rounds changes" in out
    assert "| 77d062bb (2) | not above: 1.000 (1.000 - 1.000), 2 rounds |" in out


def test_table_only_prints_the_rows_the_filters_select_at_any_cap_unless_given(tmp_path, capsys):
    """Trials at caps 24 and 11: without --caps both rows print, as before the filters; --caps and
    --workloads leave out the rows they do not name."""
    path = tmp_path / "r.json"
    results = rounds_on_machines(str(path))
    limits = {(w, a, 11.0, d): n for (w, a, _, d), n in LIMITS.items()}
    runner.run_grid([("gpt2m", 11.0, "batch")], ALLOCS, StandIn(limits), results,
                    runner.Budget(1e9), planned, log=lambda _: None)
    results.save()
    argv = ["--table-only", "--resume", str(path)]
    assert capacity_main.main(argv) == 0
    out = capsys.readouterr().out
    assert "| GPT-2-medium | 11 | batch | 4 |" in out and "| GPT-2-medium | 24 | batch | 4 |" in out
    assert capacity_main.main(argv + ["--caps", "24"]) == 0
    out = capsys.readouterr().out
    assert "| GPT-2-medium | 11 |" not in out and "| GPT-2-medium | 24 | batch | 4 |" in out
    assert capacity_main.main(argv + ["--caps", "11"]) == 0
    out = capsys.readouterr().out
    assert "| GPT-2-medium | 24 |" not in out and "| GPT-2-medium | 11 | batch | 4 |" in out
    assert capacity_main.main(argv + ["--caps", "80"]) == 0
    assert "The trials hold workloads gpt2m; caps 11, 24." in capsys.readouterr().out


def interval_by_machines(rule):
    """A stand-in for step_rounds.interval whose bounds depend only on the machines resampled:
    `rule(machines)` is True for "not above" (upper end 1.01), False for undecided (1.03)."""
    def interval(ratios, *, machines=None, **_):
        return (1.0, 0.99, 1.01) if rule(machines) else (1.0, 0.99, 1.03)
    return interval


def test_one_verdict_that_several_machines_decide_counts_once(monkeypatch):
    """Three machines, two rounds each; a verdict is "not above" only with all three: leaving out
    any one changes it, a line per machine, but it is one verdict changed."""
    results = searched()
    run_rounds(results, RoundRuns({a: [0.5] * 6 for a in ALLOCATOR_ORDER}), 6)
    for r in results.rounds.values():
        r["machine"] = "abc"[r["round"] // 2]
    monkeypatch.setattr(step_rounds, "interval",
                        interval_by_machines(lambda on: len(set(on)) == 3))
    text = machines.one_machine_out_table(results, [ROW], 64)
    assert text.startswith("4 verdict(s) checked; leaving out one machine's rounds changes 4 of "
                           "them:")
    lines = [line.strip("| ").split(" | ") for line in text.splitlines()
             if line.startswith("| GPT-2-medium")]
    assert len(lines) == 12
    assert [line[7] for line in lines[:3]] == ["a (2)", "b (2)", "c (2)"]


def test_rounds_that_name_no_machine_are_never_left_out(monkeypatch):
    """Three rounds on machine "a", three naming none: only "a" is left out; without it the
    unnamed rounds remain, and the verdict (here "not above" while any unnamed round is resampled)
    stands."""
    results = searched()
    run_rounds(results, RoundRuns({a: [0.5] * 6 for a in ALLOCATOR_ORDER}), 6)
    for r in results.rounds.values():
        if r["round"] < 3:
            r["machine"] = "a"
    monkeypatch.setattr(step_rounds, "interval", interval_by_machines(lambda on: None in on))
    assert machines.one_machine_out_table(results, [ROW], 64) == (
        "4 verdict(s) checked; leaving out one machine's rounds changes none of them.")


def test_a_label_named_whole_wins_over_a_boot_id_it_begins():
    results = rounds_on_machines()
    for r in results.rounds.values():
        if r.get("machine") == "old":
            r["machine"] = "77d0"  # a label that is also the start of BOOT_A
    assert machines.without_machines(results, ["77d0"]) == ["77d0"]
    assert {r["round"] for r in results.rounds.values()} == {0, 1, 2}


def test_the_command_line_says_when_a_machine_left_out_ran_none_of_the_rows(tmp_path, capsys):
    """Round 2's runs (BOOT_B's) moved to a row without search trials, which no table prints:
    leaving BOOT_B out changes nothing printed, and the command says so; leaving BOOT_A out
    does change the tables, and no such line is printed."""
    path = tmp_path / "r.json"
    results = rounds_on_machines()
    for r in results.rounds.values():
        if r["round"] == 2:
            r["cap_gib"] = 80.0
    results.path = str(path)
    results.save()
    argv = ["--table-only", "--resume", str(path), "--without-machines"]
    assert capacity_main.main(argv + ["77e0,old"]) == 0
    out = capsys.readouterr().out
    assert ("77e00000 ran no step rounds of the rows selected: leaving it out changes none of "
            "these tables") in out
    assert "old ran no" not in out
    assert capacity_main.main(argv + ["77d0"]) == 0
    assert "ran no step rounds" not in capsys.readouterr().out


def test_the_report_names_the_cards_of_the_searches_and_of_the_step_rounds(tmp_path, capsys):
    path = tmp_path / "r.json"
    results = rounds_on_machines(str(path))
    for r in results.rounds.values():
        if r["round"] == 3:
            r["device"] = "NVIDIA H100 80GB HBM3"
    results.save()
    assert capacity_main.main(["--table-only", "--resume", str(path)]) == 0
    head = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("capacity searches")]
    assert len(head) == 1
    searched = {r.get("device") for r in results.records.values()}
    torch = {r.get("torch") for r in results.records.values()} | {
        r.get("torch") for r in results.rounds.values()}
    assert len(searched) == len(torch) == 1
    card, version = searched.pop(), torch.pop()
    assert head[0].startswith(
        f"capacity searches ({card}, torch {version}); step rounds (NVIDIA H100 80GB HBM3, "
        f"torch {version}: 3 runs; {card}, torch {version}: 9 runs); planner")


def test_table_only_without_files_or_without_the_package_is_a_usage_error(tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.delenv("CAPACITY_RESUME", raising=False)
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--table-only"])
    assert e.value.code == 2
    assert "--table-only prints the tables of the --resume files" in capsys.readouterr().err
    path = tmp_path / "r.json"
    rounds_on_machines(str(path)).save()
    real = capacity_main.importlib.util.find_spec
    monkeypatch.setattr(capacity_main.importlib.util, "find_spec",
                        lambda name, *rest: None if name == "vramledger" else real(name, *rest))
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--table-only", "--resume", str(path)])
    assert e.value.code == 2
    assert "the vramledger package cannot be imported" in capsys.readouterr().err


def test_unnamed_as_one_counts_the_runs_that_name_no_machine_as_one(tmp_path, capsys):
    """Rounds 0-1 on BOOT_A, rounds 2-3 naming no machine: the interval counts three machines
    (BOOT_A and each unnamed round); with --unnamed-as-one, two."""
    path = tmp_path / "r.json"
    results = rounds_on_machines(str(path))
    for r in results.rounds.values():
        r.pop("machine", None)
        if r["round"] >= 2:
            r.pop("host", None)
        else:
            r["host"] = {"boot_id": BOOT_A}
    results.save()
    argv = ["--table-only", "--resume", str(path)]
    assert capacity_main.main(argv) == 0
    assert "over 4 rounds, 3 machines (2 unknown) |" in capsys.readouterr().out
    assert capacity_main.main(argv + ["--unnamed-as-one"]) == 0
    out = capsys.readouterr().out
    assert "counted the 6 step-round run(s) that name no machine as one machine, 'unnamed'" in out
    assert "over 4 rounds, 2 machines |" in out
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--unnamed-as-one", "--resume", str(path)])
    assert e.value.code == 2
    assert "--unnamed-as-one prints a table of --resume: it needs --table-only" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("flags, named", [
    (["--allocators", "vramledger,torch"], "--allocators"),
    (["--step-rounds", "3"], "--step-rounds"),
    (["--traces", "traces-out"], "--traces"),
])
def test_table_only_refuses_the_flags_that_pick_trials(tmp_path, capsys, flags, named):
    """--table-only runs no trial: a flag that only picks trials is refused (status 2) by name
    instead of being ignored; --allocators naming all three, in any order, is what it prints."""
    path = tmp_path / "r.json"
    rounds_on_machines(str(path)).save()
    with pytest.raises(SystemExit) as e:
        capacity_main.main(["--table-only", "--resume", str(path), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{named} picks what trials run; --table-only runs none" in err
    assert not (tmp_path / "traces-out").exists()
    assert capacity_main.main(["--table-only", "--resume", str(path), "--allocators",
                               "vramledger,torch-expandable,torch"]) == 0
