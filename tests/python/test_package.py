"""The vramledger package on a machine without a GPU: import, option conversion and errors.

Runs against the importable `vramledger` (installed with `pip install --no-build-isolation .`, or
torch_plugin/python on PYTHONPATH with VRAMLEDGER_PLUGIN pointing at a built plugin). Tests that
need the plugin library or torch skip, saying so, where they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import vramledger
from vramledger import _options, _plugin


def run_python(code: str, **env_overrides: str | None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (same sys.path) and returns the finished process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for key, value in env_overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def plugin_available() -> bool:
    try:
        _plugin.plugin_path()
    except RuntimeError:
        return False
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


needs_plugin = pytest.mark.skipif(not plugin_available(),
                                  reason="the torch plugin library or torch is not available")


def test_import_is_light_and_does_not_import_torch():
    r = run_python("""
        import sys, vramledger
        print(vramledger.is_installed(), "torch" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_install_with_a_missing_override_names_it():
    r = run_python("""
        import vramledger
        try:
            vramledger.install()
        except RuntimeError as e:
            print("RuntimeError:", e)
    """, VRAMLEDGER_PLUGIN="/nonexistent/libvramledger_plugin.so")
    assert r.returncode == 0, r.stderr
    assert "RuntimeError: vramledger: VRAMLEDGER_PLUGIN=/nonexistent/libvramledger_plugin.so " \
           "does not exist" in r.stdout


def test_package_without_plugin_imports_and_install_says_why(tmp_path):
    # A copy of the package with no plugin beside it: a CPU-only build (which still has the
    # _core extension, whose option table checks install()'s keywords).
    src = os.path.dirname(vramledger.__file__)
    shutil.copytree(src, tmp_path / "vramledger",
                    ignore=shutil.ignore_patterns("libvramledger_*", "__pycache__"))
    r = run_python(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import vramledger
        assert vramledger.__file__.startswith({str(tmp_path)!r}), vramledger.__file__
        try:
            vramledger.install(max_split_size_mb=200)
        except RuntimeError as e:
            print("RuntimeError:", e)
    """, VRAMLEDGER_PLUGIN=None)
    assert r.returncode == 0, r.stderr
    assert "RuntimeError: vramledger: the torch plugin libvramledger_plugin.so is not installed" \
        in r.stdout
    assert "pip install --no-build-isolation ." in r.stdout


@needs_plugin
def test_install_without_cuda_says_so():
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; tests/gpu covers install()")
    r = run_python("""
        import vramledger
        try:
            vramledger.install()
        except RuntimeError as e:
            print("RuntimeError:", e)
        print(vramledger.is_installed())
    """)
    assert r.returncode == 0, r.stderr
    assert "RuntimeError: vramledger.install(): CUDA is not available" in r.stdout
    assert r.stdout.split()[-1] == "False"


def test_install_mode_is_checked_and_native_needs_cuda_too():
    with pytest.raises(ValueError, match="mode must be None, 'pluggable' or 'native', got 'bogus'"):
        vramledger.install(mode="bogus")
    assert not vramledger.is_installed()
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; tests/gpu covers install(mode='native')")
    r = run_python("""
        import vramledger
        try:
            vramledger.install(mode="native")
        except RuntimeError as e:
            print("RuntimeError:", e)
        print(vramledger.is_installed(), vramledger.installed_mode())
    """)
    assert r.returncode == 0, r.stderr
    assert "RuntimeError: vramledger.install(): CUDA is not available" in r.stdout
    assert r.stdout.split()[-2:] == ["False", "None"]


def test_native_library_becomes_torchs_allocator_before_cuda_starts():
    """The torch-native library is beside the plugin and, loaded into a torch process, becomes
    torch's current CUDA allocator (torch.cuda.get_allocator_backend() names it) without a GPU;
    a second install is refused by name."""
    try:
        _plugin.plugin_path()
    except RuntimeError as e:
        pytest.skip(f"no plugin in this build: {e}")
    r = run_python("""
        import ctypes, torch
        from vramledger import _native, _plugin
        _plugin.load()
        print("before", torch.cuda.get_allocator_backend())
        _native.install()
        print("after", torch.cuda.get_allocator_backend())
        try:
            _native.install()
        except RuntimeError as e:
            print("again:", e)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "before native"
    assert lines[1] == "after vramledger"
    assert lines[2].startswith("again: vramledger.install(mode='native'): ") and "already" in lines[2]


def test_a_second_install_must_repeat_options_and_mode():
    """The same options and mode again is a no-op; another mode is refused naming both modes
    (torch cannot swap its allocator twice)."""
    r = run_python("""
        import vramledger
        vramledger._set_installed("", "", "native")  # as a successful install(mode="native")
        vramledger.install(mode="native")
        print("again: no-op", vramledger.installed_mode())
        vramledger.install()  # no mode: the one installed
        print("no mode: no-op", vramledger.installed_mode())
        try:
            vramledger.install(mode="pluggable")
        except RuntimeError as e:
            print("RuntimeError:", e)
    """, VRAMLEDGER_CONF=None)
    assert r.returncode == 0, r.stderr
    assert "again: no-op native" in r.stdout
    assert "no mode: no-op native" in r.stdout
    assert "(mode 'native')" in r.stdout and "mode 'pluggable')" in r.stdout, r.stdout


def test_native_library_from_another_torch_minor_is_refused_naming_both():
    from vramledger import _native
    _native.check_torch_version("2.11", "2.11")
    with pytest.raises(RuntimeError, match=r"built against torch 2\.10, but torch 2\.11 is running"):
        _native.check_torch_version("2.10", "2.11")
    assert _native.torch_version().count(".") == 1


class _FakeNativeLibrary:
    def __init__(self, version: bytes):
        self.vramledger_native_torch_version = lambda: version


def test_default_mode_is_native_when_the_library_matches_this_torch(monkeypatch):
    import warnings
    from vramledger import _native
    monkeypatch.setattr(_native, "native_path", lambda: "/lib/libvramledger_native.so")
    monkeypatch.setattr(_native, "torch_version", lambda: "2.11")
    monkeypatch.setattr(_native, "_load", lambda path: _FakeNativeLibrary(b"2.11"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        assert _native.default_mode() == "native"
    assert _native.unavailable_reason() is None


def test_default_mode_falls_back_to_pluggable_with_one_warning_naming_both_versions(monkeypatch):
    from vramledger import _native
    monkeypatch.setattr(_native, "native_path", lambda: "/lib/libvramledger_native.so")
    monkeypatch.setattr(_native, "torch_version", lambda: "2.12")
    monkeypatch.setattr(_native, "_load", lambda path: _FakeNativeLibrary(b"2.11"))
    with pytest.warns(RuntimeWarning) as caught:
        assert _native.default_mode() == "pluggable"
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "built against torch 2.11, but torch 2.12 is running" in message
    assert message.endswith("vramledger.install() uses mode='pluggable' instead")
    assert "\n" not in message


def test_default_mode_falls_back_when_the_native_library_is_absent(monkeypatch):
    from vramledger import _native

    def absent():
        raise RuntimeError("vramledger: the torch-native mode's libvramledger_native.so is not "
                           "beside the plugin /x/libvramledger_plugin.so")
    monkeypatch.setattr(_native, "native_path", absent)
    with pytest.warns(RuntimeWarning, match="is not beside the plugin .*mode='pluggable' instead"):
        assert _native.default_mode() == "pluggable"


def test_pluggable_refusals_name_the_native_mode():
    """torch's "does not yet support" from its pluggable allocator gains a line naming
    mode='native', chained to torch's error; other errors and results pass unchanged."""
    from vramledger import _pluggable_limits

    def refused(*args):
        raise RuntimeError("CUDAPluggableAllocator does not yet support createOrIncrefPool. "
                           "If you need it, please file an issue describing your use case.")

    def other(x):
        if x < 0:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 2 * x

    with pytest.raises(RuntimeError) as info:
        _pluggable_limits.wrap(refused, "torch.cuda.MemPool")(1)
    text = str(info.value)
    assert text.startswith("CUDAPluggableAllocator does not yet support createOrIncrefPool")
    assert "does not route torch.cuda.MemPool to" in text
    assert "vramledger.install(mode='native')" in text
    assert isinstance(info.value.__cause__, RuntimeError)
    wrapped = _pluggable_limits.wrap(other, "x")
    assert wrapped(3) == 6 and wrapped.__name__ == "other"
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        wrapped(-1)
    assert "mode='native'" not in str(info.value)


def test_pluggable_limits_wrap_each_entry_point_of_torch_once():
    import types
    from vramledger import _pluggable_limits

    class MemPool:
        def __init__(self):
            raise RuntimeError("CUDAPluggableAllocator does not yet support createOrIncrefPool")

    def checkpoint(*args):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getCheckpointState")

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(memory=types.SimpleNamespace(MemPool=MemPool)),
        _C=types.SimpleNamespace(_cuda_getCheckpointState=checkpoint))
    first = _pluggable_limits.install(fake)
    assert first == ["torch.cuda.memory.MemPool.__init__", "torch._C._cuda_getCheckpointState"]
    init = MemPool.__init__
    assert _pluggable_limits.install(fake) == first and MemPool.__init__ is init  # once
    with pytest.raises(RuntimeError, match="torch.cuda.MemPool to; vramledger.install"):
        MemPool()
    with pytest.raises(RuntimeError, match="CUDA graph trees"):
        fake._C._cuda_getCheckpointState(0, (1, 0))


def test_pluggable_route_refuses_nccl_register_hook_before_torch_aborts(monkeypatch):
    """torch ends the process when ProcessGroupNCCL's register hook meets a pluggable allocator;
    under the pluggable route the group's creation raises first, naming the variable and the
    native mode; without the variable, or with gloo, the call passes unchanged."""
    import types
    from vramledger import _pluggable_limits

    calls = []

    def init_process_group(backend=None, **kwargs):
        calls.append(backend)
        return "group"

    def new_group(ranks=None, timeout=None, backend=None):
        calls.append(backend)
        return "subgroup"

    fake = types.SimpleNamespace(distributed=types.SimpleNamespace(
        init_process_group=init_process_group, new_group=new_group))
    names = _pluggable_limits.install(fake)
    assert "torch.distributed.init_process_group" in names
    assert "torch.distributed.new_group" in names
    monkeypatch.setenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "1")
    for call in (lambda: fake.distributed.init_process_group("nccl"),
                 lambda: fake.distributed.init_process_group(),
                 lambda: fake.distributed.init_process_group(backend="cpu:gloo,cuda:nccl"),
                 lambda: fake.distributed.new_group([0], backend="nccl"),
                 lambda: fake.distributed.new_group([0])):
        with pytest.raises(RuntimeError) as info:
            call()
        assert "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1" in str(info.value)
        assert "vramledger.install(mode='native')" in str(info.value)
    assert calls == []
    assert fake.distributed.init_process_group("gloo") == "group"
    monkeypatch.setenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0")
    assert fake.distributed.init_process_group("nccl") == "group"
    assert fake.distributed.new_group([0]) == "subgroup"
    assert calls == ["gloo", "nccl", None]


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


def test_stats_functions_need_install():
    for fn in (vramledger.memory_stats, vramledger.memory_allocated,
               vramledger.max_memory_allocated, vramledger.memory_reserved,
               vramledger.max_memory_reserved, vramledger.reset_peak_memory_stats,
               vramledger.reset_accumulated_memory_stats):
        with pytest.raises(RuntimeError, match="not installed"):
            fn()
    with pytest.raises(RuntimeError, match="not installed"):
        vramledger.empty_cache()


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


@needs_plugin
def test_device_arguments_follow_torch():
    import torch
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    assert vramledger._device_index(None) == 0
    assert vramledger._device_index(3) == 3
    assert vramledger._device_index("cuda:1") == 1
    assert vramledger._device_index(torch.device("cuda", 2)) == 2
    assert vramledger._device_index("cuda") == 0
    with pytest.raises(ValueError, match="cuda device"):
        vramledger._device_index("cpu")
    with pytest.raises(ValueError, match="cuda device"):
        vramledger._device_index(1.5)
    # -1 is the plugin's "every device": reset_peak_memory_stats(-1) reset them all while
    # memory_stats(-1) raised; a negative index is refused for every call.
    with pytest.raises(ValueError, match="index >= 0, got -1"):
        vramledger._device_index(-1)


def test_a_native_library_without_its_version_guard_falls_back(monkeypatch):
    """A library that loads but does not say which torch it was built for (an older build) is a
    reason to take the pluggable route, not an AttributeError out of install()."""
    import ctypes
    from vramledger import _native
    monkeypatch.setattr(_native, "native_path", lambda: "/lib/libvramledger_native.so")
    monkeypatch.setattr(ctypes, "CDLL", lambda path: object())
    with pytest.warns(RuntimeWarning, match="does not say which torch it was built against"):
        assert _native.default_mode() == "pluggable"
