# Allocated and reserved bytes over a snapshot's trace, rebuilt from its final state, and the
# plot of `vramledger inspect --plot`. Pure functions (the plot writes one file).
"""The timeline of a snapshot's trace, its downsampling for drawing, and its plot."""

from __future__ import annotations

from vramledger import _timeline
from vramledger._inspect_frames import _ACTIVE, devices_of


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
