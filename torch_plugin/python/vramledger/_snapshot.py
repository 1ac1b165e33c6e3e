# Memory history and snapshots for the Python package: the user API (record_memory_history,
# snapshot, dump_snapshot) over the plugin's C ABI, and reading/writing snapshot files. Stateless.
"""Memory snapshots in torch 2.11's format: record, take, write and read them.

A snapshot is the dict ``torch.cuda.memory._snapshot()`` returns (``segments``,
``device_traces``, ``allocator_settings``, ``external_annotations``) plus vramledger's key
``vramledger``, which torch's viewers ignore. Files are a pickle (protocol 4, plain dicts, lists, tuples, ints, floats, strings
and booleans only, as torch writes them) or JSON when the name ends in ``.json``; either may be
gzip-compressed (``.gz``). Writes go to a temporary file that is renamed, so a crash never leaves
half a file.
"""

from __future__ import annotations

import ctypes
import errno
import gzip
import io
import json
import os
import pickle
import secrets
import stat
import sys
import zlib
from typing import Any

__all__ = ["record_memory_history", "snapshot", "dump_snapshot", "load_snapshot",
           "write_snapshot", "SnapshotFormatError"]

PICKLE_PROTOCOL = 4
_JSON_SUFFIXES = (".json", ".json.gz")
_SEGMENT_KEYS = ("address", "total_size", "stream", "blocks")
_BLOCK_KEYS = ("size", "state")
# Keys that hold non-negative integers (bytes, addresses, stream ids, device indices) where present.
_SEGMENT_COUNTS = ("address", "total_size", "stream", "device", "allocated_size", "active_size",
                   "requested_size")
_BLOCK_COUNTS = ("address", "size", "requested_size")
_ENTRY_COUNTS = ("addr", "size", "stream", "device_free")


class SnapshotFormatError(ValueError):
    """A file that is not a readable memory snapshot; the message names the file and what was
    expected."""


class PlainUnpickler(pickle.Unpickler):
    """Loads plain values only; refuses every class, so a crafted file cannot run code. The one
    snapshot unpickler of the package (load_snapshot, and replay's reading of a pickle)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a memory snapshot holds plain values only")


# ---- The plugin's history and snapshot functions (torch_plugin/runtime/history_api.h) ----

_declared: Any = None  # the plugin library whose history functions have their ctypes types


def _lib():
    global _declared
    from vramledger import _plugin

    lib = _plugin.load()
    if _declared is not lib:
        c_int, c_char_p, c_void_p = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p
        lib.vramledger_record_memory_history.argtypes = [c_char_p, c_char_p, c_char_p,
                                                         ctypes.c_ulonglong, c_int]
        lib.vramledger_record_memory_history.restype = c_int
        lib.vramledger_snapshot_json.argtypes = [ctypes.POINTER(c_void_p)]
        lib.vramledger_snapshot_json.restype = c_int
        lib.vramledger_dump_snapshot_json.argtypes = [c_char_p]
        lib.vramledger_dump_snapshot_json.restype = c_int
        _declared = lib
    return lib


def _check(rc: int) -> None:
    from vramledger import _plugin

    _plugin._check(rc)


def _opt(value: str | None) -> bytes | None:
    if value is None:
        return None
    if "\0" in str(value):  # ctypes would cut the value there
        raise ValueError(f"record_memory_history: {value!r} holds a NUL byte")
    return str(value).encode()


def record_memory_history(enabled: str | None = "all", context: str | None = "all",
                          stacks: str = "python", max_entries: int = sys.maxsize,
                          device: Any = None, clear_history: bool = False) -> None:
    """Starts, changes or stops recording, with torch's _record_memory_history meanings.

    Args:
      enabled: None (stop and clear), "state" (stacks of live blocks, no trace) or "all"
        (also a trace of the last `max_entries` events per device).
      context: None, "state" (stacks for live blocks only), "alloc" (also on alloc events) or
        "all" (also on free events).
      stacks: "python" (Python frames of the allocating thread) or "all" (also native frames,
        symbolised when a snapshot is taken).
      max_entries: trace entries kept per device (the most recent ones); at least 1.
      device: accepted for torch compatibility; recording covers every device.
      clear_history: drop the entries recorded so far.

    Works before or after install(); allocators created later record too.

    Raises:
      ValueError: an unknown value (named in the message).
      RuntimeError: the plugin cannot be loaded.
    """
    del device  # one history for the process, as torch's global recording
    if isinstance(enabled, bool):  # torch's legacy form: True -> "all", False -> None
        enabled = "all" if enabled else None
    if max_entries < 1:
        raise ValueError(
            f"record_memory_history: max_entries must be at least 1 (got {max_entries})")
    lib = _lib()
    _check(lib.vramledger_record_memory_history(_opt(enabled), _opt(context), _opt(stacks),
                                                min(int(max_entries), 2**64 - 1),
                                                int(bool(clear_history))))


def snapshot() -> dict:
    """The current snapshot: every device's segments and blocks (with the stacks that allocated
    them), the recorded trace per device, allocator_settings, and vramledger's figures. Appends
    a `snapshot` entry to each device's trace, as torch does.

    Raises:
      RuntimeError: the plugin cannot be loaded or the snapshot fails.
    """
    lib = _lib()
    out = ctypes.c_void_p()
    _check(lib.vramledger_snapshot_json(ctypes.byref(out)))
    try:
        text = ctypes.string_at(out.value)
    finally:
        lib.vramledger_string_free(out.value)
    return normalize(json.loads(text))


def dump_snapshot(filename: str = "dump_snapshot.pickle") -> str:
    """Writes snapshot() to `filename`: JSON (streamed by the C++ side) when the name ends in
    .json, else a pickle (protocol 4) as torch's _dump_snapshot writes; ``.gz`` compresses.
    Returns the path. The file appears whole or not at all (temporary file + rename).

    Raises:
      OSError: the file cannot be written. RuntimeError: the plugin fails.
    """
    path = os.fspath(filename)
    if "\0" in path:  # ctypes would cut the name there and write another file
        raise ValueError(f"dump_snapshot: {path!r}: a file name cannot hold a NUL byte")
    if not path or path.endswith(os.sep):
        raise ValueError(f"dump_snapshot: {path!r}: give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):  # the JSON writer (C++) would say only "cannot open"
        raise FileNotFoundError(errno.ENOENT, "no such directory", parent)
    if path.lower().endswith(".json"):  # suffixes in any case, as the readers take them
        _check(_lib().vramledger_dump_snapshot_json(path.encode()))
        return path
    write_snapshot(snapshot(), path)
    return path


# ---- Files ----

def normalize(snap: Any) -> Any:
    """Restores what JSON cannot carry (segment_pool_id as a tuple, as torch has it); in place."""
    if isinstance(snap, dict):
        for seg in snap.get("segments", ()) or ():
            if isinstance(seg, dict) and isinstance(seg.get("segment_pool_id"), list):
                seg["segment_pool_id"] = tuple(seg["segment_pool_id"])
    return snap


def _plain(value: Any, where: str) -> None:
    """Raises TypeError naming the first value that is not a plain type."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if type(k) is not str:
                    raise TypeError(f"{at}: key {k!r} is not a string")
                stack.append((item, f"{at}[{k!r}]"))
        elif isinstance(v, (list, tuple)):
            if type(v) not in (list, tuple):
                raise TypeError(f"{at}: {type(v).__name__} is not a plain list or tuple")
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
        elif v is not None and type(v) not in (int, float, str, bool):
            raise TypeError(f"{at}: {type(v).__name__} is not a plain value")


