"""Pausable regions (docs/design/regions.md): `with vramledger.region(name):` sends the calling
thread's allocations to a region; pause() gives the region's GPU memory back (its virtual
addresses kept) and resume() maps it again at the same addresses.

The calls reach whichever runtime serves the process: the plugin's after vramledger.install()
(either mode), else the LD_PRELOAD shim's when the program runs under `vramledger run`
(its vramledger_preload_region_* entry points, which forward to the runtime that serves torch).
"""

from __future__ import annotations

import ctypes
import json
import threading
from typing import Any

__all__ = ["region", "pause", "resume", "regions"]

_OK, _INVALID_ARGUMENT, _FAILED, _OUT_OF_MEMORY = 0, 1, 2, 3
_BACKUPS = {"none": 0, "cpu": 1}  # vramledger_region_backup

_lock = threading.Lock()
_bound: dict[int, "_Calls"] = {}  # id(library) -> its typed calls


class _Calls:
    """The five region calls of one library, typed, with its last-error and string-free calls:
    the plugin's vramledger_region_* or the shim's vramledger_preload_region_*."""

    def __init__(self, lib: ctypes.CDLL, prefix: str, last_error: str, string_free: str) -> None:
        c_int, c_char_p, c_void_p = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p
        out = ctypes.POINTER(c_void_p)
        signatures = {
            "begin": ([c_int, c_char_p], c_int),
            "end": ([c_int, c_char_p], c_int),
            "pause": ([c_int, c_char_p, c_int, out], c_int),
            "resume": ([c_int, c_char_p, c_int, out], c_int),
            "list": ([c_int, out], c_int),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, f"{prefix}{name}")
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, name, fn)
        self.last_error = getattr(lib, last_error)
        self.last_error.argtypes, self.last_error.restype = [], c_char_p
        self.string_free = getattr(lib, string_free)
        self.string_free.argtypes, self.string_free.restype = [c_void_p], None

    def check(self, rc: int) -> None:
        """Raises for a failed call: ValueError, torch.OutOfMemoryError or RuntimeError, with the
        runtime's message (which names the region)."""
        if rc == _OK:
            return
        message = (self.last_error() or b"").decode(errors="replace")
        if rc == _INVALID_ARGUMENT:
            raise ValueError(message)
        if rc == _OUT_OF_MEMORY:
            import torch

            raise torch.OutOfMemoryError(message)
        raise RuntimeError(message)

    def json_call(self, fn: Any, *args: Any) -> Any:
        """Calls `fn(*args, &out)` and returns the JSON it wrote."""
        out = ctypes.c_void_p()
        self.check(fn(*args, ctypes.byref(out)))
        try:
            return json.loads(ctypes.string_at(out.value).decode())
        finally:
            self.string_free(out.value)


def _shim() -> ctypes.CDLL | None:
    """The process's global scope when the LD_PRELOAD shim with region calls is loaded."""
    scope = ctypes.CDLL(None)
    try:
        scope.vramledger_preload_region_begin  # noqa: B018  (a lookup: is it there?)
    except AttributeError:
        return None
    return scope


def _calls() -> _Calls:
    """The region calls of the runtime that serves this process.

    Raises:
      RuntimeError: neither vramledger.install() ran nor the shim is loaded.
    """
    import vramledger

    if vramledger.is_installed():
        from vramledger import _plugin

        lib, args = _plugin.load(), ("vramledger_region_", "vramledger_last_error",
                                     "vramledger_string_free")
    else:
        lib = _shim()
        if lib is None:
            raise RuntimeError(
                "vramledger is not serving this process: call vramledger.install() before the "
                "first CUDA tensor, or run the program under the shim (`vramledger run -- ...`)")
        args = ("vramledger_preload_region_", "vramledger_preload_last_error",
                "vramledger_preload_string_free")
    with _lock:
        calls = _bound.get(id(lib))
        if calls is None:
            calls = _bound[id(lib)] = _Calls(lib, *args)
        return calls


def _name(name: Any) -> bytes:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a region's name must be a non-empty str, got {name!r}")
    return name.encode()


def _device(device: Any) -> int:
    import vramledger

    return vramledger._device_index(device)  # pylint: disable=protected-access


