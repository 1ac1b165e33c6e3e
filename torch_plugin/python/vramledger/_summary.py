"""torch.cuda.memory_summary()'s table and memory_stats_as_nested_dict(), built from a flat
memory_stats() dict; pure Python (no torch), so it is testable against torch's recorded sample.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

_WIDTH = 75
_SIZE_UNITS = ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = (" ", "K", "M")

# (stats key, row label, kind) for the rows with large/small pool sub-rows.
_POOLED_ROWS = (
    ("allocated_bytes", "Allocated memory", "size"),
    ("active_bytes", "Active memory", "size"),
    ("requested_bytes", "Requested memory", "size"),
    ("reserved_bytes", "GPU reserved memory", "size"),
    ("inactive_split_bytes", "Non-releasable memory", "size"),
    ("allocation", "Allocations", "count"),
    ("active", "Active allocs", "count"),
    ("segment", "GPU reserved segments", "count"),
    ("inactive_split", "Non-releasable allocs", "count"),
)
_OVERSIZE_ROWS = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize GPU segments"),
)
_SUBROWS = (("large_pool", "      from large pool"), ("small_pool", "      from small pool"))
_COLUMNS = ("current", "peak", "allocated", "freed")


def _format_size(value: int, reference: float) -> str:
    """`value` in the unit chosen by `reference` (the row's first value): a larger unit once the
    reference reaches 768 of the current one; right-aligned in 6 digits plus the unit."""
    unit = _SIZE_UNITS[0]
    for next_unit in _SIZE_UNITS[1:]:
        if reference < 768 * 1024:
            break
        unit = next_unit
        value //= 1024
        reference /= 1024
    return f"{value:6d} {unit}"


def _format_count(value: int, reference: float) -> str:
    """A count in units of 1, K or M, switching once the reference reaches 750 of the unit."""
    unit = _COUNT_UNITS[0]
    for next_unit in _COUNT_UNITS[1:]:
        if reference < 750 * 1000:
            break
        unit = next_unit
        value //= 1000
        reference /= 1000
    return f"{value:7d} {unit} "


_FORMATTERS: dict[str, Callable[[int, float], str]] = {"size": _format_size,
                                                        "count": _format_count}


def _row(label: str, values: list[int], references: list[int],
         formatter: Callable[[int, float], str]) -> str:
    cells = " | ".join(formatter(v, r) for v, r in zip(values, references))
    return f" {label:<21} | {cells} "


def format_summary(stats: Mapping[str, Any], device: int, abbreviated: bool = False) -> str:
    """The text torch.cuda.memory_summary(device, abbreviated) prints for `stats` (a flat
    memory_stats() dict), byte for byte: a 75-column table framed by '|'.

    Raises:
      KeyError: a key the table needs is missing from `stats` (as torch's would).
    """
    lines = ["=" * _WIDTH,
             f" {'':16} PyTorch CUDA memory summary, device ID {device:<17d} ",
             "-" * _WIDTH,
             f"  {'':9} CUDA OOMs: {stats['num_ooms']:<12d} | {'':6} cudaMalloc retries: "
             f"{stats['num_alloc_retries']:<8d}  ",
             "=" * _WIDTH,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    for key, label, kind in _POOLED_ROWS:
        lines.append("-" * _WIDTH)
        subrows = [("all", label)] + ([] if abbreviated else list(_SUBROWS))
        references: list[int] | None = None
        for pool, sublabel in subrows:
            values = [stats[f"{key}.{pool}.{column}"] for column in _COLUMNS]
            if references is None:  # units follow the "all" row, as in torch
                references = values
            lines.append(_row(sublabel, values, references, _FORMATTERS[kind]))
    for key, label in _OVERSIZE_ROWS:
        lines.append("-" * _WIDTH)
        values = [stats[f"{key}.{column}"] for column in _COLUMNS]
        lines.append(_row(label, values, values, _format_count))
    lines.append("=" * _WIDTH)
    regions = _regions_of(stats)
    if regions:  # vramledger's pausable regions, below torch's table
        lines.append("        Region         |  Reserved  |   Mapped   | Allocated  | Backed up  ")
        lines.append("-" * _WIDTH)
        for name, figures in regions.items():
            label = f"{name[:14]} {'paused' if figures.get('paused') else 'running'}"
            values = [figures.get(f, 0) for f in _REGION_COLUMNS]
            lines.append(_row(label, values, values, _format_size))
        lines.append("=" * _WIDTH)
    return "|" + "|\n|".join(lines) + "|\n"


# The region figures the summary shows, in its columns' order (memory_stats'
# "regions.<name>.<figure>" keys).
_REGION_COLUMNS = ("reserved_bytes", "mapped_bytes", "allocated_bytes", "backed_up_bytes")
_REGION_FIELDS = _REGION_COLUMNS + ("paused_bytes", "host_buffer_bytes", "lost_bytes", "paused")


def _regions_of(stats: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """{region name: {figure: value}} from the "regions.<name>.<figure>" keys of `stats`, in
    their order (a name may hold dots: the figure is the last part)."""
    regions: dict[str, dict[str, int]] = {}
    for key, value in stats.items():
        if not key.startswith("regions."):
            continue
        name, _, field = key[len("regions."):].rpartition(".")
        if name and field in _REGION_FIELDS:
            regions.setdefault(name, {})[field] = value
    return regions


def nest(stats: Mapping[str, Any]) -> dict[str, Any]:
    """A flat memory_stats() dict ("a.b.c" keys) as torch's memory_stats_as_nested_dict() shape:
    {"allocated_bytes": {"all": {"current": ...}}, "num_ooms": ...}."""
    nested: dict[str, Any] = {}
    for key, value in stats.items():
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # "a" and "a.b" both present: keep the flat key
                node = None
                break
            node = child
        if node is None:
            nested[key] = value
        else:
            node[parts[-1]] = value
    return nested
