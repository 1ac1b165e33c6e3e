"""The allowance under a cap (_plan_allowance.py, benchmarks/capacity/calibrate.py): its constants
are what the calibration rule gives on the recorded H200 trials, only the calibration rows move
them, and `plan --fit` uses it by default with the uncapped allowance still selectable."""

from __future__ import annotations

import copy
import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.capacity import calibrate, planner, table  # noqa: E402
from benchmarks.capacity.results import ALLOCATOR_ORDER, Results  # noqa: E402
from vramledger import _plan_allowance as pa  # noqa: E402

RECORDS = ROOT / pa.CALIBRATION_RECORDS


def load(trials) -> Results:
    results = Results()
    for r in trials:
        results.records[f"{r['workload']}|{r['allocator']}|{r['cap_gib']:g}|{r['dim']}|"
                        f"{r['size']}"] = r
    return results


@pytest.fixture(scope="module")
def trials():
    return json.loads(RECORDS.read_text())["trials"]


def test_the_constants_are_the_calibration_of_the_recorded_trials(trials):
    c = calibrate.calibrate(load(trials))
    assert c.allowance == pa.UNDER_A_CAP
    assert c.peak_correction == pa.PEAK_CORRECTION
    assert calibrate.matches_package(c)
    # The rule by hand for vramledger: its largest fitting trial per calibration row.
    ratios = []
    for workload, cap, dim in pa.CALIBRATION_ROWS:
        fitting = [r for r in trials if (r["workload"], r["cap_gib"], r["dim"], r["allocator"])
                   == (workload, cap, dim, "vramledger") and r["fits"]]
        top = max(fitting, key=lambda r: r["size"])
        ratios.append(top["peak_reserved"] / top["peak_allocated"])
    assert pa.UNDER_A_CAP["vramledger"] == math.ceil(max(ratios) * 1e4) / 1e4
    # Torch native per training kind: the kind's own rows under 24 GiB, a limit at the first size
    # (Llama-1B's micro-batch 1) or a record without peaks left out; its largest is the default.
    assert c.torch_by_kind == pa.TORCH_BY_KIND
    for kind in pa.TORCH_KINDS:
        ratios = []
        for dim in ("batch", "seq"):
            fitting = [r for r in trials if (r["workload"], r["cap_gib"], r["dim"], r["allocator"])
                       == (kind.workload, 24.0, dim, "torch") and r["fits"]]
            top = max(fitting, key=lambda r: r["size"])
            if top["size"] != (1 if dim == "batch" else 64) and top.get("peak_reserved"):
                ratios.append(top["peak_reserved"] / top["peak_allocated"])
        assert pa.TORCH_BY_KIND[kind.workload] == math.ceil(max(ratios) * 1e4) / 1e4, kind
    assert pa.UNDER_A_CAP["torch"] == max(pa.TORCH_BY_KIND.values())
    assert ("llama1b", 24.0, "batch", "torch", "limit 1, the first size: the cap did not press "
            "it") in c.left_out


def test_every_measured_limit_is_predicted_within_5_percent(trials):
    """The capacity benchmark's target for plan --fit under a cap, on every row of the records:
    calibration rows (24 GiB) and evaluation rows (80 GiB) of every allocator."""
    results = load(trials)
    errors = {}
    for allocator in ALLOCATOR_ORDER:
        for w, cap, dim, got in calibrate.limits(results, allocator):
            errors[(w, cap, dim, allocator)] = (planner.predict(w, allocator, cap, dim) - got) / got
    assert len(errors) == 48
    assert max(map(abs, errors.values())) <= 0.05, errors
    # Torch native's rows at 80 GiB (held out): never small, at most 3.9% large.
    native = [e for (w, cap, dim, a), e in errors.items() if a == "torch" and cap == 80.0]
    assert len(native) == 8 and 0 <= min(native) and max(native) < 0.04


@pytest.mark.parametrize("allocator", ALLOCATOR_ORDER)
def test_the_covering_allowances_are_the_smallest_that_predict_no_limit_too_large(trials,
                                                                                  allocator):
    results = load(trials)
    assert calibrate.covering(results, allocator) == pa.COVERING[allocator]
    at, below = calibrate.scan(results, allocator, [pa.COVERING[allocator],
                                                    round(pa.COVERING[allocator] - 1e-4, 4)])
    assert all(r.predicted <= r.measured for r in at[1])
    assert any(r.predicted > r.measured for r in below[1])
    assert calibrate.covering(load([]), allocator) is None


