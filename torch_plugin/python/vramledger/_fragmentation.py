# Expandable segments' figures for the Python package: the contiguous_segments() scope and the
# fragmentation figures, over the runtime's C ABI (torch_plugin/runtime/c_api.h). The scope's
# depth is per OS thread, in the plugin; this module keeps no state besides the ctypes
# declarations.
"""Per-allocation opt-out of expandable segments, and fragmentation figures.

``with vramledger.contiguous_segments():`` makes the allocations of the calling thread come from
plain segments, each backed by one physical allocation (cudaMalloc), even with
``expandable_segments:True``: for buffers registered with RDMA or shared with NCCL, which need
one handle for the whole range. ``vramledger.fragmentation()`` reports how the reserved memory is
used: holes, the largest free block, wasted bytes, other streams' cache and the driver calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
from typing import Any, Iterator

__all__ = ["contiguous_segments", "fragmentation", "fragmentation_stats"]

# Fragmentation fields that memory_stats() carries as "fragmentation.<field>".
STATS_FIELDS = (
    "utilization",
    "wasted_bytes",
    "wasted_bytes_at_peak",
    "free_bytes",
    "largest_free_block",
    "free_space_fragmentation",
    "holes",
    "mapped_free_pages",
    "other_stream_cached_bytes",
    "page_moves",
    "retiring_bytes",
    "reused_old_mappings",
    "driver_calls_total",
    "driver_time_us_total",
)

_declared: Any = None  # the plugin library whose fragmentation functions have their ctypes types


def _lib() -> ctypes.CDLL:
    global _declared
    from vramledger import _plugin

    lib = _plugin.load()
    if _declared is not lib:
        c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
        lib.vramledger_fragmentation_json.argtypes = [c_int, c_void_p, ctypes.POINTER(c_void_p)]
        lib.vramledger_fragmentation_json.restype = c_int
        for name in ("vramledger_contiguous_segments_enter", "vramledger_contiguous_segments_exit",
                     "vramledger_contiguous_segments_depth"):
            getattr(lib, name).argtypes = []
            getattr(lib, name).restype = c_int
        _declared = lib
    return lib


def _require_installed(what: str) -> None:
    import vramledger

    if not vramledger.is_installed():
        raise RuntimeError(
            f"vramledger.{what}: vramledger is not installed in this process, so torch's own "
            f"allocator serves CUDA tensors and this has no effect; call vramledger.install() "
            f"before the first CUDA tensor")


@contextlib.contextmanager
def contiguous_segments() -> Iterator[None]:
    """Context manager: allocations made by this thread inside it come from plain segments
    backed by a single physical allocation (one handle), even with expandable_segments:True.

    Use it for buffers that must be one driver allocation (RDMA registration, NCCL sharing).
    Scopes nest; each thread has its own (an allocation made on another thread, e.g. by
    torch's autograd workers during backward, is not covered). The scope is left on exit,
    exceptions included. Without expandable segments every segment is already contiguous, so
    the scope changes nothing. The scope belongs to the thread that entered it: do not hold it
    across a generator's `yield` or an `await` that may resume elsewhere (asyncio tasks sharing
    a thread share its scope too).

    Raises:
      RuntimeError: vramledger is not installed, or the plugin cannot be loaded; the scope is
        left on another thread than the one that entered it (the entering thread's scope then
        stays open until that thread leaves it).
    """
    import threading

    _require_installed("contiguous_segments()")
    lib = _lib()
    from vramledger import _plugin

    owner = threading.get_ident()
    _plugin._check(lib.vramledger_contiguous_segments_enter())
    try:
        yield
    finally:
        if threading.get_ident() != owner:
            raise RuntimeError(
                "vramledger.contiguous_segments(): left on another thread than the one that entered "
                f"it (entered on thread {owner}, left on {threading.get_ident()}); the entering "
                "thread's scope stays open. Enter and leave the scope on the same thread.")
        _plugin._check(lib.vramledger_contiguous_segments_exit())


def contiguous_depth() -> int:
    """Number of contiguous_segments() scopes open on the calling thread."""
    return _lib().vramledger_contiguous_segments_depth()


def _current_stream(index: int) -> int:
    """torch.cuda.current_stream(index) as an integer handle when torch CUDA is available (and
    initialised, so the question creates no context), else 0, the default stream."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream(index).cuda_stream)
    except (RuntimeError, AssertionError):
        pass
    return 0


