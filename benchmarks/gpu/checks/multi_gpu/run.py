"""Multi-GPU check: FSDP2, NCCL buffer registration, CUDA IPC across devices and `vramledger
report`, for any number of GPUs (world size 1 on one GPU); prints one table last.

Parts (each a process of its own, each under torch's native allocator and under vramledger's
default where the part compares them):
  fsdp   fsdp.py under `torchrun --nproc-per-node N`, once per allocator: GPT-2-medium with FSDP2,
         losses equal within 1e-3 relative, peak reserved and utilization per rank, median step
         time per allocator; then `vramledger report` over every rank's step log. After the
         other parts, the step-time comparison: --fsdp-rounds rounds in all (the first is the
         run above), each running both allocators, in an order that alternates from round to
         round; each rank's median steady step, its device maps and unmaps and vramledger's
         driver time, waits and page moves per steady step. A run starts only when the budget
         has room for it (1.5 x the longest first-round run, at least 20 s).
  nccl   nccl_register.py under torchrun, once per allocator, with
         TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1: registrations and deregistrations the
         hook was due (from a trace tracker of its own, libvramledger_trace_counter.so), matched
         against NCCL's own REG log lines, page recycling forced, all_reduce results.
  ipc    ipc_pair.py: a tensor shared from the process on GPU 0 to the one on GPU (1 % N) and back,
         plain (contiguous_segments()) and expandable; with one GPU on the same GPU, said so.

Usage (GPU machine; VRAMLEDGER_PLUGIN and PYTHONPATH as run.sh sets them; run.sh item `multi`):
  python run.py --out DIR [--nproc N] [--steps 10] [--fsdp-rounds 3] [--parts fsdp,nccl,ipc]
                [--budget-s 230]
Exit status 0 when no row failed (NOT RUN rows give their reason and do not fail), 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import table  # noqa: E402  (beside this file)
from nccl_register import parse_nccl_log  # noqa: E402

PARTS = ("fsdp", "nccl", "ipc")
ALLOCATORS = ("native", "vramledger")


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def launch(cmd: list[str], log: str, budget: Budget, limit_s: float,
           env: dict[str, str] | None = None) -> str:
    """Runs `cmd` with its output in `log`; returns "" or why it did not end well."""
    timeout = min(limit_s, budget.left() - 5)
    if timeout < 20:
        return f"{budget.left():.0f} s of the budget left"
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    return "" if proc.returncode == 0 else f"exit {proc.returncode} (log {log})"


def budget_row(check: str, world: int, why: str) -> dict | None:
    """A NOT RUN row when the part never started for lack of budget, else None."""
    return table.not_run(check, world, why) if why.endswith("of the budget left") else None


def torchrun(nproc: int, script: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", os.path.join(HERE, script), *args]


def load_ranks(directory: str) -> dict[int, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        with open(path) as f:
            r = json.load(f)
        out[r["rank"]] = r
    return out


def fsdp_run(args, nproc: int, budget: Budget, alloc: str, round_: int) -> tuple[dict, str]:
    """One FSDP2 run: its ranks' results and "" or why it did not end well. Round 0's files are
    in fsdp-<allocator>, later rounds' in fsdp-<allocator>-round<R>."""
    d = os.path.join(args.out, f"fsdp-{alloc}" + (f"-round{round_}" if round_ else ""))
    # An earlier run's results in the same folder must not stand for a run that wrote none.
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    t0 = time.monotonic()
    why = launch(torchrun(nproc, "fsdp.py", ["--allocator", alloc, "--out", d, "--steps",
                                             str(args.steps)]),
                 os.path.join(d, "torchrun.log"), budget, args.launch_timeout_s)
    if round_ == 0:
        args.fsdp_run_s = max(args.fsdp_run_s, time.monotonic() - t0)
    return load_ranks(d), why


def round_order(round_: int) -> tuple[str, ...]:
    """The allocators in the order round `round_` runs them: alternating, so what one run leaves
    to the next (clocks, the host's page cache) falls on each alike."""
    return ALLOCATORS if round_ % 2 == 0 else ALLOCATORS[::-1]


def fsdp_part(args, nproc: int, budget: Budget, first: dict) -> list[dict]:
    """Round 0 of FSDP2 under each allocator (its runs kept in `first` for the rounds after)."""
    runs, why = {}, {}
    for alloc in ALLOCATORS:
        runs[alloc], why[alloc] = fsdp_run(args, nproc, budget, alloc, 0)
    if not why["native"] and not why["vramledger"]:
        first.update(runs)
    skipped = budget_row(f"FSDP2 GPT-2-medium, {args.steps} steps", nproc, why["vramledger"])
    if skipped:
        return [skipped]
    rows = [table.fsdp_row(runs["native"], runs["vramledger"], nproc, args.steps)]
    if why["native"] or why["vramledger"]:
        note = "; ".join(f"{a}: {w}" for a, w in why.items() if w)
        rows[0]["verdict"] = (rows[0]["verdict"] if rows[0]["verdict"].startswith("FAIL")
                              else "FAIL") + f" ({note})"
    steps_dir = os.path.join(args.out, "fsdp-vramledger", "steps")
    proc = subprocess.run([sys.executable, "-m", "vramledger", "report", "--json", steps_dir],
                          capture_output=True, text=True, timeout=60)
    summary = json.loads(proc.stdout) if proc.returncode == 0 else None
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    rows.append(table.report_row(summary, proc.stderr.strip()[-200:], nproc, args.steps))
    return rows