def _encode(snap: dict, path: str) -> bytes:
    if path.lower().endswith(_JSON_SUFFIXES):
        data = json.dumps(snap, separators=(",", ":")).encode()
    else:
        _plain(snap, "snapshot")
        data = pickle.dumps(snap, protocol=PICKLE_PROTOCOL)
    if path.lower().endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    return data


def write_snapshot(snap: dict, path: str) -> str:
    """Writes `snap` to `path` (pickle protocol 4, or JSON for .json; .gz compresses) through a
    temporary file in the same directory and os.replace. Returns `path`.

    Raises:
      TypeError: the dict holds a value that is not a plain type (named).
      OSError: the file cannot be written.
    """
    path = os.fspath(path)
    write_atomically(_encode(snap, path), path)
    return path


def write_atomically(data: bytes, path: str) -> None:
    """Writes `data` to `path` whole or not at all: a temporary file beside it, then os.replace.
    A symbolic link is written through (its target is replaced), and a path that is not a regular
    file (/dev/null, a FIFO) is written directly: replacing it would put a regular file where a
    device node was (as root, /dev/null itself).

    Raises:
      OSError: the file cannot be written. ValueError: a NUL byte in `path`.
    """
    if "\0" in path:
        raise ValueError(f"{path!r}: a file name cannot hold a NUL byte")
    try:
        mode = os.stat(path).st_mode  # follows links: /dev/stdout of a pipe is a pipe
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        with open(path, "wb") as f:  # the path as given: /proc/self/fd links open so
            f.write(data)
        return
    path = os.path.realpath(path) if os.path.islink(path) else path
    temp = f"{os.path.abspath(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    # 0o666 less the umask, like any new file (mkstemp would make it private).
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _fail(path: str, what: str) -> SnapshotFormatError:
    return SnapshotFormatError(
        f"{path}: {what}; expected a memory snapshot: a pickle (protocol 2-4) or JSON of the dict "
        f"torch.cuda.memory._snapshot() returns (keys 'segments', 'device_traces'), optionally "
        f"gzip-compressed")


