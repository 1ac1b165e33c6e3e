"""ctypes binding of libvramledger_plugin.so: finding, loading and typing its C ABI.

The ABI is documented in torch_plugin/pluggable/plugin.h (the allocator pair and hooks) and
torch_plugin/runtime/*_api.h, c_api.h (the rest). Nothing is loaded at import; load() imports torch
first, because the plugin resolves libc10.so and libcudart.so.13 from the torch already loaded.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from typing import Any

PLUGIN_NAME = "libvramledger_plugin.so"
# Overrides where the plugin is looked for (a path to the .so); used by in-tree runs.
PLUGIN_ENV = "VRAMLEDGER_PLUGIN"

_OK, _INVALID_ARGUMENT = 0, 1

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None

# vramledger_oom_observer_fn: (device, alloc size, limit, device free) -> void.
OOM_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                                ctypes.c_size_t)
# The registered trampoline; kept alive here because the plugin holds only its address.
_oom_trampoline: Any = None


def plugin_path() -> str:
    """Absolute path of the plugin library: $VRAMLEDGER_PLUGIN, else the one in this package.

    Raises:
      RuntimeError: the library does not exist (a build without the torch plugin).
    """
    override = os.environ.get(PLUGIN_ENV)
    path = override or os.path.join(os.path.dirname(os.path.abspath(__file__)), PLUGIN_NAME)
    if not os.path.isfile(path):
        if override:
            raise RuntimeError(f"vramledger: {PLUGIN_ENV}={override} does not exist")
        raise RuntimeError(
            f"vramledger: the torch plugin {PLUGIN_NAME} is not installed in "
            f"{os.path.dirname(path)}: this vramledger was built without it (no torch or no CUDA "
            f"toolkit at build time). Rebuild next to the torch you use with "
            f"`pip install --no-build-isolation .`, or point {PLUGIN_ENV} at a built plugin.")
    return os.path.abspath(path)


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_double = ctypes.c_int, ctypes.c_double
    c_char_p, c_void_p = ctypes.c_char_p, ctypes.c_void_p
    signatures = {
        "vramledger_last_error": ([], c_char_p),
        "vramledger_configure": ([c_char_p], c_int),
        "vramledger_option_names": ([], c_char_p),
        "vramledger_device_count": ([], c_int),
        # The string comes back as a c_void_p, not c_char_p, so that it can be released.
        "vramledger_memory_stats_json": ([c_int, ctypes.POINTER(c_void_p)], c_int),
        "vramledger_string_free": ([c_void_p], None),
        "vramledger_empty_cache": ([c_int], c_int),
        "vramledger_reset_peak": ([c_int], c_int),
        "vramledger_reset_accumulated": ([c_int], c_int),
        "vramledger_set_oom_observer": ([OOM_OBSERVER], c_int),
        # Hooks: torch calls them; declared so that their addresses can be taken.
        "vramledger_init": ([c_int], None),
        "vramledger_reset": ([], None),
        "vramledger_set_memory_fraction": ([c_double, c_int], None),
        "vramledger_record_stream": ([c_void_p, c_void_p], None),
        # C++ signatures (std::pair / std::function by value): only their addresses are used.
        "vramledger_begin_allocate_to_pool": (None, None),
        "vramledger_end_allocate_to_pool": (None, None),
        "vramledger_release_pool": (None, None),
        "vramledger_malloc": ([ctypes.c_size_t, c_int, c_void_p], c_void_p),
        "vramledger_free": ([c_void_p, ctypes.c_size_t, c_int, c_void_p], None),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def load() -> ctypes.CDLL:
    """Loads the plugin once (importing torch first) and returns it.

    Raises:
      RuntimeError: the library or torch is missing, or the library cannot be loaded (the
        message says why).
    """
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            return _lib
        path = plugin_path()
        try:
            import torch  # loads the libc10.so and libcudart.so.13 the plugin links
        except ImportError as e:
            raise RuntimeError(f"vramledger: the torch plugin needs torch, which cannot be "
                               f"imported: {e}") from e
        try:
            lib = ctypes.CDLL(path)
            _declare(lib)
        except (OSError, AttributeError) as e:
            raise RuntimeError(
                f"vramledger: cannot load the torch plugin {path}: {e}. It needs the libc10.so and "
                f"libcudart.so.13 of a CUDA build of torch {torch.__version__} (the one it was "
                f"built against) and the libabsl_*.so files installed beside it.") from e
        _lib, _lib_path = lib, path
        return lib


def loaded_path() -> str | None:
    """Path of the loaded plugin, or None before load()."""
    return _lib_path


def _check(rc: int) -> None:
    if rc == _OK:
        return
    message = (_lib.vramledger_last_error() or b"").decode(errors="replace")
    if rc == _INVALID_ARGUMENT:
        raise ValueError(message)
    raise RuntimeError(message)


def configure(conf: str) -> None:
    """Sets the options of allocators not created yet (VRAMLEDGER_CONF merged under `conf`).

    Raises:
      ValueError: unknown key or bad value (named in the message).
      RuntimeError: allocators already run with other options.
    """
    _check(load().vramledger_configure(conf.encode()))


def option_names() -> list[str]:
    """Every option key the C++ parser accepts, in its table's order."""
    return load().vramledger_option_names().decode().split(",")


def device_count() -> int:
    """CUDA devices the plugin sees. Raises RuntimeError when CUDA has none."""
    n = load().vramledger_device_count()
    if n < 0:
        _check(2)
    return n


def memory_stats(device: int) -> dict[str, Any]:
    """The statistics of `device` as a dict (keys of torch.cuda.memory_stats(), plus
    "utilization" and "largest_free_block_bytes"). Bytes and counts are ints.

    Raises:
      ValueError: bad device index. RuntimeError: CUDA unavailable.
    """
    lib = load()
    out = ctypes.c_void_p()
    _check(lib.vramledger_memory_stats_json(device, ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        lib.vramledger_string_free(out.value)


def empty_cache(device: int = -1) -> None:
    """Returns every fully free cached segment of `device` (-1: all) to the driver."""
    _check(load().vramledger_empty_cache(device))


def reset_peak(device: int = -1) -> None:
    """Peaks of `device` (-1: all) become their current values."""
    _check(load().vramledger_reset_peak(device))


def reset_accumulated(device: int = -1) -> None:
    """Totals and counters of `device` (-1: all) go back to 0."""
    _check(load().vramledger_reset_accumulated(device))


def hook_address(name: str) -> int:
    """Address of the exported function `name`, as torch's set_*_fn methods take it."""
    return ctypes.cast(getattr(load(), name), ctypes.c_void_p).value


def set_oom_observer(fn: Any) -> None:
    """Registers `fn(device, alloc_size, limit, device_free)` as the plugin's out-of-memory
    observer (None removes it); it runs on the allocating thread before the OOM is raised."""
    global _oom_trampoline
    trampoline = OOM_OBSERVER(fn) if fn is not None else OOM_OBSERVER()
    _check(load().vramledger_set_oom_observer(trampoline))
    _oom_trampoline = trampoline
