# Shared pieces of the `vramledger` command's modules: the command's error, the check of an
# output file name, and reading a torch snapshot's trace for `replay`. Imports no command module.
"""Helpers that cli.py, _snapshot_cli.py and _plan.py share.

This module imports no command module (cli, _snapshot_cli, _guard_cli, _run_cli, _plan), so
each of them can import it at the top and the package has no import cycle
(tests/python/test_imports.py checks that).
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib
from typing import Callable

from vramledger import _snapshot

_PICKLE_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")
_JSON_SUFFIXES = (".json", ".json.gz")  # a snapshot as JSON (replay --snapshot, convert write it)
# The ranges of replay_events' (action, addr, size, stream, time_us) tuple (tools/python_module.cc:
# std::uint64_t addr, size and stream; std::int64_t time_us), as [low, high).
_EVENT_FIELDS = (("addr", 0, 1 << 64, "an integer from 0 to 2**64 - 1"),
                 ("size", 0, 1 << 64, "an integer from 0 to 2**64 - 1"),
                 ("stream", 0, 1 << 64, "an integer from 0 to 2**64 - 1"),
                 ("time_us", -(1 << 62) + 1, 1 << 62,
                  "an integer strictly between -2**62 and 2**62 (two such times differ by less "
                  "than 2**63)"))


class CliError(Exception):
    """An error to print as ``vramledger: error: <message>`` (exit status 2)."""


def check_output(flag: str, out: str, error: Callable[[str], Exception] = CliError) -> None:
    """Raises `error` (default: CliError) naming `flag` when `out` cannot be the name of a
    file to write: empty (it was taken as no flag), a directory, or in a directory that does not
    exist (through a link's target). Called before any work, so a bad name costs no replay,
    report or plan (replay, inspect, convert, plan)."""
    if not out:
        raise error(f"{flag} '': give a file name")
    target = os.path.realpath(out)  # a link's target (which may not exist yet)
    if os.path.isdir(target) or out.endswith(os.sep):
        raise error(f"{flag} {out}: is a directory; give a file name")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise error(f"{flag} {out}: no such directory: {parent}")


def is_snapshot(path: str) -> bool:
    """A torch memory snapshot (pickle or JSON) by its name; anything else is a trace CSV."""
    return path.lower().endswith(_PICKLE_SUFFIXES + _JSON_SUFFIXES)


def load_snapshot(path: str) -> dict:
    """The snapshot at `path` for `replay`: a JSON one read and validated by _snapshot, a pickle
    read with _snapshot's restricted unpickler (no class is ever loaded); errors are CliError."""
    if path.lower().endswith(_JSON_SUFFIXES):
        try:
            return _snapshot.load_snapshot(path)  # validated: segments and device_traces lists
        except _snapshot.SnapshotFormatError as e:
            raise CliError(f"{e!s:.300}") from e  # names the file itself
        except (ValueError, OSError, RecursionError) as e:
            raise CliError(f"{path}: cannot read the snapshot: {e!s:.300}") from e
    opener = gzip.open if path.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            snapshot = _snapshot.PlainUnpickler(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, IndexError,
            AttributeError, KeyError, RecursionError, MemoryError, OverflowError,
            zlib.error) as e:  # a malformed pickle or gzip stream: any of these
        raise CliError(f"{path}: cannot read the snapshot pickle: {e!s:.200}") from e
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces"), list):
        raise CliError(f"{path}: not a torch memory snapshot (no 'device_traces' list)")
    return snapshot


def snapshot_events(path: str, snapshot: dict, device: int) -> list[tuple]:
    """The trace entries of `device` as (action, addr, size, stream, time_us) tuples, each field
    checked against the range the C++ binding takes (_EVENT_FIELDS)."""
    traces = snapshot["device_traces"]
    if not 0 <= device < len(traces):
        raise CliError(f"{path}: no device {device} in device_traces "
                       f"(it has {len(traces)} device(s))")
    where = f"{path}: device_traces[{device}]"
    if not isinstance(traces[device], list):
        raise CliError(f"{where} must be a list of trace entries (dicts), "
                       f"got {traces[device]!r:.60}")
    events = []
    for i, entry in enumerate(traces[device], 1):
        if not isinstance(entry, dict):
            raise CliError(f"{where} entry {i}: must be a dict, got {entry!r:.60}")
        if "action" not in entry:
            raise CliError(f"{where} entry {i}: no 'action'")
        action = entry["action"]
        if not isinstance(action, str) or not action.isascii():  # the binding takes a UTF-8 str
            raise CliError(f"{where} entry {i}: 'action' must be a trace action name, "
                           f"got {action!r:.60}")
        values = []
        for key, low, high, what in _EVENT_FIELDS:
            # An `oom` entry carries the device's free bytes in `device_free` instead of `addr`.
            if key == "addr" and entry["action"] == "oom":
                key = "device_free"
                if key not in entry:
                    raise CliError(f"{where} entry {i}: an 'oom' entry without 'device_free'")
            value = entry.get(key, 0)
            if type(value) is not int or not low <= value < high:  # bool is no integer here
                raise CliError(f"{where} entry {i}: '{key}' must be {what}, got {value!r:.60}")
            values.append(value)
        events.append((str(entry["action"]), *values))
    return events