def load_snapshot(path: str) -> dict:
    """Reads a snapshot written by vramledger or by torch (_dump_snapshot), pickle or JSON, plain
    or gzip (detected from the content). A bare list of segments (torch's legacy form) becomes
    {'segments': list, 'device_traces': []}. Classes are never unpickled.

    Raises:
      SnapshotFormatError (a ValueError): truncated, corrupt or foreign content; the message
        names the file and what was expected.
      OSError: the file cannot be read.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise _fail(path, f"corrupt or truncated gzip data ({e})") from e
    if not raw:
        raise _fail(path, "the file is empty")
    if raw[:1] == b"\x80":
        if raw[1:2] and raw[1] > 4:
            raise _fail(path, f"pickle protocol {raw[1]} (torch's viewer reads 2-4 only)")
        try:
            data = PlainUnpickler(io.BytesIO(raw)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
                AttributeError, KeyError, MemoryError, OverflowError, RecursionError) as e:
            raise _fail(path, f"truncated or corrupt pickle ({type(e).__name__}: {e})") from e
    elif raw.lstrip()[:1] in (b"{", b"["):
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise _fail(path, f"truncated or invalid JSON ({e})") from e
    else:
        raise _fail(path, f"unrecognised content (starts with {raw[:8]!r})")
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    validate(data, path)
    return normalize(data)


def _at(where: str, key: str) -> str:
    """Names d[key] in a message: "segments[0]: 'size'", or "'key'" at the top level."""
    return f"{where}: {key!r}" if where else repr(key)


def _count(path: str, d: dict, key: str, where: str) -> None:
    """A non-negative integer (sizes, addresses, streams, devices) at d[key], where present."""
    value = d.get(key, 0)
    if type(value) is not int or value < 0:  # bool is no count; NaN and 1e400 are floats
        raise _fail(path, f"{_at(where, key)} must be a non-negative integer, got {value!r:.60}")


def _list(path: str, d: dict, key: str, where: str) -> list:
    value = d.get(key, [])
    if not isinstance(value, list):
        raise _fail(path, f"{_at(where, key)} must be a list, got {value!r:.60}")
    return value


def _dict(path: str, d: dict, key: str, where: str) -> dict:
    value = d.get(key, {})
    if not isinstance(value, dict):
        raise _fail(path, f"{_at(where, key)} must be a dict, got {value!r:.60}")
    return value


def _frames(path: str, d: dict, where: str) -> None:
    """d['frames'], where present: a list of dicts whose 'line' is an integer."""
    for k, frame in enumerate(_list(path, d, "frames", where)):
        if not isinstance(frame, dict):
            raise _fail(path, f"{where}.frames[{k}] must be a dict, got {frame!r:.60}")
        if type(frame.get("line", 0)) is not int:
            raise _fail(path, f"{where}.frames[{k}]: 'line' must be an integer, "
                              f"got {frame['line']!r:.60}")


def validate(data: Any, path: str = "<snapshot>") -> None:
    """Checks the keys every reader relies on and their types (sizes and addresses are
    non-negative integers, blocks and frames lists); raises SnapshotFormatError naming the first
    segment, block, trace entry or key that is wrong."""
    if not isinstance(data, dict):
        raise _fail(path, f"the top level is a {type(data).__name__}, not a dict")
    segments = data.get("segments")
    if not isinstance(segments, list):
        raise _fail(path, "no 'segments' list")
    traces = data.setdefault("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise _fail(path, "'device_traces' is not a list of lists")
    _dict(path, data, "allocator_settings", "")
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise _fail(path, f"{where} is not a dict")
        for key in _SEGMENT_KEYS:
            if key not in seg:
                raise _fail(path, f"{where} has no {key!r}")
        for key in _SEGMENT_COUNTS:
            _count(path, seg, key, where)
        _frames(path, seg, where)
        for j, block in enumerate(_list(path, seg, "blocks", where)):
            at = f"{where}.blocks[{j}]"
            if not isinstance(block, dict) or any(k not in block for k in _BLOCK_KEYS):
                raise _fail(path, f"{at} lacks 'size' or 'state'")
            for key in _BLOCK_COUNTS:
                _count(path, block, key, at)
            _frames(path, block, at)
    for d, entries in enumerate(traces):
        for i, e in enumerate(entries):
            where = f"device_traces[{d}][{i}]"
            if not isinstance(e, dict) or "action" not in e:
                raise _fail(path, f"{where} has no 'action'")
            for key in _ENTRY_COUNTS:
                _count(path, e, key, where)
            _frames(path, e, where)
    extra = data.get("vramledger")
    if isinstance(extra, dict):  # vramledger's own figures (inspect shows its peaks)
        _dict(path, extra, "history", "vramledger")
        for k, dev in enumerate(_list(path, extra, "devices", "vramledger")):
            where = f"vramledger.devices[{k}]"
            if not isinstance(dev, dict):
                raise _fail(path, f"{where} must be a dict, got {dev!r:.60}")
            for name, value in _dict(path, dev, "stats", where).items():
                if type(value) not in (int, float):
                    raise _fail(path, f"{where}.stats: {name!r} must be a number, "
                                      f"got {value!r:.60}")
