"""Options: install()'s keyword arguments as a `key:value,...` settings string.

Torch-free. The accepted keys come from the C++ option tables (allocator/core/option_tables.cc)
through the compiled extension vramledger._core, so there is no second list to keep in step.
`python -m vramledger._options --markdown` prints docs/options.md as those tables generate it.
"""

from __future__ import annotations

import difflib
import functools
import sys
from typing import Any, Mapping


def _core_module():
    try:
        from vramledger import _core  # the C++ extension (tools/python_module.cc)
    except ImportError as e:
        raise RuntimeError(
            "vramledger's option table is in its C++ extension vramledger._core, which does not "
            f"import ({e}); install the package with `pip install --no-build-isolation .` from "
            "the source tree") from e
    return _core


@functools.cache
def option_table() -> tuple[dict[str, str], ...]:
    """Every accepted option as a dict (name, table, type, default, accepted, help, env).

    Raises:
      RuntimeError: the compiled extension vramledger._core is missing (the package was not
        installed with `pip install --no-build-isolation .`, e.g. a source folder on PYTHONPATH).
    """
    return tuple(_core_module().option_table())


def markdown() -> str:
    """docs/options.md as the C++ option tables generate it. RuntimeError as option_table()."""
    return _core_module().options_markdown()


@functools.cache
def known_keys() -> tuple[str, ...]:
    """The accepted keys, in the order errors list them (the allocator's, then the process's).

    Read from the C++ table through vramledger._core, or, where the package runs from its source
    folder without _core (the GPU checks), through the loaded plugin's C ABI
    (vramledger_option_names), which reads the same table.

    Raises:
      RuntimeError: neither _core nor the plugin loads.
    """
    try:
        return tuple(row["name"] for row in option_table())
    except RuntimeError as core_error:
        try:
            from vramledger import _plugin
            return tuple(_plugin.option_names())
        except Exception as plugin_error:  # the plugin's own load errors vary (OSError, ...)
            raise RuntimeError(f"{core_error}; the plugin's option list is not available either "
                               f"({plugin_error})") from core_error


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
      RuntimeError: `options` is not empty and the option table cannot be read (known_keys()).
    """
    if not options:
        return ""
    keys = known_keys()
    unknown = sorted(k for k in options if k not in keys)
    if unknown:
        near = difflib.get_close_matches(unknown[0].lower(), keys, n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]!r}?)" if near else ""  # as the C++ parser's
        raise ValueError(f"unknown vramledger option {unknown[0]!r}{hint}; accepted keys: "
                         + ", ".join(keys))
    return ",".join(f"{k}:{_format_value(k, options[k])}" for k in sorted(options))


def _main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m vramledger._options --markdown   (prints docs/options.md)",
              file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