def fsdp_rounds_part(args, nproc: int, budget: Budget, first: dict) -> list[dict]:
    """Rounds 1 .. --fsdp-rounds - 1 after round 0's runs `first` (none with --fsdp-rounds 1),
    and the step-time row."""
    check = "FSDP2 step time"
    if not first:
        return [table.not_run(check, nproc, "the first FSDP2 runs did not both end well")]
    rounds = {a: [first[a]] for a in ALLOCATORS}
    failed, left = [], []
    for r in range(1, args.fsdp_rounds):
        for alloc in round_order(r):
            # launch() itself refuses to start with under 20 s left.
            if budget.left() - 5 < max(20.0, 1.5 * args.fsdp_run_s):
                left.append(f"{alloc} round {r}")
                continue
            got, w = fsdp_run(args, nproc, budget, alloc, r)
            if w:
                failed.append(f"{alloc} round {r}: {w}")
            rounds[alloc].append(got)
    return [table.fsdp_time_row(rounds["native"], rounds["vramledger"], nproc, failed, left)]


def nccl_part(args, nproc: int, budget: Budget) -> list[dict]:
    check = "NCCL register hook, page recycling forced"
    if not os.path.isfile(args.tracker):
        return [table.not_run(check, nproc, f"no {args.tracker} (bash benchmarks/gpu/run.sh "
                                            "prepare builds it)")]
    runs, logs, why = {}, {}, []
    for alloc in ALLOCATORS:
        d = os.path.join(args.out, f"nccl-{alloc}")
        os.makedirs(d, exist_ok=True)
        env = {"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1", "NCCL_DEBUG": "INFO",
               "NCCL_DEBUG_SUBSYS": "REG", "NCCL_DEBUG_FILE": os.path.join(d, "nccl.%p.log")}
        w = launch(torchrun(nproc, "nccl_register.py", ["--allocator", alloc, "--out", d,
                                                        "--tracker", args.tracker]),
                   os.path.join(d, "torchrun.log"), budget, args.launch_timeout_s, env)
        if budget_row(check, nproc, w):
            return [budget_row(check, nproc, w)]
        if w:
            why.append(f"{alloc}: {w}")
        runs[alloc] = load_ranks(d)
        logs[alloc] = {}
        for r, x in runs[alloc].items():
            path = os.path.join(d, f"nccl.{x['pid']}.log")
            if os.path.isfile(path):
                with open(path, errors="replace") as f:
                    logs[alloc][r] = parse_nccl_log(f.read())
    out = table.nccl_row(runs["native"], runs["vramledger"], logs["native"], logs["vramledger"],
                         nproc)
    if why:
        out["verdict"] = (out["verdict"] if out["verdict"].startswith("FAIL") else "FAIL") + \
            f" ({'; '.join(why)})"
    return [out]


def ipc_part(args, gpus: int, budget: Budget) -> list[dict]:
    path = os.path.join(args.out, "ipc.json")
    why = launch([sys.executable, os.path.join(HERE, "ipc_pair.py"), "--out", path, "--gpus",
                  str(max(gpus, 1))], os.path.join(args.out, "ipc.log"), budget,
                 args.launch_timeout_s)
    if budget_row("CUDA IPC", 1, why):
        return [budget_row("CUDA IPC", min(gpus, 2), why)]
    result = None
    if os.path.isfile(path):
        with open(path) as f:
            result = json.load(f)
    return table.ipc_rows(result, why, min(gpus, 2) if gpus else 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for every part's files")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (0: one per GPU present)")
    ap.add_argument("--steps", type=int, default=10, help="FSDP2 training steps")
    ap.add_argument("--fsdp-rounds", type=int, default=3,
                    help="FSDP2 runs per allocator for the step-time comparison")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " +
                    ", ".join(PARTS))
    ap.add_argument("--budget-s", type=float, default=230, help="wall-clock budget of all parts")
    ap.add_argument("--launch-timeout-s", type=float, default=150)
    ap.add_argument("--tracker", default=os.path.join(
        os.path.dirname(os.environ.get("VRAMLEDGER_PLUGIN", "")),
        "libvramledger_trace_counter.so"), help="the trace counter library (default: beside "
        "$VRAMLEDGER_PLUGIN)")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown part(s) {unknown}; the parts are {', '.join(PARTS)}")
    if args.nproc < 0 or args.steps < 1 or args.fsdp_rounds < 1:
        ap.error("--nproc must be >= 0, --steps >= 1 and --fsdp-rounds >= 1")
    args.fsdp_run_s = 0.0  # the longest FSDP2 run so far: what a further round needs
    gpus = gpu_count()
    nproc = args.nproc or max(gpus, 1)
    os.makedirs(args.out, exist_ok=True)
    budget = Budget(args.budget_s)
    rows, first = [], {}
    if gpus == 0:
        rows.append(table.not_run("every part", nproc, "no GPU (nvidia-smi -L lists none)"))
    else:
        # The step-time rounds come last: the checks first, the comparison with what is left.
        if "fsdp" in parts:
            parts.append("fsdp_rounds")
        for part in parts:
            t0 = time.monotonic()
            rows += {"fsdp": lambda: fsdp_part(args, nproc, budget, first),
                     "nccl": lambda: nccl_part(args, nproc, budget),
                     "ipc": lambda: ipc_part(args, gpus, budget),
                     "fsdp_rounds": lambda: fsdp_rounds_part(args, nproc, budget, first)}[part]()
            print(f"part {part}: {time.monotonic() - t0:.0f} s", flush=True)
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table.format_table(rows, gpus))
    return 0 if table.passed(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
