"""One trial of the capacity benchmark in its own process: a workload trained for six steps under
one allocator and a cap on reserved memory; it fits when no step runs out of memory.

Beside each step's time (`step_s`) the record holds, one entry per completed step, what that step
changed in the allocator's counters (memory_stats(), the same keys under all three allocators):
`step_device_alloc` and `step_device_free`, the calls that obtained or gave back device memory
(torch: cudaMalloc / cudaFree, or with expandable segments cuMemMap / cuMemUnmap of a page;
vramledger: a segment reserved or released, or a run of pages mapped into or unmapped from an
expandable segment, a mapping of a handle it kept counting as one as well, so they count mappings,
not handles created), `step_sync_all_streams` (waits on every stream's pending frees before a
retry or a release) and `step_alloc_retries`; a slow step that obtained, released or waited shows
there. Records written before these fields were recorded lack them. `host` (host_facts()) says
which machine ran the trial (cards of one name run a row's steps at different speeds on
different machines), and a vramledger record's `mode` the route install() took.

Where a step's time went on the host: `step_launch_ms`, the time until the step's work was
queued (train_step returned; the rest of `step_s` is the wait for the GPU; a wait inside the step,
such as an allocator's on an event or torch's cudaFree before a retry, falls in it, and shows in
the counters above and, under vramledger, in `step_waits`), and what the process
and its machine did in the step (process_totals()): `step_user_ms` and `step_sys_ms`, the CPU
time of all the process's threads in user and kernel mode (getrusage; the kernel's accounting may
count in ticks of a few ms, and a thread that spins while it waits for the GPU counts as busy);
`step_minflt`, minor page faults; `step_vcsw` and `step_ivcsw`, the threads' voluntary and
involuntary context switches; `step_main_cpu_ms` and `step_runq_ms`, the time the main (Python)
thread ran and the time it was ready to run but waited for a CPU (/proc/thread-self/schedstat; a
kernel without scheduler statistics gives None); `step_steal_ms`, the time the hypervisor gave
the machine's CPUs to others (/proc/stat, all CPUs summed, in ticks of 10 ms; 0 where none is
reported); `step_migrations`, the main thread's moves between CPUs, and `step_cpu`, the CPU it
ended the step on. Before each step, outside its timed span, host_probes() times fixed host work
(`step_probe_py_us`, an interpreter loop; `step_probe_launch_us`, a launch): a process slower at
them is slower as a process, whatever its allocator. A process slower than another shows there
whether it queued its work more slowly, faulted or switched more, waited for a CPU, moved between
CPUs, ran fixed work slower, or ran on a contended machine. (Since the probes came, add_'s kernel
is loaded before step 1: step 1's time is not compared with earlier records' step 1.) At the end:
`maxrss_mib`, the process's peak resident host memory, and `threads`, its threads.

Under vramledger the record also holds, per step, what its own ledger of driver calls changed
by (vramledger.fragmentation(); absent under torch's allocators and from earlier records):
`step_driver_ms`, the time of every CUDA driver and runtime call it made; `step_waits` and
`step_wait_ms`, its cudaEventSynchronize and cudaStreamSynchronize calls and their time, the
waits that stop the host from running ahead of the GPU (a page move over an old mapping whose
fence the GPU has not reached, a release before a retry). A step slow under vramledger alone
shows there whether the time went to its driver calls or its waits. Its device allocs and frees
above are not driver calls alone: a handle moved within its stream counts a map (a cuMemMap) and
an unmap whose cuMemUnmap comes later, if ever, and an old mapping taken back (the handle returned
to an address it held before) a map and an unmap with no driver call
(docs/design/page-recycling.md); `step_cu_mem_map`, `step_cu_mem_unmap` and `step_take_backs`
(cuMemMap and cuMemUnmap calls, old mappings taken back) tell them apart. (Its host time in
malloc and free needs the `host_timing` option, off in the default policy the trial measures.)

With a trace path (a sixth argument; run_trial's `trace`), the trial also records the allocator's
memory history (torch's or vramledger's record_memory_history, no stacks) and, after each step
outside its timed span, takes a snapshot, whose `snapshot` entry marks the step's end in the trace
(where `vramledger replay` splits steps). vramledger's snapshot holds its own entry, torch's only
the entries before it, so under torch (and after an out-of-memory error) one more snapshot ends
the trace. The last snapshot goes to the path as a gzip-compressed pickle, which `vramledger
replay` and `python -m benchmarks.capacity.trace_steps` read. Its step times include no snapshot,
but the recording's own cost: a traced trial's figures are not compared with untraced ones.

With --profile (run_trial's `profile`), the steps profiles.PROFILED_STEPS each run under
torch.profiler and the record's `profile` holds, per step index, its ops' calls and times
(profiles.py). With --host-timing under vramledger (its `host_timing` option), `step_host_us` holds
per step the host time of its allocations and frees. Both cost time in the steps they measure.

  python -m benchmarks.capacity.trial WORKLOAD ALLOCATOR CAP_GIB BATCH SEQ [TRACE.pickle.gz]
      [--profile] [--host-timing]
(from the repo root)
prints one line `RESULT_JSON {...}`. run_trial() starts that process and reads the line.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.capacity import workloads

RESULT = "RESULT_JSON "
GIB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOCATORS = ("torch", "torch-expandable", "vramledger")
# A record's per-step field -> the memory_stats() counter whose change over the step it holds.
STEP_COUNTERS = {"step_device_alloc": "num_device_alloc", "step_device_free": "num_device_free",
                 "step_sync_all_streams": "num_sync_all_streams",
                 "step_alloc_retries": "num_alloc_retries"}
# vramledger's per-step figures (each a change of vramledger_totals()): its driver time and waits,
# and its page-table driver calls beside the old mappings it took back without one.
VRAMLEDGER_FIGURES = ("step_driver_ms", "step_waits", "step_wait_ms")
VRAMLEDGER_MAPPINGS = ("step_cu_mem_map", "step_cu_mem_unmap", "step_take_backs")
WAIT_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize")
# Far above a trial's six steps (the bundled traces: 0.9-1.3 x 10^5 events in 10-12 steps).
MAX_TRACE_ENTRIES = 2_000_000


def vramledger_totals(frag: dict) -> dict[str, float]:
    """The running totals behind VRAMLEDGER_FIGURES and VRAMLEDGER_MAPPINGS in a
    vramledger.fragmentation() dict: driver time (ms), the waits' count and time (ms), the
    cuMemMap and cuMemUnmap calls, and the old mappings taken back."""
    calls = frag["driver_calls"]
    return {"step_driver_ms": frag["driver_time_us_total"] / 1e3,
            "step_waits": sum(calls[c]["count"] for c in WAIT_CALLS),
            "step_wait_ms": sum(calls[c]["time_us"] for c in WAIT_CALLS) / 1e3,
            "step_cu_mem_map": calls["cuMemMap"]["count"],
            "step_cu_mem_unmap": calls["cuMemUnmap"]["count"],
            "step_take_backs": frag["reused_old_mappings"]}


def read_text(path: str) -> str | None:
    """The stripped contents of a small system file, or None where it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def host_facts() -> dict:
    """What tells machines apart in a record: the kernel's boot id (one per boot of a machine or
    virtual machine; a container shares its host's), the CPU model, the CPUs this process may run
    on and the kernel's load averages (a container's are its host's: what else runs there shows).
    Step times differ between machines that name the same GPU; these say which records share one.
    A fact that cannot be read is None."""
    cpuinfo = read_text("/proc/cpuinfo") or ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), None)
    load = (read_text("/proc/loadavg") or "").split()[:3]
    return {"boot_id": read_text("/proc/sys/kernel/random/boot_id"), "cpu_model": model,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "loadavg": [float(x) for x in load] if len(load) == 3 else None}


