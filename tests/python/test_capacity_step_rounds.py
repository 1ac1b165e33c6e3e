"""benchmarks/capacity's repeated step-time comparison without a GPU: the rounds' rotating order,
their resume, the bootstrap interval and the tables, driven by test_capacity_bench's stand-in
trial (the searches) and a stand-in for the rounds' runs."""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchmarks.capacity import __main__ as capacity_main  # noqa: E402
from benchmarks.capacity import coverage, runner, step_rounds, table, trial  # noqa: E402
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results  # noqa: E402
from test_capacity_bench import ALLOCS, LIMITS, Clock, StandIn, planned  # noqa: E402

ROW = ("gpt2m", 24.0, "batch")  # all three fit batch 4 (torch native's limit)
COUNTERS = ("step_device_alloc", "step_device_free", "step_sync_all_streams",
            "step_alloc_retries")


def searched(path=None) -> Results:
    """Results holding the row's finished searches."""
    results = Results(path)
    runner.run_grid([ROW], ALLOCS, StandIn(LIMITS), results, runner.Budget(1e9), planned,
                    log=lambda _: None)
    assert table.common_size(results, *ROW, ALLOCATOR_ORDER, 64) == 4
    return results


class RoundRuns:
    """Stands in for the rounds' runs: the n-th run of an allocator has steady steps of
    `steady[allocator][n]` s (None: it runs out of memory) after two warm steps of 9 s, and the
    per-step counters (and vramledger's own per-step figures) when `counters` is set."""

    def __init__(self, steady, counters=True, trial_s=20.0):
        self.steady, self.counters, self.trial_s = steady, counters, trial_s
        self.clock = Clock()
        self.calls = []

    def __call__(self, workload, allocator, cap, dim, size, timeout_s):
        n = sum(c[1] == allocator for c in self.calls)
        self.calls.append((workload, allocator, cap, dim, size))
        self.clock.now += self.trial_s
        t = self.steady[allocator][n]
        if t is None:
            return {"fits": False, "oom": True, "step_s": [9.0], "retries": 1}
        r = {"fits": True, "oom": False, "step_s": [9.0, 9.0] + [t] * 4, "median_step_s": t,
             "retries": 0, "device": "stand-in", "torch": "none"}
        if self.counters:  # allocator index i: i allocs per step, one free in each warm step
            i = ALLOCATOR_ORDER.index(allocator)
            r.update(step_device_alloc=[i] * 6, step_device_free=[1, 1, 0, 0, 0, 0],
                     step_sync_all_streams=[0, 0, 0, 0, 0, i], step_alloc_retries=[0] * 6)
            if allocator == "vramledger":  # its n-th run: 2n waits of 1.5 ms in the last step
                r.update(step_driver_ms=[45.0, 35.0, 1.0, 1.0, 2.0, 4.0],
                         step_waits=[0, 0, 0, 0, 0, 2 * n],
                         step_wait_ms=[0.0, 0.0, 0.0, 0.0, 0.0, 3.0 * n],
                         step_cu_mem_map=[100, 50, 2, 0, 0, 2],
                         step_cu_mem_unmap=[0, 10, 1, 1, 0, 0],
                         step_take_backs=[0, 5, 3, 3, 3, 3])
        return r


def run_rounds(results, stand_in, rounds, budget_s=1e9):
    step_rounds.run_rounds([ROW], rounds, stand_in, results,
                           runner.Budget(budget_s, stand_in.clock), log=lambda _: None)


def test_each_round_rotates_which_allocator_runs_first():
    assert [step_rounds.order(r) for r in range(4)] == [
        ["torch", "torch-expandable", "vramledger"],
        ["torch-expandable", "vramledger", "torch"],
        ["vramledger", "torch", "torch-expandable"],
        ["torch", "torch-expandable", "vramledger"]]
    results = searched()
    search_records = json.dumps(results.records, sort_keys=True)
    runs = RoundRuns({a: [0.5] * 3 for a in ALLOCATOR_ORDER})
    run_rounds(results, runs, 3)
    assert [c[1] for c in runs.calls] == sum((step_rounds.order(r) for r in range(3)), [])
    assert {c[4] for c in runs.calls} == {4}  # at the size all three fit
    assert sorted((r["allocator"], r["round"]) for r in results.rounds.values()) == sorted(
        (a, r) for a in ALLOCATOR_ORDER for r in range(3))
    # The searches' records (batch 4's of each allocator among them) are left as they were.
    assert json.dumps(results.records, sort_keys=True) == search_records


def test_rounds_resume_from_the_file_without_running_a_run_twice(tmp_path):
    path = str(tmp_path / "r.json")
    results = searched(path)
    first = RoundRuns({a: [0.5] * 5 for a in ALLOCATOR_ORDER})
    # 30 s expected for the first run, 20 s after: 4 runs in 90 s.
    run_rounds(results, first, 3, budget_s=90.0)
    assert [c[1] for c in first.calls] == ["torch", "torch-expandable", "vramledger",
                                           "torch-expandable"]
    saved = json.loads(pathlib.Path(path).read_text())
    assert len(saved["step_rounds"]) == 4 and len(saved["trials"]) == len(results.records)

    resumed = Results(str(tmp_path / "r2.json"))
    assert resumed.load([path]) == len(results.records) and len(resumed.rounds) == 4
    rest = RoundRuns({a: [0.5] * 5 for a in ALLOCATOR_ORDER})
    run_rounds(resumed, rest, 3)
    assert [c[1] for c in rest.calls] == ["vramledger", "torch", "vramledger", "torch",
                                          "torch-expandable"]  # round 1's rest, then round 2
    again = RoundRuns({a: [0.5] * 5 for a in ALLOCATOR_ORDER})
    run_rounds(resumed, again, 3)
    assert again.calls == []
    run_rounds(resumed, again, 4)  # one more round: round 3, which starts as round 0 does
    assert [c[1] for c in again.calls] == step_rounds.order(3)
    # Nor does a search run again.
    search_again = StandIn(LIMITS)
    runner.run_grid([ROW], ALLOCS, search_again, resumed, runner.Budget(1e9), planned,
                    log=lambda _: None)
    assert search_again.calls == []


