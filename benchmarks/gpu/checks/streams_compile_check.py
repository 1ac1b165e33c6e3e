"""Streams, the synchronized OOM retry, a record_stream soak and torch.compile,
each under torch's native allocator and under vramledger, each in its own process.

Every check runs in a fresh child process per allocator (`--child CHECK --allocator A`):
vramledger.install() must come before CUDA's initialisation, and a failed capture or compile
must not poison the checks after it. The parent prints one table row per check:
`check | native | vramledger | verdict`, with the figures that back the verdict.

Checks:
  record_stream            producer stream writes a pattern into fresh 1 MiB tensors, a slow
                           consumer stream (torch.cuda._sleep) verifies it 1,000 times; with
                           record_stream 0 mismatches, without it the canary shows the early reuse
                           torch's own allocator also allows.
  sync_retry               the card is filled so that one 2 GiB block is the only cached one; it
                           is record_stream'd on a side stream busy for ~300 ms and freed; the same
                           size on the main stream must succeed on the first call after one
                           synchronized retry (num_alloc_retries +1, num_ooms +0).
  soak                     10,000 x {alloc 256 KiB, record_stream on stream 2, short kernel there,
                           free} while stream 3 runs a ~10 s kernel holding one block: active -
                           allocated bytes (sampled every 100 iterations) stays below 16 MiB.
  compile_default          torch.compile(mode="default") of a GPT-2-medium forward/backward
                           (batch 4, seq 256, bf16 autocast, AdamW eager, dropout 0), 3 steps;
                           losses finite and within 1e-2 relative of the same process's eager run
                           and of the native compiled run.
  compile_reduce_overhead  the same with mode="reduce-overhead" (cudagraph trees): runs, or fails
                           with an error whose first line is reported.

Usage (GPU machine; see run.sh):
  VRAMLEDGER_PLUGIN=.devbuild/lib/libvramledger_plugin.so PYTHONPATH=torch_plugin/python \\
      /opt/torch/.venv/bin/python3 benchmarks/gpu/checks/streams_compile_check.py --out $OUT/streams
With --out, writes DIR/streams_compile_check.json, DIR/streams_compile_table.txt and one log per
child (DIR/<check>.<allocator>.log). The two compile checks run their native and vramledger
children side by side (--serial to run them one after the other); the rest run one at a time.
Exit status: 0 when every verdict passed, 1 when one failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

RESULT_PREFIX = "RESULT_JSON "
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALLOCATORS = ("native", "vramledger")
# Per-child wall-clock limits in seconds; the whole run is also capped by --budget-s.
TIMEOUT_S = {
    "record_stream": 90,
    "sync_retry": 120,
    "soak": 120,
    "compile_default": 300,
    "compile_reduce_overhead": 300,
}
CHECKS = tuple(TIMEOUT_S)
COMPILE_CHECKS = ("compile_default", "compile_reduce_overhead")
LOSS_REL_TOL = 1e-2          # compiled vs eager / vs native compiled, bf16 autocast
SOAK_LIMIT = 16 * MiB        # active - allocated bound of the soak


# ---------------------------------------------------------------------------------------------
# Child side: one check, one allocator, one RESULT_JSON line on stdout.
# ---------------------------------------------------------------------------------------------

def _setup(allocator: str, **options):
    """Installs vramledger (before any CUDA call) when asked; returns (torch, stats) where
    stats() is the allocator's memory_stats dict of device 0 (vramledger's raw plugin figures,
    which skip memory_stats()'s fragmentation walk, so sampling them in a loop stays cheap)."""
    if allocator == "vramledger":
        import vramledger
        vramledger.install(**options)
        from vramledger import _plugin
        import torch
        return torch, lambda: _plugin.memory_stats(0)
    import torch
    return torch, lambda: torch.cuda.memory_stats(0)


