# One device's figures from a snapshot's segments: memory_summary's current values per pool,
# fragmentation, holes per stream and live allocations by innermost user frame. Pure functions.
"""The figures of ``vramledger inspect``, computed from the snapshot dict alone."""

from __future__ import annotations

from vramledger._inspect_frames import (_ACTIVE, _POOLS, devices_of, frame_text,
                                        innermost_user_frame)


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
