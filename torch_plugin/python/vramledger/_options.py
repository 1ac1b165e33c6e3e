"""Allocator options: install()'s keyword arguments as a `key:value,...` settings string.

Pure Python and torch-free. KNOWN_KEYS mirrors OptionTable() in allocator/core/options.cc;
tests/python/test_package.py checks the two agree whenever the plugin library is present.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

# Torch's PYTORCH_CUDA_ALLOC_CONF keys (same meaning), then vramledger's own.
KNOWN_KEYS: tuple[str, ...] = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "expandable_segments",
    "large_segment_size_mb",
    "roundup_power2_divisions",
    "release_lock_on_cudamalloc",
    "per_process_memory_fraction",
    "backend",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "page_recycling",
    "expandable_page_mb",
    "recycle_slack",
    "expandable_handle_mb",
    "recycle_tails_first",
    "keep_old_mappings",
    "host_timing",
    "plan",
    "dump_dir",
    "max_dumps",
    "step_log",  # issue 6: per-step peak logs
)

# Characters the settings syntax reserves (it also drops whitespace), so a string value
# containing one could not round-trip.
_RESERVED = set(",[]") | set(" \t\r\n")


def _format_scalar(key: str, value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        bad = sorted(set(value) & _RESERVED)
        if bad or not value:
            raise ValueError(
                f"vramledger option {key!r}: value {value!r} cannot be written in the settings "
                f"syntax (empty, or contains {''.join(bad)!r})")
        return value
    raise ValueError(f"vramledger option {key!r}: unsupported value {value!r} of type "
                     f"{type(value).__name__} (use bool, int, float, str, list or dict)")


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, Mapping):
        # e.g. roundup_power2_divisions={256: 1, 512: 2, ">": 4} -> [256:1,512:2,>:4]
        items = [f"{_format_scalar(key, k)}:{_format_scalar(key, v)}" for k, v in value.items()]
        return "[" + ",".join(items) + "]"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_scalar(key, v) for v in value) + "]"
    return _format_scalar(key, value)


def to_conf_string(options: Mapping[str, Any]) -> str:
    """Converts install()'s keyword arguments to a settings string, keys sorted.

    Booleans become True/False (torch's spelling), lists and dicts become [a,b] and [k:v,...].
    Values are checked by the C++ parser when the plugin is configured.

    Raises:
      ValueError: an unknown key (the message names it and lists the accepted keys) or a value
        that cannot be written in the `key:value,...` syntax.
    """
    unknown = sorted(k for k in options if k not in KNOWN_KEYS)
    if unknown:
        near = difflib.get_close_matches(unknown[0].lower(), KNOWN_KEYS, n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]!r}?)" if near else ""  # as the C++ parser's
        raise ValueError(f"unknown vramledger option {unknown[0]!r}{hint}; accepted keys: "
                         + ", ".join(KNOWN_KEYS))
    return ",".join(f"{k}:{_format_value(k, options[k])}" for k in sorted(options))
