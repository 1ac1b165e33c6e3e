"""The multi-GPU check's verdicts and table (benchmarks/gpu/checks/multi_gpu/table.py) and its
NCCL bookkeeping (nccl_register.py), on stand-in figures; its driver's arguments and its answer
on a machine without a GPU. The check itself runs on the GPU machine (run.sh item `multi`)."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import types

import pytest

HERE = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "checks" / "multi_gpu"
GIB = 1 << 30


def _load(name):
    spec = importlib.util.spec_from_file_location(f"multi_gpu_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the standard library only at the top
    return module


table = _load("table")
nccl = _load("nccl_register")


def fsdp_rank(rank, losses, mode="native", reserved=20 * GIB, allocated=19 * GIB, step_s=0.2):
    r = {"rank": rank, "losses": losses, "median_step_s": step_s, "peak_reserved": reserved,
         "peak_allocated": allocated, "utilization": allocated / reserved}
    if mode:
        r["mode"] = mode
    return r


def test_fsdp_passes_when_losses_agree_and_prints_figures_per_rank():
    losses = [10.5, 10.2, 9.9]
    native = {r: fsdp_rank(r, losses, mode=None, reserved=21 * GIB) for r in range(2)}
    vl = {r: fsdp_rank(r, [x * (1 + 5e-4) for x in losses], step_s=0.25) for r in range(2)}
    row = table.fsdp_row(native, vl, world=2, steps=3)
    assert row["verdict"].startswith("PASS"), row
    assert "r1 21.00 GiB util 0.905" in row["native"]
    assert "median step 250.0 ms" in row["vramledger"]
    assert "r0 20.00 GiB util 0.950" in row["vramledger"]


def test_fsdp_fails_on_losses_past_the_tolerance_and_on_a_missing_rank():
    native = {0: fsdp_rank(0, [10.0, 9.0]), 1: fsdp_rank(1, [10.0, 9.0])}
    vl = {0: fsdp_rank(0, [10.0, 9.0 * (1 + 2e-3)])}
    verdict = table.fsdp_row(native, vl, world=2, steps=2)["verdict"]
    assert verdict.startswith("FAIL")
    assert "vramledger ranks [1] wrote no result" in verdict
    assert "losses differ by 2.00e-03" in verdict


def test_fsdp_fails_when_vramledger_ran_in_the_pluggable_mode():
    native = {0: fsdp_rank(0, [1.0])}
    verdict = table.fsdp_row(native, {0: fsdp_rank(0, [1.0], mode="pluggable")}, 1, 1)["verdict"]
    assert verdict.startswith("FAIL") and "pluggable" in verdict


def test_report_row_needs_every_rank_with_every_step():
    summary = {"ranks": [{"rank": 0, "steps": 10}, {"rank": 1, "steps": 10}],
               "peak_reserved_bytes": {"spread_fraction": 0.01}, "flagged_ranks": []}
    assert table.report_row(summary, "", world=2, steps=10)["verdict"] == "PASS"
    assert "spread 1.0%" in table.report_row(summary, "", 2, 10)["vramledger"]
    assert table.report_row(summary, "", world=3, steps=10)["verdict"].startswith("FAIL")
    assert table.report_row(None, "no step logs", 2, 10)["verdict"].startswith("FAIL")


def test_parse_nccl_log_reads_registrations_skips_and_warnings():
    text = ("host:1:2 [0] NCCL INFO register comm 0x55d0 buffer 0x7f0000000000 size 2097152\n"
            "host:1:2 [0] NCCL INFO Skipping registration for buffer 0x7f0000400000 size 4096 "
            "(LocalRegister=0, P2pUsesMemcpy=0)\n"
            "host:1:2 [0] NCCL WARN Deregister: Could not find handle\n"
            "host:1:2 [0] NCCL INFO rank 0 - deregistered net buffer handle 0x1\n")
    log = nccl.parse_nccl_log(text)
    assert log["registered"] == [(0x7F0000000000, 2097152)]
    assert log["skipped"] == [(0x7F0000400000, 4096)]
    assert log["warnings"] == ["host:1:2 [0] NCCL WARN Deregister: Could not find handle"]


def test_expected_registrations_follow_segment_alloc_and_free_of_this_device():
    A, F, M, U = (nccl.ACTIONS.index(a) for a in ("segment_alloc", "segment_free",
                                                  "segment_map", "segment_unmap"))
    events = [(A, 0, 0x2000, 64), (M, 0, 0x9000, 2), (A, 1, 0x5000, 8),  # other device
              (A, 0, 0x2000, 64),  # already registered: torch passes over it
              (F, 0, 0x1000, 32), (U, 0, 0x9000, 2), (F, 0, 0x2000, 64), (F, 0, 0x7000, 16)]
    got = nccl.expected_registrations([(0x1000, 32)], events, device=0)
    assert got["registrations"] == [(0x1000, 32), (0x2000, 64)]
    assert got["deregistrations"] == [(0x1000, 32), (0x2000, 64)]
    assert got["unknown_frees"] == [(0x7000, 16)]


def nccl_rank(rank, regs, moves=4, ok=True, error=None):
    return {"rank": rank, "error": error, "at_init": regs[:1], "registrations": regs,
            "deregistrations": regs[1:], "unknown_frees": [], "page_moves": moves,
            "counts": {"segment_alloc": len(regs) - 1, "segment_free": len(regs) - 1,
                       "segment_map": 9, "segment_unmap": 7},
            "all_reduce": [{"name": "1 MiB", "ok": True}, {"name": "block", "ok": ok}]}


def test_nccl_row_passes_when_nccl_registered_what_the_hook_was_due():
    regs = [(0x1000, 32), (0x2000, 64)]
    log = {"registered": regs, "skipped": [], "warnings": []}
    row = table.nccl_row({0: nccl_rank(0, regs, moves=None)}, {0: nccl_rank(0, regs)},
                         {0: log}, {0: log}, world=1)
    assert row["verdict"] == "PASS", row
    assert "registered 2 (1 at creation), deregistered 1" in row["vramledger"]
    assert "SEGMENT_ALLOC/FREE/MAP/UNMAP 1/1/9/7, page moves 4" in row["vramledger"]
    assert "page moves" not in row["native"]
    assert "NCCL logged 2 registrations" in row["native"]


def test_nccl_row_fails_on_other_addresses_wrong_results_no_moves_and_warnings():
    regs = [(0x1000, 32), (0x2000, 64)]
    good = {"registered": regs, "skipped": [], "warnings": []}
    other = {"registered": [(0x1000, 32), (0x3000, 64)], "skipped": [], "warnings": []}
    warned = {"registered": regs, "skipped": [], "warnings": ["NCCL WARN x"]}
    native = {0: nccl_rank(0, regs, moves=None)}
    cases = [({0: nccl_rank(0, regs)}, other, "1 unexpected"),
             ({0: nccl_rank(0, regs, ok=False)}, good, "all_reduce wrong on ['block']"),
             ({0: nccl_rank(0, regs, moves=0)}, good, "moved no page"),
             ({0: nccl_rank(0, regs)}, warned, "NCCL warned"),
             ({0: nccl_rank(0, regs, error="RuntimeError: boom")}, good, "boom"),
             ({}, good, "vramledger ranks [0] wrote no result"),
             ({0: nccl_rank(0, regs)}, {"registered": [], "skipped": [], "warnings": []},
              "NCCL logged no registration under vramledger")]
    for vl, log, reason in cases:
        verdict = table.nccl_row(native, vl, {0: good}, {0: log}, world=1)["verdict"]
        assert verdict.startswith("FAIL") and reason in verdict, (reason, verdict)


def ipc_result(same_gpu, read_ok=True):
    gpus = [0, 0] if same_gpu else [0, 1]
    rows = [{"layout": layout, "from_gpu": gpus[s], "to_gpu": gpus[1 - s],
             "segment": "cudaMalloc" if layout == "plain" else "pages", "read_ok": read_ok,
             "write_ok": True} for layout in ("plain", "expandable") for s in (0, 1)]
    return {"gpus": gpus, "same_gpu": same_gpu, "rows": rows, "errors": []}


def test_ipc_on_one_gpu_says_across_gpus_was_not_run_and_why():
    rows = table.ipc_rows(ipc_result(same_gpu=True), "", world=1)
    assert [r["verdict"] for r in rows] == ["NOT RUN: needs 2 GPUs", "PASS"]
    assert "same GPU 0" in rows[1]["check"]
    assert "expandable GPU 0->0 (pages): read ok, write ok" in rows[1]["vramledger"]
    assert table.passed(rows)


def test_ipc_across_gpus_fails_on_a_wrong_read_or_an_error():
    rows = table.ipc_rows(ipc_result(same_gpu=False), "", world=2)
    assert len(rows) == 1 and rows[0]["verdict"] == "PASS"
    assert "GPU 0 <-> GPU 1" in rows[0]["check"]
    bad = table.ipc_rows(ipc_result(same_gpu=False, read_ok=False), "", world=2)
    assert bad[0]["verdict"].startswith("FAIL") and "read WRONG" in bad[0]["verdict"]
    failed = dict(ipc_result(same_gpu=False), rows=[], errors=["process 7 exit 1"])
    assert "process 7 exit 1" in table.ipc_rows(failed, "", 2)[0]["verdict"]
    assert table.ipc_rows(None, "timed out", 2)[0]["verdict"].startswith("FAIL")


def test_format_table_has_a_line_per_row_and_says_what_world_size_one_leaves_out():
    rows = [table.row("a", 1, "n", "v", "PASS"), table.not_run("b", 1, "needs 2 GPUs")]
    text = table.format_table(rows, gpus=1)
    lines = text.splitlines()
    assert lines[0] == "==== multi-GPU check: 1 GPU(s)"
    assert lines[3] == "| a | 1 | n | v | PASS |"
    assert lines[4] == "| b | 1 | - | - | NOT RUN: needs 2 GPUs |"
    assert "need 2 GPUs" in lines[-1]
    assert table.passed(rows)
    assert not table.passed(rows + [table.row("c", 2, "", "", "FAIL: x")])
    assert "world size 1" not in table.format_table([table.row("a", 2, "", "", "PASS")], 2)


def test_run_refuses_an_unknown_part():
    proc = subprocess.run([sys.executable, str(HERE / "run.py"), "--out", "x", "--parts",
                           "fsdp,ddp"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown part(s) ['ddp']" in proc.stderr


def test_run_without_a_gpu_prints_a_not_run_table(tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "run.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": str(tmp_path)})  # no nvidia-smi on this PATH
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == [
        "| every part | 1 | - | - | NOT RUN: no GPU (nvidia-smi -L lists none) |",
        "world size 1: FSDP2 shards nothing and NCCL's collectives stay on one GPU; sharding "
        "across ranks and IPC across devices need 2 GPUs (kind nvidia-h200-x2)."]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["verdict"].startswith("NOT RUN")


def _tracker_path():
    root = HERE.parents[3]
    for build in ("build-ci", "build"):
        path = root / build / "torch_plugin" / "lib" / "libvramledger_trace_counter.so"
        if path.exists():
            return path
    return None


def test_trace_counter_attaches_to_torchs_allocator_without_a_gpu():
    """trace_counter.cc on this CPU machine: torch's allocator takes the tracker before CUDA
    starts (as ProcessGroupNCCL attaches its hook), nothing has happened yet, an action torch
    does not have reads -1, and the read-back of events is empty."""
    pytest.importorskip("torch")
    lib = _tracker_path()
    if lib is None:
        pytest.skip("libvramledger_trace_counter.so is not built (benchmarks off or no torch)")
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(HERE)!r})
import nccl_register
t = nccl_register.Tracker({str(lib)!r})
t.attach()
t.attach()  # a second tracker: torch keeps both
print(json.dumps([t.counts(), t.events(), t.lib.vramledger_tc_count(len(nccl_register.ACTIONS)),
                  t.lib.vramledger_tc_count(-1), t.lib.vramledger_tc_dropped()]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts, events, past_end, negative, dropped = json.loads(proc.stdout.splitlines()[-1])
    assert counts == {name: 0 for name in nccl.ACTIONS}
    assert events == [] and past_end == -1 and negative == -1 and dropped == 0


def test_nccl_row_says_when_nccl_logged_no_registration_at_all():
    regs = [(0x1000, 32)]
    silent = {"registered": [], "skipped": [], "warnings": []}
    row = table.nccl_row({0: nccl_rank(0, regs, moves=None)}, {0: nccl_rank(0, regs)},
                         {0: silent}, {0: silent}, world=1)
    assert row["verdict"] == "PASS"
    assert "NCCL's log has no registration line" in row["native"]


def timed_rank(rank, steady_s, maps=(30, 20, 4, 0, 2), vl=False):
    """A rank's result with step counters: two warm steps, then steady ones."""
    r = {"rank": rank, "steady_median_step_s": steady_s, "device_alloc": list(maps),
         "device_free": [0, 5, 1, 1, 0]}
    if vl:
        r.update(step_driver_ms=[40.0, 9.0, 1.0, 2.0, 3.0], step_waits=[0, 1, 0, 0, 1],
                 step_wait_ms=[0.0, 4.0, 0.0, 0.0, 1.5], page_moves=[0, 3, 6, 0, 0])
    return r


