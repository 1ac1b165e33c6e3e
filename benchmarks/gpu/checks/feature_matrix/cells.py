"""The features of the feature matrix, each a function run in a process of its own.

A cell is one feature under one allocator ("column"): `python cells.py FEATURE COLUMN` sets the
column up (vramledger.install() for the vramledger columns; the environment does the rest), runs
the feature and prints one JSON line {"ok", "detail", "values"}. `values` are the numbers that
must agree with torch's native allocator (losses, sums, tokens); the driver compares them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def setup(column: str):
    if column == "vramledger":
        import vramledger
        vramledger.install()
    elif column == "pluggable":
        import vramledger
        vramledger.install(mode="pluggable")
    import torch
    torch.manual_seed(0)
    return torch


def mempool(torch, column):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    y = torch.ones(1 << 20, device="cuda")  # outside the pool
    segments = pool.snapshot()
    owned = [s for s in segments if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
    assert owned, f"the pool's snapshot has no segment holding the tensor ({len(segments)} segments)"
    assert not any(s["address"] <= y.data_ptr() < s["address"] + s["total_size"]
                   for s in segments), "a tensor made outside the pool is in its snapshot"
    uses = pool.use_count()
    total = float(x.sum().item())
    del x, y
    del pool
    torch.cuda.empty_cache()
    return f"{len(segments)} segment(s) in the pool, use_count {uses}", [total]


def _custom_library(torch) -> str:
    """Builds (once) a CUDAPluggableAllocator library that counts its calls."""
    import subprocess
    out = os.path.join(os.environ.get("FM_OUT", "/tmp"), "libfm_alloc.so")
    if not os.path.exists(out):
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", out,
                        os.path.join(HERE, "custom_alloc.cc"), "-ldl"], check=True)
    return out


def mempool_custom(torch, column):
    import ctypes
    path = _custom_library(torch)
    lib = ctypes.CDLL(path)
    lib.fm_alloc_calls.restype = ctypes.c_long
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "fm_alloc", "fm_free")
    pool = torch.cuda.MemPool(alloc.allocator())
    with torch.cuda.use_mem_pool(pool):
        x = torch.full((4 << 20,), 3.0, device="cuda")
    calls = lib.fm_alloc_calls()
    assert calls >= 1, "the pool's allocator was never called"
    total = float(x.sum().item())
    del x
    del pool
    torch.cuda.empty_cache()
    return f"the pool's allocator served {calls} segment(s)", [total]


def snapshot_history(torch, column):
    torch.cuda.memory._record_memory_history(max_entries=10000)
    xs = [torch.empty(n * MiB, device="cuda") for n in (1, 3, 9)]
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = sum(len(t) for t in snap["device_traces"])
    assert snap["segments"], "no segments in torch's snapshot"
    assert traces >= 3, f"{traces} trace entries"
    del xs
    return f"{len(snap['segments'])} segments, {traces} trace entries", []


def stats(torch, column):
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    peak = torch.cuda.max_memory_allocated()
    allocated = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
    assert peak >= 256 * MiB and allocated >= 256 * MiB, f"max_memory_allocated {peak}"
    del x
    summary = torch.cuda.memory_summary()
    assert "memory summary" in summary.lower(), summary[:200]
    return f"max_memory_allocated {peak / MiB:.0f} MiB", []


def graph(torch, column):
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512)).cuda()
    x = torch.randn(64, 512, device="cuda")
    eager = model(x)
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            model(x)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g1, pool=pool):
        out1 = model(x)
    with torch.cuda.graph(g2, pool=pool):
        out2 = model(out1)
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    err = float((out1 - eager).abs().max().item())
    assert err == 0.0, f"graph differs from eager by {err}"
    return "two graphs in one shared pool replay as eager", [float(out2.sum().item())]


def oom(torch, column):
    try:
        torch.empty(1 << 44, dtype=torch.uint8, device="cuda")  # 16 TiB
    except torch.OutOfMemoryError as e:
        kind = type(e).__name__
    else:
        raise AssertionError("16 TiB was allocated")
    y = torch.ones(1024, device="cuda")
    return f"{kind}, CUDA usable after", [float(y.sum().item())]


def _gpt2(torch, medium: bool):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = (GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024)
           if medium else GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256))
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).cuda()


def compile_train(torch, column):
    """reduce-overhead (CUDA graph trees) on a GPT-2-medium training step: the model compiled,
    backward and optimizer eager, each step begun with cudagraph_mark_step_begin() (torch's rule
    for a graph whose outputs the next call overwrites); prints step times."""
    model = _gpt2(torch, medium=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses, times = [], []
    steps = int(os.environ.get("FM_STEPS", "8"))
    for _ in range(steps):
        ids = torch.randint(0, 50257, (4, 256), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.item()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    later = sorted(times[3:])
    return (f"losses {[round(v, 4) for v in losses[:3]]}..., median later step "
            f"{later[len(later) // 2] * 1e3:.1f} ms"), losses


def compile_generate(torch, column):
    """Greedy generation whose sequence grows each step: CUDA graph trees record a new graph
    for each shape (dynamic=False: one per length)."""
    model = _gpt2(torch, medium=False).eval()
    fwd = torch.compile(lambda ids: model(input_ids=ids).logits[:, -1, :],
                        mode="reduce-overhead", dynamic=False)
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 64
    ids = torch.randint(0, 50257, (2, 8), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(2))
    with torch.no_grad():
        for _ in range(12):
            nxt = fwd(ids).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        again = fwd(ids[:, :12]).argmax(-1)  # an earlier shape: its recorded graph is replayed
    tokens = [int(t) for t in ids[:, 8:].flatten().tolist()]
    return f"12 shapes recorded, {len(tokens)} tokens", tokens + [int(t) for t in again.tolist()]


def _ipc_peer(queue_in, queue_out):
    import torch
    t = queue_in.get()  # from the process under test
    queue_out.put(float(t.sum().item()))
    t.mul_(2)
    torch.cuda.synchronize()
    mine = torch.full((1 << 20,), 7.0, device="cuda")
    queue_out.put(mine)
    queue_out.put(queue_in.get())  # wait until the other side is done with `mine`
    del t


def ipc(torch, column):
    """A CUDA tensor sent to a process on torch's own allocator, and one received from it; with
    a contiguous (plain) segment and with the column's default segments. Only the default
    layout's sums are compared across columns (torch's columns have no contiguous layout); the
    contiguous layout's are checked exactly here."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    details, values = [], []
    layouts = ["default"]
    if column in ("vramledger", "pluggable"):
        layouts.append("contiguous")
    for layout in layouts:
        saved = {k: os.environ.pop(k) for k in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF")
                 if k in os.environ}
        q_in, q_out = ctx.Queue(), ctx.Queue()
        peer = ctx.Process(target=_ipc_peer, args=(q_in, q_out))
        peer.start()
        os.environ.update(saved)
        if layout == "contiguous":
            import vramledger
            with vramledger.contiguous_segments():
                t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        else:
            t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        torch.cuda.synchronize()
        q_in.put(t)
        seen = q_out.get(timeout=120)
        theirs = q_out.get(timeout=120)
        torch.cuda.synchronize()
        doubled = float(t.sum().item())
        got = float(theirs.sum().item())
        del theirs
        q_in.put("done")
        q_out.get(timeout=60)
        peer.join(60)
        assert peer.exitcode == 0, f"peer exit {peer.exitcode}"
        expect = float((1 << 20) * ((1 << 20) - 1) / 2)
        assert seen == expect and doubled == 2 * expect and got == 7.0 * (1 << 20), (
            seen, doubled, got)
        details.append(f"{layout}: sent and received")
        if layout == "default":
            values += [seen, doubled, got]
    return "; ".join(details), values


