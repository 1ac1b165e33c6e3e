"""The feature matrix: each torch feature that goes through the CUDA allocator, under torch's
allocator and under each route of vramledger, one process per cell (cells.py).

Columns: torch native, torch expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True),
vramledger default (vramledger.install()), vramledger pluggable (install(mode="pluggable")), and
the LD_PRELOAD shim on an unmodified program. The columns run side by side (one process each,
running its cells in turn), so step times here are not a benchmark (bench/graph_step_ab.py is).

Passes when every feature that passes under torch native passes under vramledger default and
the shim, with the same numbers (losses, sums, tokens) within 1e-3 relative.

    python benchmarks/gpu/checks/feature_matrix/run.py --shim .devbuild/lib/libvramledger_preload.so
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = ("native", "expandable", "vramledger", "pluggable", "shim")
TITLES = {"native": "torch native", "expandable": "torch expandable",
          "vramledger": "vramledger default", "pluggable": "vramledger pluggable",
          "shim": "LD_PRELOAD shim"}
FEATURES = ("stats", "snapshot", "graph", "oom", "mempool", "mempool_custom", "ipc",
            "nccl_register", "fsdp2", "compile_generate", "compile_train")
MUST_MATCH = ("vramledger", "shim")  # columns that must pass what torch native passes
REL_TOL = 1e-3


def column_env(column: str, shim: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF", "VRAMLEDGER_CONF")}
    if column == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if column == "shim":
        env["LD_PRELOAD"] = shim
        env["VRAMLEDGER_PRELOAD_QUIET"] = "1"
    return env


def run_cell(feature: str, column: str, shim: str, out: str, timeout: int) -> dict:
    log = os.path.join(out, f"{column}-{feature}.log")
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "cells.py"), feature, column],
                              env=column_env(column, shim), capture_output=True, text=True,
                              timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace")
        rc = "timeout"
    with open(log, "w") as f:
        f.write(text)
    lines = [l for l in text.splitlines() if l.startswith("FM_RESULT ")]
    if lines:
        result = json.loads(lines[-1][len("FM_RESULT "):])
    else:
        tail = [l for l in text.splitlines() if l.strip()][-1:] or [""]
        result = {"feature": feature, "column": column, "ok": False, "values": [],
                  "detail": f"exit {rc} without a result: {tail[0][:200]}"}
    result["seconds"] = round(time.time() - t0, 1)
    return result


def run_column(column: str, features, shim: str, out: str, timeout: int,
               deadline: float) -> list[dict]:
    """The column's cells in turn; a cell that would start past `deadline` is listed as not
    run, and none runs past it, so the table is printed within the budget."""
    results = []
    for f in features:
        left = int(deadline - time.time())
        if left < 10:
            results.append({"feature": f, "column": column, "ok": False, "values": [],
                            "detail": "not run: the budget was spent", "seconds": 0.0,
                            "not_run": True})
            continue
        results.append(run_cell(f, column, shim, out, min(timeout, left)))
    return results


def agree(a: list, b: list) -> tuple[bool, float]:
    if len(a) != len(b):
        return False, float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-12))
    return worst <= REL_TOL, worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shim", required=True, help="path of libvramledger_preload.so")
    ap.add_argument("--out", default=".devbuild/out/feature_matrix")
    ap.add_argument("--features", default=",".join(FEATURES))
    ap.add_argument("--columns", default=",".join(COLUMNS))
    ap.add_argument("--cell-timeout", type=int, default=240)
    ap.add_argument("--budget-s", type=int, default=3600,
                    help="no cell runs past this many seconds from the start")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["FM_OUT"] = os.path.abspath(args.out)
    features = args.features.split(",")
    columns = args.columns.split(",")
    deadline = time.time() + args.budget_s
    with concurrent.futures.ThreadPoolExecutor(len(columns)) as pool:
        futures = {c: pool.submit(run_column, c, features, os.path.abspath(args.shim), args.out,
                                  args.cell_timeout, deadline) for c in columns}
        results = {c: {r["feature"]: r for r in futures[c].result()} for c in columns}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)

    failures = []
    for column in columns:
        for feature in features:
            r = results[column][feature]
            base = results.get("native", {}).get(feature)
            if column != "native" and base and base["ok"] and r["ok"] and base["values"]:
                same, worst = agree(base["values"], r["values"])
                r["agrees"] = same
                r["detail"] += f" (vs native: worst rel. {worst:.1e})"
                if not same:
                    r["ok"] = False
            if column in MUST_MATCH and (r.get("not_run") or (base and base.get("not_run"))):
                failures.append(f"{feature} under {TITLES[column]}: not run (budget)")
            elif column in MUST_MATCH and base and base["ok"] and not r["ok"]:
                failures.append(f"{feature} under {TITLES[column]}: {r['detail']}")

    print("\n---- details")
    for feature in features:
        for column in columns:
            r = results[column][feature]
            print(f"{feature:17} {TITLES[column]:21} {'ok' if r['ok'] else 'FAIL':4} "
                  f"{r['seconds']:6.1f}s  {r['detail']}")
    print("\n---- feature matrix (ok / FAIL / not run; details above)")
    width = max(len(TITLES[c]) for c in columns)
    print(f"| {'feature':17} | " + " | ".join(f"{TITLES[c]:{width}}" for c in columns) + " |")
    for feature in features:
        cells = ["not run" if results[c][feature].get("not_run") else
                 "ok" if results[c][feature]["ok"] else "FAIL" for c in columns]
        print(f"| {feature:17} | " + " | ".join(f"{x:{width}}" for x in cells) + " |")
    for line in failures:
        print("FAIL", line)
    print("PASS" if not failures else f"FAIL: {len(failures)} feature(s)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
