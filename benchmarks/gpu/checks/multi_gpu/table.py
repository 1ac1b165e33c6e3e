"""Verdicts and the table of the multi-GPU check, from the parts' result files (pure Python, no
torch, so the CPU tests run it on stand-in figures).

Each verdict is a row {"check", "world", "native", "vramledger", "verdict"}: the figures of each
allocator as one short text, and PASS, FAIL: reason, or NOT RUN: reason.
"""

from __future__ import annotations

import collections
import math
from typing import Any

REL_TOL = 1e-3
GIB = 1 << 30


def row(check: str, world: int, native: str, vramledger: str, verdict: str) -> dict[str, Any]:
    return {"check": check, "world": world, "native": native, "vramledger": vramledger,
            "verdict": verdict}


def not_run(check: str, world: int, reason: str) -> dict[str, Any]:
    return row(check, world, "-", "-", f"NOT RUN: {reason}")


def _ranks_missing(runs: dict[int, dict], world: int) -> list[int]:
    return [r for r in range(world) if r not in runs]


def fsdp_row(native: dict[int, dict], vl: dict[int, dict], world: int,
             steps: int) -> dict[str, Any]:
    """FSDP2 training: every rank's result under both allocators, losses equal within REL_TOL
    relative at every step, the figures per rank and the median step time per allocator."""
    check = f"FSDP2 GPT-2-medium, {steps} steps"

    def figures(runs: dict[int, dict]) -> str:
        if not runs:
            return "no result"
        median_ms = sorted(r["median_step_s"] for r in runs.values())[len(runs) // 2] * 1e3
        per_rank = "; ".join(f"r{r} {x['peak_reserved'] / GIB:.2f} GiB util "
                             f"{x['utilization']:.3f}" for r, x in sorted(runs.items()))
        return f"median step {median_ms:.1f} ms; peak reserved {per_rank}"

    problems = []
    for name, runs in (("native", native), ("vramledger", vl)):
        missing = _ranks_missing(runs, world)
        if missing:
            problems.append(f"{name} ranks {missing} wrote no result")
        short = [r for r, x in runs.items() if len(x["losses"]) != steps]
        if short:
            problems.append(f"{name} ranks {short} ran fewer than {steps} steps")
    worst = 0.0
    for r in sorted(set(native) & set(vl)):
        for a, b in zip(native[r]["losses"], vl[r]["losses"]):
            worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    if set(native) & set(vl) and worst > REL_TOL:
        problems.append(f"losses differ by {worst:.2e} relative (tolerance {REL_TOL})")
    modes = {x.get("mode") for x in vl.values()}
    if vl and modes != {"native"}:
        problems.append(f"vramledger ran in mode {sorted(map(str, modes))}, not its default "
                        "torch-native mode")
    verdict = "FAIL: " + "; ".join(problems) if problems else (
        f"PASS (losses within {worst:.1e} relative)")
    return row(check, world, figures(native), figures(vl), verdict)


WARM_STEPS = 2  # a run's steps before its steady ones (fsdp.py reads it from here)
VRAMLEDGER_STEP = ("step_driver_ms", "step_waits", "step_wait_ms", "page_moves")
LABELS = {"device_alloc": "maps", "device_free": "unmaps", "step_driver_ms": "driver ms",
          "step_waits": "waits", "step_wait_ms": "wait ms", "page_moves": "page moves"}


def _per_steady_step(runs: list[dict[int, dict]], field: str) -> float | None:
    """`field` per steady step, over every rank of every run that has it."""
    values = [v for run in runs for x in run.values() for v in x.get(field, [])[WARM_STEPS:]]
    return sum(values) / len(values) if values else None


def fsdp_time_row(native: list[dict[int, dict]], vl: list[dict[int, dict]], world: int,
                  failed: list[str], left: list[str]) -> dict[str, Any]:
    """The FSDP2 step-time comparison over rounds (each a run's ranks, round 0 first): per
    allocator the median steady step by round (the median over ranks) and over the rounds, the
    device maps / unmaps per steady step, and vramledger's driver ms, waits, their ms and page
    moves per steady step; vramledger / native as the geometric mean of the rounds' ratios and
    their range. It fails when a run failed or a rank wrote no result; rounds the budget left
    out are named."""
    check = f"FSDP2 step time, {max(len(native), len(vl))} round(s), alternating order"
    problems = list(failed)

    def by_round(runs: list[dict[int, dict]], name: str) -> list[float | None]:
        out = []
        for k, run in enumerate(runs):
            times = [x["steady_median_step_s"] for x in run.values()
                     if "steady_median_step_s" in x]
            if len(times) < world:
                problems.append(f"{name} round {k}: {len(times)} of {world} ranks with a steady "
                                "step time")
                out.append(None)
            else:
                out.append(sorted(times)[len(times) // 2])
        return out

    def figures(runs: list[dict[int, dict]], times: list[float | None], fields) -> str:
        got = [t for t in times if t is not None]
        if not got:
            return "no result"
        text = ("steady step ms by round " + " ".join(
            f"{t * 1e3:.1f}" if t is not None else "-" for t in times) +
            f", median {sorted(got)[len(got) // 2] * 1e3:.1f}")
        counts = [_per_steady_step(runs, f) for f in fields]
        if None not in counts:
            text += "; per steady step " + " / ".join(f"{c:.2f}" for c in counts) + \
                " (" + " / ".join(LABELS[f] for f in fields) + ")"
        return text

    t_native, t_vl = by_round(native, "native"), by_round(vl, "vramledger")
    native_text = figures(native, t_native, ("device_alloc", "device_free"))
    vl_text = figures(vl, t_vl, ("device_alloc", "device_free") + VRAMLEDGER_STEP)
    ratios = [b / a for a, b in zip(t_native, t_vl) if a and b]
    if ratios:
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        vl_text += (f"; vramledger / native {gm:.3f} ({min(ratios):.3f}-{max(ratios):.3f} over "
                    f"{len(ratios)} round(s))")
    if problems:
        verdict = "FAIL: " + "; ".join(problems)
    else:
        verdict = "PASS" + (f" (not run, budget: {', '.join(left)})" if left else "")
    return row(check, world, native_text, vl_text, verdict)


def report_row(summary: dict[str, Any] | None, error: str, world: int,
               steps: int) -> dict[str, Any]:
    """`vramledger report --json` over the vramledger FSDP run's step logs: one row per rank,
    each with every step."""
    check = "vramledger report over every rank's step log"
    if summary is None:
        return row(check, world, "-", f"no report: {error}"[:200], "FAIL: the report failed")
    ranks = summary["ranks"]
    spread = summary["peak_reserved_bytes"]["spread_fraction"]
    text = (f"{len(ranks)} rank(s), steps {[r['steps'] for r in ranks]}, peak reserved spread "
            f"{spread:.1%}, flagged {summary['flagged_ranks']}")
    problems = []
    if sorted(r["rank"] for r in ranks) != list(range(world)):
        problems.append(f"ranks {[r['rank'] for r in ranks]}, expected 0..{world - 1}")
    if any(r["steps"] != steps for r in ranks):
        problems.append(f"a rank logged other than {steps} steps")
    return row(check, world, "-", text, "FAIL: " + "; ".join(problems) if problems else "PASS")


def _multiset(pairs) -> collections.Counter:
    return collections.Counter((int(a), int(s)) for a, s in pairs)


def nccl_figures(runs: dict[int, dict], logs: dict[int, dict]) -> tuple[str, list[str]]:
    """One allocator's NCCL registration figures, and its problems."""
    if not runs:
        return "no result", ["no rank wrote a result"]
    problems, parts = [], []
    for r, x in sorted(runs.items()):
        if x.get("error"):
            problems.append(f"rank {r}: {x['error']}")
            continue
        c = x["counts"]
        bad = [a["name"] for a in x["all_reduce"] if not a["ok"]]
        if bad:
            problems.append(f"rank {r}: all_reduce wrong on {bad}")
        if x["unknown_frees"]:
            problems.append(f"rank {r}: {len(x['unknown_frees'])} SEGMENT_FREE of segments never "
                            "registered")
        if not any(c[k] for k in ("segment_alloc", "segment_map")):
            problems.append(f"rank {r}: the trace tracker saw no SEGMENT_ALLOC or SEGMENT_MAP")
        if x.get("dropped_events"):
            problems.append(f"rank {r}: the tracker dropped {x['dropped_events']} events")
        text = (f"r{r}: registered {len(x['registrations'])} ({len(x['at_init'])} at creation), "
                f"deregistered {len(x['deregistrations'])}; trace SEGMENT_ALLOC/FREE/MAP/UNMAP "
                f"{c['segment_alloc']}/{c['segment_free']}/{c['segment_map']}/"
                f"{c['segment_unmap']}")
        if x.get("page_moves") is not None:
            text += f", page moves {x['page_moves']}"
        text += f", {len(x['all_reduce'])} all_reduce ok {len(x['all_reduce']) - len(bad)}"
        log = logs.get(r)
        if log is None:
            text += ", no NCCL log"
        elif log["warnings"]:
            problems.append(f"rank {r}: NCCL warned: {log['warnings'][0][:160]}")
        if log is not None:
            seen = _multiset(log["registered"] + log["skipped"])
            text += f", NCCL logged {sum(seen.values())} registrations"
            if seen and seen != _multiset(x["registrations"]):
                problems.append(f"rank {r}: NCCL registered {sum(seen.values())} buffers, the "
                                f"hook was due {len(x['registrations'])} (addresses differ: "
                                f"{len(seen - _multiset(x['registrations']))} unexpected)")
        parts.append(text)
    return "; ".join(parts), problems


def nccl_row(native: dict[int, dict], vl: dict[int, dict], native_logs: dict[int, dict],
             vl_logs: dict[int, dict], world: int) -> dict[str, Any]:
    """ProcessGroupNCCL with the register hook: no error, every all_reduce right, NCCL's
    registrations those the hook was due, and (vramledger) pages moved by recycling."""
    check = "NCCL register hook, page recycling forced"
    native_text, problems = nccl_figures(native, native_logs)
    vl_text, vl_problems = nccl_figures(vl, vl_logs)
    problems = [f"native {p}" for p in problems] + [f"vramledger {p}" for p in vl_problems]
    for name, runs in (("native", native), ("vramledger", vl)):
        missing = _ranks_missing(runs, world)
        if missing:
            problems.append(f"{name} ranks {missing} wrote no result")
    logged = {name: sum(len(log["registered"]) + len(log["skipped"]) for log in logs.values())
              for name, logs in (("native", native_logs), ("vramledger", vl_logs))}
    if logged["native"] and not logged["vramledger"] and vl:
        problems.append("NCCL logged no registration under vramledger (the hook off?), "
                        f"{logged['native']} under torch native")
    elif not logged["native"] and not logged["vramledger"]:
        native_text += "; NCCL's log has no registration line: compared with the hook's due only"
    moved = [x.get("page_moves") or 0 for x in vl.values() if not x.get("error")]
    if moved and not any(moved):
        problems.append("vramledger moved no page: recycling was not exercised")
    verdict = "FAIL: " + "; ".join(problems) if problems else "PASS"
    return row(check, world, native_text, vl_text, verdict[:600])


def ipc_rows(result: dict[str, Any] | None, error: str, world: int) -> list[dict[str, Any]]:
    """CUDA IPC between the process on GPU 0 and the one on GPU (1 % GPUs), both ways, plain and
    expandable; with one GPU the cross-device row is NOT RUN and the same-GPU row says so."""
    if result is None:
        return [row("CUDA IPC", world, "-", f"no result: {error}"[:200], "FAIL: no result")]
    a, b = result["gpus"]
    rows = []
    if result["same_gpu"]:
        rows.append(not_run("CUDA IPC across GPUs (GPU 0 <-> GPU 1)", world, "needs 2 GPUs"))
        check = f"CUDA IPC, two processes on the same GPU {a} (in place of across GPUs)"
    else:
        check = f"CUDA IPC across GPUs (GPU {a} <-> GPU {b})"
    cells = [f"{r['layout']} GPU {r['from_gpu']}->{r['to_gpu']} ({r['segment']}): read "
             f"{'ok' if r['read_ok'] else 'WRONG'}, write {'ok' if r['write_ok'] else 'WRONG'}"
             for r in result["rows"]]
    bad = [c for c, r in zip(cells, result["rows"]) if not (r["read_ok"] and r["write_ok"])]
    problems = bad + result["errors"]
    if not result["rows"] and not problems:
        problems = ["no case ran"]
    verdict = "FAIL: " + "; ".join(p.splitlines()[-1] if p else p for p in problems)[:600] \
        if problems else "PASS"
    rows.append(row(check, world, "-", "; ".join(cells) or "-", verdict))
    return rows


def format_table(rows: list[dict[str, Any]], gpus: int) -> str:
    lines = [f"==== multi-GPU check: {gpus} GPU(s)",
             "| check | world | torch native | vramledger default | verdict |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['check']} | {r['world']} | {r['native']} | {r['vramledger']} | "
                     f"{r['verdict']} |")
    if any(r["world"] == 1 for r in rows):
        lines.append("world size 1: FSDP2 shards nothing and NCCL's collectives stay on one GPU; "
                     "sharding across ranks and IPC across devices need 2 GPUs (kind "
                     "nvidia-h200-x2).")
    return "\n".join(lines)


def passed(rows: list[dict[str, Any]]) -> bool:
    """True when no row failed (NOT RUN rows, with their reason, do not fail the check)."""
    return not any(r["verdict"].startswith("FAIL") for r in rows)
