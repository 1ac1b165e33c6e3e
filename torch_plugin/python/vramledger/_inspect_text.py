# The text report of `vramledger inspect`: memory_summary's table, the fragmentation figures,
# holes per stream and the top live allocations. Pure functions.
"""Formats inspect's summary as text; the Peak cells are shared with the HTML report."""

from __future__ import annotations

from vramledger._inspect_frames import _POOLS, fmt_bytes

_ROWS = (("Allocated memory", "allocated_bytes", True), ("Active memory", "active_bytes", True),
         ("Requested memory", "requested_bytes", True),
         ("GPU reserved memory", "reserved_bytes", True),
         ("Non-releasable memory", "inactive_split_bytes", True),
         ("Allocations", "allocation", False), ("Active allocs", "active", False),
         ("GPU reserved segments", "segment", False),
         ("Non-releasable allocs", "inactive_split", False))


# Stats torch leaves at 0 with expandable segments (docs/design/torch-facts.md §5): peak unknown.
_NOT_KEPT_WITH_EXPANDABLE = ("segment", "inactive_split", "inactive_split_bytes")


def peak_text(d: dict, key: str, pool: str, show) -> str:
    """The Peak cell of `key` in `pool` for device summary `d` (text and HTML reports): the
    stat's peak; "n/a *" where torch keeps the stat at 0 because every segment is expandable;
    the peak marked "*" where only the plain segments count (some are expandable)."""
    peak = (d["stats"] or {}).get(f"{key}.{pool}.peak")
    kind = d.get("expandable", "none")
    if key in _NOT_KEPT_WITH_EXPANDABLE and kind == "all":
        return "n/a *"  # a 0 peak under a nonzero Cur misled
    if peak is None:
        return "n/a"
    return f"{show(peak)} *" if key in _NOT_KEPT_WITH_EXPANDABLE and kind == "some" else show(peak)


def expandable_note(d: dict) -> str | None:
    """The footnote for peak_text's "*", or None when no segment is expandable."""
    kind = d.get("expandable", "none")
    if kind == "none":
        return None
    return ("* expandable segments: torch keeps no segment or inactive_split stats for them "
            "(they stay 0); Cur counts the snapshot's mapped ranges and the free pieces beside "
            "live blocks in them" + ("" if kind == "all" else
                                     ", Peak the plain (contiguous) segments only"))


def format_summary(summary: dict, source: str) -> str:
    """The text report of `vramledger inspect`."""
    out = [f"vramledger inspect: {source} ({summary['origin']} snapshot)"]
    h = summary.get("history")
    if h:
        limit = h.get("max_entries")
        # INT64_MAX is how a replay (and max_entries=None) writes "no limit".
        limit = "all" if isinstance(limit, int) and limit >= (1 << 63) - 1 else limit
        if h.get("context") and h["context"] != "None":  # older snapshots wrote the word
            context = f"context={h['context']} stacks={h.get('stacks')}"
        else:  # `stacks` says which frames a context would record: beside None it misled
            context = "context=None (no stacks recorded)"
        out.append(f"history: enabled={h.get('enabled')} {context} max_entries={limit}")
    if not summary["devices"]:
        out.append("no segments and no trace: the snapshot is empty")
    for d in summary["devices"]:
        out += ["", f"device {d['device']}: {d['segments']} segments, {d['blocks']} blocks, "
                    f"{d['live_allocations']} live allocations, "
                    f"{d['trace_entries']} trace entries"]
        if d.get("paused_segments"):
            out.append(f"  paused regions: {d['paused_segments']} ranges, "
                       f"{fmt_bytes(d['paused_bytes'])} released, "
                       f"{fmt_bytes(d['paused_allocated_bytes'])} of live blocks (not counted below)")
        stats = d["stats"] or {}
        out.append(f"  {'Metric':<28} {'Cur Usage':>14} {'Peak Usage':>14}")
        for label, key, is_bytes in _ROWS:
            for pool in _POOLS:
                name = label if pool == "all" else f"    from {pool.replace('_', ' ')}"
                cur = d["pools"][pool][key]
                show = fmt_bytes if is_bytes else (lambda v: f"{v:,}")
                out.append(f"  {name:<28} {show(cur):>14} {peak_text(d, key, pool, show):>14}")
        note = expandable_note(d)
        if note:
            out.append(f"  {note}")
        f = d["fragmentation"]
        out += ["", "  fragmentation:",
                f"    utilization (allocated / reserved, now): {f['utilization']:.2%}",
                f"    free (cached) bytes: {fmt_bytes(f['free_bytes'])}; largest free block: "
                f"{fmt_bytes(f['largest_free_block'])}",
                f"    free-space fragmentation (1 - largest free / free): "
                f"{f['free_space_fragmentation']:.2%}",
                f"    holes (free blocks beside live ones): {f['holes']:,}, "
                f"{fmt_bytes(f['hole_bytes'])}"]
        if "utilization" in stats:
            out.append(f"    utilization (peak allocated / peak reserved): "
                       f"{stats['utilization']:.2%}")
        out += ["", "  holes per stream:",
                f"    {'stream':<18} {'holes':>7} {'hole bytes':>12} {'free bytes':>12} "
                f"{'largest free':>13}"]
        for s in d["holes_per_stream"]:
            out.append(f"    {s['stream']:<18} {s['holes']:>7,} {fmt_bytes(s['hole_bytes']):>12} "
                       f"{fmt_bytes(s['free_bytes']):>12} "
                       f"{fmt_bytes(s['largest_free_block']):>13}")
        out += ["", f"  top {len(d['top_allocations'])} live allocations by innermost user frame:",
                f"    {'#':>3} {'bytes':>12} {'count':>7}  frame"]
        for i, g in enumerate(d["top_allocations"], 1):
            out.append(f"    {i:>3} {fmt_bytes(g['bytes']):>12} {g['count']:>7,}  {g['frame']}")
    return "\n".join(out) + "\n"