# What run_trial sets in the trial's environment itself (extra_env may not).
TRIAL_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "VRAMLEDGER_CONF", "VRAMLEDGER_PLUGIN", "PYTHONPATH",
             "PYTHONUNBUFFERED", "PYTHONHASHSEED")
# A record's per-step fields that are changes of process_totals()'s entries of the same name.
PROCESS_FIGURES = ("step_user_ms", "step_sys_ms", "step_minflt", "step_vcsw", "step_ivcsw",
                   "step_main_cpu_ms", "step_runq_ms", "step_migrations", "step_steal_ms")
# The fixed host work timed between steps (host_probes()): additions in the interpreter's loop,
# about 1 ms; launches of a one-element add_, about 1-2 ms.
PROBE_LOOP = 50000
PROBE_LAUNCHES = 200


def steal_ms() -> float | None:
    """The machine's stolen CPU time so far (ms, all CPUs; /proc/stat's `cpu` line, the eighth
    field, in clock ticks), or None where it cannot be read."""
    fields = ((read_text("/proc/stat") or "").splitlines() or [""])[0].split()
    if len(fields) < 9 or fields[0] != "cpu" or not fields[8].isdigit():
        return None
    return int(fields[8]) * 1e3 / os.sysconf("SC_CLK_TCK")