def test_a_file_without_step_rounds_still_loads_and_a_bad_list_is_an_error(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"trials": list(searched().records.values())}))
    results = Results()
    assert results.load([str(old)]) > 0 and results.rounds == {}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"trials": [], "step_rounds": {"round": 0}}))
    with pytest.raises(ValueError, match="step_rounds"):
        Results().load([str(bad)])


def test_files_that_number_two_runs_alike_are_refused_and_a_resumed_copy_is_not(tmp_path):
    """Pooled files key a step round by its row, allocator and round: a second run under the
    same number would replace the first without a word, so loading them is an error naming
    both files; the same record in both (a resumed file's copy) loads as one."""
    run = {"workload": "llama1b", "allocator": "torch", "cap_gib": 24.0, "dim": "batch",
           "size": 1, "round": 3, "fits": True, "step_s": [0.3] * 6}
    first, copy, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"trials": [], "step_rounds": [run]}))
    copy.write_text(json.dumps({"trials": [], "step_rounds": [dict(run)]}))
    other.write_text(json.dumps({"trials": [], "step_rounds": [dict(run, step_s=[0.4] * 6)]}))
    pooled = Results()
    pooled.load([str(first), str(copy)])
    assert list(pooled.rounds.values()) == [run]
    with pytest.raises(ValueError) as e:
        Results().load([str(first), str(other)])
    said = str(e.value)
    assert said.startswith(f"{other}: step round 3 of llama1b torch at 24 GiB, batch 1, is "
                           f"also in {first} with other figures")
    # Another round, allocator or row is another key: no collision.
    for change in ({"round": 4}, {"allocator": "vramledger"}, {"size": 2}):
        other.write_text(json.dumps({"trials": [], "step_rounds": [dict(run, **change)]}))
        both = Results()
        both.load([str(first), str(other)])
        assert len(both.rounds) == 2, change


def test_the_bootstrap_interval_of_fixed_ratios():
    """Resampling three ratios a < b < c, the mean of logs is a's alone 1/27 of the time (3.7%)
    and the next smallest, (2 log a + log b) / 3, 3/27 more: the 5th percentile is that one, the
    95th (log b + 2 log c) / 3. Two ratios: each end is 1/4 of the resamples."""
    a, b, c = 0.9, 1.0, 1.2
    gm, low, high = step_rounds.bootstrap_interval([b, c, a])
    assert gm == pytest.approx((a * b * c) ** (1 / 3))
    assert low == pytest.approx(math.exp((2 * math.log(a) + math.log(b)) / 3))
    assert high == pytest.approx(math.exp((math.log(b) + 2 * math.log(c)) / 3))
    # Seeded: the same every time.
    assert step_rounds.bootstrap_interval([b, c, a]) == (gm, low, high)
    assert step_rounds.bootstrap_interval([a, c])[1:] == pytest.approx((a, c))
    assert step_rounds.bootstrap_interval([1.03] * 4) == pytest.approx((1.03, 1.03, 1.03))
    assert step_rounds.bootstrap_interval([1.1]) is None
    assert step_rounds.bootstrap_interval([]) is None
    with pytest.raises(ValueError, match="positive"):
        step_rounds.bootstrap_interval([1.0, 0.0])


def test_rounds_of_several_machines_are_resampled_by_machine_then_round():
    """Two machines, one fast and one slow, six rounds each that agree within the machine: the
    rounds' own bootstrap sees twelve independent rounds and a narrow interval; resampled by
    machine, a resample is all of one machine a quarter of the time each way, so the interval
    reaches both machines' ratios."""
    ratios = [1.00] * 6 + [1.10] * 6
    machines = ["a"] * 6 + ["b"] * 6
    gm, low, high = step_rounds.bootstrap_interval(ratios)
    assert high - low < 0.06
    clustered = step_rounds.bootstrap_interval(ratios, machines=machines)
    assert clustered[0] == pytest.approx(gm)
    assert clustered[1:] == pytest.approx((1.00, 1.10))
    assert step_rounds.bootstrap_interval(ratios, machines=machines) == clustered  # seeded
    # One machine, a machine per ratio or none known: the rounds' own bootstrap, exactly.
    for same in (["a"] * 12, list("abcdefghijkl"), [None] * 12):
        assert step_rounds.bootstrap_interval(ratios, machines=same) == (gm, low, high)
    # A ratio of unknown machine is a machine of its own beside the named ones.
    # Three machines: all-a or all-b resamples are 1/27 each, the bounds near either machine's.
    mixed = step_rounds.bootstrap_interval(ratios + [1.05], machines=machines + [None])
    plain = step_rounds.bootstrap_interval(ratios + [1.05])
    assert mixed[1] < 1.01 < plain[1] and plain[2] < 1.09 < mixed[2]
    with pytest.raises(ValueError, match="2 machines for 12 ratios"):
        step_rounds.bootstrap_interval(ratios, machines=["a", "b"])


def test_each_drawn_machines_rounds_are_resampled_too():
    """Three machines alike, each with rounds of 1.0 and 1.2: drawing machines alone would give
    every resample the same mean; drawing each machine's rounds as well spreads them."""
    ratios, machines = [1.0, 1.2] * 3, ["a", "a", "b", "b", "c", "c"]
    gm, low, high = step_rounds.bootstrap_interval(ratios, machines=machines)
    assert low < gm < high
    assert step_rounds.machines_note(machines) == ", 3 machines"
    assert step_rounds.machines_note(["a", "a", None, None]) == ", 3 machines (2 unknown)"
    assert step_rounds.machines_note(["a", "a"]) == step_rounds.machines_note([None] * 3) == ""