class region:  # pylint: disable=invalid-name  # used as `with vramledger.region(name):`
    """`with vramledger.region("rollout"):` sends the calling thread's allocations on `device`
    (None: the current device) to region `name`, created on first use, until the block ends;
    CUDA graphs captured inside keep their private pools in the region, and `vramledger.tag`
    scopes inside it still set plan categories. Scopes nest (the innermost region takes the
    allocations); a tensor keeps its region after the block. Also usable as a decorator.

    torch runs backward() on its own device threads, whose allocations (gradients, backward's
    temporaries) a thread's scope would not see; so inside the block backward() runs on the
    calling thread (torch.autograd.set_multithreading_enabled(False)), unless
    `backward_on_this_thread` is False.

    Raises (on entry):
      ValueError: an empty name or a bad device.
      RuntimeError: vramledger does not serve this process, or the runtime refuses (the message
        names the region).
    """

    def __init__(self, name: str, device: Any = None, backward_on_this_thread: bool = True) -> None:
        self._name = _name(name)
        self._device_arg = device
        self._backward_here = backward_on_this_thread
        # Each thread's open entries of this object (one object may be entered on several
        # threads at once, as a decorator is), innermost last: its device and the autograd
        # threading it replaced. torch keeps that flag per thread (c10::AutogradState), so each
        # thread restores its own.
        self._local = threading.local()

    def _entered(self) -> list[tuple[int, bool | None]]:
        entered = getattr(self._local, "entered", None)
        if entered is None:
            entered = self._local.entered = []
        return entered

    def __enter__(self) -> "region":
        calls = _calls()
        device = _device(self._device_arg)
        calls.check(calls.begin(device, self._name))
        multithreaded = None
        if self._backward_here:
            import torch

            multithreaded = torch._C._is_multithreading_enabled()  # pylint: disable=protected-access
            torch._C._set_multithreading_enabled(False)  # pylint: disable=protected-access
        self._entered().append((device, multithreaded))
        return self

    def __exit__(self, *exc: Any) -> None:
        device, multithreaded = self._entered().pop()
        if multithreaded is not None:
            import torch

            torch._C._set_multithreading_enabled(multithreaded)  # pylint: disable=protected-access
        calls = _calls()
        calls.check(calls.end(device, self._name))

    def __call__(self, fn: Any) -> Any:
        import functools

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapped


def pause(name: str, backup: str = "none", device: Any = None) -> dict[str, Any]:
    """Gives the GPU memory of region `name` back to the driver, keeping its virtual addresses:
    waits for the work queued on the region's memory, copies its live blocks to pinned host
    memory when `backup` is "cpu" (with "none" their contents are lost), then unmaps and
    releases every physical page of the region. A tensor of a paused region must not be used
    until resume(); freeing one is allowed. Safe from any thread.

    Returns:
      {"released_bytes", "backed_up_bytes", "already_paused", "handles", "wait_seconds",
      "copy_seconds", "driver_seconds"}: bytes released to the driver and bytes copied to host
      memory; pausing a paused region is a no-op with already_paused True. The rest say where the
      time went: waiting for the region's queued work, the backup's copies, and unmapping and
      releasing `handles` physical handles.

    Raises:
      ValueError: `backup` is not "none" or "cpu", an empty name, a bad device.
      RuntimeError: no such region, a pause during a CUDA graph capture, or a pinned allocation
        or copy that failed (the region is then left as it was). The message names the region.
    """
    if backup not in _BACKUPS:
        raise ValueError(f"vramledger.pause(): backup must be 'none' or 'cpu', got {backup!r}")
    calls = _calls()
    r = calls.json_call(calls.pause, _device(device), _name(name), _BACKUPS[backup])
    return {key: r[key] for key in ("released_bytes", "backed_up_bytes", "already_paused",
                                     "handles", "wait_seconds", "copy_seconds", "driver_seconds")}


def resume(name: str, keep_host_buffers: bool = False, device: Any = None) -> dict[str, Any]:
    """Maps new pages under region `name` at the same addresses and restores its backups, so its
    tensors and the CUDA graphs that use them work again. The pinned host buffers are freed,
    unless `keep_host_buffers` keeps them for the next pause. Safe from any thread.

    Returns:
      {"mapped_bytes", "restored_bytes", "already_running", "handles", "driver_seconds",
      "copy_seconds"}; resuming a running region is a no-op with already_running True. The rest
      say where the time went: creating and mapping `handles` physical handles, and copying the
      backups back.

    Raises:
      torch.OutOfMemoryError: the card or the plan cannot hold the region (the message names
        the plan line or the shortfall); the region stays paused with its backups intact.
      RuntimeError: no such region, or another failure (the region stays paused).
      ValueError: an empty name, a bad device.
    """
    calls = _calls()
    r = calls.json_call(calls.resume, _device(device), _name(name), int(bool(keep_host_buffers)))
    return {key: r[key] for key in ("mapped_bytes", "restored_bytes", "already_running",
                                     "handles", "driver_seconds", "copy_seconds")}


def regions(device: Any = None) -> list[dict[str, Any]]:
    """The pausable regions of `device` (None: every device), one dict each: device, name, pool
    (its private pool's id), paused, and in bytes reserved_bytes (virtual bytes of its
    segments), mapped_bytes (physical bytes held now), allocated_bytes (live blocks),
    paused_bytes (released by the pause), backed_up_bytes (held in pinned host memory) and
    host_buffer_bytes (pinned bytes kept for the next pause), lost_bytes (pages a failed pause
    lost under live blocks, until the next pause and resume; 0 except after a double driver
    failure).

    Raises:
      RuntimeError: vramledger does not serve this process. ValueError: bad device.
    """
    calls = _calls()
    index = -1 if device is None else _device(device)
    return calls.json_call(calls.list, index)