def _stream_handle(stream: Any) -> int:
    """A stream argument as the integer handle the C ABI takes: a torch.cuda.Stream (its
    cuda_stream) or an int in [0, 2**64). ValueError for anything else (bools, floats, negative
    or too large ints), naming the value."""
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < 2**64:
        raise ValueError(f"fragmentation(stream=...): expected a torch.cuda.Stream or a stream "
                         f"handle (an int in [0, 2**64)), got {stream!r}")
    return handle


def fragmentation(device: Any = None, *, stream: int | None = None) -> dict[str, Any]:
    """The fragmentation figures of `device` (None: the current device) as a dict.

    Keys (sizes in bytes, ints; ratios floats):
      utilization: peak allocated / peak reserved (1.0 before anything is reserved).
      wasted_bytes / wasted_bytes_at_peak: reserved - allocated, now and at the peaks.
      free_bytes: reserved - active, the cache. largest_free_block: the largest request served
        without growing. free_space_fragmentation: 1 - largest_free_block / free_bytes.
      holes: free blocks between live ones. mapped_free_pages: the pages of the physical handles
        that lie wholly inside free blocks (expandable segments). page_moves: pages recycled.
        retiring_bytes: recycled pages still mapped at the address they left until the stream's earlier work there has
        finished (counted once in reserved), or kept there (keep_old_mappings).
      reused_old_mappings: page moves back onto an address that still mapped the handle (no
        driver call; keep_old_mappings).
      other_stream_cached_bytes: free bytes cached for streams other than `stream`.
      driver_calls: {CUDA call name: {"count", "time_us"}} for every call kind, with
        driver_calls_total, driver_time_us_total and driver_time ("measured" on CUDA,
        "modelled" on the simulator).
      host_time: {"malloc": {"count", "time_us"}, "free": {"count", "time_us"}}: calls to the
        allocator and the host time spent in them (lock wait and driver calls included),
        cumulative; what vramledger can add to a host-bound step.
      regions: one dict per pausable region of the device, as vramledger.regions() gives it
        (name, paused, reserved_bytes, mapped_bytes, allocated_bytes, paused_bytes,
        backed_up_bytes, host_buffer_bytes, lost_bytes; docs/design/regions.md).
      device, current_stream.

    Args:
      device: None, an index, "cuda:N" or a torch.device.
      stream: the stream whose cache is not "other"; by default torch.cuda.current_stream(device)
        when torch CUDA is available, else the default stream 0. An int handle
        (torch.cuda.Stream.cuda_stream) or a torch.cuda.Stream.

    Raises:
      RuntimeError: vramledger is not installed, or the plugin fails. ValueError: bad device or
        stream (checked first).
    """
    import vramledger
    from vramledger import _plugin

    handle = None if stream is None else _stream_handle(stream)
    _require_installed("fragmentation()")
    index = vramledger._device_index(device)
    stream = _current_stream(index) if handle is None else handle
    lib = _lib()
    out = ctypes.c_void_p()
    _plugin._check(lib.vramledger_fragmentation_json(index, stream or None, ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        lib.vramledger_string_free(out.value)


def fragmentation_stats(index: int) -> dict[str, Any]:
    """The figures memory_stats() adds, as "fragmentation.<field>" for each of STATS_FIELDS
    (current stream as fragmentation() chooses it)."""
    f = fragmentation(index)
    return {f"fragmentation.{key}": f[key] for key in STATS_FIELDS}
