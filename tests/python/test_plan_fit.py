"""`vramledger plan --fit batch|seq` (_plan_fit.py): the largest size whose planned peak with the
allocator's allowance (under a cap, or uncapped) fits the card, checked against the plain plan; its
table against its JSON; its bad inputs."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from vramledger import _plan, _plan_allowance, _plan_fit, cli

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "traces" / "configs"
GPT2M = ["--config", str(CONFIGS / "gpt2-medium.json")]
# The capacity benchmark's GPT-2-medium: 8192 learned positions, so its sequence can pass 1024.
GPT2M_8K = ["--config", str(pathlib.Path(__file__).resolve().parent / "data"
                            / "gpt2-medium-8192-positions.json")]
LLAMA = ["--config", str(CONFIGS / "llama-1b.json")]
# (model flags, the other dimension's flag) for each dimension searched.
CASES = [
    (GPT2M, "batch", ["--seq", "1024"]),
    (GPT2M_8K, "seq", ["--batch", "4"]),
    (LLAMA, "batch", ["--seq", "2048"]),
    (LLAMA + ["--checkpointing"], "seq", ["--batch", "8"]),
    (LLAMA + ["--checkpointing", "--lora-rank", "16"], "batch", ["--seq", "4096"]),
]
# The training kind (_plan_allowance.TORCH_KINDS) each case's model flags train as.
KINDS = {"gpt2-medium.json": "gpt2m", "gpt2-medium-8192-positions.json": "gpt2m",
         "llama-1b.json": "llama1b",
         "llama-1b.json --checkpointing": "llama1b-ckpt",
         "llama-1b.json --checkpointing --lora-rank 16": "llama1b-lora"}


def kind_of(model: list[str]) -> str:
    return KINDS[" ".join([pathlib.Path(model[1]).name, *model[2:]])]


def plan(capsys, *args):
    """(exit status, stdout, stderr) of `vramledger plan ARGS` run in this process."""
    status = cli.main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


def plan_json(capsys, *args, statuses=(0,)):
    status, out, err = plan(capsys, *args, "--json")
    assert status in statuses, err
    return json.loads(out)


ALLOCATORS = sorted(_plan_allowance.ALLOCATOR_NAMES)


@pytest.mark.parametrize("allowance", _plan_allowance.MODELS)
@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("model, dim, other", CASES)
def test_fit_is_monotone_in_the_card(capsys, model, dim, other, allocator, allowance):
    sizes = []
    for card in (30, 40, 48, 64, 80, 96, 120, 139.8):
        fit = plan_json(capsys, *model, *other, "--fit", dim, "--card-gib", card,
                        "--allocator", allocator, "--allowance", allowance)["fit"]
        sizes.append(fit["size"])
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1], sizes


@pytest.mark.parametrize("allowance", _plan_allowance.MODELS)
@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("model, dim, other", CASES)
@pytest.mark.parametrize("card", (32, 80))
def test_fit_agrees_with_the_plain_plan_at_its_size_and_one_above(capsys, model, dim, other,
                                                                  allocator, allowance, card):
    got = plan_json(capsys, *model, *other, "--fit", dim, "--card-gib", card,
                    "--allocator", allocator, "--allowance", allowance)
    fit = got["fit"]
    n, card_bytes = fit["size"], int(card * _plan.GIB)
    assert n >= 1 and fit["card_bytes"] == card_bytes == got["card_bytes"]
    assert got["inputs"][dim] == n
    factor = (_plan_allowance.UNDER_A_CAP if allowance == "cap" else _plan_allowance.UNCAPPED)[
        allocator]
    if (allocator, allowance) == ("torch", "cap"):  # torch native's is the training kind's
        factor = _plan_allowance.TORCH_BY_KIND[kind_of(model)]
    assert fit["training_kind"]["workload"] == kind_of(model)
    correction = _plan_allowance.PEAK_CORRECTION if allowance == "cap" else 1
    assert (fit["allowance_model"], fit["allowance"], fit["peak_correction"]) == (
        allowance, factor, correction)
    at = plan_json(capsys, *model, *other, f"--{dim}", n, "--card-gib", card)
    # The plain plan adds no allowance: one step above may still fit the card, or not (status 1).
    above = plan_json(capsys, *model, *other, f"--{dim}", n + 1, "--card-gib", card,
                      statuses=(0, 1))
    at.pop("formulas"), got.pop("formulas")  # the same but for nothing; compared below as a whole
    assert {k: v for k, v in got.items() if k != "fit"} == at
    assert fit["planned_peak_bytes"] == at["total_bytes"]
    assert fit["next_planned_peak_bytes"] == above["total_bytes"]
    times = max(1, correction * factor)  # never below the planned peak: the plain plan fits
    assert at["total_bytes"] * times <= card_bytes < above["total_bytes"] * times
    assert fit["needed_bytes"] <= card_bytes < fit["next_needed_bytes"]


def test_fit_table_carries_the_json_figures(capsys):
    args = [*LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "80",
            "--allocator", "torch-expandable"]
    got = plan_json(capsys, *args)
    status, text, err = plan(capsys, *args)
    assert status == 0 and err == ""
    fit = got["fit"]
    assert (f"the largest micro-batch predicted to fit is {fit['size']} at seq 2048 "
            f"(torch expandable_segments:True's allowance under a cap)") in text
    gb = _plan.gb
    times = f"x {fit['peak_correction']:g} x {fit['allowance']:g}"
    assert (f"batch {fit['size']}: planned peak {gb(fit['planned_peak_bytes'])} {times} = "
            f"{gb(fit['needed_bytes'])} <= card {gb(fit['card_bytes'])}" in text)
    assert (f"batch {fit['next_size']}: planned peak {gb(fit['next_planned_peak_bytes'])} "
            f"{times} = {gb(fit['next_needed_bytes'])} > card" in text)
    # Both allowances are named, the one used first, each with its source.
    cap, uncapped = fit["allowances"]["cap"], fit["allowances"]["uncapped"]
    assert (f"allowance under a cap {cap['factor']:g}, after the planned peak's correction x "
            f"{cap['peak_correction']:g} (measured / planned peak allocated) ({cap['source']}); "
            f"not used: uncapped "
            f"{uncapped['factor']:g}, peak reserved with abundant memory" in text)
    assert f"micro-batch {fit['size']} x seq 2048 per GPU" in text
    for c in _plan.CATEGORIES:
        assert re.search(rf"^  {c} +{re.escape(gb(got[c]))} ", text, re.M), c
    assert f"planned peak allocated {gb(got['total_bytes'])} per GPU" in text


def test_sizes_a_hundredth_of_a_gb_apart_print_their_bytes(capsys):
    # One token more adds about 2.9 MB here: the sizes that fit and do not, and the card, would
    # print alike in GB.
    args = [*GPT2M_8K, "--batch", "1", "--fit", "seq", "--card-gib", "24"]
    fit = plan_json(capsys, *args)["fit"]
    status, text, _ = plan(capsys, *args)
    assert status == 0
    now, above = (f"{_plan.gb(fit[k])[:-1]}, {fit[k]:,} bytes)"
                  for k in ("needed_bytes", "next_needed_bytes"))
    assert f" = {now} <= card 25.77 GB (24.00 GiB, 25,769,803,776 bytes)\n" in text
    assert f" = {above} > card\n" in text
    assert fit["needed_bytes"] <= fit["card_bytes"] < fit["next_needed_bytes"]
    # Where GB tells them apart, no bytes.
    text = plan(capsys, *LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "80")[1]
    assert " bytes)" not in text


def test_amounts_add_bytes_only_where_sizes_would_print_alike():
    assert _plan_fit.amounts(10**9, 2 * 10**9) == [_plan.gb(10**9), _plan.gb(2 * 10**9)]
    assert _plan_fit.amounts(10**9, 10**9) == [_plan.gb(10**9)] * 2
    assert _plan_fit.amounts(10**9, 10**9 + 1) == ["1.00 GB (0.93 GiB, 1,000,000,000 bytes)",
                                                   "1.00 GB (0.93 GiB, 1,000,000,001 bytes)"]


def test_fit_prints_the_conservative_answer_beside_its_own(capsys):
    # Llama-1B with checkpointing under 24 GiB, torch native: its training kind's allowance says
    # 7 (the benchmark measured 7), the records' envelope over every workload 6.
    args = [*LLAMA, "--seq", "2048", "--checkpointing", "--fit", "batch", "--card-gib", "24",
            "--allocator", "torch"]
    fit = plan_json(capsys, *args)["fit"]
    assert (fit["size"], fit["conservative"]["size"]) == (7, 6)
    assert fit["conservative"]["allowance"] == _plan_allowance.COVERING["torch"]
    status, text, _ = plan(capsys, *args)
    assert status == 0
    assert (f"  conservative answer: batch 6, at an allowance of "
            f"{_plan_allowance.COVERING['torch']:g}, under which no limit the capacity benchmark "
            f"measured for torch native, on any workload, was predicted too large (plan with this "
            f"one where running out of memory costs more than the difference; "
            f"{_plan_allowance.COVERING_SOURCE})") in text
    # vramledger's envelope gives the same size here; the uncapped model has no envelope.
    args[-1] = "vramledger"
    assert plan_json(capsys, *args)["fit"]["conservative"]["size"] == 9
    assert "  conservative answer: batch 9 as well, at an allowance of" in plan(capsys, *args)[1]
    uncapped = plan_json(capsys, *GPT2M, "--seq", "1024", "--fit", "batch", "--card-gib", "80",
                         "--allowance", "uncapped")["fit"]
    assert "conservative" not in uncapped
    # Where the answer is 1 and the envelope's allowance leaves nothing, the line says so.
    args = [*LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "22.5", "--allocator", "torch"]
    assert plan_json(capsys, *args)["fit"]["conservative"]["size"] == 0
    assert "  conservative answer: not even batch 1, at an allowance" in plan(capsys, *args)[1]


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_the_conservative_size_is_never_above_the_answer(capsys, allocator):
    for card in (24, 40, 80, 141):
        fit = plan_json(capsys, *LLAMA, "--seq", "4096", "--checkpointing", "--lora-rank", "16",
                        "--fit", "batch", "--card-gib", str(card), "--allocator", allocator)["fit"]
        assert 0 < fit["conservative"]["size"] <= fit["size"]


def test_torch_natives_allowance_is_its_training_kinds_and_names_it(capsys):
    args = [*LLAMA, "--seq", "4096", "--checkpointing", "--lora-rank", "16", "--fit", "batch",
            "--card-gib", "80", "--allocator", "torch"]
    fit = plan_json(capsys, *args)["fit"]
    kind = next(k for k in _plan_allowance.TORCH_KINDS if k.workload == "llama1b-lora")
    assert fit["allowance"] == _plan_allowance.TORCH_BY_KIND["llama1b-lora"]
    assert fit["training_kind"] == {"workload": "llama1b-lora", "title": kind.title,
                                    "trains_as": kind.short}
    said = (f"measured on {kind.title}; this setup trains the same way: {kind.short}, "
            f"{_plan_allowance.MEASURED_SETUP}")
    assert fit["allowance_measured_for"] == fit["allowances"]["cap"]["measured_for"] == said
    assert fit["allowances"]["cap"]["factor"] == fit["allowance"]
    assert "llama1b-lora's rows under a 24 GiB cap" in fit["allowance_source"]
    text = plan(capsys, *args)[1]
    assert (f"torch native's allowance under a cap {fit['allowance']:g} ({said}), after the "
            f"planned peak's correction") in text
    # The other allocators' factor is one for every kind, and says no kind.
    args[-1] = "torch-expandable"
    fit = plan_json(capsys, *args)["fit"]
    assert fit["allowance"] == _plan_allowance.UNDER_A_CAP["torch-expandable"]
    assert fit["allowance_measured_for"] is None
    assert fit["training_kind"]["workload"] == "llama1b-lora"


@pytest.mark.parametrize("flags, differs", [
    (["--precision", "fp32"], "precision fp32, where every one measured ran bf16 autocast"),
    (["--precision", "fp16-mixed"], "precision fp16-mixed, where"),
    (["--optimizer", "sgd"], "optimizer sgd, where"),
    (["--optimizer", "adamw-8bit"], "optimizer adamw-8bit, where"),
    (["--qlora", "--lora-rank", "16"], "a 4-bit (QLoRA) base, where"),
    (["--qlora"], "a 4-bit (QLoRA) base, where"),
    (["--zero-stage", "1", "--gpus", "2"], "ZeRO-1 on 2 GPUs, where"),
    (["--gpus", "2"], "ZeRO-0 on 2 GPUs, where"),
    (["--eager-attention"], "materialised attention scores, where"),
    (["--lora-rank", "16"], "gated MLP + LoRA, none of the measured tanh-GELU MLP / gated MLP"),
    (["--checkpointing", "--lora-rank", "16", "--lora-targets", "all"],
     "LoRA on all projections, where"),
    (["--mlp", "gelu"], "exact-GELU MLP, none of the measured"),
])
def test_a_setup_of_no_measured_kind_takes_torch_natives_largest_allowance(capsys, flags,
                                                                            differs):
    args = [*LLAMA, "--seq", "2048", *flags, "--fit", "batch", "--card-gib", "80",
            "--allocator", "torch"]
    fit = plan_json(capsys, *args)["fit"]
    assert fit["training_kind"]["workload"] is None and differs in fit["training_kind"]["differs"]
    assert fit["allowance"] == _plan_allowance.UNDER_A_CAP["torch"] == max(
        _plan_allowance.TORCH_BY_KIND.values())
    assert "every kind's rows under a 24 GiB cap" in fit["allowance_source"]
    text = plan(capsys, *args)[1]
    assert ("(the largest measured, as no measured setup trains as this one: "
            + fit["training_kind"]["differs"] + "), after") in text
    assert "  not measured:" not in text  # the allowance line says it
    # Under another allocator a line of its own says so.
    args[-1] = "vramledger"
    text = plan(capsys, *args)[1]
    assert ("  not measured: this setup trains as none of the capacity benchmark's workloads ("
            + fit["training_kind"]["differs"] + "); the allowance is the one measured on them\n"
            ) in text
    assert "  not measured:" not in plan(capsys, *LLAMA, "--seq", "2048", "--fit", "batch",
                                         "--card-gib", "80")[1]


def test_each_benchmark_workload_trains_as_its_own_kind():
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from benchmarks.capacity import planner
    for kind in _plan_allowance.TORCH_KINDS:
        got, why = _plan_fit.kind_of(planner._model(kind.workload),
                                     planner._setup(kind.workload, 1, 1024))
        assert (got, why) == (kind, "")


def test_only_the_measured_mlp_lora_and_checkpointing_make_a_kind():
    kind = _plan_allowance.training_kind
    assert kind("gelu-tanh", True, 0)[0] is None
    assert kind("gelu", False, 0)[0] is None
    assert kind("gelu-tanh", False, 0)[0].workload == "gpt2m"
    assert kind("gated", True, 8)[0].workload == "llama1b-lora"
    assert kind("gated", True, 8, lora_targets="all")[0] is None
    assert kind("gated", False, 0, gpus=2) == (
        None, "ZeRO-0 on 2 GPUs, where every one measured ran " + _plan_allowance.MEASURED_SETUP)


def test_fit_writes_the_plan_file_at_the_size_it_found(capsys, tmp_path):
    out = tmp_path / "plan.json"
    got = plan_json(capsys, *GPT2M, "--seq", "1024", "--fit", "batch", "--card-gib", "40",
                    "--out", out)
    doc = json.loads(out.read_text())
    assert doc["estimate"]["total_bytes"] == got["fit"]["planned_peak_bytes"]
    assert got["plan"]["limit"] == doc["limit"]


def assert_refused(status, err, code, *needles):
    assert status == code, err
    assert err.startswith("vramledger: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_a_card_below_the_model_states_fits_nothing(capsys):
    status, out, err = plan(capsys, *LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "16")
    assert out == ""
    assert_refused(status, err, 1, "nothing fits the card 17.18 GB (16.00 GiB)",
                   "the optimizer step alone")


def test_nothing_fits_with_json_prints_size_0_and_the_plan_at_1(capsys):
    args = [*LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "16", "--allocator", "torch"]
    status, out, err = plan(capsys, *args, "--json")
    assert_refused(status, err, 1, "nothing fits the card 17.18 GB (16.00 GiB)")
    got = json.loads(out)
    fit = got["fit"]
    assert (fit["size"], fit["next_size"], fit["needed_bytes"]) == (0, 1, None)
    assert fit["next_planned_peak_bytes"] == got["total_bytes"]
    assert fit["next_needed_bytes"] > fit["card_bytes"] == 16 << 30
    assert fit["allocator"] == "torch" and fit["conservative"]["size"] == 0
    assert got["inputs"]["batch"] == 1 and got["fits"] is False


def test_nothing_fits_under_the_allowance_alone(capsys, tmp_path):
    # The plain plan at 1 fits this card, its allowance does not: "fits" follows --fit, and a
    # plan file asked for is said not to be written.
    args = [*LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "20.6", "--allowance",
            "uncapped", "--out", tmp_path / "plan.json"]
    status, out, err = plan(capsys, *args, "--json")
    assert_refused(status, err, 1, "nothing fits the card 22.12 GB (20.60 GiB)",
                   f"no plan file written ({tmp_path / 'plan.json'})")
    got = json.loads(out)
    assert got["fits"] is False and got["fit"]["size"] == 0
    assert got["total_bytes"] <= got["card_bytes"] < got["fit"]["next_needed_bytes"]
    assert not (tmp_path / "plan.json").exists()


def test_a_sequence_too_long_for_batch_1_fits_nothing(capsys):
    status, _, err = plan(capsys, *LLAMA, "--seq", "100000", "--fit", "batch", "--card-gib", "40")
    assert_refused(status, err, 1, "batch 1 at seq 100000 plans", "a smaller --seq may fit")


def test_fits_at_every_size_tried_names_the_bound(capsys):
    status, out, err = plan(capsys, *GPT2M, "--seq", "1", "--fit", "batch", "--card-gib", "1e6")
    assert out == ""
    assert_refused(status, err, 2, "every micro-batch tried fits",
                   f"up to batch {_plan_fit.MAX_SIZE['batch']} (the search's bound)")


def test_a_models_learned_positions_end_the_sequence_search(capsys):
    # GPT-2-medium's 1024 positions fit a 24 GiB card at micro-batch 1 with room to spare: the
    # answer is 1024, said to be the model's limit, not the card's.
    args = [*GPT2M, "--batch", "1", "--fit", "seq", "--card-gib", "24"]
    status, text, _ = plan(capsys, *args)
    assert status == 0
    assert text.startswith("vramledger plan --fit seq: the longest sequence the model takes, "
                           "1024 (its learned positions), is predicted to fit at micro-batch 1")
    assert ("  seq 1025: longer than the model's 1024 learned positions; the card is not what "
            "limits the sequence\n") in text
    fit = plan_json(capsys, *args)["fit"]
    assert (fit["size"], fit["bound"], fit["limited_by"]) == (1024, 1024, "positions")
    assert "next_size" not in fit and fit["needed_bytes"] <= fit["card_bytes"]
    # With more positions the card ends it, above 1024.
    fit = plan_json(capsys, *GPT2M_8K, "--batch", "1", "--fit", "seq", "--card-gib", "24")["fit"]
    assert fit["limited_by"] == "card" and fit["size"] > 1024 and fit["bound"] == 8192
    # Where the card ends it first, the card is named.
    fit = plan_json(capsys, *GPT2M, "--batch", "64", "--fit", "seq", "--card-gib", "80")["fit"]
    assert fit["limited_by"] == "card" and fit["size"] < 1024 and fit["bound"] == 1024


def test_other_limits_name_what_ends_the_search(capsys):
    fit = plan_json(capsys, *LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "80")["fit"]
    assert fit["limited_by"] == "card"
    got = plan_json(capsys, *LLAMA, "--seq", "2048", "--fit", "batch", "--card-gib", "10",
                    statuses=(1,))
    assert got["fit"]["limited_by"] == "nothing fits"


def test_the_plain_plans_default_sequence_stops_at_the_learned_positions(capsys, tmp_path):
    config = json.loads((CONFIGS / "gpt2-medium.json").read_text()) | {"n_positions": 512}
    (tmp_path / "gpt2-512.json").write_text(json.dumps(config))
    got = plan_json(capsys, "--config", tmp_path / "gpt2-512.json", "--batch", "1")
    assert got["inputs"]["seq"] == 512
    assert plan_json(capsys, *GPT2M, "--batch", "1")["inputs"]["seq"] == 1024


@pytest.mark.parametrize("args, needle", [
    ([*GPT2M, "--seq", "2048", "--batch", "1"],
     "--seq 2048 is longer than the model's 1024 learned positions (from "),
    ([*GPT2M, "--seq", "1025", "--fit", "batch"],
     "--seq 1025 is longer than the model's 1024 learned positions"),
    (["--params", "7B", "--seq", "1024", "--fit", "batch"], "--fit needs the model's shape"),
    ([*GPT2M, "--fit", "batch"], "--fit batch needs the sequence length it holds fixed: give --seq"),
    ([*GPT2M, "--fit", "seq"], "--fit seq needs the micro-batch it holds fixed: give --batch"),
    ([*GPT2M, "--fit", "batch", "--seq", "512", "--batch", "4"],
     "--fit batch searches the micro-batch: drop --batch 4"),
    ([*GPT2M, "--allocator", "torch"], "--allocator applies to --fit only"),
    ([*GPT2M, "--allowance", "cap"], "--allowance applies to --fit only"),
    ([*GPT2M, "--fit", "batch", "--seq", "512", "--allowance", "tight"],
     "argument --allowance: invalid choice: 'tight'"),
    ([*GPT2M, "--fit", "size", "--seq", "512"], "argument --fit: invalid choice: 'size'"),
    ([*GPT2M, "--fit", "seq", "--batch", "0"], "--batch must be at least 1, got 0"),
])
def test_fit_bad_input_is_a_cli_error(capsys, args, needle):
    status, out, err = plan(capsys, *args)
    assert out == ""
    assert_refused(status, err, 2, needle)