def thread_sched_ms() -> tuple[float | None, float | None]:
    """The calling thread's time on a CPU and its time waiting on a run queue, ready but not
    running (ms; the first two fields of /proc/thread-self/schedstat, in ns), each None where it
    cannot be read."""
    fields = (read_text("/proc/thread-self/schedstat") or "").split()
    if len(fields) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None, None
    return int(fields[0]) / 1e6, int(fields[1]) / 1e6


def thread_cpu() -> int | None:
    """The CPU the calling thread last ran on (/proc/thread-self/stat's `processor`, the 39th
    field), or None where it cannot be read."""
    stat = (read_text("/proc/thread-self/stat") or "").rpartition(")")[2].split()
    return int(stat[36]) if len(stat) > 36 and stat[36].isdigit() else None  # fields 3.. follow


def thread_migrations() -> int | None:
    """The calling thread's moves between CPUs so far (/proc/thread-self/sched's
    se.nr_migrations, where the kernel keeps scheduler statistics), or None where it cannot be
    read."""
    for line in (read_text("/proc/thread-self/sched") or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "se.nr_migrations" and value.strip().isdigit():
            return int(value.strip())
    return None


def process_totals() -> dict[str, float | None]:
    """The running totals behind PROCESS_FIGURES: this process's CPU time (ms), minor page faults
    and context switches (getrusage, every thread), the calling thread's CPU time, run-queue
    wait (thread_sched_ms()) and migrations (thread_migrations()) and the machine's stolen time
    (steal_ms())."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    main_cpu, runq = thread_sched_ms()
    return {"step_user_ms": u.ru_utime * 1e3, "step_sys_ms": u.ru_stime * 1e3,
            "step_minflt": u.ru_minflt, "step_vcsw": u.ru_nvcsw, "step_ivcsw": u.ru_nivcsw,
            "step_main_cpu_ms": main_cpu, "step_runq_ms": runq,
            "step_migrations": thread_migrations(), "step_steal_ms": steal_ms()}


def host_probes(torch, scalar) -> tuple[float, float]:
    """Fixed host work, the same in every process, timed between steps with the GPU idle: the
    interpreter's loop of PROBE_LOOP additions (us), and PROBE_LAUNCHES launches of `scalar`'s
    add_(1) through torch's dispatcher (us per launch; the wait after them is not timed). A
    process whose probes ran slower ran any host work slower (its CPU, the CPU's clock, a load
    beside it), whatever its allocator. Probes that matched another process's while its steps
    queued their work later do not place the difference: the step's own work, or a slower memory
    system (caches, memory bandwidth, page tables) that a small loop and launch do not feel, or a
    load that came only during the steps."""
    t0 = time.perf_counter()
    total = 0
    for i in range(PROBE_LOOP):
        total += i
    t1 = time.perf_counter()
    for _ in range(PROBE_LAUNCHES):
        scalar.add_(1)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6, (t2 - t1) * 1e6 / PROBE_LAUNCHES


def host_us(frag: dict) -> float:
    """The host time of vramledger's allocations and frees so far (us; its host_timing option)."""
    return sum(frag["host_time"][k]["time_us"] for k in ("malloc", "free"))


def child(workload: str, allocator: str, cap_gib: float, batch: int, seq: int,
          trace: str | None = None, profile: bool = False, host_timing: bool = False) -> dict:
    """Runs the trial in this process (nothing of CUDA initialised yet) and returns its record;
    with `trace`, also writes the allocator's snapshot with its trace there; with `profile`, the
    record holds the profiled steps' ops; with `host_timing` (vramledger), its host time per
    step."""
    w = workloads.WORKLOADS[workload]
    if allocator == "vramledger":
        import vramledger
        # The default policy; host_timing adds two clock reads and two atomic adds to each call.
        vramledger.install(**({"host_timing": True} if host_timing else {}))
    import torch
    mem = sys.modules["vramledger"] if allocator == "vramledger" else torch.cuda
    # Each allocator caps reserved memory at fraction x the total cudaMemGetInfo reports (torch's
    # allowed_memory_maximum; vramledger's SetMemoryFraction, which torch's
    # set_per_process_memory_fraction reaches on either route), so the same call gives all three
    # the same cap.
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "oom": False,
           "error": None, "host": host_facts(), "step_s": [], "losses": [],
           "step_launch_ms": [], "step_cpu": [], "step_probe_py_us": [],
           "step_probe_launch_us": [], **{f: [] for f in (*STEP_COUNTERS, *PROCESS_FIGURES)}}
    if allocator == "vramledger":  # the route install() took: "native", or "pluggable"
        out["mode"] = mem.installed_mode()
    ledger = mem.fragmentation if allocator == "vramledger" else None
    if ledger:
        out.update({f: [] for f in VRAMLEDGER_FIGURES + VRAMLEDGER_MAPPINGS})
    timed = bool(ledger) and host_timing
    if timed:
        out["step_host_us"] = []
    if profile:
        from benchmarks.capacity import profiles
        out["profile"] = {}
    last = None  # the last snapshot taken (with a trace)
    if trace:
        if allocator == "vramledger":
            record, take_snapshot = mem.record_memory_history, mem.snapshot
        else:
            record = torch.cuda.memory._record_memory_history
            take_snapshot = torch.cuda.memory._snapshot
        record("all", context=None, stacks="python", max_entries=MAX_TRACE_ENTRIES)
    try:
        model, opt = workloads.build(torch, w)
        # What the model holds besides what the planner counts shows here (a causal-mask buffer
        # of n_positions^2 per layer in some transformers versions).
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
        vocab = w.config["vocab_size"]
        # host_probes()'s operand (one 512-byte block of the allocator's, kept for the trial),
        # and one untimed round of them: the first launch of add_ loads its kernel (10-30 ms on
        # an H100), which no probe's figure should hold.
        scalar = torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
        host_probes(torch, scalar)
        for i, length in enumerate(workloads.lengths(seq)):
            torch.cuda.synchronize()
            python_us, launch_us = host_probes(torch, scalar)  # outside the timed span
            out["step_probe_py_us"].append(python_us)
            out["step_probe_launch_us"].append(launch_us)
            before = mem.memory_stats()  # outside the timed span
            frag = ledger() if ledger else None
            totals = vramledger_totals(frag) if ledger else {}
            prof = profiles.start(torch) if profile and i in profiles.PROFILED_STEPS else None
            used = process_totals()
            t0 = time.perf_counter()
            loss = workloads.train_step(torch, model, opt, vocab, batch, length)
            queued = time.perf_counter()
            torch.cuda.synchronize()
            out["step_s"].append(time.perf_counter() - t0)
            out["step_launch_ms"].append((queued - t0) * 1e3)
            out["step_cpu"].append(thread_cpu())
            for field, total in process_totals().items():
                out[field].append(None if total is None or used[field] is None
                                  else total - used[field])
            out["losses"].append(float(loss))  # after the wait: the GPU is done with it
            del loss  # freed before the next step begins, not inside its timed span
            if prof is not None:
                out["profile"][str(i)] = profiles.stop(prof)
            after = mem.memory_stats()
            for field, stat in STEP_COUNTERS.items():
                out[field].append(after.get(stat, 0) - before.get(stat, 0))
            if ledger:
                now = ledger()
                for field, total in vramledger_totals(now).items():
                    out[field].append(total - totals[field])
                if timed:
                    out["step_host_us"].append(host_us(now) - host_us(frag))
            if trace:
                last = take_snapshot()  # its `snapshot` entry ends the step in the trace
    except torch.OutOfMemoryError as e:
        out.update(oom=True, error=str(e)[:400])
    except RuntimeError as e:  # an out-of-memory error raised outside the allocator (cuBLAS)
        if "out of memory" not in str(e).lower():
            raise
        out.update(oom=True, error=str(e)[:400])
    s = mem.memory_stats()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    status = read_text("/proc/self/status") or ""
    out["maxrss_mib"] = usage.ru_maxrss / 1024  # Linux: KiB
    out["threads"] = next((int(line.split()[1]) for line in status.splitlines()
                           if line.startswith("Threads:")), None)
    out.update(fits=not out["oom"], retries=s.get("num_alloc_retries", 0),
               peak_allocated=s.get("allocated_bytes.all.peak", 0),
               peak_reserved=s.get("reserved_bytes.all.peak", 0), cap_bytes=int(cap_gib * GIB))
    out["median_step_s"] = statistics.median(out["step_s"]) if out["step_s"] else None
    if trace:
        # torch's snapshot returns the trace before its own entry: one more holds the last step's.
        # After an out-of-memory error, the step that ran out, up to its oom entry.
        if allocator != "vramledger" or out["oom"] or last is None:
            last = take_snapshot()
        # The package's writer: pickle protocol 4, gzip, through a temporary file (on the trial's
        # PYTHONPATH under every allocator; run_trial puts torch_plugin/python there).
        from vramledger._snapshot import write_snapshot
        write_snapshot(last, trace)
        out["trace"] = os.path.basename(trace)
        out["trace_entries"] = len(last["device_traces"][0]) if last["device_traces"] else 0
    return out


