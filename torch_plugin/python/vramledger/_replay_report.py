# The replay's readable report: the table of figures beside torch's, the program's releases the
# replay followed, and the plan's refusals with the stacks a snapshot recorded. Pure functions.
"""Formatting of ``vramledger replay``'s result dict (the C++ binding's, tools/python_module.cc)."""

from __future__ import annotations

_GIB = 1 << 30


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
        f"  {'recorded (trace)':<24} {r['recorded_modeled_driver_us']:,.1f} us = "
        f"{r['recorded_driver_time_pct_of_span']:.3f}% of the span (the trace's segment events, "
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
    return [""] + [f"  {a:<26} {b:<34} {c}" for a, b, c in [header] + rows] + [
        "  at end: reserved - allocated is the cache the program still held when the trace ended "
        "(empty_cache() or the process's exit returns it)"]


def _recorded_heading(r: dict) -> str:
    """The recorded column's heading: which policy wrote the trace's segments, so a replay under
    another conf is not read as that policy's figures (as the C++ table's)."""
    if r["recorded_segment_maps"]:
        return "recorded (trace, expandable)"
    if r["recorded_segment_allocs"]:
        return "recorded (trace, native)"
    return "recorded (trace)"


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


def format_table(r: dict) -> str:
    """The replay's table (as the C++ one, tools/replay/replay_report.cc), with the program's
    releases and the plan's refusals at the end."""
    recorded_reserved = "n/a (no segment events in the trace)"
    if r["recorded_segment_allocs"]:
        recorded_reserved = _bytes(r["recorded_peak_reserved_bytes"])
    rows = [
        ("", "vramledger (replay)", _recorded_heading(r)),
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
    lines += format_releases(r["releases"]) + format_plan(r)
    return "\n".join(lines) + "\n"


def format_releases(rel: dict) -> list[str]:
    """The program's releases (runs of segment_free / segment_unmap in the trace) and what the
    replay did with them; nothing when the trace has none."""
    if not rel["runs"]:
        return []
    lines = ["", f"  program's releases: {rel['runs']:,} in the trace "
                 f"({rel['empty_cache_runs']:,} empty_cache(), {rel['retry_runs']:,} out-of-memory "
                 f"retries; {_bytes(rel['trace_bytes'])} released by torch)"]
    if not rel["followed"]:
        lines.append("  not applied (--ignore-releases): the replay kept its cache")
        return lines
    line = (f"  applied {rel['applied']:,} (the replay's cache emptied there, "
            f"{_bytes(rel['replay_released_bytes'])} returned)")
    if rel["skipped"]:
        line += (f"; {rel['skipped']:,} retries skipped: the replay was not as full as torch "
                 "when torch ran out")
    return lines + [line]


def format_stack(refusal: dict) -> list[str]:
    """The refusal's stack lines (innermost first) as recorded in a snapshot, or why none."""
    frames = refusal.get("stack")
    if frames:
        return (["  stack (innermost first), as the snapshot recorded it for this allocation:"] +
                [f"    {f['filename']}:{f['line']} in {f['name']}" for f in frames])
    return [f"  stack: none ({refusal.get('stack_note', 'no frames recorded')})"]


def format_plan(r: dict) -> list[str]:
    """The plan's line (cap, refusals, warnings) and each listed refusal: the trace line and
    row, the guard's message (plan line, rule, live bytes by category) and the stack."""
    plan = r.get("plan")
    if not plan:
        return []
    cap = f"cap on reserved {_bytes(plan['cap_bytes'])}" if plan["cap_bytes"] else \
        "no cap on reserved"
    line = f"  plan {plan['path']} (device {plan['device']}): {cap}; refusals: {plan['refusals']:,}"
    if plan["refusals"]:
        line += (" (the replay stopped at the first)" if plan["stopped"] else
                 " (each refused allocation skipped, the replay went on)")
    lines = ["", line + f"; warn_at warnings: {plan['warnings']:,}"]
    for i, refusal in enumerate(plan["listed"], 1):
        lines.append(f"  refusal {i} at {r['trace']}:{refusal['line']} (trace event "
                     f"{refusal['event']:,}): {refusal['row']}")
        lines += ["    " + text for text in refusal["message"].splitlines()]
        lines += ["  " + text for text in format_stack(refusal)]
    if plan["refusals"] > len(plan["listed"]):
        lines.append(f"  ({plan['refusals'] - len(plan['listed']):,} more refusals not listed)")
    return lines
