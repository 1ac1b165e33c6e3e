"""torch's integration on a GPU: its memory API, CUDA graphs, torch.compile, OOM observers and DataLoader
workers under vramledger. Prints one table row per check; exit status 1 if any failed.

    PYTHONPATH=torch_plugin/python VRAMLEDGER_PLUGIN=build-i/torch_plugin/lib/libvramledger_plugin.so \
        .venv/bin/python benchmarks/gpu/checks/torch_integration_check.py

`--mode native` runs every check with vramledger installed as torch's own CUDAAllocator
(install(mode="native"), torch's functions unpatched) and adds the checks of torch's own
_snapshot and _record_memory_history (docs/design/torch-native-mode.md).
The torch.compile check runs in a child process of its own (with vramledger installed there
too): in one process with the failed-capture check before it, compile failed on the H200 with
"Offset increment outside graph capture ...". The larger compile checks (GPT-2-medium, default
and reduce-overhead, against native) are in streams_compile_check.py.
Exit status: 0 when every check passed, 1 when one failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

MODE = "pluggable"
if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                      epilog="\n".join(__doc__.splitlines()[1:]),
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    _parser.add_argument("--mode", choices=("pluggable", "native"), default="pluggable",
                         help="install(mode=...): the route into torch")
    MODE = _parser.parse_args().mode

import vramledger  # noqa: E402

try:
    vramledger.install(mode=MODE)  # before any CUDA call; pluggable: torch's functions patched
except RuntimeError as e:
    if "CUDA is not available" in str(e):
        print(f"torch_integration_check: no CUDA device ({str(e).splitlines()[0]})")
        sys.exit(2)
    raise

import torch  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def check(name):
    """Runs the decorated function as one check and records (name, ok, detail)."""
    def wrap(fn):
        start = time.perf_counter()
        try:
            detail = fn() or ""
            RESULTS.append((name, True, f"{detail} ({time.perf_counter() - start:.1f} s)"))
        except Exception as e:  # pylint: disable=broad-except
            traceback.print_exc()
            RESULTS.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
        return fn
    return wrap


@check("torch.cuda memory API answers from vramledger")
def _memory_api():
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] >= 64 << 20, stats
    assert torch.cuda.memory_allocated() == vramledger.memory_allocated()
    assert torch.cuda.max_memory_allocated() >= 64 << 20
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    assert torch.cuda.memory.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"] > 0
    summary = torch.cuda.memory_summary()
    assert summary.startswith("|=====") and "Allocated memory" in summary, summary
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    del x
    return f"allocated {torch.cuda.memory_allocated()} B after del"


@check("CUDA graph capture + replay of an MLP step equals eager")
def _graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).cuda()
    static_in = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs do
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_in)
    worst = 0.0
    for _ in range(5):
        data = torch.randn(64, 256, device="cuda")
        static_in.copy_(data)
        graph.replay()
        torch.cuda.synchronize()
        eager = model(data)
        worst = max(worst, (static_out - eager).abs().max().item())
    assert worst < 1e-4, worst
    # The graph's private pool names its segments in the snapshot (torch's segment_pool_id);
    # in native mode torch's own _snapshot answers, and _snapshot(pool) holds only that pool.
    pool = tuple(graph.pool())
    snap = torch.cuda.memory._snapshot() if MODE == "native" else vramledger.snapshot()
    owners = sorted({tuple(seg["segment_pool_id"]) for seg in snap["segments"]})
    assert pool in owners, (pool, owners)
    if MODE == "native":
        only = torch.cuda.memory_snapshot(mempool_id=pool)
        assert only and {tuple(seg["segment_pool_id"]) for seg in only} == {pool}, only[:1]
    before = torch.cuda.memory_reserved()
    del graph, static_out
    torch.cuda.empty_cache()
    return (f"max |graph - eager| = {worst:.2e}; pool {pool} in the snapshot's {owners}; "
            f"reserved {before} -> {torch.cuda.memory_reserved()}")


@check("failed capture leaves no pool behind")
def _failed_capture():
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            y = torch.ones(1 << 20, device="cuda") * 2
            torch.cuda.synchronize()  # not allowed while capturing: the capture fails
    except Exception:  # pylint: disable=broad-except
        pass
    else:
        raise AssertionError("the capture did not fail")
    torch.cuda.synchronize()
    y = None  # noqa: F841
    del graph
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert after == before, (before, after)
    return f"reserved {before} -> {after}"


# Runs in a fresh process with vramledger installed: a failed capture earlier in this one must
# not decide whether compile works.
_COMPILE_CHILD = f"""
import vramledger
vramledger.install(mode={MODE!r})
import torch
model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(),
                            torch.nn.Linear(128, 1)).cuda()