def _cycles_per_ms(torch) -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured with CUDA events."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = int(5e7)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def _first_line(e: BaseException) -> str:
    """`Type: first line` of an exception; when that line only says who raised (dynamo's
    "backend='inductor' raised:"), the next non-empty line is appended."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"{type(e).__name__}: {text}"[:300]


def child_record_stream(allocator: str) -> dict:
    """Producer/consumer with and without record_stream; mismatches counted on the GPU."""
    torch, _ = _setup(allocator)
    cpm = _cycles_per_ms(torch)
    iters, numel = 1000, MiB // 4                 # 1 MiB int32 tensors
    # 500 us of consumer work per iteration: slower than the CPU enqueues the producer's work (the
    # H200 run with 50 us showed no early reuse in either allocator: the consumer kept up).
    sleep_cycles = int(0.5 * cpm)
    out = {"cycles_per_ms": cpm, "iters": iters, "tensor_bytes": numel * 4}
    for record in (True, False):
        producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
        bad = torch.zeros((), dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        ptrs = set()
        t0 = time.perf_counter()
        for i in range(iters):
            with torch.cuda.stream(producer):
                t = torch.empty(numel, dtype=torch.int32, device="cuda")
                t.fill_(i)
            ptrs.add(t.data_ptr())
            consumer.wait_stream(producer)
            with torch.cuda.stream(consumer):
                torch.cuda._sleep(sleep_cycles)   # a slow consumer: reuse would show
                bad += (t != i).any()
            if record:
                t.record_stream(consumer)
            del t                                 # freed while the consumer may still read it
        torch.cuda.synchronize()
        key = "with" if record else "without"
        out[f"{key}_mismatches"] = int(bad.item())
        out[f"{key}_distinct_blocks"] = len(ptrs)
        out[f"{key}_s"] = time.perf_counter() - t0
        del bad
        torch.cuda.empty_cache()
    return out


def child_sync_retry(allocator: str) -> dict:
    """One cached 2 GiB block pending on a busy side stream, the card otherwise full: the next
    2 GiB allocation on the main stream must wait for the event and succeed on the first call."""
    # The check is about the non-expandable path; keywords win over VRAMLEDGER_CONF.
    opts = {"expandable_segments": False} if allocator == "vramledger" else {}
    torch, stats = _setup(allocator, **opts)
    cpm = _cycles_per_ms(torch)
    size = 2 * GiB
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    x_ptr = x.data_ptr()
    free0, total = torch.cuda.mem_get_info()
    fill, fill_ooms = [], 0
    for chunk in (8 * GiB, GiB, 128 * MiB, 32 * MiB):   # until free < size / 2 + 32 MiB
        while torch.cuda.mem_get_info()[0] - chunk >= size // 2:
            try:
                fill.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                fill_ooms += 1
                break
    x.fill_(0)   # loads the fill kernel now: a first launch behind the sleep would hold the host
    torch.cuda.synchronize()
    free_filled = torch.cuda.mem_get_info()[0]
    before = stats()
    cached = before["reserved_bytes.all.current"] - before["allocated_bytes.all.current"]
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(300 * cpm))             # ~300 ms of busy side stream
        x.fill_(1)                                    # ... which then uses x
    x.record_stream(side)
    side_busy = not side.query()
    t0 = time.perf_counter()
    del x                                             # freed; reusable only after side's event
    error = None
    try:
        y = torch.empty(size, dtype=torch.uint8, device="cuda")   # the first and only call
        y_ptr = y.data_ptr()
    except torch.OutOfMemoryError as e:
        error, y, y_ptr = _first_line(e), None, None
    alloc_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    after = stats()
    n_fill = len(fill)
    del y, fill
    torch.cuda.empty_cache()
    return {
        "cycles_per_ms": cpm, "total": total, "free_at_start": free0,
        "free_after_fill": free_filled, "fill_tensors": n_fill,
        "fill_ooms": fill_ooms, "cached_before": cached, "side_busy_before_alloc": side_busy,
        "oom_error": error, "alloc_ms": alloc_ms, "same_address": y_ptr == x_ptr,
        "retries_delta": after["num_alloc_retries"] - before["num_alloc_retries"],
        "ooms_delta": after["num_ooms"] - before["num_ooms"],
        "sync_all_streams_delta": after["num_sync_all_streams"] - before["num_sync_all_streams"],
        "reserved_after_cleanup": stats()["reserved_bytes.all.current"],
    }


def child_soak(allocator: str) -> dict:
    """10,000 record_stream'd 256 KiB blocks on stream 2 while stream 3 holds one for ~10 s."""
    torch, stats = _setup(allocator)
    cpm = _cycles_per_ms(torch)
    iters, numel = 10_000, 256 * KiB // 4
    main, s2, s3 = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    stats()                                           # any first-call cost outside the loop
    # Warm up every kernel the loop launches before the long work is queued. With CUDA's lazy
    # module loading (the default) the first launch of a kernel loads its module, and loading
    # waits for the work already running on the device: in three H200 runs the loop's first
    # fill_ held the host until the 10 s of holding work had finished, under both allocators, and
    # with fill_ warmed up, the holding work's own add_ did the same (a fourth run).
    warm = torch.empty(numel, dtype=torch.float32, device="cuda")
    s2.wait_stream(main)
    with torch.cuda.stream(s2):
        warm.fill_(0.0)
        warm.add_(1)                                  # the holding work's last kernel
    warm.record_stream(s2)
    del warm
    probe_done = torch.cuda.Event()
    probe_done.record(s2)
    probe_done.query()
    torch.cuda.synchronize()
    hold = torch.empty(numel, dtype=torch.float32, device="cuda")
    # ~10 s of work on stream 3 (torch.cuda._sleep: one thread block spinning, so the rest of
    # the GPU stays free for stream 2's short kernels), then the block it holds. A large matmul
    # does not do here: it fills every SM, stream 2's kernels queue behind it and every one of
    # the 10,000 blocks stays pending under either allocator (a fifth H200 run: 255.8 MiB).
    s3.wait_stream(main)
    long_start, long_end = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
    n_sleep = 10
    with torch.cuda.stream(s3):
        long_start.record()
        for _ in range(n_sleep):
            torch.cuda._sleep(int(1000 * cpm))        # ~1 s each, ~10 s in all ...
        hold.add_(1)                                  # ... and the block it holds
        long_end.record()
    hold.record_stream(s3)
    del hold
    long_done = torch.cuda.Event()
    long_done.record(s3)
    samples, ptrs, running = [], set(), []
    t0 = time.perf_counter()
    for i in range(iters):
        x = torch.empty(numel, dtype=torch.float32, device="cuda")
        ptrs.add(x.data_ptr())
        s2.wait_stream(main)
        with torch.cuda.stream(s2):
            x.fill_(float(i))                         # short kernel using x on stream 2
        x.record_stream(s2)
        del x
        if i % 100 == 0:
            s = stats()
            samples.append(s["active_bytes.all.current"] - s["allocated_bytes.all.current"])
            running.append(not long_done.query())
    loop_s = time.perf_counter() - t0
    long_running_at_end = not long_done.query()
    long_done.synchronize()
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")                     # events are processed at allocation
    s = stats()
    return {
        "cycles_per_ms": cpm, "iters": iters, "samples": len(samples),
        "max_pending": max(samples), "first_pending": samples[0], "loop_s": loop_s,
        "long_kernel_running_at_end": long_running_at_end, "distinct_blocks": len(ptrs),
        "samples_while_long_kernel_ran": sum(running),
        "long_kernel_ms": long_start.elapsed_time(long_end), "long_kernel_launches": n_sleep,
        "pending_after_sync": s["active_bytes.all.current"] - s["allocated_bytes.all.current"],
        "total_wall_s": time.perf_counter() - t0,
    }


