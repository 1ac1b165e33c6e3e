# The `vramledger` command line: `vramledger replay TRACE` replays a recorded allocation trace
# on the simulated device and sets its figures beside torch's. Stateless; one call per process.
"""Command-line entry point of vramledger (``python -m vramledger``).

Subcommands:
  replay TRACE [--capacity-gib N] [--json] [--conf key:value,...] [--device N]
               [--timeline OUT.csv] [--plot OUT.png] [--sample-every N] [--gpu-lag-us N]
      TRACE is a trace CSV (``action,addr,size,stream,time_us``, plain or .gz) or a torch memory
      snapshot pickle (``torch.cuda.memory._snapshot()``, ``.pickle`` / ``.pickle.gz``, or its JSON
      form, ``.json`` / ``.json.gz``), whose
      ``device_traces[N]`` is replayed. Sizes are bytes, times microseconds. A ``snapshot`` event
      ends a training step (utilization_at_each_step). --timeline writes allocated, reserved and
      wasted bytes over the trace with the trace's own reserved bytes as CSV; --plot draws them.
      --gpu-lag-us N: the simulated GPU finishes work N microseconds of trace time after the
      host queued it (fences complete late, as on a real GPU; default 0: at once).

Errors print ``vramledger: error: ...`` on stderr and exit with status 2; ``plan`` exits with 1
when the planned peak does not fit the card, ``report --fail-on-flag`` when a rank is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from vramledger import _cli_shared
from vramledger import _options  # the option table (process settings the replay ignores)
from vramledger import _snapshot_cli  # inspect, convert, diff, replay --snapshot
from vramledger import _guard_cli  # plan, report
from vramledger import _run_cli  # run (LD_PRELOAD shim)
from vramledger import _timeline  # replay --timeline / --plot
from vramledger._cli_shared import CliError

_GIB = 1 << 30
_H200_TOTAL_BYTES = 150109880320  # torch's total_memory of the H200 the bundled traces ran on
_INT64_MAX = (1 << 63) - 1  # the C++ binding's std::int64_t (sample_every, gpu_lag_us)


def _ignored_by_replay() -> dict[str, str]:
    """The options the replay parses but never acts on, with their help: the option table's
    process settings (the guard, step logs, dumps, the shim's switches), which take effect in the
    torch plugin (vramledger.install) or the LD_PRELOAD shim (vramledger run), not in the
    simulation."""
    # The table marks vramledger's own keys' help "vramledger: ..."; inside this sentence the
    # prefix would only repeat the program's name.
    return {row["name"]: row["help"].removeprefix("vramledger: ")
            for row in _options.option_table() if row["table"] == "process"}


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse calls this and expects no return
        raise CliError(f"{message} (see {self.prog} --help)")


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


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / _GIB:.2f} GiB)"


def _format_driver_time(r: dict) -> list[str]:
    """Driver time against the trace's span, the steady state and page moves (as the C++
    table, tools/replay/replay_report.cc)."""
    s = r["steady_state"]
    span = r["trace_span_us"]
    return [
        "",
        f"  {'trace span':<24} {span:,} us ({span / 1e6:.3f} s), first to last event",
        f"  {'driver time (modelled)':<24} {r['modeled_driver_us']:,.1f} us = "
        f"{r['driver_time_pct_of_span']:.3f}% of the span",
        f"  {'recorded (trace, torch)':<24} {r['recorded_modeled_driver_us']:,.1f} us = "
        f"{r['recorded_driver_time_pct_of_span']:.3f}% of the span (torch's segment events, "
        "same cost model)",
        f"  {'steady state':<24} after {100 * s['after_fraction']:.0f}% of the events (from line "
        f"{s['start_line']}; span {s['span_us'] / 1e6:.3f} s): "
        f"{sum(s['driver_calls'].values()):,} calls, {s['modeled_driver_us']:,.1f} us = "
        f"{s['driver_time_pct_of_span']:.3f}% of its span",
        f"  {'page moves':<24} {r['page_moves']:,} ({r.get('reused_old_mappings', 0):,} back onto "
        "an old mapping, no driver call)",
    ]


def _format_fragmentation(r: dict) -> list[str]:
    """Fragmentation at the moment reserved first reached its peak and at the end, side by side,
    with the C++ report's labels (tools/replay/replay_report.cc, FormatFragmentation): utilization
    is peak allocated / peak reserved so far at either point (running peaks, so the two columns
    differ when a later peak comes); "wasted then" is reserved - allocated at
    that moment, which differs from peak reserved - peak allocated when reserved reaches its peak
    late (a page created within recycle_slack of the peak while little is allocated)."""
    p, e = r["fragmentation_at_peak"], r["fragmentation_at_end"]
    rows = [("utilization, peaks so far", f"{p['utilization']:.4f}", f"{e['utilization']:.4f}")]
    for label, key in (("wasted then (res.-alloc.)", "wasted_bytes"),
                       ("peak res. - peak alloc.", "wasted_bytes_at_peak"),
                       ("largest free block", "largest_free_block")):
        rows.append((label, _bytes(p[key]), _bytes(e[key])))
    rows += [("free-space fragmentation", f"{p['free_space_fragmentation']:.4f}",
              f"{e['free_space_fragmentation']:.4f}"),
             ("holes", f"{p['holes']:,}", f"{e['holes']:,}"),
             ("mapped free pages", f"{p['mapped_free_pages']:,}", f"{e['mapped_free_pages']:,}"),
             ("other streams' cache", _bytes(p["other_stream_cached_bytes"]),
              _bytes(e["other_stream_cached_bytes"]))]
    header = ("fragmentation", f"at peak reserved (line {p['line']})", "at end")
    return [""] + [f"  {a:<26} {b:<34} {c}" for a, b, c in [header] + rows]


def _format_steps(r: dict) -> list[str]:
    """One row per step; nothing when the trace marks no steps."""
    steps = r["utilization_at_each_step"]
    if not steps:
        return []
    lines = ["", f"  {'step':<6} {'end line':>10} {'events':>9} {'peak allocated':>18} "
                 f"{'peak reserved':>18} {'utilization':>11} {'calls':>8} {'mem calls':>9} "
                 f"{'driver (us)':>14}"]
    for s in steps:
        name = f"{s['step']}{'' if s['complete'] else '*'}"
        end = f"{s['end_line']:,}" if s["complete"] else "end"
        lines.append(f"  {name:<6} {end:>10} {s['events']:>9,} {s['peak_allocated_bytes']:>18,} "
                     f"{s['peak_reserved_bytes']:>18,} {s['utilization']:>11.4f} "
                     f"{s['driver_calls']:>8,} {s['memory_calls']:>9,} "
                     f"{s['modeled_driver_us']:>14,.1f}")
    lines.append("  mem calls: the calls that map, unmap, create or free device memory (cuMem*, "
                 "cudaMalloc, cudaFree); the others are events and queries")
    if not steps[-1]["complete"]:
        lines.append("  * events after the last step mark (an unfinished step)")
    return lines


def _format_table(r: dict) -> str:
    recorded_reserved = "n/a (no segment events in the trace)"
    if r["recorded_segment_allocs"]:
        recorded_reserved = _bytes(r["recorded_peak_reserved_bytes"])
    rows = [
        ("", "vramledger (replay)", "recorded (trace, torch)"),
        ("alloc+free events", f"{r['events']:,}", f"{r['recorded_events']:,}"),
        ("peak allocated", _bytes(r["peak_allocated_bytes"]),
         "n/a (the trace has requested sizes only)"),
        ("peak requested", _bytes(r["peak_requested_bytes"]),
         _bytes(r["trace_peak_requested_bytes"])),
        ("peak reserved", _bytes(r["peak_reserved_bytes"]), recorded_reserved),
        ("utilization", f"{r['utilization']:.4f} (allocated / reserved)",
         f"{r['recorded_utilization']:.4f} (requested / reserved)"
         if r["recorded_peak_reserved_bytes"] > 0 else "n/a"),
        ("segment allocs", f"{r['device_allocs']:,}", f"{r['recorded_segment_allocs']:,}"),
        ("segment frees", f"{r['device_frees']:,}", f"{r['recorded_segment_frees']:,}"),
        # torch's names; the trace's oom events are torch's refusals, a replay stops at one.
        ("num_alloc_retries", f"{r['alloc_retries']:,}", "n/a"),
        ("num_ooms", "0 (a replay stops at one)", f"{r['recorded_ooms']:,}"),
    ]
    if "snapshot_reserved_bytes" in r:
        rows.append(("at snapshot", "", f"reserved {_bytes(r['snapshot_reserved_bytes'])}, "
                                        f"allocated {_bytes(r['snapshot_allocated_bytes'])}"))
    conf = r["conf"] or "(defaults)"
    lines = [f"vramledger replay of {r['trace']}",
             f"  {r['trace_events']:,} trace events; simulated capacity "
             f"{_bytes(r['capacity_bytes'])}; conf: {conf}", ""]
    lines += [f"  {a:<17} {b:<36} {c}".rstrip() for a, b, c in rows]
    lines += ["", f"  {'driver calls (modelled)':<24} {'count':>12} {'time (us)':>16}"]
    total = 0
    for name, count in sorted(r["driver_calls"].items()):
        if count:
            total += count
            lines.append(f"  {name:<24} {count:>12,} {r['driver_us'].get(name, 0.0):>16,.1f}")
    lines.append(f"  {'total':<24} {total:>12,} {r['modeled_driver_us']:>16,.1f}")
    lines += _format_driver_time(r) + _format_fragmentation(r) + _format_steps(r)
    lines += ["", f"  live at end: {r['live_at_end']:,} blocks, {_bytes(r['live_bytes_at_end'])}; "
                  f"unknown frees: {r['unknown_frees']:,}; "
                  f"allocs of live addresses: {r['reused_live_addresses']:,}"]
    return "\n".join(lines) + "\n"


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
                "sample_every": args.sample_every or 0, "gpu_lag_us": args.gpu_lag_us}
    path = _utf8(args.trace, "TRACE")
    _utf8(args.conf, "--conf")
    _utf8(os.environ.get("VRAMLEDGER_CONF", ""), "VRAMLEDGER_CONF")
    is_snapshot = _cli_shared.is_snapshot(path)
    if args.device < 0:
        raise CliError(f"--device must be a device index (0 or more), got {args.device}")
    if args.device != 0 and not is_snapshot:
        raise CliError(f"--device {args.device}: a trace CSV holds one device's events; --device "
                       "selects a device only in a torch snapshot")
    try:
        if is_snapshot:
            snapshot = _cli_shared.load_snapshot(path)
            events = _cli_shared.snapshot_events(path, snapshot, args.device)
            figures = _snapshot_figures(path, snapshot, args.device)
            result = core.replay_events(events, args.conf, capacity,
                                        source=f"{path}:device_traces[{args.device}]", **timeline)
            result["device"] = args.device
            result.update(figures)
        else:
            result = core.replay_file(path, args.conf, capacity, **timeline)
    except (ValueError, OSError, MemoryError, RuntimeError) as e:
        raise CliError(str(e)) from e
    _write_timeline(args, result)

    if args.snapshot:  # the replayed allocator's snapshot at peak or end
        result["snapshot"] = _snapshot_cli.write_replay_snapshot(args, core, capacity)
    for warning in _warnings(result, is_snapshot, args):
        print(f"vramledger: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(_format_table(result))
        if "snapshot" in result:
            sys.stdout.write(_snapshot_cli.format_replay_snapshot(result["snapshot"]))
        for key, what in (("timeline", "timeline CSV"), ("plot", "timeline chart")):
            if key in result:
                print(f"  wrote the {what} to {result[key]}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="vramledger", description=__doc__.splitlines()[0])
    from vramledger import __version__  # the package is imported by now (cli is its submodule)
    parser.add_argument("--version", action="version", version=f"vramledger {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=_ArgumentParser)
    commands.required = True
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
    _snapshot_cli.add_replay_snapshot_args(replay)
    replay.set_defaults(run=_replay)
    _snapshot_cli.register(commands, CliError)
    _guard_cli.register(commands, CliError)
    _run_cli.register(commands, CliError)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0; 1 from plan when the peak does not fit
    or from report --fail-on-flag; 2 after printing an error)."""
    try:
        args = _parser().parse_args(argv)
        return args.run(args)
    except CliError as e:
        print(f"vramledger: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vramledger replay ... | head`
        sys.stderr.close()
        return 0
    # Safety nets for what a command did not turn into a CliError itself (inputs that gave
    # tracebacks: a 100,000-deep JSON file, a 1e308 parameter count, a full disk).
    except RecursionError:
        print("vramledger: error: the input is nested too deeply to read or write",
              file=sys.stderr)
        return 2
    except OverflowError as e:
        print(f"vramledger: error: a number is out of range: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"vramledger: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
