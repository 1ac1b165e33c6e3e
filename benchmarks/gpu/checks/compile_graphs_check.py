"""Does torch.compile(mode="reduce-overhead") run under vramledger when inductor captures CUDA
graphs without cudagraph trees?

With cudagraph trees (torch's default) reduce-overhead fails under any pluggable allocator:
"pluggable does not yet support checkPoolLiveAllocations" (measured on the H200, torch 2.11).
With `torch._inductor.config.triton.cudagraph_trees = False` inductor uses plain
torch.cuda.graph capture into a private pool, which vramledger serves through the pluggable
pool hooks (begin/end allocate to pool, release pool). This probe trains a 4-layer GPT-2 for 4
steps that way, under vramledger (install()) and under torch's native allocator, each in its own
process, and prints the losses, the later step time and PASS when both ran and agree (1e-2).

Usage (GPU machine): python compile_graphs_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PREFIX = "RESULT_JSON "


def child(allocator: str) -> None:
    if allocator == "vramledger":
        import vramledger
        vramledger.install()
    import time

    import torch
    import torch._inductor.config as inductor_config
    from transformers import GPT2Config, GPT2LMHeadModel

    inductor_config.triton.cudagraph_trees = False
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=512, vocab_size=8192,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(0)
    losses, times, error = [], [], None
    try:
        for _ in range(4):
            x = torch.randint(0, cfg.vocab_size, (4, 256), generator=gen).cuda()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except Exception as e:  # pylint: disable=broad-except  # reported
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    print(PREFIX + json.dumps({"losses": losses, "times": times, "error": error}), flush=True)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        print("compile_graphs_check: no CUDA device (torch.cuda.is_available() is not True)")
        return 2
    results = {}
    for allocator in ("native", "vramledger"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", allocator],
                              capture_output=True, text=True, timeout=240)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
        results[allocator] = (json.loads(lines[-1][len(PREFIX):]) if lines else
                              {"losses": [], "times": [], "error": proc.stderr[-300:]})
        r = results[allocator]
        later = f"{min(r['times'][1:]) * 1e3:.1f} ms" if len(r["times"]) > 1 else "-"
        print(f"{allocator:>10}: losses {[round(x, 4) for x in r['losses']]}, later step {later}, "
              f"error {r['error']}")
    n, v = results["native"], results["vramledger"]
    ok = (not n["error"] and not v["error"] and len(v["losses"]) == 4 and
          all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(n["losses"], v["losses"])))
    print(f"{'PASS' if ok else 'FAIL'} reduce-overhead with cudagraph_trees=False under vramledger")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
