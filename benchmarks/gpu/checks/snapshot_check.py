"""Memory history on a GPU: snapshots torch's viewers open, OOM forensics, overhead.

Runs, each in its own process (install() must precede CUDA's initialisation):
  forensics  vramledger installed with dump_dir=OUT/dumps, max_dumps=3 and history on: allocates
             from a named function, provokes four torch.OutOfMemoryErrors and checks that each
             message names a snapshot file that exists, that at most 3 dumps remain, that the dump
             has the `oom` entry (with device_free) and the allocating function's frame, and that
             vramledger.dump_snapshot() pickles load in torch.cuda._memory_viz (segsum, trace,
             trace_plot, and `python -m torch.cuda._memory_viz stats`) with matching totals.
  train      GPT-2-medium (as train_compare.py: 24 layers, hidden 1024, batch 8, seq U[128,1024],
             bf16 autocast, AdamW) under {vramledger, native} x {history off, on}; median step
             time of the timed steps. With history on, one extra step takes a snapshot after the
             forward pass (vramledger.dump_snapshot() / torch.cuda.memory._dump_snapshot()); the
             largest live block's innermost user frame and stack are reported, and its stack
             must name a line of the model file (transformers' modeling_gpt2.py).
Prints every check, the overhead table (history on / off, per allocator) and a summary.

Usage (the GPU image has no Abseil: build the plugin here with `benchmarks/gpu/run.sh
prepare`, carry .devbuild/lib, then on the GPU machine):
  VRAMLEDGER_PLUGIN=.devbuild/lib/libvramledger_plugin.so PYTHONPATH=torch_plugin/python \
      python benchmarks/gpu/checks/snapshot_check.py --out "$OUT" [--steps 8] [--skip-train]
Writes OUT/snapshot_check.json, OUT/dumps/, OUT/forensics.pickle|.json and
OUT/gpt2m-{vramledger,native}.pickle (the mid-step snapshots).
Exit status: 0 when every check passed, 1 when one failed, 2 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import pickletools
import statistics
import subprocess
import sys
import time

RESULT_PREFIX = "RESULT_JSON "
VIEWER_OPCODES = {"PROTO", "FRAME", "MEMOIZE", "BINGET", "LONG_BINGET", "EMPTY_DICT",
                  "EMPTY_LIST", "MARK", "SETITEMS", "SETITEM", "APPEND", "APPENDS",
                  "SHORT_BINUNICODE", "BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1",
                  "BINFLOAT", "NEWTRUE", "NEWFALSE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
                  "EMPTY_TUPLE", "NONE", "DICT", "LIST", "BINPUT", "LONG_BINPUT", "STOP"}


def make_weights(torch):
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # the frame to find


def forensics(out: str) -> dict:
    import vramledger
    from vramledger import _inspect, _snapshot

    dump_dir = os.path.join(out, "dumps")
    vramledger.install(dump_dir=dump_dir, max_dumps=3)
    vramledger.record_memory_history("all", "all", "python", max_entries=100000)
    import torch
    from torch.cuda import _memory_viz as mv

    checks = {}
    w = make_weights(torch)
    messages = []
    for _ in range(4):
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            messages.append(str(e))
        time.sleep(0.01)
    marker = "memory snapshot written to "
    paths = [m.split(marker, 1)[1].split(" ", 1)[0] if marker in m else None for m in messages]
    checks["four OutOfMemoryErrors raised"] = len(messages) == 4
    checks["every message names its dump"] = all(paths)
    checks["the last dump exists"] = bool(paths and paths[-1] and os.path.exists(paths[-1]))
    dumps = sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []
    ours = [d for d in dumps if d.startswith("vramledger-oom-")]
    checks["at most max_dumps=3 kept"] = len(ours) == 3
    result = {"message_tail": messages[-1][-400:] if messages else "", "dumps": dumps}
    if checks["the last dump exists"]:
        dump = _snapshot.load_snapshot(paths[-1])
        trace = dump["device_traces"][torch.cuda.current_device()]
        ooms = [e for e in trace if e["action"] == "oom"]
        checks["dump has oom entries with device_free"] = bool(ooms) and all(
            "device_free" in e and "addr" not in e for e in ooms)
        block = max((b for s in dump["segments"] for b in s["blocks"]
                     if b["state"] == "active_allocated"), key=lambda b: b["size"])
        frame = _inspect.innermost_user_frame(block["frames"])
        result["largest_block_frame"] = _inspect.frame_text(frame)
        checks["largest block names make_weights in this file"] = (
            frame[2] == "make_weights" and frame[0].endswith("snapshot_check.py"))
    pickle_path = vramledger.dump_snapshot(os.path.join(out, "forensics.pickle"))
    vramledger.dump_snapshot(os.path.join(out, "forensics.json"))
    raw = open(pickle_path, "rb").read()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    checks["pickle protocol 4, viewer opcodes only"] = (
        raw[:2] == b"\x80\x04" and ops <= VIEWER_OPCODES)
    data = _snapshot.load_snapshot(pickle_path)
    reserved = sum(s["total_size"] for s in data["segments"])
    stats_text = mv.segsum(data)
    checks["_memory_viz.segsum totals match"] = (
        f"total_reserved: {mv.Bytes(reserved)}" in stats_text)
    checks["_memory_viz.trace reads it"] = "entries" in mv.trace(data)
    checks["_memory_viz.trace_plot reads it"] = "add_local_files" in mv.trace_plot(data)
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", pickle_path],
                          capture_output=True, text=True, timeout=300)
    checks["python -m torch.cuda._memory_viz stats"] = (
        proc.returncode == 0 and f"total_reserved: {mv.Bytes(reserved)}" in proc.stdout)
    checks["reserved equals vramledger.memory_reserved()"] = (
        reserved == vramledger.memory_reserved())
    del w
    result["checks"] = checks
    return result


def train(allocator: str, history: bool, steps: int, out: str) -> dict:
    if allocator == "vramledger":
        import vramledger
        vramledger.install()
        if history:
            vramledger.record_memory_history("all", "all", "python")
    import random

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if allocator == "native" and history:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    random.seed(0)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        x = torch.randint(0, cfg.vocab_size, (8, random.randint(128, 1024)), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        snapshot_path = None
        if step == steps and history:  # the extra, untimed step: snapshot after the forward
            torch.cuda.synchronize()
            snapshot_path = os.path.join(out, f"gpt2m-{allocator}.pickle")
            if allocator == "vramledger":
                import vramledger
                vramledger.dump_snapshot(snapshot_path)
            else:
                torch.cuda.memory._dump_snapshot(snapshot_path)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step < steps:
            times.append(time.perf_counter() - t0)
    result = {"allocator": allocator, "history": history, "step_s": times,
              "median_step_s": statistics.median(times[2:] if len(times) > 3 else times)}
    if history:
        from vramledger import _inspect, _snapshot

        snap = _snapshot.load_snapshot(snapshot_path)
        block = max((b for s in snap["segments"] for b in s["blocks"]
                     if b["state"] == "active_allocated"), key=lambda b: b["size"])
        result["largest_block_bytes"] = block["size"]
        result["largest_block_frame"] = _inspect.frame_text(
            _inspect.innermost_user_frame(block["frames"]))
        result["largest_block_stack"] = [_inspect.frame_text(
            (f["filename"], f["line"], f["name"])) for f in block["frames"][:12]]
        model = [f for f in block["frames"] if str(f["filename"]).endswith("modeling_gpt2.py")]
        result["model_frame"] = _inspect.frame_text(
            (model[0]["filename"], model[0]["line"], model[0]["name"])) if model else None
    return result


def run_child(args: list[str]) -> dict | None:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                          text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    print(f"snapshot_check: child {args} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
          f"\n{proc.stderr[-6000:]}")
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".devbuild/out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        if args.child[0] == "forensics":
            result = forensics(args.out)
        else:
            result = train(args.child[0], args.child[1] == "on", args.steps, args.out)
        print(RESULT_PREFIX + json.dumps(result))
        return 0

    report, failed, broken = {}, False, False
    print("==== forensics (vramledger)")
    f = run_child(["--out", args.out, "--child", "forensics"])
    if f is None:
        broken = True
    else:
        report["forensics"] = f
        for name, ok in f["checks"].items():
            print(f"  {'PASS' if ok else 'FAIL'}  {name}")
            failed |= not ok
        print(f"  largest live block: {f.get('largest_block_frame')}")
        print(f"  OOM message ends: ...{f['message_tail'][-200:]}")
    if not args.skip_train:
        print("==== GPT-2-medium step time, history off / on")
        runs = {}
        for allocator in ("vramledger", "native"):
            for history in ("off", "on"):
                r = run_child(["--out", args.out, "--steps", str(args.steps), "--child",
                               allocator, history])
                broken |= r is None
                runs[f"{allocator}/{history}"] = r
        report["train"] = runs
        print(f"  {'allocator':<12} {'off (s)':>10} {'on (s)':>10} {'overhead':>10}")
        for allocator in ("vramledger", "native"):
            off, on = runs.get(f"{allocator}/off"), runs.get(f"{allocator}/on")
            if off and on:
                over = on["median_step_s"] / off["median_step_s"] - 1
                print(f"  {allocator:<12} {off['median_step_s']:>10.4f} "
                      f"{on['median_step_s']:>10.4f} {over:>+9.1%}")
                report[f"{allocator}_overhead"] = over
        for allocator in ("vramledger", "native"):
            on = runs.get(f"{allocator}/on")
            if on:
                print(f"  {allocator} snapshot after forward: largest live block "
                      f"{on['largest_block_bytes']:,} B from {on['largest_block_frame']}")
                for frame in on["largest_block_stack"]:
                    print(f"      {frame}")
        on = runs.get("vramledger/on")
        if on:
            ok = on.get("model_frame") is not None
            print(f"  {'PASS' if ok else 'FAIL'}  the largest live block's stack names the model "
                  f"file and line: {on.get('model_frame')}")
            failed |= not ok
        if "vramledger_overhead" in report and "native_overhead" in report:
            ok = report["vramledger_overhead"] <= report["native_overhead"] + 0.01
            print(f"  {'PASS' if ok else 'FAIL'}  history overhead no higher than torch's "
                  f"(+1 point tolerance for noise)")
            failed |= not ok
    with open(os.path.join(args.out, "snapshot_check.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    print("==== summary:", "BROKEN RUN" if broken else ("FAIL" if failed else "PASS"))
    return 2 if broken else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
