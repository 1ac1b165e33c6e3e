#!/usr/bin/env bash
# Issue 7 on the H200: GPT-2-medium training (train_compare.py's unmodified native child) with and
# without the LD_PRELOAD shim, then a cudaMalloc-only CUDA C++ program under the shim.
# Usage: benchmarks/gpu/preload_check.sh [PRELOAD_SO] (default: the installed package's copy).
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
SO=${1:-$($PY -c 'import os, vramledger; print(os.path.join(os.path.dirname(vramledger.__file__), "libvramledger_preload.so"))')}
OUT=${OUT:-/tmp/preload_check}; rm -rf "$OUT"; mkdir -p "$OUT/dumps"
STEPS=${STEPS:-10}
echo "== without shim"; $PY benchmarks/gpu/train_compare.py --child native --steps "$STEPS" > "$OUT/native.txt" 2>&1 || { tail -30 "$OUT/native.txt"; exit 2; }
echo "== under shim"; VRAMLEDGER_PRELOAD_QUIET=1 VRAMLEDGER_CONF="dump_dir:$OUT/dumps,expandable_segments:True" LD_PRELOAD="$SO" \
  $PY benchmarks/gpu/train_compare.py --child native --steps "$STEPS" > "$OUT/shim.txt" 2>&1 || { tail -30 "$OUT/shim.txt"; exit 2; }
$PY - "$OUT" <<'P'
import glob, json, sys
out = sys.argv[1]
def res(name):
    lines = [l for l in open(f"{out}/{name}.txt") if l.startswith("RESULT_JSON ")]
    return json.loads(lines[-1][len("RESULT_JSON "):])
a, b = res("native"), res("shim")
rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"]))
print(f"losses max rel diff {rel:.2e} -> {'OK' if rel <= 1e-3 else 'FAIL'}")
print(f"median step native {a['median_step_s']*1e3:.1f} ms, shim {b['median_step_s']*1e3:.1f} ms "
      f"({(b['median_step_s']/a['median_step_s']-1)*100:+.1f}%)")
summ = glob.glob(f"{out}/dumps/vramledger-preload-*-exit.txt"); snap = glob.glob(f"{out}/dumps/vramledger-preload-*-exit.json")
print("exit summary:", summ, "snapshot:", snap)
if snap:
    p = json.load(open(snap[0]))["vramledger"]["preload"]
    print("shim counts:", p)
    print("torch's tensor allocations (native run, allocation.all.allocated) are printed by the"
          " count child below")
if summ: print(open(summ[0]).read())
P
echo "== allocation counts: torch native count vs shim cudaMallocAsync count (same small script)"
cat > "$OUT/count.py" <<'P'
import torch, random, sys
from transformers import GPT2Config, GPT2LMHeadModel
random.seed(0); torch.manual_seed(0)
cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
m = GPT2LMHeadModel(cfg).cuda(); opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
for _ in range(3):
    x = torch.randint(0, cfg.vocab_size, (8, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16): loss = m(input_ids=x, labels=x).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
if torch.cuda.get_allocator_backend() == "native":
    print("COUNT torch allocation.all.allocated", torch.cuda.memory_stats()["allocation.all.allocated"])
else:
    import ctypes, json
    lib = ctypes.CDLL(None); f = lib.vramledger_preload_stats_json; f.restype = ctypes.c_void_p
    p = f(); s = json.loads(ctypes.string_at(p).decode()); print("COUNT shim", s)
P
$PY "$OUT/count.py" 2>&1 | grep COUNT
VRAMLEDGER_PRELOAD_QUIET=1 VRAMLEDGER_CONF="dump_dir:$OUT/dumps2" LD_PRELOAD="$SO" $PY "$OUT/count.py" 2>&1 | grep COUNT
echo "== cudaMalloc-only C++ program (nvcc -cudart shared: a static cudart cannot be interposed)"
cat > "$OUT/plain.cu" <<'C'
#include <cuda_runtime.h>
#include <cstdio>
int main() {
  void* p[100]; int bad = 0;
  for (int i = 0; i < 100; ++i) bad += cudaMalloc(&p[i], (i + 1) << 16) != cudaSuccess;
  for (int i = 0; i < 100; ++i) bad += cudaFree(p[i]) != cudaSuccess;
  std::printf("plain: 100 cudaMalloc + 100 cudaFree, failures %d\n", bad);
  return bad != 0;
}
C
nvcc -cudart shared -o "$OUT/plain" "$OUT/plain.cu" && \
  VRAMLEDGER_CONF="dump_dir:$OUT/dumps3" LD_PRELOAD="$SO" "$OUT/plain" 2>&1 | grep -E "plain|calls seen|served"
