"""The budget guard from Python: tags, the phase, steps, per-tag stats, plan checks.

Tags and the phase are plain ids in the plugin (torch_plugin/runtime/guard_api.h): `tag()` sets
the calling thread's tag, `phase()` the process-wide one used by threads without their own tag (autograd's).
Without the plugin library (a build without CUDA or torch) tags and steps do nothing, so code that
uses them still runs. Refusal reports call back into `_python_stack` for the Python frames.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import sysconfig
import threading
from typing import Any, Iterator

from vramledger import _plugin

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_unavailable = False  # the plugin library is missing: tags and steps are no-ops
_tag_ids: dict[str, int] = {}

_STACK_FN = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)
_MAX_USER_FRAMES = 24


def _is_library_frame(filename: str) -> bool:
    """Frames of torch, this package and the standard library (not site-packages, which holds
    model code such as transformers)."""
    if filename.startswith("<frozen"):
        return True
    path = os.path.abspath(filename)
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(torch.__file__)))
    if any(path.startswith(d + os.sep) for d in dirs):
        return True
    paths = sysconfig.get_paths()
    site = [os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib") if paths.get(k)]
    std = [os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)]
    return any(path.startswith(d) for d in std) and not any(path.startswith(d) for d in site)


def _clean(text: str) -> str:
    return text.replace("\t", " ").replace("\n", " ")


def _format_stack() -> str:
    """The calling thread's Python frames for a refusal report, innermost first: user frames
    (not torch, vramledger or the standard library), then a note on what was left out. A thread
    without Python frames (autograd's) reports the main thread's frames, with a note."""
    frames = []
    try:
        frame = sys._getframe(2)  # skip _format_stack and the ctypes callback
    except ValueError:  # nothing below the callback: a thread that runs no Python
        frame = None
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    lines = []
    if not frames:
        main = sys._current_frames().get(threading.main_thread().ident)
        lines.append("N\t(frames of the main thread: the request came from a thread without "
                     "Python frames, such as autograd's)")
        while main is not None:
            frames.append((main.f_code.co_filename, main.f_lineno, main.f_code.co_name))
            main = main.f_back
    user = [f for f in frames if not _is_library_frame(f[0])]
    shown = user[:_MAX_USER_FRAMES] if user else frames[:_MAX_USER_FRAMES]
    for filename, line, name in shown:
        lines.append(f"F\t{_clean(filename)}\t{line}\t{_clean(name)}")
    left_out = len(frames) - len(shown)
    if left_out > 0:
        lines.append(f"N\t(+{left_out} torch, vramledger and standard-library frames left out)"
                     if user else f"N\t(+{left_out} outer frames left out)")
    return "\n".join(lines) + "\n"


def _python_stack(buf: int, capacity: int) -> int:
    try:
        data = _format_stack().encode("utf-8", "replace")[:capacity]
        ctypes.memmove(buf, data, len(data))
        return len(data)
    except BaseException:  # noqa: BLE001 - a report must never raise into the allocator
        return 0


_stack_callback = _STACK_FN(_python_stack)  # kept alive for the process


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_uint, c_void_p = ctypes.c_int, ctypes.c_uint, ctypes.c_void_p
    signatures = {
        "vramledger_tag_id": ([ctypes.c_char_p, ctypes.POINTER(c_uint)], c_int),
        "vramledger_set_thread_tag": ([c_uint], c_uint),
        "vramledger_set_phase": ([c_uint], c_uint),
        "vramledger_tag_stats_json": ([c_int, ctypes.POINTER(c_void_p)], c_int),
        "vramledger_reset_tag_peaks": ([c_int], c_int),
        "vramledger_step": ([ctypes.POINTER(c_void_p)], c_int),
        "vramledger_plan_check": ([ctypes.c_char_p, c_int, ctypes.c_ulonglong,
                                   ctypes.POINTER(c_void_p)], c_int),
        "vramledger_set_python_stack_fn": ([_STACK_FN], c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def library(required: bool = True) -> ctypes.CDLL | None:
    """The plugin with the guard functions declared and the Python stack provider set.

    Returns None when the library is missing and `required` is False.

    Raises:
      RuntimeError: the library is missing or cannot be loaded (and `required` is True).
    """
    global _lib, _unavailable
    with _lock:
        if _lib is not None:
            return _lib
        if _unavailable and not required:
            return None
        try:
            lib = _plugin.load()
        except RuntimeError:
            _unavailable = True
            if required:
                raise
            return None
        _declare(lib)
        lib.vramledger_set_python_stack_fn(_stack_callback)
        _lib = lib
        return lib


def _check(lib: ctypes.CDLL, rc: int) -> None:
    if rc == 0:
        return
    message = (lib.vramledger_last_error() or b"").decode(errors="replace")
    raise (ValueError if rc == 1 else RuntimeError)(message)


def _json_result(lib: ctypes.CDLL, call) -> Any:
    out = ctypes.c_void_p()
    _check(lib, call(ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out.value).decode()) if out.value else None
    finally:
        lib.vramledger_string_free(out.value)


def tag_id(name: str) -> int:
    """The id of tag `name` (interned on first use; "untagged" is 0), or 0 without the plugin.

    Raises:
      ValueError: an empty name or one over 64 bytes. RuntimeError: 1024 tags exist already.
    """
    if not isinstance(name, str):
        raise ValueError(f"a tag name must be a str, got {name!r}")
    if "\0" in name:  # ctypes would cut the name there
        raise ValueError(f"a tag name cannot hold a NUL byte, got {name!r}")
    if name in _tag_ids:
        return _tag_ids[name]
    lib = library(required=False)
    if lib is None:
        return 0
    out = ctypes.c_uint()
    _check(lib, lib.vramledger_tag_id(name.encode(), ctypes.byref(out)))
    _tag_ids[name] = out.value
    return out.value


@contextlib.contextmanager
def tag(name: str) -> Iterator[None]:
    """Attributes allocations made by this thread inside the block to `name` (nests; restores
    the previous tag on exit)."""
    tid = tag_id(name)
    lib = library(required=False)
    if lib is None:
        yield
        return
    previous = lib.vramledger_set_thread_tag(tid)
    try:
        yield
    finally:
        lib.vramledger_set_thread_tag(previous)


class _Phase:
    """Returned by phase(): the phase is already set; as a context manager it restores the
    previous phase on exit."""

    def __init__(self, previous: int | None):
        self._previous = previous

    def __enter__(self) -> "_Phase":
        return self

    def __exit__(self, *exc: Any) -> None:
        lib = library(required=False)
        if lib is not None and self._previous is not None:
            lib.vramledger_set_phase(self._previous)


def phase(name: str | None) -> _Phase:
    """Sets the process-wide phase (the tag of allocations on threads without their own tag,
    autograd's included); None clears it. Usable as a plain call or a context manager."""
    tid = 0 if name is None else tag_id(name)
    lib = library(required=False)
    if lib is None:
        return _Phase(None)
    return _Phase(lib.vramledger_set_phase(tid))


def step() -> list[dict[str, Any]]:
    """Ends the training step on every device: returns one record per device (step index, peak
    allocated / reserved bytes of the step, per-tag peaks) and appends them to the step log when
    the step_log option is set. [] without the plugin.

    Raises:
      RuntimeError: the step log cannot be written.
    """
    lib = library(required=False)
    if lib is None:
        return []
    return _json_result(lib, lambda out: lib.vramledger_step(out)) or []


@contextlib.contextmanager
def step_scope() -> Iterator[None]:
    """Runs the block as one training step: step() is called when it exits (also on error)."""
    try:
        yield
    finally:
        step()


def tag_stats(device: int) -> dict[str, int]:
    """{"tags.<name>.current": bytes, "tags.<name>.peak": bytes, "guard.refusals": n, ...} for
    `device` ({} without the plugin or before the device allocated)."""
    lib = library(required=False)
    if lib is None:
        return {}
    return _json_result(lib, lambda out: lib.vramledger_tag_stats_json(device, out)) or {}


def reset_tag_peaks(device: int = -1) -> None:
    """Tag peaks of `device` (-1: all) become their current values."""
    lib = library(required=False)
    if lib is not None:
        _check(lib, lib.vramledger_reset_tag_peaks(device))


def check_plan(path: str, device_count: int = 0, card_bytes: int = 0) -> dict[str, Any]:
    """Loads the plan file `path` with the same C++ parser the allocator uses and returns its
    summary (see vramledger_plan_check in torch_plugin/runtime/plan_access.h). Device keys are
    checked against `device_count` when > 0; sizes against a card of `card_bytes` when > 0.

    Raises:
      ValueError: "<path>:<line>: field '<field>': ..." for a bad plan, or a directory.
      FileNotFoundError: no such file. RuntimeError: the file cannot be read, or the plugin
        library is missing.
    """
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory; the plan is a JSON file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: the vramledger plan file does not exist")
    lib = library(required=True)
    return _json_result(lib, lambda out: lib.vramledger_plan_check(
        os.fsencode(path), device_count, card_bytes, out))


def configured_plan(options: dict[str, Any], env_conf: str) -> str | None:
    """The plan path install() will use: the `plan` keyword, else `plan:` in VRAMLEDGER_CONF."""
    if options.get("plan"):
        return str(options["plan"])
    depth, item, items = 0, "", []
    for ch in env_conf:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    for entry in items:
        key, _, value = entry.strip().partition(":")
        if key.strip() == "plan" and value.strip():
            return value.strip()
    return None


def on_install(options: dict[str, Any], env_conf: str) -> None:
    """Called by install() before the allocator is swapped in: sets the stack provider and checks
    the configured plan early (syntax, fields, categories, device indices; the card's size is
    checked when the device is first used).

    Raises:
      ValueError: the plan is malformed (the message names the file, line and field).
      FileNotFoundError: the plan file does not exist.
    """
    library(required=True)
    path = configured_plan(options, env_conf)
    if path:
        import torch

        check_plan(path, device_count=torch.cuda.device_count())
