"""install()'s keywords: the settings string they become, the C++ option table that checks them
(through _core, or the plugin's C ABI without it), and the errors that name a bad key or value.
"""

from __future__ import annotations

import os

import pytest

import vramledger
from vramledger import _options, _plugin

from test_package import needs_plugin, run_python


@pytest.mark.parametrize("options, expected", [
    ({}, ""),
    ({"max_split_size_mb": 200}, "max_split_size_mb:200"),
    ({"expandable_segments": False, "max_split_size_mb": 200},
     "expandable_segments:False,max_split_size_mb:200"),
    ({"expandable_segments": True}, "expandable_segments:True"),
    ({"garbage_collection_threshold": 0.6}, "garbage_collection_threshold:0.6"),
    ({"roundup_power2_divisions": 4}, "roundup_power2_divisions:4"),
    ({"roundup_power2_divisions": [1, 2, 4]}, "roundup_power2_divisions:[1,2,4]"),
    ({"roundup_power2_divisions": {256: 1, 512: 2, ">": 4}},
     "roundup_power2_divisions:[256:1,512:2,>:4]"),
    ({"dump_dir": "/tmp/dumps", "page_recycling": False},
     "dump_dir:/tmp/dumps,page_recycling:False"),
])
def test_options_become_a_sorted_settings_string(options, expected):
    assert _options.to_conf_string(options) == expected


def test_unknown_key_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="unknown vramledger option 'max_split_mb'"):
        _options.to_conf_string({"max_split_mb": 200})
    with pytest.raises(ValueError, match=r"'expandable_segment' \(did you mean "
                                         r"'expandable_segments'\?\); accepted keys: "):
        _options.to_conf_string({"expandable_segment": True})
    # install() checks keys before it touches torch or the plugin.
    with pytest.raises(ValueError, match=r"^vramledger\.install\(\): unknown vramledger option "
                                         r"'no_such_option'"):
        vramledger.install(no_such_option=1)
    assert not vramledger.is_installed()


@pytest.mark.parametrize("value", [None, object(), "a,b", "two words", "", 1j])
def test_values_the_syntax_cannot_carry_are_value_errors(value):
    with pytest.raises(ValueError, match="'dump_dir'"):
        _options.to_conf_string({"dump_dir": value})


def test_python_keys_are_the_cpp_option_table():
    """install()'s keyword check reads the C++ tables through _core: both tables, in order."""
    core = pytest.importorskip("vramledger._core")
    table = _options.option_table()
    assert [row["name"] for row in table] == [row["name"] for row in core.option_table()]
    assert _options.known_keys()[:2] == ("max_split_size_mb", "max_non_split_rounding_mb")
    by_name = {row["name"]: row for row in table}
    assert by_name["expandable_segments"]["table"] == "allocator"
    assert by_name["expandable_segments"]["default"] == "False"
    assert by_name["dump_dir"]["table"] == "process"
    assert by_name["preload_quiet"]["env"] == "VRAMLEDGER_PRELOAD_QUIET"
    assert all(row["help"] and row["type"] and row["accepted"] for row in table)
    assert not hasattr(_options, "KNOWN_KEYS")  # one list only, the C++ one


def test_process_options_are_install_keywords():
    assert (_options.to_conf_string({"step_log": "/tmp/steps", "preload_quiet": True})
            == "preload_quiet:True,step_log:/tmp/steps")


def test_options_markdown_is_docs_options_md():
    pytest.importorskip("vramledger._core")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "options.md")
    with open(path, encoding="utf-8") as f:
        assert f.read() == _options.markdown(), \
            "regenerate: python -m vramledger._options --markdown > docs/options.md"


_WITHOUT_CORE = """
    import sys
    sys.modules["vramledger._core"] = None  # as if the extension were not built
    from vramledger import _options
    print(repr(_options.to_conf_string({})))
    try:
        print(_options.to_conf_string({"expandable_segments": True}))
        _options.to_conf_string({"expandable_segment": True})
    except (RuntimeError, ValueError) as e:
        print(type(e).__name__ + ":", e)
"""


@needs_plugin
def test_without_core_the_keyword_check_reads_the_plugins_c_abi():
    """The package from a source folder (no compiled _core), as the GPU checks run it: the keys
    come from the loaded plugin's C ABI, which reads the same C++ table."""
    r = run_python(_WITHOUT_CORE)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == ["''", "expandable_segments:True"], r.stdout
    assert lines[2].startswith("ValueError: unknown vramledger option 'expandable_segment' "
                               "(did you mean 'expandable_segments'?)"), r.stdout


def test_without_core_or_plugin_the_keyword_check_says_what_is_missing(tmp_path):
    """Neither _core nor the plugin: keywords are refused with a message naming both; install()
    without keywords needs no table."""
    r = run_python(_WITHOUT_CORE, VRAMLEDGER_PLUGIN=str(tmp_path / "missing.so"))
    assert r.returncode == 0, r.stderr
    assert "''" in r.stdout
    assert "RuntimeError: vramledger's option table is in its C++ extension vramledger._core" \
        in r.stdout, r.stdout
    assert "the plugin's option list is not available either" in r.stdout, r.stdout


@needs_plugin
def test_cpp_and_python_option_tables_agree():
    # The plugin's key list and _core's come from the same C++ tables.
    assert _plugin.option_names() == list(_options.known_keys())


@needs_plugin
def test_cpp_parser_errors_name_the_key():
    with pytest.raises(ValueError, match="expandable_segments"):
        _plugin.configure("expandable_segments:yes")
    with pytest.raises(ValueError, match="max_split_size_mb"):
        _plugin.configure(_options.to_conf_string({"max_split_size_mb": "lots"}))
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        _plugin.configure("bogus:1")
    _plugin.configure("max_split_size_mb:200,expandable_segments:False")


@needs_plugin
def test_environment_settings_are_validated():
    r = run_python("""
        from vramledger import _plugin
        try:
            _plugin.configure("")
        except ValueError as e:
            print("ValueError:", e)
    """, VRAMLEDGER_CONF="bogus_env_key:1")
    assert r.returncode == 0, r.stderr
    assert "ValueError:" in r.stdout and "bogus_env_key" in r.stdout