def test_fsdp_time_row_compares_the_rounds_and_gives_the_counters_per_steady_step():
    native = [{r: timed_rank(r, t) for r in range(2)} for t in (0.30, 0.32, 0.31)]
    vl = [{0: timed_rank(0, t, vl=True), 1: timed_rank(1, t + 0.02, vl=True)}
          for t in (0.29, 0.33, 0.30)]
    row = table.fsdp_time_row(native, vl, world=2, failed=[], left=[])
    assert row["check"] == "FSDP2 step time, 3 round(s), alternating order"
    assert row["verdict"] == "PASS"
    # Two ranks: the median over ranks is the upper one; steady steps are the last three.
    assert row["native"] == ("steady step ms by round 300.0 320.0 310.0, median 310.0; per steady "
                             "step 2.00 / 0.67 (maps / unmaps)")
    ratios = [0.31 / 0.30, 0.35 / 0.32, 0.32 / 0.31]
    gm = math.exp(sum(map(math.log, ratios)) / 3)
    assert row["vramledger"] == (
        "steady step ms by round 310.0 350.0 320.0, median 320.0; per steady step 2.00 / 0.67 / "
        "2.00 / 0.33 / 0.50 / 2.00 (maps / unmaps / driver ms / waits / wait ms / page moves); "
        f"vramledger / native {gm:.3f} ({min(ratios):.3f}-{max(ratios):.3f} over 3 round(s))")