def test_the_t_interval_over_rounds_and_over_machines():
    """Over rounds: the mean of the logs plus or minus t(0.95, n - 1) standard errors (2.919986
    for three rounds). Over machines: two machines of six rounds each, all 1.00 on one and all
    1.10 on the other: the machines' means 0 and d (d = log 1.1), their mean d / 2 and standard
    error d / 2 (the rounds' cluster-robust error with the G / (G - 1) factor, as every machine
    has as many rounds), over 1 degree of freedom (6.313752)."""
    a, b, c = 0.9, 1.0, 1.2
    logs = [math.log(x) for x in (a, b, c)]
    mean = sum(logs) / 3
    half = 2.919986 * statistics.stdev(logs) / math.sqrt(3)
    assert step_rounds.t_interval([b, c, a]) == pytest.approx(
        (math.exp(mean), math.exp(mean - half), math.exp(mean + half)))
    d = math.log(1.1)
    clustered = step_rounds.t_interval([1.0] * 6 + [1.1] * 6, machines=["a"] * 6 + ["b"] * 6)
    assert clustered == pytest.approx(
        (math.exp(d / 2), math.exp(d / 2 - 6.313752 * d / 2), math.exp(d / 2 + 6.313752 * d / 2)))
    # Machines of unequal rounds: each machine's mean log counts once. Nine rounds of 1.00 on
    # machine a, one of 1.10 on b, one of 1.21 on c: the means 0, d and 2 d, their mean d (stdev
    # d) over 2 degrees of freedom (2.919986), the estimate d. The rounds' own mean is 3 d / 11,
    # with a cluster-robust error of 0.34 d: the mean sits on a. A round whose machine is unknown
    # counts as a machine of its own.
    ratios, machines = [1.0] * 9 + [1.1, 1.21], ["a"] * 9 + ["b", "c"]
    unequal = step_rounds.t_interval(ratios, machines=machines)
    half = 2.919986 * d / math.sqrt(3)
    assert unequal == pytest.approx((math.exp(d), math.exp(d - half), math.exp(d + half)))
    assert step_rounds.t_interval(ratios, machines=machines[:9] + ["b", None]) == unequal
    # interval() spans it and the bootstrap's, whose estimate (over every round) it keeps.
    spanned = step_rounds.interval(ratios, machines=machines)
    boot = step_rounds.bootstrap_interval(ratios, machines=machines)
    assert spanned == (boot[0], min(boot[1], unequal[1]), max(boot[2], unequal[2]))
    assert spanned[0] == pytest.approx(math.exp(3 * d / 11))
    # One machine, or one per ratio: over the rounds.
    assert step_rounds.t_interval([b, c, a], machines=["x"] * 3) == step_rounds.t_interval(
        [b, c, a], machines=["x", "y", None])
    assert step_rounds.t_interval([1.03] * 4) == pytest.approx((1.03, 1.03, 1.03))
    assert step_rounds.t_interval([1.1]) is None
    with pytest.raises(ValueError, match="positive"):
        step_rounds.t_interval([1.0, -1.0])
    with pytest.raises(ValueError, match="1 machines for 2 ratios"):
        step_rounds.t_interval([1.0, 1.1], machines=["a"])


def test_the_interval_is_the_wider_of_the_bootstrap_and_t():
    """Three rounds: the t interval is the wider at both ends, and the verdict follows it (a
    bootstrap upper end under 1.02, a t upper end above). Two machines of six rounds each,
    resampled by machine: each end is the wider of the two."""
    ratios = [1.005, 1.012, 1.016]
    boot, student = step_rounds.bootstrap_interval(ratios), step_rounds.t_interval(ratios)
    assert student[1] < boot[1] and boot[2] < 1.02 < student[2]
    assert step_rounds.interval(ratios) == (boot[0], student[1], student[2])
    assert step_rounds.verdict(boot) == "not above"
    assert step_rounds.verdict(step_rounds.interval(ratios)) == "undecided"
    ratios, machines = [1.00, 1.02] * 3 + [1.08, 1.10] * 3, ["a"] * 6 + ["b"] * 6
    both = (step_rounds.bootstrap_interval(ratios, machines=machines),
            step_rounds.t_interval(ratios, machines=machines))
    assert step_rounds.interval(ratios, machines=machines) == pytest.approx(
        (both[0][0], min(x[1] for x in both), max(x[2] for x in both)))
    assert step_rounds.interval([1.1]) is None
    # Six machines alike, each with a round of 0.9 and one of 1.1: the machines' means agree, so t
    # over the machines is narrow, while the bootstrap draws each machine's rounds too and spreads
    # wider: interval() keeps the bootstrap's ends.
    ratios = [0.9, 1.1] * 6
    machines = [m for m in "abcdef" for _ in range(2)]
    boot = step_rounds.bootstrap_interval(ratios, machines=machines)
    student = step_rounds.t_interval(ratios, machines=machines)
    assert boot[1] < student[1] and student[2] < boot[2]
    assert step_rounds.interval(ratios, machines=machines) == boot
    # The level reaches both: a 50% interval is narrower than the 90% one at both ends.
    ratios = [1.005, 1.012, 1.016, 0.99]
    half, ninety = step_rounds.interval(ratios, level=0.5), step_rounds.interval(ratios)
    assert ninety[1] < half[1] and half[2] < ninety[2]
    assert half == step_rounds.span(step_rounds.bootstrap_interval(ratios, level=0.5),
                                     step_rounds.t_interval(ratios, level=0.5))
    assert step_rounds.t_interval(ratios, level=0.5)[2] < step_rounds.t_interval(ratios)[2]


