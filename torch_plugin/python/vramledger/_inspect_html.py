# The self-contained HTML page of `vramledger inspect --html`: inline SVG timelines and tables,
# no scripts and no network. Pure functions.
"""HTML report of a snapshot: totals, fragmentation, holes per stream, top stacks, timeline."""

from __future__ import annotations

import html
from typing import Any

from vramledger import _inspect

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:17px;margin-top:28px}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f3f3f3;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
code{font-size:12px}details summary{cursor:pointer}.muted{color:#777}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(header: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td class=n>{_e(c)}</td>" if i in numeric else f"<td>{c}</td>"
                         for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def timeline_svg(t: dict, width: int = 900, height: int = 260) -> str:
    """An inline SVG of allocated and reserved (GiB) over the trace entries of one device."""
    n = len(t["reserved"])
    if t["entries"] == 0:
        return "<p class=muted>no trace entries for this device</p>"
    left, right, top, bottom = 60, 10, 10, 30
    w, h = width - left - right, height - top - bottom
    ymax = max(max(t["reserved"]), max(t["allocated"]), 1)

    def points(values: list[int]) -> str:
        return " ".join(f"{left + i * w / max(n - 1, 1):.1f},{top + h - v * h / ymax:.1f}"
                        for i, v in _inspect.downsample(values, width))

    ticks = []
    for k in range(5):
        v = ymax * k / 4
        y = top + h - v * h / ymax
        ticks.append(f'<line x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#eee"/><text x="{left - 6}" y="{y + 4:.1f}" font-size="11" '
                     f'text-anchor="end">{v / (1 << 30):.1f}</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="allocated and reserved over the trace">'
        + "".join(ticks)
        + f'<polyline fill="none" stroke="#d62728" stroke-width="1.4" '
          f'points="{points(t["reserved"])}"/>'
        + f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.4" '
          f'points="{points(t["allocated"])}"/>'
        + f'<text x="{left}" y="{height - 8}" font-size="11">trace entry 0 .. {n - 1}; GiB; '
          f'<tspan fill="#d62728">reserved</tspan>, '
          f'<tspan fill="#1f77b4">allocated (live requested)</tspan></text></svg>')


def render(snap: dict, summary: dict, source: str) -> str:
    """The page: one section per device."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>vramledger: {_e(source)}"
             f"</title><style>{_CSS}</style></head><body>",
             f"<h1>vramledger inspect: {_e(source)}</h1>",
             f"<p class=muted>{_e(summary['origin'])} snapshot</p>"]
    settings = summary.get("allocator_settings") or {}
    if settings:
        parts.append("<details><summary>allocator settings</summary>" + _table(
            ["key", "value"], [[_e(k), _e(v)] for k, v in settings.items()]) + "</details>")
    for d in summary["devices"]:
        dev = d["device"]
        parts.append(f"<h2>device {dev}</h2><p>{d['segments']} segments, {d['blocks']} blocks, "
                     f"{d['live_allocations']} live allocations, {d['trace_entries']} trace "
                     f"entries</p>")
        parts.append("<h3>timeline</h3>" + timeline_svg(_inspect.timeline(snap, dev)))
        rows = []
        for label, key, is_bytes in _inspect._ROWS:
            for pool in _inspect._POOLS:
                show = _inspect.fmt_bytes if is_bytes else (lambda v: f"{v:,}")
                name = label if pool == "all" else f"&nbsp;&nbsp;from {pool.replace('_', ' ')}"
                rows.append([name, show(d["pools"][pool][key]),
                             _inspect.peak_text(d, key, pool, show)])
        parts.append("<h3>totals</h3>" + _table(["metric", "current", "peak"], rows, {1, 2}))
        note = _inspect.expandable_note(d)
        if note:
            parts.append(f"<p>{_e(note)}</p>")
        f = d["fragmentation"]
        parts.append("<h3>fragmentation</h3>" + _table(["figure", "value"], [
            ["utilization (allocated / reserved, now)", f"{f['utilization']:.2%}"],
            ["free (cached) bytes", _inspect.fmt_bytes(f["free_bytes"])],
            ["largest free block", _inspect.fmt_bytes(f["largest_free_block"])],
            ["free-space fragmentation (1 - largest / free)",
             f"{f['free_space_fragmentation']:.2%}"],
            ["holes", f"{f['holes']:,} ({_inspect.fmt_bytes(f['hole_bytes'])})"]], {1}))
        parts.append("<h3>holes per stream</h3>" + _table(
            ["stream", "segments", "holes", "hole bytes", "free bytes", "largest free"],
            [[s["stream"], s["segments"], s["holes"], _inspect.fmt_bytes(s["hole_bytes"]),
              _inspect.fmt_bytes(s["free_bytes"]), _inspect.fmt_bytes(s["largest_free_block"])]
             for s in d["holes_per_stream"]], {0, 1, 2, 3, 4, 5}))
        rows = []
        for g in d["top_allocations"]:
            texts = [_inspect.frame_text((fr.get("filename"), fr.get("line"), fr.get("name")))
                     for fr in g["frames"][:30]]
            stack = "<br>".join(f"<code>{_e(t)}</code>" for t in texts) or \
                "<span class=muted>no frames</span>"
            rows.append([_inspect.fmt_bytes(g["bytes"]), f"{g['count']:,}",
                         f"<details><summary><code>{_e(g['frame'])}</code></summary>{stack}"
                         f"</details>"])
        parts.append("<h3>top live allocations by innermost user frame</h3>"
                     + _table(["bytes", "count", "frame (click: stack of the largest block)"],
                              rows, {0, 1}))
    parts.append("</body></html>\n")
    return "".join(parts)
