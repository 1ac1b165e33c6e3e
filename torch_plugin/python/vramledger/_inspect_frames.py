# The shared vocabulary of snapshot analysis: pools, block states, which frames are user code, how
# a size and a frame print, which devices a snapshot covers. Pure functions.
"""Frames, sizes and devices of a memory snapshot, for the _inspect_* modules."""

from __future__ import annotations

import re

_POOLS = ("all", "large_pool", "small_pool")
_ACTIVE = ("active_allocated", "active_pending_free")
# Library frames: torch itself, the Python standard library, and vramledger.
_LIBRARY = re.compile(r"([/\\](site|dist)-packages[/\\](torch|vramledger)[/\\])"
                      r"|([/\\]lib[/\\]python3\.\d+[/\\](?!site-packages|dist-packages))"
                      r"|(^<frozen )")
NO_STACK = ("<no stack recorded>", 0, "")


def fmt_bytes(n: float) -> str:
    """torch's format_size: 'N bytes' below 1 KiB, else 'x.xx KiB/MiB/GiB/TiB'; 'n/a' for a
    figure that is not a finite number (a malformed snapshot's NaN or Infinity)."""
    if n != n or n in (float("inf"), float("-inf")):
        return "n/a"
    n = int(n)
    if abs(n) < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if abs(value) < 1024.0 or unit == "TiB":
            return f"{value:.2f} {unit}"
    return f"{value:.2f} TiB"


def is_python_frame(frame: dict) -> bool:
    filename = str(frame.get("filename", ""))
    return filename.endswith(".py") or (filename.startswith("<") and "frozen" not in filename)


def is_user_frame(frame: dict) -> bool:
    """A Python frame outside torch, vramledger and the standard library (model code, scripts,
    and third-party libraries such as transformers count as user code)."""
    return is_python_frame(frame) and not _LIBRARY.search(str(frame.get("filename", "")))


def innermost_user_frame(frames: list) -> tuple:
    """(filename, line, name) of the innermost user frame; else the innermost Python frame; else
    the innermost frame; NO_STACK when there are none. Frames are innermost first."""
    for test in (is_user_frame, is_python_frame, lambda f: True):
        for f in frames or ():
            if test(f):
                return (str(f.get("filename", "?")), int(f.get("line", 0)), str(f.get("name", "?")))
    return NO_STACK


def frame_text(frame: tuple) -> str:
    filename, line, name = frame
    if frame == NO_STACK:
        return filename
    return f"{filename}:{line} in {name}"


def devices_of(snap: dict) -> list[int]:
    devices = {int(s.get("device", 0)) for s in snap["segments"]}
    devices |= {d for d, t in enumerate(snap.get("device_traces", [])) if t}
    return sorted(devices)