def test_the_interval_holds_the_true_ratio_about_as_often_as_it_says():
    """Log-normal rounds around a true ratio of 1: over 3 rounds the 90% bootstrap interval alone
    holds it in well under 90% of the trials, the interval the tables give in about 90% (Student's
    t is exact for normal logs)."""
    figures = coverage.coverage(3, trials=300, resamples=400)
    assert figures["bootstrap"] < 0.75
    assert 0.85 <= figures["interval"] <= 0.95
    # Three machines of four rounds each, the machines apart as much as the rounds: resampling
    # three machines, the bootstrap falls short again; the t interval over the machines holds.
    figures = coverage.coverage(4, machines=3, trials=300, resamples=400)
    assert figures["bootstrap"] < 0.82
    assert figures["interval"] >= 0.85
    # One machine of 16 rounds and six of one, as GPT-2-medium's 80 GiB sequence row: the t
    # interval over the machines' means holds; the rounds' cluster-robust one held in 0.50.
    figures = coverage.coverage([16, 1, 1, 1, 1, 1, 1], trials=300, resamples=400)
    assert figures["t"] >= 0.85 and figures["interval"] >= 0.85


def test_the_coverage_command(capsys):
    assert coverage.main(["--rounds", "3", "--trials", "20", "--resamples", "100"]) == 0
    out = capsys.readouterr().out
    assert "| N | bootstrap alone | Student's t alone | the tables' interval (spanning both) |" in out
    assert out.strip().splitlines()[-1].startswith("| 3 | ")
    for args, message in ((["--rounds", "1"], "2 or more rounds in all"),
                          (["--trials", "0"], "--trials must be at least 1"),
                          (["--spread", "0"], "--spread must be above 0"),
                          (["--machines", "0"], "--machines must be at least 1"),
                          (["--machines", "2", "--machine-spread", "-1"],
                           "--machine-spread must be 0 or more"),
                          (["--machine-spread", "0.1"], "it needs --machines 2 or more"),
                          (["--resamples", "99"], "--resamples must be at least 100"),
                          (["--machine-rounds", "3", "2", "--rounds", "3"],
                           "leave out --rounds and --machines"),
                          (["--machine-rounds", "3", "2", "--machines", "2"],
                           "leave out --rounds and --machines"),
                          (["--machine-rounds", "3", "2", "--machines", "1"],
                           "leave out --rounds and --machines"),
                          (["--machine-rounds", "5"], "2 or more machines of 1 or more rounds"),
                          (["--machine-rounds", "3", "0"],
                           "2 or more machines of 1 or more rounds")):
        with pytest.raises(SystemExit) as exit_:
            coverage.main(args)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_coverage_with_heavy_tails(capsys):
    """--tails t3: the log draws from Student's t of 3 degrees of freedom, scaled to the same
    standard deviation; normal draws stay those of the seed."""
    import random
    rng = random.Random(1)
    xs = [coverage.draw(rng, 0.02, "t3") for _ in range(20000)]
    sd = (sum(x * x for x in xs) / len(xs)) ** 0.5
    assert 0.017 < sd < 0.023  # t3's sample spread converges slowly: no fourth moment
    far = sum(abs(x) > 4 * 0.02 for x in xs) / len(xs)  # beyond 4 sd: normal 6e-5, t3 ~ 0.6%
    assert 0.003 < far < 0.012
    normal = coverage.coverage([4, 3, 1], trials=40, resamples=100)
    assert normal == coverage.coverage([4, 3, 1], trials=40, resamples=100, tails="normal")
    heavy = coverage.coverage([4, 3, 1], trials=40, resamples=100, tails="t3")
    assert heavy != normal and all(0 <= heavy[k] <= 1 for k in coverage.KINDS)
    assert coverage.main(["--machine-rounds", "4", "3", "1", "--trials", "40", "--resamples",
                          "100", "--tails", "t3"]) == 0
    out = capsys.readouterr().out
    assert "Student's t of 3 degrees of freedom in the log" in out
    assert out.strip().splitlines()[-1] == (
        "| 8 | " + " | ".join(f"{heavy[k]:.3f}" for k in coverage.KINDS) + " |")
    with pytest.raises(SystemExit) as exit_:
        coverage.main(["--tails", "cauchy"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_coverage_of_machines_of_unequal_rounds(capsys):
    """--machine-rounds: machines of the rounds it names. Equal ones draw what --machines does
    (the same draws for a seed); the line counts the rounds in all and names each machine's."""
    assert (coverage.coverage([4, 4, 4], trials=50, resamples=100)
            == coverage.coverage((4, 4, 4), trials=50, resamples=100)
            == coverage.coverage(4, machines=3, trials=50, resamples=100))
    assert coverage.main(["--machine-rounds", "8", "3", "1", "--trials", "20",
                          "--resamples", "100"]) == 0
    out = capsys.readouterr().out
    assert "3 machines (spread 0.02) of 8 / 3 / 1 rounds, N in all" in out
    figures = coverage.coverage([8, 3, 1], trials=20, resamples=100)
    assert out.strip().splitlines()[-1] == (
        "| 12 | " + " | ".join(f"{figures[k]:.3f}" for k in coverage.KINDS) + " |")


def test_the_rounds_table_resamples_rounds_of_several_machines_by_machine():
    """Six rounds on three machines, two each: the table's interval is interval()'s by machine,
    not the rounds' own, and says over how many machines."""
    vl = [0.50, 0.51, 0.55, 0.56, 0.49, 0.50]
    results = searched()
    run_rounds(results, RoundRuns({"torch": [0.5] * 6, "torch-expandable": [0.5] * 6,
                                   "vramledger": vl}), 6)
    boots = ["a", "a", "b", "b", "c", "c"]
    for r in results.rounds.values():
        r["host"] = {"boot_id": boots[r["round"]]}
    ratios = [t / 0.5 for t in vl]
    bounds = step_rounds.interval(ratios, machines=boots)
    assert bounds[1:] != step_rounds.interval(ratios)[1:]
    rows = row_cells(step_rounds.rounds_table(results, [ROW], 64))
    assert rows["torch native"][9] == (
        "{:.3f} ({:.3f} - {:.3f}) over 6 rounds, 3 machines".format(*bounds))


def test_a_runs_machine_is_its_boot_id_else_its_label():
    assert step_rounds.machine({"host": {"boot_id": "b1"}, "machine": "first"}) == "b1"
    assert step_rounds.machine({"host": None, "machine": "first"}) == "first"
    assert step_rounds.machine({"device": "H100"}) is None
    h100 = {"device": "H100"}
    assert step_rounds.same_machine(dict(h100, machine="first"), dict(h100, machine="first"))
    assert not step_rounds.same_machine(dict(h100, machine="first"),
                                        dict(h100, machine="second"))
    assert not step_rounds.same_machine(dict(h100, machine="first"),
                                        dict(h100, host={"boot_id": "b1"}))
    assert step_rounds.cards([dict(h100, machine="first"), dict(h100, machine="second"),
                              h100]) == "H100 on 2 machines and 1 run of unknown machines"


def test_the_verdict_reads_the_interval_against_two_percent():
    assert step_rounds.verdict((0.99, 0.96, 1.02)) == "not above"
    assert step_rounds.verdict((1.01, 0.99, 1.03)) == "undecided"
    assert step_rounds.verdict((1.05, 1.021, 1.08)) == "above"
    assert step_rounds.verdict(None) == "too few rounds"


def row_cells(text: str) -> dict[str, list[str]]:
    return {line.split(" | ")[4]: line.strip("| ").split(" | ")
            for line in text.splitlines() if line.startswith("| GPT-2-medium")}


def test_the_rounds_table_with_the_per_step_counters():
    # vramledger's third run runs out of memory: its ratios pair two rounds.
    steady = {"torch": [0.50, 0.52, 0.51], "torch-expandable": [0.40, 0.41, 0.40],
              "vramledger": [0.49, 0.53, None]}
    results = searched()
    run_rounds(results, RoundRuns(steady), 3)
    rows = row_cells(step_rounds.rounds_table(results, [ROW], 64))
    torch, expandable, vl = rows["torch native"], rows["torch expandable"], rows["vramledger"]
    assert torch[5:9] == ["3 of 3", "0.500 0.520 0.510", "0.510", "0.00 / 0.00 / 0.00 / 0.00"]
    assert vl[5:9] == ["2 of 3", "0.490 0.530 -", "0.510", "2.00 / 0.00 / 0.50 / 0.00"]
    assert expandable[8] == "1.00 / 0.00 / 0.25 / 0.00"
    # Two rounds, 0.980 and 1.019: within 2% of torch native each, but over 2 rounds Student's t
    # (1 degree of freedom) reaches well past 1.02: undecided.
    gm, low, high = step_rounds.interval([0.49 / 0.50, 0.53 / 0.52])
    assert high > 1.1
    assert torch[9:11] == [f"{gm:.3f} ({low:.3f} - {high:.3f}) over 2 rounds", "undecided"]
    assert expandable[9:11] == [
        "{:.3f} ({:.3f} - {:.3f}) over 2 rounds".format(
            *step_rounds.interval([0.49 / 0.40, 0.53 / 0.41])), "above"]
    assert vl[9:11] == ["-", "-"]
    # vramledger's own figures over its two fitting runs' 8 steady steps (runs 0 and 1: 0 and 2
    # waits; 4 maps, 2 unmaps and 12 take-backs each); torch's allocators have none.
    assert vl[11] == "2.00 / 0.25 / 0.38 / 1.00 / 0.50 / 3.00"
    assert torch[11] == expandable[11] == "-"
    assert vl[12] == torch[12] == "stand-in"  # the card, as the runs' records name it


def test_the_rounds_table_pairs_a_rounds_runs_only_on_one_machine():
    """Round 1's vramledger run names another machine (records joined from two machines' files
    under one round number): rounds 0 and 2 alone pair."""
    results = searched()
    run_rounds(results, RoundRuns({a: [0.5, 0.5, 0.5] for a in ALLOCATOR_ORDER}), 3)
    for r in results.rounds.values():
        r["host"] = {"boot_id": "a"}
        if r["allocator"] == "vramledger":
            r["step_s"] = [x * 1.05 for x in r["step_s"]]
            if r["round"] == 1:
                r["host"] = {"boot_id": "b"}
                r["step_s"] = [x * 0.5 for x in r["step_s"]]
    rows = row_cells(step_rounds.rounds_table(results, [ROW], 64))
    assert rows["torch native"][9:11] == ["1.050 (1.050 - 1.050) over 2 rounds", "above"]


NATIVE, EXPANDABLE = "vramledger / torch native", "vramledger / torch expandable"
TORCHES = "torch expandable / torch native"  # the steps table's third line per row


def test_the_steps_table_gives_each_steady_steps_ratio_over_the_rounds():
    """Four rounds, 0-1 on machine a and 2-3 on b: vramledger's step 3 is 10% slower than torch's
    in rounds 0 and 1 and 5% faster in round 2, its other steps tie; its round-3 run runs out of
    memory (no round 3 pairs, as in the rounds table), and round 1's torch expandable run names
    machine c (not paired with vramledger's)."""
    results = searched()
    steady = {"torch": [0.5] * 4, "torch-expandable": [0.5] * 4,
              "vramledger": [0.5, 0.5, 0.5, None]}
    run_rounds(results, RoundRuns(steady), 4)
    for r in results.rounds.values():
        r["host"] = {"boot_id": "a" if r["round"] < 2 else "b"}
        if r["allocator"] == "vramledger" and r["fits"]:
            r["step_s"][2] *= 0.95 if r["round"] == 2 else 1.10
        if r["allocator"] == "torch-expandable" and r["round"] == 1:
            r["host"] = {"boot_id": "c"}
    text = step_rounds.steps_table(results, [ROW], 64)
    rows = row_cells(text)
    assert set(rows) == {NATIVE, EXPANDABLE, TORCHES}
    cell = "{:.3f} ({:.3f} - {:.3f}), slower in {} of {}"
    native = step_rounds.interval([1.10, 1.10, 0.95], machines=["a", "a", "b"])
    expandable = step_rounds.interval([1.10, 0.95], machines=["a", "b"])
    assert native != step_rounds.interval([1.10, 1.10, 0.95])  # resampled by machine
    tie = "1.000 (1.000 - 1.000), slower in 0 of {}"
    assert rows[NATIVE][5:9] == [cell.format(*native, 2, 3)] + [tie.format(3)] * 3
    assert rows[EXPANDABLE][5:9] == [cell.format(*expandable, 1, 2)] + [tie.format(2)] * 3
    # The total of the four steady steps of 0.5 s: 2.05 s where step 3 took 10% longer, 1.975 s
    # where it took 5% less; the verdict is the rounds table's rule on that interval.
    slower, faster = 2.05 / 2.0, 1.975 / 2.0
    native_total = step_rounds.interval([slower, slower, faster], machines=["a", "a", "b"])
    expandable_total = step_rounds.interval([slower, faster], machines=["a", "b"])
    total = cell + ", {}"
    assert rows[NATIVE][9] == total.format(*native_total, 2, 3,
                                           step_rounds.verdict(native_total))
    assert rows[EXPANDABLE][9] == total.format(*expandable_total, 1, 2,
                                               step_rounds.verdict(expandable_total))
    assert native_total[0] == pytest.approx((slower * slower * faster) ** (1 / 3), abs=5e-4)
    assert step_rounds.verdict(native_total) == "undecided"  # upper end 1.025, above 1.02
    assert ("| step 3 (0.3) | step 4 (0.8) | step 5 (1.0) | step 6 (0.45) | steady steps' total |"
            in text.splitlines()[0])
    assert text.splitlines()[1] == "|---" * 10 + "|"


def test_the_steps_table_total_is_the_ratio_of_the_steady_steps_sums():
    """Steady steps of different lengths (0.3, 0.8, 1.0, 0.45 s under torch); vramledger's step 3
    takes 50% longer in round 0 and its step 5 10% less in round 1; its round-2 record ends after
    step 5, one steady step short (it counts in the steps it has, not in the total). The total's
    ratio is sum over sum, not the mean of the steps' ratios, and its point estimate the
    geometric mean of the rounds'."""
    results = searched()
    run_rounds(results, RoundRuns({a: [0.5] * 3 for a in ALLOCATOR_ORDER}), 3)
    torch_steps = [9.0, 9.0, 0.3, 0.8, 1.0, 0.45]
    scale = {0: (2, 1.5), 1: (4, 0.9), 2: (5, 1.0)}  # round: (step index, factor)
    for r in results.rounds.values():
        r["step_s"] = list(torch_steps)
        if r["allocator"] == "vramledger":
            i, factor = scale[r["round"]]
            r["step_s"][i] *= factor
            if r["round"] == 2:
                r["step_s"] = r["step_s"][:5]  # no step 6
    rows = row_cells(step_rounds.steps_table(results, [ROW], 64))
    total = sum(torch_steps[2:])  # 2.55 s
    ratios = [(total + 0.3 * 0.5) / total, (total - 1.0 * 0.1) / total]  # round 2 is short
    bounds = step_rounds.interval(ratios)
    expected = (f"{bounds[0]:.3f} ({bounds[1]:.3f} - {bounds[2]:.3f}), slower in 1 of 2, "
                f"{step_rounds.verdict(bounds)}")
    assert rows[NATIVE][9] == rows[EXPANDABLE][9] == expected
    assert bounds[0] == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
    assert f"{bounds[0]:.3f}" != f"{(ratios[0] + ratios[1]) / 2:.3f}"  # not the arithmetic mean
    step_mean = sum([1.5, 1, 1, 1]) / 4  # round 0's mean of the steps' ratios: not its total's
    assert f"{step_mean:.3f}" != f"{ratios[0]:.3f}"
    assert step_rounds.verdict(bounds) == "undecided"  # round 0's 1.059 lies past 1.02
    # Round 2's short record counts in the steps it has: step 6 pairs two rounds, step 3 three.
    assert rows[NATIVE][8].endswith("of 2") and rows[NATIVE][5].endswith("of 3")


def test_the_steps_table_compares_torchs_two_allocators_without_a_verdict():
    """Torch expandable's steps take 3% less than torch native's in rounds 0 and 1 (machine a)
    and 2% more in round 2 (machine b), where vramledger runs out of memory: the third line pairs
    all three rounds, by machine, and its total carries no verdict (the target is vramledger's);
    vramledger's lines pair rounds 0 and 1."""
    results = searched()
    run_rounds(results, RoundRuns({"torch": [0.5] * 3, "torch-expandable": [0.5] * 3,
                                   "vramledger": [0.5, 0.5, None]}), 3)
    for r in results.rounds.values():
        r["host"] = {"boot_id": "a" if r["round"] < 2 else "b"}
        if r["allocator"] == "torch-expandable":
            r["step_s"] = [x * (1.02 if r["round"] == 2 else 0.97) for x in r["step_s"]]
    text = step_rounds.steps_table(results, [ROW], 64)
    rows = row_cells(text)
    # One line each, in this order, under a header whose fifth column names the ratio.
    assert [line.split(" | ")[4] for line in text.splitlines()[2:]] == [NATIVE, EXPANDABLE,
                                                                       TORCHES]
    assert text.splitlines()[0].split(" | ")[4] == "ratio"
    bounds = step_rounds.interval([0.97, 0.97, 1.02], machines=["a", "a", "b"])
    cell = f"{bounds[0]:.3f} ({bounds[1]:.3f} - {bounds[2]:.3f}), slower in 1 of 3"
    assert rows[TORCHES][5:] == [cell] * 5
    assert rows[NATIVE][9].endswith("slower in 0 of 2, not above")
    expandable = step_rounds.interval([1 / 0.97] * 2)
    assert rows[EXPANDABLE][9] == (f"{expandable[0]:.3f} ({expandable[1]:.3f} - "
                                   f"{expandable[2]:.3f}), slower in 2 of 2, above")


def test_the_steps_table_with_one_round_or_none_paired():
    results = searched()
    run_rounds(results, RoundRuns({"torch": [0.5], "torch-expandable": [0.4],
                                   "vramledger": [0.55]}), 1)
    rows = row_cells(step_rounds.steps_table(results, [ROW], 64))
    assert rows[NATIVE][5:] == ["1.100, 1 round"] * 5
    assert rows[EXPANDABLE][5:] == ["1.375, 1 round"] * 5
    assert rows[TORCHES][5:] == ["0.800, 1 round"] * 5
    results = searched()
    run_rounds(results, RoundRuns({"torch": [0.5], "torch-expandable": [0.4],
                                   "vramledger": [None]}), 1)
    rows = row_cells(step_rounds.steps_table(results, [ROW], 64))
    assert rows[NATIVE][5:] == rows[EXPANDABLE][5:] == ["-"] * 5
    assert rows[TORCHES][5:] == ["0.800, 1 round"] * 5  # torch's two pair without vramledger
    assert step_rounds.steps_table(searched(), [ROW], 64).startswith("No step rounds")


def test_the_tables_on_records_without_the_per_step_counters(tmp_path, capsys):
    path = tmp_path / "r.json"
    results = searched(str(path))
    run_rounds(results, RoundRuns({a: [0.5, 0.6] for a in ALLOCATOR_ORDER}, counters=False), 1)
    rows = row_cells(step_rounds.rounds_table(results, [ROW], 64))
    assert rows["vramledger"][5:9] == ["1 of 1", "0.500", "0.500", "-"]
    assert rows["vramledger"][11] == "-"
    assert rows["torch native"][9:] == ["1.000 over 1 round", "too few rounds", "-", "stand-in"]
    retries = table.retries_table(results, [ROW], 64)  # the searches' records lack them too
    assert "| GPT-2-medium | 24 | batch | 4 | vramledger | 0.00 | 0.500 | - |" in retries
    # The command line prints both, the rounds' after the retries'; a row without rounds says so.
    assert capacity_main.main(["--table-only", "--resume", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"resumed {len(results.records)} trial(s) and 3 step-round run(s)" in out
    assert out.index("| retries per step") < out.index("Step time over rounds") < out.index(
        "| 1.000 over 1 round | too few rounds |")
    assert step_rounds.rounds_table(results, [("gpt2m", 24.0, "seq")], 64).startswith(
        "No step rounds")


def test_the_retries_table_gives_a_search_records_per_step_counters():
    results = searched()
    record = results.get(*ROW[:1], "vramledger", *ROW[1:], 4)
    record.update(step_device_alloc=[3, 1, 2, 0, 0, 0], step_device_free=[0, 0, 1, 1, 0, 0],
                  step_sync_all_streams=[0] * 6, step_alloc_retries=[0, 0, 0, 0, 0, 2])
    assert ("| vramledger | 0.00 | 0.500 | 0.50 / 0.50 / 0.00 / 0.50 | - |"
            in table.retries_table(results, [ROW], 64))
    record.update(step_driver_ms=[8.0, 8.0, 0, 0, 0, 4], step_waits=[0, 0, 0, 0, 0, 1],
                  step_wait_ms=[0, 0, 0, 0, 0, 2.5])
    # Records from before the page-table calls were kept give the timing alone.
    assert ("| vramledger | 0.00 | 0.500 | 0.50 / 0.50 / 0.00 / 0.50 | 1.00 / 0.25 / 0.62 / - / - "
            "/ - |" in table.retries_table(results, [ROW], 64))
    record.update(step_cu_mem_map=[9, 9, 4, 0, 0, 0], step_cu_mem_unmap=[0, 0, 2, 0, 0, 0],
                  step_take_backs=[0, 0, 1, 1, 1, 1])
    assert ("| vramledger | 0.00 | 0.500 | 0.50 / 0.50 / 0.00 / 0.50 | 1.00 / 0.25 / 0.62 / 1.00 "
            "/ 0.50 / 1.00 |" in table.retries_table(results, [ROW], 64))
    assert "| torch native | 0.00 | 0.500 | - | - |" in table.retries_table(results, [ROW], 64)


def test_bad_step_rounds_is_an_error(capsys):
    for value, needle in (("x", "whole number"), ("-1", "from 0 to 1000")):
        with pytest.raises(SystemExit) as e:
            capacity_main.main(["--table-only", "--step-rounds", value])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_the_card_column_names_each_card_and_a_ratio_pairs_one_cards_runs():
    steady = {"torch": [0.50, 0.40, 0.50], "torch-expandable": [0.50, 0.50, 0.50],
              "vramledger": [0.45, 0.55, 0.45]}
    results = searched()
    run_rounds(results, RoundRuns(steady), 3)
    for r in results.rounds.values():  # round 1 merged from another machine's file
        r["device"] = "NVIDIA H100 80GB HBM3" if r["round"] == 1 else "NVIDIA H200"
    # ... except torch native's round-1 run, recorded on the H200: that round pairs nothing.
    results.get_round(*ROW[:1], "torch", *ROW[1:], 4, 1)["device"] = "NVIDIA H200"
    rows = row_cells(step_rounds.rounds_table(results, [ROW], 64))
    assert rows["vramledger"][12] == rows["torch expandable"][12] == "H100 80GB HBM3, H200"
    assert rows["torch native"][12] == "H200"
    assert rows["torch native"][9] == "{:.3f} ({:.3f} - {:.3f}) over 2 rounds".format(
        *step_rounds.interval([0.45 / 0.50, 0.45 / 0.50]))
    assert rows["torch expandable"][9].endswith("over 3 rounds")


def test_a_run_without_a_device_shows_no_card():
    assert step_rounds.cards([{"fits": False}]) == "-"
    assert step_rounds.cards([{"device": "NVIDIA H200"}, {"fits": False}]) == "H200"


def test_the_card_column_counts_the_hosts_the_records_name():
    def run(boot_id=None):
        return {"device": "NVIDIA H100 80GB HBM3"} | (
            {"host": {"boot_id": boot_id}} if boot_id else {})
    assert step_rounds.cards([run("a"), run("a")]) == "H100 80GB HBM3 on 1 machine"
    assert step_rounds.cards([run("a"), run("b"), run("a")]) == "H100 80GB HBM3 on 2 machines"
    assert step_rounds.cards([run("a"), run(), run()]) == (
        "H100 80GB HBM3 on 1 machine and 2 runs of unknown machines")
    assert step_rounds.cards([run(), run()]) == "H100 80GB HBM3"


def test_the_card_column_says_which_card_ran_on_which_machines():
    def run(device, boot_id=None):
        return {"device": device} | ({"host": {"boot_id": boot_id}} if boot_id else {})
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert step_rounds.cards([run(h200), run(h100, "a"), run(h200), run(h100, "b")]) == (
        "H100 80GB HBM3 on 2 machines, H200 (machines not recorded)")
    assert step_rounds.cards([run(h200, "c"), run(h100, "a"), run(h100)]) == (
        "H100 80GB HBM3 on 1 machine and 1 run of unknown machines, H200 on 1 machine")
    assert step_rounds.cards([run(h200), run(h100)]) == "H100 80GB HBM3, H200"
    # A run that names no card (it failed before it read one) counts under none, its machine too.
    assert step_rounds.cards([{"fits": False, "host": {"boot_id": "z"}}]) == "-"
    assert step_rounds.cards([{"fits": False, "host": {"boot_id": "z"}}, run(h100, "a")]) == (
        "H100 80GB HBM3 on 1 machine")
    # An empty label names no machine.
    assert step_rounds.machine({"machine": "", "host": {"boot_id": ""}}) is None
    assert step_rounds.cards([dict(run(h100), machine=""), run(h100, "a")]) == (
        "H100 80GB HBM3 on 1 machine and 1 run of unknown machines")


def test_a_trial_record_names_its_machine(monkeypatch):
    facts = trial.host_facts()
    assert set(facts) == {"boot_id", "cpu_model", "cpus", "loadavg"}
    assert facts["cpus"] >= 1 and len(facts["loadavg"]) == 3  # Linux, as every machine here
    assert facts["boot_id"] and len(facts["boot_id"]) == 36
    # Where /proc cannot be read, each fact is None, never an error.
    monkeypatch.setattr(trial, "read_text", lambda path: None)
    assert trial.host_facts() | {"cpus": None} == dict.fromkeys(facts)


def test_runs_pair_only_on_one_card_and_one_machine_where_both_name_theirs():
    h100, h200 = {"device": "H100"}, {"device": "H200"}

    def on(card, boot):
        return dict(card, host={"boot_id": boot})
    assert step_rounds.same_machine(h100, h100) and not step_rounds.same_machine(h100, h200)
    assert step_rounds.same_machine(on(h100, "a"), on(h100, "a"))
    assert not step_rounds.same_machine(on(h100, "a"), on(h100, "b"))
    # A record from before trials named their machine pairs by card alone.
    assert step_rounds.same_machine(on(h100, "a"), h100)
    assert step_rounds.same_machine(dict(h100, host=None), on(h100, "b"))


def test_a_total_needs_both_runs_every_step():
    steps = [9.0, 9.0, 0.3, 0.8, 1.0, 0.45]
    assert step_rounds.total_ratio(steps, steps) == 1.0
    assert step_rounds.total_ratio([2 * x for x in steps], steps) == pytest.approx(2.0)
    assert step_rounds.total_ratio(steps, steps[:5]) is None  # torch's run stopped short
    assert step_rounds.total_ratio(steps[:5], steps) is None
    assert step_rounds.total_ratio(steps[:5], steps[:5]) is None  # alike, but short


def test_an_end_that_rounds_to_the_limit_is_printed_to_four_decimals():
    """1.0205 and 1.0196 both read 1.020 to three decimals, one on each side of the 2% limit."""
    assert step_rounds.bounds_text((1.011, 1.0007, 1.0205)) == "1.011 (1.001 - 1.0205)"
    assert step_rounds.bounds_text((1.005, 0.9930, 1.0196)) == "1.005 (0.993 - 1.0196)"
    assert step_rounds.bounds_text((1.0, 0.99, 1.02)) == "1.000 (0.990 - 1.020)"
    assert step_rounds.bounds_text((1.0, 0.99, 1.0149)) == "1.000 (0.990 - 1.015)"
    assert step_rounds.bounds_text((1.0, 0.99, 1.03), "{} [{}, {}]") == "1.000 [0.990, 1.030]"