def _init_single_rank(torch):
    import socket
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    return dist


def fsdp2(torch, column):
    from torch.distributed.fsdp import fully_shard
    dist = _init_single_rank(torch)
    model = _gpt2(torch, medium=True)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(3)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 50257, (4, 256), device="cuda", generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
    dist.destroy_process_group()
    return f"losses {[round(v, 4) for v in losses]}", losses


def nccl_register(torch, column):
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
    dist = _init_single_rank(torch)
    xs = [torch.full((n * MiB // 4,), 1.5, device="cuda") for n in (1, 8, 64)]
    for x in xs:
        dist.all_reduce(x)
    torch.cuda.synchronize()
    sums = [float(x.sum().item()) for x in xs]
    dist.destroy_process_group()
    return "all_reduce with the register hook on", sums


FEATURES = {
    "mempool": mempool, "mempool_custom": mempool_custom, "snapshot": snapshot_history,
    "stats": stats, "graph": graph, "oom": oom, "ipc": ipc, "nccl_register": nccl_register,
    "fsdp2": fsdp2, "compile_generate": compile_generate, "compile_train": compile_train,
}


def main() -> int:
    feature, column = sys.argv[1], sys.argv[2]
    result = {"feature": feature, "column": column}
    try:
        torch = setup(column)
        detail, values = FEATURES[feature](torch, column)
        result.update(ok=True, detail=detail, values=values)
    except BaseException as e:  # the cell reports every failure as its result
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        result.update(ok=False, detail=last.splitlines()[0][:300], values=[])
        traceback.print_exc()
    print("FM_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