def _child_compile(allocator: str, mode: str) -> dict:
    """Eager then torch.compile(mode) of GPT-2-medium forward/backward, 3 steps each, from the
    same initial weights and batches; AdamW (lr 1e-4) runs eagerly."""
    torch, _ = _setup(allocator)
    import random

    from transformers import GPT2Config, GPT2LMHeadModel

    random.seed(0)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel(cfg).cuda()
    model.train()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, 256), generator=gen).cuda() for _ in range(3)]

    def train(fn, mark_step: bool) -> tuple[list[float], list[float]]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses, times = [], []
        for b in batches:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(input_ids=b, labels=b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return losses, times

    out = {"mode": mode, "torch": torch.__version__}
    out["eager_losses"], _ = train(model, False)
    model.load_state_dict(init)
    del init
    from torch._dynamo.utils import counters

    t0 = time.perf_counter()
    try:
        compiled = torch.compile(model, mode=mode)
        out["compiled_losses"], times = train(compiled, mode == "reduce-overhead")
        out["ran"] = True
        out["first_step_s"], out["later_step_s"] = times[0], min(times[1:])
    except Exception as e:  # pylint: disable=broad-except  # reported, not fatal
        import traceback
        traceback.print_exc()
        out["ran"] = False
        out["error"] = _first_line(e)
        out["error_full"] = str(e)[:4000]
        out["failed_after_s"] = time.perf_counter() - t0
    out["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
    try:  # after a failed capture CUDA may be unusable; the result line must still come out
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
    except Exception as e:  # pylint: disable=broad-except
        out["peak_allocated"] = None
        out["after_error"] = _first_line(e)
    return out


def child_compile_default(allocator: str) -> dict:
    return _child_compile(allocator, "default")


def child_compile_reduce_overhead(allocator: str) -> dict:
    return _child_compile(allocator, "reduce-overhead")


def run_child_mode(check: str, allocator: str) -> int:
    result = globals()[f"child_{check}"](allocator)
    result.update(check=check, allocator=allocator)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent side: probe, launch children, judge, print.
# ---------------------------------------------------------------------------------------------

PROBE = r"""
import json, torch
ok = torch.cuda.is_available() and torch.cuda.device_count() > 0
info = {"torch": torch.__version__, "cuda": ok}
if ok:
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, total=p.total_memory)
print(json.dumps(info))
"""


def probe() -> dict:
    """torch version and device 0 in a throwaway process, so this one never touches CUDA."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        return {"cuda": False, "why": "probe timed out after 120 s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"cuda": False, "why": f"cannot import torch: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Child:
    """A running child process for (check, allocator); its own process group, so a timeout
    also ends torch.compile's worker processes."""

    def __init__(self, check: str, allocator: str, out_dir: str | None):
        self.check, self.allocator, self.out_dir = check, allocator, out_dir
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", check, "--allocator",
             allocator], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)

    def collect(self, timeout: float) -> dict:
        """Waits up to `timeout` s; returns {"status": ok|error|timeout, "result", "wall_s",
        "stderr_tail"} and writes the child's log when the run has an output folder."""
        timed_out = False
        try:
            stdout, stderr = self.proc.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, stderr = self.proc.communicate()
        wall = time.perf_counter() - self.start
        if self.out_dir:
            with open(os.path.join(self.out_dir, f"{self.check}.{self.allocator}.log"), "w") as f:
                f.write(f"exit {self.proc.returncode} after {wall:.1f} s"
                        f"{' (TIMEOUT)' if timed_out else ''}\n--- stdout\n{stdout}\n"
                        f"--- stderr\n{stderr}\n")
        lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
        entry = {"wall_s": wall, "rc": self.proc.returncode,
                 "stderr_tail": "\n".join(stderr.strip().splitlines()[-25:])}
        if timed_out:
            entry.update(status="timeout", why=f"TIMEOUT after {timeout:.0f} s")
        elif self.proc.returncode != 0 or not lines:
            rc = self.proc.returncode
            how = f"signal {-rc}" if rc is not None and rc < 0 else f"exit {rc}"
            entry.update(status="error", why=f"ERROR ({how}): {_error_line(stderr)}")
        else:
            entry.update(status="ok", result=json.loads(lines[-1][len(RESULT_PREFIX):]))
        return entry