def process_env(allocator: str, conf: str | None = None, plugin: str | None = None,
                extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a trial's process under `allocator`: this one's, less any allocator
    setting of its own, with vramledger's settings (VRAMLEDGER_CONF) and another build's plugin
    (VRAMLEDGER_PLUGIN) where given, `extra_env`, torch expandable's PYTORCH_CUDA_ALLOC_CONF, and
    the repository and the package on PYTHONPATH.

    Raises:
      ValueError: `conf` or `plugin` for one of torch's allocators, or `extra_env` naming a
        variable set here (TRIAL_ENV).
    """
    taken = sorted(set(extra_env or {}) & set(TRIAL_ENV))
    if taken:
        raise ValueError(f"{', '.join(taken)}: the trial sets these itself; give the allocator, "
                         f"conf or plugin instead")
    given = {k: v for k, v in (("conf", conf), ("plugin", plugin)) if v is not None}
    if given and allocator != "vramledger":
        raise ValueError(", ".join(f"{k} {v!r}" for k, v in given.items())
                         + f": vramledger's settings; the trial's allocator is {allocator}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "VRAMLEDGER_CONF"):
        env.pop(key, None)
    if conf is not None:
        env["VRAMLEDGER_CONF"] = conf
    if plugin is not None:
        env["VRAMLEDGER_PLUGIN"] = plugin
    env.update(extra_env or {})
    if allocator == "torch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "torch_plugin", "python")] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_trial(workload: str, allocator: str, cap_gib: float, dim: str, size: int,
              timeout_s: float, trace: str | None = None, profile: bool = False,
              host_timing: bool = False, conf: str | None = None,
              plugin: str | None = None, extra_env: dict[str, str] | None = None) -> dict:
    """Runs the trial of `size` along `dim` ("batch" or "seq") in a new process (one allocator per
    process: install() must come before CUDA starts, and nothing cached from an earlier trial may
    help a later one). Returns its record: `fits` True or False, or None with `error` when the
    process failed some other way (`timed_out` when it ran past `timeout_s`). With `trace`, the
    trial records its allocator's trace and writes its snapshot to that path; with `profile`, its
    record holds the profiled steps (profiles.py); with `host_timing`, vramledger's host time per
    step; with `conf`, vramledger runs with those settings (VRAMLEDGER_CONF, `key:value,...`);
    with `plugin`, vramledger loads that plugin library (VRAMLEDGER_PLUGIN: another build's), and
    the record's `library` names its folder; with `extra_env`, the process gets those variables
    too, under any allocator (a host allocator's settings, say: GLIBC_TUNABLES, LD_PRELOAD), and
    the record's `env` holds them.

    Raises:
      ValueError: `conf` or `plugin` for one of torch's allocators, or `extra_env` naming a
        variable the trial sets itself (TRIAL_ENV).
    """
    env = process_env(allocator, conf, plugin, extra_env)
    batch, seq = workloads.WORKLOADS[workload].shape(dim, size)
    cmd = [sys.executable, "-m", "benchmarks.capacity.trial", workload, allocator,
           str(cap_gib), str(batch), str(seq)] + ([os.path.abspath(trace)] if trace else [])
    cmd += (["--profile"] if profile else []) + (["--host-timing"] if host_timing else [])
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"fits": None, "timed_out": True, "wall_s": time.monotonic() - t0,
                "error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        return {"fits": None, "wall_s": time.monotonic() - t0,
                "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    record = json.loads(lines[-1][len(RESULT):])
    record["wall_s"] = time.monotonic() - t0
    if extra_env:
        record["env"] = dict(extra_env)
    # Which build of vramledger ran (the caller's label, e.g. its commit): records of several
    # builds may share a results file.
    if plugin is not None:
        record["library"] = os.path.basename(os.path.dirname(os.path.abspath(plugin)))
    elif allocator == "vramledger" and os.environ.get("CAPACITY_LIBRARY"):
        record["library"] = os.environ["CAPACITY_LIBRARY"]
    return record


def parse_args(argv: list[str]) -> tuple[list, dict]:
    """The child's positional arguments (WORKLOAD ALLOCATOR CAP_GIB BATCH SEQ [TRACE]) converted,
    and its flags as keyword arguments.

    Raises:
      SystemExit: an unknown flag or a wrong number of arguments (status 2, the usage on stderr).
    """
    flags = {"--profile": "profile", "--host-timing": "host_timing"}
    unknown = [a for a in argv if a.startswith("--") and a not in flags]
    plain = [a for a in argv if a not in flags]
    if unknown or len(plain) not in (5, 6):
        print(f"usage: python -m benchmarks.capacity.trial WORKLOAD ALLOCATOR CAP_GIB BATCH SEQ "
              f"[TRACE.pickle.gz] [--profile] [--host-timing] (got {' '.join(argv)})",
              file=sys.stderr)
        sys.exit(2)
    name, alloc, cap, b, s, *path = plain
    return [name, alloc, float(cap), int(b), int(s), *path], {
        key: flag in argv for flag, key in flags.items()}


if __name__ == "__main__":
    args, kwargs = parse_args(sys.argv[1:])
    print(RESULT + json.dumps(child(*args, **kwargs)), flush=True)