def test_fsdp_time_row_fails_on_a_failed_run_or_a_missing_rank_and_names_what_the_budget_left():
    native = [{0: timed_rank(0, 0.3)}, {0: timed_rank(0, 0.3)}]
    vl = [{0: timed_rank(0, 0.3, vl=True)}, {}]
    row = table.fsdp_time_row(native, vl, 1, ["vramledger round 1: exit 1 (log x)"],
                              ["native round 2", "vramledger round 2"])
    assert row["verdict"] == ("FAIL: vramledger round 1: exit 1 (log x); vramledger round 1: 0 of "
                              "1 ranks with a steady step time")
    assert row["vramledger"].startswith("steady step ms by round 300.0 -, median 300.0")
    assert "over 1 round(s)" in row["vramledger"]
    ok = table.fsdp_time_row(native[:1], vl[:1], 1, [], ["native round 1", "vramledger round 1"])
    assert ok["verdict"] == "PASS (not run, budget: native round 1, vramledger round 1)"
    # Results without the counters: the times alone; without the steady step time: named.
    bare = [{0: {"rank": 0, "steady_median_step_s": 0.25}}]
    assert table.fsdp_time_row(bare, bare, 1, [], [])["native"] == (
        "steady step ms by round 250.0, median 250.0")
    older = [{0: {"rank": 0, "median_step_s": 0.25}}]
    assert table.fsdp_time_row(older, bare, 1, [], [])["verdict"] == (
        "FAIL: native round 0: 0 of 1 ranks with a steady step time")


