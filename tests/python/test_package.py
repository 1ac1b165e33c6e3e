"""The vramledger package on a machine without a GPU: import, install() and its errors, device
arguments. Its options: test_package_options.py; the route install() takes: test_package_modes.py.

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
from vramledger import _plugin


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


def test_stats_functions_need_install():
    for fn in (vramledger.memory_stats, vramledger.memory_allocated,
               vramledger.max_memory_allocated, vramledger.memory_reserved,
               vramledger.max_memory_reserved, vramledger.reset_peak_memory_stats,
               vramledger.reset_accumulated_memory_stats):
        with pytest.raises(RuntimeError, match="not installed"):
            fn()
    with pytest.raises(RuntimeError, match="not installed"):
        vramledger.empty_cache()


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
