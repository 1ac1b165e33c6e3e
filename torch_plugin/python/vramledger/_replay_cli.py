# `vramledger replay TRACE`: replays a recorded allocation trace (CSV or torch snapshot) on the
# simulated device, beside torch's figures; follows the program's releases and enforces a plan.
"""The ``replay`` command of ``vramledger`` (registered by cli.py).

replay TRACE [--capacity-gib N] [--json] [--conf key:value,...] [--device N]
             [--timeline OUT.csv] [--plot OUT.png] [--sample-every N] [--gpu-lag-us N]
             [--ignore-releases] [--plan-keep-going] [--snapshot OUT ...]

Exit status: 0; 1 when the plan (``--conf plan:FILE``) refused an allocation; 2 after an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from vramledger import _cli_shared
from vramledger import _options  # the option table (process settings the replay ignores)
from vramledger import _replay_report  # the table and the plan's report
from vramledger import _snapshot_cli  # replay --snapshot
from vramledger import _timeline  # replay --timeline / --plot
from vramledger._cli_shared import CliError

_GIB = 1 << 30
_H200_TOTAL_BYTES = 150109880320  # torch's total_memory of the H200 the bundled traces ran on
_INT64_MAX = (1 << 63) - 1  # the C++ binding's std::int64_t (sample_every, gpu_lag_us)
_REFUSALS_LISTED = 10  # --plan-keep-going: refusals reported with their messages


def _ignored_by_replay() -> dict[str, str]:
    """The options the replay parses but never acts on, with their help: the option table's
    process settings (step logs, dumps, the shim's switches), which take effect in the torch
    plugin (vramledger.install) or the LD_PRELOAD shim (vramledger run), not in the simulation.
    `plan` is not one of them: the replay enforces it on the simulated device."""
    # The table marks vramledger's own keys' help "vramledger: ..."; inside this sentence the
    # prefix would only repeat the program's name.
    return {row["name"]: row["help"].removeprefix("vramledger: ")
            for row in _options.option_table()
            if row["table"] == "process" and row["name"] != "plan"}


def _attach_stacks(result: dict, snapshot: dict | None, device: int) -> None:
    """Adds to each listed plan refusal the stack the input recorded for its allocation
    ("stack": [{filename, line, name}], innermost first) or why there is none ("stack_note")."""
    plan = result.get("plan")
    if not plan:
        return
    entries = snapshot["device_traces"][device] if snapshot is not None else None
    for refusal in plan["listed"]:
        if entries is None:
            refusal["stack_note"] = ("a trace CSV records no stacks; replay a snapshot recorded "
                                     "with stacks to see them")
            continue
        frames = entries[refusal["event"] - 1].get("frames")
        if isinstance(frames, list) and frames:
            refusal["stack"] = [{"filename": str(f.get("filename", "?")),
                                 "line": f.get("line", 0), "name": str(f.get("name", "?"))}
                                for f in frames if isinstance(f, dict)]
        else:
            refusal["stack_note"] = ("the snapshot recorded no frames for this allocation; "
                                     "record with torch.cuda.memory._record_memory_history("
                                     "context='all', stacks='python')")


def _core():
    try:
        from vramledger import _core as core  # the C++ extension (tools/python_module.cc)
    except ImportError as e:
        raise CliError(f"the C++ extension vramledger._core is not available ({e}); "
                       "build and install the package with scripts/setup.sh") from e
    return core


def _utf8(value: str, what: str) -> str:
    """`value` if it is valid UTF-8 (the C++ side takes UTF-8 strings), else CliError naming
    `what`: a byte that is not UTF-8 reaches Python surrogate-escaped."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise CliError(f"{what} is not valid UTF-8 at character {e.start + 1}: {value!r}") from e
    return value


def _snapshot_figures(path: str, snapshot: dict, device: int) -> dict:
    """Reserved and allocated bytes of the snapshot's segments (the state when it was taken)."""
    segments = snapshot.get("segments", [])
    if not isinstance(segments, list):
        raise CliError(f"{path}: 'segments' must be a list, got {segments!r:.60}")
    reserved = allocated = 0
    for i, segment in enumerate(segments):
        if not isinstance(segment, dict):
            raise CliError(f"{path}: segments[{i}] must be a dict, got {segment!r:.60}")
        for key in ("device", "total_size", "allocated_size"):
            value = segment.get(key, 0)
            if type(value) is not int or value < 0:
                raise CliError(f"{path}: segments[{i}]: '{key}' must be a non-negative integer, "
                               f"got {value!r:.60}")
        if segment.get("device", 0) == device:
            reserved += segment.get("total_size", 0)
            allocated += segment.get("allocated_size", 0)
    return {"snapshot_reserved_bytes": reserved, "snapshot_allocated_bytes": allocated}


def _warnings(r: dict, is_snapshot: bool, args: argparse.Namespace) -> list[str]:
    out = []
    kinds = (("unknown_frees", "free_completed events of addresses not live in the trace (never "
                               "allocated in it, or freed twice) were not replayed"),
             ("reused_live_addresses", "alloc events of addresses still live (the trace lost "
                                       "their free; the earlier block was freed first)"))
    for key, what in kinds:
        if r[key]:
            places = ", ".join(f"{r['trace']}:{x['line']} (addr {x['addr']:#x})"
                               for x in r[key + "_listed"][:5])
            more = ", ..." if r[key] > 5 else ""
            note = ""
            if is_snapshot and key == "unknown_frees":
                note = (" (expected for a snapshot: its trace ring buffer starts mid-run, so "
                        "blocks allocated before it are unknown)")
            out.append(f"{r[key]:,} {what}{note}; at {places}{more}")
    if r.get("time_reversals"):
        what = ("event is earlier (time_us) than the event before it, at"
                if r["time_reversals"] == 1 else
                "events are earlier (time_us) than the event before them, the first at")
        out.append(f"{r['time_reversals']:,} {what} {r['trace']}:{r['first_time_reversal_line']} "
                   f"({r['first_time_reversal_us']:,} us earlier): the trace is not in time order, "
                   "so its span and the driver-time shares are not meaningful (the memory figures "
                   "are)")
    # VRAMLEDGER_CONF, then --conf, as (key, value) pairs: a later pair wins, as in the allocator.
    options = [tuple(part.strip() for part in item.partition(":")[::2])
               for item in r["conf"].split(",") if item.strip()]
    ignored = _ignored_by_replay() if options else {}
    for key, value in options:
        if key in ignored and value:
            out.append(f"option {key}:{value} is ignored by the replay, which simulates the "
                       f"allocator only ({ignored[key]}): it takes effect in the torch plugin, "
                       "vramledger.install(), or the LD_PRELOAD shim, vramledger run")
    if args.plan_keep_going and not r.get("plan"):
        out.append("--plan-keep-going applies to a plan (--conf plan:FILE), none given: ignored")
    if args.sample_every and not (args.timeline or args.plot):
        out.append("--sample-every applies to --timeline and --plot, neither given: it is ignored")
    if not args.snapshot:
        given = [flag for flag, value, default in (("--at", args.at, "peak"),
                                                   ("--max-entries", args.max_entries,
                                                    sys.maxsize))
                 if value != default]
        if given:
            out.append(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
                       "--snapshot, not given: ignored")
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        out.append(f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']} is not read "
                   "by the replay (it is torch's, for torch's allocator); vramledger's options "
                   "come from VRAMLEDGER_CONF and --conf, with torch's keys")
    if args.gpu_lag_us and dict(options).get("expandable_segments") != "True":
        out.append("--gpu-lag-us delays the completion of the allocator's events, which only "
                   "expandable segments record in a replay (a trace holds no record_stream uses): "
                   "without expandable_segments:True it changes nothing")
    if r.get("recorded_segment_maps") and dict(options).get("expandable_segments") != "True":
        out.append(f"{r['trace']} was recorded with torch's expandable segments "
                   f"({r['recorded_segment_maps']:,} segment_map events) and is replayed without "
                   "them: for a like-for-like comparison add --conf expandable_segments:True")
    if is_snapshot:
        out.append(f"a snapshot keeps only the last {r['trace_events']:,} trace entries; blocks "
                   "allocated before them are not replayed, so the peaks cover that window only")
    if r["allocs"] == 0 and r["frees"] == 0:
        out.append(f"{r['trace']} holds no alloc or free event: nothing was replayed")
    elif 0 <= r["trace_span_us"] < 1_000_000:  # a negative span: time order, warned above
        out.append(f"{r['trace']} spans only {r['trace_span_us']:,} us of trace time: driver time "
                   "as a share of that span means little (the figure is for training runs)")
    return out


def _write_timeline(args: argparse.Namespace, result: dict) -> None:
    """Writes --timeline and draws --plot from result["timeline_csv"] (removed from `result`)."""
    text = result.pop("timeline_csv", None)
    if text is None:
        return
    conf = result["conf"] or "(defaults)"
    title = (f"{result['trace']}\nconf: {conf}; utilization {result['utilization']:.4f} "
             f"(recorded {result['recorded_utilization']:.4f})")
    title = title.replace("$", r"\$")  # a file name is not mathtext (matplotlib's $...$)
    try:
        if args.timeline:
            _timeline.write_csv(text, args.timeline)
            result["timeline"] = args.timeline
        if args.plot:
            _timeline.plot(text, args.plot, title)
            result["plot"] = args.plot
    except _timeline.TimelineError as e:
        raise CliError(str(e)) from e


def _replay(args: argparse.Namespace) -> int:
    args.conf = ",".join(c for c in args.conf if c)  # every --conf, in order
    core = _core()
    if args.capacity_gib is not None and not 2 / 1024 <= args.capacity_gib <= 1e6:  # NaN too
        raise CliError(f"--capacity-gib must be a number of GiB from 0.001953125 (2 MiB) to 1e6, "
                       f"got {args.capacity_gib}")
    capacity = (int(args.capacity_gib * _GIB) if args.capacity_gib is not None
                else getattr(core, "H200_TOTAL_BYTES", _H200_TOTAL_BYTES))
    if args.sample_every is not None and not 0 < args.sample_every <= _INT64_MAX:
        raise CliError(f"--sample-every must be a positive number of events, at most "
                       f"{_INT64_MAX}, got {args.sample_every}")
    if not 0 <= args.gpu_lag_us <= _INT64_MAX:
        raise CliError(f"--gpu-lag-us must be a non-negative number of microseconds, at most "
                       f"{_INT64_MAX}, got {args.gpu_lag_us}")
    if args.timeline == "-":
        raise CliError("--timeline -: the timeline is not written to stdout; give a file name "
                       "(OUT.csv)")
    _snapshot_cli.check_replay_snapshot_args(args)  # before the replay, which --snapshot repeats
    for flag, out in (("--timeline", args.timeline), ("--plot", args.plot),
                      ("--snapshot", args.snapshot)):
        # Before the replay: a bad one found after it left the others written.
        if out is not None:
            _cli_shared.check_output(flag, out)
    if args.plot:  # before the replay, so a wrong name costs no replay
        try:
            _timeline.plot_format(args.plot)
        except _timeline.TimelineError as e:
            raise CliError(str(e)) from e
    timeline = {"timeline": bool(args.timeline or args.plot),
                "sample_every": args.sample_every or 0, "gpu_lag_us": args.gpu_lag_us,
                "follow_releases": not args.ignore_releases,
                "plan_keep_going": args.plan_keep_going, "max_refusals_listed": _REFUSALS_LISTED}
    path = _utf8(args.trace, "TRACE")
    _utf8(args.conf, "--conf")
    _utf8(os.environ.get("VRAMLEDGER_CONF", ""), "VRAMLEDGER_CONF")
    is_snapshot = _cli_shared.is_snapshot(path)
    if args.device < 0:
        raise CliError(f"--device must be a device index (0 or more), got {args.device}")
    if args.device != 0 and not is_snapshot:
        raise CliError(f"--device {args.device}: a trace CSV holds one device's events; --device "
                       "selects a device only in a torch snapshot")
    snapshot = None
    try:
        if is_snapshot:
            snapshot = _cli_shared.load_snapshot(path)
            events = _cli_shared.snapshot_events(path, snapshot, args.device)
            figures = _snapshot_figures(path, snapshot, args.device)
            result = core.replay_events(events, args.conf, capacity,
                                        source=f"{path}:device_traces[{args.device}]",
                                        device=args.device, **timeline)
            result["device"] = args.device
            result.update(figures)
        else:
            result = core.replay_file(path, args.conf, capacity, **timeline)
    except (ValueError, OSError, MemoryError, RuntimeError) as e:
        raise CliError(str(e)) from e
    _attach_stacks(result, snapshot, args.device)
    _write_timeline(args, result)

    if args.snapshot:  # the replayed allocator's snapshot at peak or end
        result["snapshot"] = _snapshot_cli.write_replay_snapshot(args, core, capacity)
    for warning in _warnings(result, is_snapshot, args):
        print(f"vramledger: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(_replay_report.format_table(result))
        if "snapshot" in result:
            sys.stdout.write(_snapshot_cli.format_replay_snapshot(result["snapshot"]))
        for key, what in (("timeline", "timeline CSV"), ("plot", "timeline chart")):
            if key in result:
                print(f"  wrote the {what} to {result[key]}")
    plan = result.get("plan")
    if plan and plan["refusals"]:
        sys.stdout.flush()
        first = plan["listed"][0]
        print(f"vramledger: the plan {plan['path']} refused {plan['refusals']:,} allocation(s), "
              f"the first at {result['trace']}:{first['line']} ({first['rule']}, plan line "
              f"{first['plan_line']})", file=sys.stderr)
        return 1
    return 0


def register(commands: Any) -> None:
    """Adds the replay command to `commands` (cli.py's subparsers)."""
    replay = commands.add_parser(
        "replay", help="replay a trace on the simulated device, beside torch's recorded figures",
        description="Replays alloc / free_completed events of a trace through vramledger on the "
                    "simulated device (SimBackend) and prints its peaks beside the trace's own.")
    replay.add_argument("trace", metavar="TRACE",
                        help="trace CSV (plain or .gz) or torch snapshot: pickle (.pickle[.gz]) "
                             "or JSON (.json[.gz])")
    replay.add_argument("--capacity-gib", type=float, default=None, metavar="N",
                        help="simulated device capacity in GiB (default: the H200's 139.80)")
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.add_argument("--conf", action="append", default=[], metavar="key:value,...",
                        help="allocator options (PYTORCH_CUDA_ALLOC_CONF syntax), applied after "
                             "VRAMLEDGER_CONF from the environment; given twice, both apply (the "
                             "later wins for a key given in both)")
    replay.add_argument("--device", type=int, default=0, metavar="N",
                        help="device whose trace a snapshot replays (default 0)")
    replay.add_argument("--timeline", default=None, metavar="OUT.csv",
                        help="write allocated, reserved and wasted bytes over the trace, with the "
                             "trace's own reserved bytes, as CSV")
    replay.add_argument("--plot", default=None, metavar="OUT.png",
                        help="draw the timeline as a PNG (.svg and .pdf by the name; needs "
                             "matplotlib)")
    replay.add_argument("--sample-every", type=int, default=None, metavar="N",
                        help="timeline: a point at least every N trace events (default: about "
                             "2000 points in all)")
    replay.add_argument("--gpu-lag-us", type=int, default=0, metavar="N",
                        help="the simulated GPU finishes work N us of trace time after the host "
                             "queued it: fences complete late, as on a real GPU (default 0)")
    replay.add_argument("--ignore-releases", action="store_true",
                        help="do not empty the replay's cache where the trace shows the "
                             "program's releases (runs of segment_free / segment_unmap: its "
                             "empty_cache() calls, torch's out-of-memory retries)")
    replay.add_argument("--plan-keep-going", action="store_true",
                        help="with --conf plan:FILE: count every refusal (the first "
                             f"{_REFUSALS_LISTED} listed) and go on, instead of stopping at the "
                             "first; the exit status is 1 after any refusal")
    _snapshot_cli.add_replay_snapshot_args(replay)
    replay.set_defaults(run=_replay)
