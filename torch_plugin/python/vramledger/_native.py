"""ctypes binding of libvramledger_native.so, the torch-native mode (docs/design/torch-native-mode.md).

The library sits beside the plugin it was built with (it links that plugin and serves through its
allocators) and is loaded after it, so both share one set of allocators.
"""

from __future__ import annotations

import ctypes
import os
import warnings

from vramledger import _plugin

NATIVE_NAME = "libvramledger_native.so"


def native_path() -> str:
    """Absolute path of the torch-native library: beside the loaded (or to-be-loaded) plugin.

    Raises:
      RuntimeError: the library does not exist (torch ships no libc10_cuda, or an older build).
    """
    plugin = _plugin.loaded_path() or _plugin.plugin_path()
    path = os.path.join(os.path.dirname(plugin), NATIVE_NAME)
    if not os.path.isfile(path):
        raise RuntimeError(
            f"vramledger: the torch-native mode's {NATIVE_NAME} is not beside the plugin "
            f"{plugin}: this build has no torch-native mode (torch without libc10_cuda?); use "
            f"install(mode='pluggable')")
    return path


def torch_version() -> str:
    """The running torch's "MAJOR.MINOR" (torch.__version__ without patch and local parts)."""
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def check_torch_version(built: str, running: str) -> None:
    """Raises RuntimeError naming both versions unless `built` == `running` ("MAJOR.MINOR"):
    torch's CUDAAllocator interface changes between minors, and a library built against another
    one would call the wrong virtual functions (docs/design/torch-facts.md §3)."""
    if built != running:
        raise RuntimeError(
            f"vramledger: {NATIVE_NAME} was built against torch {built}, but torch {running} is "
            f"running; the torch-native mode must be rebuilt against this torch "
            f"(`pip install --no-build-isolation .`)")


def _load(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise RuntimeError(f"vramledger: cannot load the torch-native library {path}: {e}") from e
    try:
        lib.vramledger_native_torch_version.argtypes = []
        lib.vramledger_native_torch_version.restype = ctypes.c_char_p
    except AttributeError as e:  # a build older than the version guard
        raise RuntimeError(f"vramledger: the torch-native library {path} does not say which torch "
                           f"it was built against ({e}); rebuild it") from e
    return lib


def unavailable_reason() -> str | None:
    """None when the torch-native mode can serve the running torch; else why not, one line
    (the library is absent or does not load, or was built against another torch minor: both
    versions named)."""
    try:
        lib = _load(native_path())
        check_torch_version(lib.vramledger_native_torch_version().decode(), torch_version())
    except RuntimeError as e:
        return str(e)
    return None


def default_mode() -> str:
    """install()'s mode when none is given: "native" when unavailable_reason() is None, else
    "pluggable", after one RuntimeWarning that gives the reason."""
    reason = unavailable_reason()
    if reason is None:
        return "native"
    warnings.warn(f"{reason}; vramledger.install() uses mode='pluggable' instead",
                  RuntimeWarning, stacklevel=3)
    return "pluggable"


def install() -> None:
    """Makes vramledger torch's own CUDA allocator (NativeAllocator), before CUDA starts.

    Pre: the plugin is loaded and configured (_plugin.load(), _plugin.configure()).

    Raises:
      RuntimeError: the library is missing or cannot be loaded, or torch's allocator is
        already initialized (the message says so).
    """
    lib = _load(native_path())
    check_torch_version(lib.vramledger_native_torch_version().decode(), torch_version())
    lib.vramledger_native_install.argtypes = []
    lib.vramledger_native_install.restype = ctypes.c_int
    lib.vramledger_native_last_error.argtypes = []
    lib.vramledger_native_last_error.restype = ctypes.c_char_p
    if lib.vramledger_native_install() != 0:
        message = (lib.vramledger_native_last_error() or b"").decode(errors="replace")
        raise RuntimeError(f"vramledger.install(mode='native'): {message}")