def test_the_command_says_the_constants_match(capsys):
    assert calibrate.main(["--resume", str(RECORDS)]) == 0
    out = capsys.readouterr().out
    assert "the planner's constants (vramledger/_plan_allowance.py) are these" in out
    assert f"| torch native | {pa.UNDER_A_CAP['torch']:.4f} | {pa.UNCAPPED['torch']:.4f} |" in out


def test_evaluation_rows_never_move_the_calibration(trials):
    base = calibrate.calibrate(load(trials))
    extra = copy.deepcopy([r for r in trials
                           if r["cap_gib"] == 80.0 and r.get("peak_allocated")])
    for r in extra:  # an evaluation row whose allocator needed twice what it allocated
        r["peak_reserved"] = 2 * r["peak_allocated"]
        r["peak_allocated"] //= 2
    moved = calibrate.calibrate(load(trials + extra))
    assert (moved.allowance, moved.torch_by_kind, moved.peak_correction) == (
        base.allowance, base.torch_by_kind, base.peak_correction)
    assert all(planner.role(r["workload"], r["cap_gib"], r["dim"], r["allocator"]) == "evaluation"
               for r in extra)
    # A 24 GiB row of another workload than GPT-2-medium evaluates vramledger, calibrates torch.
    assert planner.role("llama1b-lora", 24.0, "seq", "vramledger") == "evaluation"
    assert planner.role("llama1b-lora", 24.0, "seq", "torch") == "calibration"


def test_a_training_kind_without_a_row_that_calibrates_is_an_error_naming_it(trials):
    # Llama-1B's one row that calibrates (its micro-batch row's limit is 1) keeps no peaks.
    bare = copy.deepcopy(trials)
    for r in bare:
        if (r["workload"], r["allocator"], r["dim"], r["cap_gib"], r["size"]) == (
                "llama1b", "torch", "seq", 24.0, 2944):
            r["peak_reserved"] = r["peak_allocated"] = None
    with pytest.raises(ValueError, match="torch native, Llama-1B, full fine-tuning: no "
                                         "calibration row"):
        calibrate.calibrate(load(bare))


def test_a_calibration_row_moves_the_calibration(trials):
    changed = copy.deepcopy(trials)
    for r in changed:
        if (r["workload"], r["dim"], r["allocator"], r["size"]) == ("gpt2m", "batch", "torch", 6):
            r["peak_reserved"] = int(r["peak_allocated"] * 1.2)
    c = calibrate.calibrate(load(changed))
    assert c.allowance["torch"] == 1.2
    assert not calibrate.matches_package(c)


def test_a_missing_calibration_row_is_an_error_naming_it(trials):
    kept = [r for r in trials if not (r["dim"] == "seq" and r["allocator"] == "torch")]
    with pytest.raises(ValueError, match="gpt2m seq under 24 GiB, torch: no limit found"):
        calibrate.calibrate(load(kept))


def test_under_a_cap_each_allocator_needs_less_than_it_holds_uncapped():
    """Near the cap torch's allocators free their cache and retry; vramledger holds little cache
    either way. So the cap allowance is below the uncapped one, most of all for torch native."""
    for a in pa.ALLOCATOR_NAMES:
        assert 1 <= pa.UNDER_A_CAP[a] < pa.UNCAPPED[a]
    gaps = {a: pa.UNCAPPED[a] - pa.UNDER_A_CAP[a] for a in pa.ALLOCATOR_NAMES}
    assert max(gaps, key=gaps.get) == "torch"