compiled = torch.compile(model, mode="default")
x = torch.randn(32, 128, device="cuda")
out = compiled(x)
out.sum().backward()
diff = (out - model(x)).abs().max().item()
assert diff < 1e-3, diff
print(f"max |compiled - eager| = {{diff:.2e}}")
"""


@check('torch.compile(mode="default") runs (own process)')
def _compile():
    try:
        proc = subprocess.run([sys.executable, "-c", _COMPILE_CHILD], capture_output=True,
                              text=True, timeout=100, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as e:
        raise AssertionError("the compile process timed out after 100 s") from e
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln.split(":")[0]]
        raise AssertionError(f"exit {proc.returncode}: {(errors or lines or ['?'])[-1]}")
    return proc.stdout.strip().splitlines()[-1]


@check("OOM observer called, torch.OutOfMemoryError raised, process keeps working")
def _oom():
    calls = []
    vramledger.attach_out_of_memory_observer(lambda *args: calls.append(args))
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        message = str(e)
    else:
        raise AssertionError("no OutOfMemoryError")
    assert len(calls) == 1, calls
    device, alloc_size, limit, device_free = calls[0]
    assert device == 0 and alloc_size >= 2 * total and limit == total, calls
    assert "free-space fragmentation" in message, message
    assert torch.cuda.memory_stats()["num_ooms"] >= 1
    torch.ones(10, device="cuda").sum().item()
    return f"observer args {calls[0]}"


if MODE == "native":
    @check("native mode: torch's backend name, _snapshot segments and memory history")
    def _native_torch_api():
        assert torch.cuda.get_allocator_backend() == "vramledger", torch.cuda.get_allocator_backend()
        torch.cuda.memory._record_memory_history(max_entries=1000)
        x = torch.empty(48 << 20, dtype=torch.uint8, device="cuda")
        snap = torch.cuda.memory._snapshot()
        vl = vramledger.snapshot()  # before the switch goes off: off clears (as torch's)
        torch.cuda.memory._record_memory_history(enabled=None)
        mine = [b for seg in snap["segments"] for b in seg["blocks"]
                if b["state"] == "active_allocated" and b["size"] >= 48 << 20]
        assert mine, snap["segments"][:2]
        expandable = sorted({seg["is_expandable"] for seg in snap["segments"]})
        allocs = [e for e in snap["device_traces"][0]
                  if e["action"] == "alloc" and e["addr"] == x.data_ptr()]
        assert allocs and allocs[-1]["size"] == 48 << 20, snap["device_traces"][0][-3:]
        traces = sum(len(t) for t in vl["device_traces"])
        assert traces >= len(snap["device_traces"][0]) > 0, (traces, len(snap["device_traces"][0]))
        allocated = sum(seg["allocated_size"] for seg in snap["segments"])
        assert allocated == torch.cuda.memory_allocated(), (allocated, torch.cuda.memory_allocated())
        del x
        return (f"{len(snap['segments'])} segments (is_expandable {expandable}), "
                f"{len(snap['device_traces'][0])} trace entries in torch's snapshot, "
                f"{traces} in vramledger's")


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        x = torch.full((16,), float(i))
        return x, x.sum()


@check("DataLoader(pin_memory=True, num_workers=2) feeds a training loop")
def _dataloader():
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=32, num_workers=2,
                                         pin_memory=True)
    model = torch.nn.Linear(16, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batches = 0
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = ((model(x).squeeze(1) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batches += 1
    assert batches == 8, batches
    return f"{batches} batches"


def main() -> int:
    width = max(len(name) for name, _, _ in RESULTS)
    print(f"\n{'check':<{width}}  result  detail")
    for name, ok, detail in RESULTS:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {detail}")
    print(torch.cuda.memory_summary(abbreviated=True))
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
