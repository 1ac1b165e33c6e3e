# `vramledger diff`: live bytes per allocating stack in two snapshots, what grew, and its text
# report. Pure functions.
"""What grew between two memory snapshots, by stack."""

from __future__ import annotations

from typing import Any, Iterable

from vramledger._inspect_frames import NO_STACK, fmt_bytes, frame_text, innermost_user_frame


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
