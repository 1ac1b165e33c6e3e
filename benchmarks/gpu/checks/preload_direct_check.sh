#!/usr/bin/env bash
# The LD_PRELOAD shim's direct route on a GPU: an unmodified torch program under the shim gets
# vramledger as torch's own allocator (libvramledger_native.so beside the shim), so torch's
# memory_stats count its tensors, get_allocator_backend() names vramledger, torch's snapshot has
# vramledger's segments, a MemPool is tried (printed, no verdict), the shim's exit summary names
# the route, and a plan too small raises torch.OutOfMemoryError with the shim's refusal report.
# Then the fallback: the shim with no native library beside it warns once and serves torch
# through torch's cudaMallocAsync backend. Skips (exit 0) without a CUDA device.
# Usage: benchmarks/gpu/checks/preload_direct_check.sh [PRELOAD_SO] (default .devbuild/lib's copy).
# Env: PYTHON, OUT (default /tmp/preload_direct_check). PASS/FAIL lines; exit 0 when all passed.
set -u
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-python}
SO=${1:-$PWD/.devbuild/lib/libvramledger_preload.so}
OUT=${OUT:-/tmp/preload_direct_check}; rm -rf "$OUT"; mkdir -p "$OUT"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "SKIP: no CUDA device here (torch.cuda.is_available() is False)"; exit 0
fi
[ -f "$SO" ] || { echo "FAIL: no shim at $SO"; exit 2; }
fails=0
check() {  # check OK|FAIL MESSAGE
  if [ "$1" = OK ]; then echo "PASS: $2"; else echo "FAIL: $2"; fails=$((fails + 1)); fi
}
# field FILE KEY: the value of KEY in the program's RESULT_JSON line ("" when absent).
field() {
  "$PY" -c 'import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("RESULT_JSON ")]
v = json.loads(lines[-1][len("RESULT_JSON "):]).get(sys.argv[2]) if lines else None
print("" if v is None else v)' "$1" "$2"
}