def test_run_alternates_the_order_of_the_fsdp_rounds_and_refuses_zero_rounds():
    spec = importlib.util.spec_from_file_location("multi_gpu_run", HERE / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    assert [run.round_order(r) for r in range(3)] == [
        ("native", "vramledger"), ("vramledger", "native"), ("native", "vramledger")]
    proc = subprocess.run([sys.executable, str(HERE / "run.py"), "--out", "x", "--fsdp-rounds",
                           "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--fsdp-rounds >= 1" in proc.stderr


def test_fsdp_rounds_run_both_allocators_alternately_while_the_budget_has_room():
    spec = importlib.util.spec_from_file_location("multi_gpu_run_rounds", HERE / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    started = []

    def fsdp_run(args, nproc, budget, alloc, round_):
        started.append((alloc, round_))
        budget.spent += 40.0
        return {0: timed_rank(0, 0.3, vl=alloc == "vramledger")}, ""

    class Budget:  # 40 s per run; a run needs max(20, 1.5 x 30) = 45 s, plus 5
        def __init__(self, seconds):
            self.seconds, self.spent = seconds, 0.0

        def left(self):
            return self.seconds - self.spent

    run.fsdp_run = fsdp_run
    args = types.SimpleNamespace(fsdp_rounds=3, fsdp_run_s=30.0)
    first = {"native": {0: timed_rank(0, 0.3)}, "vramledger": {0: timed_rank(0, 0.3, vl=True)}}
    (row,) = run.fsdp_rounds_part(args, 1, Budget(1000.0), first)
    assert started == [("vramledger", 1), ("native", 1), ("native", 2), ("vramledger", 2)]
    assert row["check"] == "FSDP2 step time, 3 round(s), alternating order"
    assert row["verdict"] == "PASS" and "over 3 round(s)" in row["vramledger"]
    started.clear()
    (row,) = run.fsdp_rounds_part(args, 1, Budget(80.0), first)  # room for one run only
    assert started == [("vramledger", 1)]
    assert row["verdict"] == ("PASS (not run, budget: native round 1, native round 2, vramledger "
                              "round 2)")
    assert "over 1 round(s)" in row["vramledger"]  # round 1 has no native run to pair with
    # No first round to build on: the row says so and nothing starts.
    started.clear()
    (row,) = run.fsdp_rounds_part(args, 1, Budget(1000.0), {})
    assert started == [] and row["verdict"].startswith("NOT RUN: the first FSDP2 runs")