def test_needed_bytes_round_up_and_never_fall_with_the_planned_peak():
    cap = pa.allowance("torch", "cap")
    assert cap.needed(10**12) == math.ceil(
        10**12 * round(cap.factor * 1e6) * round(cap.peak_correction * 1e6) / 1e12)
    assert cap.needed(0) == 0 and cap.needed(1) == 2  # 1.0346 bytes round up
    assert pa.allowance("vramledger", "uncapped").needed(10**6) == 1008800
    # vramledger under a cap: 0.9933 x 1.0074 = 1.00066, just above the planned peak.
    assert pa.allowance("vramledger", "cap").needed(10**9) == -(-10**9 * 993300 * 1007400 // 10**12)
    assert pa.allowance("vramledger", "cap").needed(10**9) > 10**9
    # A product below 1 is floored at the planned peak: a size --fit returns always fits the plan.
    low = pa.Allowance("cap", "vramledger", 1.0061, 0.9933, "test")
    assert low.needed(10**9) == 10**9 and low.describe() == " x max(1, 0.9933 x 1.0061)"
    values = [cap.needed(n) for n in range(0, 10**7, 9973)]
    assert values == sorted(values)


@pytest.mark.parametrize("args, needle", [
    (("cuda-malloc", "cap"), "unknown allocator 'cuda-malloc'; choose from vramledger"),
    (("torch", "tight"), "unknown allowance model 'tight'; choose from cap, uncapped"),
])
def test_an_unknown_allocator_or_model_is_refused_by_name(args, needle):
    with pytest.raises(ValueError, match=needle):
        pa.allowance(*args)


@pytest.mark.parametrize("allocator", ALLOCATOR_ORDER)
def test_the_cap_model_fits_at_least_what_the_uncapped_one_does(allocator):
    for workload, cap in (("gpt2m", 24.0), ("llama1b", 80.0), ("llama1b-lora", 24.0)):
        for dim in ("batch", "seq"):
            assert (planner.predict(workload, allocator, cap, dim, "cap")
                    >= planner.predict_uncapped(workload, allocator, cap, dim))


def test_the_errors_table_splits_calibration_from_evaluation(trials):
    results = load(trials)
    groups = sorted(results.groups())
    text = table.errors_table(results, groups, {"uncapped allowance": planner.predict_uncapped,
                                                "allowance under a cap": planner.predict},
                              planner.role, 64)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # A row per limit found; the calibration rows are GPT-2-medium's four under 24 GiB for
    # vramledger and torch expandable, and the eight under 24 GiB of torch native's four kinds.
    assert len(rows) == sum(1 for w, c, d in groups for a in ALLOCATOR_ORDER
                            if table.measured(results, w, a, c, d, 64)) == 48
    assert sum("| calibration |" in r for r in rows) == 12
    assert all("| evaluation |" in r for r in rows if "| 80 |" in r)
    assert all("| calibration |" in r for r in rows if "| 24 |" in r and "| torch native |" in r)
    # Each printed error is (predicted - measured) / measured of the row's own figures.
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        got = int(cells[5])
        for cell in cells[7:]:
            pred, err = cell.split(" (")
            assert err == f"{100 * (int(pred) - got) / got:+.1f}%)"
    summary = [line for line in text.splitlines() if line.endswith("rows.")]
    assert [line.split(":")[0] for line in summary] == ["uncapped allowance",
                                                        "allowance under a cap"]


def test_torch_natives_need_under_a_cap_differs_by_workload(trials):
    """The records bracket each row's need: GPT-2-medium's torch native lies wholly below the
    LoRA workload's, so no one constant can predict both rows exactly."""
    rows = {(w, c, d, a): (low, high) for w, c, d, a, _, low, high
            in calibrate.brackets(load(trials))}
    for row, (low, high) in rows.items():
        assert low is None or low < high, row
        assert high >= 1, row
    gpt2_high = max(rows[("gpt2m", 24.0, d, "torch")][1] for d in ("batch", "seq"))
    lora_low = rows[("llama1b-lora", 24.0, "batch", "torch")][0]
    assert gpt2_high < lora_low
    # GPT-2-medium's training kind's constant is its upper bound, rounded up.
    assert pa.TORCH_BY_KIND["gpt2m"] == math.ceil(gpt2_high * 1e4) / 1e4


def test_a_scan_at_a_training_kinds_factor_predicts_what_plan_fit_does_on_its_rows(trials):
    results = load(trials)
    for kind in pa.TORCH_KINDS:
        [(factor, rows)] = calibrate.scan(results, "torch", [pa.TORCH_BY_KIND[kind.workload]])
        assert len(rows) == 16  # every workload, cap and dimension has torch native's limit
        own = [r for r in rows if r.workload == kind.workload]
        assert len(own) == 4
        for r in own:
            assert r.predicted == planner.predict(r.workload, "torch", r.cap_gib, r.dim)
            assert r.measured == table.measured(results, r.workload, "torch", r.cap_gib, r.dim,
                                                64)


def test_a_larger_factor_never_predicts_a_larger_size(trials):
    # The scan's factor reaches the search: were it ignored, every factor would predict alike.
    scanned = calibrate.scan(load(trials), "vramledger", [1.0, 1.05, 1.10])
    for (_, lower), (_, higher) in zip(scanned, scanned[1:]):
        assert all(h.predicted <= lo.predicted for lo, h in zip(lower, higher))
    assert any(h.predicted < lo.predicted for lo, h in zip(scanned[0][1], scanned[-1][1]))


def test_the_scan_command_names_the_best_factor_and_its_misses(capsys):
    assert calibrate.main(["--resume", str(RECORDS), "--scan", "torch",
                           "--factors", "1.04:1.14:0.04"]) == 0
    out = capsys.readouterr().out
    assert "torch native, one allowance under a cap for every row (16 rows):" in out
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("| 1.")] == \
        ["| 1.0400", "| 1.0800", "| 1.1200"]
    assert "most rows within 5%: 13 of 16, at 1.1200:" in out
    assert "| GPT-2-medium seq 24 GiB | 1728 | 1581 (-8.5%) |" in out
    assert "| 1.0400 | 5 | +22.6% | - |" in out  # no row predicted small: no worst under