def _error_line(stderr: str) -> str:
    """The last `SomeError: text` line of a child's stderr (torch appends hints after the
    exception line), else its last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*:")
    hits = [ln for ln in lines if pattern.match(ln)]
    return ((hits or lines or ["(no stderr)"])[-1])[:160]


def _mib(n) -> str:
    return f"{n / MiB:.1f} MiB"


def _worst_rel(a: list[float], b: list[float]) -> float:
    if not a or not b or len(a) != len(b):
        return math.inf
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def _finite(xs) -> bool:
    return bool(xs) and all(math.isfinite(x) for x in xs)


def judge(check: str, runs: dict) -> list[tuple[str, str, str, str]]:
    """Table rows (check, native cell, vramledger cell, verdict) for one check's two runs."""
    n, v = runs.get("native"), runs.get("vramledger")
    nr = n["result"] if n and n["status"] == "ok" else None
    vr = v["result"] if v and v["status"] == "ok" else None

    def cell(run, text_fn):
        if run is None:
            return "not run"
        if run["status"] != "ok":
            return run["why"]
        return text_fn(run["result"])

    if check == "record_stream":
        def with_cell(r):
            return (f"{r['with_mismatches']}/{r['iters']} mismatches, "
                    f"{r['with_distinct_blocks']} blocks")

        def without_cell(r):
            return (f"{r['without_mismatches']}/{r['iters']} mismatches, "
                    f"{r['without_distinct_blocks']} blocks")

        if vr is None:
            v1 = v2 = "FAIL (vramledger run failed)"
        else:
            ok1 = vr["with_mismatches"] == 0 and (nr is None or nr["with_mismatches"] == 0)
            v1 = "PASS" if ok1 else "FAIL (mismatches with record_stream)"
            vl_reuse = vr["without_mismatches"] > 0
            if nr is None:
                v2 = f"INFO (native failed; vramledger reuse {'seen' if vl_reuse else 'not seen'})"
            elif vl_reuse == (nr["without_mismatches"] > 0):
                v2 = ("PASS (early reuse visible in both)" if vl_reuse
                      else "PASS (no early reuse visible in either)")
            else:
                v2 = (f"DIFF (reuse seen by {'vramledger' if vl_reuse else 'native'} only; "
                      "allowed without record_stream)")
        return [("1a producer/consumer, record_stream", cell(n, with_cell), cell(v, with_cell), v1),
                ("1b same without record_stream (canary)", cell(n, without_cell),
                 cell(v, without_cell), v2)]

    if check == "sync_retry":
        def c(r):
            first = "OOM: " + r["oom_error"] if r["oom_error"] else "ok 1st call"
            return (f"{first}, retries +{r['retries_delta']}, ooms +{r['ooms_delta']}, "
                    f"sync_all +{r['sync_all_streams_delta']}, waited {r['alloc_ms']:.0f} ms, "
                    f"side busy {'y' if r['side_busy_before_alloc'] else 'n'}, "
                    f"free after fill {_mib(r['free_after_fill'])}, "
                    f"cached {_mib(r['cached_before'])}")

        if vr is None:
            verdict = "FAIL (vramledger run failed)"
        elif vr["oom_error"]:
            verdict = "FAIL (OutOfMemoryError on the first call)"
        elif not vr["side_busy_before_alloc"]:
            verdict = "INCONCLUSIVE (side stream already idle)"
        elif vr["free_after_fill"] >= 2 * GiB:
            verdict = "INCONCLUSIVE (card not full)"
        elif vr["retries_delta"] == 1 and vr["ooms_delta"] == 0:
            verdict = "PASS"
        else:
            verdict = f"FAIL (retries +{vr['retries_delta']}, ooms +{vr['ooms_delta']})"
        return [("2 OOM while the block waits on an event", cell(n, c), cell(v, c), verdict)]

    if check == "soak":
        def c(r):
            return (f"max active-allocated {_mib(r['max_pending'])} over {r['samples']} samples, "
                    f"loop {r['loop_s']:.1f} s, {r['distinct_blocks']} blocks, long kernel running "
                    f"in {r.get('samples_while_long_kernel_ran', '?')} samples "
                    f"(it took {r.get('long_kernel_ms', 0) / 1e3:.1f} s), "
                    f"{'running' if r['long_kernel_running_at_end'] else 'DONE'} at end")

        if vr is None:
            verdict = "FAIL (vramledger run failed)"
        elif vr.get("samples_while_long_kernel_ran", 0) < vr["samples"] // 2:
            verdict = "INCONCLUSIVE (the 10 s kernel was not running for most of the loop)"
        elif vr["max_pending"] < SOAK_LIMIT:
            verdict = f"PASS (max {_mib(vr['max_pending'])} < 16 MiB)"
        else:
            verdict = f"FAIL (max {_mib(vr['max_pending'])} >= 16 MiB)"
        return [("3 soak 10k record_stream + 10 s kernel", cell(n, c), cell(v, c), verdict)]

    # The two compile checks.
    def c(r):
        if not r["ran"]:
            return f"FAILS: {r['error']}"
        rel = _worst_rel(r["eager_losses"], r["compiled_losses"])
        skips = f", cudagraph skips {r['cudagraph_skips']}" if r["cudagraph_skips"] else ""
        return (f"runs: losses {' '.join(f'{x:.4f}' for x in r['compiled_losses'])} "
                f"(vs eager {rel:.1e}), 1st step {r['first_step_s']:.0f} s, "
                f"then {r['later_step_s'] * 1e3:.0f} ms{skips}")

    name = ("4a torch.compile mode=default, GPT-2-medium" if check == "compile_default"
            else "4b torch.compile mode=reduce-overhead")
    if vr is None:
        verdict = "FAIL (vramledger run " + (v["status"] if v else "missing") + ")"
    elif vr["ran"]:
        bad = not _finite(vr["compiled_losses"])
        rel_eager = _worst_rel(vr["eager_losses"], vr["compiled_losses"])
        rel_native = (_worst_rel(nr["compiled_losses"], vr["compiled_losses"])
                      if nr and nr.get("ran") else None)
        if bad:
            verdict = "FAIL (non-finite loss)"
        elif rel_eager > LOSS_REL_TOL or (rel_native is not None and rel_native > LOSS_REL_TOL):
            verdict = f"FAIL (losses differ: vs eager {rel_eager:.1e}, vs native {rel_native})"
        else:
            vs_native = f", vs native {rel_native:.1e}" if rel_native is not None else ""
            verdict = f"PASS (runs; vs eager {rel_eager:.1e}{vs_native})"
            if vr["cudagraph_skips"]:
                verdict += f", cudagraphs skipped {vr['cudagraph_skips']}x"
    elif check == "compile_reduce_overhead":
        verdict = "PASS (fails with a clear error; needs torch's native allocator)"
    else:
        verdict = "FAIL (compile failed)"
    return [(name, cell(n, c), cell(v, c), verdict)]


