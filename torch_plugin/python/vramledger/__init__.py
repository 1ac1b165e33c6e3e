"""vramledger: a CUDA caching allocator for PyTorch that keeps the books on every byte.

Swap it in once, first thing in the process, before any CUDA tensor or torch.cuda call:

    import vramledger
    vramledger.install(max_split_size_mb=200)   # torch's PYTORCH_CUDA_ALLOC_CONF keys
    import torch
    x = torch.empty(1 << 20, device="cuda")    # served by vramledger
    print(vramledger.max_memory_allocated())

By default vramledger becomes torch's own CUDA allocator, so torch.cuda.memory_stats(), MemPool,
CUDA graph trees and CUDA IPC all reach it; on the pluggable route (install(mode="pluggable"))
torch's own memory_stats() and friends raise, so this package offers them under the same names
and meanings either way. Importing it does not import torch and works without a GPU or a built
plugin; install() says what is missing.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

from vramledger import _options, _pluggable_limits, _plugin, _summary
from vramledger._snapshot import dump_snapshot, record_memory_history, snapshot
from vramledger._guard import phase, step, step_scope, tag  # budget guard
from vramledger import _guard
from vramledger import _fragmentation
from vramledger._fragmentation import contiguous_segments, fragmentation
from vramledger._regions import pause, region, regions, resume  # pausable regions
__version__ = "0.1.0"

__all__ = [
    "install",
    "is_installed",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
    "memory_stats_as_nested_dict",
    "attach_out_of_memory_observer",
    "empty_cache",
    "record_memory_history",
    "snapshot",
    "dump_snapshot",
    "tag",
    "phase",
    "step",
    "step_scope",
    "contiguous_segments",
    "fragmentation",
    "region",
    "pause",
    "resume",
    "regions",
]

_ENV_CONF = "VRAMLEDGER_CONF"

_lock = threading.Lock()
# (settings string from install()'s keywords, VRAMLEDGER_CONF at the time) once installed.
_installed: tuple[str, str] | None = None
_installed_mode: str | None = None  # "pluggable" or "native"
# Keeps the CUDAPluggableAllocator (and the ctypes functions it points at) alive.
_allocator: Any = None


def install(*, mode: str | None = None, patch_torch: bool | None = None, **options: Any) -> None:
    """Makes vramledger torch's CUDA allocator for this process.

    Args:
      mode: None (default): "native" when libvramledger_native.so was built against the running
        torch's minor version, else "pluggable" with one warning naming the two versions.
        "native": as torch's own CUDAAllocator, so every torch call that reaches its allocator
        (memory_stats, memory_summary, _snapshot, _record_memory_history, torch.cuda.MemPool,
        CUDA graph trees of torch.compile(mode="reduce-overhead"), CUDA IPC, allocator trace
        trackers) is served by vramledger (docs/design/torch-native-mode.md). "pluggable":
        through torch's CUDAPluggableAllocator (a C ABI stable across torch 2.x); torch routes
        only allocations, frees and CUDA graph pools there, and its calls that need more raise
        a RuntimeError that names mode="native".
      patch_torch: also make torch.cuda's memory_stats, memory_stats_as_nested_dict,
        memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved,
        reset_peak_memory_stats, reset_accumulated_memory_stats and memory_summary (and the same
        names in torch.cuda.memory) answer from vramledger's functions; torch's own raise
        RuntimeError with a pluggable allocator. Default: True for "pluggable", False for
        "native" (torch's own then work).
      **options: allocator options with torch's key names and meanings (max_split_size_mb=200,
        expandable_segments=False (the default is True: memory grows by pages that page
        recycling reuses; False gives torch's plain policy), roundup_power2_divisions=[1, 2, 4], ...) plus vramledger's
        own and the process settings (plan, dump_dir, ...): every key, its default and range
        in docs/options.md, generated from the C++ option table. Settings from the VRAMLEDGER_CONF environment variable (`key:value,...`)
        apply first; keywords win.

    A second call with the same options, mode (and environment) does nothing.

    Raises:
      ValueError: an unknown key or bad value, or a mode other than the two (the message names
        it).
      RuntimeError: the plugin library or torch is missing, or the plugin cannot load; CUDA is
        not available; CUDA is already initialised in this process (install() must come before
        the first CUDA tensor or torch.cuda call); vramledger is already installed with other
        options or another mode; for mode "native", libvramledger_native.so is missing or was
        built against another torch minor (the message names both versions).
    """
    global _installed, _allocator
    if mode not in (None, "pluggable", "native"):
        raise ValueError(
            f"vramledger.install(): mode must be None, 'pluggable' or 'native', got {mode!r}")
    try:
        conf = _options.to_conf_string(options)
    except ValueError as e:  # name the call, as install()'s other errors do
        raise ValueError(f"vramledger.install(): {e}") from e
    env = os.environ.get(_ENV_CONF, "")
    with _lock:
        if _installed is not None:
            if _installed == (conf, env) and mode in (None, _installed_mode):
                return
            raise RuntimeError(
                f"vramledger is already installed in this process (mode {_installed_mode!r}) "
                f"with options {_installed[0]!r} "
                f"({_ENV_CONF}={_installed[1]!r}); torch cannot swap its allocator twice, so "
                f"install() accepts only the same options and mode again (asked for {conf!r}, "
                f"{_ENV_CONF}={env!r}, mode {mode!r})")
        _plugin.load()  # RuntimeError if the plugin or torch is missing; imports torch
        _plugin.configure(conf)
        _guard.on_install(options, env)  # stack provider; the plan is checked early
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "vramledger.install(): CUDA is not available (torch.cuda.is_available() is "
                "False); vramledger allocates GPU memory and needs a CUDA device and driver")
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "vramledger.install(): CUDA is already initialised in this process, so torch's "
                "allocator can no longer be replaced. Call vramledger.install() before the first "
                "CUDA tensor or torch.cuda call (at the top of the program, before the model is "
                "moved to the GPU).")
        _plugin.set_oom_observer(_call_oom_observers)  # observers run before the throw
        from vramledger import _native

        if mode is None:
            mode = _native.default_mode()  # one warning when it falls back to "pluggable"
        if patch_torch is None:
            patch_torch = mode == "pluggable"
        if mode == "native":
            _native.install()
            _set_installed(conf, env, mode)
            if patch_torch:
                _patch_torch(torch)
            return
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _plugin.loaded_path(), "vramledger_malloc", "vramledger_free")
        hooks = allocator.allocator()
        hooks.set_init_fn(_plugin.hook_address("vramledger_init"))
        hooks.set_reset_fn(_plugin.hook_address("vramledger_reset"))
        hooks.set_memory_fraction_fn(_plugin.hook_address("vramledger_set_memory_fraction"))
        hooks.set_record_stream_fn(_plugin.hook_address("vramledger_record_stream"))
        # CUDA graph private pools (torch.cuda.graph, use_mem_pool).
        hooks.set_begin_allocate_to_pool(_plugin.hook_address("vramledger_begin_allocate_to_pool"))
        hooks.set_end_allocate_to_pool_fn(_plugin.hook_address("vramledger_end_allocate_to_pool"))
        hooks.set_release_pool(_plugin.hook_address("vramledger_release_pool"))
        torch.cuda.memory.change_current_allocator(allocator)
        _allocator = allocator
        _pluggable_limits.install(torch)  # its refusals name mode="native"
        _set_installed(conf, env, mode)
        if patch_torch:
            _patch_torch(torch)


def _set_installed(conf: str, env: str, mode: str) -> None:
    global _installed, _installed_mode
    _installed, _installed_mode = (conf, env), mode


def installed_mode() -> str | None:
    """"pluggable" or "native" once install() succeeded in this process, else None."""
    return _installed_mode if _installed is not None else None


# Names of torch.cuda (and torch.cuda.memory) functions that install(patch_torch=True) replaces,
# each by the vramledger function of the same name.
_TORCH_PATCHED = (
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
)
# The torch functions replaced by _patch_torch(), as (module, name) -> original.
_torch_originals: dict[tuple[str, str], Any] = {}


def _patch_torch(torch: Any) -> None:
    """Points torch.cuda.X and torch.cuda.memory.X at vramledger's X for every X in
    _TORCH_PATCHED, keeping the originals in _torch_originals."""
    namespace = globals()
    for module in (torch.cuda, torch.cuda.memory):
        for name in _TORCH_PATCHED:
            key = (module.__name__, name)
            if key not in _torch_originals:
                _torch_originals[key] = getattr(module, name, None)
            setattr(module, name, namespace[name])


def is_installed() -> bool:
    """True once install() succeeded in this process."""
    return _installed is not None


def _require_installed() -> None:
    if _installed is None:
        raise RuntimeError("vramledger is not installed in this process; call "
                           "vramledger.install() before the first CUDA tensor")


def _device_index(device: Any) -> int:
    """torch's device argument (None, int, "cuda:1", torch.device) as an index; None and a device
    without index mean the current device (0 while CUDA is not initialised)."""
    import torch

    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        device = device.index
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    if isinstance(device, bool) or not isinstance(device, int):
        raise ValueError(f"Expected a cuda device (None, int, str or torch.device), got {device!r}")
    if device < 0:  # the plugin reads -1 as "every device": never from a user's argument
        raise ValueError(f"Expected a cuda device index >= 0, got {device}")
    return device


def memory_stats(device: Any = None) -> "collections.OrderedDict[str, Any]":
    """torch.cuda.memory_stats() for vramledger: every key torch reports, with its meaning
    (bytes or counts, ints), plus "utilization" (float: peak allocated / peak reserved) and
    "largest_free_block_bytes"; sorted by key. Per-tag bytes: "tags.<name>.current" and
    "tags.<name>.peak" (requested bytes), "guard.refusals", "guard.warnings", "guard.limit_bytes".
    Fragmentation: "fragmentation.<field>" for the scalar figures of fragmentation()
    (holes, largest_free_block, free_space_fragmentation, wasted_bytes_at_peak, ...).
    Pausable regions: "regions.<name>.<figure>" for reserved_bytes, mapped_bytes,
    allocated_bytes, paused_bytes, backed_up_bytes, host_buffer_bytes, lost_bytes (bytes) and
    paused (0/1), as regions() gives them (docs/design/regions.md).

    Raises:
      RuntimeError: vramledger is not installed. ValueError: bad device.
    """
    _require_installed()
    index = _device_index(device)
    stats = _plugin.memory_stats(index)
    stats.update(_guard.tag_stats(index))  # "tags.<name>.current" / ".peak", "guard.*"
    stats.update(_fragmentation.fragmentation_stats(index))  # "fragmentation.*"
    return collections.OrderedDict(sorted(stats.items()))


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """memory_stats() nested at its dots, as torch.cuda.memory_stats_as_nested_dict():
    {"allocated_bytes": {"all": {"current": ...}, ...}, "num_ooms": ..., ...}.

    Raises:
      RuntimeError: vramledger is not installed. ValueError: bad device.
    """
    return _summary.nest(memory_stats(device))


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """torch.cuda.memory_summary() from vramledger's figures: the same 75-column table, byte for
    byte, with the large/small pool rows left out when `abbreviated`.

    Raises:
      RuntimeError: vramledger is not installed. ValueError: bad device.
    """
    index = _device_index(device)
    return _summary.format_summary(memory_stats(index), index, abbreviated)


def memory_allocated(device: Any = None) -> int:
    """Bytes currently held by tensors (rounded block sizes), as torch.cuda.memory_allocated."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    """Peak of memory_allocated() in bytes since the start or reset_peak_memory_stats()."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Any = None) -> int:
    """Bytes currently reserved from the driver (segments or mapped pages), cache included."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Any = None) -> int:
    """Peak of memory_reserved() in bytes since the start or reset_peak_memory_stats()."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    """Every peak statistic of `device` becomes its current value."""
    _require_installed()
    _plugin.reset_peak(_device_index(device))
    _guard.reset_tag_peaks(_device_index(device))  # tag peaks too


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """The totals ("allocated"/"freed") and event counters of `device` go back to 0."""
    _require_installed()
    _plugin.reset_accumulated(_device_index(device))


def empty_cache() -> None:
    """Returns every cached, fully free segment of every device to the driver (as
    torch.cuda.empty_cache(), which also reaches vramledger once installed)."""
    _require_installed()
    _plugin.empty_cache(-1)


# Callables given to attach_out_of_memory_observer(), in order; copied under _observers_lock (not
# _lock, which install() holds) and called outside it.
_observers_lock = threading.Lock()
_oom_observers: list[Any] = []


def attach_out_of_memory_observer(observer: Any) -> None:
    """Calls `observer(device, alloc_size, limit, device_free)` on every out-of-memory failure,
    before torch.OutOfMemoryError is raised, as torch.cuda.memory._attach_out_of_memory_observer
    does for its native allocator: `alloc_size` is the size that could not be obtained, `limit`
    the memory-fraction cap in bytes if one is set, else the device total, and `device_free` the
    device's free bytes. Observers run on the allocating thread; an exception in one is printed
    and the others still run. May be called before or after install().
    """
    if not callable(observer):
        raise TypeError(f"observer must be callable, got {observer!r}")
    with _observers_lock:
        _oom_observers.append(observer)


def _call_oom_observers(device: int, alloc_size: int, limit: int, device_free: int) -> None:
    """The plugin's observer (a ctypes trampoline): runs every attached observer in order."""
    import sys
    import traceback

    with _observers_lock:
        observers = list(_oom_observers)
    for observer in observers:
        try:
            observer(device, alloc_size, limit, device_free)
        except Exception:  # pylint: disable=broad-except  # one bad observer must not hide others
            print(f"vramledger: out-of-memory observer {observer!r} raised:", file=sys.stderr)
            traceback.print_exc()