# The unmodified program: nothing in it knows about vramledger.
cat > "$OUT/program.py" <<'P'
import json, os, sys
import torch
out = {"backend": torch.cuda.get_allocator_backend(),
       "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
if sys.argv[1] == "train":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        x = torch.randn(64, 1024, device="cuda")
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    out["loss"] = loss.item()
    out["peak"] = torch.cuda.memory_stats().get("allocated_bytes.all.peak", 0)
    out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    out["backend_after"] = torch.cuda.get_allocator_backend()
    try:
        out["snapshot_segments"] = len(torch.cuda.memory._snapshot()["segments"])
    except Exception as e:  # printed, judged below
        out["snapshot_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            t = torch.empty(1 << 20, device="cuda")
        out["mempool"] = f"ok ({t.numel() * 4} bytes in a MemPool)"
        del t
    except Exception as e:
        out["mempool"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:300]
else:  # "oom": 2 GiB under a 1 GiB plan
    try:
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        out["oom"] = "no error"
    except torch.OutOfMemoryError as e:
        out["oom"] = "torch.OutOfMemoryError"
        out["oom_message"] = str(e).splitlines()[0][:200]
print("RESULT_JSON " + json.dumps(out), flush=True)
P

echo "== without the shim (reference loss)"
"$PY" "$OUT/program.py" train > "$OUT/native.txt" 2>&1 || { tail -20 "$OUT/native.txt"; exit 2; }
echo "== under the shim: the direct route"
VRAMLEDGER_PRELOAD_QUIET=1 VRAMLEDGER_CONF="dump_dir:$OUT/dumps,expandable_segments:True" \
  LD_PRELOAD="$SO" "$PY" "$OUT/program.py" train > "$OUT/direct.txt" 2>&1
RC=$?
[ "$RC" = 0 ] && r=OK || r=FAIL; check $r "the program ran under the shim (exit status $RC)"
b=$(field "$OUT/direct.txt" backend_after)
[ "$b" = vramledger ] && r=OK || r=FAIL; check $r "torch.cuda.get_allocator_backend() = '$b'"
c=$(field "$OUT/direct.txt" alloc_conf)
[ -z "$c" ] && r=OK || r=FAIL; check $r "PYTORCH_CUDA_ALLOC_CONF not forced by the shim: '${c}'"
peak=$(field "$OUT/direct.txt" peak); mma=$(field "$OUT/direct.txt" max_memory_allocated)
[ "${peak:-0}" -gt 0 ] 2>/dev/null && [ "${mma:-0}" -gt 0 ] 2>/dev/null && r=OK || r=FAIL
check $r "torch.cuda.memory_stats()['allocated_bytes.all.peak'] = ${peak:-none}, max_memory_allocated() = ${mma:-none}"
segs=$(field "$OUT/direct.txt" snapshot_segments)
[ "${segs:-0}" -gt 0 ] 2>/dev/null && r=OK || r=FAIL
check $r "torch.cuda.memory._snapshot() has ${segs:-no} segments ($(field "$OUT/direct.txt" snapshot_error))"
"$PY" - "$OUT/native.txt" "$OUT/direct.txt" <<'P' && r=OK || r=FAIL
import json, sys
def loss(path):
    l = [x for x in open(path) if x.startswith("RESULT_JSON ")][-1]
    return json.loads(l[len("RESULT_JSON "):])["loss"]
a, b = loss(sys.argv[1]), loss(sys.argv[2])
rel = abs(a - b) / max(abs(a), 1e-12)
print(f"  loss native {a:.6g}, direct {b:.6g}, rel diff {rel:.2e}")
sys.exit(0 if rel <= 1e-3 else 1)
P
check $r "the loss equals torch native's within 1e-3"
echo "  MemPool under the direct route: $(field "$OUT/direct.txt" mempool)"
summary=$(ls "$OUT"/dumps/vramledger-preload-pid*-exit.txt 2>/dev/null | head -1)
route=$([ -n "$summary" ] && grep -m1 '^route: ' "$summary")
[[ "$route" == "route: direct"* ]] && r=OK || r=FAIL; check $r "exit summary ${summary:-missing}: ${route:-no route line}"
[ -n "$summary" ] && sed -n '/^device /,+4p' "$summary" | sed 's/^/  /'

echo "== under the shim with a 1 GiB plan: 2 GiB asked"
printf '{\n  "vramledger_plan": 1,\n  "limit": "1GiB"\n}\n' > "$OUT/plan.json"
VRAMLEDGER_PRELOAD_QUIET=1 VRAMLEDGER_CONF="dump_dir:$OUT/dumps_plan,plan:$OUT/plan.json" \
  LD_PRELOAD="$SO" "$PY" "$OUT/program.py" oom > "$OUT/oom.txt" 2>&1
o=$(field "$OUT/oom.txt" oom)
[ "$o" = torch.OutOfMemoryError ] && r=OK || r=FAIL
check $r "the refusal raised ${o:-nothing}: $(field "$OUT/oom.txt" oom_message)"
report=$(ls "$OUT"/dumps_plan/vramledger-preload-pid*-refusal-1.txt 2>/dev/null | head -1)
[ -n "$report" ] && grep -q "vramledger plan violation: $OUT/plan.json:3: limit" "$report" && r=OK || r=FAIL
check $r "the shim's refusal report names plan line 3: ${report:-none}"

echo "== fallback: the shim with no libvramledger_native.so beside it"
mkdir -p "$OUT/no_native"
for f in "$(dirname "$SO")"/*; do
  [ "$(basename "$f")" = libvramledger_native.so ] || ln -s "$f" "$OUT/no_native/"
done
VRAMLEDGER_CONF="dump_dir:$OUT/dumps_fallback" LD_PRELOAD="$OUT/no_native/$(basename "$SO")" \
  "$PY" "$OUT/program.py" train > "$OUT/fallback.txt" 2>&1
RC=$?
n=$(grep -c "vramledger: no libvramledger_native.so beside the shim" "$OUT/fallback.txt")
[ "$RC" = 0 ] && [ "$n" = 1 ] && r=OK || r=FAIL
check $r "one warning line (exit status $RC): $(grep -m1 'vramledger: no libvramledger_native' "$OUT/fallback.txt" | cut -c1-160)"
b=$(field "$OUT/fallback.txt" backend)
[ "$b" = cudaMallocAsync ] && r=OK || r=FAIL; check $r "torch's backend on the fallback: '$b'"
served=$(sed -n 's/^served: allocations \([0-9]*\).*/\1/p' "$OUT/fallback.txt" | head -1)
[ "${served:-0}" -gt 0 ] 2>/dev/null && r=OK || r=FAIL
check $r "the interposition served ${served:-no} allocations"
echo "preload_direct_check: $fails failure(s)"
[ "$fails" = 0 ]
