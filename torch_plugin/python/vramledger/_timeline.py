# The replay timeline for `vramledger replay --timeline/--plot`: writes the CSV that the C++ replay
# produced and draws it as a PNG, SVG or PDF (matplotlib, Agg backend). Stateless functions; no
# shared state.
"""Timeline output of ``vramledger replay``.

The CSV comes from the C++ replay (``vramledger._core``, ``timeline=True``) with the columns of
``_core.TIMELINE_CSV_HEADER``: ``event,line,time_us,allocated_bytes,reserved_bytes,wasted_bytes,
requested_bytes,recorded_reserved_bytes,driver_us``. Bytes are bytes, times microseconds.
"""

from __future__ import annotations

import csv
import io
import os

_GIB = 1 << 30


class TimelineError(Exception):
    """A timeline could not be written or drawn; the message names the file."""


def write_csv(text: str, path: str) -> None:
    """Writes the timeline CSV `text` to `path` unchanged. Raises TimelineError."""
    try:
        with open(path, "w", newline="", encoding="ascii") as f:
            f.write(text)
    except OSError as e:
        raise TimelineError(f"{path}: cannot write the timeline: {e.strerror or e}") from e


def parse_csv(text: str) -> dict[str, list[float]]:
    """The timeline CSV as {column: values} (integers for bytes, floats for driver_us)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        return {}
    return {key: [float(r[key]) if key == "driver_us" else int(r[key]) for r in rows]
            for key in rows[0]}


# File formats --plot writes, by the name's extension (matplotlib's names for them).
PLOT_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def plot_format(path: str) -> str:
    """The file format for a --plot path, from its extension (case-insensitive). Raises
    TimelineError naming the accepted extensions for any other name."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in PLOT_FORMATS:
        raise TimelineError(f"{path}: --plot writes {', '.join(PLOT_FORMATS)} files; name it with "
                            "one of these extensions")
    return PLOT_FORMATS[ext]


def plot(text: str, path: str, title: str) -> None:
    """Draws the timeline CSV `text` at `path` (PNG, SVG or PDF by its extension, plot_format):
    the replay's allocated, reserved and wasted bytes and the trace's own recorded reserved bytes
    (torch) over time, in GiB.

    The x axis is seconds since the trace's first sampled event, or the event number when the
    trace has no times. Raises TimelineError when the extension is none of PLOT_FORMATS,
    matplotlib is missing or the file cannot be written.
    """
    fmt = plot_format(path)
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display: render to a file only
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise TimelineError(f"--plot needs matplotlib ({e}); pip install matplotlib") from e
    columns = parse_csv(text)
    if not columns:
        raise TimelineError(f"{path}: the timeline is empty (the trace has no events)")
    times = columns["time_us"]
    if max(times) > min(times):
        x = [(t - times[0]) / 1e6 for t in times]
        xlabel = "time since the trace's first event (s)"
    else:
        x = columns["event"]
        xlabel = "trace event"

    def gib(key: str) -> list[float]:
        return [v / _GIB for v in columns[key]]

    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    try:
        # The band between allocated and reserved is the waste (waste drawn up from zero
        # covered the allocated line and was hard to read).
        ax.fill_between(x, gib("allocated_bytes"), gib("reserved_bytes"), step="post",
                        color="tab:red", alpha=0.25,
                        label="wasted, replay (reserved - allocated, between the lines)")
        ax.plot(x, gib("recorded_reserved_bytes"), drawstyle="steps-post", color="tab:gray",
                linestyle="--", linewidth=1.4, label="reserved, recorded (trace: torch)")
        ax.plot(x, gib("reserved_bytes"), drawstyle="steps-post", color="tab:blue",
                linewidth=1.4, label="reserved, replay (vramledger)")
        ax.plot(x, gib("allocated_bytes"), drawstyle="steps-post", color="tab:green",
                linewidth=1.0, label="allocated, replay")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        directory = os.path.dirname(path)
        if directory and not os.path.isdir(directory):
            raise TimelineError(f"{path}: cannot write the plot: no directory {directory}")
        try:
            fig.savefig(path, format=fmt)
        except OSError as e:
            raise TimelineError(f"{path}: cannot write the plot: {e.strerror or e}") from e
    finally:
        plt.close(fig)
