"""Probe: does a record_stream'd block stay unavailable while the side stream is busy?

Prints the side stream's state (query()) and elapsed time at the moment of the next allocation,
the addresses, and vramledger's active/allocated bytes, so a reuse can be told apart from a side
stream that already finished.
"""
import time

import vramledger

vramledger.install()
import torch  # noqa: E402

MiB = 1 << 20
side = torch.cuda.Stream()
x = torch.ones(16 * MiB, device="cuda")
torch.cuda.synchronize()
ptr = x.data_ptr()
t0 = time.perf_counter()
with torch.cuda.stream(side):
    torch.cuda._sleep(int(4e9))
    x.mul_(2)
x.record_stream(side)
del x
s = vramledger.memory_stats()
print("pending bytes", s["active_bytes.all.current"] - s["allocated_bytes.all.current"])
busy = not side.query()
y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
print(f"side busy before y: {busy}; after {time.perf_counter() - t0:.3f} s; y reused x: {y.data_ptr() == ptr}")
side.synchronize()
print(f"side done after {time.perf_counter() - t0:.3f} s")
