"""In-process step-time A/B: torch's native allocator and vramledger in one process.

Whole processes on the H200 machine differ by up to 20% in speed (step_ab's A/A control,
docs/design/step-time-measurement.md), which hides a 2% target. Here one process holds both
allocators: vramledger is installed as usual (vramledger.install(), torch's
CUDAPluggableAllocator), torch's native caching allocator is kept, and the helper library
(allocator_swap.cc, beside the plugin) makes one or the other torch's current allocator between
steps, after a synchronize. Every tensor is freed by the allocator that made it (torch's DataPtr
carries its deleter), so each allocator serves the steps it is current for: the activations,
gradients and temporaries of that step. The model and the optimizer state are made by
vramledger (an untimed setup step on vramledger creates AdamW's state) and stay there.

The workloads are workloads_compare.py's (capture.py's models, batch and sequence-length ranges).
Each group runs one training step under each mode: native, vramledger, native-again (native once
more: the A/A control of the method itself), in one of the six orders, cycled group by group
(inprocess_stats.ORDERS: each mode takes each position, and each pair of positions, equally
often). The first step at a sequence length the process has not run before takes up to twice as
long as the next one, whatever the allocator (torch's per-shape work; H200, 2026-11-30: GPT-2
0.21 s, then 0.08 s twice), so a group's steps are all repeats or all new lengths:
  --lengths repeat (default)  one length per group, first run by an untimed priming step (on
        native; under the shim on the plugin, see below), then the three timed steps at it.
        Priming on native favours native: its cache has just served that length, while
        vramledger's timed step follows its own step of another length.
  --lengths steady  as repeat, with an untimed priming step on each allocator (the reference's,
        then vramledger's), so every timed step repeats the length its own allocator served
        last: the steady state of a run whose shapes repeat (a fixed sequence length). Neither
        allocator is favoured; what an allocator does when shapes change is the other forms'.
  --lengths fresh  every timed step at a length never run before in the process, as in the
        captured workloads' ten-odd steps; a group takes three adjacent lengths L, L+1, L+2 (from
        a seeded shuffle of the range cut into triples), its i-th step running L+i. Several times
        noisier: the per-shape cost varies from shape to shape.
The first --warmup groups are not counted. Per group, the ratio of a mode's step to native's step
of the same group; the verdict is on the median over groups, with a bootstrap 90% interval
(5,000 resamplings, seeded; inprocess_stats.summarize): "shown" when the interval lies at or
under --target, "refuted" when above it, otherwise "neither". Losses are not compared (each group
trains three steps); workloads_compare.py compares them, a process each.

Also printed per workload: vramledger's driver calls (cuMem*, cudaMalloc, cudaFree; the cheap
cudaEvent* calls left out) in the counted groups' vramledger steps (median and last three) and
the driver time of those steps (all calls, measured around each) as a share of the step.

The shim (--shim LIB): torch's native allocator cannot be reached in a process where the
LD_PRELOAD shim has chosen torch's cudaMallocAsync backend (torch picks its backend once, when
libc10_cuda loads, and exports only the current one). So each workload also runs under the shim,
where the modes are shim (that backend, its calls served by the shim), vramledger (the plugin, a
second vramledger in the process) and shim-again, and the shim's ratio to native is chained:
median(vramledger / native) in the plain process times median(shim / vramledger) under the shim,
both ratios inside one process (inprocess_stats.chained). It assumes the plugin costs the same
beside the shim as without it.

Usage: python inprocess_ab.py [--workloads gpt2m,llama1b,llama1b-ckpt] [--groups 30]
       [--warmup 4] [--lengths repeat|steady|fresh] [--target 1.02]
       [--shim LIB [--shim-target 1.03]] [--json OUT.json]
       python inprocess_ab.py --pool A.json B.json ...   (no GPU: the groups of earlier runs
       pooled per workload, reference, lengths and conf; every ratio stays inside one process and
       the interval resamples processes, then their groups)
Env: VRAMLEDGER_PLUGIN (the plugin; the helper is found beside it unless VRAMLEDGER_AB_SWAP names
it), VRAMLEDGER_CONF (default expandable_segments:True).
Exit status: 0 when every workload ran (whatever the verdict), 1 when one failed, 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "checks"))  # train_compare (workloads_compare)
from inprocess_stats import HEADER, fresh_triples, modes_for, pooled, report, schedule  # noqa: E402

RESULT = "RESULT_JSON "


class SwapLibrary:
    """allocator_swap.cc through ctypes: torch's current CUDA allocator as an opaque pointer
    (int), made current again by store(), initialized by init(), named by name()."""

    def __init__(self, path: str | None = None):
        import ctypes
        path = path or os.environ.get("VRAMLEDGER_AB_SWAP") or os.path.join(
            os.path.dirname(os.environ.get("VRAMLEDGER_PLUGIN", "")),
            "libvramledger_allocator_swap.so")
        self._ctypes = ctypes
        self._lib = lib = ctypes.CDLL(path)
        lib.vramledger_ab_current.restype = ctypes.c_void_p
        lib.vramledger_ab_current.argtypes = []
        lib.vramledger_ab_store.restype = None
        lib.vramledger_ab_store.argtypes = [ctypes.c_void_p]
        lib.vramledger_ab_init.restype = ctypes.c_int
        lib.vramledger_ab_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.vramledger_ab_name.restype = ctypes.c_int
        lib.vramledger_ab_name.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]

    def current(self) -> int:
        return self._lib.vramledger_ab_current()

    def store(self, allocator: int) -> None:
        self._lib.vramledger_ab_store(allocator)

    def init(self, allocator: int, device_count: int) -> int:
        """1: was initialized; 0: initialized now; -1: init failed (message on stderr)."""
        return self._lib.vramledger_ab_init(allocator, device_count)

    def name(self, allocator: int) -> str:
        buf = self._ctypes.create_string_buffer(64)
        self._lib.vramledger_ab_name(allocator, buf, len(buf))
        return buf.value.decode()


def child(workload: str, groups: int, warmup: int, seed: int, lengths: str) -> None:
    """One workload's groups in this process; prints RESULT_JSON with every group's steps.

    torch's allocator at start names the reference: "native" in a plain process; under the
    LD_PRELOAD shim, torch's cudaMallocAsync backend, whose calls the shim serves ("shim"). The
    modes are then (reference, vramledger, reference-again). With `lengths` "repeat", the
    untimed priming step runs on native in a plain process and on vramledger's plugin under the
    shim, so that the mode each ratio's numerator names (vramledger / native, shim / vramledger)
    never follows its own step of the same length; with "steady" it runs on both."""
    import torch  # noqa: F401  (loads libc10_cuda before the helper needs its symbols)

    swap = SwapLibrary()
    first = swap.current()
    started = swap.name(first)
    shimmed = "libvramledger_preload" in os.environ.get("LD_PRELOAD", "")
    if started == "native" and not shimmed:
        base, prime = "native", "native"
    elif started == "cudaMallocAsync" and shimmed:
        base, prime = "shim", "vramledger"
        # torch parses PYTORCH_CUDA_ALLOC_CONF again on first use and asserts that the backend
        # it names is the current allocator's (CUDAAllocatorConfig.cpp, "parsed at runtime !=
        # parsed at load time"): the shim's backend:cudaMallocAsync would then fail against the
        # pluggable one. The backend is chosen already (at load); the variable is done with.
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        raise RuntimeError(f"torch's allocator at start is {started!r} (LD_PRELOAD "
                           f"{os.environ.get('LD_PRELOAD')!r}): expected native, or "
                           "cudaMallocAsync under the shim")
    import vramledger
    route = os.environ.get("VRAMLEDGER_AB_MODE", "pluggable")  # run()'s --mode
    vramledger.install(mode=route)
    plugged = swap.current()
    expected = {"pluggable": "pluggable", "native": "vramledger"}[route]
    assert swap.name(plugged) == expected, (swap.name(plugged), route)
    from workloads_compare import make, train_step

    torch.manual_seed(0)
    model, p = make(workload)
    model = model.cuda()  # under vramledger; torch's lazy init sets up only the current allocator
    if swap.init(first, torch.cuda.device_count()) < 0:
        raise RuntimeError(f"torch's {started} allocator could not be initialized (stderr)")
    if p["ckpt"]:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    current = {m: (plugged if m == "vramledger" else first) for m in modes_for(base)}
    current["prime"] = current[prime] if lengths == "repeat" else first
    current["prime-vramledger"] = plugged

    def step(seq: int) -> float:
        return float(train_step(torch, model, opt, p, seq))

    def driver_calls() -> tuple[int, float]:
        f = vramledger.fragmentation()["driver_calls"]
        return (sum(v["count"] for k, v in f.items() if not k.startswith("cudaEvent")),
                sum(v["time_us"] for v in f.values()))

    step(p["lo"])  # untimed, on vramledger: AdamW's state is made here (fresh lengths skip lo)
    rng = random.Random(seed)
    starts = (fresh_triples(p["lo"], p["hi"], warmup + groups, seed) if lengths == "fresh"
              else [rng.randint(p["lo"], p["hi"]) for _ in range(warmup + groups)])
    out = []
    for g, seq in enumerate(starts):
        steps = schedule(g, base, lengths, seq)
        row = {"seq": seq, "order": [m for m, _ in steps if not m.startswith("prime")],
               "warmup": g < warmup}
        for mode, length in steps:
            torch.cuda.synchronize()
            swap.store(current[mode])
            before = driver_calls()
            t0 = time.perf_counter()
            loss = step(length)
            torch.cuda.synchronize()
            row[mode] = time.perf_counter() - t0
            if mode == "vramledger":
                after = driver_calls()
                row["vramledger_driver_calls"] = after[0] - before[0]
                row["vramledger_driver_us"] = round(after[1] - before[1], 1)
            if loss != loss:  # NaN: the step itself went wrong
                raise RuntimeError(f"{workload} group {g} {mode}: loss is NaN")
        out.append(row)
    swap.store(plugged)  # vramledger current again for the exit
    s = vramledger.memory_stats()
    print(RESULT + json.dumps(dict(
        workload=workload, base=base, lengths=lengths, groups=out, route=route,
        conf=os.environ.get("VRAMLEDGER_CONF", ""), torch=torch.__version__, seed=seed,
        warmup=warmup, run_id=f"{os.uname().nodename}:{os.getpid()}:{time.time_ns()}",
        vramledger_peak_reserved=s["reserved_bytes.all.peak"],
        vramledger_peak_allocated=s["allocated_bytes.all.peak"])), flush=True)


def run(workload: str, a: argparse.Namespace, shim: str | None = None) -> dict:
    """One child process for `workload`; under the LD_PRELOAD shim `shim` when given."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.setdefault("VRAMLEDGER_CONF", "expandable_segments:True")
    env["VRAMLEDGER_AB_MODE"] = a.mode
    if shim:  # the shim's exit dump and its lines on stderr are not what is measured here; the
        # backend named keeps the shim on its interposition (docs/design/preload-route.md), the
        # route this A/B chains against the plugin
        env.update(LD_PRELOAD=shim, VRAMLEDGER_PRELOAD_QUIET="1",
                   VRAMLEDGER_PRELOAD_NO_EXIT_DUMP="1",
                   PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", workload,
                           "--groups", str(a.groups), "--warmup", str(a.warmup),
                           "--seed", str(a.seed), "--lengths", a.lengths], env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"--- {workload}{' under the shim' if shim else ''} failed "
                         f"({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n")
        return dict(workload=workload, failed=True, base="shim" if shim else "native",
                    lengths=a.lengths, conf=env["VRAMLEDGER_CONF"])
    return json.loads(lines[-1][len(RESULT):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", default="gpt2m,llama1b,llama1b-ckpt")
    ap.add_argument("--groups", type=int, default=30, help="counted groups per workload")
    ap.add_argument("--warmup", type=int, default=4, help="groups run first and not counted")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sequence lengths")
    ap.add_argument("--lengths", choices=("repeat", "steady", "fresh"), default="repeat",
                    help="repeat: the timed steps repeat a length primed on the reference; "
                         "steady: primed on both allocators; fresh: every timed step at a "
                         "length new to the process (noisier)")
    ap.add_argument("--target", type=float, default=1.02,
                    help="ratio to native the verdict is about (1.02)")
    ap.add_argument("--shim", metavar="LIB",
                    help="also run each workload under this LD_PRELOAD shim: the "
                         "shim against vramledger's plugin there, chained with the plugin "
                         "against native (verdict at --shim-target)")
    ap.add_argument("--shim-target", type=float, default=1.03,
                    help="the shim's ratio to native the chained verdict is about")
    ap.add_argument("--mode", choices=("pluggable", "native"), default="pluggable",
                    help="vramledger's route into torch in the children: install(mode=...) "
                         "(native: torch's own CUDAAllocator, docs/design/torch-native-mode.md)")
    ap.add_argument("--json", help="write every group and the verdicts here")
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="no GPU run: pool the groups of earlier --json outputs (per workload, "
                         "reference, lengths and conf) and print the table over all of them")
    a = ap.parse_args()
    if a.groups < 1 or a.warmup < 0:
        ap.error("--groups must be at least 1 and --warmup at least 0")
    if a.shim and not os.path.isfile(a.shim):
        ap.error(f"--shim {a.shim}: no such file")
    if a.child:
        child(a.child, a.groups, a.warmup, a.seed, a.lengths)
        return 0
    lines = list(HEADER)
    if a.pool:
        try:
            results = pooled(a.pool)
        except ValueError as e:
            ap.error(f"--pool: {e}")
        if not results:
            ap.error("--pool: the files hold no successful run")
        lines += report(results, a.target, a.shim_target)
        print("\n".join(lines))
        return 0
    print(f"vramledger's route into torch: install(mode={a.mode!r})", flush=True)
    results, ok = [], True
    for w in a.workloads.split(","):
        runs = [run(w, a)] + ([run(w, a, os.path.abspath(a.shim))] if a.shim else [])
        results += runs
        ok = ok and not any(r.get("failed") for r in runs)
        rows = report(runs, a.target, a.shim_target)  # as each workload ends
        lines += rows
        print("\n".join(rows), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