def format_table(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("check", "native", "vramledger", "verdict")
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(4)]
    widths = [min(w, 110) for w in widths]

    def line(r):
        return " | ".join(f"{x:<{w}}" for x, w in zip(r, widths)).rstrip()

    out = [line(head), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " " + __doc__.splitlines()[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    ap.add_argument("--allocator", choices=ALLOCATORS, default="native",
                    help="allocator of a --child run (internal)")
    ap.add_argument("--checks", default=",".join(CHECKS),
                    help="comma-separated subset of: " + ", ".join(CHECKS))
    ap.add_argument("--out", help="folder for the JSON, the table and the children's logs")
    ap.add_argument("--budget-s", type=float, default=560,
                    help="wall-clock cap of the whole run in seconds (default 560); a child gets "
                         "at most what is left, a check with under 20 s left is skipped")
    ap.add_argument("--serial", action="store_true",
                    help="run the compile checks' native and vramledger children one at a time")
    args = ap.parse_args()
    if args.child:
        return run_child_mode(args.child, args.allocator)

    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    info = probe()
    if not info.get("cuda"):
        why = info.get("why", f"torch {info.get('torch')} sees no CUDA device")
        print(f"streams_compile_check: no CUDA device ({why}); these checks need a GPU.")
        return 2
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(f"device {info['device']} ({info['total'] / GiB:.0f} GiB), torch {info['torch']}, "
          f"VRAMLEDGER_PLUGIN={os.environ.get('VRAMLEDGER_PLUGIN', '(unset)')}", flush=True)

    deadline = time.perf_counter() + args.budget_s
    runs: dict[str, dict] = {}

    def left() -> float:
        return deadline - time.perf_counter()

    def skipped():
        return {"status": "skipped", "why": "SKIPPED (time budget spent)", "wall_s": 0.0,
                "stderr_tail": ""}

    for check in checks:
        runs[check] = {}
        parallel = check in COMPILE_CHECKS and not args.serial
        if left() < 20:
            runs[check] = {a: skipped() for a in ALLOCATORS}
            continue
        if parallel:
            children = [Child(check, a, args.out) for a in ALLOCATORS]
            limit = min(TIMEOUT_S[check], left())
            for ch in children:
                runs[check][ch.allocator] = ch.collect(limit - (time.perf_counter() - ch.start))
        else:
            for a in ALLOCATORS:
                if left() < 20:
                    runs[check][a] = skipped()
                    continue
                limit = min(TIMEOUT_S[check], left())
                runs[check][a] = Child(check, a, args.out).collect(limit)
        walls = ", ".join(f"{a} {r['status']} {r['wall_s']:.0f} s" for a, r in runs[check].items())
        print(f"  {check}: {walls}", flush=True)

    rows = []
    for check in checks:
        rows += judge(check, runs[check])
    table = format_table(rows)
    print()
    print(table)
    failures = [(c, a, r) for c in checks for a, r in runs[c].items()
                if r["status"] in ("error", "timeout")]
    for check, allocator, r in failures:
        print(f"\n--- {check} / {allocator}: {r['why']}; stderr tail:\n{r['stderr_tail']}")
    for check in COMPILE_CHECKS:
        for a, r in runs.get(check, {}).items():
            if r["status"] == "ok" and not r["result"]["ran"]:
                print(f"\n--- {check} / {a} compile error:\n{r['result']['error_full'][:1500]}")
    if args.out:
        with open(os.path.join(args.out, "streams_compile_check.json"), "w") as f:
            json.dump({"probe": info, "runs": runs, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "streams_compile_table.txt"), "w") as f:
            f.write(table + "\n")
    return 1 if any(r[3].startswith(("FAIL", "INCONCLUSIVE")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
