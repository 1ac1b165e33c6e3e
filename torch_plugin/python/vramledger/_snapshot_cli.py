# The snapshot subcommands of the `vramledger` command line (inspect, convert, diff) and the
# `replay --snapshot` option; registered by cli.py. Stateless; one call per process.
"""``vramledger inspect | convert | diff`` and ``vramledger replay TRACE --snapshot OUT``.

inspect FILE [--top N] [--device N] [--plot out.png|.svg|.pdf] [--html out.html] [--json]
    Totals like memory_summary, fragmentation, holes per stream, the largest free block and the
    top N live allocations by innermost user frame of a snapshot (vramledger's or torch's, pickle
    or JSON, plain or .gz).
convert IN OUT
    Pickle <-> JSON, by OUT's name (.json / .json.gz: JSON; else pickle protocol 4).
diff A B [--top N] [--json]
    What grew from snapshot A to B, by allocating stack.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from vramledger import _cli_shared, _inspect, _snapshot, _timeline
from vramledger._cli_shared import check_output

_error: Callable[[str], Exception] = _cli_shared.CliError  # register() may replace it


def _load(path: str) -> dict:
    try:
        return _snapshot.load_snapshot(path)
    except _snapshot.SnapshotFormatError as e:
        raise _error(str(e)) from e
    except OSError as e:
        raise _error(f"{path}: cannot read: {e.strerror or e}") from e


def _write(snap: dict, path: str) -> None:
    try:
        _snapshot.write_snapshot(snap, path)
    except (OSError, TypeError, ValueError) as e:
        raise _error(f"{path}: cannot write the snapshot: "
                     f"{getattr(e, 'strerror', None) or e}") from e
    except RecursionError as e:
        raise _error(f"{path}: cannot write the snapshot: a value is nested too deeply") from e


def _kind(path: str) -> str:
    return "JSON" if path.lower().endswith(_snapshot._JSON_SUFFIXES) else "pickle (protocol 4)"


def _inspect_cmd(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise _error(f"--top must be >= 0, got {args.top}")
    if args.device is not None and args.device < 0:
        raise _error(f"--device must be a device index (0 or more), got {args.device}")
    for flag, value in (("--plot", args.plot), ("--html", args.html)):
        if value == "-":  # as replay's --timeline and --snapshot
            raise _error(f"{flag} -: the file is not written to stdout; give a file name")
        if value is not None:  # before reading: --html's bad name was found after the report
            check_output(flag, value)
    if args.plot:  # before reading the snapshot, as replay --plot: .png, .svg or .pdf
        try:
            _timeline.plot_format(args.plot)
        except _timeline.TimelineError as e:
            raise _error(str(e)) from e
    snap = _load(args.file)
    if args.device is not None:
        devices = _inspect.devices_of(snap)
        if args.device not in devices:
            raise _error(f"--device {args.device}: {args.file} has no segments or trace entries "
                         f"of device {args.device} (devices with either: "
                         f"{', '.join(map(str, devices)) or 'none'})")
        snap = dict(snap, segments=[s for s in snap["segments"]
                                    if int(s.get("device", 0)) == args.device])
        traces = snap.get("device_traces", [])
        snap["device_traces"] = [t if i == args.device else [] for i, t in enumerate(traces)]
    summary = _inspect.summarize(snap, args.top)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        sys.stdout.write(_inspect.format_summary(summary, args.file))
    if args.plot:
        try:
            devices = _inspect.plot_png(snap, args.plot, os.path.basename(args.file))
        except ValueError as e:
            raise _error(f"--plot: {args.file}: {e}") from e
        except ImportError as e:
            raise _error(f"--plot needs matplotlib ({e}); pip install matplotlib") from e
        except OSError as e:
            raise _error(f"{args.plot}: cannot write the plot: {e.strerror or e}") from e
        print(f"vramledger: wrote {args.plot} (devices {', '.join(map(str, devices))})",
              file=sys.stderr)
    if args.html:
        from vramledger import _inspect_html

        page = _inspect_html.render(snap, summary, os.path.basename(args.file))
        try:
            # A lone surrogate in a frame's file name: escaped, not an error.
            data = page.encode("utf-8", errors="backslashreplace")
            _snapshot.write_atomically(data, args.html)  # no stray .tmp file
        except (OSError, ValueError) as e:
            raise _error(f"{args.html}: cannot write: {getattr(e, 'strerror', None) or e}") from e
        print(f"vramledger: wrote {args.html}", file=sys.stderr)
    return 0


def _convert_cmd(args: argparse.Namespace) -> int:
    check_output("OUT", args.output)  # before reading: '' said "cannot write: No such file"
    snap = _load(args.input)
    _write(snap, args.output)
    print(f"vramledger: wrote {args.output} ({_kind(args.output)})", file=sys.stderr)
    return 0


def _diff_cmd(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise _error(f"--top must be >= 0, got {args.top}")
    result = _inspect.diff(_load(args.a), _load(args.b), args.top)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(_inspect.format_diff(result, args.a, args.b))
    return 0


def register(commands: Any, error: Callable[[str], Exception]) -> None:
    """Adds inspect, convert and diff to cli.py's subparsers; `error` is cli.CliError."""
    global _error
    _error = error
    p = commands.add_parser(
        "inspect", help="summarise a memory snapshot (vramledger's or torch's)",
        description="Totals like memory_summary, fragmentation, holes per stream and the top "
                    "live allocations by innermost user frame of a snapshot: a pickle or JSON "
                    "(plain or .gz) written by vramledger or by torch.cuda.memory._dump_snapshot.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--top", type=int, default=10, metavar="N",
                   help="allocation groups to list (default 10)")
    p.add_argument("--device", type=int, default=None, metavar="N", help="only this device")
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw allocated and reserved over the trace as a PNG (.svg and .pdf by "
                        "the name; needs matplotlib)")
    p.add_argument("--html", metavar="OUT.html",
                   help="write a self-contained HTML page (no network needed)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=_inspect_cmd)

    p = commands.add_parser(
        "convert", help="convert a snapshot between pickle and JSON",
        description="Reads a snapshot (pickle or JSON, plain or .gz) and writes it as JSON when "
                    "OUT ends in .json or .json.gz, else as a pickle (protocol 4, plain types, as "
                    "torch writes). The output appears whole or not at all.")
    p.add_argument("input", metavar="IN")
    p.add_argument("output", metavar="OUT")
    p.set_defaults(run=_convert_cmd)

    p = commands.add_parser(
        "diff", help="what grew between two snapshots, by stack",
        description="Live bytes per allocating stack in snapshot A and B; lists the stacks whose "
                    "bytes grew, largest growth first.")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--top", type=int, default=20, metavar="N", help="stacks to list (default 20)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_diff_cmd)


