# Reading a memory snapshot (vramledger's or torch's): totals like memory_summary, fragmentation,
# live allocations by innermost user frame, the timeline, and diffs. Pure functions.
"""Analysis of memory snapshots for ``vramledger inspect`` and ``vramledger diff``.

Everything here works on the snapshot dict alone (torch.cuda.memory._snapshot()'s shape), so a
snapshot written by torch's own allocator reads the same as one written by vramledger. Sizes are
bytes; the timeline's x axis is the index of the trace entry.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from vramledger import _timeline

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


def _counters() -> dict:
    keys = ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
            "inactive_split_bytes", "allocation", "active", "segment", "inactive_split")
    return {pool: dict.fromkeys(keys, 0) for pool in _POOLS}


def device_summary(snap: dict, device: int, top: int = 10) -> dict:
    """Figures of one device from its segments: memory_summary's current values per pool,
    fragmentation, holes per stream, the largest free block, and the `top` groups of live
    allocations by innermost user frame."""
    pools = _counters()
    free_bytes = largest_free = holes = hole_bytes = 0
    streams: dict[int, dict] = {}
    groups: dict[tuple, dict] = {}
    on_device = [s for s in snap["segments"] if int(s.get("device", 0)) == device]
    # A paused region's ranges hold no memory now (docs/design/regions.md): listed apart.
    paused = [s for s in on_device if s.get("paused")]
    segments = [s for s in on_device if not s.get("paused")]
    for seg in segments:
        pool = "small_pool" if seg.get("segment_type") == "small" else "large_pool"
        blocks = seg["blocks"]
        has_active = any(b["state"] in _ACTIVE for b in blocks)
        stream = streams.setdefault(int(seg.get("stream", 0)), {
            "holes": 0, "hole_bytes": 0, "free_bytes": 0, "largest_free_block": 0, "segments": 0})
        stream["segments"] += 1
        for counters in (pools["all"], pools[pool]):
            counters["reserved_bytes"] += int(seg["total_size"])
            counters["segment"] += 1
        for b in blocks:
            size, state = int(b["size"]), b["state"]
            if state in _ACTIVE:
                for counters in (pools["all"], pools[pool]):
                    counters["active_bytes"] += size
                    counters["active"] += 1
                    counters["requested_bytes"] += int(b.get("requested_size", size))
                    if state == "active_allocated":
                        counters["allocated_bytes"] += size
                        counters["allocation"] += 1
                if state == "active_allocated":
                    key = innermost_user_frame(b.get("frames", []))
                    g = groups.setdefault(key, {"bytes": 0, "requested_bytes": 0, "count": 0,
                                                "largest": 0, "frames": []})
                    g["bytes"] += size
                    g["requested_bytes"] += int(b.get("requested_size", size))
                    g["count"] += 1
                    if size > g["largest"]:
                        g["largest"], g["frames"] = size, list(b.get("frames", []))
                continue
            free_bytes += size
            largest_free = max(largest_free, size)
            stream["free_bytes"] += size
            stream["largest_free_block"] = max(stream["largest_free_block"], size)
            if len(blocks) > 1:
                for counters in (pools["all"], pools[pool]):
                    counters["inactive_split_bytes"] += size
                    counters["inactive_split"] += 1
            if has_active:
                holes += 1
                hole_bytes += size
                stream["holes"] += 1
                stream["hole_bytes"] += size
    reserved = pools["all"]["reserved_bytes"]
    allocated = pools["all"]["allocated_bytes"]
    top_groups = sorted(groups.items(), key=lambda kv: (-kv[1]["bytes"], kv[0]))[:max(top, 0)]
    return {
        "device": device,
        "segments": len(segments),
        "blocks": sum(len(s["blocks"]) for s in segments),
        "paused_segments": len(paused),
        "paused_bytes": sum(int(s["total_size"]) for s in paused),
        "paused_allocated_bytes": sum(int(b["size"]) for s in paused for b in s["blocks"]
                                      if b["state"] == "active_allocated"),
        "trace_entries": len(snap["device_traces"][device])
        if device < len(snap.get("device_traces", [])) else 0,
        "pools": pools,
        "fragmentation": {
            "reserved_bytes": reserved,
            "allocated_bytes": allocated,
            "free_bytes": free_bytes,
            "largest_free_block": largest_free,
            "holes": holes,
            "hole_bytes": hole_bytes,
            "utilization": allocated / reserved if reserved else 0.0,
            "free_space_fragmentation": 1.0 - largest_free / free_bytes if free_bytes else 0.0,
        },
        "holes_per_stream": [dict(stream=s, **v) for s, v in sorted(streams.items())],
        "top_allocations": [
            {"frame": frame_text(k), "filename": k[0], "line": k[1], "name": k[2], **v}
            for k, v in top_groups],
        "live_allocations": sum(g["count"] for g in groups.values()),
        "stats": _vramledger_stats(snap, device),
        # "all", "some" or "none" of the segments: torch keeps no segment counts for them.
        "expandable": ("none" if not any(s.get("is_expandable") for s in segments) else
                       "all" if all(s.get("is_expandable") for s in segments) else "some"),
    }


def _vramledger_stats(snap: dict, device: int) -> dict | None:
    extra = snap.get("vramledger")
    if not isinstance(extra, dict):
        return None
    for d in extra.get("devices", []) or []:
        if isinstance(d, dict) and d.get("device") == device:
            return d.get("stats")
    return None


def summarize(snap: dict, top: int = 10) -> dict:
    """The whole inspection as plain values: one device_summary per device, the snapshot's
    origin ('vramledger' with its version, or 'torch') and allocator settings."""
    extra = snap.get("vramledger") if isinstance(snap.get("vramledger"), dict) else None
    return {
        "origin": f"vramledger {extra.get('version', '?')}" if extra else "torch",
        "history": extra.get("history") if extra else None,
        "allocator_settings": snap.get("allocator_settings", {}),
        "devices": [device_summary(snap, d, top) for d in devices_of(snap)],
    }


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


def timeline(snap: dict, device: int) -> dict:
    """Allocated (live requested bytes) and reserved bytes after each trace entry of `device`,
    reconstructed backwards from the snapshot's own state (so a ring buffer that starts mid-run
    still has the right absolute values). Lists of length entries + 1 (index 0: before the
    first entry)."""
    traces = snap.get("device_traces", [])
    entries = traces[device] if device < len(traces) else []
    segs = [s for s in snap["segments"] if int(s.get("device", 0)) == device]
    live = sum(int(b.get("requested_size", b["size"])) for s in segs for b in s["blocks"]
               if b["state"] in _ACTIVE)
    reserved = sum(int(s["total_size"]) for s in segs)
    n = len(entries)
    allocated_series, reserved_series = [0] * (n + 1), [0] * (n + 1)
    allocated_series[n], reserved_series[n] = live, reserved
    for i in range(n - 1, -1, -1):
        e = entries[i]
        action, size = e.get("action"), int(e.get("size", 0))
        if action == "alloc":
            live -= size
        elif action == "free_completed":
            live += size
        elif action in ("segment_alloc", "segment_map"):
            reserved -= size
        elif action in ("segment_free", "segment_unmap"):
            reserved += size
        allocated_series[i], reserved_series[i] = live, reserved
    return {"device": device, "entries": n, "allocated": allocated_series,
            "reserved": reserved_series}


def downsample(values: list, width: int) -> list[tuple[int, int]]:
    """(index, value) pairs, at most about 2*width, keeping each bucket's first and max points so
    peaks survive."""
    n = len(values)
    if n <= 2 * width:
        return list(enumerate(values))
    out = []
    step = n / width
    for b in range(width):
        lo, hi = int(b * step), max(int((b + 1) * step), int(b * step) + 1)
        peak = max(range(lo, min(hi, n)), key=values.__getitem__)
        out.append((lo, values[lo]))
        if peak != lo:
            out.append((peak, values[peak]))
    out.append((n - 1, values[-1]))
    return out


def plot_png(snap: dict, path: str, title: str) -> list[int]:
    """Draws allocated and reserved over the trace, one panel per device with a trace, into a
    PNG, SVG or PDF by the name's extension (_timeline.plot_format; matplotlib, Agg backend).
    Returns the devices drawn.

    Raises:
      ValueError: the snapshot has no trace entries. ImportError: matplotlib is missing.
      OSError: the file cannot be written. _timeline.TimelineError: another extension.
    """
    fmt = _timeline.plot_format(path)
    devices = [d for d in devices_of(snap) if timeline(snap, d)["entries"] > 0]
    if not devices:
        raise ValueError("the snapshot has no trace entries (device_traces is empty), so there "
                         "is no timeline to plot; record with enabled='all'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(devices), 1, figsize=(11, 3.6 * len(devices)), squeeze=False)
    for ax, d in zip(axes[:, 0], devices):
        t = timeline(snap, d)
        x = range(len(t["reserved"]))
        gib = 1 << 30
        ax.plot(x, [v / gib for v in t["reserved"]], label="reserved", color="#d62728")
        ax.plot(x, [v / gib for v in t["allocated"]], label="allocated (live requested)",
                color="#1f77b4")
        ax.set_title(f"{title}: device {d}".replace("$", r"\$"))  # a name is not mathtext
        ax.set_xlabel("trace entry")
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110, format=fmt)
    finally:
        plt.close(fig)
    return devices


def _live_by_stack(snap: dict) -> dict[tuple, dict]:
    groups: dict[tuple, dict] = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = b.get("frames") or []
            key = tuple((str(f.get("filename", "?")), int(f.get("line", 0)),
                         str(f.get("name", "?"))) for f in frames) or (NO_STACK,)
            g = groups.setdefault(key, {"bytes": 0, "count": 0})
            g["bytes"] += int(b["size"])
            g["count"] += 1
    return groups


def diff(a: dict, b: dict, top: int = 20) -> dict:
    """What grew from snapshot `a` to `b`: live bytes per allocating stack (all frames), sorted
    by growth; plus reserved/allocated totals of both."""
    ga, gb = _live_by_stack(a), _live_by_stack(b)
    rows = []
    for key in set(ga) | set(gb):
        before, after = ga.get(key, {"bytes": 0, "count": 0}), gb.get(key, {"bytes": 0, "count": 0})
        delta = after["bytes"] - before["bytes"]
        frames = [{"filename": f, "line": l, "name": n} for f, l, n in key if (f, l, n) != NO_STACK]
        rows.append({"delta_bytes": delta, "bytes_before": before["bytes"],
                     "bytes_after": after["bytes"], "count_before": before["count"],
                     "count_after": after["count"],
                     "frame": frame_text(innermost_user_frame(frames)),
                     "stack": [frame_text((f["filename"], f["line"], f["name"])) for f in frames]})
    grew = sorted((r for r in rows if r["delta_bytes"] > 0), key=lambda r: -r["delta_bytes"])
    shrank = sum(-r["delta_bytes"] for r in rows if r["delta_bytes"] < 0)

    def totals(s: dict) -> dict:
        blocks = [blk for x in s["segments"] for blk in x["blocks"]]
        return {"reserved_bytes": sum(int(x["total_size"]) for x in s["segments"]),
                "allocated_bytes": sum(int(blk["size"]) for blk in blocks
                                       if blk["state"] == "active_allocated")}

    return {"before": totals(a), "after": totals(b), "grew": grew[:max(top, 0)],
            "stacks_grew": len(grew), "bytes_grew": sum(r["delta_bytes"] for r in grew),
            "bytes_shrank": shrank}


def format_diff(d: dict, a_name: str, b_name: str, stack_depth: int = 4) -> str:
    out = [f"vramledger diff: {a_name} -> {b_name}"]
    for key, label in (("reserved_bytes", "reserved"), ("allocated_bytes", "allocated")):
        before, after = d["before"][key], d["after"][key]
        out.append(f"  {label:<10} {fmt_bytes(before):>12} -> {fmt_bytes(after):>12} "
                   f"({'+' if after >= before else '-'}{fmt_bytes(abs(after - before))})")
    stacks = "stack" if d["stacks_grew"] == 1 else "stacks"
    out += [f"  live bytes grew by {fmt_bytes(d['bytes_grew'])} over {d['stacks_grew']} {stacks} "
            f"and shrank by {fmt_bytes(d['bytes_shrank'])}", ""]
    if not d["grew"]:
        out.append("  nothing grew")
    for i, r in enumerate(d["grew"], 1):
        out.append(f"  {i:>3}. +{fmt_bytes(r['delta_bytes']):<12} ({fmt_bytes(r['bytes_before'])}"
                   f" in {r['count_before']} -> {fmt_bytes(r['bytes_after'])} in "
                   f"{r['count_after']})  {r['frame']}")
        for frame in _first(r["stack"], stack_depth):
            out.append(f"          {frame}")
    return "\n".join(out) + "\n"


def _first(items: Iterable[Any], n: int) -> list:
    return list(items)[:n]