def test_fit_with_the_allocators_own_allowance_is_fit_and_an_unknown_allocator_is_refused():
    from vramledger import _plan_fit
    own = pa.allowance("torch", "cap", pa.TORCH_KINDS[1])
    assert own.factor == pa.TORCH_BY_KIND["llama1b"]
    assert pa.TORCH_KINDS[1].workload == "llama1b"
    assert planner.predict_with("llama1b", 24.0, "seq", own) == planner.predict(
        "llama1b", "torch", 24.0, "seq")
    odd = pa.Allowance("cap", "mystery", 1.1, 1.0, "test")
    with pytest.raises(ValueError, match="unknown allocator 'mystery'"):
        _plan_fit.fit_with(planner._model("gpt2m"), planner._setup("gpt2m", 1, 1024), "batch",
                           odd)


@pytest.mark.parametrize("text", ["1.0:1.2", "a:b:c", "1.1:1.0:0.01", "1.0:1.2:0", "0.9:1.2:0.1",
                                  "1:inf:0.1", "nan:nan:nan", "1:1.2:nan", "1:1.2:1e-300",
                                  "1:1.0001:0.00001", "1:2:1e-4"])
def test_bad_factors_are_refused_with_a_message(text, capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--resume", str(RECORDS), "--scan", "torch", "--factors", text])
    assert e.value.code == 2
    assert f"--factors {text!r}" in capsys.readouterr().err


def test_factors_without_a_scan_and_bad_records_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--resume", str(RECORDS), "--factors", "1:1.1:0.1"])
    assert e.value.code == 2 and "--factors is for --scan" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    for text, says in (('{"trials": [', "not JSON"),
                       ('{"trials": [{"workload": "gpt2m"}]}',
                        "a record without its 'allocator' field")):
        bad.write_text(text)
        with pytest.raises(SystemExit) as e:
            calibrate.main(["--resume", str(bad), "--scan", "torch"])
        assert e.value.code == 2
        assert f"--resume: {bad}: {says}" in capsys.readouterr().err
    bad.write_text('{"trials": []}')
    assert calibrate.main(["--resume", str(bad), "--scan", "torch"]) == 1
    assert "no row of torch native has a measured limit" in capsys.readouterr().err


def test_factors_cover_the_range_inclusive():
    assert calibrate.parse_factors("1.00:1.02:0.01") == [1.0, 1.01, 1.02]
    assert calibrate.parse_factors("1.1:1.1:0.5") == [1.1]
    default = calibrate.parse_factors("1.00:1.20:0.005")
    assert len(default) == 41 and default[-1] == 1.2 and len(set(default)) == 41
    assert calibrate.parse_factors("1.0:1.3:0.1") == [1.0, 1.1, 1.2, 1.3]