def add_replay_snapshot_args(replay: argparse.ArgumentParser) -> None:
    """Adds --snapshot, --at and --max-entries to cli.py's replay parser."""
    replay.add_argument("--snapshot", metavar="OUT", default=None,
                        help="also write the replayed allocator's snapshot (with its history) to "
                             "OUT: JSON for .json, else pickle; opens in torch's viewers")
    replay.add_argument("--at", choices=("peak", "end"), default="peak",
                        help="take the snapshot at the peak of reserved memory (default) or at "
                             "the end of the trace")
    replay.add_argument("--max-entries", type=int, default=sys.maxsize, metavar="N",
                        help="trace entries the snapshot's history keeps (default: all)")


def check_replay_snapshot_args(args: argparse.Namespace) -> None:
    """Refuses a bad --max-entries or --snapshot before the replay runs (cli.py calls this)."""
    if not 1 <= args.max_entries <= sys.maxsize:  # the binding takes a 64-bit count
        raise _error(f"--max-entries must be >= 1 and at most {sys.maxsize}, "
                     f"got {args.max_entries}")
    if args.snapshot == "-":
        raise _error("--snapshot -: the snapshot is not written to stdout; give a file name "
                     "(OUT.json or OUT.pickle)")


def write_replay_snapshot(args: argparse.Namespace, core: Any, capacity: int) -> dict:
    """Replays args.trace again with the history on (and args.gpu_lag_us and
    args.ignore_releases, as the replay it accompanies), writes the snapshot at args.at to args.snapshot, and returns {path, at,
    events_replayed, line, reserved_bytes}. check_replay_snapshot_args has checked the flags."""
    path = args.trace
    try:
        if _cli_shared.is_snapshot(path):  # a snapshot, pickle or JSON: its device's trace
            events = _cli_shared.snapshot_events(path, _cli_shared.load_snapshot(path),
                                                 args.device)
            snap = core.replay_snapshot_events(
                events, args.conf, capacity, source=f"{path}:device_traces[{args.device}]",
                at=args.at, max_entries=args.max_entries, gpu_lag_us=args.gpu_lag_us,
                follow_releases=not args.ignore_releases)
        else:
            snap = core.replay_snapshot_file(path, args.conf, capacity, at=args.at,
                                             max_entries=args.max_entries,
                                             gpu_lag_us=args.gpu_lag_us,
                                             follow_releases=not args.ignore_releases)
    except (ValueError, OSError, MemoryError, RuntimeError) as e:
        raise _error(str(e)) from e
    _write(_snapshot.normalize(snap), args.snapshot)
    replay = snap["vramledger"]["replay"]
    return {"path": args.snapshot, "at": replay["at"], "events_replayed": replay["events_replayed"],
            "line": replay["line"], "reserved_bytes": replay["reserved_bytes"]}


def format_replay_snapshot(info: dict) -> str:
    return (f"  snapshot at {info['at']} (after {info['events_replayed']:,} trace events, line "
            f"{info['line']:,}; reserved {_inspect.fmt_bytes(info['reserved_bytes'])}) written to "
            f"{info['path']}\n")
