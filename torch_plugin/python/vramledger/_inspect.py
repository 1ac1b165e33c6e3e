# Reading a memory snapshot (vramledger's or torch's): totals like memory_summary, fragmentation,
# live allocations by innermost user frame, the timeline, and diffs. Pure functions, each part in
# its own module; this one gathers them under the names the commands and the HTML report use.
"""Analysis of memory snapshots for ``vramledger inspect`` and ``vramledger diff``.

Everything here works on the snapshot dict alone (torch.cuda.memory._snapshot()'s shape), so a
snapshot written by torch's own allocator reads the same as one written by vramledger. Sizes are
bytes; the timeline's x axis is the index of the trace entry.
"""

from __future__ import annotations

from vramledger._inspect_diff import _first, _live_by_stack, diff, format_diff
from vramledger._inspect_frames import (_ACTIVE, _LIBRARY, _POOLS, NO_STACK, devices_of,
                                        fmt_bytes, frame_text, innermost_user_frame,
                                        is_python_frame, is_user_frame)
from vramledger._inspect_summary import _counters, _vramledger_stats, device_summary, summarize
from vramledger._inspect_text import (_NOT_KEPT_WITH_EXPANDABLE, _ROWS, expandable_note,
                                      format_summary, peak_text)
from vramledger._inspect_timeline import downsample, plot_png, timeline

__all__ = [
    "NO_STACK", "device_summary", "devices_of", "diff", "downsample", "expandable_note",
    "fmt_bytes", "format_diff", "format_summary", "frame_text", "innermost_user_frame",
    "is_python_frame", "is_user_frame", "peak_text", "plot_png", "summarize", "timeline",
]
